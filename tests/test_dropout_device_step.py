"""Dropout's step held on the device (minidist/autograd/dropout_keys.py, "The step on the
device"): what a CUDA graph with dropout rests on, checked on the CPU.

The keys' counter advancing once per next_step, the lag of a redrawn snapshot, settle()
after "replays" (the counter advanced alone), the state_dict/load round trip keeping the
counter's array, the uploads kept per content; every kind of site's numbers (whole, a TP
slice, single-word columns, cp positions, MoE places) by the kernel path; then whole GPT
training steps on numpy
with the kernel path turned on for numpy (DropoutKeys.run: the Philox kernel run by the CPU
harness, tests/cuda_cpu.py, for every dropout site): the same losses and parameters as the host
path bit for bit, with --ckpt-activations (a recompute redraws through a snapshot) and a
backward after a later forward (lag 1), and no upload after the first step.
The kernels themselves: tests/test_cuda_philox_cpu.py, tests/test_cuda_flash_cpu.py.
Run: python -m pytest -q tests/test_dropout_device_step.py
"""

import numpy as np
import pytest

import cuda_cpu
from minidist import backend
from minidist.autograd.dropout_keys import DropoutKeys
from minidist.nn import GPT, GPTConfig
from minidist.strategy.base import SingleProcess
from minidist.train.step import train_step
from minidist.train.args import train_parser

CONFIG = GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=8, vocab_size=30, dropout=0.2)


def test_the_counter_advances_with_next_step_and_a_snapshot_lags():
    keys = DropoutKeys(5)
    keys.next_step()
    counter, lag = keys.device_step(np)           # made from the count on first use
    assert counter.dtype == np.int64 and counter.shape == (1,) and counter[0] == 1 and lag == 0
    old = keys.snapshot()
    for n in (2, 3):
        keys.next_step()
        assert keys.counter is counter and counter[0] == keys.count == keys.step == n
    with keys.as_of(old):                         # a recompute redraws step 1: lag 2
        assert keys.device_step(np) == (counter, 2) and keys.step == 1 and keys.count == 3
    assert keys.device_step(np) == (counter, 0)


def test_settle_catches_the_host_up_after_replays():
    """A replay advances the counter alone (the captured next_step); settle reads it back,
    one host read; without a counter nothing is read."""
    keys = DropoutKeys(5)
    reads = sum(backend.host_reads().values())
    keys.settle()
    assert sum(backend.host_reads().values()) == reads
    keys.next_step()
    counter, _ = keys.device_step(np)
    counter += 3                                   # three replays
    assert keys.step == keys.count == 1
    keys.settle()
    assert keys.step == keys.count == 4 and sum(backend.host_reads().values()) == reads + 1


def test_state_dict_settles_and_load_writes_the_counter_in_place():
    keys = DropoutKeys(5)
    keys.next_step()
    counter, _ = keys.device_step(np)
    counter += 2                                   # replays
    assert keys.state_dict() == {"step": 3, "seed": 5}
    keys.load_state_dict({"step": 7})
    assert keys.counter is counter and counter[0] == 7 and keys.step == keys.count == 7
    fresh = DropoutKeys(5)
    fresh.load_state_dict(keys.state_dict())
    assert fresh.step == fresh.count == 7 and fresh.counter is None


def test_uploads_are_kept_per_content():
    keys = DropoutKeys(5)
    a = keys.on_device([3, 1, 2], np)
    assert a.dtype == np.int64 and a.shape == (3,)
    assert keys.on_device(np.array([3, 1, 2], np.int32), np) is a
    assert keys.on_device([3, 1], np) is not a
    assert keys.on_device(np.array([[3, 1, 2]]), np).shape == (1, 3)
    assert keys.uploads_kept == 3


def harness():
    """What DropoutKeys.run is set to for the device path on numpy: uploads kept, the Philox
    kernel run on the CPU through the harness, the step read from the counter."""
    if cuda_cpu.reason_unavailable() is not None:
        pytest.skip(cuda_cpu.reason_unavailable())
    return cuda_cpu.run


def test_without_a_run_the_keys_take_the_device_path_only_where_the_new_kernels_are_on():
    """kernel_run: None on numpy (the host path), the harness where it is set."""
    assert DropoutKeys(5).kernel_run(np) is None
    assert DropoutKeys(5, run=cuda_cpu.run).kernel_run(np) is cuda_cpu.run


def test_sites_drawn_by_the_kernel_path_are_the_host_paths():
    """DropoutSite's numbers through the kernel path (kept uploads, the Philox kernel on the
    CPU) equal the host's bit for bit: a whole tensor, a tensor-parallel slice, a tile whose
    columns are not whole Philox blocks (each number its own word), cp's scattered
    positions, MoE's places (`at`)."""
    from minidist.autograd.dropout_keys import DropoutSite

    def draws(run=None):
        keys = DropoutKeys(9, run)
        keys.next_step()
        whole, tp = DropoutSite(keys, "a"), DropoutSite(keys, "a", axis=1, parts=2, index=1)
        cp = DropoutSite(keys, "b", seq_axis=1)
        with keys.rows_of([4, 1, 6]):
            out = [whole.random((3, 5, 8)), tp.random((3, 2, 7, 7)),
                   whole.block((3, 2, 9, 9), [np.arange(2), np.arange(1, 6), np.arange(3, 8)]),
                   whole.at(3, [2, 0], np.array([[0], [12]]), np.arange(5))]
            with keys.positions_of([0, 1, 6, 7], 8):
                out.append(cp.random((3, 4, 8)))
        assert (keys.counter is None) == (run is None)     # the kernel drew, or did not
        return out
    want = draws()
    for a, b in zip(draws(harness()), want):
        assert a.dtype == np.float32
        np.testing.assert_array_equal(a, b)


def run_steps(ckpt, attention, run=None, steps=3):
    """Losses and the model after `steps` float64 train_steps (dropout 0.2), and the
    uploads kept after each; `run`: the keys' (None: the host path on numpy)."""
    args = train_parser().parse_args(["--grad-accum", "2", "--lr", "1e-2"])
    strategy = SingleProcess(ckpt_activations=ckpt)
    config = GPTConfig(**{**CONFIG.__dict__, "attention": attention})
    model = strategy.build_model(config, 3, "float64")
    model.dropout_keys.run = run
    opt = strategy.build_optimizer(model, args)
    r = np.random.default_rng(0)
    losses, kept = [], []
    for _ in range(steps):
        x, y = (r.integers(0, 30, (4, 8)) for _ in range(2))
        losses.append(float(train_step(strategy, model, opt, x, y, args)[0]))
        kept.append(model.dropout_keys.uploads_kept)
    return losses, model, kept


@pytest.mark.parametrize("ckpt,attention", [(False, "materialized"), (True, "tiled")])
def test_steps_drawn_by_the_kernel_path_are_the_host_paths(ckpt, attention):
    want, host, _ = run_steps(ckpt, attention)
    got, dev, kept = run_steps(ckpt, attention, harness())
    assert got == want
    for p, q in zip(host.parameters(), dev.parameters()):
        np.testing.assert_array_equal(p.data, q.data)
    keys = dev.dropout_keys
    assert keys.counter[0] == keys.count == keys.step == 3 and host.dropout_keys.counter is None
    assert kept[0] > 0 and kept[1:] == kept[:-1]          # after the first step: no upload


def test_a_backward_after_a_later_forward_redraws_its_own_masks():
    """Two training forwards outside train_step (steps 1 and 2), then the first's backward:
    tiled attention's backward draws step 1 through the counter (2) less the lag (1)."""
    def grads(run=None):
        model = GPT(GPTConfig(**{**CONFIG.__dict__, "attention": "tiled"}), seed=1,
                    dtype="float64")
        model.dropout_keys.run = run
        x = np.random.default_rng(1).integers(0, 30, (2, 8))
        _, first = model(x, x)
        model(x, x)
        first.backward()
        return [p.grad.copy() for p in model.parameters()], model.dropout_keys
    want, _ = grads()
    got, keys = grads(harness())
    assert keys.counter[0] == 2
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
