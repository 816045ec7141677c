"""One optimizer step, the same for every strategy, in one screen.

    this rank's rows of the global batch (and their numbers in it: dropout's keys)
    -> --grad-accum micro-batches: forward + backward each (a pipeline: its 1F1B/GPipe schedule)
       under no_sync() but the last, so data parallelism communicates once per step
    -> gradient sync (DDP all-reduce, ZeRO reduce-scatter, the pipeline's tied embedding,
       sequence parallelism's replicated gradients summed over tp in one all-reduce)
    -> clip by the global gradient norm -> optimizer step -> after_step (ZeRO: all-gather)
    -> zero the gradients -> loss averaged over the replicas

What differs between strategies is which object `strategy` is (composed in plain sight by
minidist/train/strategy.py make_strategy: TP, PP, CP, EP, then DDP/ZeRO; the methods:
minidist/strategy/base.py).
Tests: tests/test_train.py, and every exactness script in tests/scripts/ (they all train
through this function).
"""
import contextlib

import numpy as np

from minidist.strategy import memory


def train_step(strategy, model, opt, x, y, args):
    """One step on the GLOBAL batch (x, y). Returns (loss averaged over the replicas, gradient
    norm before clipping, memory ledger or None). The ledger is measured when --log-json asks.
    Loss and norm are 0-d float64 arrays on the device (numpy scalars on the CPU): nothing
    here reads the device (but --amp's overflow verdict and MoE's routing, each one counted
    backend.host_read); the loop reads them at the steps that log (minidist/train/progress.py,
    tests/test_no_sync.py)."""
    measure = bool(args.log_json) or strategy.reports_memory     # ZeRO's end-of-run table
    # rows r*B/dp .. (r+1)*B/dp of the batch, and their numbers in it (dropout's keys)
    x, y, ids = strategy.local_rows(x, y, np.arange(len(x)))
    n = args.grad_accum
    rows = len(x) // n
    if rows * n != len(x) or not rows:   # (train_gpt.py refuses it first; a script may not)
        raise ValueError(f"train_step: this rank's {len(x)} rows of the batch do not split "
                         f"into grad_accum {n} equal micro-batches (rows {rows * n} to "
                         f"{len(x) - 1} would be dropped); give a batch of a multiple of "
                         f"{n} rows per replica")
    strategy.start_step()                              # counters for the end-of-run summary
    model.dropout_keys.next_step()                     # this step's masks
    loss_sum, act = 0.0, 0
    for i in range(n):
        xb, yb = x[i * rows:(i + 1) * rows], y[i * rows:(i + 1) * rows]
        # Every micro-batch but the last only accumulates gradients locally. DDP: the last
        # one's backward fires the grad hooks that start the bucket all-reduces (overlapped
        # mode: on the group's communication thread, while backward goes on here).
        with strategy.no_sync() if i < n - 1 else contextlib.nullcontext(), \
                model.dropout_keys.rows_of(ids[i * rows:(i + 1) * rows]):
            # forward, then backward of loss / n (x the loss scale under float16 --amp);
            # a pipeline runs --micro-batches of these rows through its schedule here
            loss, held = strategy.forward_backward(model, xb, yb, 1.0 / n, measure)
        loss_sum = loss_sum + loss                     # on the device: no host sync here
        act = max(act, held)
    strategy.sync_grads(model)      # wait for / run the gradient communication of this step
    norm = opt.clip_grad_norm(args.grad_clip, strategy.reduce_sum_sq)   # unscaled (amp)
    opt.step()
    strategy.after_step()           # ZeRO: all-gather the updated parameter shards
    mem = memory.ledger(model.parameters(), opt, act) if measure else None
    strategy.zero_grad(opt)         # DDP: zeroes its buckets, so .grad stay views into them
    strategy.end_step(act)
    return strategy.global_mean(loss_sum / n), norm, mem
