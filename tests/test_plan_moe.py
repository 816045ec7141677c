"""The planners under Mixture of Experts and expert parallelism (moe_cost.py), worked by hand:
the pairwise all-to-all, the experts' compute on a split sequence, ep x dp communication, the
busiest rank's load, ZeRO over the experts' replicas; examples/plan.py with experts."""
import json
from dataclasses import replace
import subprocess
import sys

import pytest

from minidist.train.args import train_parser
from minidist.train.cluster import Cluster
from minidist.train.comm_cost import Link, collective_time, span
from minidist.train.cost import step_time
from minidist.train.planner import Layout, bill, stage_params

from tests.plan_cases import MOE_TOY, TOY, UNIT, plan_cli


# ---- Mixture of Experts and expert parallelism (minidist/train/moe_cost.py) ------------------

# block 1 is MoE: 2 experts, top-2, capacity ceil(0.5 x 2 x 2 / 2) = 1 token per expert and
# sequence, so a sequence of 2 tokens keeps min(k s, E cap) = min(4, 2) = 2 of its 4 rows


def test_all_to_all_time_worked_by_hand():
    """Pairwise exchange, 4 ranks, 1200 B per rank: 3 steps of alpha + 300 B / 100 B/s = 12 s.
    EP groups are neighbours after tp: dp 4 = ep 2 x edp 2, tp 2, 4 GPUs per node: the ep
    group (ranks 0, 2) is one node, the edp group (ranks 0, 4) two."""
    from minidist.train.comm_cost import all_to_all_time
    assert all_to_all_time(1200, 4, Link(1.0, 100.0)) == pytest.approx(12.0)
    assert all_to_all_time(1200, 1, Link(1.0, 100.0)) == 0.0
    layout = Layout(dp=4, tp=2, ep=2)
    assert span(layout, "ep", 4) == (2, 1) and span(layout, "edp", 4) == (1, 2)
    two_nodes = Cluster("2x4", 4, 1, 1, 1, Link(1.0, 100.0), Link(10.0, 10.0))
    assert collective_time(two_nodes, "all_to_all", 200, layout, "ep") == pytest.approx(2.0)
    assert collective_time(two_nodes, "all_reduce", 200, layout, "edp") == pytest.approx(40.0)


def test_moe_compute_worked_by_hand():
    """MOE_TOY, b = 1, s = 2, 1 FLOP/s. Block 0 dense: 832. Block 1: attention 8 b s h^2 + 4 b
    s^2 h = 256 + 64, the router 2 b s h E = 32, the experts 16 h^2 x 2 kept rows = 512: 864.
    Output layer 128. Forward 1824, step 3 x = 5472 s. MFU's model FLOPs count the k s = 4
    rows (capacity ignored): experts 1024, forward 2336, 7008 (> the step's FLOPs: capacity
    dropped half the rows). TP2: attention halves, the router and experts stay whole: 416 +
    (160 + 544) + 64 = 1184, x 3 = 3552; all-reduces of 32 B (32 s each): forward 2 (dense
    block) + 1 (MoE block: attention only) + the embedding's, backward 2 + 1 + the head's."""
    t = step_time(MOE_TOY, Layout(amp=False), UNIT, seq=2, global_batch=1)
    assert t["compute"] == pytest.approx(5472) and t["step"] == pytest.approx(5472)
    assert t["mfu"] == pytest.approx(7008 / 5472)
    tp = step_time(MOE_TOY, Layout(tp=2, amp=False), UNIT, seq=2, global_batch=1)
    assert tp["compute"] == pytest.approx(3552) and tp["tp_cp"] == pytest.approx(8 * 32)
    with pytest.raises(ValueError):         # 2 experts do not split over ep 4
        step_time(MOE_TOY, Layout(dp=4, ep=4, amp=False), UNIT, seq=2, global_batch=4)


def test_moe_on_a_split_sequence_worked_by_hand():
    """MOE_TOY, b = 1, s = 2, 1 FLOP/s, 1 B/s, no latency (minidist/train/moe_cost.py
    split_times). TP2 + SP: the MoE block's router and experts run on s/2 tokens: (160 + 16
    + 256) + 416 + 64 = 912, x 3 = 2736 s. Its routing's exchange over tp: the ids, 1 B x k
    2 x s 2 = 4 B all-gathered (1/2 of it sent: 2 s), the sums (b E + 1) x 4 B = 12 B
    all-reduced (12 s): 14 s forward, 2 calls. The gradients over tp: the router's 8 values
    and both experts' 148 (c_fc 64 + 16, c_proj 64 + 4), 304 values, and the dense replicated
    ones (block 0's two norms and two row biases, 24; block 1's, no MLP bias, 20; wpe 8, ln_f
    8: 60), 364 x 4 B = 1456 B, summed by the strategy once a step in one all-reduce after the
    dp sync (minidist/tp/state.py sum_partial_grads): `tp_sum` 1456 s a step, nothing in
    backward (until 2026-11-29 priced per micro-batch, 9 calls in backward, as f summed them;
    the dense 240 B unpriced until 2026-11-29). Under --ep 2 this rank's one expert's 4 tensors
    (592 B) join the router's 32 B and the dense 240 B in that sum once a step, 864 s
    (until 2026-11-29 priced as f summed them: 592 s and 4 calls in each backward). CP2
    (s = 1 token a rank): the ring (forward 1 hop, backward 3, of K and V: 2 x 16 B: 32 s
    each, in both blocks: 256 s) + the ids over cp (k 2 x 2
    tokens = 4 B: 2 s) and the sums (12 s): 270 s of the step's tp_cp."""
    from minidist.train.moe_cost import split_times
    sp = Layout(tp=2, sp=True, amp=False)
    assert split_times(MOE_TOY, UNIT, sp, b=1, s=2, e=4, stage=0) == (14, 0, 2, 0)
    assert split_times(MOE_TOY, UNIT, Layout(tp=2, amp=False), 1, 2, 4, 0) == (0, 0, 0, 0)
    t = step_time(MOE_TOY, sp, UNIT, seq=2, global_batch=1)
    assert t["compute"] == pytest.approx(2736) and t["tp_sum"] == pytest.approx(1456)
    assert step_time(MOE_TOY, sp, UNIT, seq=2, global_batch=1, micro_batches=1)["tp_sum"] == \
        step_time(MOE_TOY, sp, UNIT, seq=4, global_batch=2, micro_batches=2)["tp_sum"]
    ep = Layout(dp=2, ep=2, tp=2, sp=True, amp=False)
    assert split_times(MOE_TOY, UNIT, ep, b=1, s=2, e=4, stage=0)[1::2] == (0, 0)
    assert step_time(MOE_TOY, ep, UNIT, seq=2, global_batch=2)["tp_sum"] == pytest.approx(864)
    assert step_time(MOE_TOY, Layout(tp=2, amp=False), UNIT, 2, 1)["tp_sum"] == 0
    cp = step_time(MOE_TOY, Layout(cp=2, amp=False), UNIT, seq=2, global_batch=1)
    assert cp["tp_cp"] == pytest.approx(256 + 14)


def test_ep2_dp2_communication_worked_by_hand():
    """MOE_TOY on dp 4 = ep 2 x edp 2, b = 1 per rank, 1 B/s, sync 10 s, 1 s per parameter.
    All-to-alls: 2 kept rows x h 4 x 4 B = 32 B, over 2 ranks 1 step of 16 B: 16 s; the
    counts 8 E = 16 B: 8 s; forward counts + dispatch + combine = 40, backward 32: 72 s, 5
    syncs: 50 s. Parameters: dense 244 (block 0) + 104 (block 1's attention, norms, router)
    + 48 (wte, wpe, ln_f) = 396, all-reduced over the 4 ranks: 2 x 3/4 x 396 x 4 B = 2376 s;
    each expert 148 (c_fc 64 + 16, c_proj 64 + 4), this rank's one all-reduced over its 2
    replicas in one bucket (592 B: 592 s; nothing hidden, no overlap), + clipping's 8 B over
    ep: 600 s.
    Optimizer: 396 + 148 = 544 s. ZeRO-1: the experts' one unit (148) over edp 2, a
    reduce-scatter of 1/2 x 592 B (from backward's hooks; no overlap here) and an all-gather
    as much: 592 s (no clipping sum of its
    own); optimizer ceil(396 / 4) + ceil(148 / 2) = 99 + 74 = 173 s. ep = dp = 2: no edp
    sum, only the clipping's 8 s; the dense all-reduce over 2 ranks, 1584 s. Full recompute
    runs the forward's 3 all-to-alls again in backward: 72 + 40 = 112 s, 8 syncs: 80 s; the
    blocks' forward once more: 5472 + 832 + 864 = 7168 s of compute."""
    unit = replace(UNIT, sync_s=10.0, opt_s_per_param=1.0)
    assert stage_params(MOE_TOY, ep=2) == [396 + 148]
    t = step_time(MOE_TOY, Layout(dp=4, ep=2, amp=False), unit, seq=2, global_batch=4)
    assert t["ep_all_to_all"] == pytest.approx(72) and t["sync"] == pytest.approx(50)
    assert t["dp_exposed"] == pytest.approx(2376) and t["expert_grads"] == pytest.approx(600)
    assert t["optimizer"] == pytest.approx(544)
    assert t["step"] == pytest.approx(5472 + 72 + 50 + 2376 + 600 + 544)
    z1 = step_time(MOE_TOY, Layout(dp=4, ep=2, zero=1, amp=False), unit, seq=2, global_batch=4)
    assert z1["optimizer"] == pytest.approx(173) and z1["dp_comm"] == pytest.approx(2376)
    assert z1["expert_grads"] == pytest.approx(592)
    ep2 = step_time(MOE_TOY, Layout(dp=2, ep=2, amp=False), unit, seq=2, global_batch=2)
    assert ep2["expert_grads"] == pytest.approx(8) and ep2["dp_exposed"] == pytest.approx(1584)
    redo = step_time(MOE_TOY, Layout(dp=4, ep=2, amp=False, recompute="full"), unit, seq=2,
                     global_batch=4)
    assert redo["ep_all_to_all"] == pytest.approx(112) and redo["sync"] == pytest.approx(80)
    assert redo["compute"] == pytest.approx(7168)


def test_experts_buckets_hide_behind_backward_worked_by_hand():
    """MOE_TOY on dp 4 = ep 2 x edp 2: this rank's expert, 4 tensors of 64, 16, 64, 4 values
    (256, 64, 256, 16 B), is a DDP of its own over edp (minidist/ddp/sync.py), bucketed as
    the dense DDP is: at 1 MiB one bucket, 2 alpha + 592 B over 2 ranks (+ the clip's 8 B
    over ep, 2 alpha + 8): 604 s at alpha 1 s, where one all-reduce per tensor cost 610.
    At 200 B a bucket, last tensor first: 16 | 256 | 64 | 256 (a tensor that would overflow
    starts the next). Overlap 1, no latency: backward computes 2/3 of the 5472 s, 3648 s;
    the dense 2376 s in 10 buckets (training's cut: call_cost.ddp_buckets) hide but the
    last, the first tensors' 192 B (wte, wpe, h.0.ln_1: it starts after backward),
    288 s over 4 ranks, exposed (until 2026-11-29 an equal share of the 2376 s in 8 buckets,
    297 s), 2088 s of the window filled; the experts' 592 s hide behind the 1560 s left but their
    last bucket, 592 / 4 = 148 s, + the clip's 8: 156 s."""
    from minidist.train.moe_cost import expert_buckets, expert_tensors
    ep2 = Layout(dp=4, ep=2, amp=False)
    sizes = expert_tensors(MOE_TOY, ep2, 0)
    assert sizes == [64, 16, 64, 4] and expert_buckets(sizes, 4, 1.0) == [592]
    assert expert_buckets(sizes, 4, 200 / 2**20) == [16, 256, 64, 256]
    slow = step_time(MOE_TOY, ep2, replace(UNIT, intra=Link(1.0, 1.0)), seq=2, global_batch=4,
                     bucket_mb=1.0)
    assert slow["expert_grads"] == slow["expert_comm"] == pytest.approx(604)
    t = step_time(MOE_TOY, ep2, replace(UNIT, overlap=1.0), seq=2, global_batch=4,
                  bucket_mb=200 / 2**20)
    assert t["dp_exposed"] == pytest.approx(288) and t["expert_comm"] == pytest.approx(600)
    assert t["expert_grads"] == pytest.approx(156)


def test_plan_cli_with_experts():
    """python examples/plan.py ... --moe-experts 4 --moe-top-k 2 --layout dp=4,ep=2 --json: the
    row carries ep and the all-to-all time; the search tries ep; a bad ep is one error line,
    exit 2; the MoE flags' names and defaults are train_gpt.py's."""
    model = ["--preset", "here", "--n-layer", "2", "--n-head", "2", "--n-embd", "64", "--seq",
             "32", "--vocab-size", "64", "--global-batch", "8", "--gpus", "4", "--fp32",
             "--moe-experts", "4", "--moe-top-k", "2", "--json"]
    run = [sys.executable, "examples/plan.py", *model]
    one = json.loads(subprocess.run(run + ["--layout", "dp=4,ep=2"], capture_output=True,
                                    text=True, timeout=60, check=True).stdout)["rows"][0]
    assert one["ep"] == 2 and one["ep_all_to_all"] > 0 and one["layout"].startswith("EP2")
    rows = json.loads(subprocess.run(run + ["--top", "100"], capture_output=True, text=True,
                                     timeout=60, check=True).stdout)["rows"]
    assert {r["ep"] for r in rows} == {1, 2, 4} and any(r["cp"] > 1 for r in rows)
    assert all(r["sp"] == (r["tp"] > 1) for r in rows)     # MoE on split sequences: built
    bad = subprocess.run(run + ["--layout", "dp=4,ep=3"], capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and bad.stderr.startswith("error: --layout: ep=3")
    assert len(bad.stderr.strip().splitlines()) == 1
    cli = plan_cli()
    ours, train = vars(cli.parse([])), vars(train_parser().parse_args([]))
    for flag in ("moe_experts", "moe_top_k", "moe_capacity_factor", "moe_every"):
        assert ours[flag] == train[flag]


def test_busiest_rank_load_worked_by_hand():
    """E = 2, top-1, capacity factor 2, s = 2: capacity ceil(2 x 1 x 2 / 2) = 2 tokens per
    expert, balanced 1 x 2 = 2 rows per sequence, full E x 2 = 4. ep 2, b = 1, load 1.5:
    the busiest rank runs 3 rows (load 3: capped at 4), 16 h^2 = 256 FLOPs each, x 3 for the
    step: + 768 (+ 1536) s over load 1; each of the 4 all-to-alls of rows (dispatch and
    combine, forward and backward) moves 3 x 16 B, half of it to the other rank: 24 s, not 16.
    Load 0.5 without ep (half the tokens dropped): 1 row, - 768 s."""
    from minidist.train.moe_cost import expert_rows
    cfg = replace(TOY, moe_experts=2, moe_top_k=1, moe_capacity_factor=2.0, moe_every=2)
    assert [expert_rows(cfg, 2, load=x) for x in (1, 1.5, 3)] == [2, 3, 4]
    ep2 = Layout(dp=2, ep=2, amp=False)
    base = step_time(cfg, ep2, UNIT, seq=2, global_batch=2)
    busy = step_time(cfg, ep2, UNIT, seq=2, global_batch=2, moe_load=1.5)
    full = step_time(cfg, ep2, UNIT, seq=2, global_batch=2, moe_load=3.0)
    assert busy["compute"] - base["compute"] == pytest.approx(768)
    assert full["compute"] - base["compute"] == pytest.approx(1536)
    assert busy["ep_all_to_all"] - base["ep_all_to_all"] == pytest.approx(4 * (24 - 16))
    dp2 = Layout(dp=2, amp=False)
    assert step_time(cfg, dp2, UNIT, seq=2, global_batch=2)["compute"] - step_time(
        cfg, dp2, UNIT, seq=2, global_batch=2, moe_load=0.5)["compute"] == pytest.approx(768)


def test_zero_under_ep_shards_the_experts_optimizer_over_their_replicas():
    """MOE_TOY on dp 4 = ep 2 x edp 2, ZeRO-3, float32: the 396 dense parameters sharded over
    the 4 ranks (ceil(396 / 4) = 99 each: 4 + 4 + 8 B), this rank's expert (148) ZeRO-1 over
    its 2 replicas, as minidist/ep/optim.py keeps it: params 4 (99 + 148), grads the same,
    optimizer 8 (99 + ceil(148 / 2) = 74)."""
    row = bill(MOE_TOY, Layout(dp=4, ep=2, zero=3, amp=False), seq=2)
    assert (row["params"], row["grads"], row["optimizer"]) == (4 * 247, 4 * 247, 8 * 173)
    ddp = bill(MOE_TOY, Layout(dp=4, ep=2, amp=False), seq=2)
    assert ddp["params"] == 4 * 544


def test_an_interleaved_stage_is_priced_the_blocks_it_holds():
    """MOE_TOY of 4 blocks (1 and 3 MoE), pp 2, v 2: the pipeline builds blocks 0, 2 on stage 0
    and 1, 3 on stage 1 (pp/schedule.py chunk_layers), so stage 1 runs both MoE blocks; until
    2026-11-30 the step-time model priced v = 1's stages (0, 1 and 2, 3: one MoE block each).
    b = 1, s = 2, 1 FLOP/s (test_moe_compute_worked_by_hand's blocks: dense 832, MoE 864, the
    output layer 128): stage 1's forward 2 x 864 + 128 = 1856, m = 2 micro-batches x 3 x
    1856 = 11136 s (v = 1's stages: 1824, 10944); the bubble (p - 1)(t_f + t_b) / v with the
    sends of 32 B twice a micro-batch each way: (1856 + 64 + 3712 + 64) / 2 = 2848. DDP's
    tensors, the experts' (ep 2: one expert of each MoE block) and Muon's work per stage are
    those blocks' too (Muon: stage 0 twice pp 4's dense stage 0, stage 1 twice its MoE one)."""
    from minidist.pp.schedule import chunk_layers
    from minidist.train.call_cost import stage_tensors
    from minidist.train.moe_cost import expert_tensors
    from minidist.train.muon_cost import muon_times
    config = replace(MOE_TOY, n_layer=4)
    assert [config.is_moe(i) for i in range(4)] == [False, True, False, True]
    t = step_time(config, Layout(pp=2, amp=False), UNIT, seq=2, global_batch=2,
                  micro_batches=2, schedule="interleaved", v=2)
    assert t["compute"] == pytest.approx(11136) and t["bubble"] == pytest.approx(2848)
    assert step_time(config, Layout(pp=2, amp=False), UNIT, seq=2, global_batch=2,
                     micro_batches=2)["compute"] == pytest.approx(10944)
    assert [[i for c in chunk_layers(4, 2, 2, s) for i in c] for s in (0, 1)] == [[0, 2],
                                                                                  [1, 3]]
    experts = [sum(".mlp.experts." in name for name, _, _ in       # 2 experts x 4 tensors
                   stage_tensors(config, Layout(pp=2), s, v=2)) for s in (0, 1)]
    assert experts == [0, 2 * 8]
    ep2 = Layout(dp=2, ep=2, pp=2, amp=False)
    assert expert_tensors(config, ep2, 0, v=2) == [] and \
        expert_tensors(config, ep2, 1, v=2) == [64, 16, 64, 4] * 2
    assert [sum(n for _, n, _ in stage_tensors(config, Layout(pp=2), s, v=2)) for s in (0, 1)] \
        == stage_params(config, 1, 2, 1, v=2)
    one = muon_times(config, Layout(pp=4, muon=True, amp=False), UNIT, 1.0, lambda o, n: n)
    two = muon_times(config, Layout(pp=2, muon=True, amp=False), UNIT, 1.0, lambda o, n: n,
                     v=2)
    assert one[0] != one[1] and two == [tuple(2 * x for x in one[s]) for s in (0, 1)]
