"""Sharded loads return the saved state or a library error: hashes checked by default, the manifest checked by its
own checksum and against every other file, hostile numbers refused at once, readers that see one commit."""

from __future__ import annotations

import io
import json
import os
import shutil
from argparse import Namespace
from pathlib import Path

import numpy as np
import pytest

from _sharded_edit import loaded_bytes, reseal, save_threads, small_chain
from fastckpt.cli.verify import run as verify_cli
from fastckpt.errors import ChecksumMismatchError, FormatError
from fastckpt.sharded import CheckpointReader, HashTable, Loader
from fastckpt.sharded.format import DESCRIPTION_FILE, MANIFEST_FILE
from fastckpt.sharded.reader import CheckpointChangedError

GOLDEN_OLD = Path(__file__).parent / "data" / "golden" / "sharded-0.2.0"


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    root = tmp_path_factory.mktemp("chain")
    full, delta = small_chain(root)
    return root, full, delta


def _copy(chain, tmp_path) -> tuple[Path, Path]:
    root = tmp_path / "c"
    shutil.copytree(chain[0], root)
    return root / "full", root / "delta"


def _verify_output(path) -> tuple[int, str]:
    out = io.StringIO()
    return verify_cli(Namespace(directory=str(path), no_hash=False, quiet=False), out), out.getvalue()


def _edit_json(path: Path, edit) -> None:
    data = json.loads(path.read_bytes())
    edit(data)
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


def test_every_bit_flip_in_a_shard_file_is_an_error_naming_file_and_parts(chain, tmp_path):
    full, _ = _copy(chain, tmp_path)
    want = loaded_bytes(chain[1])
    path = full / "model-00001-000.safetensors"
    original = path.read_bytes()
    rng = np.random.default_rng(0)
    for bit in rng.choice(len(original) * 8, 80, replace=False):
        data = bytearray(original)
        data[bit // 8] ^= 1 << (bit % 8)
        path.write_bytes(bytes(data))
        with pytest.raises(FormatError, match=r"model-00001-000\.safetensors"):
            loaded_bytes(full)
    path.write_bytes(original)
    assert loaded_bytes(full) == want
    # The header is checked on open; past it, only the hash sees a flip in a payload: with verify=False such a
    # flip loads (the opt-out), which is what the default guards against.
    data = bytearray(original)
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(ChecksumMismatchError, match=r"model-00001-000\.safetensors: BLAKE3 .* it holds \d+ parts"):
        loaded_bytes(full)


def test_a_flipped_byte_in_the_base_of_a_delta_is_named(chain, tmp_path):
    full, delta = _copy(chain, tmp_path)
    want = loaded_bytes(delta)
    for name in ("model-00000-000.safetensors", "model-00001-001.safetensors"):
        path = full / name
        original = path.read_bytes()
        data = bytearray(original)
        data[-3] ^= 0x10
        path.write_bytes(bytes(data))
        for shards in (1, 2):
            with pytest.raises(ChecksumMismatchError, match=f"{full}: {name}: BLAKE3"):
                loaded_bytes(delta, 0, shards)
        path.write_bytes(original)
    assert loaded_bytes(delta) == want


def test_a_failed_verified_load_leaves_the_given_tables_and_arrays_as_they_were(chain, tmp_path):
    full, _ = _copy(chain, tmp_path)
    path = full / "model-00000-001.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    table = HashTable(3, slots=("m", "v"))
    table.insert([1, 2], np.ones((2, 3), np.float32))
    w = np.full((10, 4), -1, np.float32)
    with pytest.raises(ChecksumMismatchError):
        Loader(str(full), hashtables={"emb": table}, tensors={"w": w}).load()
    assert table.ids().tolist() == [1, 2] and np.all(w == -1)


def test_read_tensor_checks_each_file_it_touches_once(chain, tmp_path):
    full, _ = _copy(chain, tmp_path)
    with CheckpointReader(full) as r:
        assert r.verified_files() == []
        r.read_tensor("b")
        touched = r.verified_files()
        assert touched and set(touched) <= set(r.files)
        r.read_tensor("emb.id")
        assert r.verified_files() == sorted(r.files)  # every rank's id part: every file
    with CheckpointReader(full, verify=False) as r:
        name = r.file_of("w/part_1_2").path
    data = bytearray(Path(name).read_bytes())
    data[-1] ^= 4
    Path(name).write_bytes(bytes(data))
    with CheckpointReader(full) as r:
        with pytest.raises(ChecksumMismatchError, match=os.path.basename(name)):
            r.read_tensor("w")
    with CheckpointReader(full, verify=False) as r:
        assert r.read_tensor("w").shape == (10, 4)  # the opt-out reads what is there


# -- the manifest and the metadata files --------------------------------------------------------------------------

def _shift_row_start(descriptions):
    descriptions["w/part_1_2"]["row_start"] -= 1


def _empty_shape(manifest):
    manifest["tensors"]["w"]["shape"] = []


def _no_tables(manifest):
    manifest["hashtables"] = {}


@pytest.mark.parametrize("name, edit, message", [
    (DESCRIPTION_FILE, _shift_row_start, r"entry 'w/part_1_2': rows \[4, 9\) of shape \[5, 4\]: expected rows from 5"),
    (MANIFEST_FILE, _empty_shape, r"entry 'w/part_0_2': global_shape \[10, 4\] float32, the manifest says \[\] "
                                  "float32"),
    (MANIFEST_FILE, _no_tables, r"'hashtables' and torch_rank_weights_embs_table_multi_shard.json name different "
                                r"tables: \['emb', 'small'\]"),
])
@pytest.mark.parametrize("sealed", [False, True])
def test_manifest_and_description_edits_are_caught(chain, tmp_path, name, edit, message, sealed):
    """The three edits that 0.2.0 loaded (and ``verify`` passed): caught by the hashes, and when the manifest is
    rewritten consistently (its hashes and checksum redone) by the cross-checks; ``verify`` names them."""
    full, _ = _copy(chain, tmp_path)
    _edit_json(full / name, edit)
    if sealed:
        reseal(full)
    expected = message if sealed else (r"manifest.json: its contents hash to BLAKE3" if name == MANIFEST_FILE else
                                       f"{name}: .* the manifest says")
    with pytest.raises(FormatError, match=expected):
        Loader(str(full)).load()
    status, out = _verify_output(full)
    assert status == 1 and out.startswith(f"FAIL {full}") and name.split(".")[0] in out


@pytest.mark.parametrize("edit, message", [
    (_shift_row_start, r"rows \[4, 9\) of shape \[5, 4\]: expected rows from 5"),
    (_empty_shape, r"the manifest says \[\]"),
    (_no_tables, "name different tables"),
])
def test_the_same_edits_of_a_0_2_0_checkpoint_are_caught_by_the_cross_checks(tmp_path, edit, message):
    """Format version 1 has no checksum of the manifest: the cross-checks alone catch the edits."""
    shutil.copytree(GOLDEN_OLD, tmp_path / "old")
    full = tmp_path / "old" / "full"
    if edit is _shift_row_start:
        _edit_json(full / DESCRIPTION_FILE, lambda d: d["w/part_1_2"].__setitem__("row_start", 1))
        message = r"rows \[1, 4\) of shape \[3, 2\]: expected rows from 2"
    else:
        _edit_json(full / MANIFEST_FILE, edit)
    reseal(full)
    with pytest.raises(FormatError, match=message):
        Loader(str(full)).load()
    assert _verify_output(full)[0] == 1


@pytest.mark.parametrize("key", ["world_size", "parallel"])
@pytest.mark.parametrize("sealed", [False, True])
def test_a_hostile_world_size_is_a_format_error_at_once(chain, tmp_path, key, sealed):
    full, _ = _copy(chain, tmp_path)
    _edit_json(full / MANIFEST_FILE, lambda m: m.__setitem__(key, 10**12))
    if sealed:
        reseal(full)
    with pytest.raises(FormatError, match="manifest.json: " + ("world_size 1000000000000 x parallel 2 tensor files"
                                                               if key == "world_size" and sealed else
                                                               "world_size 2 x parallel 1000000000000" if sealed
                                                               else "its contents hash")):
        CheckpointReader(full)
    status, out = _verify_output(full)
    assert status == 1 and "manifest.json" in out


@pytest.mark.parametrize("where, edit, message", [
    (MANIFEST_FILE, lambda m: m.__setitem__("files", []), "'files' must be an object"),
    (MANIFEST_FILE, lambda m: m["files"]["model-00000-000.safetensors"].__setitem__("size", "1"),
     r"files\['model-00000-000.safetensors'\] must be"),
    (MANIFEST_FILE, lambda m: m.__setitem__("tensors", {"w": 3}), r"tensors\['w'\] must be"),
    (MANIFEST_FILE, lambda m: m["tensors"]["w"].__setitem__("dtype", "object"), r"tensors\['w'\]: unknown dtype"),
    (MANIFEST_FILE, lambda m: m["hashtables"]["emb"].__setitem__("slots", "mv"), r"hashtables\['emb'\]: 'slots'"),
    (MANIFEST_FILE, lambda m: m["hashtables"]["emb"].__setitem__("dim", None), r"hashtables\['emb'\]: 'dim'"),
    (MANIFEST_FILE, lambda m: m["hashtables"]["emb"].__setitem__("ids", 10**15), r"hashtables\['emb'\] says "),
    (MANIFEST_FILE, lambda m: m.__setitem__("format_version", 0), "'format_version' must be a positive"),
    (DESCRIPTION_FILE, lambda d: d["w/part_0_2"].__setitem__("shape", {"a": 1}), r"entry 'w/part_0_2': 'shape'"),
    (DESCRIPTION_FILE, lambda d: d["w/part_0_2"].__setitem__("row_start", None), r"entry 'w/part_0_2': a dense"),
    (DESCRIPTION_FILE, lambda d: d["w/part_0_2"].__setitem__("part", [0]), r"entry 'w/part_0_2': 'part'"),
    (DESCRIPTION_FILE, lambda d: d["emb.id/part_0_2"].__setitem__("role", 5), r"entry 'emb.id/part_0_2': a hash"),
    (DESCRIPTION_FILE, lambda d: d["emb.m/part_1_2"].__setitem__("shape", [10**12, 3]), r"entry 'emb.m/part_1_2'"),
    (DESCRIPTION_FILE, lambda d: d.__setitem__("w/part_0_2", []), r"entry 'w/part_0_2': must be an object"),
    ("index.json", lambda i: i["block_index"].__setitem__("w/part_0_2", "0"), r"block_index\['w/part_0_2'\]"),
    ("tensorkey.json", lambda t: t.__setitem__("w/part_0_2", ["w"]), r"\['w/part_0_2'\] must be the tensor's name"),
])
def test_malformed_metadata_values_are_format_errors_naming_file_and_key(chain, tmp_path, where, edit, message):
    full, _ = _copy(chain, tmp_path)
    _edit_json(full / where, edit)
    reseal(full)
    with pytest.raises(FormatError, match=f"{where}: .*{message}" if where != MANIFEST_FILE else message) as info:
        Loader(str(full)).load()
    assert str(full / where) in str(info.value)
    status, out = _verify_output(full)
    assert status == 1


# -- one commit -----------------------------------------------------------------------------------------------------

def test_a_checkpoint_replaced_while_it_is_opened_is_named(chain, tmp_path, monkeypatch):
    """An overwrite=True save landing between the reader's opens: 0.2.0 read parts of two checkpoints."""
    full, _ = _copy(chain, tmp_path)
    other = save_threads(tmp_path / "other", [{}], {"w": np.zeros((10, 4), np.float32)}, parallel=4)
    import fastckpt.sharded.reader as reader_module

    real = reader_module.open_file
    calls = []

    def open_and_swap(path, **options):
        f = real(path, **options)
        if not calls:  # after the first file: the directory is replaced, as _swap_in does
            os.rename(full, str(full) + ".old")
            os.rename(other, full)
        calls.append(path)
        return f

    monkeypatch.setattr(reader_module, "open_file", open_and_swap)
    with pytest.raises(CheckpointChangedError, match="the checkpoint changed while it was opened"):
        with CheckpointReader(full) as r:
            r.verify()  # every file opened, one after another
    calls.clear()
    os.rename(full, other)
    os.rename(str(full) + ".old", full)
    with pytest.raises(CheckpointChangedError, match="changed while it was opened"):
        Loader(str(full)).load()


def _resident_kib(path: str) -> int:
    """The resident KiB of this process's mappings of ``path`` (Linux's /proc/self/smaps)."""
    total, mine = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5:  # a mapping's first line: address range ... [path]
                mine = len(head) >= 6 and head[5] == path
            elif mine and head and head[0] == "Rss:":
                total += int(head[1])
    return total


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads Linux's /proc/self/smaps")
@pytest.mark.parametrize("copy_on_write", [False, True])
def test_hashing_a_mapped_file_leaves_its_pages_out_of_the_process(tmp_path, copy_on_write):
    """A verified load hashes every file it reads: through the mapping, each piece is let go of once hashed (the
    pages stay in the page cache), so the load's resident set holds the rows it loaded, not the files too. A
    copy-on-write mapping keeps its pages (some may be its own)."""
    from fastckpt.sharded import Saver

    out = Saver(path=str(tmp_path / "c"), parallel=1, tensors={"w": np.ones((3 << 20) // 8)}).save()
    with CheckpointReader(out, verify=False, copy_on_write=copy_on_write) as reader:
        name, = (n for n in reader.files)
        path = os.path.realpath(os.path.join(out, name))
        assert reader.file_problem(name) is None
        resident = _resident_kib(path)
        assert resident < 512 if not copy_on_write else resident >= 3 << 10
        assert reader.host("w/part_0_1")[-1] == 1.0  # the views read the file as before


def test_readers_holding_a_file_hash_it_once_between_them(chain, tmp_path):
    """Ranks run as threads (resharding) read every file's ids: while readers hold a file open, one hash serves all;
    once the last closes, the next open hashes again (a file changed in between is seen)."""
    import fastckpt.sharded.reader as reader_module

    full, _ = _copy(chain, tmp_path)
    calls = []
    real = reader_module._digests.once

    def counting(identity, compute):
        return real(identity, lambda: calls.append(identity) or compute())

    import unittest.mock

    with unittest.mock.patch.object(reader_module._digests, "once", counting):
        with CheckpointReader(full) as a, CheckpointReader(full) as b:
            a.read_tensor("emb.id"), b.read_tensor("emb.id")
            assert len(calls) == len(set(calls)) == len(a.verified_files()) == len(b.verified_files()) >= 2
        with CheckpointReader(full) as c:
            c.read_tensor("emb.id")
            assert len(calls) == 2 * len(c.verified_files())
            held = [f.mapped.identity for f in c.files.values()]
            assert all(reader_module._digests.holders(i) == 1 for i in held)  # c alone holds them
    assert not any(reader_module._digests.holders(i) for i in held)
    leaked = CheckpointReader(full)
    held = [f.mapped.identity for f in leaked.files.values()]
    del leaked  # never closed: collected, it lets go too
    import gc

    gc.collect()
    assert not any(reader_module._digests.holders(i) for i in held)



_COLLECTED_UNDER_THE_LOCK = """
import faulthandler, gc, sys
faulthandler.dump_traceback_later(60, exit=True)
import fastckpt.sharded.reader as reader_module
from fastckpt.sharded import CheckpointReader

leaked = CheckpointReader(sys.argv[1])
leaked.cycle = leaked  # only the cyclic collector frees it, and runs its weakref.finalize then
held = [f.mapped.identity for f in leaked.files.values()]
del leaked
# What an allocation under the lock (a Future in Flights.once, a Flight in Flights.hold) can set off on this thread.
with reader_module._digests._lock:
    gc.collect()
assert not any(reader_module._digests.holders(i) for i in held)
print("released")
"""


def test_a_reader_collected_while_its_thread_holds_the_digest_lock_lets_go(chain, tmp_path):
    """A garbage collection can start inside any allocation, including one made while this thread holds the shared
    digests' lock; a reader never closed and collected there releases its files through that same lock, on the same
    thread. Run in a child: a deadlock there is a timeout here, not a hung suite."""
    import subprocess
    import sys

    full, _ = _copy(chain, tmp_path)
    root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", _COLLECTED_UNDER_THE_LOCK, str(full)], capture_output=True,
                          text=True, env=env, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "released", done.stderr[-3000:]

def test_a_load_reads_the_commit_it_opened_when_the_directory_is_replaced_after(chain, tmp_path, monkeypatch):
    """Once every file is open, a save with overwrite=True replacing the directory (and the old one removed) does
    not reach the load: every row comes from the files it opened."""
    import fastckpt.sharded.loader as loader_module

    full, _ = _copy(chain, tmp_path)
    want = {shards: loaded_bytes(full, 0, shards, dense="rows") for shards in (1, 3)}
    other = save_threads(tmp_path / "other", [{}, {}], {"w": np.zeros((10, 4), np.float32)}, parallel=2)
    real = loader_module._check_one_commit

    def check_then_replace(readers, chain_):
        real(readers, chain_)
        os.rename(full, str(full) + ".old")
        shutil.rmtree(str(full) + ".old")
        shutil.copytree(other, full)

    monkeypatch.setattr(loader_module, "_check_one_commit", check_then_replace)
    for shards in (1, 3):
        assert loaded_bytes(full, 0, shards, dense="rows") == want[shards]
        shutil.rmtree(full)
        shutil.copytree(chain[0] / "full", full)


def test_verify_names_files_the_manifest_does_not_list(chain, tmp_path):
    full, _ = _copy(chain, tmp_path)
    assert _verify_output(full)[0] == 0
    shutil.copy(full / "model-00001-001.safetensors", full / "model-00002-000.safetensors")
    status, out = _verify_output(full)
    assert status == 1 and "holds 1 file(s) its manifest does not list: ['model-00002-000.safetensors']" in out


def test_a_tensor_file_replaced_by_a_symlink_is_a_format_error(chain, tmp_path):
    full, _ = _copy(chain, tmp_path)
    path = full / "model-00000-001.safetensors"
    os.rename(path, tmp_path / "elsewhere.safetensors")
    os.symlink(tmp_path / "elsewhere.safetensors", path)
    with CheckpointReader(full) as r:  # found when the file is first used, every time
        for _ in range(2):
            with pytest.raises(FormatError, match="model-00000-001.safetensors: a symbolic link"):
                r.files["model-00000-001.safetensors"]
        with pytest.raises(FormatError, match="model-00000-001.safetensors: a symbolic link"):
            r.verify()


@pytest.mark.parametrize("link, part, field, value", [("full", "emb.id/part_0_2", "payload_nbytes", 2**62),
                                                      ("full", "emb.id/part_0_2", "payload_nbytes", 10**12 + 8),
                                                      ("delta", "small.id/part_0_2", "shuffle", 2**63)])
def test_hostile_encoding_numbers_of_a_compressed_part_are_format_errors(tmp_path, link, part, field, value):
    """The codec was asked for 2**62 bytes of output up front (its failed allocation aborted the process); an empty
    part with a shuffle of 2**63 raised numpy's ValueError."""
    full, delta = small_chain(tmp_path, compression="zstd")
    path = Path(full if link == "full" else delta)
    assert field != "shuffle" or json.loads((path / DESCRIPTION_FILE).read_bytes())[part]["encoding"][
        "payload_nbytes"] == 0  # the empty part numpy could not reshape
    _edit_json(path / DESCRIPTION_FILE, lambda d: d[part]["encoding"].__setitem__(field, value))
    reseal(path)
    for verify in (True, False):
        with pytest.raises(FormatError, match=f"{part}'.*(claims|does not decompress|payload bytes|unknown encoding)"):
            Loader(str(path), verify=verify).load()


def test_owner_mod_is_numpys_mod_for_every_shard_count():
    from fastckpt.sharded.loader import owner_mod

    ids = np.concatenate([np.random.default_rng(3).integers(-(2**63), 2**63 - 1, 5000, dtype=np.int64),
                          np.array([-(2**63), -(2**63) + 1, -1, 0, 1, 2**63 - 1], np.int64)])
    for n in (1, 2, 3, 4, 7, 8, 64, 1000, 1024):
        got = owner_mod(ids, n)
        assert got.dtype == np.int64 and np.array_equal(got, np.mod(ids, n)), n
