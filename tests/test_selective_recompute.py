"""Selective recompute, `--attention recompute` (Megatron-LM's selective activation
recomputation; minidist/autograd/attention.py Redo): the materialised attention keeps no
(B, nh, T, T) weights or dropout mask for backward, which computes them again from q and k.
The same numbers bit for bit (values, gradients, a model's training), the weights' bytes gone
from the graph, the masks redrawn as of the forward's keys, and the planner's search
proposing it with a command training runs. Its gradient against finite differences is a row
of tests/test_gradcheck.py; its ledger against the planner rows of tests/test_planner.py.

Run: python -m pytest -q tests/test_selective_recompute.py
"""
import json

import numpy as np
import pytest

from minidist import backend
from minidist.autograd import Tensor, fused as F
from minidist.autograd.dropout_keys import DropoutKeys, DropoutSite
from minidist.nn import GPT, GPTConfig
from minidist.nn.config import ATTENTIONS
from minidist.strategy.memory import activation_bytes
from minidist.train.args import train_parser
from minidist.train.cli import check_flags
from minidist.train.strategy import check_layout
from minidist.train.cluster import H100_IB
from minidist.train.planner import Layout, bill
from minidist.train.search import search, train_flags


def randn(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape)


def run(fn, arrays, g):
    """fn's output and its inputs' gradients for the incoming gradient g, on the host."""
    ts = [Tensor(a.copy(), requires_grad=True) for a in arrays]
    y = fn(*ts)
    y.backward(g)
    return [backend.to_host(a) for a in [y.data] + [t.grad for t in ts]]


def site(seed=3):
    return DropoutSite(DropoutKeys(seed), "transformer.h.0.attn.attn_dropout")


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("p", [0.0, 0.3])
def test_recompute_equals_the_kept_weights_bit_for_bit(xp, dtype, p):
    """Both attention Functions, with and without dropout: the backward that computes P and
    the mask again gives the gradients of the one that kept them, bit for bit (on the GPU
    too, `--device cuda`: the same softmax kernel and keyed mask both times)."""
    qkv = xp.asarray(randn(2, 13, 24).astype(dtype))            # 2 heads of 4
    g = xp.asarray(randn(2, 13, 8, seed=1).astype(dtype))
    kept = run(lambda x: F.causal_self_attention(x, 2, p, site()), [qkv], g)
    redo = run(lambda x: F.causal_self_attention(x, 2, p, site(), recompute=True), [qkv], g)
    for a, b in zip(redo, kept):
        np.testing.assert_array_equal(a, b)
    q, k, v = (xp.asarray(randn(2, 3, 11, 5, seed=i).astype(dtype)) for i in range(3))
    g = xp.asarray(randn(2, 3, 11, 5, seed=7).astype(dtype))
    kept = run(lambda *a: F.causal_attention(*a, p, site()), [q, k, v], g)
    redo = run(lambda *a: F.causal_attention(*a, p, site(), recompute=True), [q, k, v], g)
    for a, b in zip(redo, kept):
        np.testing.assert_array_equal(a, b)
    if p:                                                         # the mask did something
        plain = run(lambda *a: F.causal_attention(*a), [q, k, v], g)
        assert np.abs(plain[0] - kept[0]).max() > 1e-3


def test_the_backward_redraws_the_forwards_masks_after_the_keys_moved_on():
    """A pipeline runs a micro-batch's backward after later forwards moved the keys (other
    rows, the next step): the masks are the forward's, the gradients those of a backward
    run at once; drawn with the moved keys instead they would differ."""
    qkv, g = randn(2, 12, 24), randn(2, 12, 8, seed=2)
    s = site()
    with s.keys.rows_of([4, 5]):
        want = run(lambda x: F.causal_self_attention(x, 2, 0.3, s, recompute=True), [qkv], g)
    x = Tensor(qkv.copy(), requires_grad=True)
    with s.keys.rows_of([4, 5]):
        y = F.causal_self_attention(x, 2, 0.3, s, recompute=True)
    s.keys.next_step()
    with s.keys.rows_of([0, 1]):
        y.backward(g)
    np.testing.assert_array_equal(x.grad, want[1])
    with s.keys.rows_of([0, 1]):
        other = run(lambda x: F.causal_self_attention(x, 2, 0.3, s, recompute=True), [qkv], g)
    assert not np.allclose(other[1], want[1])


def saved_bytes(fn, T, nh=2, hs=4):
    """What the attention's node keeps beyond its input and output (B = 1)."""
    x = Tensor(randn(1, T, 3 * nh * hs), requires_grad=True)
    y = fn(x)
    return activation_bytes(y) - x.data.nbytes - y.data.nbytes


@pytest.mark.parametrize("p", [0.0, 0.1])
def test_it_keeps_no_weights_and_no_mask(p):
    """Kept: P (nh T^2 float64s) and with dropout its mask (nh T^2 bytes); recomputed:
    nothing past q, k, v (the input) and y, at any T."""
    for T in (32, 64):
        assert saved_bytes(lambda x: F.causal_self_attention(x, 2, p, site()), T) == \
            2 * T * T * (8 + (1 if p else 0))
        assert saved_bytes(lambda x: F.causal_self_attention(x, 2, p, site(), recompute=True),
                           T) == 0


def test_dropout_numbers_from_a_generator_are_refused():
    """A generator's numbers cannot be drawn again: recompute needs keyed ones."""
    x = Tensor(randn(1, 4, 6))
    with pytest.raises(TypeError, match="DropoutSite"):
        F.causal_self_attention(x, 1, 0.1, np.random.default_rng(0), recompute=True)
    F.causal_self_attention(x, 1, 0.0, np.random.default_rng(0), recompute=True)   # no draw


TINY = dict(n_layer=2, n_head=2, n_embd=16, block_size=24, vocab_size=11, dropout=0.1)


def test_a_gpt_trains_the_same_numbers_with_less_kept():
    """Two steps of a GPT with dropout: the same losses and gradients bit for bit, and its
    graph smaller by the weights and masks of every layer (L nh B T^2 (8 + 1) bytes)."""
    idx = np.random.default_rng(0).integers(0, 11, (3, 25))
    out = {}
    for attention in ("materialized", "recompute"):
        model = GPT(GPTConfig(**TINY, attention=attention), dtype="float64")
        model.train()
        runs = []
        for step in range(2):                  # each forward: the keys' next step
            _, loss = model(idx[:, :-1], idx[:, 1:])
            kept = activation_bytes(loss, model.parameters())
            loss.backward()
            runs.append((loss.data, kept, {n: p.grad.copy()
                                           for n, p in model.named_parameters()}))
        out[attention] = runs
    T = 24
    for (l0, b0, g0), (l1, b1, g1) in zip(out["materialized"], out["recompute"]):
        np.testing.assert_array_equal(l1, l0)
        for name in g0:
            np.testing.assert_array_equal(g1[name], g0[name], err_msg=name)
        assert b0 - b1 == 2 * 2 * 3 * T * T * (8 + 1)


def test_the_flag_is_the_models_choice():
    """--attention takes the config's choices (args.py names them without importing numpy)."""
    action = next(a for a in train_parser()._actions if a.dest == "attention")
    assert tuple(action.choices) == ATTENTIONS
    assert train_parser().parse_args(["--attention", "recompute"]).attention == "recompute"


def test_the_search_proposes_it_with_a_command_training_runs():
    """A materialised attention's search tries selective recompute (not where the ring's
    tiles keep no scores); a row's flags are --attention recompute, which the train parser
    takes; its memory is the row without it less the scores' term."""
    config = GPTConfig(n_layer=4, n_head=8, n_embd=256, block_size=1024, vocab_size=512)
    rows = search(config, H100_IB, gpus=8, seq=1024, global_batch=16, tiled=False)
    chosen = [r for r in rows if r["recompute"] == "selective"]
    assert chosen and not [r for r in chosen if r["cp"] > 1 and r["cp_attention"] == "ring"]
    row = chosen[0]
    flags = train_flags(config, row)
    assert flags[flags.index("--attention") + 1] == "recompute"
    args = train_parser().parse_args(flags + ["--device", "cpu"])
    check_flags(args)                                   # training's own checks, as run
    check_layout(args, row["dp"] * row["tp"] * row["pp"] * row["cp"])
    assert args.attention == "recompute"
    plain = [r for r in rows if r["recompute"] == "none" and r["layout"] ==
             row["layout"].replace(", selective recompute", "")
             and r["micro_batches"] == row["micro_batches"]]
    assert plain and plain[0]["mem"]["activations"] > row["mem"]["activations"]
    rows = search(config, H100_IB, gpus=8, seq=1024, global_batch=16, tiled=True)
    assert not [r for r in rows if r["recompute"] == "selective"]


def test_bill_counts_minidists_graph_without_the_scores():
    """The minidist count for --attention recompute is the plain one less a s^2 b (e + d)
    per layer (the probabilities and the 1-byte mask)."""
    config = GPTConfig(n_layer=3, n_head=4, n_embd=64, block_size=64, vocab_size=256,
                       dropout=0.1)
    plain = bill(config, Layout(amp=False), 64, 2, formula="minidist")["activations"]
    redo = bill(config, Layout(amp=False, recompute="selective"), 64, 2,
                formula="minidist")["activations"]
    assert plain - redo == 3 * 4 * 64 * 64 * 2 * (4 + 1)
    json.dumps(redo)
