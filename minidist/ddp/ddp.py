"""Data parallelism (DDP): every rank holds the whole model and reads its own shard of each
global batch; the ranks average their gradients, then all take the same optimizer step.

Why that is exact: with N equal shards the loss of the global batch is the mean of the N shard
means, so its gradient is the mean over ranks of each rank's gradient (an all-reduce "avg").
Every rank then holds the gradient one process would compute on the whole batch, and since
the parameters are broadcast from rank 0 when the model is wrapped, they start equal and stay
equal (the all-reduce leaves bitwise identical sums on every rank).

Three ways to average, side by side, simplest first (picotron's DataParallelNaive and
DataParallelBucket, plus the overlap PyTorch's DDP is known for):

    naive       after backward, one blocking all-reduce per parameter: ~50 small messages per
                step for a 4-layer GPT, each paying 2(N-1) ring steps of latency.
    bucketed    the parameters, in reverse order, packed into flat buckets of ~bucket_mb;
                each parameter's .grad is a view into its bucket, so the autograd engine's `+=`
                writes straight into it. After backward: one all-reduce per bucket, no copies.
    overlapped  bucketed, and a bucket's all-reduce starts (async_op=True) from the grad hook
                the moment its last gradient is complete, while backward goes on computing the
                earlier layers. sync_grads() waits for all of them.

Where the code is: the three modes are minidist/ddp/sync.py's classes, a sync of any list
of parameters over a group (GradSync, BucketedGradSync, OverlappedGradSync; expert
parallelism syncs its experts over their replicas with one: minidist/ep/strategy.py); this
file's DataParallel* classes are the same with a model in front (ModelSide: its parameters,
less the experts, and its methods).

Reverse order, because backward finishes the last layer's gradients first: the first bucket
fills first. Buckets are launched strictly in order (bucket k+1 waits for bucket k), so every
rank issues the same collectives in the same order even if hooks fire in a different order.

How communication makes progress while Python computes: MPI moves bytes only while some thread
is inside an MPI call. `async_op=True` queues the all-reduce on the group's communication
thread (minidist/comm/stream.py), which runs the ring's steps (Irecv + Isend, then a wait
that releases the GIL: minidist/comm/channel.py); the main thread meanwhile runs backward
(numpy releases the GIL inside its kernels).
On GPU the caller records a CUDA event on its (compute) stream when it issues the bucket; the
communication thread waits for that event, then stages the bucket through host memory for MPI
(or, with --comm nccl, enqueues NCCL on that thread's current stream, cupy's default stream).
Tracing (`trace.enable()`) records each all-reduce's start and end: the Chrome trace shows
them running inside the backward pass
(tests/test_ddp_exact.py::test_four_ranks_equal_one_process_every_mode_and_algo).

A debugger (pdb) traces only the thread it runs in, so it cannot stop in these all-reduces;
with `sync_comm` on the group (train_gpt.py --sync-comm, MINIDIST_SYNC_COMM=1) each bucket's
all-reduce runs in the hook itself, in the calling thread: steppable, and no longer overlapped.

Gradient accumulation: inside `with ddp.no_sync():` the hooks start nothing and gradients add
up in the buckets; run the last micro-batch outside it, then call sync_grads().

Tests: tests/test_ddp.py (in-process), tests/test_ddp_exact.py (4 ranks == 1 process in float64
for every mode and algorithm, dp 2 x grad-accum 2, bytes = 2(N-1)/N x gradient bytes,
clipping, the overlap trace).
"""
from minidist.ddp.sync import (BucketedGradSync, GradSync, OverlappedGradSync,
                                check_mode)


def DistributedDataParallel(model, group, mode="overlapped", bucket_mb=1.0):
    """Wrap `model` for data parallelism over `group` (a ProcessGroup): one of the classes
    below, by `mode` ("naive", "bucketed" or "overlapped"), over its parameters that require
    a gradient and are not `expert_parallel` (minidist/ep/'s). Broadcasts rank 0's."""
    check_mode(mode)
    if mode == "naive":
        return DataParallelNaive(model, group)
    cls = DataParallelOverlap if mode == "overlapped" else DataParallelBucket
    return cls(model, group, bucket_mb)


class ModelSide:
    """DDP's model side, put before a sync class of minidist/ddp/sync.py: the model
    (`module`), whose parameters but the `expert_parallel` ones the sync class takes; a call
    is a forward (counted for the debug check, the buckets attached first); and the model's
    own methods, as torch's DDP answers them (the wrapper is no Module itself)."""

    def __init__(self, model, group, *bucket_mb):
        self.module = model
        super().__init__([p for p in model.parameters()              # forward order; experts
                          if p.requires_grad and not p.expert_parallel],  # are minidist/ep/'s
                         group, *bucket_mb)

    def __call__(self, *args, **kwargs):
        self.before_forward()
        return self.module(*args, **kwargs)

    def parameters(self):
        return self.module.parameters()

    def named_parameters(self):
        return self.module.named_parameters()

    def train(self, mode=True):
        self.module.train(mode)
        return self

    def eval(self):
        return self.train(False)

    def state_dict(self):
        return self.module.state_dict()

    def load_state_dict(self, state, strict=True):
        return self.module.load_state_dict(state, strict)


class DataParallelNaive(ModelSide, GradSync):
    """`model` wrapped; one blocking all-reduce per parameter gradient, after backward."""


class DataParallelBucket(ModelSide, BucketedGradSync):
    """`model` wrapped; its gradients in flat buckets, one all-reduce per bucket."""


class DataParallelOverlap(ModelSide, OverlappedGradSync):
    """`model` wrapped; each bucket's all-reduce started from the grad hook, in backward."""
