"""The step-time model's Mixture of Experts and expert parallelism (minidist/train/cost.py
calls these; minidist/nn/moe.py is the layer, minidist/ep/ the strategy).

Compute of one MoE block, forward, b sequences of s tokens, hidden h, E experts, top-k,
capacity factor F (what minidist/nn/moe.py runs):
    attention        (8 b s h^2 + 4 b s^2 h) / tp       split by tp as in a dense block
    router           2 b s h E                          replicated on every tp rank
    experts          16 h^2 per (token, expert) row     whole experts on every tp rank
    shared experts   16 h^2 S per token / tp            (--moe-shared S) one MLP S wide,
                                                        split by tp as a dense MLP
    rows per sequence  min(k s, E ceil(F k s / E))      each expert keeps at most
                                                        ceil(F k s / E) tokens of a sequence
The rows assume a balanced routing by default: no expert gets more than its capacity, so
k s rows are kept when F >= 1 and E x capacity when F < 1. `load` (the CLI's --moe-load) is
the rows the busiest rank runs over that balanced count: below 1 when the routing drops
tokens (a rank without ep runs its own tokens' kept rows); above 1 under expert
parallelism when the routing is unbalanced: a rank runs the rows that arrive for its E/ep
experts, and every rank waits at the combine for the busiest one. Capped where that rank's
experts are full: E/ep x capacity x the ep b sequences of its group, i.e. E x capacity
rows per own sequence (~F k s: the capacity factor bounds the imbalance).
Model FLOPs (MFU's numerator) count k s rows per sequence: the k experts a token visits,
capacity ignored (as GPT.flops_per_token).

Communication, per MoE block and micro-batch on an ep group of N ranks (exchange.py):
forward an all-to-all of the counts (E int64s per rank), the dispatch and the combine (each
rows x h x e bytes per rank, (N-1)/N of it to the others), backward the combine's and the
dispatch's reverse (the counts are reused): 3 blocking all-to-alls forward, 2 backward, each
the pairwise exchange's (N-1)(alpha + n/(N B)) on the links the ep group spans, plus the
cluster's sync per blocking collective. Full recompute (--ckpt-activations) runs each block's
forward again inside backward, its 3 all-to-alls too: 3 forward, 3 + 2 backward.
Gradients (minidist/ep/strategy.py): the dense parameters go through DDP (or ZeRO) over
all dp ranks as before. Under DDP this rank's experts are a DDP of their own over their
dp / ep replicas (edp; minidist/ddp/sync.py, --ddp overlapped): their tensors cut into
buckets by the dense DDP's rule (expert_buckets: bucket_mb, last tensor first), each
bucket's all-reduce started from backward's hooks, so hidden behind what of the last
micro-batch's backward the dense gradients leave free, up to the overlap, never the last
bucket (until 2026-11-29 one all-reduce per tensor after backward, in full: 16 calls where
the run makes 1); gradient clipping sums one number over the ep group; the optimizer
updates all dense
parameters and this rank's experts. Under ZeRO (any stage) the experts are ZeRO-1 over edp
(minidist/ep/optim.py): per MoE block one flat unit of this rank's experts, its gradient
reduce-scattered over edp from backward's hooks (hidden likewise, never the last unit) and
its parameters all-gathered after the step, in full view
(the same bytes as the all-reduce, one unit per block instead of one call per tensor); the
clipping's sum rides on ZeRO's over dp; the optimizer updates the dense shard and 1/edp of
the experts (ceil per unit).
A sequence split over ranks (cp > 1; sequence parallelism, sp: each tp rank holds s/tp of
the cp rank's s tokens in the MoE block) routes over the whole sequence
(minidist/nn/moe_split.py): per MoE block forward, on the tp group under SP and then on the
cp group, an all-gather of the top-k expert ids (1 byte each; the cp one gathers tp parts)
and an all-reduce of the b E + 1 sums (e bytes each): 2 blocking collectives per group,
again inside backward under full recompute. Under SP the router and the experts run on the
rank's s/tp tokens (their FLOPs / tp), and their gradients, each rank's covering its
tokens, are summed over tp, which the dense MLP, split by tp, does not need: the router's
h E and the experts' (under --ep this rank's E/ep, after their sync over edp) by the
strategy once a step, in the coalesced all-reduce of the replicated gradients after the
data-parallel sync (minidist/tp/state.py sum_partial_grads, pieces of at most 4 MiB, an
all-reduce each, with the dense layer norms, biases and wpe: minidist/train/call_cost.py
sp_sum; ZeRO: this rank's shard of them; until 2026-11-29 --ep's experts were summed in
backward, one blocking call per tensor every micro-batch).
Tests: tests/test_plan_moe.py (test_all_to_all_time_worked_by_hand,
test_moe_compute_worked_by_hand, test_ep2_dp2_communication_worked_by_hand,
test_busiest_rank_load_worked_by_hand).
"""
import functools
import math

from minidist.nn.config import (attention_weights, block_param_specs, config_key, config_of_key,
                                mlp_weights)
from minidist.nn.moe import capacity
from minidist.pp.schedule import block_stages
from minidist.ddp.sync import bucket_cuts
from minidist.train.comm_cost import collective_time
from minidist.train.tp_cp_cost import exposed


def check_moe_layout(config, layout):
    """Raise ValueError for a layout the MoE model does not cover (module docstring)."""
    if not config.moe_experts:
        if layout.ep > 1:
            raise ValueError("ep > 1 needs a Mixture of Experts (moe_experts)")
        return
    if layout.dp % layout.ep or config.moe_experts % layout.ep:
        raise ValueError(f"ep {layout.ep} must divide dp {layout.dp} and the "
                         f"{config.moe_experts} experts")


def expert_rows(config, s, active=False, load=1.0):
    """Expert rows per sequence of s tokens on the busiest rank: min(k s, E x capacity) kept
    under a balanced routing, times `load` (module docstring), at most E x capacity;
    active: k s (the model FLOPs' count)."""
    k, E = config.moe_top_k, config.moe_experts
    if active:
        return k * s
    full = E * capacity(s, E, k, config.moe_capacity_factor)
    return min(min(k * s, full) * load, full)


def moe_block_flops(config, b, s, tp=1, s_keys=None, active=False, load=1.0, sp=False):
    """Forward FLOPs of one MoE block on b sequences of s tokens (queries), on one tp rank:
    attention split by tp, the router and the experts' rows whole, on s/tp of the tokens
    under sequence parallelism (module docstring)."""
    h, keys = config.n_embd, s if s_keys is None else s_keys
    attention = (2 * b * s * attention_weights(config) + 4 * b * s * keys * h) / tp
    moe = 2 * b * s * h * config.moe_experts + \
        2 * mlp_weights(config) * b * expert_rows(config, s, active, load)
    shared = 2 * mlp_weights(config) * config.moe_shared * b * s / tp     # split by tp
    return attention + (moe / tp if sp else moe) + shared


def stage_moe_blocks(config, layout, stage, v=1):
    """MoE blocks on pipeline `stage` (of v chunks under interleaving)."""
    return stage_blocks(config_key(config), layout.pp, stage, v)[1]


@functools.lru_cache(maxsize=4096)
def stage_blocks(key, pp, stage, v=1):
    """(blocks, MoE blocks) on pipeline `stage` of `pp` of the model `key` (config_key), v
    chunks a stage (block_stages): kept, as the search asks for every layout (2,000 blocks:
    7 s of a search's 50)."""
    config = config_of_key(key)
    mine = [i for i, s in enumerate(block_stages(config.n_layer, pp, v)) if s == stage]
    return len(mine), sum(1 for i in mine if config.is_moe(i))


def exchange_times(config, cluster, layout, b, s, e, blocks, load=1.0):
    """(forward, backward) seconds of the all-to-alls of `blocks` MoE blocks for one
    micro-batch of b sequences (e bytes per value), and their (forward, backward) counts;
    the busiest rank's rows (`load`) set the size (a sendrecv waits for the larger side).
    Full recompute repeats the forward's inside backward."""
    if layout.ep == 1 or blocks == 0:
        return 0.0, 0.0, 0, 0
    rows = b * expert_rows(config, s, load=load)
    data = collective_time(cluster, "all_to_all", rows * config.n_embd * e, layout, "ep")
    counts = collective_time(cluster, "all_to_all", 8 * config.moe_experts, layout, "ep")
    fwd, n_fwd = blocks * (counts + 2 * data), 3 * blocks
    redo = layout.recompute == "full"
    return fwd, blocks * 2 * data + redo * fwd, n_fwd, 2 * blocks + redo * n_fwd


def split_times(config, cluster, layout, b, s, e, stage, v=1):
    """(forward, backward) seconds and (forward, backward) counts of the blocking collectives
    of a sequence split over ranks (module docstring) for one micro-batch of b sequences on
    `stage`, s = this cp rank's tokens: the exchange of each MoE block's routing (ids,
    sums) on tp (SP) and cp. (Under SP the router's and the experts' gradients, --ep's
    too, are summed over tp once a step, not in backward: call_cost.sp_sum.) v: chunks a
    stage (stage_moe_blocks)."""
    blocks = stage_moe_blocks(config, layout, stage, v)
    tp = layout.tp if layout.sp and layout.tp > 1 else 1
    groups = [(axis, tokens) for axis, tokens, on in (("tp", s, tp > 1),
                                                      ("cp", s * layout.cp, layout.cp > 1)) if on]
    if not blocks or not groups:
        return 0.0, 0.0, 0, 0
    k, E = config.moe_top_k, config.moe_experts      # ids gathered: every token's k, 1 B
    one = sum(collective_time(cluster, "all_gather", b * tokens * k, layout, axis) +
              collective_time(cluster, "all_reduce", (b * E + 1) * e, layout, axis)
              for axis, tokens in groups)
    fwd, n_fwd = blocks * one, blocks * 2 * len(groups)
    redo = layout.recompute == "full"
    bwd, n_bwd = redo * fwd, redo * n_fwd
    return fwd, bwd, n_fwd, n_bwd


def _own_experts(config, layout, stage, v=1):
    """(MoE blocks on `stage`, the sizes of one expert's parameter tensors, the E/ep experts
    one rank holds of each block) under ep: every ep rank holds as many, of the same shapes;
    every expert's tensors are expert 0's."""
    return (stage_moe_blocks(config, layout, stage, v), list(_one_expert(config_key(config))),
            config.moe_experts // layout.ep)


@functools.lru_cache(maxsize=256)
def _one_expert(key):
    """Sizes of expert 0's parameter tensors in a MoE block of the model `key` (config_key):
    kept, as the search asks for every layout (E 128: 8 of its 80 s under cProfile)."""
    return tuple(math.prod(shape) for name, (shape, _) in
                 block_param_specs(config_of_key(key), True).items()
                 if ".mlp.experts.0." in name)


def expert_tensors(config, layout, stage, v=1):
    """Sizes of the expert parameter tensors one rank of `stage` (v chunks a stage) holds
    under ep > 1 (E/ep experts of each MoE block, block by block, expert by expert); []
    without expert parallelism (DDP/ZeRO then treats the experts as any parameter)."""
    if layout.ep == 1:
        return []
    blocks, one, mine = _own_experts(config, layout, stage, v)
    return one * (mine * blocks)


def expert_units(config, layout, stage, v=1):
    """Per MoE block of `stage` (v chunks a stage), the parameters of the E/ep experts one
    rank holds: the flat units of the experts' ZeRO over edp (minidist/ep/optim.py); []
    without ep. (Counted per block, not walked expert by expert: E 32 on 64 GPUs made this
    31 s of a 115 s search.)"""
    if layout.ep == 1:
        return []
    blocks, one, mine = _own_experts(config, layout, stage, v)
    return [mine * sum(one)] * blocks


def expert_buckets(sizes, g_bytes, bucket_mb):
    """Bytes of each all-reduce the experts' DDP over edp runs a step: `sizes` (this rank's
    expert tensors, forward order) cut into buckets of bucket_mb MiB of `g_bytes`-byte
    gradients, last tensor first, by training's own rule (minidist/ddp/sync.py
    bucket_cuts: --ddp overlapped, the default, and bucketed)."""
    return list(_buckets(tuple(sizes), g_bytes, bucket_mb))


@functools.lru_cache(maxsize=64)
def _buckets(sizes, g_bytes, bucket_mb):
    """expert_buckets, kept per argument (a search cuts the same experts for many layouts)."""
    nbytes = [n * g_bytes for n in sizes]
    return tuple(sum(nbytes[i] for i in cut) for cut in bucket_cuts(nbytes, bucket_mb))


def expert_grad_time(cluster, layout, sizes, g_bytes, comm="ring", units=(), p_bytes=0,
                     window=0.0, bucket_mb=1.0):
    """(exposed, whole) seconds of the experts' gradient sums over edp. Under DDP the experts'
    own DDP (minidist/ddp/sync.py; module docstring): an all-reduce per bucket (`sizes`,
    expert_buckets at bucket_mb), started from backward's hooks, so hidden behind `window`
    seconds of backward up to the cluster's overlap, never the last bucket (as the dense
    DDP's, cost.py), and clipping's one-number all-reduce over ep (blocking, in full). Under
    ZeRO per unit (`units`, expert_units) a reduce-scatter of its gradients, started from
    backward's hooks too (ZeRO-1's), hidden likewise, and an all-gather of its `p_bytes`
    parameters after the step, in full view. No edp sum when ep = dp (one replica)."""
    if not sizes:
        return 0.0, 0.0

    times = {}                      # (op, bytes) -> seconds: buckets repeat (one per expert

    def edp(op, nbytes):            # tensor past bucket_mb: E 128 made this 23 s of 80)
        if (op, nbytes) not in times:
            times[op, nbytes] = collective_time(cluster, op, nbytes, layout, "edp", comm)
        return times[op, nbytes]
    if layout.zero:
        rs = sum(edp("reduce_scatter", n * g_bytes) for n in units)
        ag = sum(edp("all_gather", n * p_bytes) for n in units)
        return exposed(rs, window, cluster.overlap, len(units)) + ag, rs + ag
    buckets = expert_buckets(sizes, g_bytes, bucket_mb)
    summed = sum(edp("all_reduce", n) for n in buckets)
    clip = collective_time(cluster, "all_reduce", 8, layout, "ep")
    return exposed(summed, window, cluster.overlap, len(buckets)) + clip, summed + clip
