"""asv benchmarks for fastckpt, one module per ``fastckpt bench`` suite (``bench_<suite>.py``).

Run from ``asv_bench/`` with the checkout on asv's path (asv drops ``PYTHONPATH``; ``ASV_PYTHONPATH`` is what it
passes on): ``ASV_PYTHONPATH=$PWD/.. asv run --quick --python=same``. ``tools/asv-check.sh`` compares a commit
with its parent.
"""
