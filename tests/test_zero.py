"""ZeRO: the flat layout in-process, then N ranks under mpiexec against one process in float64
(stages 1, 2, 3, hybrid sharding, overlapped parameter gathers), the memory ledger and bytes
per step against theory. Sharded checkpoints: tests/test_zero_checkpoint.py; ZeRO-3 through
the model's block hooks: tests/test_zero_hooks.py.

The distributed checks run tests/scripts/zero_check.py, which batches many comparisons into one
mpiexec start; each test's docstring gives the command to run it by hand.
"""
import os
import subprocess
import sys

import numpy as np
import pytest

from minidist.backend import to_host
from minidist.nn import GPT, GPTConfig
from minidist.zero.flat import FlatUnit, gpt_units, placeholder
from minidist.strategy import memory
from minidist.train.args import train_parser
from mpirun import ROOT, tagged_json, within
from tests.zero_cases import CONFIG, SEED, batch


class P:
    """A parameter's fields, its data on `xp` (numpy or cupy: the xp fixture)."""

    def __init__(self, xp, *shape, decay=True):
        self.data, self.decay = xp.arange(np.prod(shape), dtype=float).reshape(shape), decay
        self.shape, self.size, self.dtype = shape, self.data.size, self.data.dtype
        self.grad_dtype = self.dtype


def test_flat_unit_pads_to_a_multiple_of_the_ranks_and_cuts_equal_shards(xp):
    w, b = P(xp, 3), P(xp, 3, decay=False)
    units = [FlatUnit("u", [("w", w), ("b", b)], world=4, rank=r) for r in range(4)]
    u = units[1]
    assert (u.numel, u.padded, u.padding, u.shard_size, u.lo, u.hi) == (6, 8, 2, 2, 2, 4)
    flat = u.flatten()
    assert flat.tolist() == [0, 1, 2, 0, 1, 2, 0, 0]                 # padding: zeros at the end
    assert list(u.pieces()) == [(0, 2, 3), (1, 0, 1)]               # w[2], b[0]
    assert u.decay_ranges() == [(0, 1)]                              # only w's element decays
    assert [list(x.pieces()) for x in (units[2], units[3])] == [[(1, 1, 3)], []]
    u.point_params_at(flat)
    assert xp.shares_memory(w.data, flat) and w.data.shape == (3,)


def test_gpt_units_and_placeholders():
    model = GPT(CONFIG, seed=0)
    units = gpt_units(model, world=4, rank=0)
    assert [u.name for u in units] == ["root", "h.0", "h.1", "h.2", "h.3"]
    assert units[0].names == ["transformer.wte.weight", "transformer.wpe.weight",
                              "transformer.ln_f.weight", "transformer.ln_f.bias"]
    assert sum(u.numel for u in units) == model.num_parameters()
    assert all(u.padding and u.padded % 4 == 0 for u in units)      # odd sizes: padded
    units[1].release_params()
    p = units[1].params[0]
    assert p.shape == units[1].shapes[0] and np.isnan(p.data).all()
    assert memory.unique_nbytes([p.data, placeholder((7,), p.data)]) == 4   # one float32
    with pytest.raises(ValueError, match="read-only"):   # numpy finds a writer (CuPy would not)
        p.data[...] = 0.0


def test_zero1_reduces_a_gradient_dropped_to_none_as_zeros():
    """ZeRO-1 keeps every .grad a view into its unit's full gradient buffer; one that someone
    dropped (model.zero_grad(): None) and that the next backward does not reach goes into the
    reduce-scatter as zeros, not as the last step's gradient the view still holds. One-rank
    group, in process: after a backward through wpe alone, every other shard is zero."""
    from mpi4py import MPI
    from minidist.comm import ProcessGroup
    from minidist.zero.engine import zero_engine
    model = GPT(CONFIG, SEED, "float64")
    engine = zero_engine(model, ProcessGroup(MPI.COMM_SELF, name="dp"), 1)
    model(*batch(0, 4))[1].backward()
    engine.sync_grads()
    assert all(u.grad_shard.any() for u in engine.units)
    model.zero_grad()                                     # .grad = None, not the views
    wpe = model.transformer.wpe.weight
    (wpe * wpe).sum().backward()                          # reaches wpe alone
    engine.sync_grads()
    root = engine.units[0]
    want = root.flat.flatten([2 * wpe.data if p is wpe else None for p in root.flat.params])
    assert np.array_equal(to_host(root.grad_shard), to_host(want))
    assert not any(u.grad_shard.any() for u in engine.units[1:])


def test_zero1_issues_each_blocks_reduce_scatter_before_backward_reaches_the_blocks_below():
    """ZeRO-1 issues a unit's reduce-scatter from backward's hooks as soon as the unit is
    complete, units last to first (the order backward completes them, as DDP's buckets):
    when block 0's first gradient is complete, blocks 3, 2 and 1 have been issued, under the
    rest of backward. Taken first to last (the root first, whose wte completes at the very
    end), all would be issued at the end of backward: the same numbers, and still every unit
    issued before sync_grads waits (what zero_check.py counts), but nothing overlapped.
    One-rank group run in sequence (sync_comm): each call is counted as it is issued."""
    from mpi4py import MPI
    from minidist.comm import ProcessGroup, trace
    from minidist.zero.engine import zero_engine
    model = GPT(CONFIG, SEED, "float64")
    group = ProcessGroup(MPI.COMM_SELF, name="zero1-issue-order", sync_comm=True)
    engine = zero_engine(model, group, 1)
    def calls():
        return trace.counters(group.name).get("reduce_scatter", {"calls": 0})["calls"]
    issued = []                                   # reduce-scatters issued at that moment
    model.transformer.h[0].mlp.c_proj.weight.register_grad_hook(lambda p: issued.append(calls()))
    model(*batch(0, 4))[1].backward()
    engine.sync_grads()
    assert issued == [CONFIG.n_layer - 1], issued
    assert calls() == CONFIG.n_layer + 1                      # and h.0's and the root's


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_model_zero_grad_between_steps_is_zeros_at_stage_1_and_refused_at_2_and_3(stage):
    """A loop that empties the gradients with model.zero_grad() (PyTorch's habit), not the
    optimizer's: ZeRO-1 keeps each .grad a view and takes the None as zeros, so the next
    step's shards hold that step's gradient alone; at stages 2 and 3 .grad is None already
    and the shards kept the step's gradients, which the next backward added to (the next
    step took both, silently): refused there, naming opt.zero_grad(). One-rank group."""
    from mpi4py import MPI
    from minidist.comm import ProcessGroup
    from minidist.zero.engine import zero_engine
    from minidist.zero.optim import ShardedAdamW
    model = GPT(CONFIG, SEED, "float64")
    engine = zero_engine(model, ProcessGroup(MPI.COMM_SELF, name="dp"), stage)
    opt = ShardedAdamW(engine, lr=1e-2)
    model(*batch(0, 4))[1].backward()
    engine.sync_grads()
    opt.step()
    engine.after_step()
    model.zero_grad()
    if stage > 1:
        with pytest.raises(RuntimeError, match=r"without zero_grad\(\).*opt\.zero_grad\(\)"):
            model(*batch(1, 4))[1].backward()
        return
    model(*batch(1, 4))[1].backward()
    engine.sync_grads()
    ref = GPT(CONFIG, SEED, "float64")
    ref.load_state_dict({n: p.data.copy() for n, p in model.named_parameters()})
    ref(*batch(1, 4))[1].backward()
    for u, f in zip(engine.units, gpt_units(ref, 1, 0)):
        want = f.flatten([p.grad for p in f.params])
        assert np.array_equal(to_host(u.grad_shard), to_host(want)), f.name


def test_zero_paper_arithmetic():
    P_ = 1000
    assert memory.zero_model_states(P_, 4, 0) == {"params": 4000, "grads": 4000,
                                                  "optimizer": 8000, "total": 16000}
    assert memory.zero_model_states(P_, 4, 1)["optimizer"] == 2000
    assert memory.zero_model_states(P_, 4, 2, amp=True) == {
        "params": 2000, "grads": 500, "optimizer": 3000, "total": 5500}
    assert memory.zero_model_states(P_, 4, 3, amp=True)["total"] == 16 * P_ // 4
    assert memory.zero_model_states(1001, 4, 3) == {       # a shard is ceil(P / N): 251
        "params": 4 * 251, "grads": 4 * 251, "optimizer": 8 * 251, "total": 16 * 251}
    assert memory.zero_model_states(P_, 4, 1, amp=True, grad_bytes=4) == {  # --grad-dtype
        "params": 2000, "grads": 4000, "optimizer": 3000, "total": 9000}    # float32


@pytest.mark.cpu_only("examples/zero_walkthrough.py simulates the ranks on numpy by design")
def test_the_chapters_tables_are_the_arithmetic_for_the_main_jobs_model():
    """minidist/zero/README.md's tables for the main job's model (train_gpt.py's defaults,
    vocabulary 256) on 4 ranks: each stage's model states (the paper's arithmetic,
    memory.zero_model_states, float32 and --amp; measured = predicted there, no unit padded)
    and the bytes sent (DDP, stages 1-2: 2(N-1)/N Psi; stage 3: (N-1)/N (Psi + root +
    (2L-2)/L blocks), 1.24x DDP, 1.41x with 12 layers). That runs measure these is
    test_stages_match_one_process_with_clipping_accumulation_memory_and_comm's; by hand:

        mpirun -n 4 python examples/bench_zero.py
    """
    args, n, mib = train_parser().parse_args([]), 4, 2**-20
    text = " ".join(open(f"{ROOT}/minidist/zero/README.md").read().split())

    def units(n_layer):
        config = GPTConfig(n_layer=n_layer, n_head=args.n_head, n_embd=args.n_embd,
                           block_size=args.block_size, vocab_size=256)
        return [u.numel for u in gpt_units(GPT(config, seed=0), n, 0)]

    def stage3_vs_ddp(sizes):
        root, blocks, L = sizes[0], sum(sizes[1:]), len(sizes) - 1
        return (root + blocks + root + (2 * L - 2) / L * blocks) / (2 * (root + blocks))

    sizes = units(args.n_layer)
    assert all(s % n == 0 for s in sizes)              # no padding: measured = predicted
    psi = sum(sizes)
    for stage, name in enumerate(["DDP", "1", "2", "3"]):
        row = memory.zero_model_states(psi, n, stage)
        cells = [f"{row[k] * mib:.3f} / {row[k] * mib:.3f}"
                 for k in ("params", "grads", "optimizer", "total")]
        assert f"| {name} | {' | '.join(cells)} |" in text, (name, cells)
    amp = [memory.zero_model_states(psi, n, stage, amp=True)["total"] * mib
           for stage in range(4)]
    assert "model states {:.3f} (DDP), {:.3f}, {:.3f}, {:.3f} MiB".format(*amp) in text, amp
    ddp, x3 = 2 * (n - 1) / n, stage3_vs_ddp(sizes)
    assert f"| DDP | {ddp * psi * 4 * mib:.2f} | {ddp:.2f} | 1.00 |" in text
    assert f"| 3 | {x3 * ddp * psi * 4 * mib:.2f} | {x3 * ddp:.2f} | {x3:.2f} |" in text, x3
    assert f"{x3:.2f}x with the main job's 4 layers, {stage3_vs_ddp(units(12)):.2f}x with 12" \
        in text


def test_zero_walkthrough_equals_one_process(capsys):
    """python examples/zero_walkthrough.py --ranks 3 --steps 2: each simulated rank's slice
    of the reduce-scattered gradient and, after AdamW on the shards and the all-gather, every
    rank's parameters equal one process's; the shard table cuts through parameters."""
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import zero_walkthrough
    assert zero_walkthrough.main(["--ranks", "3", "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "rank 1 owns [  28,   56): wte.weight[28:48] wpe.weight[0:8]" in out, out
    slices = [float(line.rsplit("= ", 1)[1]) for line in out.splitlines()
              if "reduce-scatter" in line and "max |slice" in line]
    assert len(slices) == 4 and max(slices) < 1e-15, slices       # 2 units x 2 steps
    worst = float(out.rstrip().rsplit("max difference ", 1)[1].rstrip(")"))
    assert ": OK (max difference" in out and worst < 1e-12
    assert "ZeRO-3       198     198     396" in out               # 594 / 3 each, m and v


@pytest.mark.parametrize("flags", [["--ranks", "0"], ["--steps", "-1"]])
def test_zero_walkthrough_refuses_bad_input(flags):
    """One `error:` line naming the flag, exit 2, no traceback."""
    out = subprocess.run([sys.executable, "examples/zero_walkthrough.py", *flags], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    errors = [line for line in out.stderr.splitlines() if "error:" in line]
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert len(errors) == 1 and f"error: {' '.join(flags)}:" in errors[0], out.stderr


def test_stages_match_one_process_with_clipping_accumulation_memory_and_comm(mpi):
    """Stages 1, 2, 3 at 4 ranks == 1 process (float64, clipping active, 2 micro-batches,
    every unit padded), every unit's reduce-scatter started by backward's hooks before
    sync_grads (stage 1: only in the last micro-batch, the first held back by no_sync;
    stages 2, 3: in both), then the ledger and the bytes sent per step against theory:

        mpiexec -n 4 python tests/scripts/zero_check.py --clip 0.05 --grad-accum 2 \\
            --memory --comm
    """
    out = mpi(4, "tests/scripts/zero_check.py", "--clip", "0.05", "--grad-accum", "2",
              "--memory", "--comm", timeout=300)
    results = tagged_json(out)
    assert [r["stage"] for r in results] == [1, 2, 3]
    for r in results:
        assert within(r, 1e-10), r
        assert all(r["padding"]) and max(r["norms"]) > 0.05
        assert r["scatters_in_backward"] == r["units"] * (1 if r["stage"] == 1 else 2), r
    mem, = tagged_json(out, "MEMORY")
    for rank_rows in mem["by_rank"]:
        m = {int(s): row["measured"] for s, row in rank_rows.items()}
        assert abs(4 * m[1]["optimizer"] / m[0]["optimizer"] - 1) < 0.03
        assert abs(4 * m[2]["grads"] / m[0]["grads"] - 1) < 0.03
        assert abs(4 * m[3]["params"] / m[0]["params"] - 1) < 0.03
    comm, = tagged_json(out, "COMM")
    ratios = {int(s): row.get("vs_ddp") for s, row in comm["stages"].items()}
    assert abs(ratios[1] - 1) < 0.01 and abs(ratios[2] - 1) < 0.01
    L = comm["n_layer"]
    assert 1.0 < ratios[3] < 1.5 and abs(ratios[3] - 1 - (L - 2) / (2 * L)) < 0.05


def test_stages_with_activation_checkpointing_no_prefetch_mpi_and_amp_memory(mpi):
    """3 ranks with the MPI library's collectives, activation checkpointing (stage 3 gathers
    for the recompute) and no prefetch; then 4 ranks, mixed precision, 2 + 2 + 12 bytes:

        mpiexec -n 3 python tests/scripts/zero_check.py --ckpt-activations --no-prefetch \\
            --algo mpi --batch-size 6
        mpiexec -n 4 python tests/scripts/zero_check.py --stages "" --amp
    """
    out = mpi(3, "tests/scripts/zero_check.py", "--ckpt-activations", "--no-prefetch",
              "--algo", "mpi", "--batch-size", "6", timeout=300)
    assert [r["stage"] for r in tagged_json(out)] == [1, 2, 3]
    for r in tagged_json(out):
        assert within(r, 1e-10), r
    out = mpi(4, "tests/scripts/zero_check.py", "--stages", "", "--amp", timeout=300)
    mem, = tagged_json(out, "MEMORY")
    assert mem["amp"] and len(mem["by_rank"]) == 4     # the script checked every number


def test_hybrid_sharding_matches_one_process_and_sends_one_all_reduce_across(mpi):
    """Hybrid sharding (--zero-shard): each 2 of 4 ranks hold one sharded replica; stages 1,
    2, 3 with clipping and 2 micro-batches == 1 process (float64), and the bytes each rank
    sent to the other replica are one ring all-reduce of its gradient shards per step
    (asserted in the script against ring_bytes), every stage starting them under backward
    (the trace's issue times); then shard groups of 1 (every rank a whole
    replica, only the all-reduce between them), stages 2 and 3 under recompute without
    prefetch:

        mpiexec -n 4 python tests/scripts/zero_check.py --shard 2 --clip 0.05 --grad-accum 2
        mpiexec -n 4 python tests/scripts/zero_check.py --shard 1 --stages 2,3 \
            --ckpt-activations --no-prefetch
    """
    runs = [(["--shard", "2", "--clip", "0.05", "--grad-accum", "2"], [1, 2, 3], 2),
            (["--shard", "1", "--stages", "2,3", "--ckpt-activations", "--no-prefetch",
          "--grad-accum", "2"], [2, 3], 1)]
    for flags, stages, shard in runs:
        results = tagged_json(mpi(4, "tests/scripts/zero_check.py", *flags, timeout=300))
        assert [r["stage"] for r in results] == stages
        for r in results:
            assert within(r, 1e-10), r
            assert r["shard_ranks"] == shard and r["across_replicas"] > 0, r
            # each unit's all-reduce across starts under backward, but for the last two
            # reduce-scatters still in flight (stage 1 since 2026-11-27: was 0)
            assert r["across_in_backward"] >= r["units"] - 2, r


def test_overlapped_parameter_gathers_equal_one_process(mpi):
    """--overlap-param-gather at stages 1 and 2 (2 micro-batches, clipping): the all-gathers
    after each step run in the background and the next forward waits for each unit in its
    block hook; == 1 process (float64), after the last step every parameter is still a NaN
    placeholder, never half-gathered numbers, and the gathers ran on a group of their own
    (on the shard group the loss's mean waited for them: no overlap):

        mpiexec -n 4 python tests/scripts/zero_check.py --overlap-gather --stages 1,2 \
            --clip 0.05 --grad-accum 2
    """
    out = mpi(4, "tests/scripts/zero_check.py", "--overlap-gather", "--stages", "1,2",
              "--clip", "0.05", "--grad-accum", "2", timeout=300)
    results = tagged_json(out)
    assert [(r["stage"], r["overlap_gather"]) for r in results] == [(1, True), (2, True)]
    for r in results:
        assert within(r, 1e-10), r
        # how many gathers the next forward found still running is a measurement (4 of 5
        # here), not asserted: on shared cores all may finish first
        assert r["gathers_in_flight"] <= r["units"], r


def test_the_summary_counts_overlapped_gathers_once_per_step(mpi):
    """The run's last line gives the bytes a rank sent per step: ZeRO-1 sends a reduce-scatter
    and an all-gather of the parameters, (N-1)/N Psi each, 2(N-1)/N = 1.50 x at 4 ranks, with
    or without --overlap-param-gather (the same collectives, the gathers on a group of their
    own, landing during the next step; the summary printed 1.80 x there until 2026-11-29):

        mpiexec -n 4 python examples/train_gpt.py --zero 1 --overlap-param-gather \\
            --steps 3 --n-layer 2 --n-embd 32 --block-size 32 --batch-size 8 --sample 0
    """
    flags = ["--zero", "1", "--steps", "3", "--n-layer", "2", "--n-embd", "32",
             "--block-size", "32", "--batch-size", "8", "--eval-iters", "1", "--sample", "0"]
    lines = []
    for extra in ([], ["--overlap-param-gather"]):
        out = mpi(4, "examples/train_gpt.py", *flags, *extra, timeout=120).stdout
        line, = [s for s in out.splitlines() if s.startswith("ZeRO-1 over 4 ranks")]
        lines.append(line)
        assert "MiB of parameters (1.50 x; DDP sends 2(N-1)/N = 1.50 x)" in line, line
    assert lines[0] == lines[1]


def test_the_zero3_summary_equals_the_gathers_that_find_no_unit_in_its_buffer(mpi):
    """ZeRO-3's bytes per step, 3 blocks of C = 32 (b values each; the root R: wte, wpe,
    ln_f), 4 ranks, M micro-batches: M reduce-scatters of Psi, the root gathered once, the
    blocks in the first forward, every block but the last two in each backward, and every
    block but the first two in each later forward (still in their buffers from the
    backward before): (N-1)/N (M Psi + R + L b + (L-2) b + (M-1) 2 (L-2) b):

        mpiexec -n 4 python examples/train_gpt.py --zero 3 --grad-accum 2 --n-layer 3 \\
            --n-embd 32 --block-size 32 --batch-size 8 --steps 2 --sample 0
    """
    L, C, V, T, N = 3, 32, 256, 32, 4
    R = V * C + T * C + 2 * C                                     # wte, wpe, ln_f
    b = 4 * C + (C * 3 * C + 3 * C) + (C * C + C) + (C * 4 * C + 4 * C) + (4 * C * C + C)
    psi = R + L * b
    for m in (1, 2):
        gathers = R + L * b + (L - 2) * b + (m - 1) * 2 * (L - 2) * b
        x = (N - 1) / N * (m * psi + gathers) / psi
        out = mpi(N, "examples/train_gpt.py", "--zero", "3", "--grad-accum", str(m),
                  "--n-layer", str(L), "--n-embd", str(C), "--block-size", str(T),
                  "--batch-size", "8", "--steps", "2", "--eval-iters", "1", "--sample", "0",
                  timeout=120).stdout
        line, = [s for s in out.splitlines() if s.startswith("ZeRO-3 over 4 ranks")]
        assert f"MiB of parameters ({x:.2f} x; the paper's ZeRO-3" in line, (x, line)
