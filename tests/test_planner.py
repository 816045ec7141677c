"""The memory planner (minidist/train/planner.py, examples/plan_memory.py) against the memory
ledger: a small model trained under each strategy, per-rank parameter, gradient and
optimizer bytes equal to the planner's, activations equal to its count of minidist's graph
and at least Korthikanti et al.'s; the published closed forms (ZeRO paper, Korthikanti
Table 2); the decision order; the CLI.

Adding a strategy is one row of ROWS: its train_gpt.py flags and the planner's Layout."""
import json
import subprocess
import sys

import pytest

from minidist.nn import GPT, GPTConfig
from minidist.train.args import train_parser
from minidist.train.loop import train
from minidist.train.planner import (Layout, bill, config_for_params, layer_activation_bytes,
                                    model_state_bytes, plan, stage_params)

CFG = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=256)
FLAGS = ["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size", "32",
         "--batch-size", "8", "--steps", "2", "--eval-every", "0", "--eval-iters", "1",
         "--sample", "0"]
BATCH = 8

ROWS = [   # (name, ranks, train_gpt.py flags, the planner's layout); mpiexec for ranks > 1
    ("fp32", 1, [], Layout(amp=False)),
    ("fp32 ckpt", 1, ["--ckpt-activations"], Layout(amp=False, recompute="full")),
    ("amp", 1, ["--amp"], Layout(amp=True)),
    ("amp ckpt accum2", 1, ["--amp", "--ckpt-activations", "--grad-accum", "2"],
     Layout(amp=True, recompute="full")),
    pytest.param("ddp2 amp ckpt", 2, ["--amp", "--ckpt-activations"],
                 Layout(dp=2, amp=True, recompute="full"), marks=pytest.mark.mpi),
    pytest.param("ddp2 fp32", 2, [], Layout(dp=2, amp=False),
                 marks=[pytest.mark.mpi, pytest.mark.slow]),
    pytest.param("zero1 amp", 2, ["--zero", "1", "--amp"], Layout(dp=2, zero=1),
                 marks=pytest.mark.mpi),
    pytest.param("zero2 amp", 2, ["--zero", "2", "--amp"], Layout(dp=2, zero=2),
                 marks=[pytest.mark.mpi, pytest.mark.slow]),
    pytest.param("zero3 amp", 2, ["--zero", "3", "--amp"], Layout(dp=2, zero=3),
                 marks=[pytest.mark.mpi, pytest.mark.slow]),
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


def test_decision_order():
    r = plan(config_for_params(7e9, 4096), gpus=8, gpu_mem_gib=80, seq=4096)
    assert r["recommendation"] == "ZeRO-1 (amp, ckpt)"
    names = [row["layout"] for row in r["rows"]]
    assert names[:5] == ["DDP (fp32)", "DDP (amp)", "DDP (amp, ckpt)", "ZeRO-1 (amp)",
                         "ZeRO-1 (amp, ckpt)"]
    small = GPTConfig(n_layer=12, n_head=12, n_embd=768, block_size=1024)   # GPT-2 124M
    assert plan(small, gpus=1, gpu_mem_gib=80)["recommendation"] == "DDP (fp32)"
    assert [plan(small, gpus=1, gpu_mem_gib=12, micro_batch=b)["recommendation"]
            for b in (4, 8, 16, 64)] == ["DDP (fp32)", "DDP (amp)", "DDP (amp, ckpt)", None]
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
    assert result["recommendation"] == "ZeRO-1 (amp, ckpt)"
    assert {"params", "grads", "optimizer", "activations", "total", "fits"} <= set(
        result["rows"][0])
