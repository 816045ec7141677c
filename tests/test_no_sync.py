"""No device-to-host read inside a training step but the counted, documented ones (issue 21's
"no host syncs", proven on the CPU; the reads that remain: minidist/train/README.md).

On a GPU every device -> host read (float(loss), .item(), bool(array), cupy's .get(), ...)
makes the CPU wait until the GPU has drained its queue, and rules out capturing the step as a
CUDA graph. The step makes each deliberate read through `backend.host_read(a, why)`, which
counts it per reason, on numpy too. So, with no GPU and no stand-in objects:

1. the counts: train_step on numpy, step after step, reads nothing in the common
   configurations, once under --amp (the overflow verdict), once per MoE layer and
   micro-batch (the routing); a whole run (examples/train_gpt.py on 1 process and under
   mpiexec: DDP, ZeRO-3, TP, PP) reads the loss and norm only at the steps that log,
   evaluate or end, and once per evaluation;
2. the code: a scan of the step's modules' syntax trees finds `.item()`, `.tolist()`,
   `.get()`, `to_host(`, `float(` / `int(` / `bool(` of anything but a literal, a flag or a
   host_read, and math.isfinite / isnan / isinf, and compares what it finds with ALLOWED, each
   entry with its reason: a new one fails until it is justified here (or removed), a stale
   entry fails until it is deleted.
The scan cannot see an implicit conversion (`if array:`, f"{array}", math.sqrt(array)): the
GPU session's count of device-to-host copies (nsys / CUPTI, examples/GPU_NOTES.md) is the
check of those. Run: python -m pytest -q tests/test_no_sync.py
"""
import ast
import pathlib
import re

import numpy as np
import pytest

from minidist import backend
from minidist.nn import GPTConfig
from minidist.optim import clip
from minidist.train import step as step_module
from minidist.train.args import train_parser
from minidist.train.loop import train
from minidist.train.strategy import make_strategy

ROOT = pathlib.Path(__file__).resolve().parent.parent

# ---- 1. the reads, counted --------------------------------------------------------------

SMALL = ["--n-layer", "2", "--n-head", "2", "--n-embd", "16", "--block-size", "8",
         "--batch-size", "4", "--device", "cpu"]


def _run_steps(n, *flags):
    """n train_steps of a small model on one process; returns (each step's host reads,
    the last step's (loss, norm, mem))."""
    args = train_parser().parse_args([*SMALL, *flags])
    strategy = make_strategy(args)
    config = GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=8, vocab_size=13,
                       moe_experts=args.moe_experts, moe_top_k=args.moe_top_k)
    model = strategy.build_model(config, seed=0, dtype=args.dtype)
    opt = strategy.build_optimizer(model, args)
    reads, out = [], None
    for i in range(n):
        x = np.random.default_rng(i).integers(0, 13, (4, 8))
        before = backend.host_reads()
        out = step_module.train_step(strategy, model, opt, x, np.roll(x, -1, 1), args)
        after = backend.host_reads()
        reads.append({k: v - before.get(k, 0) for k, v in after.items()
                      if v != before.get(k, 0)})
    return reads, out


@pytest.mark.parametrize("flags", [[], ["--grad-accum", "2"], ["--grad-clip", "0"],
                                   ["--grad-clip", "1e-3", "--dtype", "float64"],
                                   ["--ckpt-activations"], ["--log-json", "unused.jsonl"]])
def test_a_step_reads_nothing_from_the_device(flags):
    """The common configurations: clip factor, loss, norm all stay on the device."""
    reads, _ = _run_steps(3, *flags)
    assert reads == [{}, {}, {}]


@pytest.mark.parametrize("flags", [["--amp"], ["--amp", "--grad-accum", "2"],
                                   ["--amp", "--grad-clip", "0"]])
def test_an_amp_step_reads_its_overflow_verdict_once(flags):
    """--amp: skip or step is a Python decision (AdamW's step counts, the loss scale)."""
    reads, _ = _run_steps(3, *flags)
    assert reads == [{"amp overflow verdict": 1}] * 3


@pytest.mark.parametrize("accum", [1, 2])
def test_an_moe_step_reads_its_routing_once_per_layer_and_micro_batch(accum):
    reads, _ = _run_steps(2, "--moe-experts", "4", "--moe-top-k", "2",
                          "--grad-accum", str(accum))
    assert reads == [{"moe routing": 2 * accum}] * 2          # 2 MoE layers


def _run_flags(corpus, tmp_path, steps, *flags):
    return ["--n-layer", "2", "--n-head", "2", "--n-embd", "16", "--block-size", "16",
            "--batch-size", "4", "--eval-iters", "2", "--sample", "0", "--data", corpus,
            "--cache-dir", str(tmp_path / "cache"), "--steps", str(steps), *flags]


@pytest.mark.parametrize("flags, reads", [
    # reads at steps 0 (the first), 2 and 5 (--log-every 3), 6 (the last); 1 evaluation
    (["--log-every", "3", "--eval-every", "0"], {"loss and norm": 4, "eval loss": 1}),
    # and at 1, 3 (evaluations at 1, 3, 5, 6)
    (["--log-every", "3", "--eval-every", "2"], {"loss and norm": 6, "eval loss": 4}),
    # --log-json: a row per step, so a read per step
    (["--log-every", "3", "--eval-every", "0", "--log-json", "LOG"],
     {"loss and norm": 7, "eval loss": 1}),
    (["--log-every", "3", "--eval-every", "0", "--amp"],
     {"loss and norm": 4, "eval loss": 1, "amp overflow verdict": 7}),
])
def test_a_run_reads_only_where_it_logs_evaluates_or_ends(corpus, tmp_path, flags, reads):
    flags = [str(tmp_path / "log.jsonl") if f == "LOG" else f for f in flags]
    args = train_parser().parse_args(_run_flags(corpus, tmp_path, 7, "--device", "cpu",
                                                *flags))
    assert train(args)["host_reads"] == reads


READS_LINE = re.compile(r"device -> host reads on rank 0 \(backend.host_read\): (.*)")


@pytest.mark.parametrize("ranks, flags", [(2, []), (2, ["--zero", "3"]), (2, ["--tp", "2"]),
                                          (2, ["--pp", "2"])],
                         ids=["ddp", "zero3", "tp", "pp"])
def test_a_distributed_run_reads_only_where_it_logs(mpi, corpus, tmp_path, ranks, flags):
    """mpiexec -n 2 python examples/train_gpt.py --steps 7 --log-every 3 --eval-every 0
    --n-layer 2 --n-head 2 --n-embd 16 --block-size 16 --batch-size 4 --eval-iters 2
    --sample 0 [--zero 3 | --tp 2 | --pp 2]: rank 0's last lines count its reads. The
    stop flag every step is an all-reduce of host memory, not a read."""
    out = mpi(ranks, "examples/train_gpt.py", *_run_flags(corpus, tmp_path, 7, "--log-every",
                                                          "3", "--eval-every", "0", *flags))
    assert READS_LINE.findall(out.stdout) == ["loss and norm 4, eval loss 1"]


def test_train_step_returns_device_values_not_python_floats():
    for flags in ([], ["--grad-accum", "2", "--grad-clip", "1e-3"]):
        loss, norm, _ = _run_steps(1, "--dtype", "float64", *flags)[1]
        for value in (loss, norm):
            assert type(value) is not float                      # not pulled to the host
            assert isinstance(value, (np.ndarray, np.generic)) and np.ndim(value) == 0
            assert value.dtype == np.float64 and np.isfinite(value)


def test_clip_is_an_array_multiply_exact_when_not_clipping():
    r = np.random.default_rng(1)
    grads = [r.standard_normal((3, 4)).astype(np.float32), r.standard_normal(5)]
    before = [g.copy() for g in grads]
    norm = clip.clip_grad_norm(grads, max_norm=1e3)
    assert type(norm) is not float and np.ndim(norm) == 0
    assert all(np.array_equal(a, b) for a, b in zip(grads, before))    # x 1.0: bitwise
    norm = clip.clip_grad_norm(grads, max_norm=0.5)
    scale = 0.5 / (float(norm) + 1e-6)
    np.testing.assert_array_equal(grads[0], before[0] * np.float32(scale))
    np.testing.assert_array_equal(grads[1], before[1] * scale)


def test_host_read_counts_per_reason_and_returns_a_host_array():
    before = backend.host_reads().get("a test's reason", 0)
    out = backend.host_read(np.float64(2.5), "a test's reason")
    assert isinstance(out, np.ndarray) and float(out) == 2.5
    assert backend.host_reads()["a test's reason"] == before + 1


# ---- 2. the code, scanned ---------------------------------------------------------------

STEP_MODULES = [
    "train/step.py", "train/loop.py", "train/progress.py", "train/amp.py",
    "train/master_weights.py",
    "train/loss_scale.py", "optim/adamw.py",
    "optim/flat_adamw.py", "optim/clip.py", "optim/optimizer.py", "optim/schedule.py",
    "optim/sgd.py", "strategy/base.py", "ddp/ddp.py", "ddp/sync.py", "ddp/strategy.py",
    "zero/zero.py", "zero/stage3.py", "zero/engine.py", "zero/flat.py", "zero/optim.py",
    "zero/strategy.py",
    "tp/layers.py", "tp/region.py",
    "tp/collectives.py", "tp/gathered.py",
    "tp/strategy.py", "tp/state.py", "tp/model.py", "pp/microbatches.py", "pp/schedule.py",
    "pp/stage.py", "pp/strategy.py", "pp/link.py", "cp/context.py", "cp/ring.py",
    "cp/strategy.py", "ep/exchange.py", "ep/optim.py", "ep/strategy.py", "nn/gpt.py",
    "nn/block.py", "nn/layers.py", "nn/moe.py", "nn/moe_bias.py", "nn/module.py",
    "autograd/ops.py",
    "autograd/fused.py", "autograd/attention.py", "autograd/tensor.py", "autograd/function.py",
    "autograd/indexing.py", "autograd/recompute.py", "autograd/flash.py",
    "autograd/cuda_kernels.py", "autograd/cuda_kernels_new.py", "autograd/fusions.py"]
# (not scanned: minidist/comm/, whose MPI path copies a device buffer to the host by design
# (staging.py; CUDA-aware MPI or --comm nccl avoid it), and checkpoint, planner, sampling
# modules, which run outside the step)

OUTSIDE_THE_STEP = "runs outside a training step (setup, checkpoints, sampling)"
HOST_VALUE = "a host value already (a Python number, or numpy made on the host)"
ALLOWED = {
    # whole functions that never run inside a step
    "train/loss_scale.py:LossScaler.__init__": OUTSIDE_THE_STEP,
    "train/loss_scale.py:LossScaler.load_state_dict": OUTSIDE_THE_STEP,
    "train/amp.py:bfloat16_problem": OUTSIDE_THE_STEP + ": probes bfloat16 once, at setup "
                                      "(and for the --amp log line)",
    "train/master_weights.py:MasterWeightOptimizer.__init__": OUTSIDE_THE_STEP,
    "train/master_weights.py:MasterWeightOptimizer.state_dict": OUTSIDE_THE_STEP,
    "optim/optimizer.py:Optimizer.state_dict": OUTSIDE_THE_STEP,
    "optim/optimizer.py:Optimizer.load_state_dict": OUTSIDE_THE_STEP,
    "optim/optimizer.py:wants_decay": OUTSIDE_THE_STEP + ": parameter groups, at setup",
    "strategy/base.py:SingleProcess.__init__": OUTSIDE_THE_STEP,
    "strategy/base.py:SingleProcess.whole_state": OUTSIDE_THE_STEP,
    "zero/zero.py:ZeroStage1.full_state_dict": OUTSIDE_THE_STEP,
    "zero/flat.py:FlatUnit.__init__": OUTSIDE_THE_STEP,
    "tp/region.py:TensorParallelRegion.__init__": OUTSIDE_THE_STEP,
    "tp/strategy.py:TensorParallel.__init__": OUTSIDE_THE_STEP,
    "tp/model.py:TensorParallelGPT.parameter_counts": OUTSIDE_THE_STEP,
    "tp/model.py:TensorParallelGPT.full_state_dict": OUTSIDE_THE_STEP,
    "tp/model.py:TensorParallelGPT.local_state": OUTSIDE_THE_STEP,
    "pp/stage.py:PipelineStage._pipe_forward": OUTSIDE_THE_STEP + ": evaluation, sampling",
    "pp/stage.py:PipelineStage.next_token": OUTSIDE_THE_STEP,
    "nn/gpt.py:GPT.set_checkpointing": OUTSIDE_THE_STEP,
    "nn/gpt.py:GPT.last_logits": OUTSIDE_THE_STEP,
    "nn/moe.py:moe_layers": OUTSIDE_THE_STEP + ": parses module names",
    "autograd/tensor.py:Tensor.__init__": HOST_VALUE + ": the requires_grad flag",
    "autograd/tensor.py:Tensor.item": "the user's explicit read; nothing in the step calls it",
    "autograd/tensor.py:Tensor.numpy": "the user's explicit read; nothing in the step calls it",
    # single calls inside the step, on host values
    "nn/moe_bias.py:RouterBias.state_dict": OUTSIDE_THE_STEP + ": checkpoints",
    "nn/moe_bias.py:RouterBias.load_state_dict": OUTSIDE_THE_STEP + ": checkpoints",
    "nn/moe_bias.py:LoadBalance.report": HOST_VALUE + ": the host table of router biases and "
                                         "the summed loads, at evaluations",
    "nn/moe_bias.py:imbalance": HOST_VALUE + ": the summed loads, at evaluations",
    "nn/moe_bias.py:global_load_stats: counts[:, :E].tolist()": HOST_VALUE + " (--log-json)",
    "nn/moe_bias.py:global_load_stats: counts[:, E].tolist()": HOST_VALUE + " (--log-json)",
    "nn/moe_bias.py:global_load_stats: (total[:, E + 1] / held[:, 0]).tolist()":
        HOST_VALUE + " (--log-json)",
    "train/progress.py:StepValues.__init__: int(capacity)": HOST_VALUE + ": --log-every",
    "train/progress.py:StepValues.due: bool(wanted)": HOST_VALUE + ": flags and step numbers",
    "train/progress.py:StepValues.read: float(loss)": HOST_VALUE + ": a row of the host_read",
    "train/progress.py:StepValues.read: float(norm)": HOST_VALUE + ": a row of the host_read",
    "train/progress.py:first_not_finite: math.isfinite(loss)": HOST_VALUE + ": read's rows",
    "train/progress.py:first_not_finite: math.isfinite(norm)": HOST_VALUE + ": read's rows",
    "train/progress.py:clock: int(round(seconds))": HOST_VALUE + ": a time in seconds",
    "train/progress.py:_finite: math.isfinite(value)": HOST_VALUE + ": a --log-json row's",
    "train/progress.py:drop_rows_from": OUTSIDE_THE_STEP + ": the log's lines, at a resume",
    "train/loss_scale.py:LossScaler.verdict: math.isfinite(norm)":
        HOST_VALUE + ": the norm from the verdict's one host_read",
    "train/master_weights.py:MasterWeightOptimizer.clip_grad_norm: bool(grads)": "a Python list",
    "train/amp.py:MixedPrecision.verdict_on_device: bool(grads)": "a Python list",
    "train/loss_scale.py:LossScaler.settle: float(state[0])":
        HOST_VALUE + ": settle's one host_read (at the steps the loop reads losses)",
    "train/loss_scale.py:LossScaler.settle: int(x)":
        HOST_VALUE + ": settle's one host_read (at the steps the loop reads losses)",
    "optim/sgd.py:SGD.update: bool(first)": HOST_VALUE + ": a Python flag",
    "strategy/base.py:any_rank_of: float(flag)": HOST_VALUE + ": a Python flag",
    "strategy/base.py:any_rank_of: bool(buf[0])": HOST_VALUE + ": a numpy buffer (MPI)",
    "strategy/base.py:SingleProcess.any_rank: bool(flag)": HOST_VALUE + ": a Python flag",
    "ep/exchange.py:_exchange: int(sum(recv_rows))": HOST_VALUE + ": counts of the routing",
    "ep/exchange.py:_exchange: int(n)": HOST_VALUE + ": counts of the routing",
    "ep/exchange.py:ExpertExchange.run: int(send.sum() - send[r].sum())":
        HOST_VALUE + ": counts of the routing",
    "ep/exchange.py:ExpertExchange.run: int(recv.sum() - recv[r].sum())":
        HOST_VALUE + ": counts of the routing",
    "nn/moe.py:Routing.dropped: int(self.assigned - self.counts.sum())":
        HOST_VALUE + ": the routing is computed on the host (one host_read of the probs)",
    "nn/moe.py:MoE.run_experts: int(n)": HOST_VALUE + ": counts of the routing",
    "nn/moe.py:load_stats: kept.tolist()": HOST_VALUE + ": counts of the routing",
    "autograd/cuda_kernels.py:_threads: int(n)": HOST_VALUE + ": a size",
}
CALLS = {"item", "tolist", "get", "asnumpy", "to_host"}
CASTS = {"float", "int", "bool"}
CHECKS = {"isfinite", "isnan", "isinf"}


def _is_host(arg):
    """A literal, a command-line flag (args.x), len(...), or a host_read(...)'s result."""
    if isinstance(arg, ast.Constant):
        return True
    if isinstance(arg, ast.Attribute) and isinstance(arg.value, ast.Name):
        return arg.value.id == "args"
    if isinstance(arg, ast.Call):
        name = getattr(arg.func, "attr", getattr(arg.func, "id", None))
        return name in ("len", "host_read")
    return False


def _reads(node):
    """Whether a Call node may read a device value to the host."""
    f = node.func
    if isinstance(f, ast.Attribute):
        if f.attr in CALLS and not (f.attr == "get" and node.args):     # not dict.get(key)
            return True
        return (isinstance(f.value, ast.Name) and f.value.id == "math" and f.attr in CHECKS
                and not all(_is_host(a) for a in node.args))
    return isinstance(f, ast.Name) and (f.id == "to_host" or (
        f.id in CASTS and bool(node.args) and not _is_host(node.args[0])))


def _found(module):
    """{"module:Qual.name: call" or "module:Qual.name" (a whole function ALLOWED)}."""
    found, scope = set(), []

    class Visitor(ast.NodeVisitor):
        def visit_scope(self, node):
            scope.append(node.name)
            self.generic_visit(node)
            scope.pop()
        visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = visit_scope

        def visit_Call(self, node):
            if _reads(node):
                where = f"{module}:{'.'.join(scope)}"
                found.add(where if where in ALLOWED else f"{where}: {ast.unparse(node)}")
            self.generic_visit(node)

    Visitor().visit(ast.parse((ROOT / "minidist" / module).read_text()))
    return found


def test_the_step_reads_the_device_only_through_host_read_or_as_allowed():
    found = set().union(*map(_found, STEP_MODULES))
    new = sorted(found - set(ALLOWED))
    assert not new, "device -> host reads in the step's code (use backend.host_read, or " \
                    "justify them in ALLOWED):\n" + "\n".join(new)
    stale = sorted(set(ALLOWED) - found)
    assert not stale, "ALLOWED entries the code no longer has:\n" + "\n".join(stale)


def test_the_scan_finds_what_it_looks_for():
    """The scanner itself, on a made-up module's source."""
    tree = ast.parse("float(loss)\nint(args.steps)\nx.item()\nd.get('k')\nq.get()\n"
                     "float(backend.host_read(a, 'why'))\nmath.isfinite(norm)\nlen(a)\n")
    hits = [ast.unparse(n) for n in ast.walk(tree) if isinstance(n, ast.Call) and _reads(n)]
    assert sorted(hits) == sorted(["float(loss)", "x.item()", "q.get()",
                                   "math.isfinite(norm)"])
