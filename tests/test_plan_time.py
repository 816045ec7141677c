"""The step-time model (minidist/train/cost.py, comm_cost.py, cluster.py): collectives,
bubbles, overlap and whole steps worked by hand on toy models; first-use walk 32's terms
(tests/plan_cases.py: the toys). The search and plan.py's command line:
tests/test_plan_search.py; the calibration: tests/test_plan_calibration.py."""
from dataclasses import replace

import pytest

from minidist.nn import GPTConfig
from minidist.train.cluster import Cluster, Elementwise, hbm_elementwise
from minidist.train.comm_cost import Link, collective_time, hier_all_reduce_time, ring_time, span
from minidist.train.cost import bubble_time, exposed, layer_flops, step_time
from minidist.train.planner import Layout, stage_params
from minidist.train.zero3_cost import zero3_gathers

from tests.plan_cases import TOY, TOY4, UNIT

# ---- the step-time model (minidist/train/cost.py): small cases worked by hand ----------------

def test_ring_and_hierarchical_collective_times():
    link = Link(alpha=1.0, bw=100.0)
    # all-reduce, 4 ranks, 1000 B: 2 x (3 alpha + 3/4 x 1000 / 100) = 21; gamma 0.01: + 7.5
    assert ring_time("all_reduce", 1000, 4, link) == pytest.approx(21.0)
    assert ring_time("all_reduce", 1000, 4, link, gamma=0.01) == pytest.approx(28.5)
    assert ring_time("all_gather", 1000, 4, link) == pytest.approx(10.5)
    assert ring_time("reduce_scatter", 1000, 1, link) == 0.0
    # 2 nodes x 2 ranks, 800 B: RS in node 1 + 400/100 = 5; AR of 400 B across: 2 x (10 +
    # 200/10) = 60; AG in node 5. Flat ring at the slow link: 2 x (3 x 10 + 600/10) = 180
    intra, inter = Link(1.0, 100.0), Link(10.0, 10.0)
    assert hier_all_reduce_time(800, 2, 2, intra, inter) == pytest.approx(70.0)
    two_nodes = Cluster("2x2", 2, 1, 1, 1, intra, inter)
    dp4 = Layout(dp=4)
    assert collective_time(two_nodes, "all_reduce", 800, dp4, "dp", "hier") == \
        pytest.approx(70.0)
    assert collective_time(two_nodes, "all_reduce", 800, dp4, "dp") == pytest.approx(180.0)


def test_groups_are_placed_by_the_mesh_order():
    """global rank = tp + tp (cp + cp (dp + dp pp)): tp groups are neighbours."""
    assert span(Layout(dp=2, tp=4), "tp", 4) == (4, 1)        # ranks 0-3: one node
    assert span(Layout(dp=2, tp=4), "dp", 4) == (1, 2)        # ranks 0, 4: two nodes
    assert span(Layout(dp=4, tp=2), "dp", 4) == (2, 2)        # ranks 0, 2 | 4, 6
    assert span(Layout(dp=2, tp=2, pp=2), "pp", 8) == (2, 1)  # ranks 0, 4: one node of 8
    assert span(Layout(dp=3), "dp", 2) == (0, 2)              # 2 + 1: uneven nodes


def test_bubble_of_each_schedule():
    """p = 4 stages, t_f = 1, t_b = 2: (p-1)(t_f+t_b) = 9; interleaved v = 2 halves it;
    zb-h1 with t_w = t_b / 2 = 1: 3 x (1 + 2 - 2) = 3, a third. With m = 2 < p zb-h1 has too
    few W's to fill the bubble: F and B through 5 slots of 2 plus the last W, 11, less the
    work 2 x 3: 5."""
    assert bubble_time("gpipe", 4, 8, 1, 2) == pytest.approx(9)
    assert bubble_time("1f1b", 4, 8, 1, 2) == pytest.approx(9)
    assert bubble_time("interleaved", 4, 8, 1, 2, v=2) == pytest.approx(4.5)
    assert bubble_time("zb-h1", 4, 8, 1, 2) == pytest.approx(3)
    assert bubble_time("zb-h1", 4, 2, 1, 2) == pytest.approx(5)
    assert bubble_time("1f1b", 1, 8, 1, 2) == 0
    with pytest.raises(ValueError):
        bubble_time("dualpipe", 4, 8, 1, 2)


def test_overlap_hides_all_but_the_last_piece():
    assert exposed(10, 8, overlap=1.0) == 10          # one piece: nothing to hide behind
    assert exposed(10, 8, overlap=1.0, units=5) == 2  # 8 of 10 hidden
    assert exposed(10, 8, overlap=0.5, units=5) == 6  # half the window usable
    assert exposed(0, 8, overlap=1.0) == 0


def test_ddp_step_worked_by_hand():
    """TOY, b = 1 sequence of s = 2 tokens per rank, 1 FLOP/s, 1 B/s, no overlap.
    Forward: 2 layers x (24 x 2 x 4^2 + 4 x 2^2 x 4) + 2 x 2 x 4 x 8 = 1792 FLOPs; the step
    computes 3x that: 5376 s. Parameters: 2 (12 h^2 + 13 h) + V h + s h + 2 h = 536, float32
    gradients 2144 B, ring all-reduce over 2 ranks: 2 x 1/2 x 2144 = 2144 s."""
    assert layer_flops(1, 2, 4) == 832 and stage_params(TOY) == [536]
    t = step_time(TOY, Layout(dp=2, amp=False), UNIT, seq=2, global_batch=2)
    assert t["compute"] == pytest.approx(5376)
    assert t["dp_exposed"] == pytest.approx(2144)
    assert t["step"] == pytest.approx(5376 + 2144)
    assert t["mfu"] == pytest.approx(5376 * 2 / (7520 * 2 * 1))   # both ranks' model FLOPs
    assert t["tokens_per_s"] == pytest.approx(4 / 7520)


def test_tp_and_pipeline_steps_worked_by_hand():
    """TP2: every activation all-reduce is b s h e = 1 x 2 x 4 x 4 = 32 B, 2 x 1/2 x 32 =
    32 s; forward 2 per layer + the embedding's = 5, backward 2 per layer + the head's = 5.
    PP2, 2 micro-batches of 1: stage 1 (a layer + the output layer) is the slower, t_f =
    832 + 128 = 960 s, t_b = 1920 s, p2p 32 s each way; 2 x (t_f + t_b) + (2-1)(t_f + t_b),
    and the clip's global norm: an all-reduce of an 8-byte number over the 2 stages, 8 s."""
    tp = step_time(TOY, Layout(tp=2, amp=False), UNIT, seq=2, global_batch=1)
    assert tp["tp_cp"] == pytest.approx(10 * 32)
    pp = step_time(TOY, Layout(pp=2, amp=False), UNIT, seq=2, global_batch=2,
                   micro_batches=2)
    t_f, t_b = 960 + 32, 1920 + 32
    assert pp["bubble"] == pytest.approx(t_f + t_b)
    assert pp["clip_norm"] == pytest.approx(8)
    assert pp["step"] == pytest.approx(3 * (t_f + t_b) + 8)


def test_sequence_parallel_comm_counts_the_regathers_worked_by_hand():
    """TP2 + SP on TOY, b = 1, s = 2: act = 32 B, a reduce-scatter or an all-gather over 2
    ranks 1/2 x 32 = 16 s. Forward: (2 layers x 2 + the embedding) x (16 + 16) = 160 s;
    backward the same 160 s + each column layer's input re-gathered (c_attn, c_fc per layer,
    the head: 5 x 16 = 80 s): 400 s, against TP2's 10 all-reduces of 32 s = 320 s. With full
    recompute the blocks' forward pairs again (4 x 32) and the re-gathers once: 528 s."""
    tp2 = Layout(tp=2, amp=False)
    sp = step_time(TOY, replace(tp2, sp=True), UNIT, seq=2, global_batch=1)
    assert sp["tp_cp"] == pytest.approx(160 + 160 + 80)
    assert step_time(TOY, tp2, UNIT, seq=2, global_batch=1)["tp_cp"] == pytest.approx(320)
    ckpt = step_time(TOY, replace(tp2, sp=True, recompute="full"), UNIT, seq=2, global_batch=1)
    assert ckpt["tp_cp"] == pytest.approx(400 + 4 * 32)


def test_replicated_elementwise_worked_by_hand():
    """TP2 without SP, TOY, b = 1, s = 2: act = 1 x 2 x 4 x 4 = 32 B; every rank repeats its
    norms and adds, so (1 - 1/2) x 32 = 16 x the per-byte seconds is added: forward 2 layers x
    1 + embed 3 + head 5 = 10 -> 160 s, backward 2 x 2 + 4 + 6 = 14 -> 224 s. Full recompute
    runs the blocks' forward again in backward: + 2 x 1 x 16 = 32. Two ranks per slot double
    it; SP (norms on s/t tokens) and t = 1 add nothing."""
    unit = replace(UNIT, replicated=Elementwise(1, 2, 3, 4, 5, 6))
    tp2 = Layout(tp=2, amp=False)
    t = step_time(TOY, tp2, unit, seq=2, global_batch=1)
    assert t["replicated"] == pytest.approx(160 + 224)
    # the rest as before: compute 3 x (2 x 832 / 2 + 2 x 2 x 4 x 8 / 2) = 2688, 10 all-reduces
    # of 32 s, the loss's two all-reduces of 8 B and 16 B over 2 ranks: 8 + 16 s, the clip's
    # norm over tp: 8 s
    assert t["compute"] == pytest.approx(2688) and t["loss_comm"] == pytest.approx(24)
    assert t["step"] == pytest.approx(2688 + 320 + 24 + 384 + 8)
    ckpt = step_time(TOY, replace(tp2, recompute="full"), unit, seq=2, global_batch=1)
    assert ckpt["replicated"] == pytest.approx(384 + 32)
    shared = step_time(TOY, tp2, replace(unit, compute_slots=1), seq=2, global_batch=1)
    assert shared["replicated"] == pytest.approx(2 * 384)
    assert step_time(TOY, replace(tp2, sp=True), unit, seq=2, global_batch=1)["replicated"] == 0
    assert step_time(TOY, Layout(dp=2, amp=False), unit, seq=2, global_batch=2)[
        "replicated"] == 0


def test_hbm_elementwise_counts_activation_passes():
    """At 1 B/s a block moves 14 activations forward and 14 backward (module docstring)."""
    assert hbm_elementwise(1.0) == Elementwise(14, 14, 3, 1, 2, 3)
    assert hbm_elementwise(2.0).layer_f == 7


def test_sync_per_blocking_collective_worked_by_hand():
    """sync_s = 10 s per blocking collective. TP2 on TOY (2 layers, one stage): forward 2 x 2
    all-reduces + the embedding's + the loss's 2 = 7, backward 2 x 2 + the head's = 5: 120 s.
    SP: each all-reduce is a reduce-scatter and an all-gather, (4 + 1) x 2 + 2 = 12 forward,
    5 x 2 = 10 backward, + the 4 column layers' and the head's re-gathers = 15: 270 s.
    CP2 (s/cp = 1): forward 2 layers x 1 hop, backward 2 x 3: 80 s.
    PP2 with TP2, 2 micro-batches: stage 1 (1 layer, the head: the slower) waits forward 2 + 2
    (the loss), backward 2 + 1 (the head's input) per micro-batch: 2 x 7 x 10 = 140 s."""
    unit = replace(UNIT, sync_s=10.0)
    tp2 = Layout(tp=2, amp=False)
    assert step_time(TOY, tp2, unit, seq=2, global_batch=1)["sync"] == pytest.approx(120)
    assert step_time(TOY, replace(tp2, sp=True), unit, seq=2, global_batch=1)[
        "sync"] == pytest.approx(270)
    assert step_time(TOY, Layout(cp=2, amp=False), unit, seq=2, global_batch=1)[
        "sync"] == pytest.approx(80)
    pp = step_time(TOY, Layout(tp=2, pp=2, amp=False), unit, seq=2, global_batch=2,
                   micro_batches=2)
    assert pp["sync"] == pytest.approx(140)



# ---- first-use walk 32: the terms the cost model missed or over-counted -----------------------



def test_zero3_regathers_all_but_the_last_two_blocks_worked_by_hand():
    """TOY4 on dp 2, ZeRO-3, 1 B/s, no overlap: blocks 4 x 244 parameters, root 48 (wte,
    wpe, ln_f), 1024 x 4 B. Forward gathers all of it, 1/2 x 4096 = 2048 s; backward
    re-gathers the blocks but the last two (2 x 244 x 4 B, 976 s) and reduce-scatters the
    gradients (2048 s): 5072 s, 1.24x DDP's 4096 where the paper's 3 Psi says 6144
    (minidist/zero/README.md measures the same 1.24x at L = 4). Two micro-batches
    (--grad-accum 2): the second forward finds the root and blocks 0 and 1 in their buffers
    (the first backward left them there) and gathers blocks 2 and 3 only, 976 s: 2048 + 976
    + 2 x (976 + 2048) = 9072 s, (N-1)/N (M Psi + R + (2M(L-2) + 2) b) (it was 2 x 5072)."""
    t = step_time(TOY4, Layout(dp=2, zero=3, amp=False), UNIT, seq=2, global_batch=2)
    assert t["zero_in_pipeline"] == pytest.approx(2048 + 976 + 2048)
    m2 = step_time(TOY4, Layout(dp=2, zero=3, amp=False), UNIT, seq=2, global_batch=4,
                   micro_batches=2)
    assert m2["zero_in_pipeline"] == pytest.approx(9072)
    assert m2["zero_in_pipeline"] == pytest.approx(1 / 2 * 4 * (2 * 1024 + 48 + 10 * 244))
    two = step_time(TOY, Layout(dp=2, zero=3, amp=False), UNIT, seq=2, global_batch=2)
    assert two["zero_in_pipeline"] == pytest.approx(2 * 1072)    # 2 blocks: none again


def test_interleaving_sends_v_times_and_stages_across_nodes_take_the_network():
    """TOY4, pp 2, 2 micro-batches of 1: each crosses the boundary once per chunk each way,
    act = 1 x 2 x 4 x 4 = 32 B at 1 B/s: 1F1B 2 x 2 x 32 = 128 s, interleaved (v = 2) 256 s.
    tp 4 x pp 4 on nodes of 8: stages 0-1 on node 0, 2-3 on node 1; the 1 -> 2 hop is the
    network's, and the stages move in step, so every hop is priced at it."""
    one = step_time(TOY4, Layout(pp=2, amp=False), UNIT, seq=2, global_batch=2,
                    micro_batches=2)
    two = step_time(TOY4, Layout(pp=2, amp=False), UNIT, seq=2, global_batch=2,
                    micro_batches=2, schedule="interleaved", v=2)
    assert (one["pp_p2p"], two["pp_p2p"]) == (pytest.approx(128), pytest.approx(256))
    from minidist.train.comm_cost import p2p_link
    net = replace(UNIT, inter=Link(0.0, 0.5))
    assert p2p_link(net, Layout(tp=4, pp=4)) == net.inter
    assert p2p_link(net, Layout(tp=4, pp=2)) == net.intra
    assert p2p_link(net, Layout(tp=1, pp=8)) == net.intra


def test_tiled_attention_computes_the_causal_half():
    """Tiles of 64 above the diagonal are skipped (flash.py attention_flops): n (n + 1) / 2 of
    n^2, 17/32 at s = 1024; the materialised square and the cp ring's blocks are priced
    whole. The MFU still counts the whole square: the same model FLOPs, a shorter step."""
    from minidist.autograd.flash import attention_flops
    from minidist.train.cost import causal_share
    tiled = Layout(tiled=True)
    assert causal_share(tiled, 1024) == pytest.approx(17 / 32)
    counted = attention_flops(1024, 8, 64)
    assert causal_share(tiled, 1024) == pytest.approx(counted["flops"] / counted["flops_full"])
    assert causal_share(Layout(), 1024) == 1.0 and causal_share(replace(tiled, cp=2), 1024) == 1
    cfg = GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=1024, vocab_size=256)
    full = step_time(cfg, Layout(amp=False), UNIT, seq=1024, global_batch=1)
    half = step_time(cfg, Layout(amp=False, tiled=True), UNIT, seq=1024, global_batch=1)
    assert half["compute"] < full["compute"] and half["mfu"] > full["mfu"]


def test_mfu_counts_the_cores_ranks_share():
    """On a machine of 2 cores (compute_slots), 4 ranks have 2 cores' peak, as 2 ranks do:
    the same work in the same time is the same MFU (first-use walk 32: 0.50 at 2 ranks, 0.25
    at 4, 0.06 at 16)."""
    from minidist.train.cost import compute_units
    cores = replace(UNIT, compute_slots=2, gpus_per_node=16)
    assert [compute_units(cores, g) for g in (1, 2, 4, 16)] == [1, 2, 2, 2]
    assert compute_units(UNIT, 16) == 16


def test_zero3_gathers_without_a_pipeline_are_the_closed_form():
    """Without a pipeline ZeRO-3's blocks gathered in a step of M micro-batches (--grad-accum,
    zero3_cost.zero3_gathers: two buffers by parity) are the closed form of zero/README.md,
    2M(L-2) + 2 beyond the root: every block in the first forward, L-2 in each backward and
    each later forward (the other two still in their buffers)."""
    for layers in (2, 3, 4, 7):
        for m in (1, 2, 4):
            gathers = zero3_gathers("1f1b", 1, 0, m, layers)
            assert [kind for kind, _ in gathers] == ["F", "B"] * m
            assert gathers[0] == ("F", layers)
            assert sum(k for _, k in gathers) == 2 * m * (layers - 2) + 2, (layers, m)



@pytest.mark.parametrize("tp,pp,ep", [(1, 1, 1), (2, 1, 1), (2, 2, 1), (1, 4, 1), (2, 2, 2)])
def test_the_calls_tensors_are_the_stages_parameters(tp, pp, ep):
    """minidist/train/call_cost.py cuts DDP's buckets and SP's pieces from each stage's
    tensors in model order (stage_tensors): they add up to planner.stage_params for a dense
    GPT-2, a MoE one (every other block, 4 experts, an expert's 1/ep), a Llama one."""
    from minidist.train.call_cost import stage_tensors
    base = GPTConfig(n_layer=4, n_head=4, n_embd=32, block_size=16, vocab_size=250)
    for config in (base, replace(base, moe_experts=4, moe_every=2), replace(base, arch="llama")):
        if ep > 1 and not config.moe_experts:
            continue
        layout = Layout(tp=tp, pp=pp, ep=ep, dp=2 * ep)
        assert [sum(n for _, n, _ in stage_tensors(config, layout, s)) for s in range(pp)] == \
            stage_params(config, tp, pp, ep), config
