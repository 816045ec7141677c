"""The step-time model: how fast one layout trains on one cluster (the planner says if it fits).
The cluster (`Cluster`: peak, efficiency, links, ...; the presets) is minidist/train/cluster.py.

Compute. Forward FLOPs per micro-batch of b sequences of s tokens (Megatron's count, Narayanan
et al. 2021, appendix): 24 b s h^2 per layer in the matmuls, 4 b s^2 h in attention (q k^T and
p v), 2 b s h V in the output layer. Backward is twice forward; full recompute
(--ckpt-activations) runs each block's forward once more; tiled attention's backward
recomputes the scores (2 b s^2 h per layer), and so do selective recompute's (--attention
recompute) and the cp ring's. TP divides the FLOPs by t, CP the tokens by c, PP the layers
by p. Time = FLOPs /
(peak x efficiency), the efficiency a measured factor (`Cluster.efficiency`); on a machine with
fewer cores than ranks (`compute_slots`), ranks share them: time x ranks per node / slots.
MFU counts model FLOPs (3 x forward, no recompute) over the step time and the peak (of the
GPUs; of the cores where ranks share them, `compute_units`): the whole attention square
counted, so under tiled attention (half of it computed) MFU can pass the efficiency a little.

Work TP does not split. The efficiency is measured on (or assumed for) a whole step, layer
norms and adds included, and TP divides it all by t; but without sequence parallelism every TP
rank repeats the elementwise work on the full activation (Korthikanti et al. 2022): each
block's ln_1, ln_2, two row-parallel bias adds and two residual adds, the embedding's token +
position add, ln_f. So (1 - 1/t) of it is added back, at `Cluster.replicated`'s seconds per
activation byte (forward, backward; shared cores slow it as they slow compute); with SP that
work runs on s/t tokens and the division by t is right.
Sync. Each blocking TP/CP collective (TP's all-reduces or SP's reduce-scatters and
all-gathers, the vocabulary-parallel loss's two small all-reduces, CP's ring hops or
Ulysses' all-to-alls) also waits `Cluster.sync_s` for the ranks to arrive: measured here by
bench_collectives.py --interleave.
Under SP each column-parallel layer (c_attn, c_fc, the head) keeps only its input's shard and
all-gathers it again in backward (minidist/tp/gathered.py): one more all-gather of b s h e per
column layer each backward, counted in full (minidist starts it before dX's matmul, which may
hide it; the model does not assume so) and as one more blocking collective.

Collectives: the alpha-beta model of minidist's ring and hierarchical algorithms and of its
pairwise all-to-all, placed on the links a group spans by the mesh order
(minidist/train/comm_cost.py).
Context parallelism (cp_comm), per layer and micro-batch, S = b (s/cp) (h/tp) e and Skv the
bytes of K (S kv/n_head under grouped-query attention; Ulysses: lcm(kv/tp, cp) of the
n_head/tp heads): the ring's send/recv hops of K and V blocks (2Skv each; N-1 forward, 2N-1
backward, N-1 more under full recompute), or Ulysses' two all-to-alls each way (qkv S + 2Skv
and y S a rank, the forward's again under full recompute) on the cp group's links: the bytes
of cp/ring.py ring_bytes and cp/ulysses.py ulysses_bytes. The attention's FLOPs are the same
either way.
Mixture of Experts and expert parallelism (minidist/train/moe_cost.py): a MoE block's router
and experts (k rows per token, at most the capacity), not split by tp (on s/tp tokens under
SP); under ep its 3 + 2 blocking all-to-alls per micro-batch, the experts' gradients
all-reduced over their replicas (dp x cp / ep) in buckets started from backward's hooks
(ZeRO: reduce-scattered per MoE block), hidden in what backward the dense ones leave
free, never the last bucket, the dense ones by DDP/ZeRO
over all dp (x cp) ranks; on a sequence split by cp or SP, the routing's exchange (the
experts' ids, the loss statistics); SP's sum of the replicated gradients (call_cost.py).

The step: m micro-batches through p stages, each micro-batch forward t_f and backward t_b on
a stage (compute, TP's all-reduces, CP's ring or Ulysses' all-to-alls, EP's all-to-alls,
ZeRO-3's exposed gathers: the blocks not still in their two buffers, in the schedule's
order, the root once a step, as zero/stage3.py gathers them (zero3_cost.py); the p2p
sends), then
    pipeline = m (t_f + t_b) + bubble(schedule)
    step     = pipeline + exposed data-parallel communication + experts' gradients + optimizer
               (+ Muon's collectives; its Newton-Schulz is optimizer time: muon_cost.py)
Data-parallel communication overlaps with backward (DDP's buckets, ZeRO-1/2/3's reduce-scatter,
ZeRO-3's prefetched gathers with forward) up to `Cluster.overlap` x the window, never the last
bucket or layer; each bucket and unit a call (its latency: call_cost.py). Gradients travel
in the planner's gradient bytes (planner.state_bytes: 2 or 4), parameters in their own.
Tests: tests/test_plan_time.py (each formula on a small case worked by hand),
tests/test_plan_vs_runs.py (ZeRO-3's and the experts' bytes against the runs').
"""
import math
from collections import Counter

from minidist.nn.config import attention_weights, config_key, mlp_weights
from minidist.pp.schedule import bubble_fraction
from minidist.train.call_cost import calls_time, last_unit, stage_calls, zero_units
from minidist.train.comm_cost import axis_size, collective_time, p2p_link, p2p_time
from minidist.train.moe_cost import (check_moe_layout, exchange_times, expert_grad_time,
                                     expert_tensors, expert_units, moe_block_flops,
                                     split_times, stage_blocks, stage_moe_blocks)
from minidist.train.muon_cost import muon_times
from minidist.train.planner import stage_block_params, stage_params, state_bytes
from minidist.train.tp_cp_cost import (blocking_counts, exposed, loss_comm,  # (exposed: also
                                       ring_block_times, tp_cp_comm)          # the tests')
from minidist.train.zero3_cost import zero3_gathers


# ---- FLOPs -----------------------------------------------------------------------------------

def layer_flops(b, s, h, weights=None):
    """Forward FLOPs of one transformer layer: 2bs x its matmul weights (`weights`; GPT-2's
    12h^2: QKV, proj, fc, fc2) + 4bs^2h (QK^T and AV)."""
    weights = 12 * h * h if weights is None else weights
    return 2 * b * s * weights + 4 * b * s * s * h


def forward_flops(config, b, s, active=False, load=1.0):
    """Forward FLOPs of the whole model on b sequences of s tokens (output layer included); a
    MoE block's experts on the rows capacity keeps (x load; active: k per token;
    moe_cost.py)."""
    moe = moe_block_flops(config, b, s, active=active, load=load) if config.moe_experts else 0
    dense = layer_flops(b, s, config.n_embd, attention_weights(config) + mlp_weights(config))
    return sum(moe if config.is_moe(i) else dense for i in range(config.n_layer)) + \
        2 * b * s * config.n_embd * config.vocab_size


def model_flops(config, b, s):
    """FLOPs a training step needs in theory (MFU's numerator): 3 x forward, the k experts
    each token visits."""
    return 3 * forward_flops(config, b, s, active=True)


# ---- the pipeline bubble ---------------------------------------------------------------------

def bubble_time(schedule, p, m, t_f, t_b, v=1, t_w=None):
    """Idle time of a stage over one step, given one micro-batch's forward t_f and backward
    t_b on a stage (t_b includes the weight-gradient part t_w; default t_w = t_b / 2). The
    formula is pp/schedule.py's bubble_fraction (the one the simulator's pictures check),
    turned from a share of the step into seconds: idle = work x f / (1 - f), work = m(t_f+t_b).
    For m >= p that is
        gpipe, 1f1b         (p-1)(t_f + t_b)           1F1B changes memory, not the bubble
        interleaved (v)     (p-1)(t_f + t_b) / v       v model chunks per stage
        zb-h1               (p-1)(t_f + t_b - 2 t_w)   the W's fill t_w of each idle slot"""
    if p == 1:
        return 0.0
    work = m * (t_f + t_b)
    if schedule in ("gpipe", "1f1b"):
        f = bubble_fraction(schedule, p, m)
    elif schedule == "interleaved":
        f = bubble_fraction("1f1b", p, m, v=v)
    elif schedule == "zb-h1":
        t_w = t_b / 2 if t_w is None else t_w
        f = bubble_fraction("zb-h1", p, m, t_f=t_f, t_b=t_b - t_w, t_w=t_w)
    else:
        raise ValueError(f"schedule must be gpipe, 1f1b, interleaved or zb-h1, not {schedule!r}")
    return work * f / (1 - f)


# ---- one training step -----------------------------------------------------------------------

def _share(cluster, layout):
    """How many ranks share one compute slot (1: each has its own)."""
    on_node = min(layout.gpus, cluster.gpus_per_node)
    return max(1.0, on_node / (cluster.compute_slots or on_node))


def _rate(cluster, layout, float32=False):
    """FLOP/s one rank sustains: peak x efficiency, shared when ranks outnumber compute slots;
    `float32`: at the float32 peak whatever the layout's precision (Muon's Newton-Schulz)."""
    peak = cluster.peak_tflops if layout.amp and not float32 else (cluster.peak_tflops_fp32
                                                                   or cluster.peak_tflops)
    return peak * 1e12 * cluster.efficiency / _share(cluster, layout)


def _stage_compute(config, layout, stage, b, seq, load=1.0, v=1):
    """(forward FLOPs, extra backward FLOPs beyond 2 x forward) of one micro-batch on one rank
    of `stage`: its layers (of its v chunks under interleaving; and the output layer on the
    last), split by tp and cp; a MoE block's router and experts whole on every tp rank, the
    busiest rank's rows (`load`; moe_cost.py)."""
    pp, h = layout.pp, config.n_embd
    layers, moe = stage_blocks(config_key(config), pp, stage, v)
    s_local = seq / layout.cp                # this rank's queries, against all seq keys
    # (Ulysses: all seq queries of a/cp heads, the same FLOPs)
    weights = attention_weights(config) + mlp_weights(config)          # GPT-2: 12 h^2
    attention = 4 * b * s_local * seq * h * causal_share(layout, seq)
    per_layer = (2 * b * s_local * weights + attention) / layout.tp
    blocks = (layers - moe) * per_layer + \
        (moe and moe * moe_block_flops(config, b, s_local, layout.tp, seq, load=load,
                                       sp=layout.sp))
    fwd = blocks
    if stage == pp - 1:
        fwd += 2 * b * s_local * h * config.vocab_size / layout.tp
    extra = blocks if layout.recompute == "full" else 0.0
    if not layout.keeps_scores or layout.recompute == "selective":   # backward: q k^T again
        extra += layers * attention / 2 / layout.tp
    return fwd, extra, layers


def causal_share(layout, seq, block=64):
    """The share of the (s, s) attention square a rank computes: all of it where the scores
    are materialised (the mask is applied to a full square); tiled (cp 1), only the tiles
    on or below the diagonal, n (n + 1) / 2 of n^2 for n = s / block
    (minidist/autograd/flash.py attention_flops; its DEFAULT_BLOCK of 64, and
    FlashAttention's kernels skip the same tiles). 0.53 at s = 1024. The MFU still counts
    the whole square (model_flops: the convention)."""
    if not layout.tiled or layout.cp > 1:
        return 1.0
    n = math.ceil(seq / block)
    return (n + 1) / (2 * n)


def _replicated(cluster, layout, layers, act, stage):
    """(forward, backward) seconds of the elementwise work every TP rank repeats without SP,
    beyond the 1/t of it the compute term already counts: (1 - 1/t) x act x Elementwise's
    seconds per byte, slowed like compute where ranks share cores."""
    if layout.tp == 1 or layout.sp:
        return 0.0, 0.0
    r, first, last = cluster.replicated, stage == 0, stage == layout.pp - 1
    k = (1 - 1 / layout.tp) * act * _share(cluster, layout)
    redo = r.layer_f if layout.recompute == "full" else 0.0
    f = layers * r.layer_f + first * r.embed_f + last * r.head_f
    b = layers * (r.layer_b + redo) + first * r.embed_b + last * r.head_b
    return k * f, k * b


def step_time(config, layout, cluster, seq, global_batch, micro_batches=1, schedule="1f1b",
              comm="ring", v=1, bucket_mb=25.0, moe_load=1.0, ns_steps=5):
    """Seconds of one training step and its parts: {"compute", "replicated", "tp_cp",
    "ep_all_to_all", "loss_comm", "sync", "pp_p2p", "bubble", "dp_exposed", "dp_comm",
    "expert_grads", "optimizer", "muon_ns", "muon_comm", "clip_norm", "tp_sum", "step",
    "tokens_per_s", "mfu"}.
    global_batch in sequences; micro_batches per step; comm "ring" or "hier" (data-parallel
    all-reduce); moe_load: the busiest rank's expert rows over a balanced routing's
    (moe_cost.py); ns_steps: Muon's Newton-Schulz iterations (layout.muon: muon_cost.py).
    ValueError for a MoE layout minidist does not run (moe_cost.check_moe_layout)."""
    check_moe_layout(config, layout)
    if moe_load <= 0:
        raise ValueError(f"moe_load is the busiest rank's rows over the balanced count, "
                         f"positive, not {moe_load}")
    m, e = micro_batches, (2 if layout.amp else 4)
    b = global_batch / (layout.dp * m)
    act = b * seq / layout.cp * config.n_embd * e
    rate = _rate(cluster, layout)
    rate32 = _rate(cluster, layout, float32=True)          # Muon's NS, in float32
    p_bytes, g_bytes, _ = state_bytes(layout.amp, layout.grad32)
    dpcp, axis = layout.dp * layout.cp, ("cp" if layout.cp > 1 else "dp")
    if layout.zero and layout.zero_shard:   # hybrid sharding: ZeRO's in the shard group
        dpcp, axis = layout.zero_shard, "shard"

    def coll(op, nbytes, calls=1):          # DDP's or ZeRO's group; n calls of the bytes
        return calls_time(lambda o, n: collective_time(cluster, o, n, layout, axis, comm, dpcp),
                          op, nbytes, calls)
    muon = muon_times(config, layout, cluster, rate32, coll, comm, ns_steps, v) \
        if layout.muon else [(0.0, 0.0)] * layout.pp        # per stage: NS, gathers
    worst = None            # each stage's blocks: of its v chunks (block_stages; v = 1's
    blocks = stage_block_params(config, layout.tp, layout.pp, layout.ep, v)  # until 11-30)
    for stage, n in enumerate(stage_params(config, layout.tp, layout.pp, layout.ep, v)):
        fwd, extra, layers = _stage_compute(config, layout, stage, b, seq, moe_load, v)
        moe = stage_moe_blocks(config, layout, stage, v)
        unsplit = 0 if config.moe_shared else moe            # MoE blocks with no tp-split MLP
        experts = expert_tensors(config, layout, stage, v)   # ep > 1: outside DDP/ZeRO
        dense = n - sum(experts)
        c_f, c_b = fwd / rate, (2 * fwd + extra) / rate
        tp_f, tp_b = tp_cp_comm(cluster, layout, layers, act, stage, comm, unsplit,
                                 ring_block_times(config, layout, b, seq, rate),
                                 (config.n_head, config.kv_heads))
        s_moe = seq / layout.cp / (layout.tp if layout.sp else 1)   # an MoE block's tokens
        a_f, a_b, na_f, na_b = exchange_times(config, cluster, layout, b, s_moe, e, moe,
                                              moe_load)
        q_f, q_b, nq_f, nq_b = split_times(config, cluster, layout, b, seq / layout.cp, e,
                                           stage, v)
        tp_f, tp_b = tp_f + q_f, tp_b + q_b                  # + the routing's exchange
        r_f, r_b = _replicated(cluster, layout, layers, act, stage)
        n_f, n_b = blocking_counts(layout, layers, stage, unsplit)
        n_f, n_b = n_f + na_f + nq_f, n_b + na_b + nq_b      # + EP's all-to-alls, routing
        loss = loss_comm(cluster, layout, b * seq / layout.cp, stage)
        extra_f = r_f + loss + n_f * cluster.sync_s        # work TP repeats, waits
        extra_b = r_b + n_b * cluster.sync_s
        # a micro-batch crosses each boundary once per chunk: v sends each way interleaved
        p2p = v * p2p_time(act, p2p_link(cluster, layout)) if layout.pp > 1 else 0.0
        z_f = z_b = filled = 0.0       # filled: backward that ZeRO-2/3's hidden part fills
        block = (blocks[stage] - sum(experts)) / max(layers, 1)
        root, units = dense - block * layers, zero_units(layout, layers, stage)
        last = coll("reduce_scatter", last_unit(layout, stage, root, block) * g_bytes) \
            if layout.zero in (1, 2) else 0.0                 # ZeRO-1/2's, in view
        if layout.zero >= 3:     # gathers prefetched under compute, a reduce-scatter per unit
            # each forward and backward gathers the blocks not still in their two buffers, the
            # first forward the root too (zero3_cost.py: in the schedule's order, as
            # zero/stage3.py; the runs' traces count the same): --grad-accum M's
            # (N-1)/N (M Psi + R + (2M(L-2) + 2) b) a step (zero/README.md); under 1F1B fewer
            # than GPipe's. t_f, t_b: their mean over the step's micro-batches
            pieces = max(layers // v, 1)               # units: a call per block and root unit
            counts = Counter((kind, k, i == 0) for i, (kind, k) in enumerate(
                zero3_gathers(schedule, layout.pp, stage, m, layers, v, config.n_layer)))
            for (kind, k, first), times in counts.items():       # (alike ones priced once)
                if kind == "F":
                    ag = coll("all_gather", (k * block + root * first) * p_bytes,
                              k + (units - layers) * first)
                    z_f += times * exposed(ag, c_f / v, cluster.overlap, pieces) / m
                else:
                    raw = coll("all_gather", k * block * p_bytes, k) + \
                        coll("reduce_scatter", dense * g_bytes / v, units / v)
                    z_b += times * exposed(raw, c_b / v, cluster.overlap, pieces) / m
                    filled += times * raw / m
        elif layout.zero == 2:   # each micro-batch's gradients reduce-scattered in backward,
            filled = coll("reduce_scatter", dense * g_bytes, units)     # a unit at a time,
            z_b = exposed(filled, c_b, cluster.overlap, units, last)     # the last in view
        calls = stage_calls(config, layout, stage, g_bytes, bucket_mb, v)  # DDP's, SP's sum
        t_f = c_f + tp_f + a_f + extra_f + p2p + z_f
        t_b = c_b + tp_b + a_b + extra_b + p2p + z_b
        row = dict(n=dense, experts=experts, expert_units=expert_units(config, layout, stage, v),
                   c=m * (c_f + c_b), tp_cp=m * (tp_f + tp_b),
                   a2a=m * (a_f + a_b), p2p=m * 2 * p2p, zero=m * (z_f + z_b),
                   rep=m * (r_f + r_b), loss=m * loss, sync=m * (n_f + n_b) * cluster.sync_s,
                   t_f=t_f, t_b=t_b, c_f=c_f, c_b=c_b, filled=filled - z_b,
                   units=units, last_unit=last,
                   buckets=calls[0][0], last_bucket=calls[0][1],
                   bubble=bubble_time(schedule, layout.pp, m, t_f, t_b, v))
        row["pipe"] = m * (t_f + t_b) + row["bubble"]
        row["muon_ns"], row["muon_comm"] = muon[stage]
        # SP: the replicated gradients summed over tp once a step, after the dp sync, in
        # pieces of at most 4 MiB (call_cost.py; ZeRO: this rank's shard of them)
        summed, n_sum = calls[1]
        row["tp_sum"] = calls_time(lambda o, n: collective_time(cluster, o, n, layout, "tp"),
                                   "all_reduce", summed, n_sum) + n_sum * cluster.sync_s
        # the slowest stage: its pipeline and Muon's work after it (AdamW: the pipeline's)
        row["slowest"] = row["pipe"] + row["muon_ns"] + row["muon_comm"] + row["tp_sum"]
        worst = row if worst is None or row["slowest"] > worst["slowest"] else worst
    return _finish(config, layout, cluster, seq, global_batch, worst, coll, bucket_mb, comm)


def _finish(config, layout, cluster, seq, global_batch, w, coll, bucket_mb, comm="ring"):
    """Add the once-per-step data-parallel communication (the dense parameters' `w["n"]`,
    the experts' all-reduce over edp) and the optimizer (with Muon's `w["muon_ns"]` and
    `w["muon_comm"]`) to the slowest stage's pipeline time `w`, and the derived figures."""
    p_bytes, g_bytes, _ = state_bytes(layout.amp, layout.grad32)
    n, buckets, units = w["n"], w["buckets"], w["units"]     # a call each (call_cost.py)
    dp_comm, dp_exposed = 0.0, 0.0       # ZeRO-3's (and ZeRO-2's) is in the pipeline
    ag = coll("all_gather", n * p_bytes, units) if layout.zero in (1, 2) else 0.0
    # after the step in full view, or (--overlap-param-gather) behind the next step's first
    # forward, unit by unit, the first (the root: the embedding) never hidden
    ag_exposed = exposed(ag, w["c_f"], cluster.overlap, config.n_layer + 1) \
        if layout.overlap_gather else ag
    if layout.zero == 0:
        dp_comm = coll("all_reduce", n * g_bytes, buckets)      # the last bucket in view:
        dp_exposed = exposed(dp_comm, w["c_b"], cluster.overlap, buckets,
                             coll("all_reduce", w["last_bucket"]))
    elif layout.zero == 1:       # a reduce-scatter per unit in the last backward, from hooks
        rs = coll("reduce_scatter", n * g_bytes, units)
        dp_comm = rs + ag
        dp_exposed = exposed(rs, w["c_b"], cluster.overlap, units, w["last_unit"]) + \
            ag_exposed
    elif layout.zero == 2:
        dp_comm, dp_exposed = ag, ag_exposed
    # what of the last backward the dense gradients' hidden communication fills
    filled = w["filled"] + ((dp_comm - dp_exposed) if layout.zero == 0 else
                            (rs - (dp_exposed - ag_exposed)) if layout.zero == 1 else 0.0)
    shard = math.ceil(n / layout.zero_ranks) if layout.zero else n
    if layout.zero and layout.zero_shard:   # hybrid: the shards averaged across the replicas
        across = calls_time(lambda o, b: collective_time(
            cluster, o, b, layout, "replicas", comm), "all_reduce", shard * g_bytes, units)
        # every stage starts each unit's as its last reduce-scatter lands, under the rest of
        # backward (minidist/zero/zero.py ZeroStage1._land, stage2.py ZeroStage2._finish_oldest)
        hidden = exposed(across, w["c_b"], cluster.overlap, config.n_layer + 1)
        dp_comm, dp_exposed = dp_comm + across, dp_exposed + hidden
    edp = axis_size(layout, "edp")     # ZeRO: the experts' shards over their replicas (x cp)
    mine = sum(math.ceil(u / edp) for u in w["expert_units"]) if layout.zero else \
        sum(w["experts"])
    # the experts' buckets (ZeRO: reduce-scatters) start from backward's hooks too: they
    # hide behind what of the last micro-batch's backward the dense ones leave free
    left = max(0.0, w["c_b"] - filled / cluster.overlap) if cluster.overlap else w["c_b"]
    expert = expert_grad_time(cluster, layout, w["experts"], g_bytes, comm,
                              w["expert_units"], p_bytes, left, bucket_mb)
    out = {"clip_norm": clip_norm_time(cluster, layout, coll),
           "compute": w["c"], "replicated": w["rep"], "tp_cp": w["tp_cp"],
           "ep_all_to_all": w["a2a"], "loss_comm": w["loss"], "sync": w["sync"],
           "pp_p2p": w["p2p"], "bubble": w["bubble"], "zero_in_pipeline": w["zero"],
           "dp_comm": dp_comm, "dp_exposed": dp_exposed,
           "expert_comm": expert[1], "expert_grads": expert[0],
           "optimizer": (shard + mine) * cluster.opt_s_per_param + w["muon_ns"],
           "muon_ns": w["muon_ns"], "muon_comm": w["muon_comm"], "tp_sum": w["tp_sum"]}
    out["step"] = w["pipe"] + out["dp_exposed"] + out["expert_grads"] + out["optimizer"] + \
        out["muon_comm"] + out["clip_norm"] + out["tp_sum"]
    out["tokens_per_s"] = global_batch * seq / out["step"]
    peak = cluster.peak_tflops if layout.amp else (cluster.peak_tflops_fp32
                                                    or cluster.peak_tflops)
    out["mfu"] = model_flops(config, global_batch, seq) / (
        out["step"] * compute_units(cluster, layout.gpus) * peak * 1e12)
    return out


def clip_norm_time(cluster, layout, coll):
    """Seconds of the gradient clip's global norm (minidist/train/step.py, every step): one
    blocking all-reduce of a number, plus the ranks' arrival (sync_s), over each group whose
    ranks hold different gradients (the strategies' reduce_sum_sq): ZeRO's shard group
    (`coll`: DDP's or ZeRO's), tp, pp. DDP's replicas hold the same: none. (ep's sum is
    among the experts' gradients: moe_cost.expert_grad_time.)"""
    groups = [coll("all_reduce", 8)] if layout.zero else []
    groups += [collective_time(cluster, "all_reduce", 8, layout, axis)
               for axis in ("tp", "pp") if getattr(layout, axis) > 1]
    return sum(groups) + len(groups) * cluster.sync_s


def compute_units(cluster, gpus):
    """What computes at the peak for `gpus` ranks: the GPUs; on a machine whose ranks share
    `compute_slots` cores per node, at most the cores of the nodes the ranks fill (4 ranks
    on 2 cores have 2 cores' peak, as 2 ranks do: MFU must not halve because ranks did)."""
    if cluster.compute_slots is None:
        return gpus
    nodes = math.ceil(gpus / cluster.gpus_per_node)
    return min(gpus, nodes * cluster.compute_slots)
