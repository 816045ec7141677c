"""DDP's gradient sync over a list of parameters and a group: the three modes (naive,
bucketed, overlapped), their buckets, hooks, no_sync and debug checks, as
minidist/ddp/ddp.py's module docstring explains them. DistributedDataParallel (ddp.py) is one
around a model's parameters; expert parallelism runs one over its experts' replicas
(minidist/ep/strategy.py), whose sum is divided by the dense group's size (`divisor`).
"""
import contextlib
import time

from minidist.autograd.tensor import is_grad_enabled
from minidist.backend import xp_of
from minidist.comm import debug
from minidist.comm.checks import ranks_by_value, ranks_text

MODES = ("naive", "bucketed", "overlapped")


def gradient_sync(params, group, mode="overlapped", bucket_mb=1.0, divisor=None):
    """DDP's gradient sync without a model: `params`' gradients summed over `group` in
    `mode`'s way (hooks, buckets, no_sync, the checks: as DistributedDataParallel's), then
    divided by `divisor` (None: the group's size, an average). Expert parallelism syncs its
    experts over their replicas with one (minidist/ep/strategy.py: divisor |D|, not |edp|).
    Broadcasts the group's rank 0's parameters."""
    check_mode(mode)
    if mode == "naive":
        return GradSync(params, group, divisor)
    cls = OverlappedGradSync if mode == "overlapped" else BucketedGradSync
    return cls(params, group, bucket_mb, divisor)


def check_mode(mode):
    if mode not in MODES:
        raise ValueError(f"DDP mode must be one of {MODES}, not {mode!r}")


BROADCAST_MB = 1.0    # start-up broadcast buckets: a ring segment (minidist/comm/ring.py)


def broadcast_parameters(params, group, root=0, bucket_mb=BROADCAST_MB):
    """Every rank's parameters = `root`'s (in place), so all ranks start from one model, in
    one broadcast per bucket of broadcast_buckets: a tensor of at least `bucket_mb` MiB
    alone, in place; the smaller ones packed into flat buckets of at most `bucket_mb`,
    broadcast, unpacked. One broadcast per tensor was 148 collectives for GPT-2 124M (each
    paying the ring's latency, and on GPUs without CUDA-aware MPI a staging copy each way);
    now 51, the 98 biases and norms in one. Memory: one bucket at a time (the root packs
    into it, the others receive into an empty one and unpack). Returns the number of
    broadcasts (tests/scripts/bcast_check.py counts them in the trace counters)."""
    params = list(params)
    buckets = broadcast_buckets(params, bucket_mb)
    at_root = group.rank == root        # the root's values fill the bucket; the others' land
    for idx in buckets:
        through_flat([params[i].data for i in idx], lambda buf: group.broadcast(buf, root),
                     fill=at_root, copy_back=not at_root)
    return len(buckets)


def broadcast_buckets(params, bucket_mb=BROADCAST_MB):
    """broadcast_parameters' buckets, indices into `params`: each tensor of at least
    bucket_mb MiB alone (the ring pipelines it in segments already: packing would only copy
    it), then the smaller ones grouped by their arrays' kind (dtype and array module: a
    flat buffer has one dtype, on one device), each kind's cut in order into runs of at
    most bucket_mb (byte_runs). The same on every rank (the same parameters in the same
    order: DDP's premise)."""
    cap, kinds = bucket_mb * 2**20, {}
    alone = [[i] for i, p in enumerate(params) if p.data.nbytes >= cap]
    for i, p in enumerate(params):
        if p.data.nbytes < cap:
            kinds.setdefault((p.data.dtype, type(p.data)), []).append(i)
    return alone + [[same[j] for j in run] for same in kinds.values()
                    for run in byte_runs([params[i].data.nbytes for i in same], cap)]


class GradSync:
    """One blocking all-reduce per parameter gradient, after backward: `params` (a list, in
    forward order) over `group`, divided by `divisor` (None: averaged)."""
    mode = "naive"

    def __init__(self, params, group, divisor=None):
        self.params, self.group, self.divisor = list(params), group, divisor
        self.op = "avg" if divisor is None else "sum"
        self.sync_enabled = True      # False inside no_sync()
        self.last_sync_s = 0.0        # time the last sync_grads() kept the caller waiting
        self.unsynced = False         # a backward outside no_sync() since the last sync
        self.forwards = 0             # forwards that build a graph since the last sync
        self.grads_done = 0           # and parameter gradients backward completed (hooks)
        self._hooks = [p.register_grad_hook(self._backward_ran) for p in self.params]
        broadcast_parameters(self.params, group)

    def _backward_ran(self, p):
        """Autograd hook: a backward reached `p`; outside no_sync() its gradients now wait
        for sync_grads()."""
        self.grads_done += 1
        if self.sync_enabled:
            self.unsynced = True

    def before_forward(self):
        """check_synced, and a forward counted for sync_grads' check (MINIDIST_DEBUG=1)."""
        self.check_synced()
        self.forwards += is_grad_enabled()

    def check_synced(self):
        """A forward after a backward whose gradients were never averaged (first-use walk
        29: a loop without sync_grads() let the replicas drift apart, silently): a
        RuntimeError naming the call that was missed."""
        if self.unsynced:
            raise RuntimeError(
                "DDP: a forward after a backward whose gradients were not averaged: call "
                "ddp.sync_grads() after the backward of each step's last micro-batch, before "
                "the optimizer's step; run the other micro-batches of a step inside `with "
                "ddp.no_sync():`")

    @contextlib.contextmanager
    def no_sync(self):
        """Micro-batches whose backward must not communicate (gradient accumulation)."""
        previous, self.sync_enabled = self.sync_enabled, False
        try:
            yield
        finally:
            self.sync_enabled = previous

    def sync_grads(self):
        """Average the gradients over the group, in place; returns when they are averaged.
        Call once per optimizer step, after the last backward."""
        start = time.perf_counter()
        if debug.enabled():
            self.check_same_forwards()
        self._sync()
        self.unsynced = False
        self.forwards = self.grads_done = 0
        self.last_sync_s = time.perf_counter() - start

    def check_same_forwards(self):
        """Debug mode (MINIDIST_DEBUG=1): every rank ran as many forwards since the last
        sync, and as many backwards (parameter gradients completed), or CollectiveMismatch on
        every rank, naming who ran how many. First-use walk 37: a rank that caught an
        exception after its forward and skipped the rest of the step (`continue`) had its
        next step's gradients averaged with the others' current ones, the same collectives
        in the same order, and the replicas drifted apart without a word; walk 43's rank
        that swallowed its backward averaged zeros in. One all_gather_object a step, only in
        debug mode."""
        both = self.group.all_gather_object((self.forwards, self.grads_done))
        counts = ranks_by_value([f for f, _ in both])
        grads = ranks_by_value([g for _, g in both])
        if len(counts) == 1 and len(grads) > 1:             # (walk 43: a swallowed backward)
            raise debug.CollectiveMismatch(
                "DDP: the ranks' backwards since the last sync_grads completed different "
                "numbers of parameter gradients (" + "; ".join(
                    f"{ranks_text(r)}: {n}" for n, r in grads.items()) + ") after as many "
                "forwards: a rank skipped a backward (an exception caught around "
                "loss.backward()?), and its zeros would be averaged in")
        if len(counts) > 1:
            raise debug.CollectiveMismatch(
                "DDP: the ranks ran different numbers of forwards since the last sync_grads ("
                + "; ".join(f"{ranks_text(r)}: {n}" for n, r in counts.items())
                + "): a rank skipped the rest of a step after its forward (an exception "
                "caught, then `continue`?), so its gradients would be averaged with another "
                "step's; skip a step on every rank alike, or not at all (or some ranks ran "
                "a forward through the wrapper outside no_grad() that no backward followed)")

    def _sync(self):
        for p in reversed(self.params):       # the order backward completed them
            if p.grad is None:                # no gradient this step: still take part
                p.grad = xp_of(p.data).zeros(p.shape, p.grad_dtype)
            self.group.all_reduce(p.grad, op=self.op)
            self.divide(p.grad)

    def divide(self, grad):
        """After the sum (op "sum"): / divisor, in place. (op "avg" divided already.)"""
        if self.divisor is not None:
            grad /= self.divisor

    def zero_grad(self, discard=False):
        """Drop the gradients (.grad = None, as the optimizer's zero_grad does). After a
        backward that was never averaged, a RuntimeError unless `discard` (the step dropped
        on purpose, on every rank alike): first-use walk 43 left sync_grads() out of the
        recipe's loop, and this call forgave it before the next forward could, every step."""
        self.check_dropped(discard)
        for p in self.params:
            p.grad = None

    def check_dropped(self, discard):
        """zero_grad's check: an unaveraged backward's gradients dropped only with `discard`."""
        if self.unsynced and not discard:
            raise RuntimeError(
                "DDP: zero_grad() after a backward whose gradients were not averaged: call "
                "ddp.sync_grads() after the backward of each step's last micro-batch, before "
                "the optimizer's step (to drop a step's gradients on purpose, on every rank "
                "alike: ddp.zero_grad(discard=True))")
        self.unsynced = False

    def grad_bytes(self):
        """Bytes of gradient every step averages: the all-reduce payload (in the gradients'
        dtype: float32 under --amp --grad-dtype float32)."""
        return sum(p.size * p.grad_dtype.itemsize for p in self.params)


def bucket_layout(params, bucket_mb):
    """Indices into `params`, last parameter first, cut into buckets of at most bucket_mb
    (MiB) of gradient: a parameter that would overflow the current bucket starts a new one,
    so only a parameter larger than bucket_mb on its own exceeds it. A change of gradient
    dtype or array module also starts a new bucket (a flat buffer has one dtype, on one
    device)."""
    return bucket_cuts([p.size * p.grad_dtype.itemsize for p in params], bucket_mb,
                       [(p.grad_dtype, type(p.data)) for p in params])


def bucket_cuts(sizes, bucket_mb, kinds=None):
    """bucket_layout's rule on gradient bytes alone: indices into `sizes` (bytes per
    parameter, forward order), last first, cut at bucket_mb MiB or where `kinds` (None: all
    alike) changes. The step-time model prices the buckets training cuts with it
    (minidist/train/moe_cost.py expert_buckets)."""
    last = len(sizes) - 1
    runs = byte_runs(sizes[::-1], bucket_mb * 2**20, kinds[::-1] if kinds else None)
    return [[last - i for i in run] for run in runs]


def byte_runs(sizes, cap, kinds=None):
    """Indices into `sizes` (bytes each), in order, cut into consecutive runs of at most
    `cap` bytes (a larger one a run of its own) and where `kinds` (None: all alike) changes:
    DDP's buckets (bucket_cuts, from the last parameter) and the pieces of the tensor
    parallel sum of replicated gradients (minidist/tp/state.py piece_cuts)."""
    kinds = kinds or [None] * len(sizes)
    runs, run, nbytes = [], [], 0
    for i, (size, kind) in enumerate(zip(sizes, kinds)):
        if run and (nbytes + size > cap or kind != kinds[run[-1]]):
            runs.append(run)
            run, nbytes = [], 0
        run.append(i)
        nbytes += size
    return runs + [run] if run else runs


def through_flat(arrays, collective, fill=True, copy_back=True):
    """`collective(buf)`, a collective that works in place, run on `arrays` (one dtype, one
    array module) as one: on the array itself where it is one contiguous array, else on a
    flat buffer holding them end to end (filled from them where `fill`, empty where the
    collective only writes it), copied back into each where `copy_back`; the buffer is
    freed on return, so a caller cutting its arrays into pieces holds one piece's copy at a
    time. The start-up broadcast's buckets (broadcast_parameters) and the tensor parallel
    sum of replicated gradients (minidist/tp/state.py sum_partial_grads)."""
    if len(arrays) == 1 and arrays[0].flags.c_contiguous:
        collective(arrays[0])
        return
    xp = xp_of(arrays[0])
    flat = xp.concatenate([a.reshape(-1) for a in arrays]) if fill else \
        xp.empty(sum(a.size for a in arrays), dtype=arrays[0].dtype)
    collective(flat)
    if copy_back:
        lo = 0
        for a in arrays:
            a[...] = flat[lo:lo + a.size].reshape(a.shape)
            lo += a.size


class Bucket:
    """One flat gradient buffer, in the parameters' grad_dtype (float32 under --amp
    --grad-dtype float32: backward's `+=` adds each 16-bit gradient into it in float32, and
    the all-reduce sums float32), and the parameters whose .grad are views into it."""

    def __init__(self, params):
        self.params = params
        xp = xp_of(params[0].data)
        self.buffer = xp.zeros(sum(p.size for p in params), dtype=params[0].grad_dtype)
        self.views, offset = [], 0
        for p in params:
            self.views.append(self.buffer[offset:offset + p.size].reshape(p.shape))
            offset += p.size
        self.ready = 0            # parameters whose gradient is complete in this backward
        self.work = None          # its all-reduce in flight (overlapped mode)
        self.attaches = 0         # attach() calls, and the gradients they copied in: each
        self.copies = 0           # copy is a step's gradient that backward did not add in place

    def __repr__(self):
        """What `p b` shows in a debugger stopped in _launch (it showed an address)."""
        state = ("not started" if self.work is None else
                 "done" if self.work.is_completed() else "in flight")
        return (f"Bucket({len(self.params)} params, {self.buffer.size:,} {self.buffer.dtype} = "
                f"{self.buffer.nbytes / 2**20:.2f} MiB, {self.ready} gradients complete, "
                f"all-reduce {state})")

    def attach(self):
        """Make every parameter's .grad its view again, keeping the value it holds. Only a
        fallback: DDP's own zero_grad() keeps the views, so backward's `+=` writes into the
        bucket; after the optimizer's zero_grad() (.grad = None) backward leaves the engine's
        own array, which is copied in here (one copy per gradient per step, counted in
        `copies`)."""
        self.attaches += 1
        for p, view in zip(self.params, self.views):
            if p.grad is view:
                continue
            if p.grad is None:
                view.fill(0)
            else:
                view[...] = p.grad
                self.copies += 1
            p.grad = view


class BucketedGradSync(GradSync):
    """Gradients live in flat buckets (reverse parameter order); one all-reduce per bucket."""
    mode = "bucketed"

    def __init__(self, params, group, bucket_mb=1.0, divisor=None):
        super().__init__(params, group, divisor)
        self.bucket_mb = bucket_mb
        self.buckets = [Bucket([self.params[i] for i in idx])
                        for idx in bucket_layout(self.params, bucket_mb)]
        self.zero_grad()

    def before_forward(self):
        super().before_forward()
        for b in self.buckets:               # before backward writes: grads into the buckets
            b.attach()

    def zero_grad(self, discard=False):
        """Zero every gradient in place, keeping them views into the buckets (the training
        step calls this instead of the optimizer's zero_grad: no copies in the next step);
        `discard` as the naive mode's."""
        self.check_dropped(discard)
        for b in self.buckets:
            b.buffer.fill(0)
            b.attach()

    def _sync(self):
        for b in self.buckets:
            b.attach()
            self.group.all_reduce(b.buffer, op=self.op)
            self.divide(b.buffer)


class OverlappedGradSync(BucketedGradSync):
    """Buckets whose all-reduce starts from the grad hook, during backward."""
    mode = "overlapped"

    def __init__(self, params, group, bucket_mb=1.0, divisor=None):
        self._next = 0                       # the next bucket to launch, in bucket order
        super().__init__(params, group, bucket_mb, divisor)
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}

    def zero_grad(self, discard=False):
        """As the bucketed mode's, after waiting for any all-reduce a backward started (a
        loop that drops a step's gradients without sync_grads(), `discard`: zeroing under a
        running all-reduce would race with its writes, and the next backward found its
        buckets still counted full). Every rank started the same ones, so the wait is safe."""
        self.check_dropped(discard)
        for b in self.buckets:
            if b.work is not None:
                b.work.wait()
            b.work, b.ready = None, 0
        self._next = 0
        super().zero_grad(discard=True)          # (checked above)

    def _backward_ran(self, p):
        """Autograd hook (the one GradSync registers): `p`'s gradient for this
        backward is complete; outside no_sync() its bucket's all-reduce may start."""
        super()._backward_ran(p)
        if not self.sync_enabled:
            return
        b = self._bucket_of[id(p)]
        if b.ready == len(b.params):
            raise RuntimeError("DDP: a second backward before sync_grads(); accumulate "
                               "gradients inside `with ddp.no_sync():`, and call "
                               "ddp.sync_grads() after each step's last backward")
        b.ready += 1
        if b.ready == len(b.params):
            self._launch_ready()

    def _launch_ready(self):
        """Start the all-reduce of every complete bucket whose predecessors have started."""
        while self._next < len(self.buckets):
            b = self.buckets[self._next]
            if b.ready < len(b.params):
                return
            self._launch(b)

    def _launch(self, b):
        b.attach()
        # off the calling thread: the group's communication thread runs it while backward
        # goes on (with the group's sync_comm, for a debugger, it runs here, now, blocking)
        b.work = self.group.all_reduce(b.buffer, op=self.op, async_op=True)
        self._next += 1

    def _sync(self):
        for b in self.buckets[self._next:]:  # not started by hooks (no_sync, unused params)
            self._launch(b)
        for b in self.buckets:
            b.work.wait()
            b.work, b.ready = None, 0
            self.divide(b.buffer)
        self._next = 0
