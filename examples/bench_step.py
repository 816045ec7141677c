"""Time one GPT training step (forward, backward, clip, AdamW) and compare the model's FLOP/s
with a large float32 matmul's in the same process and thread count.

    python examples/bench_step.py --n-layer 4 --n-head 4 --n-embd 256 --block-size 128 \\
        --batch-size 16 --threads 1

prints one JSON line: {"ms_per_step", "tokens_per_s", "model_gflops", "matmul_gflops",
"flops_ratio", "loss" (the last timed step's), ...}: medians over the --steps timed steps,
and beside them the best-of figures "ms_min" (the fastest step) and "matmul_gflops_max" (the
fastest matmul), which examples/calibrate_here.py divides. Model FLOPs: GPT.flops_per_token
(6 N + 12 L T C per token). A flag out of range is one `error:` line, exit status 2.
--amp: 16-bit compute with float32 master weights (train/amp.py), as train_gpt.py --amp;
--grad-dtype float32 (with --amp) keeps the gradients in float32, as train_gpt.py's does.
--adamw flat (default): FlatAdamW, one update per parameter group; per-param: AdamW.
--device cuda adds "kernels_per_step": the kernels one more step launches, counted by CUPTI
(minidist/kernel_count.py); null on the CPU or without libcupti. "host_reads_per_step": the
device -> host reads one more step makes through backend.host_read (minidist/train/README.md,
"The host reads of a step"): 0, or 1 under --amp.
--vocab-multiple M pads the vocabulary (wte rows, the head's matmul) to a multiple of M.
--peak-tflops P (> 0) adds "mfu": model FLOP/s over P (the GPU's dense peak for that dtype).
"dropout_step" (--dropout > 0): the step the last masks were drawn for (the keys settled).
--cuda-graph (--device cuda, --amp, MINIDIST_CUDA_NEW_KERNELS=1): after the --warmup eager
steps, one step is captured as a CUDA graph and every timed step replays it (`captured`):
the Python and launch cost of ~1,500 kernels goes, the GPU work stays. The same batch and
learning rate every step, and --amp's verdict and step count on the device, make a replay
the step an eager run would take, so its "loss" must equal the eager run's (a check of the
capture, beside the speed). With --dropout the masks' step is on the device too (a counter
each replay advances, which the Philox and flash kernels read: minidist/autograd/
dropout_keys.py, "The step on the device"), so each replay draws its own step's masks.
Not yet run on a GPU.
MoE (--moe-experts): "moe_bias", the [min, max] of the router biases after the last step; with
--moe-bias-rate each step updates them as training does (minidist/nn/moe_bias.py LoadBalance).
A 2048^3 float32 matmul is timed after every step, so both medians see the same load on a
shared machine (other processes slow both alike; the ratio is the robust figure).
"""
import json
import os
import sys
import time

import numpy as np

from minidist import backend
from minidist.kernel_count import KernelCounter
from minidist.nn import GPT, GPTConfig
from minidist.nn.moe_bias import LoadBalance
from minidist.optim import AdamW, FlatAdamW, clip_grad_norm, multi_tensor
from minidist.optim.muon import Muon
from minidist.train.amp import MixedPrecision
from minidist.train.args import add_model_args, arch_fields
from minidist.train.loop import moe_fields
from minidist.train.args import check_at_least, example_parser
from minidist.train.cli import run_main


def matmul_seconds(a):
    """Seconds for one a @ a (a square float32 matrix)."""
    t = time.perf_counter()
    a @ a
    backend.synchronize()
    return time.perf_counter() - t


def graph_refusal(args, device):
    """Why --cuda-graph cannot capture this step (one line), or None. A graph replays every
    kernel with the arguments it was captured with: a host read inside the step cannot be
    captured, and a number the host changes each step would be frozen. --amp with the new
    kernels keeps its verdict and AdamW's step count on the device, and dropout's step
    (the kernels read it there); float32 AdamW's step count (its bias correction) is a host
    number."""
    if not args.cuda_graph:
        return None
    if args.moe_experts:
        return ("--cuda-graph cannot capture a Mixture of Experts step: its routing reads the "
                "host (the rows each expert gets); drop --moe-experts or --cuda-graph")
    if device != "cuda":
        return "--cuda-graph needs --device cuda (CUDA graphs are a GPU feature)"
    if not args.amp or os.environ.get("MINIDIST_CUDA_NEW_KERNELS") != "1":
        return ("--cuda-graph needs --amp with MINIDIST_CUDA_NEW_KERNELS=1 (the step count "
                "and overflow verdict on the device); without them a graph would freeze them")
    return None


SETTLE_STEPS = 8       # at most this many eager steps more, for the addresses to settle


def captured(one_step, warmup, total):
    """one_step as a CUDA graph: `warmup` (>= 1) eager runs on a stream of its own (kernels
    compiled, the memory pool's blocks for that stream settled), then more (up to
    SETTLE_STEPS, never past `total` steps) until a step makes no new multi-tensor address
    table: the gradients are new arrays every step, and a table cannot be uploaded while
    capturing (multi_tensor._refuse_while_capturing), so the capture's gradients must land
    where an eager step's did. The last eager step is checked to read nothing back. Then
    one capture, which runs nothing. Returns (Replay, eager steps run).
    The warm-up and the capture allocate from a memory pool of their own, kept alive with
    the graph: the blocks the captured step freed (its temporaries, which every replay
    writes) are free blocks of that pool, which nothing allocates from after the capture.
    In the default pool an out-of-memory retry elsewhere (CuPy's free_all_blocks) would
    hand them back to the driver while the graph still writes them."""
    import cupy
    backend.synchronize()      # the model, masters and ids were made on the default stream,
    #                            which a non-blocking stream does not wait for
    stream = cupy.cuda.Stream(non_blocking=True)
    pool = cupy.cuda.MemoryPool()
    done, new_tables = 0, True
    with stream, cupy.cuda.using_allocator(pool.malloc):
        while done < warmup or (done < min(warmup + SETTLE_STEPS, total - 1) and new_tables):
            reads, tables = sum(backend.host_reads().values()), multi_tensor.tables_made()
            one_step()
            done += 1
            new_tables = multi_tensor.tables_made() != tables
        if sum(backend.host_reads().values()) != reads:
            raise RuntimeError(f"--cuda-graph: the step read the device (backend.host_read: "
                               f"{backend.host_reads()}); it cannot be captured")
        stream.synchronize()
        stream.begin_capture()
        try:
            loss = one_step()
        except BaseException:
            stream.end_capture()
            raise
        graph = stream.end_capture()
    return Replay(graph, stream, pool, loss), done


class Replay:
    """A captured step: replay() launches the graph on its stream, between the caller's
    stream's work before and after it, and returns the loss Tensor it rewrites. Holds the
    graph's memory pool as long as the graph can run."""

    def __init__(self, graph, stream, pool, loss):
        self.graph, self.stream, self.pool, self.loss = graph, stream, pool, loss

    def __call__(self):
        import cupy
        # self.stream is non-blocking: CUDA orders it against no other stream, the caller's
        # (often the legacy default) included. So the replay waits for the caller's queued
        # work, and the caller's next work (the loss's .item(), a counter read) for the
        # replay, through events: no host sync, and no stale loss read mid-replay.
        caller = cupy.cuda.get_current_stream()
        self.stream.wait_event(caller.record())
        self.graph.launch(self.stream)
        caller.wait_event(self.stream.record())
        return self.loss


def kernels_per_step(one_step):
    """CUDA kernels one more step launches (minidist/kernel_count.py, CUPTI); None on the CPU
    or where libcupti cannot be loaded (said on stderr)."""
    if backend.device() != "cuda":
        return None
    try:                    # CUPTI refusing to count costs the count, not the timed row
        counter = KernelCounter().start()          # (review 40: only the load was caught)
    except RuntimeError as e:
        print(f"kernels_per_step: {e}", file=sys.stderr)
        return None
    try:
        one_step()
    finally:
        counter.stop()
    return counter.count


def host_reads_per_step(one_step):
    """Device -> host reads (backend.host_read) one more step makes: 0 in float32, 1 under
    --amp (its overflow verdict; 0 on cupy with MINIDIST_CUDA_NEW_KERNELS=1, where the
    verdict is taken on the device); the count a GPU step makes, counted on the CPU too."""
    before = sum(backend.host_reads().values())
    one_step()
    return sum(backend.host_reads().values()) - before


def dropout_step(model, dropout):
    """The step dropout's masks were last drawn for, read back from the device counter
    (DropoutKeys.settle: replays advanced it alone); None without dropout. An eager run and
    its captured twin must agree (tests/gpu_speed.sh, tests/test_cuda_graph.py)."""
    if not dropout:
        return None
    model.dropout_keys.settle()
    return model.dropout_keys.step


# (flag, lowest allowed value, what it is); None (not given) is not checked
AT_LEAST = (("--steps", 1, "timed steps"), ("--warmup", 0, "untimed steps"),
            ("--batch-size", 1, "sequences per step"), ("--n-layer", 1, "transformer blocks"),
            ("--n-head", 1, "attention heads"), ("--n-embd", 1, "the embedding width"),
            ("--block-size", 1, "the context length"), ("--vocab-size", 1, "token ids"),
            ("--threads", 1, "BLAS threads"), ("--vocab-multiple", 1, "1: no padding"),
            ("--seed", 0, "the random seed"))     # (below 0: numpy's traceback)


def check_flags(p, args):
    """The flags' ranges, before any work (p.error: one `error:` line, exit status 2); the
    model's own checks (GPTConfig's) follow where the config is made."""
    check_at_least(p, args, AT_LEAST)
    if not 0 <= args.dropout < 1:
        p.error(f"--dropout {args.dropout}: a probability in [0, 1)")
    if args.peak_tflops is not None and not 0 < args.peak_tflops < float("inf"):
        p.error(f"--peak-tflops {args.peak_tflops}: the device's peak must be a positive "
                "number (leave it out for no mfu)")


def main(argv=None):
    """The benchmark on the command line `argv` (None: sys.argv's); run_main below makes a
    MemoryError one `error: out of memory` line, exit status 1."""
    p = add_model_args(example_parser(__doc__))
    p.add_argument("--vocab-size", type=int, default=256, help="the random tokens' vocabulary")
    p.add_argument("--steps", type=int, default=10, help="timed steps; the median counts")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps, first")
    p.add_argument("--threads", type=int, default=None,
                   help="BLAS threads (default: the node's cores)")
    p.add_argument("--amp", action="store_true", help="16-bit compute, float32 master")
    p.add_argument("--amp-dtype", choices=("float16", "bfloat16"), default=None,
                   help="the 16-bit type of --amp (default: bfloat16 on CuPy, float16 on numpy)")
    p.add_argument("--grad-dtype", choices=("float32",), default=None,
                   help="with --amp: float32 gradients (default: the 16-bit type)")
    p.add_argument("--adamw", choices=("flat", "per-param"), default="flat",
                   help="FlatAdamW (one update per group) or AdamW (one per parameter)")
    p.add_argument("--optimizer", choices=("adamw", "muon"), default="adamw",
                   help="muon: Muon for the blocks' matrices, its own per-parameter "
                   "AdamW for the rest (--adamw then unused)")
    p.add_argument("--vocab-multiple", type=int, default=None,
                   help="pad the vocabulary to a multiple of this (default: 64 on cuda, 1 on cpu)")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="the device's dense peak, TFLOP/s, for the mfu field (> 0)")
    p.add_argument("--cuda-graph", action="store_true",
                   help="replay one captured step (CUDA graph) after the warm-up")
    args = p.parse_args(argv)
    check_flags(p, args)
    threads, device = backend.setup(threads=args.threads, device=args.device)
    refusal = graph_refusal(args, device)
    if args.grad_dtype and not args.amp:
        refusal = (f"--grad-dtype {args.grad_dtype}: only used with --amp (add --amp, or "
                   "leave --grad-dtype out)")
    if refusal:
        print(f"error: {refusal}", file=sys.stderr)
        return 2
    try:
        config = GPTConfig(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd,
                           block_size=args.block_size, vocab_size=args.vocab_size,
                           dropout=args.dropout, attention=args.attention,
                           **arch_fields(args), attention_block=args.attention_block,
                           **moe_fields(args), vocab_multiple=args.vocab_multiple or (
                               64 if device == "cuda" else 1))
    except ValueError as e:             # n_embd not a multiple of n_head, ...: one line
        p.error(f"model flags: {e}")
    model = GPT(config, seed=args.seed, dtype=args.dtype)
    amp = MixedPrecision(dtype=args.amp_dtype, grad_dtype=args.grad_dtype) if args.amp \
        else None
    adamw = {"flat": FlatAdamW, "per-param": AdamW}[args.adamw]
    if args.optimizer == "muon":
        adamw = Muon
    if amp:
        amp.cast_model(model)
        opt = amp.optimizer(model.named_parameters(), lambda named: adamw(named, lr=1e-4))
    else:
        opt = adamw(model.named_parameters(), lr=1e-4)
    r = np.random.default_rng(args.seed)
    x = r.integers(0, args.vocab_size, (args.batch_size, args.block_size))
    y = r.integers(0, args.vocab_size, (args.batch_size, args.block_size))
    times, mm_times = [], []
    n = 2048
    a = backend.get_xp().asarray(backend.rng(0).standard_normal((n, n)), dtype="float32")
    balance = LoadBalance(model, None, args.moe_bias_rate)   # MoE: the router biases

    def one_step():
        _, loss = model(x, y)
        if amp:
            amp.backward(loss)
            opt.clip_grad_norm(1.0)           # unscales; checks for inf (one host read)
        else:
            loss.backward()
            clip_grad_norm(opt.params, 1.0)
        opt.step()
        opt.zero_grad()
        balance.after_step(1)               # --moe-bias-rate: as training updates them
        return loss

    step, first = one_step, 0
    if args.cuda_graph:        # ids on the device once: no upload inside the captured step
        x, y = backend.to_device(x), backend.to_device(y)
        step, first = captured(one_step, max(args.warmup, 1), args.warmup + args.steps)
    for i in range(first, args.warmup + args.steps):
        t = time.perf_counter()
        loss = step()
        backend.synchronize()
        step_s = time.perf_counter() - t
        mm_s = matmul_seconds(a)
        if i >= args.warmup:
            times.append(step_s)
            mm_times.append(mm_s)
    last_loss = float(loss.item())           # after the timed steps: its host read is not timed
    dt = float(np.median(times))
    tokens = args.batch_size * args.block_size
    model_gflops = model.flops_per_token(args.block_size) * tokens / dt / 1e9
    mm = 2 * n ** 3 / float(np.median(mm_times)) / 1e9
    mm_max = 2 * n ** 3 / min(mm_times) / 1e9         # the fastest matmul, beside ms_min
    extra = {"kernels_per_step": kernels_per_step(step),
             "host_reads_per_step": host_reads_per_step(step), "cuda_graph": args.cuda_graph,
             "dropout_step": dropout_step(model, args.dropout)}
    if config.moe_experts:
        table = model.router_bias.table
        extra["moe_bias"] = [float(table.min()), float(table.max())]
    if args.peak_tflops is not None:
        extra["mfu"] = round(model_gflops / 1e3 / args.peak_tflops, 3)
    print(json.dumps({**extra, "ms_per_step": round(dt * 1e3, 2),
                      "tokens_per_s": round(tokens / dt),
                      "model_gflops": round(model_gflops, 2), "matmul_gflops": round(mm, 2),
                      "matmul_gflops_max": round(mm_max, 2),
                      "flops_ratio": round(model_gflops / mm, 3), "threads": threads,
                      "device": backend.device(), "dtype": args.dtype, "amp": args.amp,
                      "amp_dtype": amp.dtype.name if amp else None,
                      "grad_dtype": args.grad_dtype, "adamw": args.adamw,
                      "optimizer": args.optimizer,
                      "vocab_padded": config.padded_vocab_size, "loss": last_loss,
                      "ms_min": round(min(times) * 1e3, 2)}))


if __name__ == "__main__":
    sys.exit(run_main(main))
