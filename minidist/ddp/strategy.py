"""The DataParallel strategy: DDP (minidist/ddp/ddp.py) plugged into the training loop.

    mpirun -n 4 python examples/train_gpt.py                       # dp = 4: overlapped, ring
    mpirun -n 2 python examples/train_gpt.py --grad-accum 2 --ddp bucketed --comm mpi

What it changes from SingleProcess (minidist/train/strategy.py):
    build_model         the same GPT on every rank, wrapped in DDP (which broadcasts rank 0's
                        parameters, so the ranks start identical whatever they built)
    local_rows          rank r's rows [r*B/N, (r+1)*B/N) of the global batch of B rows
    forward_backward    through the wrapper; every micro-batch but the last under no_sync()
    sync_grads          the DDP average (overlapped: waits for the all-reduces backward began)
    sum_sq_across_ranks None: after the average every rank holds the same, whole gradients, so
                        its local norm is the global one. (ZeRO, whose ranks hold disjoint
                        shards, passes a sum over ranks instead; replicas must not be summed.)
    global_mean         the loss averaged over the dp group (all-reduce "avg")
    comm_bytes          the trace counters: bytes this rank sent since the run began
    save / load         rank 0 writes (the model is replicated), every rank reads
Per step it also keeps `stats`: compute seconds (forward + backward), exposed communication
seconds (how long sync_grads kept the step waiting) and gradient bytes this rank sent.
Tests: tests/test_ddp.py.
"""
import contextlib
import time

from minidist.backend import xp_of
from minidist.comm import trace
from minidist.ddp.ddp import DistributedDataParallel
from minidist.train import memory
from minidist.train.strategy import SingleProcess


@contextlib.contextmanager
def traced(name):
    """Record the enclosed computation as an event on the trace's "compute" row."""
    start = trace.now()
    yield
    if trace.enabled():
        trace.record(dict(seq=0, op=name, algo="compute", group="compute", dtype="", bytes=0,
                          issued=start, start=start, end=trace.now()))


class DataParallel(SingleProcess):

    def __init__(self, group, mode="overlapped", bucket_mb=1.0):
        self.group, self.mode, self.bucket_mb = group, mode, bucket_mb
        self.rank, self.world_size = group.rank, group.size
        self.ddp = None
        self.stats = []                 # one dict per step: compute_s, exposed_s, bytes_sent

    def build_model(self, config, seed, dtype):
        return self.wrap(super().build_model(config, seed, dtype))

    def wrap(self, model):
        """DDP over this strategy's group around a model built elsewhere (e.g. this rank's
        tensor-parallel part: minidist/tp/strategy.py)."""
        self.ddp = DistributedDataParallel(model, self.group, self.mode, self.bucket_mb)
        return model

    def local_rows(self, x, y):
        n, r = len(x) // self.world_size, self.rank
        if n * self.world_size != len(x):
            raise ValueError(f"a global batch of {len(x)} rows does not split into "
                             f"{self.world_size} equal shards (--batch-size, --dp)")
        return x[r * n:(r + 1) * n], y[r * n:(r + 1) * n]

    def forward_backward(self, model, x, y, n_accum=1, measure=False):
        """SingleProcess's micro-batch loop through the DDP wrapper: no communication until
        the last micro-batch's backward."""
        if len(x) % n_accum:
            raise ValueError(f"{len(x)} rows do not split into {n_accum} equal micro-batches")
        start, self._sent = time.perf_counter(), trace.bytes_sent(self.group.name)
        rows, total, act = len(x) // n_accum, 0.0, 0
        for i in range(n_accum):
            last = i == n_accum - 1
            with contextlib.nullcontext() if last else self.ddp.no_sync():
                with traced("forward"):
                    _, loss = self.ddp(x[i * rows:(i + 1) * rows], y[i * rows:(i + 1) * rows])
                if measure:
                    act = max(act, memory.activation_bytes(loss, model.parameters()))
                total += float(loss.item())
                with traced("backward"):
                    self.backward(loss, n_accum)     # / n_accum, x the loss scale (amp)
        self.stats.append({"compute_s": time.perf_counter() - start})
        return total / n_accum, act

    def sync_grads(self, model):
        with traced("wait for gradients"):
            self.ddp.sync_grads()
        self.stats[-1].update(exposed_s=self.ddp.last_sync_s,
                              bytes_sent=trace.bytes_sent(self.group.name) - self._sent)

    sum_sq_across_ranks = None

    def global_mean(self, value):
        buf = xp_of(self.ddp.params[0].data).asarray([value], dtype="float64")
        self.group.all_reduce(buf, op="avg")
        return float(buf[0])

    def comm_bytes(self):
        return trace.bytes_sent()

    def save(self, directory, model, optimizer, step, rng_states, extra):
        if self.rank == 0:
            super().save(directory, model, optimizer, step, rng_states, extra)
        self.group.barrier()            # nobody reads it before it is complete

    def summary(self):
        """One line for people: the mode, bytes and exposed communication per step."""
        rows = self.stats[1:] or self.stats           # the first step warms up
        if not rows:
            return ""
        n, grad = self.world_size, self.ddp.grad_bytes()
        sent = sum(r["bytes_sent"] for r in rows) / len(rows)
        exposed = sum(r["exposed_s"] for r in rows) / len(rows)
        compute = sum(r["compute_s"] for r in rows) / len(rows)
        buckets = len(getattr(self.ddp, "buckets", ())) or len(self.ddp.params)
        kind = "buckets" if self.mode != "naive" else "per-parameter all-reduces"
        ratio = (f"the naive algorithm's root sends {n - 1}x, the others 1x"
                 if self.group.algo == "naive" else f"2(N-1)/N = {2 * (n - 1) / n:.2f}")
        return (f"DDP {self.mode} over {n} ranks ({self.group.algo}, {buckets} {kind}): "
                f"{sent / 2**20:.2f} MiB sent by rank {self.rank} per step for "
                f"{grad / 2**20:.2f} MiB of gradients ({ratio}); waiting for communication "
                f"{exposed * 1e3:.1f} ms per step after {compute * 1e3:.1f} ms of compute")

    def finish(self, args, log):
        """End of training: print the summary; write the Chrome trace if --trace."""
        log.print0(self.summary())
        if args.trace:
            trace.write_chrome_trace(args.trace, self.group)
            log.print0(f"trace of every collective written to {args.trace} "
                       "(open it in https://ui.perfetto.dev or chrome://tracing)")
