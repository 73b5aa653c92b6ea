"""asv benchmarks for fastckpt (run from asv_bench/: ``asv run --quick --python=same -E existing``)."""
