"""AdamW and SGD against NumPy reference formulas, the schedule's values, clipping (also with
gradients split over pretend ranks), default weight-decay groups, state_dict round trips.
Parameters and gradients come from the `xp` fixture (--device cuda: cupy), references are
computed with numpy on the host."""
import math

import numpy as np
import pytest

from minidist.backend import to_host as H
from minidist.nn import Parameter
from minidist.optim import (SGD, AdamW, WarmupCosine, WarmupStableDecay, adamw_update,
                            clip_grad_norm, warmup_cosine, warmup_stable_decay)


def _params(xp, seed=0, dtype=np.float64):
    r = np.random.default_rng(seed)
    w = Parameter(xp.asarray(r.standard_normal((4, 3)).astype(dtype)))
    b = Parameter(xp.asarray(r.standard_normal(3).astype(dtype)), decay=False)
    return [("w", w), ("b", b)]


def _grads(xp, step, shapes, dtype=np.float64):
    r = np.random.default_rng(100 + step)
    return [xp.asarray(r.standard_normal(s).astype(dtype)) for s in shapes]


def _reference_adamw(p, grads, lr, b1, b2, eps, wd):
    """Textbook AdamW (Loshchilov & Hutter / torch.optim.AdamW), written out plainly."""
    p, m, v = p.copy(), np.zeros_like(p), np.zeros_like(p)
    for t, g in enumerate(grads, start=1):
        p = p - lr * wd * p
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        m_hat, v_hat = m / (1 - b1 ** t), v / (1 - b2 ** t)
        p = p - lr * m_hat / (np.sqrt(v_hat) + eps)
    return p


def test_adamw_matches_reference_and_skips_decay_on_biases(xp):
    named = _params(xp)
    start = {n: H(p.data).copy() for n, p in named}
    opt = AdamW(named, lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    history = {"w": [], "b": []}
    for step in range(5):
        gw, gb = _grads(xp, step, [(4, 3), (3,)])
        named[0][1].grad, named[1][1].grad = gw, gb
        history["w"].append(H(gw))
        history["b"].append(H(gb))
        opt.step()
    for (name, p), wd in zip(named, (0.1, 0.0)):
        ref = _reference_adamw(start[name], history[name], 0.01, 0.9, 0.95, 1e-8, wd)
        np.testing.assert_allclose(H(p.data), ref, rtol=1e-12, atol=1e-14, err_msg=name)


def test_adamw_update_float32_stays_float32_in_place(xp):
    p = xp.ones(10, np.float32)
    g, m, v = xp.full(10, 0.5, np.float32), xp.zeros(10, np.float32), xp.zeros(10, np.float32)
    ids = (id(p), id(m), id(v))
    adamw_update(p, g, m, v, step=1, lr=0.1, weight_decay=0.1)
    assert p.dtype == m.dtype == v.dtype == np.float32 and ids == (id(p), id(m), id(v))
    np.testing.assert_allclose(H(p), 1 - 0.1 * 0.1 - 0.1, rtol=1e-6)  # first step moves by lr


def test_sgd_momentum_matches_reference(xp):
    named = _params(xp, 1)
    w0 = H(named[0][1].data).copy()
    opt = SGD(named, lr=0.1, momentum=0.9, weight_decay=0.01)
    p, buf = w0.copy(), None
    for step in range(4):
        gw, gb = _grads(xp, step, [(4, 3), (3,)])
        named[0][1].grad, named[1][1].grad = gw, gb
        opt.step()
        g = H(gw) + 0.01 * p
        buf = g if buf is None else 0.9 * buf + g
        p = p - 0.1 * buf
    np.testing.assert_allclose(H(named[0][1].data), p, rtol=1e-12)


def test_params_without_grad_are_skipped_and_zero_grad_clears(xp):
    named = _params(xp)
    before = H(named[1][1].data).copy()
    opt = AdamW(named)
    named[0][1].grad = xp.ones((4, 3))
    opt.step()
    np.testing.assert_array_equal(H(named[1][1].data), before)
    opt.zero_grad()
    assert all(p.grad is None for _, p in named)


def test_optimizer_state_dict_round_trip_continues_identically(xp):
    a, b = _params(xp), _params(xp)
    opt_a, opt_b = AdamW(a, lr=0.01), AdamW(b, lr=0.01)
    for step in range(3):
        for named in (a, b):
            named[0][1].grad, named[1][1].grad = _grads(xp, step, [(4, 3), (3,)])
        opt_a.step()
        opt_b.step()
    saved = opt_a.state_dict()
    fresh = _params(xp)
    for (_, pf), (_, pa) in zip(fresh, a):
        pf.data = pa.data.copy()
    opt_c = AdamW(fresh, lr=0.5)
    opt_c.load_state_dict(saved)
    assert opt_c.param_groups[0]["lr"] == 0.01
    for named, opt in ((b, opt_b), (fresh, opt_c)):
        named[0][1].grad, named[1][1].grad = _grads(xp, 9, [(4, 3), (3,)])
        opt.step()
    for (_, pb), (_, pc) in zip(b, fresh):
        np.testing.assert_array_equal(H(pb.data), H(pc.data))


def test_optimizer_state_dict_rejects_wrong_shapes(xp):
    named = _params(xp)
    opt = AdamW(named)
    named[0][1].grad, named[1][1].grad = xp.ones((4, 3)), xp.ones(3)
    opt.step()
    sd = opt.state_dict()
    sd["state"]["w"]["exp_avg"] = np.zeros((2, 2))
    with pytest.raises(ValueError, match="w.exp_avg has shape"):
        AdamW(_params(xp)).load_state_dict(sd)


def test_warmup_cosine_values():
    lr, warmup, total, floor = 1.0, 10, 110, 0.1
    assert warmup_cosine(0, lr, warmup, total, floor) == pytest.approx(0.1)
    assert warmup_cosine(9, lr, warmup, total, floor) == pytest.approx(1.0)
    assert warmup_cosine(10, lr, warmup, total, floor) == pytest.approx(1.0)
    assert warmup_cosine(60, lr, warmup, total, floor) == pytest.approx(0.55)
    assert warmup_cosine(110, lr, warmup, total, floor) == pytest.approx(0.1)
    assert warmup_cosine(500, lr, warmup, total, floor) == pytest.approx(0.1)
    sched = WarmupCosine(lr, warmup, total, floor)
    values = [sched(s) for s in range(warmup, total)]
    assert all(x >= y for x, y in zip(values, values[1:]))        # monotone decay


def test_warmup_stable_decay_values_worked_by_hand():
    """lr 1, warmup 2, 10 steps, the last 4 decaying to 0.1 along 1 - sqrt: steps 0, 1 warm
    up (0.5, 1); 2..5 hold 1; step 6 is a quarter into the decay, 0.1 + 0.9 (1 - 1/2) = 0.55;
    step 7 half, 0.1 + 0.9 (1 - sqrt(1/2)); step 9, the last, reaches 0.1. A longer run
    (20 steps) has the same rates until its own decay begins (step 16)."""
    lr, warmup, total, decay, floor = 1.0, 2, 10, 4, 0.1
    got = [warmup_stable_decay(s, lr, warmup, total, decay, floor) for s in range(12)]
    want = [0.5, 1, 1, 1, 1, 1, 0.55, 0.1 + 0.9 * (1 - 0.5 ** 0.5),
            0.1 + 0.9 * (1 - 0.75 ** 0.5), 0.1, 0.1, 0.1]
    assert got == pytest.approx(want, abs=1e-15)
    longer = WarmupStableDecay(lr, warmup, 20, decay, floor)
    assert [longer(s) for s in range(6)] == got[:6] and longer(15) == 1.0 > longer(16)


def test_clip_grad_norm_scales_to_max_norm(xp):
    grads = [xp.full((2, 2), 3.0), xp.full(1, 4.0)]       # norm sqrt(4*9 + 16) = sqrt(52)
    norm = clip_grad_norm(grads, max_norm=1.0)
    assert norm == pytest.approx(math.sqrt(52))
    assert math.sqrt(sum(float((g ** 2).sum()) for g in grads)) == pytest.approx(1.0, rel=1e-5)
    small = [xp.full(3, 0.1)]
    clip_grad_norm(small, max_norm=1.0)
    np.testing.assert_array_equal(H(small[0]), np.full(3, 0.1))   # under the limit: untouched


def test_clip_grad_norm_with_gradients_spread_over_ranks(xp):
    """Two pretend ranks each hold half the gradients; the callable plays all-reduce(sum)."""
    r = np.random.default_rng(0)
    full = [r.standard_normal(5) for _ in range(4)]
    expected = math.sqrt(sum((g ** 2).sum() for g in full))
    shards = [[xp.asarray(g) for g in full[:2]], [xp.asarray(g) for g in full[2:]]]
    local = [sum(float((g ** 2).sum()) for g in s) for s in shards]
    norms = [clip_grad_norm(shards[k], 0.5, sum_sq_across_ranks=lambda x: sum(local))
             for k in range(2)]
    assert norms == [pytest.approx(expected)] * 2
    clipped = shards[0] + shards[1]
    assert math.sqrt(sum(float((g ** 2).sum()) for g in clipped)) == pytest.approx(0.5,
                                                                                   rel=1e-5)
