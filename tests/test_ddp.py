"""Data parallelism in-process: bucket layout and hook logic (a one-rank group that notes its
calls), the wrapper, and make_strategy's refusals (before any communication).

N ranks under mpiexec against one process in float64, for every mode x algorithm:
tests/test_ddp_exact.py; examples/train_gpt.py under mpiexec: tests/test_ddp_train.py.
"""
import contextlib

import numpy as np
import pytest
from mpi4py import MPI

from minidist.autograd import Tensor
from minidist.backend import to_host as H, xp_of
from minidist.comm import ProcessGroup
from minidist.nn import GPT, GPTConfig
from minidist.ddp.ddp import DistributedDataParallel
from minidist.ddp.sync import broadcast_buckets, bucket_layout
from minidist.ddp.strategy import DataParallel
from minidist.train.args import train_parser
from minidist.strategy.base import SingleProcess
from minidist.train.strategy import check_layout, make_strategy
from minidist.train.cli import UsageError
from minidist.train.step import train_step
from mpirun import ROOT

CONFIG = GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=8, vocab_size=32)


class RecordingGroup(ProcessGroup):
    """A real one-rank ProcessGroup (COMM_SELF, ring: the average over one rank is the
    identity) that also notes each all-reduce and broadcast as it is called: (op, size,
    async, probe(), the Work an async call returned). `probe()` is evaluated at every
    all-reduce, to see when it happened."""

    def __init__(self, probe=lambda: None):
        super().__init__(MPI.COMM_SELF, "ring", name="recording")
        self.calls, self.probe = [], probe

    def broadcast(self, buf, root=0, async_op=False):
        work = super().broadcast(buf, root, async_op)
        self.calls.append(("broadcast", buf.size, async_op, None, work))
        return work

    def all_reduce(self, buf, op="sum", async_op=False):
        assert op == "avg" and buf.flags.c_contiguous
        probe = self.probe()
        work = super().all_reduce(buf, op, async_op)
        self.calls.append(("all_reduce", buf.size, async_op, probe, work))
        return work

    def reduces(self):
        return [c for c in self.calls if c[0] == "all_reduce"]


@pytest.fixture
def recording():
    """RecordingGroup(probe), each one destroyed (stream thread, communicators) at the end."""
    made = []

    def make(probe=lambda: None):
        made.append(RecordingGroup(probe))
        return made[-1]
    yield make
    for group in made:
        group.destroy()


def _batch(rows=4, step=0):
    x = np.random.default_rng(step).integers(0, CONFIG.vocab_size, (rows, CONFIG.block_size))
    return x, np.roll(x, -1, axis=1)


def _backward(ddp, step=0):
    _, loss = ddp(*_batch(step=step))
    loss.backward()
    return loss


def _param(n, dtype="float32"):
    return Tensor(np.zeros(n, dtype=dtype), requires_grad=True)


def test_bucket_layout_reverse_order_and_caps():
    mib = 2**20 // 4                                    # float32 elements in one MiB
    params = [_param(mib // 2), _param(mib // 4), _param(3 * mib), _param(mib // 2),
              _param(mib // 2), _param(10, "float64"), _param(10, "float64")]
    layout = bucket_layout(params, bucket_mb=1.0)
    assert layout == [[6, 5], [4, 3], [2], [1, 0]]     # last first; dtype change cuts; 3 MiB alone
    assert sorted(i for b in layout for i in b) == list(range(len(params)))
    assert bucket_layout(params, bucket_mb=100.0) == [[6, 5], [4, 3, 2, 1, 0]]


def test_broadcast_buckets_big_tensors_alone_small_ones_packed_by_kind():
    """The start-up broadcast's buckets (minidist/ddp/sync.py broadcast_parameters): a
    tensor of bucket_mb or more alone (broadcast in place, no copy); the smaller ones of
    each dtype together whatever their order (--amp's 16-bit matrices beside float32 norms
    would otherwise cut a bucket at every change), cut at bucket_mb; every tensor in
    exactly one bucket."""
    mib = 2**20 // 4
    params = [_param(mib // 2), _param(10, "float64"), _param(mib // 4), _param(3 * mib),
              _param(10, "float64"), _param(mib // 2), _param(mib // 2), _param(mib)]
    assert broadcast_buckets(params, 1.0) == [[3], [7], [0, 2], [5, 6], [1, 4]]
    assert broadcast_buckets(params, 100.0) == [[0, 2, 3, 5, 6, 7], [1, 4]]


def test_the_chapters_counts_are_the_main_jobs_model():
    """minidist/ddp/README.md's counts for the main job (train_gpt.py's default flags; its
    default data is bytes, vocabulary 256): parameters, tensors, float32 gradient MiB, the
    buckets bucket_layout cuts at --bucket-mb's default, and the ring's 2(N-1)/N = 1.5 x per
    rank at N = 4 (tests/test_ddp_exact.py checks the ring's bytes on every mode)."""
    args = train_parser().parse_args([])
    config = GPTConfig(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd,
                       block_size=args.block_size, vocab_size=256)
    params = list(GPT(config, seed=0).parameters())
    n, mib = sum(p.size for p in params), 4 / 2**20
    buckets = [sum(params[i].size for i in b) * mib
               for b in bucket_layout(params, args.bucket_mb)]
    text = " ".join(open(f"{ROOT}/minidist/ddp/README.md").read().split())
    for said in [f"({n:,} parameters in {len(params)} tensors, {n * mib:.2f} MiB of float32",
                 f"| {len(buckets)} ({', '.join(f'{b:.2f}' for b in buckets)} MiB) |",
                 f"sends {1.5 * n * mib:.2f} MiB per rank per step for its {n * mib:.2f} MiB"]:
        assert said in text, said


def test_grads_are_views_into_buckets_and_survive_zero_grad(device, recording):
    """On pytest's --device (the model's parameters live there; the `device` fixture)."""
    ddp = DistributedDataParallel(GPT(CONFIG, seed=0), recording(), "bucketed", 0.002)
    assert len(ddp.buckets) > 3
    _backward(ddp)
    for b in ddp.buckets:
        for p, view in zip(b.params, b.views):
            assert p.grad is view and xp_of(b.buffer).shares_memory(p.grad, b.buffer)
    assert any(float(abs(b.buffer).max()) > 0 for b in ddp.buckets)
    ddp.zero_grad(discard=True)              # zeros, views kept (no sync: dropped)
    assert all(not b.buffer.any() for b in ddp.buckets)
    assert all(p.grad is v for b in ddp.buckets for p, v in zip(b.params, b.views))
    ddp.module.zero_grad()                              # the optimizer's way: .grad = None
    _backward(ddp)                                      # forward re-attaches zeroed views
    assert all(p.grad is v for b in ddp.buckets for p, v in zip(b.params, b.views))


def test_a_bucket_says_what_it_holds_in_a_debugger(recording):
    """`p b` in a debugger stopped in DataParallelOverlap._launch (the DDP chapter's place to
    break) showed `<minidist.ddp.sync.Bucket object at 0x...>`: its repr says its size, the
    gradients complete and where its all-reduce is (first-use walk of 2026-11-30)."""
    ddp = DistributedDataParallel(GPT(CONFIG, seed=0), recording(), mode="overlapped")
    b = ddp.buckets[0]
    n = sum(p.size for p in b.params)
    assert repr(b) == (f"Bucket({len(b.params)} params, {n:,} float32 = "
                       f"{n * 4 / 2**20:.2f} MiB, 0 gradients complete, all-reduce not "
                       "started)"), repr(b)
    _backward(ddp)                              # the hooks start its all-reduce
    b.work.wait()
    assert repr(b).endswith(f", {len(b.params)} gradients complete, all-reduce done)"), b
    ddp.sync_grads()


@pytest.mark.parametrize("mode", ["bucketed", "overlapped"])
def test_the_training_step_keeps_every_gradient_a_view_into_its_bucket(mode, device,
                                                                        recording):
    """Four steps of the loop's own train_step (2 micro-batches each): the step lets DDP zero
    the gradients (strategy.zero_grad), so every .grad stays its bucket's view and backward's
    `+=` writes straight into the bucket. Counted where a copy would happen: Bucket.attach,
    which copies any gradient that is not its view (its `copies`; the optimizer's
    zero_grad, .grad = None, used to make every gradient of every step after the first a
    copy)."""
    strategy = DataParallel(recording(), mode, bucket_mb=0.002)
    args = train_parser().parse_args(["--grad-accum", "2", "--batch-size", "4"])
    model = strategy.build_model(CONFIG, 0, "float32")
    opt = strategy.build_optimizer(model, args)
    buckets = strategy.ddp.buckets
    for step in range(4):
        train_step(strategy, model, opt, *_batch(step=step), args)
        assert all(p.grad is v for b in buckets for p, v in zip(b.params, b.views)), step
    attaches, copies = [b.attaches for b in buckets], [b.copies for b in buckets]
    assert min(attaches) >= 4 and sum(copies) == 0, (attaches, copies)
    b, p = buckets[0], buckets[0].params[0]
    p.grad = p.grad.copy()                      # not its view: the one copy attach counts
    b.attach()
    assert b.copies == 1 and p.grad is b.views[0]
    assert all(xp_of(b.buffer).shares_memory(p.grad, b.buffer)
               for b in buckets for p in b.params)


@pytest.mark.parametrize("mode", ["naive", "bucketed", "overlapped"])
def test_one_rank_ddp_equals_single_process(mode, device, recording):
    """Same gradients as plain backward, including over two accumulated micro-batches and
    after the optimizer's zero_grad() (which sets .grad = None) between steps."""
    ref, model = GPT(CONFIG, seed=0, dtype="float64"), GPT(CONFIG, seed=0, dtype="float64")
    ddp = DistributedDataParallel(model, recording(), mode, 0.002)
    for step in range(2):
        ref.zero_grad()
        model.zero_grad()
        for micro in range(2):
            _backward(ref, step=10 * step + micro)
            with ddp.no_sync() if micro == 0 else contextlib.nullcontext():
                _backward(ddp, step=10 * step + micro)
        ddp.sync_grads()
        for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            np.testing.assert_array_equal(H(p.grad), H(q.grad), err_msg=f"{mode} {name}")


def test_the_wrapper_answers_the_models_parameters_modes_and_state(recording):
    """ddp.eval(), ddp.parameters(), ddp.state_dict() were AttributeErrors (first-use walk
    29: the PyTorch habit); they are the wrapped model's."""
    model = GPT(GPTConfig(**{**CONFIG.to_dict(), "dropout": 0.1}), seed=0)
    ddp = DistributedDataParallel(model, recording(), "bucketed", 0.002)
    assert ddp.eval() is ddp and not model.training
    assert ddp.train() is ddp and model.training
    assert ddp.parameters() == model.parameters()
    assert [n for n, _ in ddp.named_parameters()] == [n for n, _ in model.named_parameters()]
    state = {n: a * 0 for n, a in ddp.state_dict().items()}
    ddp.load_state_dict(state)
    assert all(not H(p.data).any() for p in model.parameters())


@pytest.mark.parametrize("mode", ["naive", "bucketed", "overlapped"])
def test_a_loop_that_forgets_sync_grads_is_stopped_at_its_next_forward(mode, recording):
    """First-use walk 29: an own loop without ddp.sync_grads() stepped on each rank's own
    gradients, and the replicas drifted apart silently (bucketed, naive). Every mode now
    refuses the next forward after a backward that was never averaged, naming the call, and
    so does the recipe's zero_grad() before it (walk 43: zero_grad forgave the backward, so
    the recipe without sync_grads drifted apart in every mode); sync_grads() clears it, and
    no_sync()'s micro-batches are not counted."""
    ddp = DistributedDataParallel(GPT(CONFIG, seed=0), recording(), mode, 0.002)
    _backward(ddp)
    with pytest.raises(RuntimeError, match=r"call ddp.sync_grads\(\) after the backward"):
        ddp(*_batch())
    with pytest.raises(RuntimeError, match=r"zero_grad\(\) after a backward whose gradients "
                       r"were not averaged: call ddp.sync_grads\(\)"):
        ddp.zero_grad()
    ddp.sync_grads()
    ddp.zero_grad()
    with ddp.no_sync():
        _backward(ddp)
    _backward(ddp)
    ddp.sync_grads()
    _backward(ddp, step=1)                                    # the next step: fine


def test_overlapped_zero_grad_after_an_unsynced_backward_waits_and_starts_over(recording):
    """A loop that drops a step's gradients (zero_grad(discard=True)) without sync_grads():
    the overlapped mode zeroed the buckets under the all-reduces its hooks had started, and
    the next backward raised "a second backward before sync_grads()" (the buckets still
    counted full). Now zero_grad waits for them and counts anew: the next step's gradients
    are a fresh backward's."""
    group = recording()
    ddp = DistributedDataParallel(GPT(CONFIG, seed=0), group, "overlapped", 0.002)
    _backward(ddp)
    launched = sum(b.work is not None for b in ddp.buckets)
    assert launched == len(ddp.buckets) > 1
    works = [c[4] for c in group.reduces()]
    with pytest.raises(RuntimeError, match=r"ddp.zero_grad\(discard=True\)"):
        ddp.zero_grad()                               # dropped on purpose only, said so
    ddp.zero_grad(discard=True)
    assert len(works) == launched and all(w.is_completed() for w in works)
    assert all(b.work is None for b in ddp.buckets)
    _backward(ddp, step=1)
    ddp.sync_grads()
    fresh = GPT(CONFIG, seed=0)
    _, loss = fresh(*_batch(step=1))
    loss.backward()
    for (name, p), q in zip(ddp.module.named_parameters(), fresh.parameters()):
        np.testing.assert_array_equal(H(p.grad), H(q.grad), err_msg=name)


def test_overlapped_launches_in_order_during_backward_not_under_no_sync(device, recording):
    model = GPT(CONFIG, seed=0)
    wpe = model.transformer.wpe.weight          # used first in forward: gradient done last
    group = recording(probe=lambda: wpe.grad is not None and bool(wpe.grad.any()))
    ddp = DistributedDataParallel(model, group, "overlapped", 0.002)
    n = len(ddp.buckets)
    with ddp.no_sync():
        _backward(ddp)
    assert group.reduces() == []                    # accumulating: nothing launched
    ddp.zero_grad()
    _backward(ddp, step=1)
    launched = group.reduces()
    assert len(launched) == n and all(async_op for _, _, async_op, _, _ in launched)
    assert [size for _, size, _, _, _ in launched] == [b.buffer.size for b in ddp.buckets]
    probes = [probe for _, _, _, probe, _ in launched]
    assert probes[0] is False and probes[-1] is True   # the first while backward still ran
    ddp.sync_grads()
    assert len(group.reduces()) == n                # sync only waits
    _backward(ddp, step=2)
    with pytest.raises(RuntimeError, match="no_sync"):
        _backward(ddp, step=3)                      # a second backward without sync_grads


def test_naive_mode_one_all_reduce_per_parameter_in_reverse_order(recording):
    group = recording()
    ddp = DistributedDataParallel(GPT(CONFIG, seed=0), group, "naive")
    _backward(ddp)
    ddp.sync_grads()
    sizes = [c[1] for c in group.reduces()]
    assert sizes == [p.size for p in reversed(ddp.params)]
    broadcasts = [c[1] for c in group.calls if c[0] == "broadcast"]
    assert broadcasts == [sum(p.size for p in ddp.params)]     # one bucket at start-up


def test_bad_mode_is_refused(recording):
    with pytest.raises(ValueError, match="overlapped"):
        DistributedDataParallel(GPT(CONFIG, seed=0), recording(), "fast")


# ---- make_strategy: refusals happen on every rank, before any communication ---------------

def _parse(*flags):
    return train_parser().parse_args(list(flags))


def test_dp_must_match_world_size():
    with pytest.raises(UsageError, match="--dp 3 = 3 ranks, but this job has 4 MPI process"):
        check_layout(_parse("--dp", "3"), 4)
    with pytest.raises(UsageError, match="mpirun -n 2"):
        make_strategy(_parse("--dp", "2"))
    assert isinstance(make_strategy(_parse("--dp", "1")), SingleProcess)


def test_batch_must_split_into_dp_times_grad_accum():
    with pytest.raises(UsageError, match="dp 4 x --grad-accum 3 = 12"):
        check_layout(_parse("--batch-size", "16", "--grad-accum", "3"), 4)


def test_nccl_without_a_gpu_is_refused(monkeypatch):
    monkeypatch.setattr("minidist.backend.cupy_module", lambda: None)
    with pytest.raises(UsageError, match="--comm nccl moves data GPU to GPU"):
        make_strategy(_parse("--comm", "nccl", "--zero", "1"))   # (one rank: a group)
