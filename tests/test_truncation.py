"""A file truncated after fastckpt mapped it: every copy fastckpt makes out of it is a FormatError, never SIGBUS.

Each case runs in its own process (a regression would kill the process, not pytest): a child forked from one
server interpreter that has imported numpy and fastckpt once (OpenCL is started in the child, never in the
server), which saves each case an interpreter start and its imports. There the mapping class is replaced by one that truncates the file to its first page right after mapping it, the moment a
writer truncating in place (not fastckpt's: it renames) could strike. The case passes when the read path
raises a FormatError naming the file and saying it was "truncated or replaced while reading"; it fails
when the interpreter dies (SIGBUS is return code -7) or anything else happens. The reads that never touched
the mapping (the pread backend, the TensorFlow reader's pread of its shards) are checked too: they say
the file shrank.
"""

from __future__ import annotations

import os
import signal
import subprocess
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Runs before each case: big tensors (so that the data lies past the first page, which the truncation keeps)
# and the truncating mapping class, installed wherever a module bound the name at import.
PRELUDE = r'''
import os, sys, numpy as np, fastckpt
import fastckpt._native.mapped as mapped_mod
import fastckpt._native.idindex  # noqa: F401 - cimports mapped: imported before MappedFile is replaced below
import fastckpt.formats.reader as reader_mod
import fastckpt.formats.npz as npz_mod
import fastckpt.formats.tf.reader as tf_reader_mod
from fastckpt.errors import FormatError

d = sys.argv[1]
TARGET = []  # paths that are truncated when mapped; empty: none

class TruncatingMappedFile(mapped_mod.MappedFile):
    def __init__(self, path, *args, **kwargs):
        super().__init__(path, *args, **kwargs)
        if os.fspath(path) in TARGET:
            os.truncate(path, 4096)

for module in (mapped_mod, reader_mod, npz_mod, tf_reader_mod):
    module.MappedFile = TruncatingMappedFile

AFTER_OPEN = []  # paths that are truncated once their index has been parsed (an NPZ's is at its end)
_open_file = reader_mod.open_file

def truncating_open_file(path, *args, **kwargs):
    f = _open_file(path, *args, **kwargs)
    if os.fspath(path) in AFTER_OPEN:
        os.truncate(path, 4096)
    return f

reader_mod.open_file = truncating_open_file

rng = np.random.default_rng(0)
TENSORS = {"a": rng.standard_normal((256, 1024)).astype(np.float32), "b": np.arange(300000, dtype=np.int64)}

def load_safetensors(pool=False, **options):
    """load_file of a safetensors file truncated once mapped, with a pool or without, and ``options``."""
    q = device_queue()
    p = os.path.join(d, "m.safetensors"); fastckpt.save_safetensors(p, TENSORS)
    TARGET.append(p)
    fastckpt.load_file(p, q, pool=fastckpt.PersistentBufferPool(q.context, q) if pool else None, **options)

def truncate_shards(directory):
    for n in os.listdir(directory):
        if n.endswith(".safetensors"):
            os.truncate(os.path.join(directory, n), 4096)

def device_queue():
    try:
        import fastckpt.device
        return fastckpt.device.default().queue
    except Exception as e:  # no OpenCL device here
        print("SKIP", e)
        sys.exit(77)
'''

CASES = {
    "npz-deflate-host": '''
        p = os.path.join(d, "c.npz"); np.savez_compressed(p, **TENSORS)
        AFTER_OPEN.append(p)
        with fastckpt.open(p) as f:
            f.host("b")
    ''',
    "safetensors-open-parse": '''
        p = os.path.join(d, "m.safetensors"); fastckpt.save_safetensors(p, TENSORS)
        TARGET.append(p); os.truncate = (lambda real: lambda path, n: real(path, 0))(os.truncate)
        fastckpt.open(p)
    ''',
    "npz-open-parse": '''
        p = os.path.join(d, "m.npz"); fastckpt.save_npz(p, TENSORS)
        TARGET.append(p)
        fastckpt.open(p)
    ''',
    "load_file-buffers": "load_safetensors(staging=False)",
    "load_file-pool": "load_safetensors(pool=True, staging=False)",
    "load_file-staging": "load_safetensors(staging=True)",
    "load_file-pool-staging": '''
        q = device_queue()
        p = os.path.join(d, "m.npz"); fastckpt.save_npz(p, TENSORS)
        AFTER_OPEN.append(p)
        fastckpt.load_file(p, q, pool=fastckpt.PersistentBufferPool(q.context, q), staging=True)
    ''',
    "load_file-hf-sharded-pool": '''
        q = device_queue()
        fastckpt.save_sharded(os.path.join(d, "hf"), TENSORS, max_shard_size="1MB")
        TARGET.extend(os.path.join(d, "hf", n) for n in os.listdir(os.path.join(d, "hf")) if n.endswith("safetensors"))
        fastckpt.load_file(os.path.join(d, "hf"), q, pool=fastckpt.PersistentBufferPool(q.context, q))
    ''',
    "load_file-decoded-train-directory": '''
        q = device_queue()
        from fastckpt.train import TinyLM, save_checkpoint
        save_checkpoint(TinyLM(vocab=4096, dim=256, hidden=512), None, None, None, None, os.path.join(d, "c"), step=1)
        TARGET.append(os.path.join(d, "c", "weights.safetensors"))
        fastckpt.load_file(os.path.join(d, "c"), q)
    ''',
    "train-load_checkpoint": '''
        from fastckpt.train import TinyLM, save_checkpoint, load_checkpoint
        save_checkpoint(TinyLM(vocab=4096, dim=256, hidden=512), None, None, None, None, os.path.join(d, "c"), step=1)
        TARGET.append(os.path.join(d, "c", "weights.safetensors"))
        load_checkpoint(os.path.join(d, "c"))
    ''',
    "train-load_checkpoint-unverified": '''
        from fastckpt.train import TinyLM, save_checkpoint, load_checkpoint
        save_checkpoint(TinyLM(vocab=4096, dim=256, hidden=512), None, None, None, None, os.path.join(d, "c"), step=1)
        TARGET.append(os.path.join(d, "c", "weights.safetensors"))
        load_checkpoint(os.path.join(d, "c"), verify=False)
    ''',
    "train-verify_checkpoint": '''
        from fastckpt.train import TinyLM, save_checkpoint, verify_checkpoint
        save_checkpoint(TinyLM(vocab=4096, dim=256, hidden=512), None, None, None, None, os.path.join(d, "c"), step=1)
        TARGET.append(os.path.join(d, "c", "weights.safetensors"))
        print(verify_checkpoint(os.path.join(d, "c")))
    ''',
    "hash-blake3_file": '''
        from fastckpt.formats.hashing import blake3_file
        p = os.path.join(d, "x.bin"); open(p, "wb").write(b"x" * (8 << 20))
        TARGET.append(p)
        blake3_file(p)
    ''',
    "hash-sha256_file": '''
        from fastckpt.formats.hashing import sha256_file
        p = os.path.join(d, "x.bin"); open(p, "wb").write(b"x" * (8 << 20))
        TARGET.append(p)
        sha256_file(p)
    ''',
    "sharded-verify": '''
        from fastckpt.sharded.saver import Saver
        from fastckpt.sharded.reader import CheckpointReader
        Saver(shard_index=0, shard_num=1, path=os.path.join(d, "s"), tensors={"w": TENSORS["a"]}).save()
        with CheckpointReader(os.path.join(d, "s")) as r:  # every file opened and mapped, then truncated under it
            list(r.files.values())
            truncate_shards(os.path.join(d, "s"))
            r.verify()
    ''',
    "sharded-read_tensor-unverified": '''
        from fastckpt.sharded.saver import Saver
        from fastckpt.sharded.reader import CheckpointReader
        Saver(shard_index=0, shard_num=1, path=os.path.join(d, "s"), tensors={"w": TENSORS["a"]}).save()
        with CheckpointReader(os.path.join(d, "s"), verify=False) as r:
            list(r.files.values())  # every file opened and mapped, then truncated under it
            truncate_shards(os.path.join(d, "s"))
            r.read_tensor("w")
    ''',
    "sharded-load-unverified": '''
        from fastckpt.sharded import HashTable, Loader, Saver
        table = HashTable(64, name="t")
        table.insert(np.arange(20000, dtype=np.int64), rng.standard_normal((20000, 64)).astype(np.float32))
        Saver(shard_index=0, shard_num=1, path=os.path.join(d, "s"), tensors={"w": TENSORS["a"]},
              hashtables={"t": table}).save()
        AFTER_OPEN.extend(os.path.join(d, "s", n) for n in os.listdir(os.path.join(d, "s"))
                          if n.endswith(".safetensors"))
        Loader(os.path.join(d, "s"), hashtables={"t": HashTable(64, name="t")},
               tensors={"w": np.zeros_like(TENSORS["a"])}, verify=False).load()
    ''',
    "convert-to-npz": '''
        from fastckpt.formats.convert import convert
        p = os.path.join(d, "m.safetensors"); fastckpt.save_safetensors(p, TENSORS)
        TARGET.append(p)
        convert(p, os.path.join(d, "out.npz"))
    ''',
    "convert-to-tf": '''
        from fastckpt.formats.convert import convert
        p = os.path.join(d, "m.safetensors"); fastckpt.save_safetensors(p, TENSORS)
        TARGET.append(p)
        convert(p, os.path.join(d, "out"), to="tf")
    ''',
    "io-load_params": '''
        from fastckpt.io.checkpoint import load_params
        p = os.path.join(d, "raw.npz"); fastckpt.save_npz(p, {"p0": TENSORS["a"]})
        AFTER_OPEN.append(p)
        load_params(None, [np.zeros_like(TENSORS["a"])], p)
    ''',
    "io-load_model": '''
        q = device_queue()
        from fastckpt import nn
        from fastckpt.io import load_model, save_model
        layers = [{"type": "Linear", "args": {"in_features": 1024, "out_features": 1024, "bias": True}}]
        p = os.path.join(d, "m.netcl"); save_model(nn.build_sequential(q, layers, seed=1), p)
        AFTER_OPEN.append(p)
        load_model(p, q)
    ''',
    "io-load_model-verify": '''
        q = device_queue()
        from fastckpt import nn
        from fastckpt.io import load_model, save_model
        layers = [{"type": "Linear", "args": {"in_features": 1024, "out_features": 1024, "bias": True}}]
        p = os.path.join(d, "m.netcl"); save_model(nn.build_sequential(q, layers, seed=1), p)
        AFTER_OPEN.append(p)
        load_model(p, q, verify=True)
    ''',
    "load_file-tf-unverified": '''
        q = device_queue()
        from fastckpt.tf import CheckpointReader, write_checkpoint
        write_checkpoint(os.path.join(d, "ckpt"), TENSORS)
        TARGET.extend(os.path.join(d, n) for n in os.listdir(d) if ".data-" in n)
        with CheckpointReader(os.path.join(d, "ckpt"), verify=False) as r:
            fastckpt.load_file(r, q)
    ''',
    "convert-tf-unverified-to-safetensors": '''
        from fastckpt.formats.convert import convert
        from fastckpt.tf import write_checkpoint
        write_checkpoint(os.path.join(d, "ckpt"), TENSORS)
        TARGET.extend(os.path.join(d, n) for n in os.listdir(d) if ".data-" in n)
        tf_reader_mod.CheckpointReader.__init__.__kwdefaults__["verify"] = False
        convert(os.path.join(d, "ckpt"), os.path.join(d, "out.safetensors"))
    ''',
    "pread-backend-host": '''
        p = os.path.join(d, "m.safetensors"); fastckpt.save_safetensors(p, TENSORS)
        TARGET.append(p)
        with fastckpt.open(p, backend="pread") as f:
            f.host("b")
    ''',
    "tf-reader-host": '''
        from fastckpt.tf import write_checkpoint
        write_checkpoint(os.path.join(d, "ckpt"), TENSORS)
        TARGET.extend(os.path.join(d, n) for n in os.listdir(d) if ".data-" in n)
        with fastckpt.open(os.path.join(d, "ckpt")) as r:
            r.host("b")
    ''',
}

# The reads that never touch a mapping report the short read in their own words.
SHORT_READ = {"pread-backend-host": "shrank while open", "tf-reader-host": ""}


def case_script(name: str) -> str:
    body = textwrap.dedent(CASES[name])
    return PRELUDE + "\ntry:\n" + textwrap.indent(body, "    ") + (
        "\nexcept FormatError as e:\n    print('FORMATERROR', e)\n    sys.exit(0)\n"
        "print('NO ERROR')\nsys.exit(3)\n")


@pytest.fixture(scope="module")
def server():
    """Children forked from one interpreter that made PRELUDE's imports (tests/_forkserver.py): a case's own
    process, without an interpreter start and those imports each time."""
    from _forkserver import ForkServer

    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    imports = "import os, sys, numpy, fastckpt, fastckpt.errors\n" + "\n".join(
        line for line in PRELUDE.splitlines() if line.startswith("import fastckpt."))
    forks = ForkServer(imports, env=env, cwd=ROOT)
    yield forks
    forks.close()


def run_case(server, name: str, tmp_path) -> subprocess.CompletedProcess:
    """Case ``name`` in a process of its own, as ``python -X faulthandler -c script tmp_path`` runs it."""
    return server.run(case_script(name), str(tmp_path), timeout=300)


@pytest.mark.parametrize("name", sorted(CASES))
def test_truncated_after_mapping_is_a_format_error(name, tmp_path, server):
    r = run_case(server, name, tmp_path)
    if r.returncode == 77:
        pytest.skip(r.stdout.strip())
    assert r.returncode != -signal.SIGBUS, f"{name}: killed by SIGBUS\n{r.stderr[-2000:]}"
    assert r.returncode == 0, f"{name}: exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"
    message = r.stdout.split("FORMATERROR", 1)[1]
    assert str(tmp_path) in message, message
    assert SHORT_READ.get(name, "truncated or replaced while reading") in message, message
