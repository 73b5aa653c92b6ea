"""Restores are all or nothing; any training-state shape; strict=False; every RNG (numpy, Python, torch)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from fastckpt.stateful import GlobalRNG
from fastckpt.train import CheckpointManager
from fastckpt.train.checkpoint import apply_checkpoint, load_checkpoint, save_checkpoint
from fastckpt.train import ShuffledTokenBatches
from fastckpt.train.reference.selfcheck import build_fresh, byte_equal, capture_full_state, first_difference, \
    train_n_steps


def _trained(seed=42):
    objs = build_fresh(seed, vocab=16, dim=8, hidden=16, num_tokens=400)
    train_n_steps(objs, 3)
    return objs


def test_a_state_that_does_not_fit_late_in_the_restore_changes_nothing(tmp_path):
    # The data iterator refuses its state (another data set) only when it is applied, after the model, the
    # optimizer and the scheduler: they were left overwritten, a half-restored run.
    saved = _trained(1)
    save_checkpoint(*saved.save_args(), tmp_path / "c", step=3, scaler=saved.scaler)
    live = _trained(2)
    other_data = ShuffledTokenBatches((np.arange(400) * 7) % 16, batch_size=live.data_iter.batch_size,
                                      seq_len=live.data_iter.seq_len, seed=5)
    live.data_iter = other_data
    before = capture_full_state(live)
    state = load_checkpoint(tmp_path / "c")
    with pytest.raises(ValueError, match="data_sha256") as err:
        apply_checkpoint(state, *live.save_args(), scaler=live.scaler)
    assert "nothing was changed" in " ".join(err.value.__notes__)
    after = capture_full_state(live)
    assert first_difference(before, after) is None  # model, optimizer, scheduler, RNG, scaler: untouched
    assert live.optimizer.lr == before["optimizer"]["lr"]  # the scheduler's side effect on the optimizer undone


def test_a_state_that_fails_its_check_is_refused_before_anything_is_applied(tmp_path):
    saved = _trained(1)
    save_checkpoint(*saved.save_args(), tmp_path / "c", step=3, scaler=saved.scaler)
    live = _trained(2)
    live.train_rng = np.random.Generator(np.random.SFC64(3))  # the saved state is PCG64's
    before = capture_full_state(live)
    with pytest.raises(ValueError, match=r"train_rng: state for numpy.random.Generator \(SFC64\) does not fit") as err:
        apply_checkpoint(load_checkpoint(tmp_path / "c"), *live.save_args(), scaler=live.scaler)
    assert "nothing was changed" in " ".join(err.value.__notes__)
    assert byte_equal(before, capture_full_state(live))


def test_a_model_of_another_shape_is_refused_naming_the_tensor_and_changes_nothing(tmp_path):
    saved = _trained(1)
    save_checkpoint(*saved.save_args(), tmp_path / "c", step=3)
    live = build_fresh(2, vocab=16, dim=8, hidden=32, num_tokens=400)
    before = capture_full_state(live)
    with pytest.raises(ValueError, match=r"model\['fc1.weight'\]: the checkpoint holds shape \[8, 16\], the object "
                                         r"\[8, 32\]"):
        apply_checkpoint(load_checkpoint(tmp_path / "c"), *live.save_args())
    assert byte_equal(before, capture_full_state(live))


def test_any_training_state_shape_round_trips_through_the_manager(tmp_path):
    a, b = _trained(1), _trained(3)
    ema = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "decay": 0.999, "steps": [1, 2], "on": True}
    gens = {"numpy": np.random.default_rng(5), "python": random.Random(6), "global": GlobalRNG()}
    for g in (gens["numpy"], gens["python"]):
        g.random()
    mgr = CheckpointManager(tmp_path / "run", fsync=False)
    mgr.save(7, {"net": a.model, "ema": ema}, [a.optimizer, b.optimizer], {"main": a.scheduler}, a.data_iter, gens,
             scaler=a.scaler)
    want = {"numpy": gens["numpy"].random(), "python": gens["python"].random(), "global": random.random()}
    fresh_a, fresh_b = build_fresh(7, vocab=16, dim=8, hidden=16, num_tokens=400), \
        build_fresh(8, vocab=16, dim=8, hidden=16, num_tokens=400)
    ema_back = {"w": np.zeros((2, 3), np.float32), "decay": 0.0, "steps": [0, 0], "on": False}
    ema_w = ema_back["w"]
    gens_back = {"numpy": np.random.default_rng(0), "python": random.Random(0), "global": GlobalRNG()}
    state = mgr.restore_latest({"net": fresh_a.model, "ema": ema_back}, [fresh_a.optimizer, fresh_b.optimizer],
                               {"main": fresh_a.scheduler}, fresh_a.data_iter, gens_back, scaler=fresh_a.scaler)
    assert state.report.complete and "model['ema']['w']" in state.report.restored
    assert ema_back["w"] is ema_w and ema_w.tolist() == ema["w"].tolist()  # an array is restored into
    assert ema_back == {**ema_back, "decay": 0.999, "steps": [1, 2], "on": True} and type(ema_back["on"]) is bool
    assert byte_equal(capture_full_state(fresh_a)["model"], a.model.state_dict())
    assert byte_equal(fresh_a.optimizer.state_dict(), a.optimizer.state_dict())
    assert byte_equal(fresh_b.optimizer.state_dict(), b.optimizer.state_dict())
    got = {"numpy": gens_back["numpy"].random(), "python": gens_back["python"].random(), "global": random.random()}
    assert got == want


def test_strict_false_restores_a_subset_and_reports_what_was_missing_or_extra(tmp_path):
    saved = _trained(1)
    save_checkpoint({"net": saved.model, "old": {"w": np.ones(2)}}, saved.optimizer, None, None, None,
                    tmp_path / "c", step=1)
    live = build_fresh(2, vocab=16, dim=8, hidden=16, num_tokens=400)
    new = {"w": np.zeros(3)}
    before = capture_full_state(live)
    with pytest.raises(ValueError, match=r"model: the checkpoint holds 'old', which the given dict lacks"):
        apply_checkpoint(load_checkpoint(tmp_path / "c"), {"net": live.model, "new": new}, live.optimizer)
    assert byte_equal(before, capture_full_state(live))
    report = apply_checkpoint(load_checkpoint(tmp_path / "c"), {"net": live.model, "new": new}, live.optimizer,
                              live.scheduler, strict=False)
    assert report.unexpected == ["model['old']"] and report.missing == ["model['new']", "scheduler"]
    assert report.restored == ["model['net']", "optimizer"] and not report.complete
    assert byte_equal(live.model.state_dict(), saved.model.state_dict()) and new["w"].tolist() == [0, 0, 0]
    assert byte_equal(live.scheduler.state_dict(), before["scheduler"])


def test_what_cannot_be_checkpointed_is_named_with_the_way_out(tmp_path):
    with pytest.raises(TypeError, match=r"model\['hook'\] \(a builtins.function\) cannot be checkpointed: .* "
                                        r"several objects go in a dict or a list"):
        save_checkpoint({"hook": lambda: 0}, None, None, None, None, tmp_path / "c", step=0)
    assert not (tmp_path / "c").exists()
    save_checkpoint({"pair": (np.zeros(2), 3)}, None, None, None, None, tmp_path / "t", step=0)
    target = {"pair": (np.ones(2), 4)}
    with pytest.raises(TypeError, match=r"model\['pair'\]\[1\]: a int inside a tuple cannot be restored in place"):
        apply_checkpoint(load_checkpoint(tmp_path / "t"), target)
    assert target["pair"][0].tolist() == [1, 1]  # checked before anything was applied


# -- torch ------------------------------------------------------------------------------------------
def test_a_torch_generator_round_trips_exactly_and_a_failed_restore_leaves_torch_objects_untouched(tmp_path):
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    gen = torch.Generator().manual_seed(11)
    model(torch.randn(3, 4, generator=gen)).sum().backward()
    opt.step()
    sched.step()
    mgr = CheckpointManager(tmp_path / "run", fsync=False)
    mgr.save(1, model, opt, sched, None, {"torch": gen, "global": GlobalRNG()})
    want = (torch.rand(5, generator=gen), torch.rand(5))

    torch.manual_seed(1)
    fresh = torch.nn.Linear(4, 2)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.01)
    fresh_sched = torch.optim.lr_scheduler.StepLR(fresh_opt, step_size=2)
    fresh_gen = torch.Generator().manual_seed(99)
    # It failed with "expected a torch.ByteTensor, but got numpy.ndarray while applying the train_rng state",
    # after the model, optimizer and scheduler were overwritten.
    state = mgr.restore_latest(fresh, fresh_opt, fresh_sched, None, {"torch": fresh_gen, "global": GlobalRNG()})
    assert state.report.complete
    assert torch.equal(torch.rand(5, generator=fresh_gen), want[0]) and torch.equal(torch.rand(5), want[1])
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))
    assert fresh_sched.state_dict() == sched.state_dict()
    # the issue's own call: a torch.Generator as train_rng
    save_checkpoint(model, None, None, None, gen, tmp_path / "g", step=0)
    after = torch.rand(3, generator=gen)
    direct = torch.Generator()
    apply_checkpoint(load_checkpoint(tmp_path / "g"), fresh, train_rng=direct)
    assert torch.equal(torch.rand(3, generator=direct), after)

    # a generator state that does not fit (a CUDA-sized or damaged state) changes nothing
    other = torch.nn.Linear(4, 2)
    other_opt = torch.optim.AdamW(other.parameters(), lr=0.5)
    weights = {k: v.clone() for k, v in other.state_dict().items()}
    bad = load_checkpoint(mgr.latest())
    bad.train_rng_state["torch"] = bad.train_rng_state["torch"][:100]
    with pytest.raises(ValueError, match=r"train_rng\['torch'\]: state for torch.*does not fit"):
        apply_checkpoint(bad, other, other_opt, None, None, {"torch": torch.Generator(), "global": GlobalRNG()})
    assert all(torch.equal(other.state_dict()[k], v) for k, v in weights.items())
    assert other_opt.state_dict()["param_groups"][0]["lr"] == 0.5 and not other_opt.state_dict()["state"]

    # a state refused only when it is applied (torch's GradScaler, after the optimizer and the scheduler were
    # restored): those are put back, and the model was not touched
    other_sched = torch.optim.lr_scheduler.StepLR(other_opt, step_size=7)
    sched_before = other_sched.state_dict()
    empty = load_checkpoint(mgr.latest())
    empty.scaler_state = {}
    with pytest.raises(RuntimeError, match="source state dict is empty") as err:
        apply_checkpoint(empty, other, other_opt, other_sched, scaler=torch.amp.GradScaler("cpu"))
    assert "while restoring scaler; nothing was changed (it and the 2 states applied before it put back from " \
           "copies)" in " ".join(err.value.__notes__)
    assert all(torch.equal(other.state_dict()[k], v) for k, v in weights.items())
    assert other_opt.state_dict()["param_groups"][0]["lr"] == 0.5 and not other_opt.state_dict()["state"]
    assert other_sched.state_dict() == sched_before


def test_a_torch_model_with_a_new_head_fine_tunes_from_a_checkpoint_with_strict_false(tmp_path):
    torch = pytest.importorskip("torch")
    body = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 3))
    save_checkpoint(body, None, None, None, None, tmp_path / "c", step=0)
    tuned = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 5))  # another head
    with pytest.raises(ValueError, match=r"model\['1.weight'\]: the checkpoint holds shape \[3, 4\]"):
        apply_checkpoint(load_checkpoint(tmp_path / "c"), tuned, strict=False)
    tuned = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Sequential(torch.nn.Linear(4, 5)))
    head = tuned[1][0].weight.detach().clone()
    report = apply_checkpoint(load_checkpoint(tmp_path / "c"), tuned, strict=False)
    assert report.missing == ["model['1.0.weight']", "model['1.0.bias']"]
    assert report.unexpected == ["model['1.weight']", "model['1.bias']"]
    assert torch.equal(tuned[0].weight, body[0].weight) and torch.equal(tuned[1][0].weight, head)
