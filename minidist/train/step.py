"""One optimizer step, the same for every strategy, in one screen.

    this rank's rows of the global batch
    -> --grad-accum micro-batches: forward + backward each (a pipeline: its 1F1B/GPipe schedule)
       under no_sync() but the last, so data parallelism communicates once per step
    -> gradient sync (DDP all-reduce, ZeRO reduce-scatter, the pipeline's tied embedding)
    -> clip by the global gradient norm -> optimizer step -> loss averaged over the replicas

What differs between strategies is which object `strategy` is (built in plain sight by
minidist/train/strategy.py make_strategy: TP, then PP, then DDP/ZeRO) and the few calls below.
Tests: tests/test_train.py, and every exactness script in tests/scripts/ (they all train
through this function).
"""
import contextlib

from minidist.comm import trace
from minidist.pp.strategy import PipelineParallel, pipeline_forward_backward
from minidist.train import memory


def train_step(strategy, model, opt, x, y, args):
    """One step on the GLOBAL batch (x, y). Returns (loss averaged over the replicas, gradient
    norm before clipping, memory ledger or None). The ledger is measured when --log-json asks.
    Loss and norm are 0-d float64 arrays on the device (numpy scalars on the CPU): nothing
    here waits for the GPU; the caller converts them when it logs (tests/test_no_sync.py)."""
    measure = bool(args.log_json) or strategy.reports_memory     # ZeRO's end-of-run table
    x, y = strategy.local_rows(x, y)                   # rows r*B/dp .. (r+1)*B/dp of the batch
    n = args.grad_accum
    rows = len(x) // n
    strategy.start_step()                              # counters for the end-of-run summary
    pipeline = isinstance(strategy, PipelineParallel)      # --pp > 1
    loss_sum, act = 0.0, 0
    for i in range(n):
        xb, yb = x[i * rows:(i + 1) * rows], y[i * rows:(i + 1) * rows]
        # Every micro-batch but the last only accumulates gradients locally. DDP: the last
        # one's backward fires the grad hooks that start the bucket all-reduces (overlapped
        # mode: on the group's communication thread, while backward goes on here).
        with strategy.no_sync() if i < n - 1 else contextlib.nullcontext():
            if pipeline:       # forward and backward of --micro-batches interleaved by stage
                loss, held = pipeline_forward_backward(strategy, model, xb, yb, 1.0 / n,
                                                       measure)
            else:
                with trace.compute("forward"):
                    _, loss = model(xb, yb)
                held = memory.activation_bytes(loss, model.parameters()) if measure else 0
                with trace.compute("backward"):
                    strategy.backward(loss, 1.0 / n)   # x the loss scale under float16 --amp
        # the loss stays on the device (float64, as a Python float was): no host sync here
        loss_sum = loss_sum + (loss if pipeline else loss.data.astype("float64"))
        act = max(act, held)
    strategy.sync_grads(model)      # wait for / run the gradient communication of this step
    norm = opt.clip_grad_norm(args.grad_clip, strategy.sum_sq_across_ranks)  # unscaled (amp)
    opt.step()
    mem = memory.ledger(model.parameters(), opt, act) if measure else None
    opt.zero_grad()
    strategy.end_step(act)
    return strategy.global_mean(loss_sum / n), norm, mem
