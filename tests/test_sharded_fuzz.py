"""The sharded loader under damage: bit flips and truncations of every file, JSON mutations of every metadata file
(written as they are, and sealed again as a tool that rewrites the manifest consistently would), hostile numbers.
Every load either returns exactly the saved state or raises a fastckpt error; with ``verify=False`` a load may
return damaged payload bytes but raises nothing but fastckpt errors; ``fastckpt verify`` never crashes.

A short run is part of the default suite; ``-m slow`` runs a long one (and the 0.2.0 checkpoints too)."""

from __future__ import annotations

import io
import json
import shutil
from argparse import Namespace
from pathlib import Path

import numpy as np
import pytest

from _sharded_edit import METADATA, loaded_bytes, reseal, small_chain
from fastckpt.cli.verify import run as verify_cli
from fastckpt.errors import FastCkptError
from fastckpt.sharded.format import MANIFEST_FILE

GOLDEN_OLD = Path(__file__).parent / "data" / "golden" / "sharded-0.2.0"
HOSTILE = [None, True, False, -1, 0, 1, 2, 3, 10**12, 2**63, -(2**63), 10**30, 1.5, float("inf"), "", "x", "float32",
           "int64", "object", "emb", "w/part_0_2", [], [0], [1], [10**12, 3], [3, 2], [-1], {}, {"a": 1}, [[1]]]
SHARDINGS = [(0, 1), (1, 2), (0, 3)]


def _paths(node, trail=()):
    yield trail
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _paths(value, (*trail, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _paths(value, (*trail, i))


def _mutate(data, rng):
    """One change at a random place of a parsed JSON file: a hostile value, a removed or an added key, a number off
    by one; returns the new document."""
    paths = list(_paths(data))
    trail = paths[rng.integers(len(paths))]
    if not trail:
        return HOSTILE[rng.integers(len(HOSTILE))]
    parent = data
    for step in trail[:-1]:
        parent = parent[step]
    last, kind = trail[-1], rng.integers(4)
    value = parent[last]
    if kind == 0 and isinstance(parent, dict):
        del parent[last]
    elif kind == 1 and isinstance(parent, dict):
        parent[f"{last}x" if isinstance(last, str) else "x"] = value
    elif kind == 2 and type(value) is int:
        parent[last] = value + int(rng.choice([-1, 1, 2**32]))
    else:
        parent[last] = HOSTILE[rng.integers(len(HOSTILE))]
    return data


def _damage(root: Path, rng) -> str:
    """One random damage under ``root``; returns what it was."""
    files = sorted(p for p in root.rglob("*") if p.is_file())
    path = files[rng.integers(len(files))]
    data = path.read_bytes()
    kind = rng.integers(3) if path.suffix == ".json" else rng.integers(2)
    if kind == 0 and data:
        bit = int(rng.integers(len(data) * 8))
        path.write_bytes(data[: bit // 8] + bytes([data[bit // 8] ^ (1 << bit % 8)]) + data[bit // 8 + 1:])
        return f"bit {bit} of {path.relative_to(root)}"
    if kind == 1:
        n = int(rng.integers(len(data) + 1))
        path.write_bytes(data[:n])
        return f"{path.relative_to(root)} truncated to {n} bytes"
    try:
        doc = json.loads(data)
    except ValueError:
        return "none"
    doc = _mutate(doc, rng)
    path.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    if rng.integers(2):  # sealed again: the hashes and the checksum agree with the edit
        reseal(path.parent, doc if path.name == MANIFEST_FILE else None)
        return f"{path.relative_to(root)} mutated and sealed"
    return f"{path.relative_to(root)} mutated"


def _fuzz(source: Path, head: str, cases: int, seed: int, tmp_path: Path) -> dict[str, int]:
    expected = {s: loaded_bytes(source / head, *s, allow_lossy=True) for s in SHARDINGS}
    rng = np.random.default_rng(seed)
    counts = {"error": 0, "same": 0}
    wrong = []
    for case in range(cases):
        root = tmp_path / f"case{case}"
        shutil.copytree(source, root)
        what = _damage(root, rng)
        sharding = SHARDINGS[rng.integers(len(SHARDINGS))]
        try:
            got = loaded_bytes(root / head, *sharding, allow_lossy=True)
        except FastCkptError:
            counts["error"] += 1
        except Exception as exc:  # noqa: BLE001 - the failure this test looks for
            wrong.append(f"{what}: {type(exc).__name__}: {exc}")
        else:
            if got == expected[sharding]:
                counts["same"] += 1
            else:
                changed = sorted(k for k in got if got[k] != expected[sharding].get(k))
                wrong.append(f"{what}: a silent wrong load ({changed})")
        try:  # verify=False may load damaged payload bytes (that is the opt-out), but raises nothing else
            loaded_bytes(root / head, *sharding, allow_lossy=True, verify=False)
        except FastCkptError:
            pass
        except Exception as exc:  # noqa: BLE001
            wrong.append(f"{what}: with verify=False, {type(exc).__name__}: {exc}")
        out = io.StringIO()
        try:
            assert verify_cli(Namespace(directory=str(root / head), no_hash=False, quiet=True), out) in (0, 1)
        except Exception as exc:  # noqa: BLE001
            wrong.append(f"{what}: fastckpt verify raised {type(exc).__name__}: {exc}")
        shutil.rmtree(root)
    assert not wrong, f"{len(wrong)} of {cases}:\n" + "\n".join(wrong[:20])
    return counts


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz-source")
    small_chain(root)
    return root


def test_damaged_chains_load_right_or_raise(chain, tmp_path):
    counts = _fuzz(chain, "delta", 150, 1, tmp_path)
    assert counts["error"] > 100  # most damage is caught (the rest changes nothing the load uses)


def _hostile_numbers(chain, tmp_path, per_file: int | None, values) -> None:
    """Integers of every metadata file of both links (``per_file`` of each, spread out; None: all) set to each of
    ``values``, the manifest sealed again: no silent wrong load, only fastckpt errors."""
    expected = loaded_bytes(chain / "delta")
    failures = []
    for link in ("full", "delta"):
        for name in (*METADATA, MANIFEST_FILE):
            doc = json.loads((chain / link / name).read_bytes())
            numbers = [t for t in _paths(doc) if t and type(_get(doc, t)) is int]
            step = 1 if per_file is None else max(1, len(numbers) // per_file)
            for k, trail in enumerate(numbers[::step]):
                for value in values[k % len(values):][:1] if per_file is not None else values:
                    root = tmp_path / "n"
                    shutil.copytree(chain, root)
                    edited = json.loads((root / link / name).read_bytes())
                    _get(edited, trail[:-1])[trail[-1]] = value
                    (root / link / name).write_text(json.dumps(edited, indent=1, sort_keys=True) + "\n")
                    reseal(root / link, edited if name == MANIFEST_FILE else None)
                    try:
                        if loaded_bytes(root / "delta") != expected:
                            failures.append(f"{link}/{name} {trail} = {value}: a silent wrong load")
                    except FastCkptError:
                        pass
                    except Exception as exc:  # noqa: BLE001
                        failures.append(f"{link}/{name} {trail} = {value}: {type(exc).__name__}: {exc}")
                    shutil.rmtree(root)
    assert not failures, "\n".join(failures[:20])


def test_hostile_numbers_in_every_metadata_file_sealed_again(chain, tmp_path):
    _hostile_numbers(chain, tmp_path, 5, (10**12, -1, 2**63))


@pytest.mark.slow
def test_hostile_numbers_in_every_metadata_file_sealed_again_all(chain, tmp_path):
    _hostile_numbers(chain, tmp_path, None, (10**12, -1, 2**63, 0, 2**31))


def _get(doc, trail):
    for step in trail:
        doc = doc[step]
    return doc


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(4))
def test_damaged_chains_load_right_or_raise_long(chain, tmp_path, seed):
    _fuzz(chain, "delta", 1000, 100 + seed, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("head", ["delta", "quantized"])
def test_damaged_0_2_0_checkpoints_load_right_or_raise(tmp_path, head):
    _fuzz(GOLDEN_OLD, head, 800, 7, tmp_path)


@pytest.fixture(scope="module")
def compressed_chain(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz-compressed")
    small_chain(root, compression="zstd")
    return root


def test_damaged_compressed_chains_load_right_or_raise(compressed_chain, tmp_path):
    """The same with every table stored zstd-compressed (encoded parts: their payload sizes and shapes hostile too)."""
    _fuzz(compressed_chain, "delta", 60, 22, tmp_path)
    _hostile_numbers(compressed_chain, tmp_path, 3, (2**63, 10**12, -1))


@pytest.mark.slow
def test_damaged_compressed_chains_load_right_or_raise_long(compressed_chain, tmp_path):
    _fuzz(compressed_chain, "delta", 800, 21, tmp_path)
    _hostile_numbers(compressed_chain, tmp_path, None, (10**12, -1, 2**63))
