"""ZeRO: the flat layout in-process, then N ranks under mpiexec against one process in float64
(stages 1, 2, 3), the memory ledger and bytes per step against theory, and sharded checkpoints
resharded across world sizes and stages.

The distributed checks run tests/scripts/zero_check.py and zero_ckpt_check.py, which batch many
comparisons into one mpiexec start; each test's docstring gives the command to run it by hand.
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from minidist.backend import to_host as H
from minidist.nn import GPT
from minidist.nn.gpt import BlockHooks
from minidist.zero.flat import FlatUnit, gpt_units, placeholder
from minidist.strategy import memory
from minidist.strategy.checkpoint import CheckpointError, load_checkpoint
from minidist.train.step import train_step
from minidist.strategy.base import SingleProcess
from mpirun import ROOT, tagged_json

sys.path.insert(0, os.path.join(ROOT, "tests", "scripts"))
from zero_check import CONFIG, SEED, batch  # noqa: E402


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


def test_zero_paper_arithmetic():
    P_ = 1000
    assert memory.zero_model_states(P_, 4, 0) == {"params": 4000, "grads": 4000,
                                                  "optimizer": 8000, "total": 16000}
    assert memory.zero_model_states(P_, 4, 1)["optimizer"] == 2000
    assert memory.zero_model_states(P_, 4, 2, amp=True) == {
        "params": 2000, "grads": 500, "optimizer": 3000, "total": 5500}
    assert memory.zero_model_states(P_, 4, 3, amp=True)["total"] == 16 * P_ // 4


@pytest.mark.cpu_only("examples/zero_walkthrough.py simulates the ranks on numpy by design")
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
        assert max(r["loss_diff"], r["norm_diff"], r["param_diff"]) < 1e-10, r
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
    for r in tagged_json(out):
        assert max(r["loss_diff"], r["norm_diff"], r["param_diff"]) < 1e-10, r
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
            assert max(r["loss_diff"], r["norm_diff"], r["param_diff"]) < 1e-10, r
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
        assert max(r["loss_diff"], r["norm_diff"], r["param_diff"]) < 1e-10, r
        assert 0 <= r["gathers_in_flight"] <= r["units"], r   # 4 of 5 measured here


def test_sharded_checkpoint_reshards_4_stage3_to_1_process_and_2_ranks_stage1(tmp_path, mpi):
    """Save at 4 ranks, ZeRO-3 (resume bitwise; a missing and a mismatched shard fail on every
    rank, named); load in one process (bitwise), step, save plain; load at 2 ranks, ZeRO-1
    (bitwise, the same step to 1e-10), and the plain checkpoint into ZeRO-2 (bitwise):

        mpiexec -n 4 python tests/scripts/zero_ckpt_check.py --save /tmp/z --stage 3
        (one process: this test's middle part)
        mpiexec -n 2 python tests/scripts/zero_ckpt_check.py --load /tmp/z --stage 1
    """
    d = str(tmp_path)
    out = mpi(4, "tests/scripts/zero_ckpt_check.py", "--save", d, "--stage", "3",
              timeout=300)
    saved, = tagged_json(out)
    assert saved["resume_bitwise"] and "shard-00002-of-00004" in saved["missing"]
    assert "shard-00001-of-00004" in saved["mismatch"] and "checksum" in saved["mismatch"]
    expected = np.load(os.path.join(d, "expected.npz"))
    one_process_from_sharded(d, expected)
    pretrained = GPT.from_pretrained(os.path.join(d, "pretrained"))      # float32 files
    assert all(np.array_equal(H(p.data), expected[n].astype(np.float32))
               for n, p in pretrained.named_parameters())
    out = mpi(2, "tests/scripts/zero_ckpt_check.py", "--load", d, "--stage", "1",
              timeout=300)
    loaded, = tagged_json(out)
    assert loaded["reshard_bitwise"] and loaded["step_diff_vs_1proc"] < 1e-10


def one_process_from_sharded(d, expected):
    """The 4-rank ZeRO-3 checkpoint in one process: the same parameters; one step; saved as
    DIR/after_1proc.npz and the plain checkpoint DIR/plain for the 2-rank part."""
    from types import SimpleNamespace
    args = SimpleNamespace(lr=1e-2, weight_decay=0.1, grad_clip=1.0, grad_accum=1,
                           batch_size=8, log_json=None, optimizer="adamw")
    strategy = SingleProcess()
    model = strategy.build_model(CONFIG, SEED, "float64")
    opt = strategy.build_optimizer(model, args)
    state = strategy.load(os.path.join(d, "ckpt"), model, opt)
    assert state["step"] == 2
    assert all(np.array_equal(H(p.data), expected[n]) for n, p in model.named_parameters())
    train_step(strategy, model, opt, *batch(2, args.batch_size), args)
    np.savez(os.path.join(d, "after_1proc.npz"),
             **{n: H(p.data) for n, p in model.named_parameters()})
    strategy.save(os.path.join(d, "plain"), model, opt, 3, {}, {})
    with pytest.raises(CheckpointError, match="shard-00002-of-00004.*missing"):
        load_checkpoint(os.path.join(d, "missing"), model, opt)


def test_train_gpt_zero3_log_table_and_resume_at_2_ranks_zero1(tmp_path, mpi):
    """The script end to end, float64: 4 ranks at ZeRO-3 log `mem` and print the memory
    table; stopped at step 2 and resumed on 2 ranks at ZeRO-1, the losses continue as if
    uninterrupted; the same with hybrid sharding (--zero-shard 2) saved and resumed as plain
    ZeRO-2, and the plain checkpoint resumed hybrid:

        mpiexec -n 4 python examples/train_gpt.py --zero 3 --dtype float64 --log-json a.jsonl
        mpiexec -n 4 python examples/train_gpt.py --zero 3 --stop-at 2 --save ckpt
        mpiexec -n 2 python examples/train_gpt.py --zero 1 --resume ckpt --log-json c.jsonl
    (with the tiny model and data flags below)"""
    corpus = tmp_path / "code.py"
    corpus.write_text("".join(f"def f{i}(x):\n    return x * {i}\n\n" for i in range(300)))
    flags = ["--n-layer", "3", "--n-head", "2", "--n-embd", "16", "--block-size", "16",
             "--batch-size", "8", "--steps", "4", "--eval-every", "0", "--eval-iters", "1",
             "--sample", "0", "--dtype", "float64", "--data", str(corpus),
             "--cache-dir", str(tmp_path / "cache")]
    a, c, ckpt = tmp_path / "a.jsonl", tmp_path / "c.jsonl", str(tmp_path / "ckpt")
    out = mpi(4, "examples/train_gpt.py", *flags, "--zero", "3", "--log-json", a,
              timeout=300)
    assert "memory per rank, ZeRO stage 3" in out.stdout and "rank 3" in out.stdout
    # first-use walks 28, 29: the paper's 3(N-1)/N named beside the measured ratio; over one
    # rank "0.00 MiB sent ... (0.00 x; DDP sends 2(N-1)/N = 0.00 x)"
    assert ("x; per micro-batch, the paper's ZeRO-3 3(N-1)/N = 2.25 x less the last two "
            "blocks'") in out.stdout
    one = subprocess.run([sys.executable, "examples/train_gpt.py", *flags, "--zero", "2",
                          "--steps", "1"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert "ZeRO-2 over 1 rank: nothing sent, the one rank owns every shard" in one, one
    mpi(4, "examples/train_gpt.py", *flags, "--zero", "3", "--stop-at", "2", "--save",
        ckpt, timeout=300)
    mpi(2, "examples/train_gpt.py", *flags, "--zero", "1", "--resume", ckpt,
        "--log-json", c, timeout=300)
    rows = [json.loads(line) for line in open(a)][:-1]
    assert set(rows[-1]["mem"]) >= {"params", "grads", "optimizer", "activations", "total"}
    resumed = [json.loads(line) for line in open(c)][:-1]
    assert [r["step"] for r in resumed] == [2, 3]
    assert all(abs(r["loss"] - rows[r["step"]]["loss"]) < 1e-9 for r in resumed)
    # hybrid sharding: 2 replicas of 2 shards each, stopped at step 2, resumed at 4 ranks
    # under plain ZeRO-2; and the plain ZeRO-3 checkpoint resumed as hybrid ZeRO-3
    h, hc, hckpt = tmp_path / "h.jsonl", tmp_path / "hc.jsonl", str(tmp_path / "hckpt")
    out = mpi(4, "examples/train_gpt.py", *flags, "--zero", "3", "--zero-shard", "2",
              "--stop-at", "2", "--save", hckpt, "--log-json", h, timeout=300)
    assert "ZeRO stage 3 over 2 ranks, replicated x 2" in out.stdout
    assert "4 ranks, each replica sharded over 2: the ZeRO paper's" in out.stdout
    assert "across the shard groups" in out.stdout
    mpi(4, "examples/train_gpt.py", *flags, "--zero", "2", "--resume", hckpt, "--log-json", hc,
        timeout=300)
    back = tmp_path / "back.jsonl"
    mpi(4, "examples/train_gpt.py", *flags, "--zero", "3", "--zero-shard", "2", "--resume",
        ckpt, "--log-json", back, timeout=300)
    hybrid = [json.loads(line) for line in open(h)][:-1]
    assert [r["step"] for r in hybrid] == [0, 1]
    for run in (hybrid, [json.loads(line) for line in open(hc)][:-1],
                [json.loads(line) for line in open(back)][:-1]):
        assert all(abs(r["loss"] - rows[r["step"]]["loss"]) < 1e-9 for r in run), run


# ---- ZeRO-3 through the model's block hooks (in process, one-rank groups) -----------------

class Recorder(BlockHooks):
    """Block hooks that write down each call, in the order the model makes them."""

    def __init__(self):
        self.calls = []

    def before_root(self):
        self.calls.append("root")

    def before_block(self, i):
        self.calls.append(f"before {i}")

    def after_block(self, i, y):
        self.calls.append(f"after {i}")
        return y


@pytest.mark.parametrize("ckpt", [False, True])
def test_gpt_calls_its_block_hooks_around_each_block(ckpt):
    model = GPT(CONFIG, seed=0, dtype="float64").set_checkpointing(ckpt)
    x = batch(0, 2)[0]
    plain = float(model(x)[0].data.sum())
    hooks = Recorder()
    model.set_block_hooks(hooks)
    assert float(model(x)[0].data.sum()) == plain
    blocks = [f"{k} {i}" for i in range(CONFIG.n_layer) for k in ("before", "after")]
    assert hooks.calls == ["root"] + blocks + ["root"]               # embed, blocks, head
    assert type(model.set_block_hooks(None).block_hooks) is BlockHooks


def one_rank(name):
    from mpi4py import MPI
    from minidist.comm import ProcessGroup
    return ProcessGroup(MPI.COMM_SELF, name=name)


def zero3_models():
    """(name, model builder) for each model class ZeRO-3 wraps: GPT, the tensor-parallel GPT
    and a pipeline stage holding every block (tp and pp groups of one rank)."""
    from minidist.pp.stage import GPTStage
    from minidist.tp.model import TensorParallelGPT
    return [("gpt", lambda: GPT(CONFIG, SEED, "float64")),
            ("tp", lambda: TensorParallelGPT(CONFIG, one_rank("tp"), SEED, "float64")),
            ("pp", lambda: GPTStage(CONFIG, one_rank("pp"), range(CONFIG.n_layer), SEED,
                                    "float64"))]


@pytest.mark.parametrize("kind", ["gpt", "tp", "pp"])
@pytest.mark.parametrize("ckpt", [False, True])
def test_zero3_gathers_in_block_hooks_and_matches_the_plain_model(kind, ckpt):
    """ZeRO-3 on a one-rank group: the engine is the model's block hooks and no method of the
    model or its blocks is replaced; outside a gather the parameters are NaN placeholders;
    loss, gradient shards and samples equal the unsharded model's bit for bit (the backward
    re-gathers block 0 after block 2 took its buffer, or its gradients would be wrong)."""
    from minidist.zero.engine import zero_engine
    build = dict(zero3_models())[kind]
    ref, model = build().set_checkpointing(ckpt), build().set_checkpointing(ckpt)
    engine = zero_engine(model, one_rank("dp"), 3)
    assert model.block_hooks is engine
    for m in [model] + list(model.transformer.h):
        assert not {"forward", "embed", "head"} & set(vars(m)), type(m)
    assert all(np.isnan(p.data).all() for p in model.parameters())
    x, y = batch(0, 4)

    def loss_of(m):
        return m.stage_forward(None, x, y) if kind == "pp" else m(x, y)[1]

    want, got = loss_of(ref), loss_of(model)
    assert float(got.data) == float(want.data)
    want.backward()
    got.backward()
    engine.sync_grads()
    grads = dict(ref.named_parameters())
    for u in engine.units:
        expected = u.flat.flatten([grads[n].grad for n in u.flat.names])
        assert np.array_equal(H(u.grad_shard), H(expected)), u.flat.name
    engine.free()
    assert all(np.isnan(p.data).all() for p in model.parameters())
    assert np.array_equal(H(model.generate(x[:, :2], 3, seed=1)),
                          H(ref.generate(x[:, :2], 3, seed=1)))


def test_before_backward_gradcheck_calls_its_function_first():
    """ZeRO-3's BeforeBackward (a block's output: its backward gathers the block's
    parameters before any of the block's ops runs) is the identity, its gradient checked
    against central differences, float64, and calls its function once per backward."""
    from minidist.autograd import Tensor
    from minidist.autograd.gradcheck import gradcheck
    from minidist.zero.stage3 import BeforeBackward
    calls = []
    x = Tensor(np.random.default_rng(7).standard_normal((3, 4)), requires_grad=True)
    gradcheck(lambda t: BeforeBackward.apply(t, lambda: calls.append(1)) * t, [x],
              name="BeforeBackward")
    assert calls
    calls.clear()
    (BeforeBackward.apply(x, lambda: calls.append(1)) * 2.0).sum().backward()
    assert calls == [1]
