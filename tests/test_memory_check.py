"""The start's memory bill (minidist/train/memory_check.py): the run's flags read into the
planner's layout, each rank's count (its pipeline stage's, the step's logits, the
evaluation's forward, a save's or a load's copy of the state), and the advice a refusal
gives, each flag priced again. Where the check looks, its verdict and the runs it refuses:
tests/test_memory_room.py.

    python -m pytest -q tests/test_memory_check.py tests/test_memory_room.py
"""
import json
from dataclasses import replace

import numpy as np
import pytest

from minidist.nn import GPT, GPTConfig
from minidist.pp.schedule import chunk_layers
from minidist.train.activations import layer_activation_bytes
from minidist.train.args import train_parser
from minidist.train.memory_check import (ADDRESS_MARGIN, advice, eval_activations,
                                         loads_assembled, rank_bill, run_layout, size_text)
from minidist.train.planner import GiB, Layout, bill, stage_params
from minidist.train.step_buffers import rank_shapes, step_buffers, zero_units
from minidist.zero.flat import gpt_units

CFG = GPTConfig(n_layer=4, n_head=4, n_embd=64, block_size=64, vocab_size=256)


def _args(*flags):
    return train_parser().parse_args([str(f) for f in flags])


@pytest.mark.parametrize("flags, size, layout, micro, m", [
    ([], 1, Layout(amp=False), 16, 1),
    (["--amp", "--zero", "3"], 4, Layout(dp=4, zero=3), 4, 1),
    (["--tp", "2", "--sequence-parallel", "--ckpt-activations"], 4,
     Layout(dp=2, tp=2, sp=True, amp=False, recompute="full"), 8, 1),
    (["--pp", "2", "--micro-batches", "4", "--attention", "recompute"], 4,
     Layout(dp=2, pp=2, amp=False, recompute="selective"), 2, 4),
    (["--pp", "2"], 4, Layout(dp=2, pp=2, amp=False), 2, 4),      # training's default m
    (["--ep", "2", "--moe-experts", "4", "--zero", "1", "--grad-accum", "2"], 4,
     Layout(dp=4, ep=2, zero=1, amp=False), 2, 1),
    (["--cp", "2", "--cp-attention", "ulysses", "--optimizer", "muon"], 2,
     Layout(cp=2, cp_attention="ulysses", amp=False, muon=True), 16, 1),
    (["--block-size", "256", "--amp", "--grad-dtype", "float32", "--zero", "2",
      "--zero-shard", "2", "--overlap-param-gather"], 4,
     Layout(dp=4, zero=2, zero_shard=2, overlap_gather=True, tiled=True, grad32=True), 4, 1),
])
def test_flags_read_into_the_planners_layout(flags, size, layout, micro, m):
    """Each flag's field, --attention auto tiled from T 256, ep counted in dp (the planner's
    convention), sequences per micro-batch after dp, --grad-accum and the pipeline's split."""
    assert run_layout(_args(*flags), size) == (layout, micro, m)


def test_a_ranks_bill_is_the_planners_for_its_stage():
    """DDP: the planner's count of minidist's graph; float64 twice float32; --eval-only no
    gradients (no buckets: DDP's naive mode) and no optimizer state (a --resume's neither:
    none is built); under PP each rank its own stage's (Korthikanti's, without dropout: a
    floor of what the graph keeps), rank 2 of pp 2 x dp 2 the last stage."""
    plain = rank_bill(CFG, _args(), 2, 1)
    want = bill(CFG, Layout(dp=2, amp=False), 64, 8, formula="minidist")
    evaluation = eval_activations(CFG, _args(), Layout(dp=2, amp=False))
    logits = 4 * 8 * 64 * 256             # the step's (B, T, V) float32 beside the graph's
    buffers = step_buffers(CFG, Layout(dp=2, amp=False), 0, 8)     # AdamW's scratch
    state = want["params"] + want["grads"] + want["optimizer"] + buffers
    assert plain == {**{k: want[k] for k in ("params", "grads", "optimizer", "activations")},
                     "checkpoint": 0, "evaluation": evaluation, "logits": logits,
                     "buffers": buffers,
                     "total": state + max(want["activations"] + logits, evaluation)}
    wide = rank_bill(CFG, _args("--dtype", "float64"), 2, 0)
    assert wide == {k: 2 * v for k, v in plain.items()}
    only = rank_bill(CFG, _args("--eval-only"), 2, 0)
    assert only["grads"] == only["optimizer"] == only["evaluation"] == 0
    assert only["total"] == plain["params"] + evaluation < plain["params"] + want["activations"]
    assert rank_bill(CFG, _args("--eval-only", "--resume", "x"), 2, 0)["optimizer"] == 0
    for split in (["--tp", 2], ["--cp", 2]):   # no graph: the plain forward's ceiling, not
        row = rank_bill(CFG, _args("--eval-only", *split), 2, 0)   # every layer's training
        assert row["activations"] == eval_activations(CFG, _args(), Layout(amp=False)) < \
            rank_bill(CFG, _args(*split), 2, 0)["activations"]
    deep, sends = replace(CFG, n_layer=16), 16 * 64 * 64 * 4    # a stage's (rows, T, C) sent
    assert rank_bill(deep, _args("--eval-only", "--pp", 2), 2, 0)["activations"] == \
        eval_activations(deep, _args(), Layout(amp=False)) + sends < \
        rank_bill(deep, _args("--pp", 2), 2, 0)["activations"]
    args = _args("--pp", "2", "--micro-batches", "2", "--dropout", "0.1")
    first, last = (rank_bill(CFG, args, 4, r)["total"] for r in (0, 2))
    stages = [bill(CFG, Layout(dp=2, pp=2, amp=False), 64, 4, dropout=False,
                   micro_batches=2, at_stage=s)["total"] +
              step_buffers(CFG, Layout(dp=2, pp=2, amp=False), s, 4) for s in (0, 1)]
    assert [first, last] == [stages[0], stages[1] + 4 * 4 * 64 * 256]     # the head's last


def test_a_tp_recompute_bills_its_recomputed_split_block():
    """--ckpt-activations under TP recomputes one block in backward, split as TP splits it:
    Korthikanti's whole block less what checkpointing keeps of it (was not billed)."""
    layout = Layout(tp=2, amp=False, recompute="full")
    extra = step_buffers(CFG, layout, 0, 8) - step_buffers(CFG, replace(
        layout, recompute="none"), 0, 8)
    assert extra == int(layer_activation_bytes(64, 8, 64, 4, 2, e=4, dropout=False) -
                        layer_activation_bytes(64, 8, 64, 4, 2, recompute="full", e=4,
                                               dropout=False)) > 0


def test_a_mixture_of_experts_is_billed_its_experts():
    """An MoE model: Korthikanti's count, with the k experts a token visits (the graph count
    has none: `python examples/train_gpt.py --steps 2 --moe-experts 4 --moe-top-k 2 --log-json
    L` was billed 84.1 MiB of activations for L's 130.2; now 120.1); --eval-only its
    forward's ceiling, a dense one's and its MoE block's experts (was the training count)."""
    moe = GPTConfig(n_layer=4, n_head=4, n_embd=64, block_size=64, vocab_size=256,
                    moe_experts=4, moe_top_k=2)
    row = rank_bill(moe, _args("--moe-experts", 4, "--moe-top-k", 2), 1, 0)
    want = bill(moe, Layout(amp=False), 64, 16, dropout=False)
    assert row["activations"] == want["activations"] > bill(
        moe, Layout(amp=False), 64, 16, formula="minidist")["activations"]
    only = rank_bill(moe, _args("--moe-experts", 4, "--moe-top-k", 2, "--eval-only"), 1, 0)
    dense = eval_activations(CFG, _args(), Layout(amp=False))     # (--eval-only: a forward's)
    assert dense < only["activations"] == eval_activations(moe, _args(), Layout(amp=False)) \
        < row["activations"]
    every = replace(moe, moe_every=2)              # (a one-block copy of it is no MoE model)
    assert eval_activations(every, _args(), Layout(amp=False)) == only["activations"]


def test_a_save_or_a_load_holds_a_copy_of_the_state():
    """A save's snapshot (parameters and optimizer) outlives the step's activations with
    --async-save and follows them otherwise; a --resume's load holds a copy only where it
    cuts or glues shards (load_copy: ZeRO's own shards, or a checkpoint of shards read
    whole), a memory-mapped one of whole arrays none, nor --init-from's weights, read as the
    model is built; a GPU's copies are on the host, not in its memory.
    Measured (25.4M parameters, batch 2, one process: peak RSS less the 40 MiB of an idle
    Python with numpy): a save each step 650 MiB for 679 counted, --async-save 763 for 752."""
    plain = rank_bill(CFG, _args(), 1, 0)
    state = plain["params"] + plain["grads"] + plain["optimizer"] + plain["buffers"]
    copy = plain["params"] + plain["optimizer"]
    steps = max(plain["activations"] + plain["logits"], plain["evaluation"])
    for row in (rank_bill(CFG, _args("--save", "ck"), 1, 0),
                rank_bill(CFG, _args("--resume", "ck"), 1, 0, assembled=True)):
        assert row["checkpoint"] == copy
        assert row["total"] == state + max(steps, copy)
    assert rank_bill(CFG, _args("--resume", "ck"), 1, 0) == {**plain, "checkpoint": 0}
    row = rank_bill(CFG, _args("--save", "ck", "--async-save"), 1, 0)
    assert row["total"] == state + steps + copy
    for stage, shards in ((1, 4), (3, 1)):
        row = rank_bill(CFG, _args("--zero", stage, "--resume", "ck"), 4, 0)
        assert row["checkpoint"] == row["params"] // shards + row["optimizer"]
    assert rank_bill(CFG, _args("--init-from", "w"), 1, 0) == plain   # (read as built)
    gpu = rank_bill(CFG, _args("--save", "ck", "--async-save"), 1, 0, host_is_device=False)
    assert gpu == plain


@pytest.mark.parametrize("shape, flags", [
    (dict(n_head=2, block_size=128, vocab_size=8192), []),
    (dict(n_head=8, block_size=512, vocab_size=256), ["--attention", "materialized"]),
    (dict(n_head=4, block_size=128, vocab_size=2048, arch="llama", n_kv_head=2), []),
    (dict(n_head=2, block_size=128, vocab_size=8192), ["--amp"]),
])
def test_the_evaluations_forward_is_in_the_bill(shape, flags):
    """evaluate()'s no-grad forward of a training micro-batch's rows peaks (tracemalloc)
    within eval_activations: --eval-only's bill (GPT-2 124M, batch 16: 7.73 GiB, was 21.16),
    a training run's beside its steps; under --grad-accum evaluate() runs micro-batches too,
    so the count is a micro-batch's."""
    import tracemalloc
    from minidist.autograd import no_grad
    from minidist.train.amp import MixedPrecision
    given = ["--batch-size", 8, "--block-size", shape["block_size"], *flags]
    args = _args(*given)
    config = GPTConfig(n_layer=2, n_embd=64, attention=args.attention, **shape)
    model = GPT(config).eval()
    if args.amp:                # 16-bit logits, and the loss's float32 copy of them
        MixedPrecision().cast_model(model)
    x = np.random.default_rng(0).integers(0, config.vocab_size, (8, config.block_size))
    tracemalloc.start()
    with no_grad():
        model(x, x)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    ceiling = eval_activations(config, args, run_layout(args, 1)[0])
    assert peak <= ceiling <= 2.2 * peak
    halves = _args(*given, "--grad-accum", 2)
    accum = rank_bill(config, halves, 1, 0)
    assert accum["evaluation"] == eval_activations(config, halves, run_layout(halves, 1)[0])
    assert accum["evaluation"] < ceiling
    steps = max(accum["activations"] + accum["logits"], accum["evaluation"])
    assert accum["total"] == accum["params"] + accum["grads"] + accum["optimizer"] + \
        accum["buffers"] + steps


def test_bill_stage_picks_a_row_and_none_the_largest():
    layout = Layout(pp=2, amp=False)
    rows = [bill(CFG, layout, 64, 2, at_stage=s) for s in (0, 1)]
    assert [r["stage"] for r in rows] == [0, 1]
    assert bill(CFG, layout, 64, 2) == max(rows, key=lambda r: r["total"])


def test_tiled_attention_keeps_a_row_not_the_scores():
    """minidist's graph under --attention tiled: each row's float32 log-sum-exp instead of
    the (T, T) probabilities (the runs' ledger: 68.25 MiB at T 256 on 2 ranks, measured)."""
    scores = bill(CFG, Layout(amp=False), 64, 4, formula="minidist")["activations"]
    rows = bill(CFG, Layout(amp=False, tiled=True), 64, 4, formula="minidist")["activations"]
    a, s, b = CFG.n_head, 64, 4
    assert scores - rows == CFG.n_layer * (a * s * s * b * 4 - a * s * b * 4)


def test_advice_names_what_would_need_less():
    """Each flag priced again: those that alone fit first, those that need less after; none
    that training refuses with the others (--amp under --dtype float64, --grad-accum 2 for 3
    rows: were advised); fewer ranks a host only where they share the memory."""
    args = _args("--batch-size", "8")
    need = rank_bill(CFG, args, 2, 0)["total"]
    text = advice(args, CFG, 2, need * 0.6)           # each flag alone needs 0.69-0.97
    assert text.startswith("--zero 3, --amp, --ckpt-activations, --grad-accum 2 (the same "
                           "batch in smaller parts), a smaller --batch-size or --block-size, "
                           "fewer ranks a host need less (python examples/plan_memory.py ")
    assert text.endswith(f"--micro-batch 4 --gpus 2 --gpu-mem {need * 0.6 / GiB:.2g} prices "
                         "each layout)")
    text = advice(args, CFG, 2, need * 0.85, shared=False)
    assert text.startswith("--ckpt-activations or --grad-accum 2 (the same batch in smaller "
                           "parts) each fit by the planner's count; --zero 3, --amp, a "
                           "smaller --batch-size or --block-size need less (")
    wide = advice(_args("--dtype", "float64", "--batch-size", "6"), CFG, 2, 1)
    assert wide.startswith("--zero 3, --ckpt-activations, --grad-accum 3 (the same batch in ")
    one = advice(_args("--amp", "--ckpt-activations", "--batch-size", "1"), CFG, 1, GiB, False)
    assert one.startswith("a smaller --batch-size or --block-size need less")
    address = advice(args, CFG, 2, need * 0.85, False, margin=ADDRESS_MARGIN)  # `ulimit -v`'s
    assert address.startswith("--zero 3, --amp, --ckpt-activations, --grad-accum 2 (the same "
                              "batch in smaller parts), a smaller --batch-size or --block-size "
                              "need less (")          # (0.69-0.97 x need: none within 0.75 x 0.85)
    assert address.endswith(f"--gpu-mem {need * 0.85 / GiB:.2g} --headroom 0.25 prices each "
                            "layout)")
    bucketed = advice(_args("--batch-size", "8", "--bucket-mb", "4"), CFG, 2, need * 0.6)
    assert bucketed.startswith("--zero 3 (without --bucket-mb), --amp, ")   # (was left out)
    assert size_text(3 * GiB // 2) == "1.50 GiB" and size_text(1536 * 1024) == "1.5 MiB"


@pytest.mark.mpi
@pytest.mark.parametrize("ranks, flags", [
    (2, ["--zero", "3"]), (2, ["--zero", "2", "--amp"]), (2, []), (1, ["--ckpt-activations"]),
    (4, ["--zero", "1", "--amp"]), (2, ["--tp", "2", "--ckpt-activations"]),
    pytest.param(2, ["--zero", "1"], marks=pytest.mark.slow),
    pytest.param(1, ["--amp"], marks=pytest.mark.slow),
])
def test_the_bill_holds_a_runs_live_arrays(ranks, flags, corpus, mpi, tmp_path):
    """The `memory:` line's largest rank is within [0.9, 1.3] x every rank's live-array peak
    over the whole run (tracemalloc from the start to the end: building, steps, evaluation):
    what the count leaves out (a gradient before it lands in its DDP bucket, Python's own)
    is within the check's "near the limit" margin (memory_check.MARGIN). Measured (the bill
    over the peak): DDP 0.93, ZeRO-1 0.93, ZeRO-3 1.14, ZeRO-2 --amp 1.15, 4 ranks ZeRO-1
    --amp 1.00, --ckpt-activations 1.05, --amp 1.05, --tp 2 --ckpt-activations 0.97 (0.90
    without TP's recomputed block; 0.41 at 4 layers of 128, --batch-size 32: step_buffers.py
    tp_block).
    Without the step's buffers (minidist/train/step_buffers.py), at 4 layers of 512 and T
    128, ZeRO-3 was billed 0.64 x its peak, ZeRO-2 0.74 x, --ckpt-activations 0.89 x:

        mpiexec -n 2 python tests/scripts/peak_memory.py OUT examples/train_gpt.py --data F \\
            --zero 3 --n-layer 2 --n-embd 512 --n-head 4 --block-size 64 --batch-size 4 \\
            --steps 2 --sample 0
    """
    if mpi.device == "cuda":
        pytest.skip("tracemalloc sees the host's arrays; a GPU's are CuPy's pool's")
    line, billed, peaks = _billed_and_peaks(
        mpi, ranks, tmp_path, ["--data", corpus, "--n-layer", "2", "--n-embd", "512",
                               "--n-head", "4", "--block-size", "64", "--batch-size", "4",
                               "--steps", "2", "--sample", "0", "--cache-dir",
                               str(tmp_path / "cache"), *flags], timeout=180)
    assert 0.9 * max(peaks) <= billed <= 1.3 * max(peaks), (line, peaks)


def _billed_and_peaks(mpi, ranks, tmp_path, flags, timeout=120):
    """examples/train_gpt.py `flags` on `ranks` under tests/scripts/peak_memory.py: (its
    `memory:` line, the largest rank's bill in bytes, every rank's traced peak)."""
    out = tmp_path / "peaks"
    out.mkdir(parents=True)
    run = mpi(ranks, "tests/scripts/peak_memory.py", str(out), "examples/train_gpt.py",
              *flags, timeout=timeout)
    line = next(x for x in run.stdout.splitlines() if x.startswith("memory: "))
    billed = float(line.split()[1]) * (GiB if line.split()[2] == "GiB" else 2 ** 20)
    return line, billed, [json.load(open(out / f"rank{r}.json"))["peak"]
                          for r in range(ranks)]


@pytest.mark.parametrize("layout", [Layout(), Layout(tp=2), Layout(pp=2), Layout(pp=3, tp=2),
                                    Layout(dp=4, ep=2)])
def test_a_ranks_shapes_are_the_planners_parameters(layout):
    """step_buffers.rank_shapes of each stage: the elements the planner counts there (its
    stage_params, held to the ledger: tests/test_planner.py); ZeRO's units as gpt_units cuts
    a real model's (the largest block's and the root's, padded to the ranks)."""
    config = GPTConfig(n_layer=6, n_head=4, n_embd=32, block_size=16, vocab_size=101,
                       moe_experts=4 if layout.ep > 1 else 0)
    for stage, n in enumerate(stage_params(config, layout.tp, layout.pp, layout.ep)):
        assert sum(k for _, _, k in rank_shapes(config, layout, stage)) == n
    dense, layout = replace(config, moe_experts=0), Layout(dp=3, zero=2)
    units = gpt_units(GPT(dense), 3, 0)
    want = (max(u.padded for u in units if u.module is not None),
            sum(u.padded for u in units if u.module is None))
    assert zero_units(rank_shapes(dense, layout, 0), layout) == want


def test_a_stages_blocks_are_the_ones_the_pipeline_builds_there():
    """rank_shapes and rank_bill put on each stage the blocks the pipeline builds there
    (pp/strategy.py build_model: chunk_layers): 6 blocks on 4 stages are 2, 2, 1, 1; the bill
    had them as 2, 1, 2, 1 (`i * pp // L`), stage 1 billed half its blocks. Interleaved, the
    blocks of the stage's chunks, an MoE model's MoE blocks among them."""
    config = replace(CFG, n_layer=6)
    for pp in range(2, 7):
        for stage in range(pp):
            blocks = {int(name.split(".")[2]) for name, _, _ in
                      rank_shapes(config, Layout(pp=pp), stage) if ".h." in name}
            assert blocks == set(chunk_layers(6, pp, 1, stage)[0]), (pp, stage)
    bills = [rank_bill(config, _args("--pp", 4, "--n-layer", 6), 4, r) for r in range(4)]
    block = sum(p.size for name, p in GPT(config).state_dict().items()
                if name.startswith("transformer.h.0."))
    assert bills[1]["params"] == 4 * 2 * block and bills[2]["params"] == 4 * block
    # interleaved (--pp-virtual 2), an MoE block every second: stage 0 holds blocks 0 and 2
    # (dense), stage 1 blocks 1 and 3 (both MoE); split_layers' stages were billed one each
    moe = replace(CFG, moe_experts=4, moe_top_k=2, moe_every=2)
    sizes = {name: p.size for name, p in GPT(moe).state_dict().items()}
    flags = _args("--pp", 2, "--pp-virtual", 2, "--micro-batches", 4, "--moe-experts", 4,
                  "--moe-top-k", 2, "--moe-every", 2)
    for stage in range(2):
        mine = [i for c in chunk_layers(4, 2, 2, stage) for i in c]
        assert {int(n.split(".")[2]) for n, _, _ in rank_shapes(moe, Layout(pp=2), stage, 2)
                if ".h." in n} == set(mine) == ({0, 2} if stage == 0 else {1, 3})
        blocks = sum(n for name, n in sizes.items()
                     if name.startswith("transformer.h.") and int(name.split(".")[2]) in mine)
        root = sizes["transformer.wte.weight"] + (sizes["transformer.wpe.weight"] if stage == 0
                                                  else sum(n for name, n in sizes.items()
                                                           if ".ln_f." in name))
        assert stage_params(moe, pp=2, v=2)[stage] == blocks + root
        assert rank_bill(moe, flags, 2, stage)["params"] == 4 * (blocks + root)


@pytest.mark.mpi
@pytest.mark.parametrize("ranks, layout, others", [(2, ["--zero", "2"], [[]]), (1, [], [])])
def test_a_resumes_bill_holds_its_live_arrays(ranks, layout, others, corpus, mpi, tmp_path):
    """--resume (read before the first step): the bill is within [0.9, 1.3] x the run's
    live-array peak, resuming in the layout that saved (ZeRO-2 on 2 ranks: its shards cut
    and held until all are read; one process: the checkpoint's whole arrays memory-mapped,
    no copy) and in `others` (DDP from ZeRO-2's shards: glued whole, a copy of the state);
    and a new run --init-from it (read a block at a time as it is built: no copy), and an
    --eval-only of it (no optimizer built, the parameters alone read: the model's build is
    its peak, billed 52.7 MiB for 57.4 both at ZeRO-2 and in one process; before, with the
    optimizer's state read, 86.4 for 103.5 and 83.8 for 81.8).
    Billed for the peak: ZeRO-2 137.8 MiB for 113.1, DDP from its shards 185.4 for 173.5,
    one process 129.4 for 113.1 (billed a copy it does not hold, 178.0: 1.57 x); --init-from
    137.8 for 119.5 (ZeRO-2), 129.4 for 121.9 (one process). The step's
    own buffers (ZeRO-2's gradients in flight) are freed by its end, so they are billed
    with the steps, not beside the copy (beside it: 178.1 for 113.1):

        mpiexec -n 2 python tests/scripts/peak_memory.py OUT examples/train_gpt.py --data F \\
            --zero 2 --n-layer 2 --n-embd 512 --n-head 4 --block-size 64 --batch-size 4 \\
            --steps 3 --sample 0 --resume CKPT     # CKPT: the same flags, --steps 2 --save

    (the --eval-only run: `--eval-only --resume CKPT`, no --steps).
    """
    if mpi.device == "cuda":
        pytest.skip("tracemalloc sees the host's arrays; a GPU's are CuPy's pool's")
    flags = ["--data", corpus, "--n-layer", "2", "--n-embd", "512", "--n-head", "4",
             "--block-size", "64", "--batch-size", "4", "--sample", "0",
             "--cache-dir", str(tmp_path / "cache")]
    ck = tmp_path / "ck"
    mpi(ranks, "examples/train_gpt.py", *flags, *layout, "--steps", "2", "--save", str(ck),
        timeout=120)
    assert loads_assembled(str(ck)) == bool(layout)
    runs = [[*other, "--resume", str(ck), "--steps", "3"] for other in [layout, *others]]
    runs += [[*layout, "--init-from", str(ck), "--steps", "3"],
             [*layout, "--resume", str(ck), "--eval-only"]]
    for i, run in enumerate(runs):
        line, billed, peaks = _billed_and_peaks(mpi, ranks, tmp_path / str(i), [*flags, *run])
        assert 0.9 * max(peaks) <= billed <= 1.3 * max(peaks), (run, line, peaks)


@pytest.mark.mpi
@pytest.mark.parametrize("ranks, model, split", [
    (2, [], ["--tp", "2"]), (1, ["--moe-experts", "4", "--moe-top-k", "2"], []),
    (2, ["--moe-experts", "4", "--moe-top-k", "2"], ["--ep", "2"])])
def test_an_evaluation_under_tp_is_billed_a_forward_not_every_layer(ranks, model, split,
                                                                    corpus, mpi, tmp_path):
    """--eval-only --tp 2 (and --cp 2) keeps no graph: the bill is the plain forward's ceiling
    (every head, the whole sequence, on the rank's rows), above the live peak and within 3 x
    of it; it was the training graph's every layer: 106.9 MiB for a peak of 23.9, now 57.1.
    An MoE model's too (its MoE block's experts: run_bill.eval_bytes): one process 249.5 MiB
    for a peak of 36.8, now 79.5; --ep 2 125.4 for 28.3, now 40.4:

        python examples/train_gpt.py --data F --n-layer 4 --n-embd 128 --block-size 128 \\
            --steps 1 --save CKPT [--moe-experts 4 --moe-top-k 2]
        mpiexec -n 2 python tests/scripts/peak_memory.py OUT examples/train_gpt.py --data F \\
            --resume CKPT --eval-only --batch-size 32 --eval-iters 1 --sample 0 --tp 2  # or --ep 2
    """
    if mpi.device == "cuda":
        pytest.skip("tracemalloc sees the host's arrays; a GPU's are CuPy's pool's")
    cache = ["--data", corpus, "--cache-dir", str(tmp_path / "cache")]
    mpi(1, "examples/train_gpt.py", *cache, "--n-layer", "4", "--n-embd", "128",
        "--block-size", "128", "--steps", "1", "--eval-iters", "1", "--sample", "0",
        "--save", str(tmp_path / "ck"), *model, timeout=120)
    line, billed, peaks = _billed_and_peaks(
        mpi, ranks, tmp_path, [*cache, "--resume", str(tmp_path / "ck"), "--eval-only",
                               "--batch-size", "32", "--eval-iters", "1", "--sample", "0",
                               *split])
    assert max(peaks) <= billed <= 3 * max(peaks), (line, peaks)
