"""The step-time model: how fast one layout trains on one cluster (the planner says if it fits).

Compute. Forward FLOPs per micro-batch of b sequences of s tokens (Megatron's count, Narayanan
et al. 2021, appendix): 24 b s h^2 per layer in the matmuls, 4 b s^2 h in attention (q k^T and
p v), 2 b s h V in the output layer. Backward is twice forward; full recompute (--ckpt-activations)
runs each block's forward once more; tiled attention's backward recomputes the scores (2 b s^2
h per layer). TP divides the FLOPs by t, CP the tokens by c, PP the layers by p. Time = FLOPs /
(peak x efficiency), the efficiency a measured factor (`Cluster.efficiency`); on a machine with
fewer cores than ranks (`compute_slots`), ranks share them: time x ranks per node / slots.
MFU counts model FLOPs (3 x forward, no recompute) over the step time and the peak.

Collectives: an alpha-beta model of the algorithms minidist implements (minidist/comm/ring.py),
a group of p ranks and a buffer of n bytes over a link of latency alpha and bandwidth B, and
gamma seconds per byte of local reduction:
    ring reduce-scatter, all-gather   (p-1) alpha + (p-1)/p n/B   (+ (p-1)/p n gamma: RS)
    ring all-reduce                   2(p-1) alpha + 2(p-1)/p n/B + (p-1)/p n gamma
    hierarchical all-reduce, k ranks per node, m nodes (minidist/comm/hier.py):
        ring reduce-scatter in the node, ring all-reduce of n/k bytes across the m nodes
        (the k local ranks each on its own NIC, at once), ring all-gather in the node
    send/recv                         alpha + n/B
A group's link comes from the mesh order (minidist/comm/mesh.py: tp fastest, then cp, dp,
pp): a group whose ranks all sit on one node uses the intra-node link, one that spans nodes
runs at the inter-node link's speed (every ring step waits for its slowest hop).

The step: m micro-batches through p stages, each micro-batch forward t_f and backward t_b on
a stage (compute, TP's all-reduces, CP's ring, ZeRO-3's exposed gathers, the p2p sends), then
    pipeline = m (t_f + t_b) + bubble(schedule)
    step     = pipeline + exposed data-parallel communication + optimizer
Data-parallel communication overlaps with backward (DDP's buckets, ZeRO-2/3's reduce-scatter,
ZeRO-3's prefetched gathers with forward) up to `Cluster.overlap` x the window, never the last
bucket or layer. Tests: tests/test_planner.py (each formula on a small case worked by hand).
"""
import math
from dataclasses import dataclass, field

from minidist.train.planner import STATE_BYTES, Layout, stage_params


@dataclass(frozen=True)
class Link:
    """One hop: latency alpha (seconds per message) and bandwidth (bytes/s, one direction)."""
    alpha: float
    bw: float


@dataclass(frozen=True)
class Cluster:
    """GPUs (or ranks) in nodes, their compute and their links. peak_tflops: dense 16-bit
    (amp) peak; peak_tflops_fp32 for float32 (None: the same); gamma: seconds per byte of a
    collective's local reduction; opt_s_per_param: the optimizer's time per parameter it
    updates; overlap: fraction of a window communication can hide in (1: all of it);
    compute_slots: ranks per node that compute at full speed at once (None: all)."""
    name: str
    gpus_per_node: int
    mem_gib: float
    peak_tflops: float
    efficiency: float
    intra: Link
    inter: Link
    peak_tflops_fp32: float = None
    gamma: float = 0.0
    opt_s_per_param: float = 0.0
    overlap: float = 1.0
    compute_slots: int = None
    notes: dict = field(default_factory=dict, compare=False)


# H100 SXM (DGX/HGX H100): 989 TFLOP/s dense bf16, 80 GB HBM3; NVLink 4 at 450 GB/s per
# direction per GPU; one 400 Gb/s (50 GB/s) NDR InfiniBand NIC per GPU. Latencies and the
# efficiency are assumptions (typical published figures: ~3 us NVLink, ~5 us IB, 40-50% MFU).
H100_IB = Cluster("h100-sxm-ib400", gpus_per_node=8, mem_gib=80.0, peak_tflops=989.0,
                  peak_tflops_fp32=67.0, efficiency=0.45, intra=Link(3e-6, 450e9),
                  inter=Link(5e-6, 50e9), opt_s_per_param=32 / 3.35e12)


# ---- FLOPs -----------------------------------------------------------------------------------

def layer_flops(b, s, h):
    """Forward FLOPs of one transformer layer: 24bsh^2 (QKV, proj, fc, fc2) + 4bs^2h."""
    return 24 * b * s * h * h + 4 * b * s * s * h


def forward_flops(config, b, s):
    """Forward FLOPs of the whole model on b sequences of s tokens (output layer included)."""
    return config.n_layer * layer_flops(b, s, config.n_embd) + \
        2 * b * s * config.n_embd * config.vocab_size


def model_flops(config, b, s):
    """FLOPs a training step needs in theory (MFU's numerator): 3 x forward."""
    return 3 * forward_flops(config, b, s)


# ---- collectives -----------------------------------------------------------------------------

def ring_time(op, nbytes, p, link, gamma=0.0):
    """Seconds of minidist's ring `op` ("all_reduce", "reduce_scatter", "all_gather") on an
    n-byte buffer over p ranks (the formulas in the docstring)."""
    if p == 1 or nbytes == 0:
        return 0.0
    phases = 2 if op == "all_reduce" else 1
    reduced = 0 if op == "all_gather" else (p - 1) / p * nbytes * gamma
    return phases * ((p - 1) * link.alpha + (p - 1) / p * nbytes / link.bw) + reduced


def hier_all_reduce_time(nbytes, k, m, intra, inter, gamma=0.0):
    """Reduce-scatter in the node (k ranks), all-reduce of a 1/k chunk across m nodes,
    all-gather in the node."""
    return (ring_time("reduce_scatter", nbytes, k, intra, gamma)
            + ring_time("all_reduce", nbytes / k, m, inter, gamma)
            + ring_time("all_gather", nbytes, k, intra))


def p2p_time(nbytes, link):
    """One send/recv of n bytes."""
    return link.alpha + nbytes / link.bw if nbytes else 0.0


# where each axis sits in the mesh: global rank = tp + tp (cp + cp (dp + dp pp)).
# Expert parallelism (minidist/ep/) is carved out of dp (ep neighbouring dp ranks, stride tp
# cp: Layout.ep); its all-to-alls are not in this model yet.
AXES = ("tp", "cp", "dp", "pp")


def axis_stride(layout, axis):
    """Distance in global ranks between neighbours of `axis`'s group (mesh order)."""
    stride = 1
    for a in AXES[:AXES.index(axis)]:
        stride *= getattr(layout, a)
    return stride


def span(layout, axis, gpus_per_node, size=None):
    """(ranks per node k, nodes m) of the `axis` group holding rank 0 (all are alike); k is 0
    when the nodes hold different numbers of its ranks. `size`: the group size (default: the
    axis's; "dpcp" groups are dp x cp ranks at cp's stride)."""
    size = size or getattr(layout, axis)
    stride = axis_stride(layout, axis)
    nodes = [i * stride // gpus_per_node for i in range(size)]
    counts = {n: nodes.count(n) for n in nodes}
    k = next(iter(counts.values()))
    return (k if all(c == k for c in counts.values()) else 0), len(counts)


def collective_time(cluster, op, nbytes, layout, axis, algo="ring", size=None):
    """Seconds of `op` on the `axis` group of `layout`, on the links that group spans."""
    p = size or getattr(layout, axis)
    k, m = span(layout, axis, cluster.gpus_per_node, p)
    if m == 1:
        return ring_time(op, nbytes, p, cluster.intra, cluster.gamma)
    if algo == "hier" and op == "all_reduce" and k > 1:
        return hier_all_reduce_time(nbytes, k, m, cluster.intra, cluster.inter, cluster.gamma)
    return ring_time(op, nbytes, p, cluster.inter, cluster.gamma)


def p2p_link(cluster, layout):
    """The link between neighbouring pipeline stages."""
    return cluster.intra if axis_stride(layout, "pp") < cluster.gpus_per_node else cluster.inter


# ---- the pipeline bubble ---------------------------------------------------------------------

def bubble_time(schedule, p, m, t_f, t_b, v=1, t_w=None):
    """Idle time of a stage over one step, in the time of one micro-batch's forward t_f and
    backward t_b on a stage. These are this module's own formulas; pp/schedule.py is the
    implementation (the lead reconciles the two if they ever disagree):
        gpipe, 1f1b         (p-1)(t_f + t_b)           1F1B changes memory, not the bubble
        interleaved (v)     (p-1)(t_f + t_b) / v       v model chunks per stage
        zb-h1               (p-1)(t_f + t_b - 2 t_w)   t_w: the weight-gradient part of t_b
                            (Qi et al. 2023: (p-1)(T_F + T_B - T_W), T_B the input-gradient
                            part, T_B + T_W = t_b; default t_w = t_b / 2)
    m >= p is assumed (fewer micro-batches than stages idles more than this)."""
    if p == 1:
        return 0.0
    if schedule in ("gpipe", "1f1b"):
        return (p - 1) * (t_f + t_b)
    if schedule == "interleaved":
        return (p - 1) * (t_f + t_b) / v
    if schedule == "zb-h1":
        t_w = t_b / 2 if t_w is None else t_w
        return (p - 1) * (t_f + t_b - 2 * t_w)
    raise ValueError(f"schedule must be gpipe, 1f1b, interleaved or zb-h1, not {schedule!r}")


def exposed(comm, window, overlap, units=1):
    """Communication left over after hiding behind `window` seconds of compute: at most
    overlap x window hides, and never the last of `units` pieces (it starts after compute)."""
    if comm == 0:
        return 0.0
    return max(comm - overlap * window, comm / max(1, units))


# ---- one training step -----------------------------------------------------------------------

def _rate(cluster, layout):
    """FLOP/s one rank sustains: peak x efficiency, shared when ranks outnumber compute slots."""
    peak = cluster.peak_tflops if layout.amp else (cluster.peak_tflops_fp32
                                                    or cluster.peak_tflops)
    on_node = min(layout.gpus, cluster.gpus_per_node)
    share = max(1.0, on_node / (cluster.compute_slots or on_node))
    return peak * 1e12 * cluster.efficiency / share


def _stage_compute(config, layout, stage, b, seq):
    """(forward FLOPs, extra backward FLOPs beyond 2 x forward) of one micro-batch on one rank
    of `stage`: its layers (and the output layer on the last), split by tp and cp."""
    L, pp, h = config.n_layer, layout.pp, config.n_embd
    layers = sum(1 for i in range(L) if i * pp // L == stage)
    s_local = seq / layout.cp                # this rank's queries, against all seq keys
    per_layer = (24 * b * s_local * h * h + 4 * b * s_local * seq * h) / layout.tp
    fwd = layers * per_layer
    if stage == pp - 1:
        fwd += 2 * b * s_local * h * config.vocab_size / layout.tp
    extra = layers * per_layer if layout.recompute == "full" else 0.0
    if layout.tiled:                         # the backward recomputes q k^T tile by tile
        extra += layers * 2 * b * s_local * seq * h / layout.tp
    return fwd, extra, layers


def _tp_cp_comm(cluster, layout, layers, act, stage, comm):
    """(forward, backward) seconds of TP's all-reduces (RS + AG with SP) and CP's ring of key
    and value blocks for one micro-batch on a stage; act = b (s/cp) h e bytes."""
    f = b = 0.0
    if layout.tp > 1:
        if layout.sp:
            one = sum(collective_time(cluster, op, act, layout, "tp")
                      for op in ("reduce_scatter", "all_gather"))
        else:
            one = collective_time(cluster, "all_reduce", act, layout, "tp", comm)
        redo = 2 * layers if layout.recompute == "full" else 0
        f = (2 * layers + (stage == 0)) * one                # + the vocab-parallel embedding
        b = (2 * layers + redo + (stage == layout.pp - 1)) * one      # + the head's input
    if layout.cp > 1:
        k, m = span(layout, "cp", cluster.gpus_per_node)
        hop = p2p_time(2 * act, cluster.intra if m == 1 else cluster.inter)   # K and V
        redo = layout.cp - 1 if layout.recompute == "full" else 0
        f += layers * (layout.cp - 1) * hop          # cp/ring.py: forward N - 1 hops,
        b += layers * (2 * layout.cp - 1 + redo) * hop   # backward N - 1 (k, v) + N (dk, dv)
    return f, b


def step_time(config, layout, cluster, seq, global_batch, micro_batches=1, schedule="1f1b",
              comm="ring", v=1, bucket_mb=25.0):
    """Seconds of one training step and its parts: {"compute", "tp_cp", "pp_p2p", "bubble",
    "dp_exposed", "dp_comm", "optimizer", "step", "tokens_per_s", "mfu"}. global_batch in
    sequences; micro_batches per step; comm "ring" or "hier" (data-parallel all-reduce)."""
    m, e = micro_batches, (2 if layout.amp else 4)
    b = global_batch / (layout.dp * m)
    act = b * seq / layout.cp * config.n_embd * e
    rate = _rate(cluster, layout)
    p_bytes, g_bytes, _ = STATE_BYTES[bool(layout.amp)]
    dpcp, axis = layout.dp * layout.cp, ("cp" if layout.cp > 1 else "dp")

    def coll(op, nbytes):
        return collective_time(cluster, op, nbytes, layout, axis, comm, dpcp)
    worst = None
    for stage, n in enumerate(stage_params(config, layout.tp, layout.pp)):
        fwd, extra, layers = _stage_compute(config, layout, stage, b, seq)
        c_f, c_b = fwd / rate, (2 * fwd + extra) / rate
        tp_f, tp_b = _tp_cp_comm(cluster, layout, layers, act, stage, comm)
        p2p = p2p_time(act, p2p_link(cluster, layout)) if layout.pp > 1 else 0.0
        z_f = z_b = 0.0
        if layout.zero >= 3:     # gathers prefetched under compute, a reduce-scatter per layer
            z_f = exposed(coll("all_gather", n * p_bytes), c_f, cluster.overlap, layers)
            z_b = exposed(coll("all_gather", n * p_bytes) + coll("reduce_scatter", n * g_bytes),
                          c_b, cluster.overlap, layers)
        elif layout.zero == 2:   # each micro-batch's gradients reduce-scattered in backward
            z_b = exposed(coll("reduce_scatter", n * g_bytes), c_b, cluster.overlap,
                          math.ceil(n * g_bytes / (bucket_mb * 2 ** 20)))
        t_f, t_b = c_f + tp_f + p2p + z_f, c_b + tp_b + p2p + z_b
        row = dict(n=n, c=m * (c_f + c_b), tp_cp=m * (tp_f + tp_b), p2p=m * 2 * p2p,
                   zero=m * (z_f + z_b), t_f=t_f, t_b=t_b, c_b=c_b,
                   bubble=bubble_time(schedule, layout.pp, m, t_f, t_b, v))
        row["pipe"] = m * (t_f + t_b) + row["bubble"]
        worst = row if worst is None or row["pipe"] > worst["pipe"] else worst
    return _finish(config, layout, cluster, seq, global_batch, worst, coll, bucket_mb)


def _finish(config, layout, cluster, seq, global_batch, w, coll, bucket_mb):
    """Add the once-per-step data-parallel communication and the optimizer to the slowest
    stage's pipeline time `w`, and the derived figures."""
    p_bytes, g_bytes, _ = STATE_BYTES[bool(layout.amp)]
    n, units = w["n"], math.ceil(w["n"] * g_bytes / (bucket_mb * 2 ** 20))
    dp_comm, dp_exposed = 0.0, 0.0       # ZeRO-3's (and ZeRO-2's) is in the pipeline
    if layout.zero == 0:
        dp_comm = coll("all_reduce", n * g_bytes)
        dp_exposed = exposed(dp_comm, w["c_b"], cluster.overlap, units)
    elif layout.zero == 1:
        rs = coll("reduce_scatter", n * g_bytes)
        dp_comm = rs + coll("all_gather", n * p_bytes)
        dp_exposed = exposed(rs, w["c_b"], cluster.overlap, units) + dp_comm - rs
    elif layout.zero == 2:
        dp_comm = coll("all_gather", n * p_bytes)
        dp_exposed = dp_comm
    shard = math.ceil(n / (layout.dp * layout.cp)) if layout.zero else n
    out = {"compute": w["c"], "tp_cp": w["tp_cp"], "pp_p2p": w["p2p"], "bubble": w["bubble"],
           "zero_in_pipeline": w["zero"], "dp_comm": dp_comm,
           "dp_exposed": dp_exposed, "optimizer": shard * cluster.opt_s_per_param}
    out["step"] = w["pipe"] + out["dp_exposed"] + out["optimizer"]
    out["tokens_per_s"] = global_batch * seq / out["step"]
    peak = cluster.peak_tflops if layout.amp else (cluster.peak_tflops_fp32
                                                    or cluster.peak_tflops)
    out["mfu"] = model_flops(config, global_batch, seq) / (
        out["step"] * layout.gpus * peak * 1e12)
    return out
