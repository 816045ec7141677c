"""Every Function's backward against central differences (float64), and its forward against a
NumPy formula, from one table. `test_every_function_is_in_the_table` fails when an op is
added to ops/indexing/fused without a row here.

Run: python -m pytest -q tests/test_gradcheck.py
"""
import inspect
import os
import re
from dataclasses import dataclass
from typing import Callable

import numpy as np
import pytest

from minidist import backend
from minidist.autograd import Function, Tensor, fused as F, ops
from minidist.autograd import attention, flash, function, fusions, indexing, llama_ops as LL
from minidist.autograd.dropout_keys import DropoutKeys, DropoutSite
from minidist.autograd.gradcheck import gradcheck

# Finite differences perturb one numpy element at a time (gradcheck.py is numpy-only): this
# is the CPU reference; on a GPU test_fused/test_cuda_kernels compare cupy against it.
pytestmark = pytest.mark.cpu_only("float64 finite differences on numpy arrays (the CPU "
                                  "reference the GPU tests compare against)")


def T(a, grad=True):
    return Tensor(np.asarray(a, dtype=np.float64), requires_grad=grad)


def randn(*shape, seed=0):
    return np.random.default_rng(seed + sum(shape)).standard_normal(shape)


def away_from_zero(*shape, seed=0):
    """Values with |v| in [0.5, 1.5]: no kinks (relu, max ties) within eps."""
    x = np.random.default_rng(seed).uniform(0.5, 1.5, shape)
    return x * np.where(np.random.default_rng(seed + 1).random(shape) < 0.5, -1, 1)


@dataclass
class Case:
    id: str
    covers: tuple                       # the Function classes this row exercises
    fn: Callable                        # Tensors -> Tensor (or list of Tensors)
    inputs: Callable                    # () -> list of Tensors / other args for fn
    ref: Callable = None                # numpy formula over the inputs' arrays
    atol: float = 1e-6
    eps: float = 1e-6


IDX = np.array([[1, 0, 3], [3, 3, 2]])          # repeated ids: scatter-add must add up
MASK = np.array([[True, False, False, True]])   # broadcasts over rows
COND = np.array([[True, False, True, False], [False, False, True, True], [True] * 4])

CASES = [
    Case("add_broadcast", (ops.Add,), lambda a, b: a + b,
         lambda: [T(randn(3, 4)), T(randn(4))], np.add),
    Case("add_both_broadcast", (ops.Add,), lambda a, b: a + b,
         lambda: [T(randn(2, 1, 3)), T(randn(4, 1))], np.add),
    Case("sub", (ops.Sub,), lambda a, b: a - b,
         lambda: [T(randn(3, 1)), T(randn(1, 4))], np.subtract),
    Case("rsub_scalar", (ops.Sub,), lambda a: 2.0 - a, lambda: [T(randn(5))], lambda a: 2 - a),
    Case("mul_broadcast", (ops.Mul,), lambda a, b: a * b,
         lambda: [T(randn(2, 3, 4)), T(randn(3, 1))], np.multiply),
    Case("div", (ops.Div,), lambda a, b: a / b,
         lambda: [T(randn(3, 4)), T(away_from_zero(4))], np.divide),
    Case("rdiv_scalar", (ops.Div,), lambda a: 1.0 / a,
         lambda: [T(away_from_zero(3, 2))], lambda a: 1 / a),
    Case("neg", (ops.Neg,), lambda a: -a, lambda: [T(randn(3, 4))], np.negative),
    Case("pow_scalar", (ops.Pow,), lambda a: a ** 3, lambda: [T(randn(3, 4))],
         lambda a: a ** 3),
    Case("pow_tensor", (ops.Pow,), lambda a, e: a ** e,
         lambda: [T(np.abs(away_from_zero(3, 2))), T(randn(2))], np.power),
    Case("exp", (ops.Exp,), lambda a: a.exp(), lambda: [T(randn(3, 4))], np.exp),
    Case("log", (ops.Log,), lambda a: a.log(), lambda: [T(np.abs(away_from_zero(3, 4)))],
         np.log),
    Case("sqrt", (ops.Sqrt,), lambda a: a.sqrt(), lambda: [T(np.abs(away_from_zero(4)))],
         np.sqrt),
    Case("tanh", (ops.Tanh,), lambda a: a.tanh(), lambda: [T(randn(3, 4))], np.tanh),
    Case("relu", (ops.Relu,), lambda a: a.relu(), lambda: [T(away_from_zero(3, 4))],
         lambda a: np.maximum(a, 0)),
    Case("sum_all", (ops.Sum,), lambda a: a.sum(), lambda: [T(randn(3, 4))], np.sum),
    Case("sum_axes_keepdims", (ops.Sum,), lambda a: a.sum(axis=(0, 2), keepdims=True),
         lambda: [T(randn(2, 3, 4))], lambda a: a.sum(axis=(0, 2), keepdims=True)),
    Case("mean_axis", (ops.Mean,), lambda a: a.mean(axis=-1), lambda: [T(randn(2, 3, 4))],
         lambda a: a.mean(axis=-1)),
    Case("max_axis", (ops.Max,), lambda a: a.max(axis=1), lambda: [T(randn(3, 5))],
         lambda a: a.max(axis=1)),
    Case("max_all_keepdims", (ops.Max,), lambda a: a.max(keepdims=True),
         lambda: [T(randn(3, 5))], lambda a: a.max(keepdims=True)),
    Case("matmul_2d", (ops.MatMul,), ops.matmul, lambda: [T(randn(3, 4)), T(randn(4, 5))],
         np.matmul),
    Case("matmul_batched_weight", (ops.MatMul,), ops.matmul,
         lambda: [T(randn(2, 3, 4)), T(randn(4, 5))], np.matmul),
    Case("matmul_broadcast_batch", (ops.MatMul,), ops.matmul,
         lambda: [T(randn(2, 1, 3, 4)), T(randn(5, 4, 2))], np.matmul),
    Case("matmul_2d_by_batched", (ops.MatMul,), ops.matmul,
         lambda: [T(randn(3, 4)), T(randn(2, 4, 5))], np.matmul),
    Case("matmul_vec_mat", (ops.MatMul,), ops.matmul, lambda: [T(randn(4)), T(randn(2, 4, 3))],
         np.matmul),
    Case("matmul_mat_vec", (ops.MatMul,), ops.matmul, lambda: [T(randn(2, 3, 4)), T(randn(4))],
         np.matmul),
    Case("matmul_vec_vec", (ops.MatMul,), ops.matmul, lambda: [T(randn(4)), T(randn(4))],
         np.matmul),
    Case("reshape", (ops.Reshape,), lambda a: a.reshape(4, 3), lambda: [T(randn(2, 6))],
         lambda a: a.reshape(4, 3)),
    Case("transpose_axes", (ops.Transpose,), lambda a: a.transpose(2, 0, 1),
         lambda: [T(randn(2, 3, 4))], lambda a: a.transpose(2, 0, 1)),
    Case("transpose_reverse", (ops.Transpose,), lambda a: a.T, lambda: [T(randn(2, 3))],
         lambda a: a.T),
    # the forward rounds to float32 (relative 6e-8), which a 1e-6 step would drown in; with
    # a 1e-2 step each difference is off by ~1e-5 (the op is linear: no O(eps^2) error)
    Case("cast_float32", (ops.Cast,), lambda a: ops.cast(a, "float32").astype("float64"),
         lambda: [T(randn(3, 4))], lambda a: a, atol=1e-4, eps=1e-2),
    Case("getitem_slices", (indexing.GetItem,), lambda a: a[1:, ::2, None],
         lambda: [T(randn(3, 4))], lambda a: a[1:, ::2, None]),
    Case("getitem_repeated_ids", (indexing.GetItem,), lambda a: a[np.array([0, 2, 0]), 1:],
         lambda: [T(randn(3, 4))], lambda a: a[np.array([0, 2, 0]), 1:]),
    Case("masked_fill", (indexing.MaskedFill,), lambda a: ops.masked_fill(a, MASK, -7.0),
         lambda: [T(randn(3, 4))], lambda a: np.where(MASK, -7.0, a)),
    Case("where", (indexing.Where,), lambda a, b: ops.where(COND, a, b),
         lambda: [T(randn(3, 4)), T(randn(4))], lambda a, b: np.where(COND, a, b)),
    Case("concat", (indexing.Concat,), lambda a, b: ops.concat([a, b, a], axis=1),
         lambda: [T(randn(2, 3)), T(randn(2, 1))], lambda a, b: np.concatenate([a, b, a], 1)),
    Case("split_sizes", (indexing.SplitJoin, indexing.SplitPart),
         lambda a: ops.split(a, [1, 3, 2], axis=-1), lambda: [T(randn(2, 6))]),
    Case("split_one_piece_unused", (indexing.SplitJoin, indexing.SplitPart),
         lambda a: ops.split(a, 3, axis=0)[2] * 2.0, lambda: [T(randn(6, 2))]),
    Case("embedding", (indexing.Embedding,), lambda w: ops.embedding(w, IDX),
         lambda: [T(randn(5, 3))], lambda w: w[IDX]),
    Case("dropout", (indexing.Dropout,), lambda a: ops.dropout(a, 0.4, backend.rng(7)),
         lambda: [T(randn(4, 5))]),
] + [
    Case("linear", (F.Linear,), F.linear,
         lambda: [T(randn(2, 3, 4)), T(randn(4, 5)), T(randn(5))], lambda x, w, b: x @ w + b),
    Case("linear_no_bias", (F.Linear,), lambda x, w: F.linear(x, w),
         lambda: [T(randn(3, 4)), T(randn(4, 2))], np.matmul),
    Case("layer_norm", (F.LayerNorm,), F.layer_norm,
         lambda: [T(randn(2, 3, 5)), T(randn(5)), T(randn(5))], lambda x, w, b: ref_ln(x, w, b)),
    Case("layer_norm_no_bias", (F.LayerNorm,), lambda x, w: F.layer_norm(x, w, None),
         lambda: [T(randn(4, 6)), T(randn(6))], lambda x, w: ref_ln(x, w, 0)),
    Case("gelu", (F.Gelu,), F.gelu, lambda: [T(2 * randn(3, 5))], lambda x: ref_gelu(x)),
    Case("softmax", (F.Softmax,), F.softmax, lambda: [T(randn(3, 5))],
         lambda x: ref_softmax(x, -1)),
    Case("softmax_axis0", (F.Softmax,), lambda x: F.softmax(x, axis=0),
         lambda: [T(randn(3, 5))], lambda x: ref_softmax(x, 0)),
    Case("log_softmax", (F.LogSoftmax,), F.log_softmax, lambda: [T(randn(3, 5))],
         lambda x: np.log(ref_softmax(x, -1))),
    Case("cross_entropy_ignore", (F.CrossEntropy,), lambda z: F.cross_entropy(z, TARGETS),
         lambda: [T(randn(2, 3, 5))], lambda z: ref_ce(z, TARGETS, -1)),
    Case("cross_entropy_2d", (F.CrossEntropy,), lambda z: F.cross_entropy(z, TARGETS[0], 9),
         lambda: [T(randn(3, 5))], lambda z: ref_ce(z, TARGETS[0], 9)),
    Case("bias_gelu", (fusions.BiasGelu,),       # h * 1.0: a fresh h each call, like the
         lambda h, b: fusions.bias_gelu(h * 1.0, b),  # model's matmul (h gets b in place)
         lambda: [T(2 * randn(3, 5)), T(randn(5))], lambda h, b: ref_gelu(h + b)),
    Case("residual_layer_norm", (fusions.ResidualLayerNorm, function.Pick),
         lambda x, r, w, b: list(fusions.residual_layer_norm(x, r, w, b)),
         lambda: [T(randn(2, 3, 5)), T(randn(2, 3, 5, seed=1)), T(randn(5)), T(randn(5))]),
    Case("residual_layer_norm_y_only", (fusions.ResidualLayerNorm, function.Pick),
         lambda x, r, w: fusions.residual_layer_norm(x, r, w)[1],
         lambda: [T(randn(4, 6)), T(randn(4, 6, seed=1)), T(randn(6))],
         lambda x, r, w: ref_ln(x + r, w, 0)),
    Case("padded_cross_entropy", (fusions.PaddedCrossEntropy,),
         lambda z: fusions.padded_cross_entropy(z, TARGETS, 4), lambda: [T(randn(2, 3, 6))],
         lambda z: ref_ce(z[..., :4], TARGETS, -1)),
    Case("causal_attention", (attention.CausalAttention,), F.causal_attention,
         lambda: [T(randn(2, 2, 4, 3, seed=i)) for i in range(3)], lambda *a: ref_attn(*a)),
    Case("causal_attention_dropout", (attention.CausalAttention,),
         lambda q, k, v: F.causal_attention(q, k, v, 0.3, backend.rng(1)),
         lambda: [T(randn(2, 2, 4, 3, seed=i)) for i in range(3)]),
    Case("causal_self_attention", (attention.CausalSelfAttention,),
         lambda x: F.causal_self_attention(x, 2), lambda: [T(randn(2, 4, 12))],
         lambda x: ref_self_attn(x, 2)),
    Case("causal_self_attention_dropout", (attention.CausalSelfAttention,),
         lambda x: F.causal_self_attention(x, 2, 0.2, backend.rng(3)),
         lambda: [T(randn(2, 4, 12))]),
    Case("causal_attention_recompute", (attention.CausalAttention,),
         lambda q, k, v: F.causal_attention(q, k, v, recompute=True),
         lambda: [T(randn(2, 2, 4, 3, seed=i)) for i in range(3)], lambda *a: ref_attn(*a)),
    Case("causal_self_attention_recompute_dropout", (attention.CausalSelfAttention,),
         lambda x: F.causal_self_attention(x, 2, 0.2, DropoutSite(DropoutKeys(4), "a"),
                                           recompute=True),
         lambda: [T(randn(2, 4, 12))]),
    Case("tiled_attention", (flash.TiledAttention,),
         lambda q, k, v: flash.tiled_attention(q, k, v, block=2),
         lambda: [T(randn(2, 2, 5, 3, seed=i)) for i in range(3)], lambda *a: ref_attn(*a)),
    Case("tiled_self_attention", (flash.TiledSelfAttention,),
         lambda x: flash.tiled_self_attention(x, 2, block=3), lambda: [T(randn(2, 7, 12))],
         lambda x: ref_self_attn(x, 2)),
    Case("tiled_attention_dropout", (flash.TiledAttention,),
         lambda q, k, v: flash.tiled_attention(q, k, v, 2, 0.3, DropoutSite(DropoutKeys(1), "a")),
         lambda: [T(randn(2, 2, 5, 3, seed=i)) for i in range(3)]),
    Case("tiled_self_attention_dropout", (flash.TiledSelfAttention,),
         lambda x: flash.tiled_self_attention(x, 2, 3, 0.2, DropoutSite(DropoutKeys(2), "a")),
         lambda: [T(randn(2, 7, 12))]),
    # Llama-style blocks (llama_ops.py)
    Case("rms_norm", (LL.RMSNorm,), LL.rms_norm,
         lambda: [T(randn(2, 3, 5)), T(randn(5))], lambda x, w: ref_rms(x, w)),
    Case("residual_rms_norm", (LL.RMSNorm,), lambda x, r, w: list(LL.residual_rms_norm(x, r, w)),
         lambda: [T(randn(4, 6)), T(randn(4, 6, seed=1)), T(randn(6))]),
    Case("swiglu", (LL.SwiGLU,), LL.swiglu, lambda: [T(3 * randn(2, 3, 8))],
         lambda h: ref_swiglu(h)),
    Case("rotary", (LL.Rotary,),             # x * 1.0: fresh, as c_attn's output (turned in place)
         lambda x: LL.rotary(x * 1.0, 2, 1, np.array([0, 5, 2]), 100.0),
         lambda: [T(randn(2, 3, 16))], lambda x: ref_rotary(x, 2, 1, np.array([0, 5, 2]), 100.0)),
    Case("repeat_kv", (LL.RepeatKV,), lambda x: LL.repeat_kv(x, 4, 2),
         lambda: [T(randn(2, 3, 24))], lambda x: ref_repeat_kv(x, 4, 2)),
    Case("repeat_kv to 4 of 8 heads", (LL.RepeatKV,), lambda x: LL.repeat_kv(x, 8, 2, 4),
         lambda: [T(randn(2, 3, 24))], lambda x: ref_repeat_kv(x, 8, 2, 4)),     # to < nh
]

TARGETS = np.array([[1, -1, 3], [0, 2, -1]])


# ---- NumPy formulas, written the obvious (slow, unfused) way -------------------------------

def ref_ln(x, w, b, eps=1e-5):
    mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + b


def ref_rms(x, w, eps=1e-5):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def ref_swiglu(h):
    a, b = np.split(h, 2, axis=-1)
    return a / (1 + np.exp(-a)) * b


def ref_rotary(x, nh, nkv, pos, theta):
    """Each q and k head's column pairs (i, i + hs/2) turned by pos * theta^(-2i/hs), as a
    2 x 2 rotation matrix per pair."""
    B, T, W = x.shape
    hs = W // (nh + 2 * nkv)
    out = x.copy()
    for h in range(nh + nkv):
        for i in range(hs // 2):
            a = pos * theta ** (-2 * i / hs)                       # (T,)
            c1, c2 = h * hs + i, h * hs + i + hs // 2
            x1, x2 = x[..., c1], x[..., c2]
            out[..., c1] = np.cos(a) * x1 - np.sin(a) * x2
            out[..., c2] = np.sin(a) * x1 + np.cos(a) * x2
    return out


def ref_repeat_kv(x, nh, nkv, to=None):
    hs, to = x.shape[-1] // (nh + 2 * nkv), to or nh
    q, k, v = np.split(x, [nh * hs, (nh + nkv) * hs], axis=-1)
    heads = lambda a: [a[..., j * hs:(j + 1) * hs] for j in range(nkv)]    # noqa: E731
    rep = lambda a: np.concatenate([h for h in heads(a) for _ in range(to // nkv)], -1)  # noqa
    return np.concatenate([q, rep(k), rep(v)], axis=-1)


def ref_gelu(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


def ref_softmax(x, axis):
    e = np.exp(x - x.max(axis, keepdims=True))
    return e / e.sum(axis, keepdims=True)


def ref_ce(z, t, ignore):
    logp = np.log(ref_softmax(z, -1)).reshape(-1, z.shape[-1])
    t = t.reshape(-1)
    keep = t != ignore
    return -logp[np.arange(len(t))[keep], t[keep]].mean()


def ref_attn(q, k, v):
    T, hs = q.shape[-2:]
    s = q @ k.swapaxes(-1, -2) / np.sqrt(hs)
    s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
    return ref_softmax(s, -1) @ v


def ref_self_attn(x, nh):
    B, T, C3 = x.shape
    q, k, v = (a.reshape(B, T, nh, -1).transpose(0, 2, 1, 3) for a in np.split(x, 3, -1))
    return ref_attn(q, k, v).transpose(0, 2, 1, 3).reshape(B, T, C3 // 3)


def functions_in_graph(out):
    """The Function classes of every Node reachable from `out` (a Tensor or a list)."""
    outs = out if isinstance(out, (list, tuple)) else [out]
    todo, seen = [o.grad_fn for o in outs if o.grad_fn is not None], set()
    while todo:
        node = todo.pop()
        if id(node) not in seen:
            seen.add(id(node))
            todo += [p for p in node.parents if p is not None and not isinstance(p, Tensor)]
            yield node.fn


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_backward_matches_central_differences(case):
    """The row's backward against central differences, after checking that the graph its fn
    builds holds every Function the row `covers` (test_every_function_is_in_the_table
    trusts that list)."""
    inputs = case.inputs()
    ran = set(functions_in_graph(case.fn(*inputs)))
    assert set(case.covers) <= ran, f"{case.id} never runs {set(case.covers) - ran}"
    gradcheck(case.fn, inputs, name=case.id, eps=case.eps, atol=case.atol)


@pytest.mark.parametrize("case", [c for c in CASES if c.ref], ids=lambda c: c.id)
def test_forward_matches_numpy_formula(case):
    inputs = case.inputs()
    got = case.fn(*inputs).data
    want = case.ref(*[x.data if isinstance(x, Tensor) else x for x in inputs])
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=case.atol)


def _functions_in(module):
    return {c for _, c in inspect.getmembers(module, inspect.isclass)
            if issubclass(c, Function) and c is not Function and c.__module__ == module.__name__}


# Functions whose float64 gradient check needs what CASES cannot give (a process group, a
# mpiexec job, a context): where it is. _Join's backward is by design no derivative of its
# forward (a constant root handing each output its given gradient): its test is that.
CHECKED_ELSEWHERE = {
    "minidist.autograd.function._Join": "tests/test_autograd_ops.py::"
        "test_backward_all_is_the_sum_of_separate_backwards_hooks_fire_once",
    "minidist.autograd.recompute.Checkpoint":
        "tests/test_checkpointing.py::test_gradcheck_through_the_recompute",
    "minidist.cp.ring.RingSelfAttention":        # 2 ranks (cp_check.py's ring_gradcheck)
        "tests/test_cp_exact.py::test_cp2_is_exact_and_sends_the_formula",
    **{f"minidist.cp.ulysses.{name}": "tests/test_cp_ulysses.py::test_ulysses_cp2_is_exact_"
       "and_sends_the_formula" for name in ("HeadsForTokens", "TokensForHeads")},  # 2 ranks
    "minidist.cp.ulysses.PickKV": "tests/test_cp_ulysses.py::test_pick_kv_gradcheck",
    "minidist.ep.exchange.AllToAll": "tests/test_alltoall.py::test_all_to_all",  # 2-4 ranks
    "minidist.nn.moe.IndexAddRows": "tests/test_moe.py::test_gradcheck_index_add_rows",
    "minidist.nn.moe_split.SequenceSum": "tests/test_moe.py::test_gradcheck_sequence_sum",
    "minidist.zero.stage3.BeforeBackward":
        "tests/test_zero_hooks.py::test_before_backward_gradcheck_calls_its_function_first",
    **{f"minidist.tp.{name}": "tests/test_tensor_parallel.py::"
       "test_two_ranks_gradchecks_exactness_memory_traffic_refusals"     # (tp_check.py)
       for name in ("gathered.GatheredLinear", "layers.VocabParallelCrossEntropy",
                    "layers.VocabShardLookup", "region.CopyToTP", "region.GatherFromSequence",
                    "region.GatherFromTP", "region.ReduceFromTP",
                    "region.ReduceScatterToSequence", "region.ScatterToTP")},
}


def _every_function():
    """Every Function subclass defined in minidist's modules (those CuPy alone can load
    aside: the CUDA kernels' Functions are the same ops' on the GPU), by qualified name."""
    import importlib
    import pkgutil
    import minidist
    out = {}
    for info in pkgutil.walk_packages(minidist.__path__, "minidist."):
        if info.name == "minidist.comm.nccl" and backend.cupy_module() is None:
            continue
        module = importlib.import_module(info.name)
        out.update({f"{info.name}.{c.__qualname__}": c for c in _functions_in(module)})
    return out


def test_every_function_is_in_the_table():
    """Every Function in minidist has a float64 gradient check: a row of CASES, or one
    CHECKED_ELSEWHERE names (review 38: seven modules were scanned, ten Functions elsewhere
    were never looked at, two of them never checked)."""
    covered = {c for case in CASES for c in case.covers}
    every = _every_function()
    missing = sorted(name for name, c in every.items()
                     if c not in covered and name not in CHECKED_ELSEWHERE)
    assert not missing, f"Functions with no gradient check: {missing}"
    assert set(CHECKED_ELSEWHERE) <= set(every), set(CHECKED_ELSEWHERE) - set(every)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    defined = {f"{path}::{name}" for path in {t.split("::")[0] for t in
                                              CHECKED_ELSEWHERE.values()}
               for name in re.findall(r"^def (test_\w+)",
                                      open(os.path.join(root, path)).read(), re.M)}
    assert set(CHECKED_ELSEWHERE.values()) <= defined, \
        set(CHECKED_ELSEWHERE.values()) - defined


def test_gradcheck_failure_names_op_input_and_index():
    class BadSquare(Function):
        @staticmethod
        def forward(ctx, a):
            ctx.save_for_backward(a)
            return a * a

        @staticmethod
        def backward(ctx, grad):
            a, = ctx.saved
            g = 2 * a * grad
            g[1, 2] += 1.0                    # the bug: one element off
            return g

    with pytest.raises(AssertionError, match=r"bad_square: gradient of input 0 "
                                             r"\(shape \(3, 4\)\) wrong at index \(1, 2\)"):
        gradcheck(BadSquare.apply, [T(randn(3, 4))], name="bad_square")
