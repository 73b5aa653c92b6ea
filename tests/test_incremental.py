"""Incremental (delta) sharded checkpoints: change tracking, chains, restore, compaction, retention, the policy."""

from __future__ import annotations

import json
import os
import shutil
import threading

import numpy as np
import pytest

from fastckpt.errors import FormatError
from fastckpt.sharded import CheckpointReader, HashTable, Loader, Saver
from fastckpt.sharded.chain import BrokenChainError, manifest_digest, prune, resolve_chain
from fastckpt.sharded.reshard import compact
from fastckpt.sharded.engine import ThreadEngine
from fastckpt.sharded.recis import slice_owner
from fastckpt.sharded.saver import DeltaPolicy

DIM, SLOTS = 4, ("m", "v")
EVERY_DELTA = DeltaPolicy(max_chain=100, max_fraction=1.0)


class Trainer:
    """``ranks`` tables that own ids by the slice rule of format version 4 (what a load of ``ranks`` ranks gives
    them), changed at random the way training changes them."""

    def __init__(self, ranks: int, seed: int = 0, n: int = 600):
        self.rng = np.random.default_rng(seed)
        self.ranks = ranks
        self.tables = [HashTable(DIM, slots=SLOTS, name="emb") for _ in range(ranks)]
        self.dense = {"w": self.rng.random((7, 3)).astype(np.float32)}
        self.step(inserts=n, updates=0, deletes=0)

    def _route(self, ids):
        return [ids[slice_owner(ids, self.ranks) == r] for r in range(self.ranks)]

    def step(self, inserts=40, updates=30, deletes=20, reinserts=5):
        rng = self.rng
        fresh = rng.integers(-(2**62), 2**62, inserts)
        held = np.concatenate([t.ids() for t in self.tables])
        touched = rng.choice(held, min(updates, len(held)), replace=False) if len(held) else held
        gone = rng.choice(held, min(deletes, len(held)), replace=False) if len(held) else held
        for r, t in enumerate(self.tables):
            mine = self._route(fresh)[r]
            t.insert(mine, rng.random((len(mine), DIM)), slots={"m": rng.random((len(mine), DIM))})
            upd = np.setdiff1d(self._route(touched)[r], gone)
            t.update(upd, rng.random((len(upd), DIM)), slots={"v": rng.random((len(upd), DIM))})
            t.delete(self._route(gone)[r])
            back = self._route(gone[:reinserts])[r]  # ids deleted and inserted again before the next save
            t.insert(back, rng.random((len(back), DIM)))
        self.dense["w"] = self.dense["w"] + 1

    def save(self, path, incremental=EVERY_DELTA, **options) -> list:
        engines = ThreadEngine.group(self.ranks)
        savers = [Saver(shard_index=r, shard_num=self.ranks, parallel=2, path=str(path), hashtables={"emb": t},
                        tensors=self.dense, engine=engines[r], timeout=30, incremental=incremental, **options)
                  for r, t in enumerate(self.tables)]
        results: list = [None] * self.ranks

        def run(r):
            try:
                results[r] = savers[r].save()
            except BaseException as exc:  # noqa: BLE001 - the test looks at it
                results[r] = exc

        threads = [threading.Thread(target=run, args=(r,)) for r in range(self.ranks)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return [s.kind for s in savers]

    def whole(self) -> HashTable:
        out = HashTable(DIM, slots=SLOTS)
        for t in self.tables:
            out.import_(*t.export())
        return out


def load_whole(path, shards: int) -> tuple[HashTable, dict]:
    out = HashTable(DIM, slots=SLOTS)
    dense = None
    for r in range(shards):
        tables, tensors = Loader(str(path), shard_index=r, shard_num=shards).load()
        out.import_(*tables["emb"].export())
        dense = tensors
    return out, dense


# -- change tracking --------------------------------------------------------------------------------------
def test_the_table_tracks_writes_and_deletes_until_marked_clean():
    t = HashTable(2)
    assert t.base is None
    t.insert([1, 2, 3, 4], np.zeros((4, 2)))
    t.mark_clean(("base", "h"))
    assert [a.tolist() for a in t.changes()] == [[], []]
    t.update([2], [[1, 1]])
    t.insert([9, 2], [[9, 9], [2, 2]])  # one new, one present
    assert t.delete([1, 4, 77]) == 2   # 77 was never there
    t.insert([4], [[4, 4]])            # deleted, then back
    written, deleted = t.changes()
    assert sorted(written.tolist()) == [2, 4, 9] and deleted.tolist() == [1]
    assert t.base == ("base", "h")
    t.import_([5], [[5, 5]], clear=True)  # replaced whole: no base can describe it
    assert t.base is None


def test_the_changed_flags_move_with_their_rows_on_delete():
    t = HashTable(1)
    t.insert(np.arange(10), np.zeros((10, 1)))
    t.mark_clean("b")
    t.update([8, 9], [[1.0], [1.0]])
    t.delete([0, 1])  # rows 8 and 9 move into the holes
    written, deleted = t.changes()
    assert sorted(written.tolist()) == [8, 9] and deleted.tolist() == [0, 1]
    ids, _, _ = t.rows()
    assert sorted(ids[t.changed_rows()].tolist()) == [8, 9] and t.changed_rows().tolist() == [0, 1]


# -- chains restore exactly ---------------------------------------------------------------------------------
@pytest.mark.parametrize("deltas", [1, 5, 20])
def test_base_plus_deltas_equals_the_uninterrupted_table(tmp_path, deltas):
    trainer = Trainer(ranks=2, seed=deltas)
    assert trainer.save(tmp_path / "s0") == ["full", "full"]  # no base yet
    for k in range(1, deltas + 1):
        trainer.step()
        assert trainer.save(tmp_path / f"s{k}") == ["delta", "delta"]
    head = tmp_path / f"s{deltas}"
    assert [os.path.basename(p) for p, _ in resolve_chain(head)] == [f"s{k}" for k in range(deltas + 1)]
    want = trainer.whole()
    for shards in (1, 3):
        got, dense = load_whole(head, shards)
        assert got == want, shards
        assert dense["w"].tobytes() == trainer.dense["w"].tobytes()


def test_a_chain_saved_by_two_ranks_continues_on_three(tmp_path):
    trainer = Trainer(ranks=2, seed=3)
    trainer.save(tmp_path / "s0")
    trainer.step()
    trainer.save(tmp_path / "s1")
    # three new ranks load the head and keep training: their tables are clean against s1
    three = Trainer(ranks=3, seed=9, n=0)
    three.dense = dict(trainer.dense)
    for r in range(3):
        tables, _ = Loader(str(tmp_path / "s1"), hashtables={"emb": three.tables[r]}, shard_index=r,
                           shard_num=3).load()
        assert three.tables[r].base == (str(tmp_path / "s1"), manifest_digest(tmp_path / "s1"))
    assert three.whole() == trainer.whole()
    three.step()
    assert three.save(tmp_path / "s2") == ["delta"] * 3
    got, _ = load_whole(tmp_path / "s2", 2)
    assert got == three.whole()


def test_the_delta_holds_only_the_changed_rows_and_deleted_ids(tmp_path):
    t = HashTable(2, slots=("m",))
    t.insert(np.arange(100), np.zeros((100, 2)))
    Saver(path=str(tmp_path / "a"), parallel=1, hashtables={"emb": t}).save()
    t.update([5, 6], [[1, 1], [2, 2]])
    t.delete([7])
    s = Saver(path=str(tmp_path / "b"), parallel=1, hashtables={"emb": t}, incremental=True)
    s.save()
    assert s.kind == "delta"
    with CheckpointReader(tmp_path / "b") as r:
        assert sorted(r.read_tensor("emb.id").tolist()) == [5, 6]
        assert r.read_tensor("emb.deleted").tolist() == [7]
        m = r.manifest
    assert m["format_version"] == 4 and m["kind"] == "delta" and m["chain_length"] == 1
    assert m["base"] == {"path": "../a", "manifest_blake3": manifest_digest(tmp_path / "a")}
    assert m["hashtables"]["emb"] == {"dim": 2, "dtype": "float32", "slots": ["m"], "ids": 99, "written": 2,
                                      "deleted": 1, "partition": {"rule": "slice", "slice_size": 65536}}
    assert [a.tolist() for a in t.changes()] == [[], []]  # committed: clean


# -- failures ------------------------------------------------------------------------------------------------
def test_a_failed_delta_save_keeps_the_changes_and_the_previous_head(tmp_path, monkeypatch):
    trainer = Trainer(ranks=2, seed=5)
    trainer.save(tmp_path / "s0")
    trainer.step()
    trainer.save(tmp_path / "s1")
    trainer.step()
    before = [[a.copy() for a in t.changes()] for t in trainer.tables]
    import fastckpt.sharded.saver as saver_module

    real = saver_module.save_safetensors

    def crash_on_rank_1(path, tensors, metadata, **options):
        if "model-00001" in str(path):
            raise OSError(28, "No space left on device")
        return real(path, tensors, metadata, **options)

    monkeypatch.setattr(saver_module, "save_safetensors", crash_on_rank_1)
    with pytest.raises((OSError, RuntimeError), match="No space left"):  # rank 0 reports rank 1's error
        trainer.save(tmp_path / "s2")
    monkeypatch.undo()
    assert not (tmp_path / "s2").exists()
    assert [[a.tolist() for a in t.changes()] for t in trainer.tables] == [[a.tolist() for a in c] for c in before]
    got, _ = load_whole(tmp_path / "s1", 1)  # the previous head loads
    assert len(got) > 0
    assert trainer.save(tmp_path / "s2") == ["delta", "delta"]  # the kept changes go into the next delta
    got, _ = load_whole(tmp_path / "s2", 2)
    assert got == trainer.whole()


def _chain(tmp_path, n=3) -> Trainer:
    trainer = Trainer(ranks=1, seed=11)
    trainer.save(tmp_path / "s0")
    for k in range(1, n + 1):
        trainer.step()
        trainer.save(tmp_path / f"s{k}")
    return trainer


def test_a_missing_base_is_named(tmp_path):
    _chain(tmp_path)
    shutil.move(tmp_path / "s1", tmp_path / "elsewhere")
    with pytest.raises(BrokenChainError, match=r"s2: its base .*s1 \(link 2 of the chain of .*s3\) is missing") as e:
        Loader(str(tmp_path / "s3")).load()
    assert e.value.link == str(tmp_path / "s2") and e.value.base == str(tmp_path / "s1")


def test_an_altered_base_is_named(tmp_path):
    _chain(tmp_path)
    manifest = tmp_path / "s0" / "manifest.json"
    data = json.loads(manifest.read_text())
    data["parallel"] = data["parallel"]  # same content, other bytes: the hash tells
    manifest.write_text(json.dumps(data))
    with pytest.raises(BrokenChainError, match=r"s1: its base .*s0 .* has a manifest.json with BLAKE3 .* the base "
                                                 r"was replaced or altered"):
        Loader(str(tmp_path / "s3")).load()


def test_a_damaged_delta_file_is_named(tmp_path):
    _chain(tmp_path, n=1)
    with open(tmp_path / "s1" / "manifest.json", "rb+") as f:
        text = f.read().replace(b'"kind": "delta"', b'"kind": "delta", "base": 7')
        f.seek(0)
        f.truncate()
        f.write(text)
    with pytest.raises(FormatError):
        Loader(str(tmp_path / "s1")).load()


# -- compaction, retention, policy ---------------------------------------------------------------------------
def test_compaction_equals_the_chain_and_stands_alone(tmp_path):
    trainer = _chain(tmp_path, n=4)
    compact(tmp_path / "s4", tmp_path / "full")
    with CheckpointReader(tmp_path / "full") as r:
        assert "kind" not in r.manifest and r.manifest["format_version"] == 4
    for k in range(5):
        shutil.rmtree(tmp_path / f"s{k}")
    got, dense = load_whole(tmp_path / "full", 2)
    assert got == trainer.whole() and dense["w"].tobytes() == trainer.dense["w"].tobytes()


def test_cli_compact(tmp_path, capsys):
    from fastckpt.cli import main

    trainer = _chain(tmp_path, n=2)
    assert main(["compact", str(tmp_path / "s2"), str(tmp_path / "c"), "--shards", "3"]) == 0
    assert "one full checkpoint from a chain of 3" in capsys.readouterr().out
    assert load_whole(tmp_path / "c", 1)[0] == trainer.whole()
    shutil.rmtree(tmp_path / "s0")
    assert main(["compact", str(tmp_path / "s2"), str(tmp_path / "d")]) == 1
    assert "is missing or was never committed" in capsys.readouterr().err
    assert main(["verify", str(tmp_path / "s2")]) == 1


def test_retention_keeps_every_base_a_kept_checkpoint_needs(tmp_path):
    trainer = Trainer(ranks=1, seed=2)
    policy = DeltaPolicy(max_chain=2, max_fraction=1.0)
    kinds = []
    for k in range(7):  # full, delta, delta, full, delta, delta, full
        if k:
            trainer.step()
        kinds += trainer.save(tmp_path / f"s{k}", incremental=policy)
        os.utime(tmp_path / f"s{k}" / "manifest.json", ns=(k * 10**9, k * 10**9))
    assert kinds == ["full", "delta", "delta", "full", "delta", "delta", "full"]
    # keep s5 and s6: s5 is a delta on s4, itself a delta on the full s3
    assert [os.path.basename(p) for p in prune(tmp_path, keep_last=2)] == ["s0", "s1", "s2"]
    assert sorted(os.listdir(tmp_path)) == ["s3", "s4", "s5", "s6"]
    assert [os.path.basename(p) for p, _ in resolve_chain(tmp_path / "s5")] == ["s3", "s4", "s5"]


def test_retention_keeps_the_chain_of_the_newest(tmp_path):
    trainer = Trainer(ranks=1, seed=2)
    for k in range(4):  # full, delta, delta, delta
        if k:
            trainer.step()
        trainer.save(tmp_path / f"s{k}")
        os.utime(tmp_path / f"s{k}" / "manifest.json", ns=(k * 10**9, k * 10**9))
    assert prune(tmp_path, keep_last=1) == []  # s3 needs s0, s1, s2
    compact(tmp_path / "s3", tmp_path / "s4")
    os.utime(tmp_path / "s4" / "manifest.json", ns=(9 * 10**9, 9 * 10**9))
    assert [os.path.basename(p) for p in prune(tmp_path, keep_last=1)] == ["s0", "s1", "s2", "s3"]
    assert os.listdir(tmp_path) == ["s4"]
    assert load_whole(tmp_path / "s4", 1)[0] == trainer.whole()


def test_the_policy_picks_full_saves(tmp_path):
    trainer = Trainer(ranks=2, seed=4)
    assert trainer.save(tmp_path / "a", incremental=False) == ["full"] * 2
    trainer.step()
    assert trainer.save(tmp_path / "b") == ["delta"] * 2  # a full save is a base too
    trainer.step(inserts=2000)  # more than half the table changed
    assert trainer.save(tmp_path / "c", incremental=DeltaPolicy(max_fraction=0.5)) == ["full"] * 2
    trainer.step()
    assert trainer.save(tmp_path / "d", incremental=DeltaPolicy(max_chain=1)) == ["delta"] * 2
    trainer.step()
    assert trainer.save(tmp_path / "e", incremental=DeltaPolicy(max_chain=1)) == ["full"] * 2
    trainer.step()
    trainer.tables[1].mark_clean(("somewhere", "else"))  # the ranks disagree on the base
    assert trainer.save(tmp_path / "f") == ["full"] * 2
    trainer.step()
    shutil.rmtree(tmp_path / "f")  # the base is gone
    assert trainer.save(tmp_path / "g") == ["full"] * 2
    got, _ = load_whole(tmp_path / "g", 1)
    assert got == trainer.whole()
    with pytest.raises(ValueError, match="max_chain"):
        DeltaPolicy(max_chain=0)
    with pytest.raises(TypeError, match="incremental"):
        Saver(path=str(tmp_path / "x"), incremental="yes")


def test_overwriting_a_base_in_its_own_chain_saves_full(tmp_path):
    trainer = _chain(tmp_path, n=2)
    trainer.step()
    assert trainer.save(tmp_path / "s1", overwrite=True) == ["full"]  # s1 is in the chain of the base s2
    assert load_whole(tmp_path / "s1", 1)[0] == trainer.whole()
