"""The memory planner (minidist/train/planner.py, examples/plan_memory.py) against the memory
ledger: a small model trained under each strategy, per-rank parameter, gradient and
optimizer bytes equal to the planner's, activations equal to its count of minidist's graph
and at least Korthikanti et al.'s; the published closed forms (ZeRO paper, Korthikanti
Table 2); the decision order; the CLI.

Adding a strategy is one row of ROWS: its train_gpt.py flags and the planner's Layout."""
import json
from dataclasses import asdict, replace
import math
import re
import subprocess
import sys

import pytest

from minidist.nn import GPT, GPTConfig
from minidist.train.args import train_parser
from minidist.train.loop import train
from minidist.pp.schedule import chunk_layers, waiting_for_weights
from minidist.pp.simulate import simulate
from minidist.train.activations import held_layers, layer_activation_bytes, stage_activations
from minidist.train.planner import (Layout, bill, config_for_params, model_state_bytes, plan,
                                    stage_params)

CFG = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=256)
FLAGS = ["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size", "32",
         "--batch-size", "8", "--steps", "2", "--eval-every", "0", "--eval-iters", "1",
         "--sample", "0"]
BATCH = 8

ROWS = [   # (name, ranks, train_gpt.py flags, the planner's layout); mpiexec for ranks > 1
    ("fp32", 1, [], Layout(amp=False)),
    ("fp32 ckpt", 1, ["--ckpt-activations"], Layout(amp=False, recompute="full")),
    ("amp", 1, ["--amp"], Layout(amp=True)),
    ("fp32 selective", 1, ["--attention", "recompute"],
     Layout(amp=False, recompute="selective")),
    ("amp selective accum2", 1, ["--amp", "--attention", "recompute", "--grad-accum", "2"],
     Layout(amp=True, recompute="selective")),
    ("amp ckpt accum2", 1, ["--amp", "--ckpt-activations", "--grad-accum", "2"],
     Layout(amp=True, recompute="full")),
    # Muon: its momentum alone for the blocks' matrices (4 B less each), AdamW's m, v the rest
    ("fp32 muon", 1, ["--optimizer", "muon"], Layout(amp=False, muon=True)),
    ("amp muon", 1, ["--amp", "--optimizer", "muon"], Layout(amp=True, muon=True)),
    pytest.param("ddp2 amp ckpt", 2, ["--amp", "--ckpt-activations"],
                 Layout(dp=2, amp=True, recompute="full"), marks=pytest.mark.mpi),
    pytest.param("ddp2 fp32", 2, [], Layout(dp=2, amp=False),
                 marks=[pytest.mark.mpi, pytest.mark.slow]),
    pytest.param("zero1 amp", 2, ["--zero", "1", "--amp"], Layout(dp=2, zero=1),
                 marks=pytest.mark.mpi),
    pytest.param("zero1 amp muon", 2, ["--zero", "1", "--amp", "--optimizer", "muon"],
                 Layout(dp=2, zero=1, muon=True), marks=pytest.mark.mpi),   # AdamW's bytes
    pytest.param("zero2 amp", 2, ["--zero", "2", "--amp"], Layout(dp=2, zero=2),
                 marks=[pytest.mark.mpi, pytest.mark.slow]),
    pytest.param("zero3 amp", 2, ["--zero", "3", "--amp"], Layout(dp=2, zero=3),
                 marks=[pytest.mark.mpi, pytest.mark.slow]),
    pytest.param("zero3 amp selective", 2, ["--zero", "3", "--amp", "--attention", "recompute"],
                 Layout(dp=2, zero=3, recompute="selective"), marks=pytest.mark.mpi),
    pytest.param("zero3 fp32 ckpt", 2, ["--zero", "3", "--ckpt-activations"],
                 Layout(dp=2, zero=3, amp=False, recompute="full"), marks=pytest.mark.mpi),
    pytest.param("tp2 amp", 2, ["--tp", "2", "--amp"], Layout(tp=2, amp=True),
                 marks=pytest.mark.mpi),
    pytest.param("tp2 fp32", 2, ["--tp", "2"], Layout(tp=2, amp=False),
                 marks=[pytest.mark.mpi, pytest.mark.slow]),
    pytest.param("pp2 amp", 2, ["--pp", "2", "--micro-batches", "2", "--amp"],
                 Layout(pp=2, amp=True), marks=pytest.mark.mpi),
    pytest.param("pp2 fp32", 2, ["--pp", "2", "--micro-batches", "2"],
                 Layout(pp=2, amp=False), marks=[pytest.mark.mpi, pytest.mark.slow]),
    pytest.param("tp2 fp32 muon", 2, ["--tp", "2", "--optimizer", "muon"],
                 Layout(tp=2, amp=False, muon=True), marks=[pytest.mark.mpi, pytest.mark.slow]),
]


def _ledger(ranks, flags, corpus, tmp, mpi):
    """The last step's per-rank ledger row (rank 0's) from --log-json, on pytest's --device
    (`mpi` hands it to the ranks; one process gets mpi.device's flag)."""
    log = tmp / "log.jsonl"
    argv = FLAGS + ["--data", corpus, "--cache-dir", str(tmp / "cache"), "--log-json",
                    str(log), *flags]
    if ranks == 1:
        train(train_parser().parse_args(argv + ["--device", mpi.device]))
    else:
        mpi(ranks, "examples/train_gpt.py", *argv, timeout=180)
    return [json.loads(line) for line in open(log)][-2]["mem"]


@pytest.mark.parametrize("name, ranks, flags, layout", ROWS)
def test_planner_matches_the_ledger(name, ranks, flags, layout, corpus, tmp_path, mpi):
    """e.g. mpiexec -n 2 python examples/train_gpt.py --amp --ckpt-activations --log-json L
    (the tiny flags above), then compare L's "mem" with planner.bill."""
    got = _ledger(ranks, flags, corpus, tmp_path, mpi)
    split = [int(flags[flags.index(f) + 1]) for f in ("--grad-accum", "--micro-batches")
             if f in flags]
    b = BATCH // (layout.dp * (split[0] if split else 1))     # sequences per micro-batch
    states = ("params", "grads", "optimizer")
    if layout.tp == layout.pp == 1:
        want = bill(CFG, layout, CFG.block_size, b, formula="minidist")
        assert {k: got[k] for k in states} == {k: want[k] for k in states}
        # DDP ranks slice the global batch, whose int64 token ids the graph keeps: +8 B/token
        assert abs(got["activations"] - want["activations"]) <= 8 * BATCH * CFG.block_size
    else:                      # TP and PP graphs: only Korthikanti's lower bound below
        want = bill(CFG, layout, CFG.block_size, b)
        assert {k: got[k] for k in states} == {k: want[k] for k in states}
    assert got["activations"] >= bill(CFG, layout, CFG.block_size, b)["activations"]


LLAMA_CFG = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=256,
                      arch="llama", bias=False, n_kv_head=1)


@pytest.mark.parametrize("name, ranks, flags, layout", [
    ("llama fp32", 1, [], Layout(amp=False)),
    ("llama amp", 1, ["--amp"], Layout(amp=True)),
    ("llama fp32 dropout", 1, ["--dropout", "0.1"], Layout(amp=False)),
    ("llama amp ckpt", 1, ["--amp", "--ckpt-activations"], Layout(amp=True, recompute="full")),
    pytest.param("llama tp2 amp", 2, ["--tp", "2", "--amp", "--n-kv-head", "2"],
                 Layout(tp=2, amp=True), marks=pytest.mark.mpi),
])
def test_planner_matches_a_llamas_ledger(name, ranks, flags, layout, corpus, tmp_path, mpi):
    """A Llama-style block (--arch llama --n-kv-head 1): the planner's parameter, gradient
    and optimizer bytes are the ledger's, its count of minidist's graph (SwiGLU's 2F + F
    per token, the repeated k and v, RoPE's tables, no position ids) the ledger's
    activations to the batch's token ids; without dropout Korthikanti's count is below them
    (with it, not: it keeps more for dropout than minidist's graph does, GPT-2's too)."""
    flags = ["--arch", "llama", "--n-kv-head", "1", *flags]      # tp: --n-kv-head 2 after it
    got = _ledger(ranks, flags, corpus, tmp_path, mpi)
    b, states = BATCH // layout.dp, ("params", "grads", "optimizer")
    cfg = replace(LLAMA_CFG, dropout=0.1 if "--dropout" in flags else 0.0,
                  n_kv_head=2 if ranks > 1 else 1)
    want = bill(cfg, layout, cfg.block_size, b,
                formula="minidist" if ranks == 1 else "korthikanti")
    assert {k: got[k] for k in states} == {k: want[k] for k in states}
    if ranks == 1:
        assert abs(got["activations"] - want["activations"]) <= 8 * BATCH * cfg.block_size
    if not cfg.dropout:
        assert got["activations"] >= bill(cfg, layout, cfg.block_size, b)["activations"]


def test_zero_paper_figure_1():
    """Rajbhandari et al.: 7.5B parameters, N_d = 64, mixed-precision Adam (K = 12)."""
    gb = {z: sum(model_state_bytes(7.5e9, 64, z, amp=True).values()) / 1e9 for z in range(4)}
    assert [round(gb[z], 1) for z in range(4)] == [120.0, 31.4, 16.6, 1.9]
    assert sum(model_state_bytes(100, 1, 0, amp=False).values()) == 1600


def test_korthikanti_table_2_closed_forms():
    s, b, h, a, t = 2048, 1, 12288, 96, 8                     # GPT-3 175B, 8-way TP
    sbh, x = s * b * h, 5 * a * s / h
    assert layer_activation_bytes(s, b, h, a) == sbh * (34 + x)
    assert layer_activation_bytes(s, b, h, a, t) == pytest.approx(sbh * (10 + 24 / t + x / t))
    assert layer_activation_bytes(s, b, h, a, t, sp=True) == pytest.approx(sbh / t * (34 + x))
    assert layer_activation_bytes(s, b, h, a, t, True, "selective") == pytest.approx(
        sbh * 34 / t)
    assert layer_activation_bytes(s, b, h, a, t, recompute="full") == 2 * sbh
    assert layer_activation_bytes(s, b, h, a, e=4, dropout=False) == sbh * 64 + a * s * s * 4


def test_tp_and_pp_split_the_parameters():
    n = GPT(CFG).num_parameters()
    assert stage_params(CFG) == [n]
    C, L, V = CFG.n_embd, CFG.n_layer, CFG.vocab_size
    split = L * (3 * C * C + 3 * C + C * C + 4 * C * C + 4 * C + 4 * C * C) + V * C
    assert stage_params(CFG, tp=2) == [n - split // 2]
    stages = stage_params(CFG, pp=2)
    assert sum(stages) == n + V * C                           # the last stage's wte copy


@pytest.mark.parametrize("config", [
    CFG, replace(CFG, n_layer=5, bias=False),
    replace(CFG, n_layer=6, moe_experts=4, moe_top_k=2, moe_every=2),
    replace(CFG, n_layer=3, moe_experts=8, moe_every=1, vocab_size=250),
    replace(CFG, n_layer=4, moe_experts=4, moe_every=2, moe_shared=2)])
def test_counts_per_kind_of_block_equal_a_walk_over_every_parameter(config):
    """stage_params and the experts' tensors per stage count one block of each kind (dense,
    MoE) and multiply, so the search does not walk every name of a 34-block, 8-expert model
    per layout (plan.py --moe-experts 8 took 74-124 s): the same numbers as walking every
    parameter of the model, for tp, pp and ep."""
    from minidist.nn.config import gpt_param_specs
    from minidist.train.moe_cost import expert_tensors, expert_units
    from minidist.train.planner import local_size
    specs, L = gpt_param_specs(config), config.n_layer
    for tp, pp, ep in [(1, 1, 1), (2, 1, 1), (1, 2, 1), (2, 3, 2), (1, 2, 4)]:
        if pp > L or (ep > 1 and (not config.moe_experts or config.moe_experts % ep)):
            continue
        want = [0] * pp
        experts = [[] for _ in range(pp)]
        for name, (shape, _) in specs.items():
            parts = name.split(".")
            stage = int(parts[2]) * pp // L if name.startswith("transformer.h.") else \
                0 if parts[1] in ("wte", "wpe") else pp - 1
            if ".mlp.experts." in name:
                want[stage] += math.prod(shape) // ep
                if int(parts[5]) < config.moe_experts // ep:
                    experts[stage].append((int(parts[2]), math.prod(shape)))
            else:
                want[stage] += local_size(name, shape, tp)
        if pp > 1:
            want[-1] += local_size("transformer.wte.weight", specs["transformer.wte.weight"][0],
                                   tp)
        assert stage_params(config, tp, pp, ep) == want, (tp, pp, ep)
        layout = Layout(tp=tp, pp=pp, ep=ep)
        for stage in range(pp):
            sizes = [n for _, n in experts[stage]]
            assert expert_tensors(config, layout, stage) == (sizes if ep > 1 else [])
            blocks = sorted({b for b, _ in experts[stage]})
            units = [sum(n for b, n in experts[stage] if b == block) for block in blocks]
            assert expert_units(config, layout, stage) == (units if ep > 1 else [])


def test_decision_order():
    r = plan(config_for_params(7e9, 4096), gpus=8, gpu_mem_gib=80, seq=4096)
    assert r["recommendation"] == "ZeRO-1 (amp, selective recompute)"
    names = [row["layout"] for row in r["rows"]]
    assert names[:7] == ["DDP (fp32)", "DDP (amp)", "DDP (amp, selective recompute)",
                         "DDP (amp, ckpt)", "ZeRO-1 (amp)", "ZeRO-1 (amp, selective recompute)",
                         "ZeRO-1 (amp, ckpt)"]
    # Korthikanti's 5as/h of 34 + 5as/h per sbh gone: 51.83 -> 17.83 GiB at s 4096, a 32
    act = {row["layout"]: row["activations"] for row in r["rows"]}
    assert act["ZeRO-1 (amp)"] / act["ZeRO-1 (amp, selective recompute)"] == pytest.approx(
        51.83 / 17.83, rel=1e-3)
    small = GPTConfig(n_layer=12, n_head=12, n_embd=768, block_size=1024)   # GPT-2 124M
    assert plan(small, gpus=1, gpu_mem_gib=80)["recommendation"] == "DDP (fp32)"
    assert [plan(small, gpus=1, gpu_mem_gib=12, micro_batch=b)["recommendation"]
            for b in (4, 8, 16, 64)] == ["DDP (fp32)", "DDP (amp)",
                                         "DDP (amp, selective recompute)", None]
    assert plan(config_for_params(70e9, 4096), gpus=8, gpu_mem_gib=80,
                seq=4096)["recommendation"] is None


@pytest.mark.parametrize("n", [7e9, 70e9, 175e9])
def test_assumed_shape_has_about_n_parameters(n):
    c = config_for_params(n)
    assert abs(sum(stage_params(c)) / n - 1) < 0.05 and c.n_embd % 1024 == 0


def test_cli_json():
    out = subprocess.run([sys.executable, "examples/plan_memory.py", "--params", "7e9",
                          "--gpus", "8", "--gpu-mem", "80", "--seq", "4096", "--json"],
                         capture_output=True, text=True, timeout=60, check=True)
    result = json.loads(out.stdout)
    assert result["recommendation"] == "ZeRO-1 (amp, selective recompute)"
    assert {"params", "grads", "optimizer", "activations", "total", "fits"} <= set(
        result["rows"][0])
    bad = subprocess.run([sys.executable, "examples/plan_memory.py", "--params", "1e9",
                          "--moe-experts", "8", "--moe-top-k", "9"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.startswith("error: model flags: moe_top_k")
    assert len(bad.stderr.strip().splitlines()) == 1


# (planner, flags, the one error line); each was a traceback, or a plan of nothing
PLANNER_BAD = [
    ("plan_memory", ["--params", "7e9", "--gpus", "0"], "--gpus 0: must be a positive number"),
    ("plan_memory", ["--params", "-5"], "--params -5.0: must be a positive number"),
    ("plan_memory", ["--params", "7e9", "--gpu-mem", "-1"], "--gpu-mem -1.0: must be a positive"),
    ("plan_memory", ["--params", "7e9", "--headroom", "1"], "--headroom 1.0: the fraction"),
    ("plan", ["--params", "7e9", "--gpus", "8", "--efficiency", "0"], "--efficiency 0.0: must"),
    ("plan", ["--params", "7e9", "--schedule", "interleaved", "--chunks", "0"],
     "--chunks/--pp-virtual 0:"),
    # train_gpt.py's names of three flags: the error named the other one
    ("plan", ["--params", "7e9", "--schedule", "interleaved", "--pp-virtual", "0"],
     "--chunks/--pp-virtual 0: must be a positive number"),
    ("plan", ["--params", "7e9", "--batch-size", "0"],
     "--global-batch/--batch-size 0: must be a positive number"),
    ("plan", ["--params", "nan"], "--params nan: must be a positive number"),
    ("plan", ["--params", "7e9", "--seq", "0"], "--seq/--block-size 0: must be a positive"),
    ("plan", ["--params", "7e9", "--seq", "7"], "--seq 7: must be even"),
    # found by a first-use walk: the shape was dropped silently, a bad number was a usage block
    ("plan", ["--params", "7e9", "--n-layer", "6"], "--n-layer 6: --params 7e+09 assumes its "
     "own shape; give --params or the shape, not both"),
    ("plan_memory", ["--params", "7e9", "--n-embd", "512", "--n-head", "8"], "--n-head 8 "
     "--n-embd 512: --params 7e+09 assumes"),
    ("plan", ["--params", "abc"], "argument --params: invalid float value: 'abc' (plan.py "
     "--help lists the flags)"),
    # a part of a node was planned as if it were full (8 + 4 priced as 8 + 8)
    ("plan", ["--params", "7e9", "--gpus", "12"], "--gpus 12 --gpus-per-node 8: 12 GPUs fill 1 "
     "node of 8 and part of another, which the step-time model cannot price (it takes every "
     "node as full); give --gpus 8 or 16, or --gpus-per-node 6 (2 full nodes)"),
    ("plan", ["--params", "7e9", "--gpus", "13", "--gpus-per-node", "8"], "--gpus 13 "
     "--gpus-per-node 8: 13 GPUs fill 1 node of 8 and part of another, which the step-time "
     "model cannot price (it takes every node as full); give --gpus 8 or 16\n"),
    ("plan_memory", ["--params", "7e9", "--gpus-per-node", "0"], "--gpus-per-node 0: must be "
     "a positive number"),
    # first-use walk 18: an efficiency of 2 priced MFU 1.86; --moe-* without --moe-experts
    # planned a dense model silently (training refuses them)
    ("plan", ["--params", "7e9", "--gpus", "64", "--efficiency", "2"], "--efficiency 2.0: the "
     "fraction of peak the compute reaches, at most 1 (0.45 for 45%)"),
    ("plan", ["--params", "7e9", "--moe-top-k", "2"], "--moe-top-k 2: only used with "
     "--moe-experts (add --moe-experts E, 2 or more, or leave --moe-top-k out)"),
    ("plan_memory", ["--params", "7e9", "--moe-every", "2"], "--moe-every 2: only used with "
     "--moe-experts"),
    # --measure runs train_gpt.py's default model: --n-layer 2 was measured as 4 layers
    ("plan_memory", ["--measure", "--n-layer", "2"], "--n-layer 2: --measure trains "
     "train_gpt.py's default model (only --arch, --n-kv-head, --optimizer and --data change "
     "what it runs); leave --n-layer out, or drop --measure to plan with it"),
    # Muon's iterations without Muon would price nothing (training refuses them too)
    ("plan", ["--params", "7e9", "--muon-ns-steps", "3"], "--muon-ns-steps 3: sets Muon's "
     "Newton-Schulz iterations, which this plan does not price (add --optimizer muon, or "
     "leave --muon-ns-steps out)"),
    ("plan", ["--params", "7e9", "--optimizer", "muon", "--muon-ns-steps", "0"],
     "--muon-ns-steps 0: must be a positive number"),
    ("plan_memory", ["--params", "7e9", "--data", "x.txt"], "--data x.txt: only read by "
     "--measure"),
]


@pytest.mark.parametrize("script", ["plan", "plan_memory"])
def test_a_planner_piped_into_head_ends_quietly(script):
    """    python examples/plan.py --params 7e9 --gpus 64 | head -1
    was a BrokenPipeError traceback once head had its line; now no traceback (status 141,
    as a shell tool killed by SIGPIPE, where the table did not fit the pipe's buffer)."""
    more = " --top 200" if script == "plan" else ""                # a table past 64 KiB
    out = subprocess.run(f"{sys.executable} examples/{script}.py --params 7e9 --gpus 64{more}"
                         " | head -c 10", shell=True, capture_output=True, text=True,
                         timeout=120)
    assert out.stdout == "model: 7.0" and out.stderr == "", out.stderr


def test_the_printed_command_carries_what_the_plan_was_priced_with():
    """The capacity factor and the losses' weights of a MoE plan, and --comm hier, were
    priced (or trained) but left out of the "run it" command (first-use walk 18)."""
    from minidist.train.search import train_flags
    config = GPTConfig(n_layer=2, n_head=4, n_embd=64, moe_experts=4, moe_top_k=2,
                       moe_capacity_factor=0.5, moe_z_loss_coef=0.001)
    row = {**asdict(Layout(dp=4, ep=2)), "micro_batches": 1, "micro_batch": 1,
           "schedule": "1f1b", "comm": "hier"}
    flags = train_flags(config, row)
    args = train_parser().parse_args(flags)
    assert (args.moe_capacity_factor, args.moe_z_loss_coef, args.comm) == (0.5, 0.001, "hier")
    assert "--moe-aux-loss-coef" not in flags                    # the default: left out


@pytest.mark.parametrize("script,flags,says", PLANNER_BAD,
                         ids=[f"{s} {' '.join(f)}" for s, f, _ in PLANNER_BAD])
def test_planner_bad_numbers_are_one_line(script, flags, says):
    """    python examples/plan_memory.py --params 7e9 --gpus 0"""
    out = subprocess.run([sys.executable, f"examples/{script}.py", *flags],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stdout == "" and "Traceback" not in out.stderr
    assert out.stderr.startswith("error: " + says) and out.stderr.count("\n") == 1, out.stderr


def test_planners_plan_part_of_one_node_and_suggest_whole_nodes(capsys):
    """    python examples/plan.py --gpus 36 --gpus-per-node 12
    suggested --gpus 32, which fills 2 nodes of 12 and part of a third (refused); now the
    whole-node counts that have a layout, 24 or 48. A job on part of one node (4 GPUs of
    8, or --gpus-per-node above --gpus) is planned: every group is inside that node."""
    says = _plan_error(["--gpus", "36", "--gpus-per-node", "12"], capsys)
    assert says.endswith("try --gpus 24 or 48"), says
    for argv in (["--gpus", "4"], ["--gpus", "4", "--gpus-per-node", "16"]):
        _plan_cli().main(argv + ["--top", "1", "--json"])
        assert json.loads(capsys.readouterr().out)["best"]


# ---- the step-time model (minidist/train/cost.py): small cases worked by hand ----------------

from minidist.train.comm_cost import (Link, collective_time, hier_all_reduce_time,  # noqa: E402
                                      ring_time, span)
from minidist.train.cluster import Cluster, Elementwise, hbm_elementwise  # noqa: E402
from minidist.train.cost import bubble_time, exposed, layer_flops, step_time  # noqa: E402

TOY = GPTConfig(n_layer=2, n_head=1, n_embd=4, block_size=2, vocab_size=8)
UNIT = Cluster("toy", gpus_per_node=8, mem_gib=1, peak_tflops=1e-12, efficiency=1.0,
               intra=Link(0.0, 1.0), inter=Link(0.0, 1.0), overlap=0.0)   # 1 FLOP/s, 1 B/s


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


def test_held_layers_are_the_simulated_schedules_peaks():
    """The planner's count of what a stage holds at its peak is the schedule functions' own
    (run on the simulator's clock, chunk by chunk): GPipe m, 1F1B min(m, p - s), ZB-H1
    min(m, p) (1F1B's whole and the rest waiting for their W, both at once), interleaved
    its warmup + 1 chunk-micro-batches, each with its blocks."""
    for p, m, L in [(2, 1, 4), (2, 8, 4), (3, 2, 7), (4, 8, 8), (3, 6, 6), (2, 4, 5)]:
        for name, v in (("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("1f1b", 2)):
            if v > 1 and (m % p or L < p * v):
                continue
            for stage, sim in enumerate(simulate(name, p, m, v)):
                peak = sim.peak_in_flight
                held, head = held_layers(L, p, stage, name, m, v)
                if name == "zb-h1":         # 1F1B's whole ones, and those waiting for W
                    whole = min(m, p - stage)
                    waiting = waiting_for_weights(name, p, stage, m)
                    assert (whole, waiting) in sim.held and whole + waiting == peak
                    # the most bytes, as a whole one holds more than a waiting one
                    assert all(a <= whole and a + w <= peak for a, w in sim.held), sim.held
                    peak = whole
                chunks = chunk_layers(L, p, v, stage)
                assert set(held) == {i for c in chunks for i in c}, (name, v, p, stage)
                if v == 1:
                    assert set(held.values()) == {peak}
                else:                       # at the peak, its blocks once per chunk held
                    assert sum(held.values()) <= peak * max(map(len, chunks))
                    assert sum(held.values()) >= peak * min(map(len, chunks))
                assert head == (0 if stage < p - 1 else 1 if v > 1 else peak)


@pytest.mark.mpi
@pytest.mark.parametrize("schedule, micro, virtual", [("gpipe", 4, 1), ("1f1b", 4, 2),
                                                      ("1f1b", 1, 1), ("zb-h1", 8, 1)])
def test_planner_prices_each_schedules_peak(schedule, micro, virtual, corpus, tmp_path,
                                            mpi):
    """mpiexec -n 2 python examples/train_gpt.py --pp 2 --micro-batches 4 --schedule gpipe
    --log-json L: the activations each stage held (the pipeline's summary line) are the
    planner's for that stage and schedule, to 10% (Korthikanti's count, a little under
    minidist's graph), and the busiest stage's the bill's: GPipe holds every micro-batch,
    1F1B with fewer micro-batches than stages one, not p (first-use walk 32: GPipe was
    priced as 1F1B, 4x under); ZB-H1's last stage 1F1B's one and one waiting for its W
    (priced whole until 2026-11-30: 9% over)."""
    out = mpi(2, "examples/train_gpt.py", *FLAGS, "--data", corpus, "--cache-dir",
              str(tmp_path / "cache"), "--log-json", str(tmp_path / "log.jsonl"),
              "--attention", "materialized", "--n-layer", "4", "--pp", "2",
              "--micro-batches", str(micro), "--schedule", schedule,
              "--pp-virtual", str(virtual), timeout=180).stdout
    held = re.search(r"activations held ([\d.]+) / ([\d.]+) MiB", out)
    measured = [float(held.group(1)) * 2 ** 20, float(held.group(2)) * 2 ** 20]
    cfg, layout = replace(CFG, n_layer=4), Layout(pp=2, amp=False)
    for stage in (0, 1):
        want = stage_activations(cfg, layout, stage, cfg.block_size, BATCH // micro, False,
                                 schedule, micro, virtual)
        assert want <= measured[stage] <= 1.1 * want, (stage, measured, want)
    want = bill(cfg, layout, cfg.block_size, BATCH // micro, schedule=schedule,
                micro_batches=micro, v=virtual)["activations"]
    assert want <= max(measured) <= 1.1 * want, (measured, want)


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


def test_tiled_attention_and_cp_in_the_memory_model():
    """Tiled (and cp's ring) attention keep 4 a s b bytes of log-sum-exp instead of the
    (s, s) scores; cp halves s."""
    s, b, h, a = 2048, 1, 1024, 8
    assert layer_activation_bytes(s, b, h, a, tiled=True) == s * b * h * 34 + 4 * a * s * b
    assert layer_activation_bytes(s, b, h, a, cp=2) == s / 2 * b * h * 34 + 4 * a * s / 2 * b
    big = config_for_params(7e9, 32768)
    flat = bill(big, Layout(dp=8), 32768)["activations"]
    tiled = bill(big, Layout(dp=8, tiled=True), 32768)["activations"]
    assert tiled < flat / 10


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
    assert best["step"] < 30 and _refused(config, best, 8) is None
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
    the blocking all-reduce beyond the two timed apart (BENCHMARKS: where TP4's step goes)."""
    out = mpi(2, "examples/bench_collectives.py", "--interleave", "--max-bytes", "64K",
              "--repeats", "1", timeout=120)
    row = json.loads(out.stdout.strip().splitlines()[-1])
    assert row["ranks"] == 2 and row["bytes"] == 64 * 1024
    assert min(row["compute"], row["all_reduce"], row["interleaved"]) > 0
    assert row["sync_s"] == pytest.approx(row["interleaved"] - row["compute"]
                                          - row["all_reduce"], abs=1e-12)
    assert isinstance(row["sync_median_s"], float) and row["compute_iters"] >= 1


# ---- Mixture of Experts and expert parallelism (minidist/train/moe_cost.py) ------------------

# block 1 is MoE: 2 experts, top-2, capacity ceil(0.5 x 2 x 2 / 2) = 1 token per expert and
# sequence, so a sequence of 2 tokens keeps min(k s, E cap) = min(4, 2) = 2 of its 4 rows
MOE_TOY = replace(TOY, moe_experts=2, moe_top_k=2, moe_capacity_factor=0.5, moe_every=2)


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
    all-reduced (12 s): 14 s forward, 2 calls; backward the gradients all-reduced over tp:
    the router's 8 values (32 s) and both experts' 148 (c_fc 64 + 16, c_proj 64 + 4: 592 s
    each): 1216 s, 9 calls. CP2 (s = 1 token a rank): the ring (forward 1 hop, backward 3,
    of K and V: 2 x 16 B: 32 s each, in both blocks: 256 s) + the ids over cp (k 2 x 2
    tokens = 4 B: 2 s) and the sums (12 s): 270 s of the step's tp_cp."""
    from minidist.train.moe_cost import split_times
    sp = Layout(tp=2, sp=True, amp=False)
    assert split_times(MOE_TOY, UNIT, sp, b=1, s=2, e=4, stage=0) == (14, 1216, 2, 9)
    assert split_times(MOE_TOY, UNIT, Layout(tp=2, amp=False), 1, 2, 4, 0) == (0, 0, 0, 0)
    assert step_time(MOE_TOY, sp, UNIT, seq=2, global_batch=1)["compute"] == pytest.approx(2736)
    cp = step_time(MOE_TOY, Layout(cp=2, amp=False), UNIT, seq=2, global_batch=1)
    assert cp["tp_cp"] == pytest.approx(256 + 14)


def test_ep2_dp2_communication_worked_by_hand():
    """MOE_TOY on dp 4 = ep 2 x edp 2, b = 1 per rank, 1 B/s, sync 10 s, 1 s per parameter.
    All-to-alls: 2 kept rows x h 4 x 4 B = 32 B, over 2 ranks 1 step of 16 B: 16 s; the
    counts 8 E = 16 B: 8 s; forward counts + dispatch + combine = 40, backward 32: 72 s, 5
    syncs: 50 s. Parameters: dense 244 (block 0) + 104 (block 1's attention, norms, router)
    + 48 (wte, wpe, ln_f) = 396, all-reduced over the 4 ranks: 2 x 3/4 x 396 x 4 B = 2376 s;
    each expert 148 (c_fc 64 + 16, c_proj 64 + 4), this rank's one all-reduced tensor by
    tensor over its 2 replicas (n B each): 592 s, + clipping's 8 B over ep: 600 s.
    Optimizer: 396 + 148 = 544 s. ZeRO-1: the experts' one unit (148) over edp 2, a
    reduce-scatter of 1/2 x 592 B and an all-gather as much: 592 s (no clipping sum of its
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
    import importlib.util
    spec = importlib.util.spec_from_file_location("plan_cli", "examples/plan.py")
    plan_cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plan_cli)
    ours, train = vars(plan_cli.parse([])), vars(train_parser().parse_args([]))
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


# models the proposal tests plan for: T 20 (sequence parallelism over 8 does not split it,
# nor over cp 2 x tp 4), a 1e9 shape at T 2048, a Mixture of Experts (with SP and cp too)
PROPOSAL_MODELS = [
    GPTConfig(n_layer=4, n_head=8, n_embd=256, block_size=20, vocab_size=50257),
    config_for_params(1e9, seq=2048),
    GPTConfig(n_layer=4, n_head=8, n_embd=256, block_size=64, vocab_size=256, moe_experts=4,
              moe_top_k=2)]


def _refused(config, row, gpus, v=1):
    """train_gpt's refusal of a planner's row (its error line), or None if it runs."""
    from minidist.train.cli import UsageError
    from minidist.train.search import train_flags
    from minidist.train.strategy import check_layout
    try:
        check_layout(train_parser().parse_args(train_flags(config, row, v)), gpus)
    except UsageError as e:
        return f"{row['layout']}: {e}"
    return None


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved", "gpipe", "zb-h1"])
def test_every_layout_the_search_proposes_is_one_training_accepts(schedule):
    """Each row of the layout search (examples/plan.py), as train_gpt's flags (train_flags),
    passes train_gpt's checks (check_layout: every refusal, before any communication), for
    a few model sizes and sequence lengths on 8 GPUs; cp with tp proposes sequence
    parallelism, which training runs (minidist/cp/README.md)."""
    from minidist.train.cluster import H100_IB
    from minidist.train.search import search
    v = 2 if schedule == "interleaved" else 1
    seen, refused = set(), []
    for config in PROPOSAL_MODELS:
        for row in search(config, H100_IB, 8, config.block_size, 32, schedule, v=v):
            refused.append(_refused(config, row, 8, v))
            seen.add((row["cp"] > 1, row["sp"]))
            if config.moe_experts:
                seen.add(("moe", row["cp"] > 1, row["sp"], row["ep"] > 1))
    assert not any(refused), [r for r in refused if r][:5]
    assert (True, True) in seen                       # cp x tp x sp among the proposals
    assert ("moe", True, True, True) in seen          # MoE: ep x cp x tp x sp too


def test_every_layout_the_memory_planner_proposes_is_one_training_accepts():
    """The same for examples/plan_memory.py's candidates (planner.plan), one micro-batch
    per stage: sequence parallelism only where the sequence splits over tp (with experts
    too)."""
    refused, sp = [], set()
    for config in PROPOSAL_MODELS:
        for gpus in (8, 16):
            for row in plan(config, gpus)["rows"]:
                row = {**row, "micro_batch": 1, "micro_batches": row["pp"],
                       "schedule": "1f1b"}
                refused.append(_refused(config, row, gpus))
                sp.add(row["sp"])
    assert not any(refused), [r for r in refused if r][:5]
    assert sp == {True, False}


def test_plan_memory_table_keeps_large_values_apart():
    """python examples/plan_memory.py --params 1e12 --gpus 8: the header says 1T (not
    1e+03B) and every row still reads as a layout, five numbers and yes/no."""
    out = subprocess.run([sys.executable, "examples/plan_memory.py", "--params", "1e12",
                          "--gpus", "8"], capture_output=True, text=True, timeout=60,
                         check=True).stdout.splitlines()
    assert out[0].startswith("model: 1T parameters (")
    assert out[1].split()[-6:] == ["params", "grads", "optim", "activ", "total", "fits"]
    rows = out[2:-1]
    assert rows and out[-1].startswith("recommendation:")
    assert float(rows[0].split()[-2]) > 1e4           # a total that once ran into its neighbour
    for line in rows:
        *numbers, fits = line[48:].split()
        assert len(numbers) == 5 and all(float(n) >= 0 for n in numbers), line
        assert fits in ("yes", "no"), line


# ---- plan.py's input: a hand layout, a size it cannot plan, a GPU count with no layout -------

def _plan_cli():
    """examples/plan.py as a module (its main(argv) runs in this process)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("plan_cli", "examples/plan.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _plan_error(argv, capsys):
    """plan.py's error line for argv (after checking it is one line, exit 2, no output)."""
    with pytest.raises(SystemExit) as e:
        _plan_cli().main(argv)
    out = capsys.readouterr()
    assert e.value.code == 2 and out.out == "" and out.err.count("\n") == 1, out
    return out.err.strip()


# (plan.py flags, the start of its error line): a run train_gpt refuses (most were priced,
# with a `run it:` command that failed), a key unknown, repeated or not a whole number (a
# traceback for micro=abc and micro=0)
LAYOUT_BAD = [
    (["--gpus", "8", "--layout", "dp=8,tp=1,pp=1,cp=1,zero=5"], "--layout: zero=5: the ZeRO"),
    (["--gpus", "6", "--layout", "dp=2,tp=3,pp=1"], "--layout: tp=3: --n-head 4 is not"),
    (["--gpus", "8", "--layout", "dp=1,pp=8"], "--layout: pp=8: --pp 8 stages for --n-layer 4"),
    (["--layout", "dp=8,micro=abc"], "--layout: micro=abc: micro takes a whole number"),
    (["--gpus", "8", "--layout", "dp=8,micro=0"], "--layout: micro=0: must be at least 1"),
    (["--gpus", "8", "--layout", "dp=-8"], "--layout: dp=-8: dp takes a whole number"),
    (["--gpus", "8", "--layout", "dp=8,speed=2"], "--layout: cannot read 'speed=2'"),
    (["--gpus", "8", "--layout", "dp=4,dp=8"], "--layout: dp is given twice"),
    (["--gpus", "8", "--seq", "12", "--layout", "dp=2,cp=4"], "--layout: cp=4: --block-size 12"),
    (["--gpus", "8", "--layout", "dp=8,ep=2"], "--layout: ep=2: ep > 1 needs a Mixture"),
    (["--gpus", "4", "--global-batch", "12", "--schedule", "interleaved", "--layout",
      "dp=2,pp=2,micro=3"], "--layout: pp=2: --pp-virtual 2: --micro-batches 3 must be"),
    (["--gpus", "8", "--layout", "dp=8,micro=3"], "--layout: dp=8 x micro=3 = 24 micro-batch"),
    (["--gpus", "16", "--layout", "dp=16,shard=8"], "--layout: shard=8: hybrid sharding needs "
     "zero=1, 2 or 3"),
    (["--gpus", "16", "--layout", "dp=16,zero=3,shard=3"], "--layout: shard=3: --zero-shard 3: "
     "the ranks each replica is sharded over must divide dp 16"),
    (["--gpus", "16", "--layout", "dp=8,tp=2,zero=1,shard=3"], "--layout: shard=3: "
     "--zero-shard 3: the ranks each replica is sharded over must divide dp 8"),
    # audit 18: both recomputes, the last silently winning; selective under the ring's tiles
    (["--gpus", "8", "--attention", "materialized", "--layout", "dp=8,ckpt,selective"],
     "--layout: ckpt and selective: give one recompute"),
    (["--gpus", "8", "--attention", "materialized", "--layout", "dp=4,cp=2,selective"],
     "--layout: selective: the ring keeps no scores to recompute"),
    (["--gpus", "8", "--layout", "dp=8,selective"], "--layout: selective: tiled attention "
     "keeps no scores to recompute"),
]


@pytest.mark.parametrize("argv,says", LAYOUT_BAD, ids=[" ".join(a) for a, _ in LAYOUT_BAD])
def test_plan_layout_refuses_what_training_refuses(argv, says, capsys):
    """    python examples/plan.py --gpus 6 --layout dp=2,tp=3,pp=1
    One error line naming the key, exit 2: the layouts train_gpt.py refuses (its own checks,
    search.layout_problems), keys that are unknown, repeated or not whole numbers."""
    assert _plan_error(argv, capsys).startswith("error: " + says)


def test_every_layout_the_search_proposes_passes_the_layout_check():
    """The search (on 8 and 6 GPUs, 1F1B and interleaved, a MoE model too) proposes only
    layouts that plan.py --layout takes: layout_problems is [] for each of its rows; and a
    micro-batch count without a pipeline is train_gpt's --grad-accum, which it accepts."""
    from minidist.train.cluster import H100_IB
    from minidist.train.search import layout_problems, search, train_flags
    for config in PROPOSAL_MODELS:
        for gpus in (6, 8):
            for schedule, v in (("1f1b", 1), ("interleaved", 2)):
                for row in search(config, H100_IB, gpus, config.block_size, 48, schedule,
                                  v=v):
                    layout = Layout(**{k: row[k] for k in Layout.__dataclass_fields__})
                    assert layout_problems(config, layout, gpus, 48, row["micro_batches"],
                                           schedule, v) == [], row["layout"]
    config = PROPOSAL_MODELS[0]
    row = {**vars(Layout(dp=8)), "micro_batches": 2, "micro_batch": 2, "schedule": "1f1b"}
    flags = train_flags(config, row)
    assert flags[flags.index("--grad-accum") + 1] == "2" and "--micro-batches" not in flags
    assert _refused(config, row, 8) is None


def test_layout_names_are_unique_and_name_zero():
    """Every distinct layout of a search has its own name (ZeRO under dp 1 x cp 4 was
    dropped: three rows read "TP2+SP x CP4"), for a dense and a MoE model, and of the
    memory planner's candidates."""
    from minidist.train.cluster import H100_IB
    from minidist.train.search import search
    fields = list(Layout.__dataclass_fields__)
    for config, batch in ((GPTConfig(n_layer=4, n_head=4, n_embd=128, block_size=1024), 3),
                          (PROPOSAL_MODELS[2], 32)):
        for rows in (search(config, H100_IB, 8, config.block_size, batch),
                     plan(config, 8)["rows"], plan(config, 16)["rows"]):
            named = {}
            for row in rows:
                named.setdefault(row["layout"], set()).add(tuple(row[k] for k in fields))
            assert all(len(layouts) == 1 for layouts in named.values()), \
                {n: s for n, s in named.items() if len(s) > 1}
    cp4 = Layout(tp=2, cp=4, sp=True, zero=3, tiled=True)
    assert cp4.name() == "TP2+SP x CP4 x ZeRO-3 (amp, tiled)"
    assert Layout(tp=2, cp=4, sp=True, tiled=True).name() == "TP2+SP x CP4 (amp, tiled)"


def test_params_the_planner_cannot_build_is_one_line(capsys):
    """    python examples/plan.py --params 1e3
    planned a one-layer model of h 256 (14M parameters) without a word: refused, naming the
    smallest size it can plan; a size it can build prints its real count on the model line,
    within 2x of the request from half the smallest up (1.2e7 was h 512, 29M: now h 256)."""
    from minidist.train.plan_args import count_text
    least = sum(stage_params(config_for_params(1, 1024)))
    says = _plan_error(["--params", "1e3"], capsys)
    assert says.startswith("error: --params 1000: the smallest model") and \
        f"has {count_text(least)} parameters" in says
    asked = float(says.split("give --params ")[1].split()[0])
    assert least / 2 <= asked <= 2 * least                  # what it says to give is planned
    for n in [asked * 1.1 ** i for i in range(0, 240, 7)]:   # up to ~1e17
        got = sum(stage_params(config_for_params(n, 1024)))
        assert n / 2 <= got <= 2 * n, n
    _plan_cli().main(["--params", str(asked), "--gpus", "8", "--top", "1"])
    model = capsys.readouterr().out.splitlines()[0]
    got = sum(stage_params(config_for_params(asked, 1024)))
    assert model.startswith(f"model: {count_text(got)} parameters (L=")


def test_the_model_line_of_a_moe_plan_says_what_params_sized(capsys):
    """    python examples/plan.py --params 7e9 --moe-experts 8 --moe-top-k 2 --gpus 64
    printed "model: 39B parameters" with nothing saying that --params sizes the dense shape
    whose MLPs become the experts (found by a first-use walk); the line now gives both."""
    from minidist.train.plan_args import count_text
    _plan_cli().main(["--params", "1e8", "--moe-experts", "4", "--moe-every", "2",
                      "--gpus", "8", "--top", "1"])
    model = capsys.readouterr().out.splitlines()[0]
    dense = config_for_params(1e8, 1024)
    moe = sum(stage_params(replace(dense, moe_experts=4, moe_every=2)))
    assert model.startswith(f"model: {count_text(moe)} parameters: the "
                            f"{count_text(sum(stage_params(dense)))} dense shape (L="), model
    assert "what --params sizes) with the MLP of one block in 2 made 4 experts, top-1" in model


def test_no_valid_layout_is_told_apart_from_none_fitting(capsys):
    """    python examples/plan.py --gpus 7
    printed an empty table and "best: nothing fits" (exit 0) for a 7M-parameter model: no
    split of 7 GPUs divides the batch, the heads and the layers. Now one error line naming
    the nearest counts that have a layout (checked here: the search has rows for them and
    none between); --gpus 3 plans pp 3 (4 micro-batches and up divide 512), which training
    runs; where layouts exist but none fits, the line says the least memory one needs."""
    from minidist.train.cluster import H100_IB
    from minidist.train.planner import GiB
    from minidist.train.search import micro_batch_counts, search
    config = GPTConfig(n_layer=4, n_head=4, n_embd=128, block_size=1024, vocab_size=50257)
    says = _plan_error(["--gpus", "7"], capsys)
    assert says.startswith("error: --gpus 7: no layout of 7 GPUs divides --global-batch 512")
    lo, hi = (int(n) for n in says.split("try --gpus ")[1].split(" or "))
    for n in range(lo, hi + 1):
        assert bool(search(config, H100_IB, n, 1024, 512)) == (n in (lo, hi)), n
    assert micro_batch_counts(3, 512) == [4, 8, 16, 32]
    assert micro_batch_counts(3, 512, grouped=True) == []
    rows = search(config, H100_IB, 3, 1024, 512)
    assert rows and all(_refused(config, r, 3) is None for r in rows)
    _plan_cli().main(["--params", "13e9", "--gpus", "2", "--seq", "4096", "--top", "1000",
                      "--json"])          # (7e9 fits now: ZeRO-3 accumulating 256 micro-batches)
    result = json.loads(capsys.readouterr().out)
    least = min(r["mem"]["total"] for r in result["rows"]) / GiB
    assert result["best"] is None and not any(r["fits"] for r in result["rows"])
    budget = H100_IB.mem_gib * 0.9                              # --headroom 0.1
    assert f"needs {least:.1f} GiB per GPU, over the {budget:.1f} GiB" in result["nothing_fits"]
    # --preset here: ranks share the machine's memory, so more ranks are no remedy (audit 18)
    _plan_cli().main(["--preset", "here", "--params", "1e9", "--gpus", "4", "--global-batch",
                      "8", "--json"])
    says = json.loads(capsys.readouterr().out)["nothing_fits"]
    assert " GiB per rank, over the " in says and "add --gpus" not in says, says


# ---- context parallelism's attention: the ring or Ulysses' all-to-alls ------------------------

CP_MODEL = GPTConfig(n_layer=2, n_head=8, n_embd=16, block_size=16, vocab_size=32)


@pytest.mark.parametrize("attention", ["ring", "ulysses"])
def test_cp_bytes_the_model_prices_are_the_training_codes(attention):
    """At 1 B/s and no latency a second is a byte: what tp_cp_cost.cp_comm prices one rank sending
    per layer and micro-batch is minidist/cp/ring.py ring_bytes or minidist/cp/ulysses.py
    ulysses_bytes of S = b (s/N) (h/tp) e (the formulas tests/scripts/cp_check.py and
    ulysses_check.py measure training against), at N = 2 and 4, tp 1 and 2, with and
    without full recompute; and a whole step's tp_cp and syncs (Ulysses: 2 blocking
    all-to-alls each way per layer, 2 more under recompute) add up from them."""
    from minidist.cp.ring import ring_bytes
    from minidist.cp.ulysses import ulysses_bytes
    from minidist.train.tp_cp_cost import cp_comm
    formula = ulysses_bytes if attention == "ulysses" else ring_bytes
    b, s, h, e = 1, 16, 16, 4
    for n in (2, 4):
        for tp in (1, 2):
            for recompute in ("none", "full"):
                layout = Layout(cp=n, tp=tp, sp=tp > 1, amp=False, recompute=recompute,
                                cp_attention=attention)
                act = b * s // n * h * e
                S = act // tp
                assert S % n == 0                            # ulysses_bytes exact
                f, bwd = cp_comm(UNIT, layout, 1, act)
                assert f + bwd == pytest.approx(formula(S, n, recompute == "full")), layout
    unit = replace(UNIT, sync_s=10.0)
    for recompute in ("none", "full"):
        layout = Layout(cp=4, amp=False, recompute=recompute, cp_attention=attention)
        t = step_time(CP_MODEL, layout, unit, seq=s, global_batch=b)
        S = b * s // 4 * h * e
        assert t["tp_cp"] == pytest.approx(2 * formula(S, 4, recompute == "full"))
        if attention == "ulysses":
            assert t["sync"] == pytest.approx(2 * (2 + 2 + 2 * (recompute == "full")) * 10)


def test_ulysses_compute_is_the_rings():
    """The attention's FLOPs per rank are the same either way (all T queries of H/N heads,
    or T/N queries of all H): only the communication differs, where both attentions tile.
    Ulysses around a materialised attention keeps its scores, where the ring's backward
    computes each block's q k^T again whatever --attention says: 2 b (s/N) s h FLOPs per
    layer more, L 2 x 2 x 1 x 4 x 16 x 16 = 4096 here (UNIT: 1 FLOP a second)."""
    for tiled in (True, False):
        ring = step_time(CP_MODEL, Layout(cp=4, amp=False, tiled=tiled), UNIT, seq=16,
                         global_batch=1)
        ulysses = step_time(CP_MODEL, Layout(cp=4, amp=False, cp_attention="ulysses",
                                             tiled=tiled), UNIT, seq=16, global_batch=1)
        assert ring["compute"] - ulysses["compute"] == (0 if tiled else 4096)
        assert ulysses["tp_cp"] < ring["tp_cp"]


def test_ulysses_memory_term():
    """Ulysses holds its attention's output in the heads layout, (B, T, C/N), beside the
    tokens-layout copy c_proj keeps: sbh e / (N t) more per layer than the ring (none under
    full recompute); the bill of the default model (4 layers, C 128, B 16, T 256, float32)
    at cp 2 is 4 MiB = 4.2 MB more: what training's ledger measured (75.7 against 71.5 MB
    per rank, minidist/cp/README.md). Untiled, its a/N heads keep their (s, s) scores."""
    s, b, h, a = 2048, 2, 1024, 8
    for n, t, sp in ((2, 1, False), (4, 1, False), (2, 2, True), (4, 2, False)):
        ring = layer_activation_bytes(s, b, h, a, t, sp, tiled=True, cp=n)
        ulysses = layer_activation_bytes(s, b, h, a, t, sp, tiled=True, cp=n, ulysses=True)
        assert ulysses - ring == s / n * b * h * 2 / t
    assert layer_activation_bytes(s, b, h, a, cp=2, recompute="full", ulysses=True) == \
        layer_activation_bytes(s, b, h, a, cp=2, recompute="full")
    assert layer_activation_bytes(s, b, h, a, cp=2, ulysses=True, dropout=False) == \
        s / 2 * b * h * 2 * (4 + 12 + 1) + a / 2 * s * s * b * 2
    default = GPTConfig(n_layer=4, n_head=4, n_embd=128, block_size=256)
    ring = bill(default, Layout(cp=2, amp=False, tiled=True), 256, 16, dropout=False)
    ulysses = bill(default, Layout(cp=2, amp=False, tiled=True, cp_attention="ulysses"), 256,
                   16, dropout=False)
    assert ulysses["activations"] - ring["activations"] == 4 * 16 * 128 * 128 * 4
    assert (ulysses["activations"] - ring["activations"]) / 1e6 == pytest.approx(
        75.746 - 71.544, abs=0.01)


def test_search_proposes_ulysses_rows_that_training_accepts():
    """The search tries Ulysses beside the ring for every cp > 1 whose heads (n_head / tp)
    divide by cp, and never where they do not (8 heads: not tp 2 x cp 8; 2 heads: not cp 4
    or 8); each Ulysses row's train_flags say --cp-attention ulysses (the ring's say
    nothing: training's default), pass train_gpt's check_layout and plan.py's
    layout_problems."""
    from minidist.train.cluster import H100_IB
    from minidist.train.search import layout_problems, search, train_flags
    for config, gpus in ((GPTConfig(n_layer=4, n_head=8, n_embd=256, block_size=64), 16),
                         (GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=64), 8)):
        rows = search(config, H100_IB, gpus, config.block_size, 32)
        ulysses = [r for r in rows if r["cp_attention"] == "ulysses"]
        assert ulysses and all(r["cp"] > 1 for r in ulysses)
        tried = {(r["tp"], r["cp"]) for r in ulysses}
        assert tried == {(r["tp"], r["cp"]) for r in rows
                         if r["cp"] > 1 and config.n_head // r["tp"] % r["cp"] == 0}
        assert all(config.n_head // tp % cp == 0 for tp, cp in tried)
        assert any(config.n_head // r["tp"] % r["cp"] for r in rows)   # the ring's alone
        for row in rows:
            flags = train_flags(config, row)
            assert ("--cp-attention" in flags) == (row["cp_attention"] == "ulysses")
        for row in ulysses:
            assert train_flags(config, row)[-2:] == ["--cp-attention", "ulysses"]
            assert _refused(config, row, gpus) is None
            layout = Layout(**{k: row[k] for k in Layout.__dataclass_fields__})
            assert layout_problems(config, layout, gpus, 32, row["micro_batches"]) == []


def test_layout_problems_names_ulysses_heads_that_do_not_divide():
    """A hand layout with Ulysses where the heads do not divide is training's cp_problems
    refusal, named by its key (cpattn); Ulysses without cp is train_gpt's idle-flag
    refusal; an attention that is neither is the key's range."""
    from minidist.train.search import layout_problems
    config = GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=64)
    bad = Layout(dp=1, tp=2, cp=4, sp=True, cp_attention="ulysses")
    says = layout_problems(config, bad, 8, 8)
    assert len(says) == 1 and says[0].startswith("cpattn=ulysses: --cp-attention ulysses "
                                                 "gives each of the --cp 4 ranks whole heads")
    assert layout_problems(config, replace(bad, tp=1, dp=2, sp=False), 8, 8) == []
    alone = layout_problems(config, Layout(dp=8, cp_attention="ulysses"), 8, 8)
    assert len(alone) == 1 and "--cp-attention ulysses" in alone[0]
    assert layout_problems(config, Layout(dp=4, cp=2, cp_attention="star"), 8, 8) == [
        "cpattn=star: the CP attention is ring or ulysses"]


ULYSSES_BAD = [
    (["--gpus", "8", "--layout", "dp=2,cp=4,cpattn=star"], "--layout: cpattn=star: cpattn is "
     "ring or ulysses"),
    (["--gpus", "8", "--layout", "tp=2,cp=4,cpattn=ulysses"], "--layout: cpattn=ulysses: "
     "--cp-attention ulysses gives each of the --cp 4 ranks whole heads"),
    (["--gpus", "8", "--layout", "dp=8,cpattn=ulysses"], "--layout: examples/train_gpt.py "
     "refuses it: --cp-attention ulysses"),
    (["--gpus", "8", "--layout", "dp=2,cp=4,cpattn=ring,cpattn=ulysses"],
     "--layout: cpattn is given twice"),
]


@pytest.mark.parametrize("argv,says", ULYSSES_BAD, ids=[" ".join(a) for a, _ in ULYSSES_BAD])
def test_plan_layout_cpattn_refusals_are_one_line(argv, says, capsys):
    """    python examples/plan.py --gpus 8 --layout tp=2,cp=4,cpattn=ulysses
    (4 heads / tp 2 = 2 do not divide by cp 4): one error line naming the key, exit 2."""
    assert _plan_error(argv, capsys).startswith("error: " + says)


def test_plan_layout_takes_cpattn_and_names_are_unique(capsys):
    """    python examples/plan.py --gpus 8 --layout dp=2,cp=4,cpattn=ulysses --json
    prices Ulysses (more memory; at --seq 4096 on NVLink the ring's hops hide behind its
    blocks' attention, Ulysses' all-to-alls do not) and its command runs it; Layout.name
    tells the two apart where cp > 1 (CP4u) and says nothing with cp 1."""
    def one(layout):
        _plan_cli().main(["--gpus", "8", "--seq", "4096", "--json", "--layout", layout])
        return json.loads(capsys.readouterr().out)
    ring, ulysses = one("dp=2,cp=4"), one("dp=2,cp=4,cpattn=ulysses")
    assert ulysses["rows"][0]["cp_attention"] == "ulysses"
    assert ulysses["command"].endswith("--cp-attention ulysses")
    assert "--cp-attention" not in ring["command"]
    r, u = ring["rows"][0], ulysses["rows"][0]
    assert r["tp_cp"] < u["tp_cp"] and u["mem"]["activations"] > r["mem"]["activations"]
    assert (r["layout"], u["layout"]) == ("CP4 x DDP x2 (amp, tiled)",
                                          "CP4u x DDP x2 (amp, tiled)")
    assert Layout(tp=2, cp=4, sp=True, zero=3, cp_attention="ulysses").name() == \
        "TP2+SP x CP4u x ZeRO-3 (amp)"


def test_ring_hops_hide_behind_their_blocks_attention_worked_by_hand():
    """At 1 B/s, no latency, overlap 1: cp 2, S = 8 B (act 8, tp 1): a hop (K and V) is 16 s.
    Forward, the one hop behind block 0's 10 s: 6 s exposed; backward 3 hops (48 s) behind 2
    blocks of 20 s: 8 s, but never under the last hop: 16 s. Overlap 0: 16 and 48, the bytes
    (ring_bytes(8, 2) = 64). Ulysses' all-to-alls hide behind nothing: the same either way.
    And one ring block's seconds are 1/cp of the layer's attention FLOPs (ring_block_times)."""
    from minidist.train.tp_cp_cost import cp_comm, ring_block_times
    ring = Layout(cp=2, amp=False)
    on = replace(UNIT, overlap=1.0)
    assert cp_comm(on, ring, 1, 8, 10.0, 20.0) == (6.0, 16.0)
    assert cp_comm(on, ring, 1, 8, 10.0, 1.0) == (6.0, 46.0)       # 48 - 2 x 1
    assert cp_comm(UNIT, ring, 1, 8, 10.0, 20.0) == (16.0, 48.0)
    assert cp_comm(on, ring, 3, 8, 100.0, 100.0) == (0.0, 48.0)    # 3 layers: 3 last hops
    uly = Layout(cp=2, amp=False, cp_attention="ulysses")
    assert cp_comm(on, uly, 1, 8, 10.0, 20.0) == cp_comm(UNIT, uly, 1, 8)
    f, bwd = ring_block_times(TOY, Layout(cp=2, amp=False, tiled=True), b=1, seq=4, rate=1.0)
    assert f == 4 * 1 * 2 * 4 * TOY.n_embd / 2 and bwd == 2.5 * f


# ---- hybrid sharding (--zero-shard): ZeRO inside each node, replicas across -----------------

def test_hybrid_sharding_step_and_memory_worked_by_hand():
    """TOY (536 parameters, float32: 2144 B of gradients), dp 4 on 2 nodes of 2 ranks, the
    node's link 10 B/s, between nodes 1 B/s, no compute to hide behind (overlap 0).
    Plain ZeRO-1: its reduce-scatter and all-gather span both nodes, 3/4 x 2144 / 1 each:
    3216 s. ZeRO-1/2 (sharded over each node's 2): 1/2 x 2144 / 10 each in the node (214.4),
    then the 268-parameter shard's all-reduce between the 2 replicas, 2 x 1/2 x 1072 / 1 =
    1072: 1286.4 s, none of it hidden. Each rank then holds 1/2 of the optimizer state, not
    1/4. ZeRO-2/2 with overlap 1: the all-reduces start under backward (3584 s of it here),
    all but the last of L + 1 = 3 units hidden: 1072 / 3; ZeRO-1/2 the same (its
    reduce-scatter, one 1 MiB bucket's worth, is the last piece and stays in view)."""
    nodes = replace(UNIT, gpus_per_node=2, intra=Link(0.0, 10.0))
    plain = step_time(TOY, Layout(dp=4, zero=1, amp=False), nodes, seq=2, global_batch=4)
    hybrid1 = Layout(dp=4, zero=1, amp=False, zero_shard=2)
    hybrid = step_time(TOY, hybrid1, nodes, seq=2, global_batch=4)
    assert plain["dp_comm"] == pytest.approx(3216) == plain["dp_exposed"]
    assert hybrid["dp_comm"] == pytest.approx(1286.4) == hybrid["dp_exposed"]
    assert bill(TOY, hybrid1, 2)["optimizer"] == 8 * 268
    assert bill(TOY, Layout(dp=4, zero=1, amp=False), 2)["optimizer"] == 8 * 134
    assert hybrid1.name() == "ZeRO-1/2 (fp32)" and hybrid1.zero_ranks == 2
    stage2 = step_time(TOY, replace(hybrid1, zero=2), replace(nodes, overlap=1.0), seq=2,
                       global_batch=4)
    assert stage2["compute"] == pytest.approx(5376)          # backward: 3584 s of it
    assert stage2["dp_exposed"] == pytest.approx(107.2 + 1072 / 3)   # + the all-gather
    stage1 = step_time(TOY, hybrid1, replace(nodes, overlap=1.0), seq=2, global_batch=4)
    assert stage1["dp_exposed"] == pytest.approx(2 * 107.2 + 1072 / 3)   # + reduce-scatter
    # under cp ZeRO's group is dp x cp, cp ranks neighbours: dp 2 x cp 4 sharded over 4 on
    # nodes of 4 holds each shard group in a node (ranks 0-3), each replica group across
    cp = Layout(dp=2, cp=4, zero=3, zero_shard=4)
    assert span(cp, "shard", 4) == (4, 1) and span(cp, "replicas", 4) == (1, 2)


def test_overlapped_parameter_gather_worked_by_hand(capsys):
    """--overlap-param-gather (Layout.overlap_gather): TOY, dp 4 on 2 nodes of 2 (as above),
    ZeRO-1, overlap 1: the reduce-scatter (1608 s across the nodes, one 1 MiB bucket: none
    of it hidden) as before, the all-gather (1608 s) behind the next forward's 1792 s, all
    but one of L + 1 = 3 units: 536 s left in view; with overlap 0 nothing changes. plan.py
    --layout takes it as `ogather` (its command adds the flag) and refuses it at ZeRO-3."""
    nodes = replace(UNIT, gpus_per_node=2, intra=Link(0.0, 10.0), overlap=1.0)
    plain = Layout(dp=4, zero=1, amp=False)
    before = step_time(TOY, plain, nodes, seq=2, global_batch=4)
    after = step_time(TOY, replace(plain, overlap_gather=True), nodes, seq=2, global_batch=4)
    assert before["compute"] == pytest.approx(5376)            # forward 1792 s of it
    assert before["dp_comm"] == after["dp_comm"] == pytest.approx(3216)
    assert before["dp_exposed"] == pytest.approx(3216)
    assert after["dp_exposed"] == pytest.approx(1608 + 536)
    quiet = replace(nodes, overlap=0.0)
    assert step_time(TOY, replace(plain, overlap_gather=True), quiet, seq=2,
                     global_batch=4)["dp_exposed"] == pytest.approx(3216)
    assert replace(plain, overlap_gather=True).name() == "ZeRO-1 (fp32, gathers overlapped)"
    _plan_cli().main(["--gpus", "8", "--layout", "dp=8,zero=1,ogather", "--top", "1"])
    assert "--zero 1 --attention tiled --overlap-param-gather" in capsys.readouterr().out
    says = _plan_error(["--gpus", "8", "--layout", "dp=8,zero=3,ogather"], capsys)
    assert says.startswith("error: --layout: ogather: the overlapped parameter gather needs")


def test_search_proposes_hybrid_sharding_across_nodes_that_training_accepts():
    """On 16 GPUs (2 nodes of 8) the search also prices ZeRO-1/2/3 sharded over each node's
    share of its dp x cp ranks (8 / tp of them: the group's ranks are tp apart; not under tp
    8, where that is 1; with pp 2 a stage is one node, nothing to split), never on one node;
    each such row is a layout train_gpt.py runs (--zero-shard) and plan.py --layout takes."""
    from minidist.train.cluster import H100_IB
    from minidist.train.search import layout_problems, search, train_flags
    config = PROPOSAL_MODELS[1]
    rows = search(config, H100_IB, 16, config.block_size, 32)
    hybrid = [r for r in rows if r["zero_shard"]]
    assert {r["zero"] for r in hybrid} == {1, 2, 3}
    assert all(r["zero_shard"] * r["tp"] == 8 < r["dp"] * r["cp"] * r["tp"] for r in hybrid)
    assert {r["cp"] for r in hybrid} == {1, 2, 4, 8} and {r["tp"] for r in hybrid} == {1, 2, 4}
    assert {r["pp"] for r in hybrid} == {1} and all(r["ep"] == 1 for r in hybrid)
    for row in hybrid:
        assert _refused(config, row, 16) is None
        assert "--zero-shard" in train_flags(config, row)
        layout = Layout(**{k: row[k] for k in Layout.__dataclass_fields__})
        assert layout_problems(config, layout, 16, 32, row["micro_batches"]) == []
    assert not any(r["zero_shard"] for r in search(config, H100_IB, 8, config.block_size, 32))


def test_search_proposes_hybrid_sharding_beside_expert_parallelism():
    """A Mixture of Experts on 16 GPUs: hybrid sharding with ep 2 and 4 too (the dense shards
    over a node's 8 / tp ranks of dp x ep, the experts ZeRO-1 over their replicas as
    without it), each row a layout training accepts; its dense optimizer state is the
    node's share (1/8), the experts' the same as plain ZeRO's."""
    from minidist.train.cluster import H100_IB
    from minidist.train.search import search
    config = PROPOSAL_MODELS[2]
    rows = search(config, H100_IB, 16, config.block_size, 32, recomputes=("none",))
    hybrid = [r for r in rows if r["zero_shard"] and r["ep"] > 1]
    assert {r["ep"] for r in hybrid} == {2, 4} and {r["zero"] for r in hybrid} == {1, 2, 3}
    for row in hybrid:
        assert _refused(config, row, 16) is None
    from minidist.train.moe_cost import expert_units
    from minidist.train.planner import STATE_BYTES, stage_params
    plain = Layout(dp=16, ep=4, zero=1)
    states = {k: bill(config, replace(plain, zero_shard=k), 64)["optimizer"] for k in (0, 8)}
    dense = stage_params(config, 1, 1, 4)[0] - sum(expert_units(config, plain, 0))
    moments = STATE_BYTES[True][2]                   # --amp: masters, m, v per parameter
    assert states[8] - states[0] == pytest.approx(moments * dense * (1 / 8 - 1 / 16),
                                                  rel=1e-3)


def test_plan_layout_takes_shard(capsys):
    """    python examples/plan.py --gpus 16 --layout dp=16,zero=3,shard=8"""
    _plan_cli().main(["--gpus", "16", "--layout", "dp=16,zero=3,shard=8"])
    out = capsys.readouterr().out
    assert "ZeRO-3/8 (amp, tiled)" in out and "--zero 3" in out and "--zero-shard 8" in out


# ---- --optimizer muon: its state, its Newton-Schulz and its gathers, worked by hand -----------

def test_muon_state_bytes_worked_by_hand():
    """TOY's blocks hold 4 matrices each, c_attn 4 x 12 (48), c_proj 4 x 4 (16), c_fc 4 x 16
    (64) and c_proj 16 x 4 (64): 192, 384 of its 536 parameters. Muon keeps M alone for
    them: 4 B less each where the optimizer is per parameter. One process, float32: AdamW's
    8 x 536 = 4288 B, Muon's 4288 - 4 x 384 = 2752 (M 4 x 384 + m, v 8 x 152); --amp
    (masters 4, m 4, v 4): 12 x 536 - 4 x 384 = 4896. TP2: 300 parameters a rank (2 x 134
    in the blocks: the split matrices and c_attn's bias halved; wte's half 16, wpe 8, ln_f
    8), 192 of them Muon's halves: 8 x 300 - 4 x 192 = 1632. ZeRO-1 over 2: the flat v
    spans the matrices too, AdamW's 8 x 268 = 2144. MOE_TOY under ep 2 (no ZeRO): block 1
    keeps its attention (64), router 4 x 2 (8) and this rank's one expert (128) by Muon: 192
    + 200 = 392 of 544: 8 x 544 - 4 x 392 = 2784; with ZeRO-1 AdamW's again."""
    from minidist.train.planner import stage_muon_params
    assert stage_muon_params(TOY) == [384] and stage_muon_params(TOY, tp=2) == [192]
    assert stage_params(TOY, tp=2) == [300]
    expect = [(Layout(amp=False), 4288, 2752), (Layout(amp=True), 6432, 4896),
              (Layout(tp=2, amp=False), 2400, 1632),
              (Layout(dp=2, zero=1, amp=False), 2144, 2144)]
    for layout, adamw, muon in expect:
        assert bill(TOY, layout, 2)["optimizer"] == adamw
        assert bill(TOY, replace(layout, muon=True), 2)["optimizer"] == muon, layout
    assert stage_muon_params(MOE_TOY, ep=2) == [392]
    ep2 = Layout(dp=4, ep=2, amp=False, muon=True)
    assert bill(MOE_TOY, ep2, 2)["optimizer"] == 8 * 544 - 4 * 392 == 2784
    assert bill(MOE_TOY, replace(ep2, zero=1), 2)["optimizer"] == \
        bill(MOE_TOY, replace(ep2, zero=1, muon=False), 2)["optimizer"]
    assert replace(ep2, zero=1).name() == "EP2 x ZeRO-1 x4 (fp32)"    # the plan says Muon


def test_muon_step_worked_by_hand():
    """TOY at 1 FLOP/s and 1 B/s, sync 10 s. Newton-Schulz, 5 steps of 4 A^2 B + 2 A^3 on
    the wide orientation (A <= B): a 4 x 4 matrix 5 x (256 + 128) = 1920, so c_attn (4, 12),
    which packs q, k and v, 3 x 1920 = 5760 (as one 4 x 12 matrix it would be 5 x (768 +
    128) = 4480), c_proj 1920, c_fc and the MLP's c_proj (4, 16) 5 x (1024 + 128) = 5760
    each: 19200 a block, 38400 for both.
    One process (and DDP x2: every rank all of them): 38400 s more, nothing sent. At the
    float32 rate: with a 16-bit peak of 4 FLOP/s --amp's step computes 4 x faster, its NS
    (on the float32 masters) does not.
    TP2: each split matrix's NS on one tp rank (muon.tp_owners, the costliest first to the
    least busy, ties in block order): c_attn to the first, c_fc to the other, the MLP's
    c_proj to the first (a tie), c_proj to the other: 11520 s against 7680, each block
    waits for the 11520 (the second block turns the order: the other rank's 11520), 23040
    for both; each split matrix's update all-gathered first (4 B a value; over 2 ranks 1/2
    of it received): c_attn 192 B -> 96 s, c_proj 64 -> 32, c_fc and c_proj 256 -> 128
    each, + 10 s of sync each: 424 s a block, and the owners' steps reduce-scattered after
    (the same bytes and syncs) 424 s more: 848 s a block.
    ZeRO-1 over 2: each block's unit (244 values: ln_1 0-8, c_attn 8-56 and its bias 56-68,
    c_proj 68-84 and 84-88, ln_2 88-96, c_fc 96-160 and 160-176, c_proj 176-240 and its
    bias) is all-gathered (976 B, 488 s) and its steps reduce-scattered (488 s); each matrix
    is one rank's, the costliest first to the least busy (muon.balance; ties in unit order,
    ranks from the unit's `first`): c_attn to the first rank, c_fc to the other, the MLP's
    c_proj to the first (a tie), c_proj to the other: 11520 s against 7680; each unit waits
    for the 11520; both: 23040 s of NS and 1952 s of collectives.
    ZeRO-1 over dp 2 x TP2: the same dp owners, and each dp rank shares the split matrices
    it owns with its tp peer (ShardedMuon's tp_owners, as TP2's): the first dp rank's c_attn
    and MLP c_proj one per tp rank, 5760 s, each gathered and reduce-scattered over tp,
    2 x (96 + 10) + 2 x (128 + 10) = 488 s: 6248 s; the other's c_fc and c_proj, 5760 s (the
    busiest tp rank) + 2 x (128 + 10) + 2 x (32 + 10) = 360 s: 6120 s. Each unit waits for
    the first's (5760, 488) and gathers and reduce-scatters itself (134 values on a tp rank,
    536 B), 268 s each: (5760, 1024) a unit, (11520, 2048) for both (when each tp rank ran
    its dp rank's whole NS and gathered only: 23040 s of NS, 1560 s of collectives).
    PP2: a block a stage, 19200 s."""
    from minidist.optim.muon import ns_flops, packed_flops
    assert [ns_flops(s) for s in ((4, 12), (4, 4), (4, 16), (16, 4))] == \
        [4480, 1920, 5760, 5760]
    assert ns_flops((4, 16), steps=3) == 3 * 1152
    assert packed_flops((4, 12), (4, 4, 4)) == 5760 and packed_flops((4, 12)) == 4480
    unit = replace(UNIT, sync_s=10.0)

    def both(layout, global_batch=1, micro_batches=1, cluster=unit):
        muon = step_time(TOY, replace(layout, muon=True), cluster, 2, global_batch,
                         micro_batches)
        adamw = step_time(TOY, layout, cluster, 2, global_batch, micro_batches)
        assert muon["optimizer"] - adamw["optimizer"] == pytest.approx(muon["muon_ns"])
        assert muon["step"] - adamw["step"] == pytest.approx(muon["muon_ns"] +
                                                             muon["muon_comm"])
        return muon["muon_ns"], muon["muon_comm"]
    assert both(Layout(amp=False)) == (38400, 0)
    assert both(Layout(dp=2, amp=False), 2) == (38400, 0)
    fast16 = replace(unit, peak_tflops=4e-12, peak_tflops_fp32=1e-12)
    assert both(Layout(amp=True), cluster=fast16) == (38400, 0)
    assert both(Layout(tp=2, amp=False)) == (2 * 11520, pytest.approx(2 * 2 * 424))
    assert both(Layout(dp=2, zero=1, amp=False), 2) == (23040, 1952)
    assert both(Layout(dp=2, tp=2, zero=1, amp=False), 2) == \
        (2 * 5760, pytest.approx(2 * (488 + 2 * 268)))
    assert both(Layout(pp=2, amp=False), 2, 2) == (19200, 0)


def test_muon_with_experts_worked_by_hand():
    """MOE_TOY (block 1 a MoE block: router 4 x 2, NS 5 x (4 x 4 x 4 + 2 x 8) = 400; two
    experts, c_fc and c_proj 5760 each), 1 FLOP/s, 1 B/s. DDP x4: block 0 19200, block 1
    5760 + 1920 + 400 + 2 x 11520 = 31120. EP2: this rank's one expert, 19600. EP2 x ZeRO-1
    over 4 (each matrix one rank's, muon.balance): block 0's unit, its four matrices on four
    ranks: 5760, gathered and reduce-scattered 2 x 3/4 x 976 B = 1464 s; block 1's dense
    unit (attention, norms, router: 104 values) c_attn, c_proj, router on three ranks:
    5760, 2 x 3/4 x 416 = 624 s; its experts' unit (one expert, 148, over edp 2: c_fc and
    c_proj a rank each) 5760, 2 x 1/2 x 592 = 592 s."""
    def muon(layout):
        t = step_time(MOE_TOY, layout, UNIT, seq=2, global_batch=4)
        return t["muon_ns"], t["muon_comm"]
    assert muon(Layout(dp=4, amp=False, muon=True)) == (19200 + 31120, 0)
    assert muon(Layout(dp=4, ep=2, amp=False, muon=True)) == (19200 + 19600, 0)
    assert muon(Layout(dp=4, ep=2, zero=1, amp=False, muon=True)) == \
        (5760 + 5760 + 5760, 1464 + 624 + 592)


@pytest.mark.parametrize("config", [
    GPTConfig(n_layer=2, n_head=4, n_embd=32, block_size=16, vocab_size=64),
    GPTConfig(n_layer=2, n_head=4, n_embd=32, block_size=16, vocab_size=64, moe_experts=4,
              moe_top_k=2, moe_shared=1, moe_every=2),
    GPTConfig(n_layer=2, n_head=4, n_embd=32, block_size=16, vocab_size=64, arch="llama",
              n_kv_head=2, bias=False)], ids=["gpt2", "moe", "llama"])
def test_muon_ns_per_zero_rank_is_the_sharded_optimizers(config):
    """The ranks' NS work under ZeRO is ShardedMuon's: for a real model's block units
    (zero/flat.py gpt_units) over n ranks, each Muon matrix is one rank's (zero/muon.py
    unit_owners, which ShardedMuon runs by); the planner prices per unit the most any rank
    runs, after a gather of the unit's padded flat U and before a reduce-scatter of the
    steps (4 B a value each). The packed matrices (c_attn's q, k, v; SwiGLU's gate, up) are
    the model's (strategy/base.py matrix_views), the planner's from the config alone."""
    from minidist.optim.muon import packed_flops
    from minidist.strategy.base import matrix_views
    from minidist.train.muon_cost import muon_times
    from minidist.zero.flat import gpt_units
    from minidist.zero.muon import unit_owners
    model = GPT(config, seed=0)
    packed = matrix_views(model)["packed"]
    assert {n.split(".", 3)[3] for n in packed} == (
        {"attn.c_attn.weight", "mlp.c_fc.weight"} if config.llama else
        {"attn.c_attn.weight"})
    for n in (2, 3, 5):
        want_ns = want_bytes = 0
        for k, f in enumerate(gpt_units(model, n, 0)):
            owners = unit_owners(f, n, k, packed=packed)
            if not owners:
                continue                                    # the root: nothing gathered
            want_ns += max(sum(packed_flops(f.shapes[i], packed.get(f.names[i]))
                               for i, o in owners.items() if o == r) for r in range(n))
            want_bytes += 2 * 4 * f.padded
        layout = Layout(dp=n, zero=1, amp=False, muon=True)
        got = muon_times(config, layout, UNIT, 1.0, lambda op, nbytes: nbytes)
        assert got == [(want_ns, want_bytes)], n


def test_a_muon_plans_command_is_one_training_accepts(capsys):
    """    python examples/plan.py --gpus 8 --optimizer muon --muon-ns-steps 3
    prices Muon and its `run it:` command trains with it (--optimizer muon, --muon-ns-steps
    3: what was priced), a command train_gpt.py's checks accept (check_layout); so does
    every row of a Muon search (the default 5 iterations left out of the command), and a
    hand layout. plan_memory.py --optimizer muon: a row per candidate with Muon's state."""
    from minidist.train.cluster import H100_IB
    from minidist.train.search import search, train_flags
    from minidist.train.strategy import check_layout
    _plan_cli().main(["--gpus", "8", "--optimizer", "muon", "--muon-ns-steps", "3", "--json",
                      "--top", "1"])
    result = json.loads(capsys.readouterr().out)
    assert result["optimizer"] == "muon" and result["rows"][0]["muon_ns_steps"] == 3
    assert result["rows"][0]["muon"] and result["rows"][0]["muon_ns"] > 0
    run = result["command"].split()
    args = train_parser().parse_args(run[9:])                 # (after --device, --comm nccl)
    assert (args.optimizer, args.muon_ns_steps) == ("muon", 3)
    check_layout(args, 8)                                     # training accepts it
    _plan_cli().main(["--gpus", "8", "--optimizer", "muon", "--layout", "dp=4,tp=2,zero=1",
                      "--top", "1"])
    out = capsys.readouterr().out
    assert "Muon (5 Newton-Schulz steps)" in out and out.rstrip().endswith("--optimizer muon")
    for config in PROPOSAL_MODELS[::2]:
        rows = search(config, H100_IB, 8, config.block_size, 32, muon=True)
        assert all(r["muon"] for r in rows)
        assert not [r for r in rows if _refused(config, r, 8)]
        flags = train_flags(config, rows[0])
        assert flags[-2:] == ["--optimizer", "muon"] and "--muon-ns-steps" not in flags
    # plan_memory.py: the same candidates, Muon's state (the DDP rows 4 B less a matrix
    # parameter, ZeRO's the same), its rows' commands what training runs
    memory = {muon: plan(PROPOSAL_MODELS[1], 8, muon=muon) for muon in (False, True)}
    assert memory[True]["optimizer"] == "muon"
    for adamw, muon in zip(memory[False]["rows"], memory[True]["rows"]):
        assert muon["muon"] and muon["layout"] == adamw["layout"]
        assert (muon["optimizer"] < adamw["optimizer"]) == (not muon["zero"])
        row = {**muon, "micro_batch": 1, "micro_batches": muon["pp"], "schedule": "1f1b"}
        assert _refused(PROPOSAL_MODELS[1], row, 8) is None


def test_the_planners_optimizer_flags_are_training_s():
    """--optimizer's choices and default, and plan.py's --muon-ns-steps default, are
    train_gpt.py's; plan_memory.py --measure trains with --optimizer (it changes what it
    measures), where every other planning flag is refused."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("plan_memory", "examples/plan_memory.py")
    memory = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(memory)

    def choices(parser):
        return {a.dest: a.choices for a in parser._actions}["optimizer"]
    train = train_parser()
    assert tuple(choices(memory.parser())) == tuple(choices(train)) == ("adamw", "muon")
    plan_cli = _plan_cli()
    for name in ("optimizer", "muon_ns_steps"):
        assert getattr(plan_cli.parse([]), name) == train.get_default(name)
    assert memory.parser().get_default("optimizer") == train.get_default("optimizer")
    for choice in choices(train):
        assert plan_cli.parse(["--optimizer", choice]).optimizer == choice
    p = memory.parser()
    assert memory.measure_problem(p.parse_args(["--measure", "--optimizer", "muon"]), p) is None


# ---- --layout takes a name as the tables print it ----------------------------------------------

NAME_FIELDS = ("dp", "tp", "pp", "cp", "zero", "ep", "zero_shard", "recompute", "sp", "amp",
               "tiled", "overlap_gather")


@pytest.mark.parametrize("gpus,kw", [(64, {}), (16, {"moe_experts": 8, "moe_top_k": 2}),
                                     (16, {"tiled": False}), (8, {"amp": False})])
def test_every_name_the_search_prints_reads_back_as_its_layout(gpus, kw):
    """Layout.name's inverse, planner.layout_from_name: every row of a search (dense, MoE with
    ep, materialised attention with selective recompute, fp32; hybrid sharding and Ulysses
    where the GPUs span nodes) and overlapped gathers read back as the fields they name."""
    from minidist.train.cluster import H100_IB
    from minidist.train.planner import layout_from_name
    from minidist.train.search import search
    moe = {k: kw.pop(k) for k in ("moe_experts", "moe_top_k") if k in kw}
    config = GPTConfig(n_layer=4, n_head=8, n_embd=256, block_size=1024, vocab_size=50257,
                       **moe)
    rows = search(config, H100_IB, gpus, 1024, 64, **kw)
    names = {r["layout"]: r for r in rows}
    assert len(names) > 20 and any("/8" in n for n in names) == (gpus > 8), len(names)
    layouts = [Layout(**{k: r[k] for k in NAME_FIELDS}) for r in names.values()]
    layouts.append(replace(layouts[0], zero=1, overlap_gather=True))
    for layout in layouts:
        fields = layout_from_name(layout.name(), layout.gpus)
        assert not isinstance(fields, str), fields
        assert Layout(**fields) == replace(layout, cp_attention=fields.get(
            "cp_attention", layout.cp_attention)), layout.name()   # (named with cp > 1)


def test_plan_layout_takes_the_name_its_table_prints(capsys):
    """    python examples/plan.py --params 7e9 --gpus 16 --seq 4096 --layout "ZeRO-1/8 (amp,
        tiled)"
    was "cannot read 'ZeRO-1/8 (amp'": --layout took key=value items only. A name
    now prices the layout at every micro-batch count the search tries: its first row is the
    search's row of that name, the same command; amp and the attention must be the flags'."""
    base = ["--params", "7e9", "--gpus", "16", "--seq", "4096", "--json", "--top", "1000"]
    _plan_cli().main(base)
    searched = json.loads(capsys.readouterr().out)
    for row in searched["rows"][:3] + searched["rows"][-2:]:
        _plan_cli().main(base + ["--layout", row["layout"]])
        one = json.loads(capsys.readouterr().out)
        assert {r["layout"] for r in one["rows"]} == {row["layout"]}
        same = [r for r in searched["rows"] if r["layout"] == row["layout"]]
        assert one["rows"][0] == same[0] or not same[0]["fits"], row["layout"]
    assert searched["best"] and json.loads(
        (_plan_cli().main(base + ["--layout", searched["best"]]), capsys.readouterr().out)[1]
    )["command"] == searched["command"]
    gpus8 = ["--params", "7e9", "--gpus", "8", "--seq", "4096"]
    assert _plan_error(gpus8 + ["--layout", "ZeRO-1 (fp32, tiled)"], capsys) == (
        "error: --layout 'ZeRO-1 (fp32, tiled)': names a float32 layout: add --fp32")
    assert _plan_error(gpus8 + ["--layout", "ZeRO-1 (amp)"], capsys) == (
        "error: --layout 'ZeRO-1 (amp)': has no 'tiled': it names materialized attention, as "
        "plan_memory.py prices it; give --attention materialized, or write the name with "
        "'tiled'")
    # first-use walk 27: a name in other letters fell to the key=value reader ("cannot read
    # 'Zero-3/8 (amp'"); and key=value without micro= priced one micro-batch only, "nothing
    # fits" where the same layout by name fitted with 4
    for text in ("zero-1 (AMP, Tiled)", "dp=8,zero=1"):
        _plan_cli().main(gpus8 + ["--layout", text, "--json"])
        rows = json.loads(capsys.readouterr().out)["rows"]
        assert {r["layout"] for r in rows} == {"ZeRO-1 (amp, tiled)"}, text
        assert rows[0]["fits"] and rows[0]["micro_batches"] == 32, text
    assert _plan_error(gpus8 + ["--layout", "TP2+SP x ZeRO-1 x4 (amp, tiled"], capsys) == (
        "error: --layout: 'TP2+SP x ZeRO-1 x4 (amp, tiled': its parentheses are not closed")
    assert _plan_error(gpus8 + ["--layout", "TP2 x ZeRO-9 x4"], capsys).startswith(
        "error: --layout: cannot read 'ZeRO-9 x4' (a part such as TP2+SP")
    assert _plan_error(gpus8 + ["--layout", "ZeRO-1 (amp, tiled, fast)"], capsys).startswith(
        "error: --layout: cannot read 'fast' in the parentheses (amp, fp32, tiled")
    assert _plan_error(gpus8 + ["--layout", "TP2+SP x DDP x2 (amp, tiled)"], capsys) == (
        "error: --layout: dp x tp x pp x cp = 4, but --gpus is 8 (change the layout, or leave "
        "--layout out to search the ones train_gpt.py runs)")


def test_plan_takes_train_gpts_attention_recompute_and_pp_virtual(capsys):
    """    python examples/plan.py --params 1.3e9 --gpus 8 --seq 2048 --attention recompute
    train_gpt.py's --attention recompute (the (T, T) scores recomputed in backward) was
    "invalid choice" in plan.py, and its --pp-virtual was plan.py's --chunks. The search now
    prices only layouts that recompute, and every command it prints runs them so; a
    key=value layout recomputes the scores (selective) unless it says ckpt; a name that
    keeps the scores is refused; --pp-virtual is --chunks."""
    base = ["--params", "1.3e9", "--gpus", "8", "--seq", "2048", "--json", "--top", "1000"]
    _plan_cli().main(base + ["--attention", "recompute"])
    result = json.loads(capsys.readouterr().out)
    assert {r["recompute"] for r in result["rows"]} == {"selective", "full"}
    assert "--attention recompute" in result["command"] or "--ckpt-activations" in \
        result["command"]
    for text, recompute in (("dp=8,zero=1", "selective"), ("dp=8,ckpt", "full")):
        _plan_cli().main(base + ["--attention", "recompute", "--layout", text])
        assert {r["recompute"] for r in json.loads(capsys.readouterr().out)["rows"]} == {
            recompute}, text
    assert _plan_error(base + ["--attention", "recompute", "--layout", "DDP (amp)"],
                       capsys) == ("error: --layout 'DDP (amp)': names attention that keeps "
                                   "its scores; give --attention materialized, or write the "
                                   "name with 'selective recompute'")
    runs = []
    for flag, v in (("--chunks", "4"), ("--pp-virtual", "4"), ("--pp-virtual", "2")):
        _plan_cli().main(["--params", "7e9", "--gpus", "16", "--seq", "4096", "--json",
                          "--top", "1000", "--schedule", "interleaved", flag, v])
        runs.append(json.loads(capsys.readouterr().out))
    assert runs[0] == runs[1] and runs[1]["rows"] != runs[2]["rows"]   # the flag is read


def test_here_says_when_it_was_measured_and_a_busier_machine_now():
    """First-use walk 26: --preset here planned 0.075 s a step for a run that measured 0.56 s
    under a load of 4-7 from other jobs; the calibration was taken at load 0.02 and the plan
    did not say so. The cluster's name now gives the calibration's date and load, and the
    table a note where the load now is over half the cores above it."""
    from minidist.train.cluster import cluster_from_calibration
    plan = _plan_cli()
    cal = json.load(open(plan.HERE))
    name = cluster_from_calibration(plan.HERE, 4).name
    assert name == f"here (measured {cal['date']} at load {cal['load_before']:.2f})"
    quiet = cal["load_before"] + cal["cores"] / 2
    assert plan.here_load_note("here", load=quiet) is None
    assert plan.here_load_note("h100", load=50.0) is None
    assert plan.here_load_note("here", load=6.0) == (
        f"the load average is 6.0 now, {cal['load_before']:.2f} when "
        f"examples/calibration_here.json was measured ({cal['date']}): steps run here now "
        "take longer than planned (python examples/calibrate_here.py measures again)")


def test_the_planners_take_train_gpts_names_for_the_batch_and_the_sequence(capsys):
    """First-use walk 26: a flag copied from train_gpt.py (--batch-size, --block-size) was an
    error in plan.py, whose names are --global-batch and --seq: both now take either."""
    plan = _plan_cli()
    plan.main(["--params", "1e9", "--gpus", "8", "--seq", "2048", "--global-batch", "64",
               "--json"])
    ours = capsys.readouterr().out
    plan.main(["--params", "1e9", "--gpus", "8", "--block-size", "2048", "--batch-size", "64",
               "--json"])
    assert capsys.readouterr().out == ours and json.loads(ours)["global_batch"] == 64


# ---- first-use walk 32: the terms the cost model missed or over-counted -----------------------

TOY4 = replace(TOY, n_layer=4)


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
    import importlib.util
    spec = importlib.util.spec_from_file_location("plan_cli", "examples/plan.py")
    plan_cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plan_cli)
    base = ["--params", "1.3e9", "--seq", "2048", "--global-batch", "256", "--gpus", "64",
            "--fp32", "--layout", "dp=64,zero=1", "--json"]

    def run(*extra):
        plan_cli.main(base + list(extra))
        return json.loads(capsys.readouterr().out)
    plain, restated = run(), run("--peak-tflops", "989")
    assert plain["assumed"]["peak_tflops_fp32"] == 67 and plain["assumed"]["overlap"] == 1
    assert restated["rows"][0]["step"] == pytest.approx(plain["rows"][0]["step"])
    faster = run("--peak-tflops-fp32", "134")
    assert faster["rows"][0]["compute"] == pytest.approx(plain["rows"][0]["compute"] / 2)
    assert run("--overlap", "0.5")["assumed"]["overlap"] == 0.5
    plan_cli.main(base[:-1])
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
    import importlib.util
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
    spec = importlib.util.spec_from_file_location("plan_cli", "examples/plan.py")
    plan_cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plan_cli)
    plan_cli.main(["--params", "1e9", "--gpus", "16", "--overlap", "0", "--intra-lat", "0",
                   "--inter-lat", "0", "--json"])
    assumed = json.loads(capsys.readouterr().out)["assumed"]
    assert (assumed["overlap"], assumed["intra_us"], assumed["inter_us"]) == (0, 0, 0)
