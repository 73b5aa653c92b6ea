"""One pinned commit for every reader of several files (fastckpt.store.snapshot): torn reads, descriptor limits.

Each multi-file layout (fastckpt's sharded and RecIS layouts, Hugging Face directories, TensorFlow prefixes, training checkpoints) is
read while another process replaces it in a loop with ``overwrite=True``: every read
returns exactly one commit, or raises CheckpointChangedError; nothing else. A child process under
``RLIMIT_NOFILE`` 256 loads checkpoints of more files than that.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
import warnings

import numpy as np
import pytest

import fastckpt
from fastckpt.errors import CheckpointChangedError, CheckpointNotFoundError, FormatError
from fastckpt.store import snapshot as snapshot_module
from fastckpt.store.snapshot import Snapshot

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TENSORS = 12  # one per file where the layout allows it: the more files, the more chances to tear


def commit_arrays(k: int) -> dict[str, np.ndarray]:
    """Commit ``k``'s tensors: every value of every tensor is k, so a read mixing commits shows it."""
    return {f"w{i:02d}": np.full((64, 8), k, np.float32) for i in range(TENSORS)}


# -- the layouts: a writer (run in a child process, overwrite=True) and a reader of the whole commit ---------------

WRITERS = {
    "sharded": """
        from fastckpt.sharded import Saver
        def save(path, k):
            Saver(path=path, parallel=6, tensors=commit_arrays(k), overwrite=True).save()
    """,
    "recis": """
        from fastckpt.sharded import Saver
        def save(path, k):
            Saver(path=path, parallel=6, tensors=commit_arrays(k), overwrite=True, layout="recis").save()
    """,
    "hf": """
        from fastckpt.formats.hfsharded import save_sharded
        def save(path, k):
            save_sharded(path, commit_arrays(k), max_shard_size=4096, overwrite=True)
    """,
    "tf": """
        from fastckpt.tf import write_checkpoint
        def save(path, k):
            write_checkpoint(path, commit_arrays(k), num_shards=4, overwrite=True)
    """,
    "training": """
        from fastckpt.train import save_checkpoint
        def save(path, k):
            save_checkpoint(commit_arrays(k), None, None, None, None, path, step=k, overwrite=True)
    """,
}


def read_whole(layout: str, path: str) -> dict[str, np.ndarray]:
    """Every tensor of the checkpoint at ``path``, copied, through the layout's reader."""
    if layout in ("sharded", "recis"):
        from fastckpt.sharded import CheckpointReader

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with CheckpointReader(path, verify=True) as reader:
                names = [n.removesuffix("^ ") if layout == "recis" else n for n in reader.tensor_names()]
                return {name: np.array(reader.read_tensor(name)) for name in names}
    with fastckpt.open(path) as reader:
        # A training checkpoint names the model's tensors under its slot ("weights/w00").
        prefix = "weights/" if layout == "training" else ""
        return {name.removeprefix(prefix): np.array(reader.host(name)) for name in reader.keys()}


def load_whole(layout: str, path: str) -> dict[str, np.ndarray]:
    """Every tensor through the sharded Loader (its preadv path)."""
    from fastckpt.sharded import Loader

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return dict(Loader(path, shard_index=0, shard_num=1, verify=True).load()[1])


def _writer_script(layout: str, path: str, stop: str, saves: int) -> str:
    return textwrap.dedent(f"""
        import os, sys, warnings
        sys.path.insert(0, {os.path.join(ROOT, 'tests')!r})
        import numpy as np
        warnings.simplefilter("ignore")
        from test_snapshot import commit_arrays
    """) + textwrap.dedent(WRITERS[layout]) + textwrap.dedent(f"""
        for n in range({saves}):
            if os.path.exists({stop!r}):
                break
            save({path!r}, 1 + n % 2)
    """)


def torn_reads(layout: str, tmp_path, seconds: float, read) -> dict[str, int]:
    """Read ``layout`` with ``read`` for ``seconds`` while a child process replaces it; counts of each outcome.
    A read that is not exactly commit 1 or commit 2 fails the test at once."""
    path, stop = str(tmp_path / "ckpt"), str(tmp_path / "stop")
    exec(compile(textwrap.dedent(WRITERS[layout]), "writer", "exec"), namespace := {"commit_arrays": commit_arrays})
    namespace["save"](path, 1)
    want = {k: commit_arrays(k) for k in (1, 2)}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    writer = subprocess.Popen([sys.executable, "-c", _writer_script(layout, path, stop, 10**6)], env=env)
    counts = {"exact": 0, "changed": 0, "absent": 0}
    try:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and writer.poll() is None:
            try:
                got = read(layout, path)
            except CheckpointChangedError:
                counts["changed"] += 1
                continue
            except CheckpointNotFoundError:
                # Hugging Face's and TensorFlow's saves move the previous index aside before the new files go in
                # (index last): between the two the prefix holds no checkpoint, and says so (no read returns data).
                assert layout in ("hf", "tf"), "a directory replaced whole is never absent"
                counts["absent"] += 1
                continue
            values = {float(a.reshape(-1)[0]) if a.size else None for a in got.values()}
            assert len(values) == 1, f"read {len(got)} tensors of commits {sorted(values)}: a torn read"
            k = int(values.pop())
            assert set(got) == set(want[k]) and all(np.array_equal(got[n], want[k][n]) for n in got)
            counts["exact"] += 1
    finally:
        open(stop, "w").close()
        writer.wait(60)
    assert writer.returncode == 0, "the writer failed"
    assert counts["exact"] > 0
    return counts


@pytest.mark.parametrize("layout", sorted(WRITERS))
def test_a_read_during_overwrite_is_one_commit_or_changed(layout, tmp_path):
    counts = torn_reads(layout, tmp_path, 1.5, read_whole)
    print(layout, counts)


@pytest.mark.parametrize("layout", ["sharded", "recis"])
def test_a_load_during_overwrite_is_one_commit_or_changed(layout, tmp_path):
    """The Loader (preadv through the bounded descriptor cache) too: never FormatError 'missing'."""
    counts = torn_reads(layout, tmp_path, 1.5, load_whole)
    print(layout, counts)


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(WRITERS))
def test_many_reads_during_overwrite_are_one_commit_or_changed(layout, tmp_path):
    counts = torn_reads(layout, tmp_path, 60.0, read_whole)
    print(layout, counts)


# -- the snapshot itself ------------------------------------------------------------------------------------------

def test_a_file_replaced_after_pinning_is_changed_and_named(tmp_path):
    (tmp_path / "manifest.json").write_bytes(b"{}")
    (tmp_path / "a.bin").write_bytes(b"abcd")
    with Snapshot(tmp_path, record="manifest.json") as snap:
        snap.read_json("manifest.json")
        snap.pin("a.bin", size=4)
        (tmp_path / "a.new").write_bytes(b"wxyz")
        os.replace(tmp_path / "a.new", tmp_path / "a.bin")
        with pytest.raises(CheckpointChangedError, match=r"a\.bin: now another file .*changed while it was opened"):
            snap.read_into("a.bin", bytearray(2), 0)


def test_a_missing_file_is_damage_unless_the_record_changed(tmp_path):
    (tmp_path / "manifest.json").write_bytes(b"{}")
    with Snapshot(tmp_path, record="manifest.json") as snap:
        snap.read("manifest.json")
        with pytest.raises(FormatError, match="b.bin: missing; the checkpoint lists it") as info:
            snap.pin("b.bin")
        assert not isinstance(info.value, CheckpointChangedError)
        os.unlink(tmp_path / "manifest.json")
        with pytest.raises(CheckpointChangedError, match="b.bin: gone .its manifest.json is gone"):
            snap.pin("b.bin")


def test_a_size_other_than_the_record_is_changed(tmp_path):
    (tmp_path / "a.bin").write_bytes(b"abc")
    with Snapshot(tmp_path) as snap, pytest.raises(CheckpointChangedError, match="3 bytes, the commit record says 4"):
        snap.pin("a.bin", size=4)


def test_links_are_refused_unless_followed(tmp_path):
    (tmp_path / "blob").write_bytes(b"abcd")
    os.symlink("blob", tmp_path / "a.bin")
    with Snapshot(tmp_path) as snap, pytest.raises(FormatError, match="a.bin: a symbolic link"):
        snap.pin("a.bin")
    with Snapshot(tmp_path, follow_links=True) as snap:
        assert snap.pin("a.bin").size == 4


def test_descriptors_stay_bounded_and_are_closed(tmp_path):
    for i in range(3 * snapshot_module.MAX_OPEN):
        (tmp_path / f"f{i}").write_bytes(bytes([i % 256]) * 8)
    before = len(os.listdir("/proc/self/fd"))
    with Snapshot(tmp_path) as snap:
        for i in range(3 * snapshot_module.MAX_OPEN):
            buf = bytearray(1)
            snap.read_into(f"f{i}", buf, 3)
            assert buf[0] == i % 256
        assert snapshot_module.open_descriptors() <= snapshot_module.MAX_OPEN
        assert len(os.listdir("/proc/self/fd")) - before <= snapshot_module.MAX_OPEN + 1
    assert len(os.listdir("/proc/self/fd")) == before


def test_a_short_file_is_a_format_error_naming_it(tmp_path):
    (tmp_path / "a.bin").write_bytes(b"ab")
    with Snapshot(tmp_path) as snap, pytest.raises(FormatError, match=r"a.bin: ends inside tensor 'w' \(read 1 of 4"):
        snap.read_into("a.bin", bytearray(4), 1, "tensor 'w'")


# -- descriptor limits: a child process under RLIMIT_NOFILE 256 ----------------------------------------------------

_LIMITED = """
import resource, sys, warnings
resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
import numpy as np, fastckpt
from fastckpt.sharded import CheckpointReader, Loader
kind, path, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
if kind == "hf":
    with fastckpt.open(path) as r:
        got = {k: float(r.host(k)[0]) for k in r.keys()}
elif kind == "sharded-reader":
    with CheckpointReader(path) as r:
        got = {k: float(r.read_tensor(k)[0]) for k in r.tensor_names()}
else:
    got = {k: float(v[0]) for k, v in Loader(path, shard_index=0, shard_num=1).load()[1].items()}
assert got == {f"t{i:05d}": float(i) for i in range(n)}, "wrong values"
print("ok", len(got))
"""


def _many_files(kind: str, path, n: int) -> None:
    tensors = {f"t{i:05d}": np.full(4, i, np.float32) for i in range(n)}
    if kind == "hf":
        from fastckpt.formats.hfsharded import save_sharded

        save_sharded(str(path), tensors, max_shard_size=16, overwrite=True)
        assert len([f for f in os.listdir(path) if f.endswith(".safetensors")]) == n
    else:
        from _sharded_edit import save_threads

        ranks = max(4, -(-n // 500))  # at most 999 files a rank
        assert n % ranks == 0
        save_threads(path, [{}] * ranks, tensors, parallel=n // ranks)


def _load_limited(kind: str, path, n: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", _LIMITED, kind, str(path), str(n)], capture_output=True, text=True,
                          env=env, timeout=600)


@pytest.mark.parametrize("kind,n", [(kind, 400) for kind in ("hf", "sharded-reader", "sharded-loader")] + [
    pytest.param(kind, n, marks=pytest.mark.slow) for kind in ("hf", "sharded-loader") for n in (1200, 10_000)])
def test_more_files_than_descriptors_load(kind, n, tmp_path_factory):
    """More files than the limit of 256 descriptors: 400 by default (0.3 failed with EMFILE from 257 files under
    this limit, and from 1,025 under the common ulimit -n 1024), 1,200 and 10,000 under -m slow."""
    path = tmp_path_factory.mktemp(kind.split("-")[0]) / "c"
    _many_files(kind.split("-")[0], path, n)
    done = _load_limited(kind, path, n)
    assert done.returncode == 0 and f"ok {n}" in done.stdout, done.stderr[-2000:]


# -- a replacement at a chosen moment: deterministic forms of the races above --------------------------------------

def _replace_dir(path: str, k: int, layout: str) -> None:
    """Replace the checkpoint at ``path`` with commit ``k`` as a save with overwrite=True does."""
    namespace = {"commit_arrays": commit_arrays}
    exec(compile(textwrap.dedent(WRITERS[layout]), "writer", "exec"), namespace)
    namespace["save"](path, k)


def test_hf_shards_replaced_while_opening_are_changed_not_mixed(tmp_path, monkeypatch):
    """0.3: the reader mapped the first shard of commit 1, then the rest of commit 2 (a torn read, no error)."""
    import fastckpt.formats.hfsharded as hf

    path = str(tmp_path / "hf")
    _replace_dir(path, 1, "hf")
    real, calls = hf.open_file, []

    def open_then_replace(*args, **kwargs):
        f = real(*args, **kwargs)
        calls.append(1)
        if len(calls) == 1:
            _replace_dir(path, 2, "hf")
        return f

    monkeypatch.setattr(hf, "open_file", open_then_replace)
    with pytest.raises(CheckpointChangedError, match="changed while it was opened"):
        read_whole("hf", path)
    monkeypatch.setattr(hf, "open_file", real)
    assert {float(a[0, 0]) for a in read_whole("hf", path).values()} == {2.0}


@pytest.mark.parametrize("layout", ["sharded", "recis"])
def test_a_directory_replaced_while_its_metadata_is_read_is_changed(layout, tmp_path, monkeypatch):
    """0.3: the manifest came from the old directory, the next metadata file was gone with it: FormatError
    'missing' (fastckpt's layout); RecIS's reader read by path and, with verify=True, called the other commit's
    files damaged."""
    import blake3

    import fastckpt.sharded.format as sharded_format
    import fastckpt.sharded.recis as recis

    path = str(tmp_path / "c")
    _replace_dir(path, 1, layout)
    calls = []

    class Hashing:  # the readers hash each metadata file they read: replace the directory at the first
        def __getattr__(self, name):
            return getattr(blake3, name)

        @staticmethod
        def blake3(*args, **kwargs):
            calls.append(1)
            if len(calls) == 1:
                os.rename(path, path + ".old")
                import shutil

                shutil.rmtree(path + ".old")
                _replace_dir(path, 2, layout)
            return blake3.blake3(*args, **kwargs)

    monkeypatch.setattr(sharded_format, "blake3", Hashing())
    monkeypatch.setattr(recis, "blake3", Hashing())
    with pytest.raises(CheckpointChangedError, match="changed while it was opened"):
        read_whole(layout, path)
    calls.clear()
    with pytest.raises(CheckpointChangedError, match="changed while it was opened"):
        load_whole(layout, path)


def test_tf_shards_replaced_after_opening_are_changed_not_read(tmp_path):
    """A TensorFlow reader maps its data shards when a tensor is first read: a save with overwrite=True between
    the open and that read is CheckpointChangedError (0.3 read the new shards through the old index)."""
    from fastckpt.tf import write_checkpoint

    prefix = str(tmp_path / "m")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        write_checkpoint(prefix, commit_arrays(1), num_shards=3, overwrite=True)
        reader = fastckpt.open(prefix)
        write_checkpoint(prefix, commit_arrays(2), num_shards=3, overwrite=True)
    with reader, pytest.raises(CheckpointChangedError, match=r"m\.data-0000\d-of-00003: now another file"):
        [reader.host(name) for name in reader.keys()]
    with fastckpt.open(prefix) as again:
        assert {float(again.host(n)[0, 0]) for n in again.keys()} == {2.0}


def test_a_manifest_size_sizes_no_read_and_verify_says_so(tmp_path):
    """0.3: a resealed manifest giving a metadata file 10**30 bytes raised OverflowError from a read of that size
    (MemoryError for 2**40), and `fastckpt verify` printed a traceback."""
    import io
    import json
    from argparse import Namespace

    from fastckpt.cli.verify import run as verify_cli
    from fastckpt.sharded import CheckpointReader, Saver
    from fastckpt.sharded.format import MANIFEST_FILE, dumps, seal

    for size in (10 ** 30, 2 ** 40):
        path = tmp_path / f"c{size}"
        Saver(path=str(path), parallel=2, tensors=commit_arrays(1)).save()
        manifest = json.loads((path / MANIFEST_FILE).read_bytes())
        for name in ("index.json", "model-00000-001.safetensors"):
            manifest["files"][name]["size"] = size
            (path / MANIFEST_FILE).write_bytes(dumps(seal({k: v for k, v in manifest.items() if k != "checksum"})))
            with pytest.raises(FormatError, match=f"{size}"):
                CheckpointReader(path)
            out = io.StringIO()
            assert verify_cli(Namespace(directory=str(path), no_hash=False, quiet=False), out) == 1
            assert "Traceback" not in out.getvalue() and str(size) in out.getvalue()


_CHAIN = """
import resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
from fastckpt.sharded import Loader
tables, _ = Loader(sys.argv[1], shard_index=0, shard_num=1).load()
ids, values, _ = tables["emb"].rows()
print("ok", len(ids), float(values[ids == 0][0, 0]))
"""


def _delta_chain(root, links: int, files: int) -> str:
    """A full checkpoint and ``links - 1`` deltas on it, each of 2 ranks x ``files // 2`` files; id 0's row is
    the link's number at the head."""
    from _sharded_edit import save_threads
    from fastckpt.sharded import DeltaPolicy, HashTable

    tables = []
    for rank in range(2):
        emb = HashTable(2, name="emb")
        ids = np.arange(rank, 64, 2, dtype=np.int64)
        emb.insert(ids, np.zeros((len(ids), 2), np.float32))
        tables.append({"emb": emb})
    path = ""
    for link in range(links):
        tables[0]["emb"].update([0], [[float(link), 0.0]])
        path = save_threads(root / f"step-{link}", tables, {"w": np.ones(4, np.float32)}, parallel=files // 2,
                            incremental=DeltaPolicy(max_fraction=1.0) if link else False)
    return path


@pytest.mark.parametrize("links,files", [(4, 96)] + [pytest.param(10, 96, marks=pytest.mark.slow)])
def test_a_delta_chain_of_more_files_than_descriptors_loads(links, files, tmp_path):
    """0.3 kept a descriptor for every file of every link: a 10-link chain of 96-file checkpoints failed with
    EMFILE under ulimit -n 1024 (and 4 links under 256)."""
    head = _delta_chain(tmp_path, links, files)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", _CHAIN, head], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0 and done.stdout.split() == ["ok", "64", f"{links - 1}.0"], done.stderr[-2000:]
