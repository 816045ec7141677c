"""The DataParallel strategy: DDP (minidist/ddp/ddp.py) plugged into the training loop.

    mpirun -n 4 python examples/train_gpt.py                       # dp = 4: overlapped, ring
    mpirun -n 2 python examples/train_gpt.py --grad-accum 2 --ddp bucketed --comm mpi

What it changes from SingleProcess (minidist/strategy/base.py):
    wrap                the model (the GPT, or another strategy's part of it) wrapped in DDP,
                        which broadcasts rank 0's parameters, so the ranks start identical
    local_rows          rank r's rows [r*B/N, (r+1)*B/N) of the global batch of B rows
    no_sync             DDP's: micro-batches that only accumulate (train/step.py)
    sync_grads          the DDP average (overlapped: waits for the all-reduces backward began)
    reduce_sum_sq       the local one: after the average every rank holds the same, whole
                        gradients (ZeRO's ranks hold disjoint shards and sum theirs)
    zero_grad           DDP's: the buckets zeroed in place, so every .grad stays a view into
                        its bucket and backward's `+=` writes there (no copy per step)
    global_mean         the loss averaged over the dp group (all-reduce "avg")
    save_plan / load    rank 0 writes (the model is replicated), every rank reads
Per step it also adds to `stats` (running means): compute seconds (forward + backward),
exposed communication seconds (how long sync_grads kept the step waiting) and gradient bytes
this rank sent.
Tests: tests/test_ddp.py, tests/test_ddp_exact.py, tests/test_ddp_train.py.
"""
import collections
import time

from minidist.comm import trace
from minidist.ddp.ddp import DistributedDataParallel
from minidist.strategy import saving
from minidist.strategy.base import SingleProcess, all_reduce_number, any_rank_of, dp_rows


class StepStats:
    """The last `keep` steps' rows for the end-of-run summary (a long run keeps no growing
    list), and how many steps there were."""

    def __init__(self, keep=100):
        self.rows, self.count = collections.deque(maxlen=keep), 0

    def add(self, **row):
        self.rows.append(row)
        self.count += 1

    def mean(self, key):
        """Mean over the kept rows, the first (warm-up) step left out while it is kept."""
        rows = list(self.rows)
        if self.count == len(rows) and len(rows) > 1:
            rows = rows[1:]
        return sum(r[key] for r in rows) / max(len(rows), 1)


class DataParallel(SingleProcess):
    """One-process training plus DDP's gradient average: the same model on every rank, each
    rank its rows of the batch."""

    def __init__(self, group, mode="overlapped", bucket_mb=1.0, amp=None,
                 ckpt_activations=False):
        super().__init__(amp, ckpt_activations)
        self.group, self.mode, self.bucket_mb = group, mode, bucket_mb
        self.rank, self.world_size = group.rank, group.size
        self.ddp = None
        self.stats = StepStats()        # compute_s, exposed_s, bytes_sent per step
        self._start = self._sent = None

    def wrap(self, model):
        """DDP over this strategy's group around the model (the GPT, or e.g. this rank's
        tensor-parallel part: minidist/tp/strategy.py). DDP registers a grad hook on every
        parameter: that is how backward starts the all-reduces."""
        self.ddp = DistributedDataParallel(model, self.group, self.mode, self.bucket_mb)
        return model

    def local_rows(self, *arrays):
        return dp_rows(arrays, self.rank, self.world_size)

    def no_sync(self):
        return self.ddp.no_sync()

    def start_step(self):
        self._start, self._sent = time.perf_counter(), trace.bytes_sent(self.group.name)

    def sync_grads(self, model):
        compute = time.perf_counter() - self._start
        with trace.compute("wait for gradients"):
            self.ddp.sync_grads()       # overlapped: waits for all-reduces begun in backward
        self.stats.add(compute_s=compute, exposed_s=self.ddp.last_sync_s,
                       bytes_sent=trace.bytes_sent(self.group.name) - self._sent)

    def zero_grad(self, opt):
        """DDP owns the gradients: zeroed in place, each still a view into its bucket."""
        self.ddp.zero_grad()

    def global_mean(self, value):
        return all_reduce_number(self.group, value, "avg", self.ddp.params[0].data)

    def any_rank(self, flag):
        return any_rank_of(self.group, flag)

    def job_group(self):
        return self.group

    def save_plan(self, model, optimizer, step, rng_states, extra):
        """Rank 0 writes the whole model (every replica holds the same); the others join
        the commit only (saving.Save.commit: nobody goes on before it is complete)."""
        if self.rank == 0:
            return super().save_plan(model, optimizer, step, rng_states, extra)
        return saving.SavePlan()

    def notes(self, training=True):
        """Strategy's, and under --comm hier how the group splits (or that it runs the flat
        ring, nodes holding different numbers of its ranks): said before step 1, not only in
        the end's summary (a first-use walk benchmarked "hier" and learned at the end)."""
        lines = super().notes(training)
        if self.group.algo == "hier":
            lines.append(f"DDP over {self.world_size} ranks: {self.group.algo_text()}")
        return lines

    def summary(self):
        """One line for people: the mode, bytes and exposed communication per step."""
        if not self.stats.count:
            return ""
        n, grad = self.world_size, self.ddp.grad_bytes()
        sent, exposed = self.stats.mean("bytes_sent"), self.stats.mean("exposed_s")
        compute = self.stats.mean("compute_s")
        buckets = len(getattr(self.ddp, "buckets", ())) or len(self.ddp.params)
        kind = ("per-parameter all-reduces" if self.mode == "naive"
                else "bucket" if buckets == 1 else "buckets")
        ratio = (f"the naive algorithm's root sends {n - 1}x, the others 1x"
                 if self.group.algo == "naive" else f"2(N-1)/N = {2 * (n - 1) / n:.2f}")
        mode = self.mode + (" (in sequence: --sync-comm)" if self.group.sync_comm else "")
        return (f"DDP {mode} over {n} ranks ({self.group.algo_text()}, {buckets} {kind}): "
                f"{sent / 2**20:.2f} MiB sent by rank {self.rank} per step for "
                f"{grad / 2**20:.2f} MiB of gradients ({ratio}); waiting for communication "
                f"{exposed * 1e3:.1f} ms per step after {compute * 1e3:.1f} ms of compute")

    def finish(self, args, log):
        """End of training: print the summary; write the Chrome trace if --trace."""
        log.print0(self.summary())
        if args.trace:
            trace.write_chrome_trace(args.trace, self.group)
            log.print0(f"trace of every collective written to {args.trace} "
                       "(open it in https://ui.perfetto.dev or chrome://tracing)"
                       + trace.kept_note())
