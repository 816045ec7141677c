"""The step-time model's Muon (--optimizer muon: minidist/optim/muon.py, the per-parameter
optimizer; minidist/zero/muon.py ShardedMuon under ZeRO): the Newton-Schulz iterations one
rank runs each step and the collectives they wait for; minidist/train/cost.py adds both to
the step. Muon's state (memory) is minidist/train/planner.py's.

Which matrices: takes_muon's, a block's weights of 2 or more dimensions (attention's c_attn
and c_proj, the MLP's c_fc and c_proj; in a MoE block the router, every expert's and the
shared experts' matrices). AdamW updates the rest. The elementwise part of either update
(momentum, decay, the step) is the cluster's opt_s_per_param per parameter, as before.

Newton-Schulz (muon.py newton_schulz) of an A x B matrix, A <= B (it runs on the wide
orientation), `steps` iterations (--muon-ns-steps, 5): muon.py ns_flops, steps x (4 A^2 B +
2 A^3) FLOPs per matrix and step (X X^T, S S, (b S + c S S) X); c_attn's q, k, v and a
SwiGLU c_fc's gate and up are matrices of their own (muon.py packed_flops). Priced at the
float32 rate, peak_tflops_fp32 x efficiency (shared like compute where ranks share cores): NS
runs in the optimizer's dtype, float32 (--amp's master weights), never in the 16-bit
compute's; on the h100 preset 67 TFLOP/s of peak, not 989.

Who runs which NS, and what moves first (U in float32: 4 bytes a value):
    no ZeRO      every matrix the rank holds, whole: one process, DDP and CP all of them, PP
                 its stage's, EP its E/ep experts of each MoE block (and every dense matrix)
    TP           a matrix split over tp (c_attn, c_fc, both c_proj, the shared experts'; the
                 router and the experts are whole on every tp rank, and run NS on each) is
                 all-gathered over tp (muon.py `whole`): (tp-1)/tp of the whole matrix's
                 bytes received, one blocking collective each (+ Cluster.sync_s, as TP's
                 others); its NS runs on one tp rank (muon.py tp_owners: per block, the
                 costliest first to the least busy), and a reduce-scatter over tp of its
                 steps (the same bytes, + sync) hands each rank its shard. The block's
                 reduce-scatters wait for every owner, so a block costs its collectives
                 and the most any tp rank owns (+ the whole matrices' NS)
    ZeRO         per block unit (zero/flat.py gpt_units: one per block), its flat U, padded
                 to a multiple of the shard group's N ranks, all-gathered over the shard
                 group (the bytes of a ZeRO-1 parameter gather, priced like ZeRO's other
                 gathers: no sync); each matrix is then one rank's (muon.py balance: the
                 costliest first, to the least busy rank), which runs its NS (under TP
                 shared with its tp peers, below), and a reduce-scatter of the unit's flat
                 steps (the same bytes) hands each rank its shard of them. The next unit's
                 gather is a ring every rank must join, so a unit costs its two collectives
                 and the most any rank spends on the matrices it owns; x the blocks of each
                 kind (dense, MoE), whose units are laid out alike
    TP x ZeRO    ZeRO's owners; an owner's tp peers own the matrix too, and its split
                 matrices are shared over them as TP's (minidist/zero/muon.py ShardedMuon
                 tp_owners: muon.tp_owners over the matrices of the unit it owns): the most
                 any tp rank owns of them, + a tp all-gather and reduce-scatter each (+
                 sync); the router and the experts, whole, on every tp peer of their owner
    EP + ZeRO    the experts' unit of each MoE block (minidist/ep/optim.py: this rank's E/ep
                 experts) likewise, over the experts' replicas (edp)
Nothing here overlaps: the optimizer runs after backward, each gather before its NS.
Tests: tests/test_plan_muon.py (test_muon_step_worked_by_hand,
test_muon_with_experts_worked_by_hand, test_muon_ns_per_zero_rank_is_the_sharded_optimizers).
"""
import collections
import math

from minidist.nn.config import block_param_specs, packed_widths
from minidist.optim.muon import balance, packed_flops, takes_muon, tp_owners
from minidist.pp.schedule import block_stages
from minidist.train.comm_cost import axis_size, collective_time
from minidist.train.planner import local_size

MUON_BYTES = 4           # U's bytes a value: float32, the optimizer's dtype (masters under amp)


Piece = collections.namedtuple("Piece", "size shape split widths")
# one parameter of a block on one rank: `size` its elements there (its tp shard), `shape`
# its whole shape where Muon updates it (else None), `split` whether TP splits it, `widths`
# the matrices its last axis packs (nn/config.py packed_widths: c_attn's q, k, v)


def block_pieces(config, moe, layout):
    """(dense, experts): one block's parameters on one rank in model order (the flat order of
    its ZeRO unit, and of the experts' unit under ep) as Pieces. Under ep the experts are a
    list of their own, this rank's E/ep of them (each the same shapes as expert 0's); without
    ep they are in `dense`, all E, as in the block's unit."""
    mine = config.moe_experts // layout.ep
    dense, experts = [], []
    for name, (shape, _) in block_param_specs(config, moe).items():
        expert = ".mlp.experts." in name
        if expert and int(name.split(".mlp.experts.")[1].split(".")[0]) >= mine:
            continue                                   # another ep rank's
        size = local_size(name, shape, layout.tp)
        piece = Piece(size, tuple(shape) if takes_muon(name, shape) else None,
                      size != math.prod(shape), packed_widths(config, name, shape))
        (experts if expert and layout.ep > 1 else dense).append(piece)
    return dense, experts


def _per_parameter(pieces, layout, cluster, rate, steps):
    """(NS seconds, tp seconds) of the matrices `pieces` of one block on one rank without
    ZeRO (the per-parameter Muon), or of one unit that a ZeRO rank owns (ShardedMuon, the
    same three loops over tp): the NS of each one whole here (every matrix without TP; under
    TP the router and the experts, on every tp rank); each tp-split one's on one tp rank
    (muon.tp_owners; the busiest rank's share, which the turned order does not change),
    all-gathered before and reduce-scattered after over tp, every tp rank in both (the
    whole matrix's bytes, (tp-1)/tp of them sent, + sync each)."""
    split = [p for p in pieces if p.shape and p.split]
    ns = sum(packed_flops(p.shape, p.widths, steps) for p in pieces
             if p.shape and not p.split) / rate
    load = [0.0] * layout.tp
    owners = tp_owners([p.shape for p in split], [p.widths for p in split], layout.tp, 0, steps)
    for p, r in zip(split, owners):
        load[r] += packed_flops(p.shape, p.widths, steps) / rate
    talk = sum(collective_time(cluster, op, math.prod(p.shape) * MUON_BYTES, layout, "tp")
               + cluster.sync_s for p in split for op in ("all_gather", "reduce_scatter"))
    return ns + max(load), talk


def _busiest(pieces, n, layout, cluster, rate, steps):
    """(NS seconds, tp seconds, padded elements) of one flat unit of `pieces` sharded over n
    ranks (zero/flat.py FlatUnit: padded to a multiple of n): each matrix is one rank's
    (ShardedMuon's owners: optim/muon.py balance, by whole-matrix NS FLOPs), which under TP
    shares the split ones' NS with its tp peers (`_per_parameter` of what it owns); the rank
    that spends the most on the matrices it owns."""
    padded = -(-sum(p.size for p in pieces) // n) * n
    mats = [p for p in pieces if p.shape and p.size]
    owners = balance([packed_flops(p.shape, p.widths, steps) for p in mats], n)
    ranks = [_per_parameter([p for p, o in zip(mats, owners) if o == r], layout, cluster,
                            rate, steps) for r in range(n)]
    ns, talk = max(ranks, key=sum)
    return ns, talk, padded


def muon_times(config, layout, cluster, rate, coll, comm="ring", steps=5, v=1):
    """[(NS seconds, communication seconds)] of Muon in one step on one rank of each pipeline
    stage (module docstring): `rate` the float32 FLOP/s of one rank; `coll(op, nbytes)` a
    collective over ZeRO's shard group (cost.step_time's). Priced once per kind of block
    (dense, MoE: every block of a kind is laid out alike), then added up per stage: its
    blocks, of its v chunks under interleaving (block_stages)."""
    L, pp = config.n_layer, layout.pp
    per_kind = {}
    for moe in {config.is_moe(i) for i in range(L)}:
        dense, experts = block_pieces(config, moe, layout)
        if not layout.zero:
            per_kind[moe] = _per_parameter(dense + experts, layout, cluster, rate, steps)
            continue
        ns, talk, padded = _busiest(dense, layout.zero_ranks, layout, cluster, rate, steps)
        talk += coll("all_gather", padded * MUON_BYTES) + coll("reduce_scatter",
                                                               padded * MUON_BYTES)
        if experts:                                    # their own unit, over edp
            e_ns, e_talk, e_padded = _busiest(experts, axis_size(layout, "edp"), layout,
                                              cluster, rate, steps)
            ns += e_ns
            talk += e_talk + sum(collective_time(cluster, op, e_padded * MUON_BYTES, layout,
                                                 "edp", comm)
                                 for op in ("all_gather", "reduce_scatter"))
        per_kind[moe] = ns, talk
    out = [(0.0, 0.0)] * pp
    for i, stage in enumerate(block_stages(L, pp, v)):
        ns, talk = per_kind[config.is_moe(i)]
        out[stage] = (out[stage][0] + ns, out[stage][1] + talk)
    return out
