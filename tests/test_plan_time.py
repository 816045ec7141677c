"""The step-time model (minidist/train/cost.py, comm_cost.py, cluster.py): collectives,
bubbles, overlap and whole steps worked by hand on toy models, the search and plan.py's
command line; first-use walk 32's terms (tests/plan_cases.py: the toys)."""
import json
from dataclasses import replace
import math
import subprocess
import sys

import pytest

from minidist.nn import GPTConfig
from minidist.train.args import train_parser
from minidist.train.cluster import Cluster, Elementwise, hbm_elementwise
from minidist.train.comm_cost import Link, collective_time, hier_all_reduce_time, ring_time, span
from minidist.train.cost import bubble_time, exposed, layer_flops, step_time
from minidist.train.planner import Layout, config_for_params, stage_params

from tests.plan_cases import TOY, TOY4, UNIT, plan_cli, training_refusal

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


def test_here_cluster_reads_the_calibration(tmp_path):
    """cluster_from_calibration: the link fit and the sync of the rank count nearest the
    asked one, the elementwise seconds as measured, ranks sharing the cores and the
    node's memory."""
    from minidist.train.cluster import cluster_from_calibration
    link = {"alpha": 1e-5, "bw": 1e9, "gamma": 0.0}
    cal = {"cores": 2, "mem_gib": 4.0, "peak_tflops": 0.1, "efficiency": 0.5, "overlap": 0.0,
           "opt_s_per_param": 1e-9, "links": {"2": link, "4": dict(link, alpha=7e-5)},
           "sync": {"2": {"sync_s": 1e-4}, "4": {"sync_s": 2e-3}},
           "replicated": dict(zip(("layer_f", "layer_b", "embed_f", "embed_b", "head_f",
                                   "head_b"), (1e-9, 2e-9, 3e-9, 4e-9, 5e-9, 6e-9)))}
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(cal))
    four = cluster_from_calibration(str(path), 4)
    assert four.intra.alpha == 7e-5 and four.sync_s == 2e-3 and four.compute_slots == 2
    assert four.replicated == Elementwise(1e-9, 2e-9, 3e-9, 4e-9, 5e-9, 6e-9)
    assert cluster_from_calibration(str(path), 2).sync_s == 1e-4
    # each rank's share of the node's memory (it was the whole node's for every rank: 4
    # ranks of 8.7 GiB "fit" in 11.8; first-use walk 18)
    assert (four.mem_gib, cluster_from_calibration(str(path), 2).mem_gib) == (1.0, 2.0)
    t = step_time(TOY, Layout(tp=4, amp=False), four, seq=2, global_batch=1)
    assert t["replicated"] > 0 and t["sync"] == pytest.approx((2 * 2 + 3 + 2 * 2 + 1) * 2e-3)


def test_plan_cli():
    """python examples/plan.py --params 7e9 --gpus 64 --json: rows fastest first, the best
    fits, its train_gpt command passes train_gpt's checks; a bad --layout is one error line
    and exit 2."""
    out = subprocess.run([sys.executable, "examples/plan.py", "--params", "7e9", "--gpus", "64",
                          "--seq", "4096", "--json", "--top", "3"],
                         capture_output=True, text=True, timeout=60, check=True)
    result = json.loads(out.stdout)
    steps = [r["step"] for r in result["rows"]]
    assert steps == sorted(steps) and result["rows"][0]["fits"]
    assert result["best"] == result["rows"][0]["layout"]
    run = result["command"].split()                     # the best row, as a train_gpt command
    assert run[:5] == ["mpirun", "-n", "64", "python", "examples/train_gpt.py"]
    # on GPUs, GPU to GPU: the bandwidth priced (walk 32's leftover: no --comm nccl)
    assert run[5:9] == ["--device", "cuda", "--comm", "nccl"]
    from minidist.train.strategy import check_layout
    check_layout(train_parser().parse_args(run[9:]), 64)          # training accepts it
    nosp = subprocess.run([sys.executable, "examples/plan.py", "--params", "7e9", "--gpus",
                           "8", "--seq", "4096", "--json", "--global-batch", "8", "--layout",
                           "tp=8,nosp"], capture_output=True, text=True, timeout=60, check=True)
    row = json.loads(nosp.stdout)["rows"][0]
    assert not row["sp"] and row["replicated"] > 0 and row["sync"] > 0
    bad = subprocess.run([sys.executable, "examples/plan.py", "--gpus", "8", "--layout",
                          "dp=4,tp=4"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.startswith("error: --layout")
    # the table's command says how to train in the vocabulary planned with
    table = subprocess.run([sys.executable, "examples/plan.py", "--params", "7e9", "--gpus",
                            "64", "--seq", "4096", "--top", "1"], capture_output=True,
                           text=True, timeout=60, check=True).stdout
    assert "run it (planned with a 50,257-token vocabulary: add --data, a folder of token " \
        "files in it, as nanoGPT or llm.c write them; without, train_gpt.py trains 256 " \
        "bytes): mpirun -n 64" in table, table


def test_search_splits_and_micro_batches():
    """8 ranks, 8 per node, 4 heads, 2 layers: tp in {1, 2, 4}, cp a power of two dividing
    the sequence, pp up to the layers, dp the rest and dividing the batch."""
    from minidist.train.search import micro_batch_counts, splits
    got = splits(GPTConfig(n_layer=2, n_head=4, n_embd=64), 8, 8, seq=64, global_batch=8)
    assert all(dp * tp * pp * cp == 8 for dp, tp, pp, cp in got)
    assert {tp for _, tp, _, _ in got} == {1, 2, 4} and max(pp for *_, pp, _ in got) == 2
    assert (8, 1, 1, 1) in got and (1, 4, 2, 1) in got and (2, 1, 1, 4) in got
    assert micro_batch_counts(1, 64) == [1, 2, 4, 8, 16, 32, 64]     # --grad-accum
    assert micro_batch_counts(1, 12) == [1, 2, 4]
    assert micro_batch_counts(4, 64) == [4, 8, 16, 32]


def test_search_accumulates_gradients_where_the_whole_batch_does_not_fit():
    """    python examples/plan.py --params 7e9 --gpus 8 --seq 4096 --global-batch 512
    proposed PP2 x ZeRO-1 x4 with full recompute, 42.3 s a step: without a pipeline the search
    tried one micro-batch of the whole per-rank batch (64 sequences), which fits nowhere.
    Now it tries --grad-accum 1, 2, 4, ... up to the first count that fits (more only costs
    time: checked for every layout here), and proposes ZeRO-1 with 32 micro-batches of 2
    sequences, no recompute: 29.7 s, the command training's checks accept."""
    from minidist.train.cluster import H100_IB
    from minidist.train.search import search, train_flags
    config = config_for_params(7e9, 4096)
    rows = search(config, H100_IB, 8, 4096, 512)
    best = next(r for r in rows if r["fits"])
    assert best["layout"] == "ZeRO-1 (amp, tiled)" and best["micro_batches"] == 32, best
    assert best["step"] < 30 and training_refusal(config, best, 8) is None
    flags = train_flags(config, best)
    assert flags[flags.index("--grad-accum") + 1] == "32" and "--ckpt-activations" not in flags
    by_layout = {}
    for r in rows:
        if r["pp"] == 1:
            by_layout.setdefault(r["layout"], []).append(r)
    for name, tried in by_layout.items():
        counts = sorted(r["micro_batches"] for r in tried)
        assert counts == [2 ** i for i in range(len(counts))], (name, counts)
        assert [r["fits"] for r in sorted(tried, key=lambda r: r["micro_batches"])][:-1] == \
            [False] * (len(tried) - 1), name          # stopped at the first that fits
        steps = [r["step"] for r in sorted(tried, key=lambda r: r["micro_batches"])]
        assert steps == sorted(steps), (name, steps)   # accumulating never priced faster


def test_bench_collectives_interleave_row(mpi):
    """--interleave: compute alone, the all-reduce alone, both in turn, and sync_s, the cost of
    the blocking all-reduce beyond the two timed apart (BENCHMARKS: where TP4's step goes).

        mpiexec -n 2 python examples/bench_collectives.py --interleave --max-bytes 64K \
            --repeats 1
    """
    out = mpi(2, "examples/bench_collectives.py", "--interleave", "--max-bytes", "64K",
              "--repeats", "1", timeout=120)
    row = json.loads(out.stdout.strip().splitlines()[-1])
    assert row["ranks"] == 2 and row["bytes"] == 64 * 1024
    assert min(row["compute"], row["all_reduce"], row["interleaved"]) > 0
    assert row["sync_s"] == pytest.approx(row["interleaved"] - row["compute"]
                                          - row["all_reduce"], abs=1e-12)
    assert isinstance(row["sync_median_s"], float) and row["compute_iters"] >= 1


# ---- first-use walk 32: the terms the cost model missed or over-counted -----------------------



def test_zero3_regathers_all_but_the_last_two_blocks_worked_by_hand():
    """TOY4 on dp 2, ZeRO-3, 1 B/s, no overlap: blocks 4 x 244 parameters, root 48 (wte,
    wpe, ln_f), 1024 x 4 B. Forward gathers all of it, 1/2 x 4096 = 2048 s; backward
    re-gathers the blocks but the last two (2 x 244 x 4 B, 976 s) and reduce-scatters the
    gradients (2048 s): 5072 s, 1.24x DDP's 4096 where the paper's 3 Psi says 6144
    (minidist/zero/README.md measures the same 1.24x at L = 4)."""
    t = step_time(TOY4, Layout(dp=2, zero=3, amp=False), UNIT, seq=2, global_batch=2)
    assert t["zero_in_pipeline"] == pytest.approx(2048 + 976 + 2048)
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


def test_efficiency_by_model_width():
    """A calibration with efficiencies at widths 128 and 256 gives 128's at 128, halfway (in
    log2) at 181, the nearest outside, and says which; one with a single figure warns."""
    from minidist.train.cluster import efficiency_for_width
    cal = {"efficiency": 0.5, "efficiency_by_width": {"128": 0.4, "256": 0.6}}
    assert efficiency_for_width(cal, 128) == (0.4, "measured at width 128")
    e, how = efficiency_for_width(cal, 181)
    assert e == pytest.approx(0.4 + 0.2 * (math.log2(181) - 7)) and "between" in how
    assert efficiency_for_width(cal, 1024)[0] == 0.6
    assert "outside" in efficiency_for_width(cal, 64)[1]
    assert "one model" in efficiency_for_width({"efficiency": 0.5}, 128)[1]


def test_the_plan_says_what_it_assumed_and_peaks_are_separate(capsys):
    """plan.py prints (and --json carries) the peaks, efficiency, overlap, links and sync it
    assumed; --peak-tflops is the 16-bit peak only (it was also float32's: restating 989 made
    --fp32 15x faster), --peak-tflops-fp32 the other; --overlap changes the overlap."""
    cli = plan_cli()
    base = ["--params", "1.3e9", "--seq", "2048", "--global-batch", "256", "--gpus", "64",
            "--fp32", "--layout", "dp=64,zero=1", "--json"]

    def run(*extra):
        cli.main(base + list(extra))
        return json.loads(capsys.readouterr().out)
    plain, restated = run(), run("--peak-tflops", "989")
    assert plain["assumed"]["peak_tflops_fp32"] == 67 and plain["assumed"]["overlap"] == 1
    assert restated["rows"][0]["step"] == pytest.approx(plain["rows"][0]["step"])
    faster = run("--peak-tflops-fp32", "134")
    assert faster["rows"][0]["compute"] == pytest.approx(plain["rows"][0]["compute"] / 2)
    assert run("--overlap", "0.5")["assumed"]["overlap"] == 0.5
    cli.main(base[:-1])
    out = capsys.readouterr().out
    assert "assumed: 989 TFLOP/s" not in out and "assumed: 67 TFLOP/s (float32" in out
    assert "never measured by minidist on a GPU" in out


@pytest.mark.parametrize("flags, says", [
    (["--calibration", "/nonexistent.json", "--preset", "here"],
     "--calibration /nonexistent.json: no such file"),
    (["--calibration", "examples/calibration_here.json"], "only with --preset here"),
    (["--calibration", "README.md", "--preset", "here"], "not a calibration"),
    (["--overlap", "1.5"], "--overlap 1.5:"),
    (["--calibration", "", "--preset", "here"], "--calibration : no such file"),
])
def test_plan_calibration_and_overlap_flags_are_checked(flags, says):
    out = subprocess.run([sys.executable, "examples/plan.py", "--n-layer", "2", "--gpus", "2",
                          *flags], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and says in out.stderr, out.stderr
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr


def test_hand_edited_calibrations_are_refused_and_zeros_are_values(tmp_path, capsys):
    """First-use walk 34: cores 0 was a ZeroDivisionError, a text efficiency a TypeError, a
    negative peak negative step times; --overlap 0 (the calibration's own value) was refused
    and --intra-lat 0 silently ignored."""
    from minidist.train.cluster import calibration_problem
    good = json.load(open("examples/calibration_here.json"))
    assert calibration_problem(good) is None
    for key, value in (("cores", 0), ("efficiency", "0.5"), ("peak_tflops", -1.0),
                       ("overlap", 2.0)):
        assert key in calibration_problem({**good, key: value})
    bad = tmp_path / "cal.json"
    bad.write_text(json.dumps({**good, "cores": 0}))
    out = subprocess.run([sys.executable, "examples/plan.py", "--preset", "here",
                          "--calibration", str(bad), "--n-layer", "2", "--gpus", "2"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "cores: not a positive number" in out.stderr
    assert "Traceback" not in out.stderr
    cli = plan_cli()
    cli.main(["--params", "1e9", "--gpus", "16", "--overlap", "0", "--intra-lat", "0",
                   "--inter-lat", "0", "--json"])
    assumed = json.loads(capsys.readouterr().out)["assumed"]
    assert (assumed["overlap"], assumed["intra_us"], assumed["inter_us"]) == (0, 0, 0)
