"""The compute of one pipeline step on one stage, micro-batch by micro-batch, and what is in
flight. The schedules (minidist/pp/schedule.py) only call these and the link, so the same
schedule functions drive the simulator (minidist/pp/simulate.py's SimSteps has the same
methods).

    forward(i, x, chunk)          micro-batch i through this rank's chunk (v = 1: the stage)
    backward(i, g, chunk)         its whole backward: dL/d(input) and the weights' gradients
    backward_input(i, g, chunk)   B of a split backward: dL/d(input) only; the weight
                                  gradients' work is queued (autograd's defer_weight_grads)
    backward_weight(i, chunk)     W: run that queue; the micro-batch is done

A micro-batch is in flight (`live`) from its forward to the end of its backward (W for a
split one): its graph, or after B the values W still needs, are what the memory ledger
counts.

Data parallelism across pipelines stays silent (the strategy's `no_sync`) in every backward
but micro-batch M-1's (its W for a split one): the last contribution to each of a chunk's
gradients, so DDP's buckets (and hybrid ZeRO's all-reduces across replicas) start there,
under the rest of that backward and the pipeline's cooldown, as Megatron-LM overlaps them.
A B pass fires no gradient hook (W does), so it needs no context.

A Mixture of Experts: the router losses of the MoE blocks on a chunk that does not end the
model (`router[(chunk, i)]`) are part of the loss, so that chunk's backward starts from its
output's gradient and from them, seeded as the last stage seeds the loss (`scale_loss`), in
one pass (autograd's backward_all); their values (`router_values`) are added to the loss
the strategy reports. Tests: tests/test_pipeline.py, tests/test_ep_exact.py.
"""
import contextlib

from minidist.autograd.function import backward_all
from minidist.autograd.tensor import defer_weight_grads
from minidist.comm import trace
from minidist.nn.gpt import moe_loss


class MicroBatches:
    """One step's micro-batches on this stage. `live[(chunk, i)]` = (input, output, queued W
    work or None); the losses (the stage holding the head); the most micro-batches in flight
    (chunk-micro-batches under interleaving) and, given `measure(live values)` -> bytes (the
    training layer's memory ledger), the most activation bytes held at once.
    `backward_loss(loss)` starts the backward at the loss (the 1/M factor, the loss scale);
    `scale_loss(loss)` is the tensor it starts from (for the router losses of MoE blocks
    elsewhere than at the head: module docstring). `no_sync()`: the context in which data
    parallelism's hooks start nothing (the strategy's), around every backward but the last."""

    def __init__(self, stage, idx, targets, n_micro, backward_loss, measure=None,
                 scale_loss=None, no_sync=contextlib.nullcontext):
        rows = len(idx) // n_micro
        self.stage, self.n_micro, self.backward_loss = stage, n_micro, backward_loss
        self.scale_loss, self.no_sync = scale_loss, no_sync
        self.idx = [idx[i * rows:(i + 1) * rows] for i in range(n_micro)]
        self.targets = [targets[i * rows:(i + 1) * rows] for i in range(n_micro)]
        ids = stage.dropout_keys.rows_in_flight(len(idx))    # their numbers in the global batch
        self.ids = [ids[i * rows:(i + 1) * rows] for i in range(n_micro)]
        self.live, self.losses, self.measure = {}, [], measure
        self.router, self.router_values = {}, []
        self.peak_in_flight, self.peak_bytes = 0, 0

    def __repr__(self):
        """For a debugger in a schedule (`p steps`): the micro-batches, which are in flight
        (forward run, backward not: (chunk, micro-batch), held activations), the peak."""
        return (f"MicroBatches({self.n_micro} of {len(self.idx[0])} rows, in flight "
                f"{sorted(self.live)}, peak {self.peak_in_flight}, "
                f"{len(self.losses)} loss(es) at the head)")

    def forward(self, i, inp, chunk=0):
        """Run micro-batch i through this rank's chunk; returns its output (the loss after
        the head)."""
        router = []
        with traced("F", i, chunk), self.stage.dropout_keys.rows_of(self.ids[i]):
            out = self.stage.stage_forward(inp, self.idx[i], self.targets[i], chunk, router)
        if router:
            self.router[(chunk, i)] = moe_loss(router)
            self.router_values.append(self.router[(chunk, i)].data.astype("float64"))
        self.live[(chunk, i)] = (inp, out, None)
        if self.stage.holds_head(chunk):
            self.losses.append(out.data.astype("float64"))    # on the device: no host read
        self.peak_in_flight = max(self.peak_in_flight, len(self.live))
        if self.measure is not None:
            self.peak_bytes = max(self.peak_bytes, self.measure(self.live.values()))
        return out

    def backward(self, i, grad, chunk=0):
        """Backpropagate micro-batch i from dL/d(output) (None after the head: the loss);
        returns dL/d(input) for the previous stage (None on the first)."""
        inp, out, _ = self.live.pop((chunk, i))
        with traced("B", i, chunk), self.silent_unless_last(i):
            self._start_backward(out, grad, chunk, self.router.pop((chunk, i), None))
        return None if inp is None else inp.grad

    def backward_input(self, i, grad, chunk=0):
        """B: only dL/d(input) now; the weights' gradients wait in a queue for W."""
        inp, out, _ = self.live[(chunk, i)]
        with traced("B", i, chunk), defer_weight_grads(self.stage.parameters()) as work:
            self._start_backward(out, grad, chunk, self.router.pop((chunk, i), None))
        self.live[(chunk, i)] = (None, None, work)       # only what W needs stays alive
        return None if inp is None else inp.grad

    def backward_weight(self, i, chunk=0):
        """W: micro-batch i's weight gradients, from what its B queued."""
        _, _, work = self.live.pop((chunk, i))
        with traced("W", i, chunk), self.silent_unless_last(i):
            work.run()

    def silent_unless_last(self, i):
        """no_sync() around micro-batch i's gradients, except the last micro-batch's: every
        schedule runs a chunk's backwards in micro-batch order (minidist/pp/schedule.py)."""
        return contextlib.nullcontext() if i == self.n_micro - 1 else self.no_sync()

    def _start_backward(self, out, grad, chunk, router):
        if self.stage.holds_head(chunk):
            self.backward_loss(out)                  # the router losses are in it
        elif router is not None:                     # d out . grad + d router x the seed
            backward_all([out, self.scale_loss(router)], [grad, None])
        else:
            out.backward(grad)


class traced:
    """Record the enclosed compute as an event on the trace's "compute" row: F3, B3, W3 for
    micro-batch 3 (F3:c1 for chunk 1 under interleaving)."""

    def __init__(self, kind, micro_batch, chunk=0):
        self.name = f"{kind}{micro_batch}" + (f":c{chunk}" if chunk else "")
        self.micro_batch = micro_batch

    def __enter__(self):
        self.start = trace.now()

    def __exit__(self, *exc):
        if trace.enabled():
            trace.record(dict(seq=self.micro_batch, op=self.name, algo="compute",
                              group="compute", dtype="", bytes=0, issued=self.start,
                              start=self.start, end=trace.now()))
