"""The checks tp_check.py runs besides exactness (2 ranks): each a generator of result rows.

    gradcheck   central differences across ranks for every conjugate Function, for
                gathered_linear and for the parallel layers built on them (float64);
                gathered_linear's backward collectives started asynchronously
    activations the activation ledger of a sequence-parallel training forward with the
                column layers' gathered inputs kept (keep_gathered) and re-gathered in
                backward (the default): less by (2L + 1) B*T*C (1 - 1/tp) x itemsize;
                same gradients
    memory      per-rank bytes of every split parameter vs the full one: 1/tp
    traffic     bytes one block, and the whole model, sends per forward + backward on the tp
                group (trace counters) vs the theory
    refusals    bad sizes stop make_strategy on every rank before any group is created
"""
import numpy as np

import minidist.comm
from minidist.autograd import Tensor, fused as F
from minidist.comm import DeviceMesh, trace
from minidist.nn import GPT
from minidist.strategy.memory import activation_bytes
from minidist.tp import region as tpf
from minidist.tp.gathered import gathered_linear
from minidist.tp.region import TensorParallelRegion
from minidist.tp.layers import (ColumnParallelLinear, RowParallelLinear,
                                SequenceParallelLayerNorm, VocabShardLookup,
                                vocab_parallel_cross_entropy)
from minidist.nn.block import Block
from minidist.tp.model import TensorParallelGPT
from minidist.train.strategy import make_strategy
from minidist.train.cli import UsageError
from dist_gradcheck import dist_gradcheck   # (tests/scripts/dist_gradcheck.py)

SEED = 11


def _rand(comm, *shape, shared=False):
    return np.random.default_rng([SEED, 7, 0 if shared else 1 + comm.rank]).standard_normal(
        shape)


def gradcheck(comm, config, flags):
    g = DeviceMesh(dp=1, tp=comm.size).tp
    B, T, C = 2, 2 * comm.size, 3
    own, same = (lambda *s: _rand(comm, *s)), (lambda *s: _rand(comm, *s, shared=True))
    cases = [("copy_to_tp (f)", lambda t: tpf.copy_to_tp(t, g), same(B, T, C), "replicated",
              "sharded"),
             ("reduce_from_tp (g)", lambda t: tpf.reduce_from_tp(t, g), own(B, T, C),
              "sharded", "replicated"),
             ("gather_from_tp", lambda t: tpf.gather_from_tp(t, g), own(B, T, C), "sharded",
              "replicated"),
             ("scatter_to_tp", lambda t: tpf.scatter_to_tp(t, g), same(B, T, 2 * comm.size),
              "replicated", "sharded"),
             ("gather_from_sequence", lambda t: tpf.gather_from_sequence(t, g),
              own(B, 2, C), "sharded", "sharded"),
             ("reduce_scatter_to_sequence", lambda t: tpf.reduce_scatter_to_sequence(t, g),
              own(B, T, C), "sharded", "sharded")]
    cases += _gathered_cases(g, B, own)
    cases += _layer_cases(g, comm, B, T, own, same)
    for name, fn, x, inp, out in cases:
        yield dist_gradcheck(name, fn, x, comm, inp, out)
    yield {"op": "gathered_linear: collectives", "rank": comm.rank,
           "issued": _gathered_collectives(g, own(B, 2, 4), own(4, 3), own(3))}


def _gathered_collectives(g, x, w, b):
    """gathered_linear's collectives on the tp group, forward then backward, in issue order,
    as (op, async): the forward's blocking all-gather; backward's re-gather and dX's
    reduce-scatter both started on the communication thread (the computation in between
    runs beside them). Traced (minidist/comm/trace.py), then the trace put back as it was."""
    was_on, before = trace.enabled(), len(trace.events())
    trace.enable()
    x, w, b = (Tensor(a.copy(), requires_grad=True) for a in (x, w, b))
    gathered_linear(x, w, b, g).sum().backward()
    if not was_on:
        trace.disable()
    mine = sorted((e["seq"], e["op"], e["async"]) for e in trace.events()[before:]
                  if e["group"] == g.name)
    want = [("all_gather", False), ("all_gather", True), ("reduce_scatter", True)]
    assert [m[1:] for m in mine] == want, mine
    return want


def _gathered_cases(g, B, own):
    """gathered_linear (tp/gathered.py), by its input shard, its weight and its bias: the
    backward's re-gather, dX's reduce-scatter, both overlapped."""
    x, w, b = own(B, 2, 4), own(4, 3), own(3)
    return [("gathered_linear: input", lambda t: gathered_linear(t, Tensor(w), Tensor(b), g),
             x, "sharded", "sharded"),
            ("gathered_linear: weight", lambda t: gathered_linear(Tensor(x), t, Tensor(b), g),
             w, "sharded", "sharded"),
            ("gathered_linear: bias", lambda t: gathered_linear(Tensor(x), Tensor(w), t, g),
             b, "sharded", "sharded")]


def _layer_cases(g, comm, B, T, own, same):
    """An MLP pair (column -> gelu -> row), plain and sequence-parallel, checked for its
    input and its column weight; a layer norm's replicated weight on sequence shards; the
    vocabulary-split lookup and cross-entropy."""
    cases = []
    for sp in (False, True):
        region = TensorParallelRegion(g, sequence_parallel=sp)
        region.sharded = sp                        # (begin() would turn it off under no_grad)
        col, row = ColumnParallelLinear(4, 6, region), RowParallelLinear(6, 4, region)
        for layer in (col, row):
            layer.weight.data = own(*layer.weight.shape)
            layer.bias.data = own(*layer.bias.shape) if layer is col else same(4)
        mlp = (lambda t, c=col, r=row: r(F.gelu(c(t))))
        x = own(B, T // comm.size, 4) if sp else same(B, T, 4)
        kind = "sharded" if sp else "replicated"
        tag = "sequence-parallel" if sp else "tensor-parallel"

        def by_weight(w, c=col, r=row, x=Tensor(x)):
            c.weight = w
            return r(F.gelu(c(x)))
        cases += [(f"{tag} MLP: input", mlp, x, kind, kind),
                  (f"{tag} MLP: column weight", by_weight, col.weight.data.copy(), "sharded",
                   kind)]
    region = TensorParallelRegion(g, sequence_parallel=True)
    region.sharded = True
    norm = SequenceParallelLayerNorm(4, region, dtype="float64")
    x_shard = Tensor(own(B, T // comm.size, 4))

    def norm_by_weight(w):
        norm.weight = w
        return norm(x_shard)
    cases += [("sequence-parallel layer norm: weight", norm_by_weight, same(4), "replicated",
               "sharded")]
    V, Vr = 4 * comm.size - 1, 4                   # the last rank holds one padding column
    start = comm.rank * Vr
    targets = np.array([0, V - 1, 5 % V, -1, 3, V - 2])
    idx = np.array([[0, V - 1, 4 % V], [2, 2, V - 2]])
    leave = TensorParallelRegion(g).leave
    cases += [("vocab_parallel_cross_entropy", lambda t: vocab_parallel_cross_entropy(
                   t, targets, g, start, V), own(len(targets), Vr), "sharded", "replicated"),
              ("vocab-parallel embedding: weight", lambda w: leave(VocabShardLookup.apply(
                   w, idx, start)), own(Vr, 3), "sharded", "replicated")]
    return cases


def memory(comm, config, flags):
    """Bytes of each parameter on this rank vs in the single-process model."""
    tp = comm.size
    g = DeviceMesh(dp=1, tp=tp).tp
    model = TensorParallelGPT(config, g, seed=SEED, dtype="float64")
    full = dict(GPT(config, seed=SEED, dtype="float64").named_parameters())
    split = {"blocks": [0, 0], "wte": [0, 0], "replicated": [0, 0]}
    for name, p in model.named_parameters():
        kind = "replicated" if p.tp_split is None else ("wte" if "wte" in name else "blocks")
        split[kind][0] += p.data.nbytes
        split[kind][1] += full[name].data.nbytes
        if kind == "blocks":
            assert p.data.nbytes * tp == full[name].data.nbytes, name
    chunk = -(-config.vocab_size // tp)
    assert split["wte"][0] == chunk * config.n_embd * 8
    for kind, (local, whole) in split.items():
        yield {"tp": tp, "rank": comm.rank, "params": kind, "local_bytes": local,
               "full_bytes": whole, "ratio": local / whole}


def activations(comm, config, flags):
    """Bytes the graph of one sequence-parallel training forward keeps on this rank
    (minidist/strategy/memory.py), with the naive pair (keep_gathered: all-gather, then
    Linear, which keeps the gathered (B, T, C)) and with gathered_linear (which keeps the
    (B, T/tp, C) shard it was given): each column layer keeps its input's shard instead of
    the whole, c_attn and c_fc per block and the head once, (2L + 1) B*T*C (1 - 1/tp) x
    itemsize less; under --ckpt-activations the blocks keep only their inputs anyway, so the
    head's alone. The gradients are bitwise the same."""
    g = DeviceMesh(dp=1, tp=comm.size).tp
    B, T, C, L, s = 2, config.block_size, config.n_embd, config.n_layer, 8
    idx = np.random.default_rng(SEED).integers(0, config.vocab_size, (B, T))
    for ckpt in (False, True):
        kept, grads = {}, {}
        for keep in (True, False):
            model = TensorParallelGPT(config, g, seed=SEED, dtype="float64",
                                      sequence_parallel=True).set_checkpointing(ckpt)
            model.region.keep_gathered = keep
            loss = model(idx, np.roll(idx, -1, axis=1))[1]
            kept[keep] = activation_bytes(loss, model.parameters())
            loss.backward()
            grads[keep] = {n: p.grad.copy() for n, p in model.named_parameters()}
        assert all(np.array_equal(grads[True][n], grads[False][n]) for n in grads[True])
        want = (1 + (0 if ckpt else 2 * L)) * B * T * C * s * (comm.size - 1) // comm.size
        assert kept[True] - kept[False] == want, (ckpt, kept, want)
        yield {"tp": comm.size, "rank": comm.rank, "ckpt": ckpt, "layers": L,
               "btc_bytes": B * T * C * s, "keep_gathered": kept[True],
               "regather": kept[False], "drop": kept[True] - kept[False], "formula": want}


def traffic(comm, config, flags):
    """tp-group traffic of one block, then of the whole model, for one forward + backward."""
    tp = comm.size
    g = DeviceMesh(dp=1, tp=tp).tp
    B, T, C, L, s = 2, config.block_size, config.n_embd, config.n_layer, 8
    x = np.random.default_rng(SEED).standard_normal((B, T, C))
    idx = np.random.default_rng(SEED).integers(0, config.vocab_size, (B, T))
    for sp in (False, True):
        model = TensorParallelGPT(config, g, seed=SEED, dtype="float64", sequence_parallel=sp)
        model.region.begin(T, shard=True)          # a training forward
        block = model.transformer.h[0]
        assert isinstance(block, Block) and isinstance(block.mlp.c_fc, ColumnParallelLinear)
        xs = x[:, comm.rank * T // tp:(comm.rank + 1) * T // tp] if sp else x
        trace.reset_counters()
        block(Tensor(xs.copy(), requires_grad=True)).sum().backward()
        shared = [p.size * s for p in block.parameters() if p.tp_split is None] if sp else []
        yield _traffic("block", sp, tp, B * T * C * s, 1, trace.counters(g.name), shared)
        trace.reset_counters()
        model(idx, np.roll(idx, -1, axis=1))[1].backward()
        shared = [p.size * s for p in model.parameters() if p.tp_split is None] if sp else []
        yield _traffic("model", sp, tp, B * T * C * s, L, trace.counters(g.name), shared,
                       ce_bytes=[B * T * s, 2 * B * T * s])


def _traffic(what, sp, tp, btc_bytes, L, counters, shared, ce_bytes=()):
    """Theory: per block 2 all-reduces of B*T*C forward (after attention's and the MLP's row
    layer) and 2 backward (before their column layers); sequence parallelism replaces each
    by an all-gather + a reduce-scatter of the same B*T*C, sending the same bytes, and adds
    the all-reduce of each replicated parameter's gradient (`shared`: layer norms, row
    biases, wpe; C numbers each but wpe). The whole model adds the embedding's and the output
    layer's pair, and the cross-entropy's all-reduces of 3 numbers per row (max; sum of exps
    and target logit). Under sequence parallelism each column layer (c_attn, c_fc; the head)
    keeps only its input's shard and all-gathers it again in backward (tp/gathered.py): one
    more all-gather of B*T*C per column layer, 2 per block, 1 for the head.
    A ring all-reduce sends 2(tp-1)/tp of its bytes per rank, an all-gather or reduce-scatter
    (tp-1)/tp."""
    pairs = 4 * L + (2 if what == "model" else 0)          # collectives of B*T*C per step
    ring = (tp - 1) / tp
    small = list(shared) + list(ce_bytes)                  # all-reduces besides f and g
    regather = 2 * L + (what == "model") if sp else 0      # backward's re-gathers
    if sp:
        want = {"all_gather": (pairs + regather, (pairs + regather) * btc_bytes),
                "reduce_scatter": (pairs, pairs * btc_bytes)}
    else:
        want = {"all_reduce": (pairs, pairs * btc_bytes)}
    if small:
        n, b = want.get("all_reduce", (0, 0))
        want["all_reduce"] = (n + len(small), b + sum(small))
    sent = 2 * ring * (pairs * btc_bytes + sum(small)) + ring * regather * btc_bytes
    got = {op: (c["calls"], c["bytes"]) for op, c in counters.items()}
    total = sum(c["bytes_sent"] for c in counters.values())
    assert got == want, (what, sp, got, want)
    assert abs(total - sent) <= 2 * len(small) * 8, (what, sp, total, sent)   # odd lengths
    return {"what": what, "sequence_parallel": sp, "tp": tp, "calls_bytes": got,
            "bytes_sent": total, "theory_sent": sent, "btc_bytes": btc_bytes, "layers": L,
            "shared_param_bytes": sum(shared), "regather_bytes": regather * btc_bytes}


BAD = [(["--tp", "4"], "--tp 4 = 4 ranks per replica (the processes are dp x 4), but this "
        "job has 2 MPI process"),
       (["--tp", "2", "--dp", "2"], "--dp 2 x --tp 2 = 4 ranks, but this job has 2"),
       (["--tp", "2", "--n-head", "3", "--n-embd", "15"],
        "--n-head 3 is not divisible by --tp 2"),
       (["--tp", "2", "--n-head", "3", "--n-embd", "15"], "--n-embd 15 is not divisible"),
       (["--tp", "2", "--sequence-parallel", "--block-size", "7"],
        "--block-size 7 over tp 2 ranks: it must be a multiple of 2"),
       (["--tp", "2", "--batch-size", "3", "--grad-accum", "2"], "--batch-size 3 does not split")]


class _NoCollectives:
    def __init__(self, *a, **k):
        raise AssertionError("a refusal reached DeviceMesh (communication) first")


def refusals(comm, config, flags):
    """Each bad flag set raises UsageError on this rank alone, before a mesh is made."""
    real, minidist.comm.DeviceMesh = minidist.comm.DeviceMesh, _NoCollectives
    try:
        for bad, message in BAD:
            try:
                make_strategy(flags("tp2", *bad), minidist.comm.ProcessGroup.world("ring"))
            except UsageError as e:
                assert message in str(e), (bad, str(e))
                yield {"flags": bad, "rank": comm.rank, "error": str(e)}
            else:
                raise AssertionError(f"{bad} was accepted")
    finally:
        minidist.comm.DeviceMesh = real
    assert sum(c["calls"] for c in trace.counters().values()) == 0
