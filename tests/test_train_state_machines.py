"""The reference state machines: optimizers, schedulers, loss scaler, data iterator, TinyLM."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest

from fastckpt.train.reference.data import ShuffledTokenBatches
from fastckpt.train.reference.model import Parameter, TinyLM
from fastckpt.train.reference.optim import SGD, Adam, AdamW
from fastckpt.train.reference.scaler import GradScaler
from fastckpt.train.reference.sched import CosineWarmupLR, ReduceLROnPlateau, StepLR
from fastckpt.train.reference.selfcheck import build_fresh, byte_equal, train_n_steps


def _params(seed=0):
    rng = np.random.default_rng(seed)
    return [Parameter(rng.standard_normal((3, 4)).astype(np.float32)), Parameter(rng.standard_normal(5).astype(np.float32))]


def _grads(params, seed):
    rng = np.random.default_rng(seed)
    for p in params:
        p.grad = rng.standard_normal(p.data.shape).astype(np.float32)


OPTS = {
    "sgd": lambda ps: SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    "adam": lambda ps: Adam(ps, lr=0.01, weight_decay=0.01),
    "adamw": lambda ps: AdamW(ps, lr=0.01, weight_decay=0.1),
}


@pytest.mark.parametrize("name", OPTS)
def test_optimizer_state_roundtrip_continues_identically(name):
    a_params = _params()
    a = OPTS[name](a_params)
    for s in range(3):
        _grads(a_params, s)
        a.step()
    b_params = _params(seed=9)
    b = OPTS[name](b_params)
    for p, q in zip(b_params, a_params):
        p.data[...] = q.data
    b.load_state_dict(copy.deepcopy(a.state_dict()))
    assert byte_equal(a.state_dict(), b.state_dict())
    for s in range(3, 6):
        _grads(a_params, s)
        _grads(b_params, s)
        a.step()
        b.step()
    assert all(p.data.tobytes() == q.data.tobytes() for p, q in zip(a_params, b_params))


def test_adam_step_count_matters():
    """Losing t changes the bias correction and hence the next update (why t is saved)."""
    ps = _params()
    opt = Adam(ps, lr=0.01)
    for s in range(5):
        _grads(ps, s)
        opt.step()
    state = copy.deepcopy(opt.state_dict())
    results = []
    for t in (state["t"], 0):
        qs = _params()
        for p, q in zip(qs, ps):
            p.data[...] = q.data
        o = Adam(qs, lr=0.01)
        o.load_state_dict(dict(state, t=t))
        _grads(qs, 99)
        o.step()
        results.append(qs[0].data.tobytes())
    assert results[0] != results[1]


def test_adamw_decay_is_decoupled():
    p = Parameter(np.full(4, 2.0, np.float32))
    opt = AdamW([p], lr=0.1, weight_decay=0.5)
    p.grad = np.zeros(4, np.float32)
    opt.step()
    assert p.data.tolist() == [np.float32(2.0) * np.float32(1 - 0.1 * 0.5)] * 4


def test_tied_parameter_is_updated_once():
    p = Parameter(np.zeros(2, np.float32))
    opt = SGD([p, p], lr=1.0)
    p.grad = np.ones(2, np.float32)
    opt.step()
    assert len(opt.params) == 1 and p.data.tolist() == [-1.0, -1.0]


@pytest.mark.parametrize("mutate, match", [
    (lambda s: s.update(type="SGD"), "state is for"),
    (lambda s: s["state"].pop(), "parameters"),
    (lambda s: s["state"][0].update(m=np.zeros((4, 3), np.float32)), "buffer 'm'"),
    (lambda s: s["state"][1].update(v=np.zeros(5, np.float64)), "buffer 'v'"),
    (lambda s: s["state"][0].pop("v"), "buffers"),
    (lambda s: s["hyper"].pop("eps"), "missing hyperparameters"),
])
def test_optimizer_load_validates_before_changing_anything(mutate, match):
    ps = _params()
    opt = Adam(ps, lr=0.01)
    _grads(ps, 0)
    opt.step()
    before = copy.deepcopy(opt.state_dict())
    bad = copy.deepcopy(before)
    bad["state"][0]["m"] = bad["state"][0]["m"] + 1  # would change state if applied early
    mutate(bad)
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(bad)
    assert byte_equal(before, opt.state_dict())


def _opt():
    return SGD([Parameter(np.zeros(1, np.float32))], lr=1.0)


def test_step_lr_values():
    opt = _opt()
    sched = StepLR(opt, step_size=2, gamma=0.5)
    lrs = [opt.lr]
    for _ in range(5):
        sched.step()
        lrs.append(opt.lr)
    assert lrs == [1.0, 1.0, 0.5, 0.5, 0.25, 0.25]


def test_cosine_warmup_values():
    opt = _opt()
    sched = CosineWarmupLR(opt, warmup_steps=4, total_steps=8, min_lr=0.1)
    lrs = [opt.lr]
    for _ in range(9):
        sched.step()
        lrs.append(opt.lr)
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]
    assert lrs[6] == 0.1 + 0.45 * (1 + math.cos(math.pi * 0.5))
    assert lrs[8] == lrs[9] == 0.1


def test_plateau_reduces_and_cools_down():
    opt = _opt()
    sched = ReduceLROnPlateau(opt, factor=0.5, patience=1, cooldown=2)
    lrs = []
    for metric in [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.5]:
        sched.step(metric)
        lrs.append(opt.lr)
    assert lrs == [1.0, 1.0, 0.5, 0.5, 0.5, 0.5, 0.25, 0.25]


@pytest.mark.parametrize("make", [
    lambda o: StepLR(o, step_size=3, gamma=0.3),
    lambda o: CosineWarmupLR(o, warmup_steps=3, total_steps=10),
    lambda o: ReduceLROnPlateau(o, factor=0.5, patience=1, cooldown=1),
])
def test_scheduler_resume_mid_schedule(make):
    metrics = [3.0, 2.0, 2.5, 2.5, 2.5, 2.5, 1.0, 1.2, 1.3, 1.4, 1.5, 1.6]
    a_opt = _opt()
    a = make(a_opt)
    for m in metrics[:5]:
        a.step(m)
    b_opt = _opt()
    b = make(b_opt)
    b.load_state_dict(copy.deepcopy(a.state_dict()))
    assert b_opt.lr == a_opt.lr
    for m in metrics[5:]:
        a.step(m)
        b.step(m)
        assert b_opt.lr == a_opt.lr
    assert a.state_dict() == b.state_dict()


def test_scheduler_refuses_other_type():
    with pytest.raises(ValueError, match="state is for"):
        StepLR(_opt(), 2).load_state_dict(CosineWarmupLR(_opt(), 1, 2).state_dict())


def test_grad_scaler_backoff_growth_and_skip():
    p = Parameter(np.zeros(2, np.float32))
    opt = SGD([p], lr=1.0)
    s = GradScaler(init_scale=8.0, growth_interval=2)
    history = []
    for g in [16.0, 16.0, np.inf, 32.0, 32.0]:
        p.grad = np.full(2, g, np.float32)
        stepped = s.step(opt)
        s.update()
        history.append((stepped, s.scale, s.growth_tracker))
    assert history == [(True, 8.0, 1), (True, 16.0, 0), (False, 8.0, 0), (True, 8.0, 1), (True, 16.0, 0)]
    assert opt.t == 4 and p.data.tolist() == [-2.0 - 2.0 - 4.0 - 4.0] * 2
    other = GradScaler()
    other.load_state_dict(s.state_dict())
    assert other.state_dict() == s.state_dict()


def test_grad_scaler_unscale_twice_is_an_error():
    opt = SGD([Parameter(np.zeros(1, np.float32))], lr=1.0)
    s = GradScaler()
    s.unscale_(opt)
    with pytest.raises(RuntimeError, match="twice"):
        s.unscale_(opt)


def _tokens(n=401):
    return np.arange(n, dtype=np.int32) % 97


def test_data_epoch_visits_every_window_once():
    it = ShuffledTokenBatches(np.arange(401, dtype=np.int32), batch_size=4, seq_len=10, seed=3)
    batches = [next(it) for _ in range(it.batches_per_epoch)]
    starts = np.concatenate([x[:, 0] for x, _ in batches])
    assert it.num_samples == 40 and np.array_equal(np.sort(starts), np.arange(40) * 10)
    assert all(np.array_equal(y, x + 1) for x, y in batches)
    next(it)
    assert it.epoch == 1 and it.position == 1


def test_data_epochs_are_shuffled_differently():
    it = ShuffledTokenBatches(np.arange(401, dtype=np.int32), batch_size=4, seq_len=10, seed=3)
    e0 = np.concatenate([next(it)[0][:, 0] for _ in range(10)])
    e1 = np.concatenate([next(it)[0][:, 0] for _ in range(10)])
    assert sorted(e0.tolist()) == sorted(e1.tolist()) and e0.tolist() != e1.tolist()


@pytest.mark.parametrize("taken", [0, 3, 10, 11, 25])
def test_data_resume_mid_epoch(taken):
    a = ShuffledTokenBatches(_tokens(), batch_size=4, seq_len=10, seed=5)
    for _ in range(taken):
        next(a)
    b = ShuffledTokenBatches(_tokens(), batch_size=4, seq_len=10, seed=5)
    b.load_state_dict(copy.deepcopy(a.state_dict()))
    for _ in range(15):
        (xa, ya), (xb, yb) = next(a), next(b)
        assert np.array_equal(xa, xb) and np.array_equal(ya, yb)


@pytest.mark.parametrize("key, value, match", [
    ("data_sha256", "0" * 64, r"data_sha256 is '0{64}' in the state but '[0-9a-f]{64}' here; build the iterator over the same data"),
    ("batch_size", 8, r"batch_size is 8 in the state but 4 here"),
    ("seq_len", 9, r"seq_len is 9 in the state but 10 here"),
    ("position", 99, r"position 99 outside 0\.\.10"),
    ("type", "Other", r"state is for 'Other'"),
])
def test_data_load_refuses_mismatch(key, value, match):
    it = ShuffledTokenBatches(_tokens(), batch_size=4, seq_len=10, seed=5)
    state = dict(it.state_dict(), **{key: value})
    with pytest.raises(ValueError, match=match):
        it.load_state_dict(state)
    assert it.position == 0


def test_data_too_small_is_refused():
    with pytest.raises(ValueError, match="smaller batch_size"):
        ShuffledTokenBatches(np.arange(20), batch_size=4, seq_len=10, seed=0)


def test_training_is_deterministic():
    assert np.array(train_n_steps(build_fresh(3), 8)).tobytes() == np.array(train_n_steps(build_fresh(3), 8)).tobytes()


@pytest.mark.parametrize("tie", [True, False])
def test_tinylm_gradients_match_finite_differences(tie):
    # A numerical check of the hand-written backward pass (float64 copy, no dropout).
    model = TinyLM(vocab=11, dim=5, hidden=7, tie_weights=tie, dropout=0.0, seed=1)
    for _, p in model.named_parameters():
        p.data = p.data.astype(np.float64)
    if tie:
        model.lm_head.weight = model.embed.weight
    x = np.array([[1, 2, 3, 4], [5, 6, 7, 8]])
    y = np.array([[2, 3, 4, 5], [6, 7, 8, 9]])
    model.forward_backward(x, y, np.random.default_rng(0))
    for name, p in model.named_parameters():
        grad = p.grad.copy()
        for idx in [(0,) * p.data.ndim, tuple(s - 1 for s in p.data.shape)]:
            old = p.data[idx]
            p.data[idx] = old + 1e-6
            up = float(model.forward_backward(x, y, np.random.default_rng(0)))
            p.data[idx] = old - 1e-6
            down = float(model.forward_backward(x, y, np.random.default_rng(0)))
            p.data[idx] = old
            assert abs((up - down) / 2e-6 - grad[idx]) < 1e-4, (name, idx)


def test_tinylm_load_state_dict_checks():
    m = TinyLM(vocab=8, dim=4, hidden=8)
    sd = {k: v.copy() for k, v in m.state_dict().items()}
    with pytest.raises(KeyError, match="missing keys"):
        m.load_state_dict({k: v for k, v in sd.items() if k != "fc1.bias"})
    with pytest.raises(ValueError, match="expected float32"):
        m.load_state_dict(dict(sd, **{"fc1.bias": sd["fc1.bias"].astype(np.float64)}))
    with pytest.raises(ValueError, match="ties"):
        m.load_state_dict(dict(sd, **{"lm_head.weight": sd["embed.weight"] + 1}))
