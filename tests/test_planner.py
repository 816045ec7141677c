"""The memory planner (minidist/train/planner.py, examples/plan_memory.py) against the memory
ledger: a small model trained under each strategy, per-rank parameter, gradient and
optimizer bytes equal to the planner's, activations equal to its count of minidist's graph
and at least Korthikanti et al.'s; the published closed forms (ZeRO paper, Korthikanti
Table 2); the decision order; what a pipeline stage holds under each schedule. The planners'
command lines: tests/test_planner_cli.py.

Adding a strategy is one row of ROWS: its train_gpt.py flags and the planner's Layout."""
import json
from dataclasses import replace
import math
import re

import pytest

from minidist.nn import GPT, GPTConfig
from minidist.pp.schedule import chunk_layers, split_layers, waiting_for_weights
from minidist.pp.simulate import simulate
from minidist.train.activations import held_layers, layer_activation_bytes, stage_activations
from minidist.train.args import train_parser
from minidist.train.loop import train
from minidist.train.planner import (Layout, bill, config_for_params, model_state_bytes,
                                    stage_params)
from minidist.train.run_bill import plan

from tests.plan_cases import CFG

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
    (with it, not: it keeps more for dropout than minidist's graph does, GPT-2's too).

        mpiexec -n 2 python examples/train_gpt.py --arch llama --n-kv-head 1 --log-json L
        ... (ROWS' flags; the ledger is the JSON row's "mem")
    """
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
    # 6 blocks on 4 stages: 2, 2, 1, 1, as the pipeline builds them (pp/schedule.py
    # split_layers; the planner counted 2, 1, 2, 1 until 2026-11-30)
    six = replace(CFG, n_layer=6)
    block = sum(p.size for name, p in GPT(six).state_dict().items()
                if name.startswith("transformer.h.0."))
    embed, ln_f = (V + six.block_size) * C, 2 * C
    assert stage_params(six, pp=4) == [embed + 2 * block, 2 * block, block,
                                       block + ln_f + V * C]


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
        stages = [s for s, blocks in enumerate(split_layers(L, pp)) for _ in blocks]
        for name, (shape, _) in specs.items():
            parts = name.split(".")
            stage = stages[int(parts[2])] if name.startswith("transformer.h.") else \
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
    # the graph's L a s^2 b e bytes of scores gone (no dropout: no mask): 53.99 -> 19.99 GiB
    act = {row["layout"]: row["activations"] for row in r["rows"]}
    assert act["ZeRO-1 (amp)"] - act["ZeRO-1 (amp, selective recompute)"] == \
        34 * 32 * 4096 ** 2 * 2
    small = GPTConfig(n_layer=12, n_head=12, n_embd=768, block_size=1024)   # GPT-2 124M
    assert plan(small, gpus=1, gpu_mem_gib=80)["recommendation"] == "DDP (fp32)"
    assert [plan(small, gpus=1, gpu_mem_gib=12, micro_batch=b)["recommendation"]
            for b in (4, 6, 8, 12, 16)] == ["DDP (fp32)", "DDP (amp)",
                                            "DDP (amp, selective recompute)",
                                            "DDP (amp, ckpt)", None]    # (16: 4.9 GiB logits)
    assert plan(config_for_params(70e9, 4096), gpus=8, gpu_mem_gib=80,
                seq=4096)["recommendation"] is None


@pytest.mark.parametrize("n", [7e9, 70e9, 175e9])
def test_assumed_shape_has_about_n_parameters(n):
    c = config_for_params(n)
    assert abs(sum(stage_params(c)) / n - 1) < 0.05 and c.n_embd % 1024 == 0


def test_held_layers_are_the_simulated_schedules_peaks():
    """The planner's count of what a stage holds at its peak is the schedule functions' own
    (run on the simulator's clock, chunk by chunk): GPipe m, 1F1B min(m, p - s), ZB-H1
    min(m, p) (1F1B's whole and the rest waiting for their W, both at once), interleaved
    its warmup + 1 chunk-micro-batches, each with its blocks."""
    for p, m, L in [(2, 1, 4), (2, 8, 4), (3, 2, 7), (4, 8, 8), (3, 6, 6), (2, 4, 5),
                    (4, 4, 6)]:
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
    (priced whole until 2026-11-29: 9% over)."""
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


def test_tiled_attention_and_cp_in_the_memory_model():
    """Tiled (and cp's ring) attention keep 4 a s b bytes of log-sum-exp instead of the
    (s, s) scores; cp halves s. Grouped-query attention (2 kv heads of 8): the ring keeps
    k and v as their heads, h + 2h/4 for Q, K, V where 3h were (1.5 x e = 3 sbh less);
    Ulysses and one process keep them repeated, 3h (tests/test_plan_vs_runs.py)."""
    s, b, h, a = 2048, 1, 1024, 8
    assert layer_activation_bytes(s, b, h, a, tiled=True) == s * b * h * 34 + 4 * a * s * b
    assert layer_activation_bytes(s, b, h, a, cp=2) == s / 2 * b * h * 34 + 4 * a * s / 2 * b
    assert layer_activation_bytes(s, b, h, a, cp=2, kv=0.25) == \
        s / 2 * b * h * 31 + 4 * a * s / 2 * b
    assert layer_activation_bytes(s, b, h, a, cp=2, ulysses=True, tiled=True, kv=0.25) == \
        layer_activation_bytes(s, b, h, a, cp=2, ulysses=True, tiled=True)
    assert layer_activation_bytes(s, b, h, a, tiled=True, kv=0.25) == \
        layer_activation_bytes(s, b, h, a, tiled=True)
    big = config_for_params(7e9, 32768)
    flat = bill(big, Layout(dp=8), 32768)["activations"]
    tiled = bill(big, Layout(dp=8, tiled=True), 32768)["activations"]
    assert tiled < flat / 10
