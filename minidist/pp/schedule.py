"""Pipeline parallelism: the GPT's blocks cut into `pp` stages, one per rank of the pp group,
and a batch cut into M micro-batches that flow through them. Two schedules, side by side.

    stage 0: embedding + blocks [0, L/pp)   ...   stage pp-1: blocks [.., L) + ln_f + head + loss

Only neighbours talk, point to point: stage s sends its output activation (rows, T, C) to
s+1 (forward) and receives the gradient of that activation back (backward). Every stage
knows (rows, T, C) and the dtype from the config and the batch, so no shape messages.

GPipe (all forward, then all backward), p = 4 stages, m = 8 micro-batches; digit i: forward
of micro-batch i, letter: its backward (a = 0, b = 1, ...) taking twice as long, '.': idle
(`python -m minidist.pp.simulate` runs the functions below to draw this):

    stage 0 |01234567.........aabbccddeeffgghh|
    stage 1 |.01234567......aabbccddeeffgghh..|
    stage 2 |..01234567...aabbccddeeffgghh....|
    stage 3 |...01234567aabbccddeeffgghh......|

1F1B: after a warmup of p-s-1 forwards, stage s alternates one forward and one backward, so
it never holds more than p-s micro-batches' activations (GPipe: all m of them):

    stage 0 |0123......aa4bb5cc6dd7ee.ff.gg.hh|
    stage 1 |.012....aa3bb4cc5dd6ee7ff.gg.hh..|
    stage 2 |..01..aa2bb3cc4dd5ee6ff7gg.hh....|
    stage 3 |...0aa1bb2cc3dd4ee5ff6gg7hh......|

Both leave the same idle "bubble": (p-1) forward+backward slots out of m+p-1 on every stage,
a fraction (p-1)/(m+p-1). 1F1B does not shrink the bubble, it shrinks activation memory
(GPipe keeps m micro-batches alive on every stage, 1F1B at most p on the first).

Deadlock: in 1F1B's steady state stage s sends forward to s+1 while s+1 sends a gradient back
to s. With blocking sends both would wait for the other's receive (large messages do not fit
MPI's eager buffers), so those two exchanges are one call that posts the send and the receive
together and waits for both (`send_forward_recv_backward`, `send_backward_recv_forward`).

Backward runs in micro-batch order 0..m-1 in both schedules, so both sum every parameter's
gradient in the same order: GPipe and 1F1B give bitwise the same step.
`VERBOSE=1` logs every send and receive (rank, stage, direction, micro-batch, shape).

The stage modules: minidist/pp/stage.py; the strategy (tied embedding, DDP, TP,
clipping, loss): minidist/pp/strategy.py; the one-process simulation behind the
pictures: pp_simulate.py.
Tests: tests/test_pipeline.py (exactness vs one process, in-flight activations, bad input).
"""
import itertools
import os

from minidist.autograd import Tensor
from minidist.comm import trace


def split_layers(n_layer, n_stages):
    """Stage s's blocks: contiguous ranges, as equal as possible (earlier stages get the
    remainder). More stages than blocks is an error: a stage needs at least one block."""
    if n_stages < 1 or n_stages > n_layer:
        raise ValueError(f"pipeline: {n_stages} stages for {n_layer} blocks; every stage "
                         f"needs at least one block, so use --pp between 1 and --n-layer "
                         f"({n_layer})")
    base, extra = divmod(n_layer, n_stages)
    sizes = [base + (s < extra) for s in range(n_stages)]
    ends = list(itertools.accumulate(sizes))
    return [range(end - n, end) for n, end in zip(sizes, ends)]


# ---- point to point between neighbouring stages ------------------------------------------

def verbose():
    return os.environ.get("VERBOSE", "0") not in ("", "0")


class StageLink:
    """This rank's place in the pipeline (pp `group`) and its sends/receives to neighbours.

    `expect(shape, dtype, xp)` fixes the boundary activation's shape for this step; receives
    allocate that, so no message carries a shape. On the first stage `recv_forward` returns
    None and `send_backward` does nothing; on the last, `send_forward` / `recv_backward`."""

    def __init__(self, group):
        self.group, self.stage, self.n_stages = group, group.rank, group.size
        self.first, self.last = self.stage == 0, self.stage == self.n_stages - 1
        self.shape = self.dtype = self.xp = None

    def expect(self, shape, dtype, xp):
        self.shape, self.dtype, self.xp = tuple(shape), dtype, xp

    def _log(self, what, peer, i):
        if verbose():
            arrow = "->" if what.startswith("send") else "<-"
            trace.log(f"stage {self.stage} {what:13s} micro-batch {i:2d} {arrow} stage {peer} "
                      f"{self.shape} {self.dtype}")

    def _start(self, kind, buf, peer, i):
        self._log(kind, peer, i)
        if kind.startswith("recv"):
            return self.group.recv(buf, peer, async_op=True)
        if tuple(buf.shape) != self.shape or buf.dtype != self.dtype:   # no shape messages:
            raise ValueError(f"stage {self.stage} would {kind} {tuple(buf.shape)} {buf.dtype} "
                             f"but stage {peer} expects {self.shape} {self.dtype}")
        return self.group.send(self.xp.ascontiguousarray(buf), peer, async_op=True)

    def _exchange(self, send=None, recv=None):
        """Post (kind, buf, peer, i) sends and receives together, then wait for all."""
        works = [self._start(*s) for s in (send, recv) if s is not None]
        for w in works:
            w.wait()

    def _empty(self):
        return self.xp.empty(self.shape, dtype=self.dtype)

    def recv_forward(self, i):
        """Micro-batch i's input activation from the previous stage (None on the first)."""
        if self.first:
            return None
        buf = self._empty()
        self._exchange(recv=("recv forward", buf, self.stage - 1, i))
        return Tensor(buf, requires_grad=True)

    def send_forward(self, out, i):
        if not self.last:
            self._exchange(send=("send forward", out.data, self.stage + 1, i))

    def recv_backward(self, i):
        """dL/d(output) of micro-batch i from the next stage (None on the last)."""
        if self.last:
            return None
        buf = self._empty()
        self._exchange(recv=("recv backward", buf, self.stage + 1, i))
        return buf

    def send_backward(self, grad, i):
        if not self.first:
            self._exchange(send=("send backward", grad, self.stage - 1, i))

    def send_forward_recv_backward(self, out, i_send, i_recv):
        """Steady state, after a forward: output of i_send out, gradient of i_recv in."""
        if self.last:
            return None
        buf = self._empty()
        self._exchange(send=("send forward", out.data, self.stage + 1, i_send),
                       recv=("recv backward", buf, self.stage + 1, i_recv))
        return buf

    def send_backward_recv_forward(self, grad, i_send, i_recv):
        """Steady state, after a backward: gradient of i_send out, input of i_recv in."""
        if self.first:
            return None
        buf = self._empty()
        self._exchange(send=("send backward", grad, self.stage - 1, i_send),
                       recv=("recv forward", buf, self.stage - 1, i_recv))
        return Tensor(buf, requires_grad=True)


# ---- the compute of one micro-batch, and what is in flight ---------------------------------

class MicroBatches:
    """One step's micro-batches on this stage: forward(i, input) and backward(i, grad), the
    (input, output) pairs alive between the two (`live`), the losses (last stage), the most
    micro-batches in flight, and, given `measure(live)` -> bytes (the training layer's memory
    ledger), the most activation bytes held at once. `backward_loss(loss)` starts the last
    stage's backward (the 1/M factor, the loss scale)."""

    def __init__(self, stage, idx, targets, n_micro, backward_loss, measure=None):
        rows = len(idx) // n_micro
        self.stage, self.n_micro, self.backward_loss = stage, n_micro, backward_loss
        self.idx = [idx[i * rows:(i + 1) * rows] for i in range(n_micro)]
        self.targets = [targets[i * rows:(i + 1) * rows] for i in range(n_micro)]
        self.live, self.losses, self.measure = {}, [], measure
        self.peak_in_flight, self.peak_bytes = 0, 0

    def forward(self, i, inp):
        """Run micro-batch i through this stage; returns its output (the loss on the last)."""
        with traced(f"F{i}", i):
            out = self.stage.stage_forward(inp, self.idx[i], self.targets[i])
        self.live[i] = (inp, out)
        if self.stage.last:
            self.losses.append(float(out.item()))
        self.peak_in_flight = max(self.peak_in_flight, len(self.live))
        if self.measure is not None:
            self.peak_bytes = max(self.peak_bytes, self.measure(self.live.values()))
        return out

    def backward(self, i, grad):
        """Backpropagate micro-batch i from dL/d(output) (the loss itself on the last stage);
        returns dL/d(input) for the previous stage (None on the first)."""
        inp, out = self.live.pop(i)
        with traced(f"B{i}", i):
            if self.stage.last:
                self.backward_loss(out)
            else:
                out.backward(grad)
        return None if inp is None else inp.grad


class traced:
    """Record the enclosed compute as an event on the trace's "compute" row (named F3, B3)."""

    def __init__(self, name, micro_batch):
        self.name, self.micro_batch = name, micro_batch

    def __enter__(self):
        self.start = trace.now()

    def __exit__(self, *exc):
        if trace.enabled():
            trace.record(dict(seq=self.micro_batch, op=self.name, algo="compute",
                              group="compute", dtype="", bytes=0, issued=self.start,
                              start=self.start, end=trace.now()))


# ---- the two schedules ---------------------------------------------------------------------

def gpipe(link, steps):
    """All forward, then all backward (GPipe, Huang et al. 2019)."""
    m = steps.n_micro
    # all forward: micro-batch i reaches stage s at slot s + i
    for i in range(m):
        x = link.recv_forward(i)
        link.send_forward(steps.forward(i, x), i)
    # all backward, in the same micro-batch order
    for i in range(m):
        g = link.recv_backward(i)
        link.send_backward(steps.backward(i, g), i)


def one_f_one_b(link, steps):
    """One forward, one backward (PipeDream-Flush / Megatron-LM's 1F1B, Narayanan et al.)."""
    m = steps.n_micro
    n_warmup = min(link.n_stages - link.stage - 1, m)   # forwards before the first backward
    n_steady = m - n_warmup
    # warmup: forwards only, filling the pipeline
    for i in range(n_warmup):
        x = link.recv_forward(i)
        link.send_forward(steps.forward(i, x), i)
    # steady state: forward micro-batch n_warmup + k, then backward micro-batch k
    x = link.recv_forward(n_warmup) if n_steady else None
    for k in range(n_steady):
        i_fwd, i_bwd = n_warmup + k, k
        out = steps.forward(i_fwd, x)
        g = link.send_forward_recv_backward(out, i_fwd, i_bwd)
        g_in = steps.backward(i_bwd, g)
        if k == n_steady - 1:
            link.send_backward(g_in, i_bwd)
        else:
            x = link.send_backward_recv_forward(g_in, i_bwd, i_fwd + 1)
    # cooldown: the backwards of the warmup's micro-batches
    for i in range(n_steady, m):
        g = link.recv_backward(i)
        link.send_backward(steps.backward(i, g), i)


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b}


def bubble_fraction(events_by_rank):
    """The measured bubble of the last step: on each rank, the share of the window from the
    first micro-batch's start to the last one's end (over all ranks) spent not computing
    (its F/B events, recorded by `traced`). Returns (mean over ranks, [per rank])."""
    steps = []
    for events in events_by_rank:
        compute = [e for e in events if e["group"] == "compute" and e["op"][0] in "FB"]
        starts = [k for k, e in enumerate(compute) if e["op"] == "F0"]
        steps.append(compute[starts[-1]:] if starts else [])
    t0 = min(e["start"] for step in steps for e in step)
    t1 = max(e["end"] for step in steps for e in step)
    idle = [1.0 - sum(e["end"] - e["start"] for e in step) / (t1 - t0) for step in steps]
    return sum(idle) / len(idle), idle


def bubble_theory(p, m):
    """GPipe's and 1F1B's bubble: (p-1) idle slots per stage out of m+p-1."""
    return (p - 1) / (m + p - 1)
