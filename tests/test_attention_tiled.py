"""Tiled (FlashAttention-style) attention, minidist/autograd/flash.py: equal to the materialised
attention in float64 (values and gradients, 1e-12), causal tiles above the diagonal never
touched, the tile/FLOP count, partial results over disjoint key chunks merged, O(T) saved
memory, and the GPT picking it from its config / --attention.

Run: python -m pytest -q tests/test_attention_tiled.py
"""
import re

import numpy as np
import pytest

from minidist.autograd import Tensor, fused as F
from minidist.autograd import flash
from minidist.autograd.dropout_keys import DropoutKeys, DropoutSite
from minidist.nn import GPT, GPTConfig
from minidist.optim import AdamW
from minidist.train.args import train_parser
from minidist.strategy.checkpoint import load_checkpoint, save_checkpoint
from minidist.strategy.memory import activation_bytes
from minidist.train.activations import minidist_activation_bytes
from mpirun import ROOT


def randn(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape)


def grads(fn, arrays, g):
    ts = [Tensor(a.copy(), requires_grad=True) for a in arrays]
    y = fn(*ts)
    y.backward(g)
    return y.data, [t.grad for t in ts]


def _site(name="transformer.h.0.attn.attn_dropout", seed=3, axis=None, parts=1, index=0):
    return DropoutSite(DropoutKeys(seed), name, axis, parts, index)


@pytest.mark.parametrize("T, block", [(7, 3), (16, 4), (33, 8), (12, 64)])
def test_tiled_dropout_equals_materialised_dropout_float64(T, block):
    """Dropout 0.3 on the attention weights: the tiles' numbers, computed a tile at a time
    forward and again backward, are the materialised mask's (the same keyed site), so the
    outputs and gradients are equal to 1e-12; a tensor-parallel rank's heads too."""
    q, k, v = (randn(2, 3, T, 5, seed=i) for i in range(3))
    g = randn(2, 3, T, 5, seed=9)
    for site in (_site(), _site(axis=1, parts=2, index=1)):
        y0, d0 = grads(lambda *a: F.causal_attention(*a, 0.3, site), [q, k, v], g)
        y1, d1 = grads(lambda *a: flash.tiled_attention(*a, block, 0.3, site), [q, k, v], g)
        np.testing.assert_allclose(y1, y0, rtol=0, atol=1e-12)
        for a, b in zip(d1, d0):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-12)
    y_undropped = flash.tiled_attention(*(Tensor(a) for a in (q, k, v)), block).data
    assert np.abs(y1 - y_undropped).max() > 1e-3                       # something dropped


def test_tiled_dropout_backward_redraws_its_forwards_numbers_whenever_it_runs():
    """A pipeline runs a micro-batch's backward after later forwards moved the keys on (other
    rows, another step): the gradients are those of a backward run at once."""
    q, k, v = (randn(2, 2, 12, 4, seed=i) for i in range(3))
    g = randn(2, 2, 12, 4, seed=9)
    site = _site()
    keys = site.keys
    with keys.rows_of([4, 5]):                                         # at once
        _, want = grads(lambda *a: flash.tiled_attention(*a, 4, 0.3, site), [q, k, v], g)
    ts = [Tensor(a.copy(), requires_grad=True) for a in (q, k, v)]
    with keys.rows_of([4, 5]):
        y = flash.tiled_attention(*ts, 4, 0.3, site)
    keys.next_step()
    with keys.rows_of([0, 1]):                                         # later, keys moved
        y.backward(g)
    for t, w in zip(ts, want):
        np.testing.assert_allclose(t.grad, w, rtol=0, atol=1e-12)
    with keys.rows_of([0, 1]):
        _, other = grads(lambda *a: flash.tiled_attention(*a, 4, 0.3, site), [q, k, v], g)
    assert not np.allclose(other[0], want[0])                          # moved keys: other masks


def test_tiled_dropout_needs_keyed_numbers():
    q = Tensor(randn(1, 1, 4, 2))
    with pytest.raises(TypeError, match="DropoutSite"):
        flash.tiled_attention(q, q, q, 4, 0.1, np.random.default_rng(0))


@pytest.mark.parametrize("T, block", [(1, 4), (7, 3), (16, 4), (33, 8), (12, 64), (9, 1)])
def test_tiled_equals_materialised_float64(T, block):
    q, k, v = (randn(2, 3, T, 5, seed=i) for i in range(3))
    g = randn(2, 3, T, 5, seed=9)
    y0, d0 = grads(F.causal_attention, [q, k, v], g)
    y1, d1 = grads(lambda *a: flash.tiled_attention(*a, block=block), [q, k, v], g)
    np.testing.assert_allclose(y1, y0, rtol=0, atol=1e-12)
    for a, b in zip(d1, d0):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-12)


@pytest.mark.parametrize("T, block", [(10, 4), (32, 8)])
def test_tiled_self_attention_equals_materialised(T, block):
    qkv, g = randn(2, T, 24, seed=1), randn(2, T, 8, seed=2)
    y0, (d0,) = grads(lambda x: F.causal_self_attention(x, 2), [qkv], g)
    y1, (d1,) = grads(lambda x: flash.tiled_self_attention(x, 2, block), [qkv], g)
    np.testing.assert_allclose(y1, y0, rtol=0, atol=1e-12)
    np.testing.assert_allclose(d1, d0, rtol=0, atol=1e-12)


def test_future_tiles_are_never_read():
    """Keys and values from position `block` on are NaN: had any tile above the diagonal of
    the first row block been computed (even masked: NaN - inf is NaN), its rows would be NaN."""
    block, T = 4, 12
    q, k, v = (randn(1, 2, T, 3, seed=i) for i in range(3))
    k_bad, v_bad = k.copy(), v.copy()
    k_bad[..., block:, :] = np.nan
    v_bad[..., block:, :] = np.nan
    clean = flash.tiled_attention(*(Tensor(a) for a in (q, k, v)), block=block).data
    dirty = flash.tiled_attention(*(Tensor(a) for a in (q, k_bad, v_bad)), block=block).data
    np.testing.assert_array_equal(dirty[..., :block, :], clean[..., :block, :])


def test_causal_counts_about_half_the_tiles_and_flops():
    c = flash.attention_flops(1024, 32, 64)
    n = 1024 // 64
    assert (c["tiles"], c["tiles_full"]) == (n * (n + 1) // 2, n * n)          # 136 of 256
    assert c["flops"] == 4 * 64 * 64 * 32 * c["tiles"]
    assert c["flops_full"] == 4 * 1024 * 1024 * 32
    assert c["flops"] / c["flops_full"] == pytest.approx((n + 1) / (2 * n))    # 0.53
    one = flash.attention_flops(256, 8, 1)                 # tiles of one: exactly the triangle
    assert one["flops"] == 4 * 8 * 256 * 257 // 2
    full = flash.attention_flops(100, 8, 16, causal=False)  # uneven edge tiles, whole square
    assert full["flops"] == full["flops_full"] and full["tiles"] == 49


def test_tile_list_covers_the_causal_triangle_once():
    seen = np.zeros((23, 23), int)
    for r0, r1, c0, c1, masked in flash.block_pairs(23, 5):
        seen[r0:r1, c0:c1] += 1
        tile = np.tril(np.ones((23, 23), bool))[r0:r1, c0:c1]
        assert masked == (not tile.all())                  # masked exactly where needed
    assert (seen[np.tril(np.ones((23, 23), bool))] == 1).all()


@pytest.mark.parametrize("cuts", [[8], [3, 11], [5, 6, 13]])
def test_merge_of_disjoint_key_chunks_equals_whole(cuts):
    """Queries at positions 8..15 over keys 0..15 cut into chunks (some chunks wholly in
    the queries' future for some rows, one wholly for all: lse -inf, weight 0)."""
    q = randn(2, 2, 8, 4, seed=3)
    k, v = randn(2, 2, 16, 4, seed=4), randn(2, 2, 16, 4, seed=5)
    y_all, lse_all = flash.partial_attention(q, k, v, q_start=8, k_start=0, block=3)
    edges = [0] + cuts + [16]
    y, lse = None, None
    for a, b in zip(edges, edges[1:]):
        part = flash.partial_attention(q, k[..., a:b, :], v[..., a:b, :], 8, a, block=3)
        y, lse = part if y is None else flash.merge_partials(y, lse, *part)
    np.testing.assert_allclose(y, y_all, rtol=0, atol=1e-12)
    np.testing.assert_allclose(lse, lse_all, rtol=0, atol=1e-12)


def test_partial_over_a_future_chunk_is_empty_and_merges_as_nothing():
    q, k, v = randn(1, 1, 4, 3, seed=6), randn(1, 1, 4, 3, seed=7), randn(1, 1, 4, 3, seed=8)
    y_f, lse_f = flash.partial_attention(q, k, v, q_start=0, k_start=4)
    assert (y_f == 0).all() and np.isneginf(lse_f).all()
    y, lse = flash.partial_attention(q, k, v)
    y_m, lse_m = flash.merge_partials(y, lse, y_f, lse_f)
    np.testing.assert_array_equal(y_m, y)
    np.testing.assert_array_equal(lse_m, lse)


def saved_bytes(fn, T):
    x = Tensor(randn(1, T, 3 * 16, seed=T).astype(np.float32), requires_grad=True)
    y = fn(x)
    return activation_bytes(y) - x.data.nbytes - y.data.nbytes


def test_tiled_keeps_o_t_memory():
    """Materialised: P (nh T^2 floats) grows 4x when T doubles, and with dropout its mask
    (nh T^2 bytes) too; tiled: lse (nh T) 2x, with dropout as without (no mask kept)."""
    mat = [saved_bytes(lambda x: F.causal_self_attention(x, 2), T) for T in (128, 256)]
    til = [saved_bytes(lambda x: flash.tiled_self_attention(x, 2, 32), T) for T in (128, 256)]
    assert mat == [2 * T * T * 4 for T in (128, 256)]
    assert til == [2 * T * 4 for T in (128, 256)]
    mat_d = [saved_bytes(lambda x: F.causal_self_attention(x, 2, 0.1, _site()), T)
             for T in (128, 256)]
    til_d = [saved_bytes(lambda x: flash.tiled_self_attention(x, 2, 32, 0.1, _site()), T)
             for T in (128, 256)]
    assert mat_d == [2 * T * T * 5 for T in (128, 256)]
    assert til_d == til


def test_float32_and_float16_inputs_run_close_to_float64():
    """Row statistics stay float32 for float16 inputs (tolerances: the inputs' precision)."""
    q, k, v = (randn(1, 2, 40, 8, seed=i) for i in range(3))
    g = randn(1, 2, 40, 8, seed=5)
    want, dwant = grads(lambda *a: flash.tiled_attention(*a, block=16), [q, k, v], g)
    for dtype, tol in (("float32", 1e-5), ("float16", 2e-2)):
        got, dgot = grads(lambda *a: flash.tiled_attention(*a, block=16),
                          [a.astype(dtype) for a in (q, k, v)], g.astype(dtype))
        assert got.dtype == dtype and all(d.dtype == dtype for d in dgot)
        np.testing.assert_allclose(got, want, atol=tol)
        for a, b in zip(dgot, dwant):
            np.testing.assert_allclose(a, b, atol=tol * 4)


TINY = dict(n_layer=2, n_head=2, n_embd=16, block_size=24, vocab_size=11)


def test_gpt_with_tiled_attention_matches_materialised():
    idx = np.random.default_rng(0).integers(0, 11, (3, 24))
    out = []
    for attention in ("materialized", "tiled"):
        model = GPT(GPTConfig(**TINY, attention=attention, attention_block=8), dtype="float64")
        _, loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()
        out.append((loss.data, {n: p.grad for n, p in model.named_parameters()}))
    np.testing.assert_allclose(out[1][0], out[0][0], rtol=0, atol=1e-12)
    for name, g in out[0][1].items():
        np.testing.assert_allclose(out[1][1][name], g, rtol=0, atol=1e-12, err_msg=name)


def test_config_refuses_unknown_names():
    with pytest.raises(ValueError, match="attention must be one of"):
        GPTConfig(**TINY, attention="flash")
    with pytest.raises(ValueError, match="attention_block must be >= 1"):
        GPTConfig(**TINY, attention="tiled", attention_block=0)


def test_flags():
    args = train_parser().parse_args(["--attention", "tiled", "--attention-block", "32"])
    assert (args.attention, args.attention_block) == ("tiled", 32)
    assert train_parser().parse_args([]).attention == "auto"


@pytest.mark.parametrize("attention,dropout,T,tiled", [
    ("auto", 0.0, 128, False), ("auto", 0.0, 255, False), ("auto", 0.0, 256, True),
    ("auto", 0.1, 1024, True), ("auto", 0.1, 128, False), ("tiled", 0.0, 16, True),
    ("materialized", 0.0, 4096, False)])
def test_auto_picks_tiled_from_256(attention, dropout, T, tiled):
    """--attention auto (the default): tiled where it is faster on the CPU too (T >= 256,
    TILED_FROM_T), materialised below, with or without attention dropout."""
    attn = GPT(GPTConfig(**{**TINY, "attention": attention, "dropout": dropout}),
               dtype="float64").transformer.h[0].attn
    assert attn.uses_tiled(T) is tiled


def test_a_checkpoint_resumes_with_the_other_attention(tmp_path):
    """How attention is computed is not part of the model: a checkpoint saved with one loads
    into a model using the other."""
    model = GPT(GPTConfig(**TINY), dtype="float64")
    save_checkpoint(tmp_path / "ck", model, AdamW(model.named_parameters()), step=1)
    other = GPT(GPTConfig(**TINY, attention="tiled"), seed=1, dtype="float64")
    load_checkpoint(tmp_path / "ck", other)
    for (name, a), b in zip(model.state_dict().items(), other.state_dict().values()):
        np.testing.assert_array_equal(b, a, err_msg=name)


def test_the_chapters_memory_table_is_the_ledgers_arithmetic():
    """minidist/autograd/README.md's table (the default model, batch 16, float32; printed by
    `python examples/attention_memory.py --seq 1024 4096`): materialised = the planner's count
    of minidist's graph (minidist_activation_bytes, held to the ledger by tests/test_planner.py),
    P being L B nh T^2 floats; tiled = the same without P and with L B nh T float32
    log-sum-exps instead, which the ledger measures too (T 1024, batch 1, to the loss's bytes)."""
    L, nh, B, mib = 4, 4, 16, 2**20
    text = open(f"{ROOT}/minidist/autograd/README.md").read()
    rows = {m.group(1): re.sub(r"(\d) (\d)", r"\1\2", m.group(0)) for m in
            re.finditer(r"^\| activations, (materialised|tiled) attention.*$", text, re.M)}
    for T in (1024, 4096):
        config = GPTConfig(n_layer=L, n_head=nh, n_embd=128, block_size=T, vocab_size=256)
        full = minidist_activation_bytes(config, T, B, dropout=False)
        lse, p = L * nh * T * B * 4, L * nh * T * T * B * 4
        tiled = minidist_activation_bytes(config, T, B, dropout=False, selective=True) + lse
        assert f"| {full / mib:.0f} MiB (P: {p / mib:.0f}) |" in rows["materialised"], T
        assert f"| {tiled / mib:.0f} MiB (lse: {lse / mib:.0f}) |" in rows["tiled"], T
    config = GPTConfig(n_layer=L, n_head=nh, n_embd=128, block_size=1024, vocab_size=256,
                       attention="tiled")
    model, x = GPT(config, seed=0), np.random.default_rng(0).integers(0, 256, (1, 1024))
    _, loss = model(x, x)
    planned = minidist_activation_bytes(config, 1024, 1, dropout=False, selective=True)
    assert abs(activation_bytes(loss, model.parameters()) - planned - L * nh * 1024 * 4) <= 8
