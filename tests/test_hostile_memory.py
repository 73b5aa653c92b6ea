"""Memory stays linear in the input: peak RSS measured in a fresh interpreter (ru_maxrss), with generous bounds.

- A TensorFlow index whose keys each extend the one before by a byte is stored in linear space but decodes
  to n**2 / 2 key bytes: 20,000 such keys (400 KB of index) took 576 MiB to open. It is refused now, with a
  FormatError, in a few MiB.
- A DEFLATE NPZ member that compresses 1000:1 was inflated into one bytes object and copied from it: a peak
  of 3x the member (256 MiB member: 763 MiB). It is inflated into the array in 16 MiB pieces now: ~1x.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(code: str, *args) -> str:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-W", "ignore", "-c", textwrap.dedent(code), *map(str, args)], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


PREFIX_KEYS = '''
    import os, resource, sys
    import crc32c
    from fastckpt._native.tftable import mask_crc
    from fastckpt.errors import FormatError
    from fastckpt.formats.tf.proto import BundleHeader, encode_entry, encode_header
    from fastckpt.formats.tf import table
    from fastckpt.formats.tf.table import TableBuilder
    from fastckpt._native.mapped import MappedFile
    from fastckpt.tf import CheckpointReader

    table._shared_prefix = lambda a, b: len(a) if b.startswith(a) else 0  # what these keys share, in C time

    prefix, n, walk = os.path.join(sys.argv[1], "m"), int(sys.argv[2]), sys.argv[3]
    open(prefix + ".data-00000-of-00001", "wb").write(bytes(4))
    value = encode_entry(1, (1,), offset=0, size=4, crc32c=mask_crc(crc32c.crc32c(bytes(4))))
    with open(prefix + ".index", "wb") as f:  # one block, one restart: every key shares all of the one before
        b = TableBuilder(f, block_size=1 << 40, restart_interval=1 << 30)
        b.add(b"", encode_header(BundleHeader()))
        for k in range(1, n + 1):
            b.add(b"k" * k, value)
        b.finish()
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        if walk == "reader":  # the bundle index CheckpointReader builds
            with CheckpointReader(prefix) as r:
                outcome = f"opened {len(r.keys())}"
        else:  # the Python-level table walk (IndexTable.items: `fastckpt inspect`, the fuzzers)
            with MappedFile(prefix + ".index") as m:
                outcome = f"opened {len(table.IndexTable(m).items())}"
    except FormatError as e:
        outcome = f"FormatError {e}"
    grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base
    print(grew // 1024, os.path.getsize(prefix + ".index"), outcome)
'''


def test_tf_index_of_keys_that_each_extend_the_last_is_refused_in_linear_memory(tmp_path):
    grew_mib, index_size, outcome = _run(PREFIX_KEYS, tmp_path, 20000, "reader").split(" ", 2)
    assert int(index_size) < 500_000
    assert outcome.startswith("FormatError "), outcome
    assert f"{tmp_path}" in outcome and "quadratic" in outcome and "entry at byte" in outcome, outcome
    assert int(grew_mib) < 64, f"opening a {index_size}-byte index took {grew_mib} MiB"  # was 576 MiB


def test_tf_index_of_a_thousand_extending_keys_still_opens(tmp_path):
    # 1,000 keys of up to 1,000 bytes: 0.5 MB of keys from a 20 KB index, within the 64x + 1 MiB allowance.
    grew_mib, _, outcome = _run(PREFIX_KEYS, tmp_path, 1000, "reader").split(" ", 2)
    assert outcome.strip() == "opened 1000"
    assert int(grew_mib) < 64


INFLATE = '''
    import os, resource, sys
    import numpy as np
    import fastckpt

    p, n = os.path.join(sys.argv[1], "z.npz"), int(sys.argv[2]) << 20
    expected = np.zeros(n, np.uint8)
    expected[::4097] = 7
    np.savez_compressed(p, z=expected)
    del expected
    with fastckpt.open(p) as f:
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        a = f.host("z")
        grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base
    check = np.zeros(n, np.uint8)
    check[::4097] = 7
    print(grew * 1024 / n, os.path.getsize(p), np.array_equal(a, check))
'''


def test_deflate_member_inflates_with_a_peak_of_about_the_member(tmp_path):
    ratio, compressed, same = _run(INFLATE, tmp_path, 128).split()
    assert same == "True"
    assert int(compressed) < (1 << 20)  # compresses ~1000:1, the case that inflated whole into one bytes object
    assert float(ratio) < 1.6, f"peak {float(ratio):.2f}x the member"  # was 2.98x; now ~1x + two 16 MiB pieces


def test_index_table_items_refuse_keys_past_the_budget(tmp_path):
    # IndexTable.items keeps one budget across its blocks: 4,000 keys of up to 4,000 bytes (8 MB) from an 80 KB
    # index exceed 64x + 1 MiB.
    grew_mib, _, outcome = _run(PREFIX_KEYS, tmp_path, 4000, "table").split(" ", 2)
    assert outcome.startswith("FormatError ") and "data block 0" in outcome and "quadratic" in outcome, outcome
    assert int(grew_mib) < 64
