"""The planners' figures against what real runs measure (the bytes a rank sends per step, the
calls the trace records, the activations the ledger holds), where the planner once priced what
training no longer does: ZeRO-3's gathers under --grad-accum and under a pipeline, the
experts' gradient buckets over their replicas, grouped-query attention's k and v, ZeRO-1/2's
reduce-scatters. At 1 B/s and no latency (UNIT) the step-time model's seconds are bytes sent
per rank."""
import json
from dataclasses import replace

import pytest

from minidist.nn import GPTConfig
from minidist.train.cost import step_time, zero_units
from minidist.train.moe_cost import expert_buckets, expert_tensors
from minidist.train.planner import Layout, bill
from minidist.train.zero3_cost import zero3_gathers

from tests.plan_cases import UNIT

SMALL = ["--block-size", "32", "--eval-iters", "1", "--sample", "0"]


def _rows(path):
    """The step rows of a --log-json file (the final record left out)."""
    return [r for r in map(json.loads, open(path)) if "step" in r]


@pytest.mark.mpi
def test_zero3_bytes_under_grad_accum_are_the_runs(mpi, tmp_path):
    """ZeRO-3 over 4 ranks, 3 blocks, --grad-accum M = 1, 2, 4: a step's bytes (the run's
    comm_bytes, step 3 less step 2, less its three one-number all-reduces, 8 B each: the
    clip's sum of squares, the loss's mean, the stop flag) = the planner's ZeRO-3 traffic,
    (N-1)/N (M Psi + R + (2M(L-2) + 2) b) (minidist/zero/README.md). Until 2026-11-29 it
    charged each micro-batch the root and the first two blocks again: 644,928 and
    1,289,856 B at M = 2 and 4, measured 540,864 and 977,664. Full recompute
    (--ckpt-activations) sends the same bytes (its forward in backward runs on the block
    backward's re-gather already fetched; zero/README.md), and the planner says so.

        mpiexec -n 4 python examples/train_gpt.py --zero 3 --grad-accum 4 --n-layer 3 \\
            --n-embd 32 --block-size 32 --batch-size 16 --steps 3 --log-json L
    """
    cfg = GPTConfig(n_layer=3, n_head=4, n_embd=32, block_size=32, vocab_size=256)
    for m, recompute in ((1, "none"), (2, "none"), (4, "none"), (2, "full")):
        log = tmp_path / f"m{m}{recompute}.jsonl"
        ckpt = ["--ckpt-activations"] if recompute == "full" else []
        out = mpi(4, "examples/train_gpt.py", "--zero", "3", "--grad-accum", str(m),
                  "--n-layer", "3", "--n-embd", "32", "--batch-size", "16", "--steps", "3",
                  *ckpt, *SMALL, "--log-json", log, timeout=120).stdout
        sent = [r["comm_bytes"] for r in _rows(log)]
        plan = step_time(cfg, Layout(dp=4, zero=3, amp=False, recompute=recompute), UNIT,
                         seq=32, global_batch=16, micro_batches=m)
        assert sent[2] - sent[1] - 3 * 8 == plan["zero_in_pipeline"], (m, sent, plan)
        psi = 4 * 47392                          # the summary's x: the same bytes over Psi
        assert f"({plan['zero_in_pipeline'] / psi:.2f} x;" in out, out


@pytest.mark.mpi
@pytest.mark.parametrize("schedule,blocks", [("1f1b", (22, 18)), ("gpipe", (30, 30)),
                                             ("zb-h1", (22, 18)), ("interleaved", (28, 20))])
def test_zero3_gathers_under_a_pipeline_are_the_runs(schedule, blocks, mpi, tmp_path):
    """pp 2 x dp 2, ZeRO-3, 4 blocks a stage, 4 micro-batches: the blocks each stage gathers
    in a step follow the schedule's order of forwards and backwards (two buffers by parity,
    zero3_cost.zero3_gathers): 1F1B 22 on stage 0 and 18 on stage 1, GPipe 30 on both (its
    forwards push out what the backwards would find), ZB-H1 1F1B's (its W gathers nothing),
    interleaved (2 chunks of 2 blocks) 28 and 20. The trace's dp all-gathers of a stage
    = its root + those blocks (+ one forward's root and blocks after the step, the final
    evaluation: the broadcast's bytes), and the step-time model's ZeRO-3 bytes at 1 B/s =
    (N-1)/N of its all-gathers and reduce-scatters (the slowest stage at 1 FLOP/s, the last).
    Until 2026-11-29 every micro-batch was priced as a first forward: 4.82 x Psi on stage 0
    under 1F1B where the run's summary says 4.42 x.

        mpiexec -n 4 python examples/train_gpt.py --pp 2 --dp 2 --zero 3 --micro-batches 4 \\
            --schedule 1f1b --n-layer 8 --n-head 2 --n-embd 32 --block-size 16 --steps 1 \\
            --trace T
    """
    trace, v = tmp_path / "pp.json", 2 if schedule == "interleaved" else 1
    order = ["--schedule", "1f1b", "--pp-virtual", "2"] if v > 1 else ["--schedule", schedule]
    out = mpi(4, "examples/train_gpt.py", "--pp", "2", "--dp", "2", "--zero", "3",
              "--micro-batches", "4", *order, "--n-layer", "8", "--n-head",
              "2", "--n-embd", "32", "--block-size", "16", "--batch-size", "16", "--steps",
              "1", "--eval-every", "0", "--eval-iters", "1", "--sample", "0", "--trace", trace,
              timeout=180).stdout
    cfg = GPTConfig(n_layer=8, n_head=2, n_embd=32, block_size=16, vocab_size=256)
    layout = Layout(dp=2, pp=2, zero=3, amp=False)
    events, block = json.load(open(trace))["traceEvents"], 4 * 12704
    sent = {}
    for stage, root in ((0, 4 * (256 * 32 + 16 * 32)), (1, 4 * (256 * 32 + 2 * 32))):
        got = {}
        for e in events:
            if e.get("ph") == "X" and e["pid"] == 2 * stage and e["args"].get("group") == "dp":
                got[e["name"]] = got.get(e["name"], 0) + e["args"]["bytes"]
        gathers = zero3_gathers(schedule, 2, stage, 4, 4, v, n_layer=8)
        assert sum(k for _, k in gathers) == blocks[stage]
        assert got["all_gather"] - got["broadcast"] == root + blocks[stage] * block
        sent[stage] = (got["all_gather"] - got["broadcast"] + got["reduce_scatter"]) / 2
    plan = step_time(cfg, layout, UNIT, seq=16, global_batch=16, micro_batches=4,
                     schedule=schedule, v=v)
    assert plan["zero_in_pipeline"] == pytest.approx(sent[1])
    psi = 4 * (4 * 12704 + 256 * 32 + 16 * 32)               # stage 0's parameters, bytes
    assert f"({sent[0] / psi:.2f} x;" in out, out


@pytest.mark.mpi
@pytest.mark.parametrize("zero,pp", [(1, 1), (2, 1), (2, 2)])
def test_zero12_reduce_scatter_a_unit_at_a_time_as_the_runs(zero, pp, mpi, tmp_path):
    """ZeRO-1 and -2 reduce-scatter each unit's gradients as backward completes it
    (minidist/zero/zero.py, stage2.py), ZeRO-2 in every micro-batch, ZeRO-1 in the step's
    last: the trace's dp reduce-scatters of a stage, per backward, are call_cost.zero_units of
    them (3 blocks and the root: 4; under pp 2 each stage's 2 blocks, its root part and its
    copy of the tied wte: 4), the last the root's (pp 2's last stage: its first block's),
    their bytes the stage's gradients. The step-time model hides all but the last of them
    (overlap 1, a backward far longer: 1 FLOP/s), so at 1 B/s a backward leaves (N-1)/N of
    its bytes in view (call_cost.last_unit; until 2026-11-29 an equal share of them all; before
    that cut by DDP's --bucket-mb, which training refuses under ZeRO).

        mpiexec -n 2 python examples/train_gpt.py --zero 2 --grad-accum 2 --n-layer 3 \\
            --n-embd 32 --block-size 32 --batch-size 8 --steps 2 --trace T
    """
    n_layer, m = (3 if pp == 1 else 4), 2        # 3 blocks; 4 over two stages
    flags = ["--pp", "2", "--dp", "2", "--micro-batches", "2"] if pp > 1 else \
        ["--grad-accum", "2"]
    trace = tmp_path / "zero.json"
    mpi(2 * pp, "examples/train_gpt.py", "--zero", str(zero), *flags, "--n-layer",
        str(n_layer), "--n-embd", "32", "--batch-size", "8", "--steps", "2", *SMALL,
        "--trace", trace, timeout=180)
    cfg = GPTConfig(n_layer=n_layer, n_head=4, n_embd=32, block_size=32, vocab_size=256)
    layout = Layout(dp=2, pp=pp, zero=zero, amp=False)
    plan = step_time(cfg, layout, replace(UNIT, overlap=1.0), seq=32, global_batch=8,
                     micro_batches=m)
    events = json.load(open(trace))["traceEvents"]
    for stage in range(pp):
        calls = sorted((e for e in events if e.get("ph") == "X" and e["pid"] == 2 * stage
                        and e["name"] == "reduce_scatter"), key=lambda e: e["ts"])
        units = zero_units(layout, n_layer // pp, stage)
        backwards = 2 * (m if zero == 2 else 1)                 # two steps
        assert len(calls) == backwards * units, (stage, calls)
        if pp == 1:
            assert calls[units - 1]["args"]["bytes"] == 4 * (256 * 32 + 32 * 32 + 2 * 32)
        elif stage == 1:                  # its first block's (the head's wte, ln_f first)
            assert calls[units - 1]["args"]["bytes"] == 4 * 12704
    sent = sum(e["args"]["bytes"] for e in calls[:units]) / 2      # (N-1)/N, the last stage's
    last = calls[units - 1]["args"]["bytes"] / 2
    if zero == 2:
        assert plan["zero_in_pipeline"] == pytest.approx(m * last)
    else:                                          # + the all-gather after the step, in view
        assert plan["dp_exposed"] == pytest.approx(last + sent)


@pytest.mark.mpi
@pytest.mark.parametrize("flags", [["--bucket-mb", "0.02"], ["--zero", "1"],
                                   ["--zero", "3", "--grad-accum", "2"]])
def test_dp_calls_are_the_runs(flags, mpi, tmp_path):
    """Each DDP bucket and ZeRO unit is a collective of its own and pays its latency
    (minidist/train/call_cost.py): dp 2, 3 blocks, two steps traced. DDP at 0.02 MiB: the
    trace's all-reduces of each step are call_cost.ddp_buckets' bytes, in order (10, the
    last the tied wte's alone); ZeRO-1: a reduce-scatter and an all-gather per unit
    (zero_units: 4); ZeRO-3 at --grad-accum 2: the root's and zero3_gathers' blocks gathered
    (7), a reduce-scatter per unit in each backward (8); the final evaluation (in
    --grad-accum's 2 micro-batches, as the steps) gathers the root and the 3 blocks for
    its first forward, and 2 blocks for its second (block 1 still in its buffer). On a
    link of 1 s latency and no transfer time the step-time model's data-parallel seconds
    are those calls (an all-reduce over 2 ranks 2 alpha, the others 1): 20, 8 and 15 s
    (until 2026-11-29 one latency for all of each: 2, 2 and 6 s).

        mpiexec -n 2 python examples/train_gpt.py --zero 3 --grad-accum 2 --n-layer 3 \\
            --n-embd 32 --block-size 32 --batch-size 8 --steps 2 --eval-every 0 --trace T
    """
    from minidist.train.call_cost import ddp_buckets
    from minidist.train.comm_cost import Link
    trace = tmp_path / "dp.json"
    mpi(2, "examples/train_gpt.py", *flags, "--n-layer", "3", "--n-embd", "32",
        "--batch-size", "8", "--steps", "2", "--eval-every", "0", *SMALL, "--trace", trace,
        timeout=180)
    calls = sorted((e for e in json.load(open(trace))["traceEvents"] if e.get("ph") == "X"
                    and e["pid"] == 0 and e["args"].get("group") == "dp"
                    and e["name"] != "broadcast" and e["args"]["bytes"] > 8),
                   key=lambda e: e["ts"])
    count = {op: sum(e["name"] == op for e in calls) for op in ("all_reduce", "reduce_scatter",
                                                                  "all_gather")}
    cfg = GPTConfig(n_layer=3, n_head=4, n_embd=32, block_size=32, vocab_size=256)
    zero, m = (int(flags[1]), 2 if "--grad-accum" in flags else 1) if "--zero" in flags \
        else (0, 1)
    layout = Layout(dp=2, zero=zero, amp=False)
    alpha = replace(UNIT, intra=Link(1.0, 1e30))
    plan = step_time(cfg, layout, alpha, seq=32, global_batch=8, micro_batches=m,
                     bucket_mb=0.02)
    units = zero_units(layout, 3, 0)
    if zero == 0:
        buckets = ddp_buckets(cfg, layout, 0, 4, 0.02)
        assert len(buckets) == 10 and buckets[-1] == 4 * 256 * 32
        assert [e["args"]["bytes"] for e in calls] == list(buckets) * 2, calls
        assert plan["dp_comm"] == pytest.approx(2 * len(buckets))
    elif zero == 1:
        assert count == {"all_reduce": 0, "reduce_scatter": 2 * units, "all_gather": 2 * units}
        assert plan["dp_comm"] == pytest.approx(2 * units)
    else:
        gathers = 1 + sum(k for _, k in zero3_gathers("1f1b", 1, 0, m, 3))
        assert gathers == 7 and units == 4
        assert count == {"all_reduce": 0, "reduce_scatter": 2 * m * units,
                         "all_gather": 2 * gathers + 1 + 3 + 2}
        assert plan["zero_in_pipeline"] == pytest.approx(gathers + m * units)


@pytest.mark.mpi
def test_the_experts_buckets_are_the_runs(mpi, tmp_path):
    """ep 2 x dp 2, 2 MoE blocks of 4 experts: each rank's 16 expert tensors are a DDP of
    their own over their 2 replicas, in buckets cut as the dense DDP cuts them. The planner's
    buckets (moe_cost.expert_buckets) = the trace's edp all-reduces of every step, in order:
    one of 133,632 B at the default 1 MiB; 8 at 0.02 MiB (a 16 KiB weight that would
    overflow a bucket starts the next); its bytes at 1 B/s = the summary's. (Until 2026-11-29
    the planner priced 16 all-reduces after backward, none hidden.)

        mpiexec -n 4 python examples/train_gpt.py --moe-experts 4 --ep 2 --dp 2 --n-layer 2 \\
            --n-embd 32 --block-size 32 --batch-size 8 --steps 3 --bucket-mb 0.02 --trace T
    """
    cfg = GPTConfig(n_layer=2, n_head=4, n_embd=32, block_size=32, vocab_size=256,
                    moe_experts=4)
    layout = Layout(dp=4, ep=2, amp=False)
    sizes = expert_tensors(cfg, layout, 0)
    assert len(sizes) == 16
    for mb, calls in ((1.0, 1), (0.02, 8)):
        trace = tmp_path / f"ep{mb}.json"
        out = mpi(4, "examples/train_gpt.py", "--moe-experts", "4", "--ep", "2", "--dp", "2",
                  "--n-layer", "2", "--n-embd", "32", "--batch-size", "8", "--steps", "3",
                  *SMALL, "--bucket-mb", str(mb), "--trace", trace, timeout=120).stdout
        events = sorted((e for e in json.load(open(trace))["traceEvents"]
                         if e.get("ph") == "X" and e["pid"] == 0
                         and e["args"].get("group") == "edp" and e["name"] == "all_reduce"),
                        key=lambda e: e["ts"])
        buckets = expert_buckets(sizes, 4, mb)
        assert len(buckets) == calls
        assert [e["args"]["bytes"] for e in events] == buckets * 3, (mb, events)
        plan = step_time(cfg, layout, UNIT, seq=32, global_batch=8, bucket_mb=mb)
        edp = plan["expert_comm"] - 8            # less the clip's 8 B over ep
        assert edp == sum(buckets)               # an all-reduce over 2: its buffer, sent
        assert f"; {edp / 2**20:.2f} MiB on the edp group of 2" in out, out


@pytest.mark.mpi
@pytest.mark.parametrize("attention", ["ring", "ulysses"])
def test_grouped_query_activations_are_the_runs(attention, mpi, tmp_path):
    """--arch llama, 4 q heads, cp 2: the ledger's activations at --n-kv-head 1 and 4. The
    ring keeps k and v as the kv heads (it repeats a block only to attend to it), 2 s b h
    (1 - kv/nh) e / cp per layer less at kv 1 (196,608 B here); Ulysses, as one process's
    attention, keeps them repeated, the same bytes at both. The planner's bill differs by
    what the ledger's does (before 2026-11-29 it billed the ring 3h whatever kv: 2,629,632 B
    at kv 1, over the 2,446,600 measured), and stays below the ledger by one amount at both
    (what Korthikanti's count leaves out: the token ids, RoPE's tables, ...).

        mpiexec -n 2 python examples/train_gpt.py --cp 2 --cp-attention ring --arch llama \\
            --n-kv-head 1 --n-layer 2 --n-head 4 --n-embd 64 --block-size 64 --log-json L
    """
    held, planned = {}, {}
    for kv in (1, 4):
        log = tmp_path / f"kv{kv}.jsonl"
        mpi(2, "examples/train_gpt.py", "--cp", "2", "--cp-attention", attention,
            "--arch", "llama", "--n-kv-head", str(kv), "--n-layer", "2", "--n-head", "4",
            "--n-embd", "64", "--block-size", "64", "--batch-size", "8", "--steps", "2",
            "--eval-every", "0", "--eval-iters", "1", "--sample", "0", "--log-json", log,
            timeout=120)
        held[kv] = _rows(log)[-1]["mem"]["activations"]
        cfg = GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=64, vocab_size=256,
                        arch="llama", bias=False, n_kv_head=kv)
        layout = Layout(cp=2, amp=False, cp_attention=attention,
                        tiled=attention == "ring")          # (--attention auto at T 64)
        planned[kv] = bill(cfg, layout, 64, 8, dropout=False)["activations"]
    fewer = 2 * 2 * 32 * 8 * 64 * (1 - 1 / 4) * 4 if attention == "ring" else 0
    assert held[4] - held[1] == fewer and planned[4] - planned[1] == fewer
    assert 0 < held[1] - planned[1] == held[4] - planned[4] < 0.01 * held[1]


def test_one_process_keeps_the_repeated_k_and_v(corpus, tmp_path, mpi):
    """Without cp the attention saves q, k, v after repeat_kv (minidist/nn/block.py): the
    ledger holds the same activations at --n-kv-head 1 and 4 (materialised and tiled), as
    the planner's counts (minidist's and Korthikanti's) bill 3 h a token at both.

        python examples/train_gpt.py --arch llama --n-kv-head 1 --n-head 4 --n-embd 64 \\
            --block-size 64 --attention tiled --log-json L
    """
    from minidist.train.args import train_parser
    from minidist.train.loop import train
    for attention in ("materialized", "tiled"):
        held = []
        for kv in (1, 4):
            log = tmp_path / f"{attention}{kv}.jsonl"
            train(train_parser().parse_args([
                "--arch", "llama", "--n-kv-head", str(kv), "--n-layer", "2", "--n-head", "4",
                "--n-embd", "64", "--block-size", "64", "--batch-size", "8", "--steps", "2",
                "--eval-every", "0", "--eval-iters", "1", "--sample", "0", "--attention",
                attention, "--data", corpus, "--cache-dir", str(tmp_path / "cache"),
                "--log-json", str(log), "--device", mpi.device]))
            held.append(_rows(log)[-1]["mem"]["activations"])
        assert held[0] == held[1], (attention, held)
        cfg = GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=64, vocab_size=256,
                        arch="llama", bias=False, n_kv_head=1)
        for formula in ("minidist", "korthikanti"):
            one, four = (bill(replace(cfg, n_kv_head=kv), Layout(amp=False,
                                                                 tiled=attention == "tiled"),
                              64, 8, dropout=False, formula=formula)["activations"]
                         for kv in (1, 4))
            assert one == four, formula
