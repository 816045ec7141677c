"""Dropout's Philox kernel (minidist/autograd/cuda_source_philox.py) RUN on the CPU
(tests/cuda_cpu.py) against the xp code DropoutKeys runs on the host: bit for bit, on
whole-block and single-number columns, counters past 2**32 blocks, both thread orders; the
step read on the device (the keys' counter less the lag: live, a snapshot redrawn, and a
plan made once and re-run as the counter advances, what a CUDA graph's replays do);
broken variants that must fail (the step from the wrong slot, the lag ignored or added
among them); the plan's argument types; nvcc compiles it where installed.
Run: python -m pytest -q tests/test_cuda_philox_cpu.py   (skips without a C++ compiler)
"""
import functools

import numpy as np
import pytest

import cuda_cpu
from minidist.autograd import cuda_kernels as ck, cuda_kernels_new as ckn
from minidist.autograd import cuda_source as cs
from minidist.autograd.dropout_keys import DropoutKeys
from test_cuda_kernels_cpu import ORDERS, failing_orders, nth_replaced

pytestmark = pytest.mark.skipif(cuda_cpu.reason_unavailable() is not None,
                                reason=str(cuda_cpu.reason_unavailable()))

SITE = "transformer.h.1.attn.attn_dropout"


def counters():
    """777 counters (odd: the grid's last block part-full): blocks near and past 2**32 (the
    high word in use), rows 0..6, as DropoutKeys.numbers builds them."""
    blocks = np.concatenate([np.arange(700), 2 ** 32 - 3 + np.arange(77)]).astype(np.int64)
    rows = np.arange(777, dtype=np.int64) % 7
    return blocks, rows


def keys_at(step, seed=1234):
    """Keys at `step`, reached by next_step as a run does (count == step)."""
    keys = DropoutKeys(seed)
    for _ in range(step):
        keys.next_step()
    return keys


def kernel_numbers(keys, src=None, order="low"):
    """keys.kernel_numbers through the CPU harness: the step read from the device counter."""
    blocks, rows = counters()
    run = functools.partial(cuda_cpu.run, source=src or cs.source("float32", "philox"),
                            order=order)
    return keys.kernel_numbers(SITE, blocks, rows, np, run)


def check_philox(src=None, order="low", seed=1234, step=9):
    """The kernel's numbers equal the xp code's at the live step, and at a snapshot two
    steps back redrawn (the kernel takes counter - lag: a recompute, a pipeline's later
    backward)."""
    keys = keys_at(step, seed)
    blocks, rows = counters()
    want = keys.philox_numbers(SITE, blocks, rows, np)                      # the xp code
    np.testing.assert_array_equal(kernel_numbers(keys, src, order), want,
                                  err_msg="philox_uniforms")
    if step >= 2:
        back = keys_at(step - 2, seed).philox_numbers(SITE, blocks, rows, np)
        with keys.as_of((step - 2, None, None)):
            np.testing.assert_array_equal(kernel_numbers(keys, src, order), back,
                                          err_msg="philox_uniforms, a snapshot redrawn")


@pytest.mark.parametrize("order", ORDERS)
def test_philox_kernel_equals_the_xp_code_bit_for_bit(order):
    check_philox(order=order)
    check_philox(order=order, seed=2 ** 40 + 5, step=0)              # a seed past 32 bits


def test_a_replayed_launch_draws_each_replays_step():
    """What a captured CUDA graph does, on the CPU: the plan is made once (its arguments
    frozen, the counter among them), then each "replay" runs the counter's advance (the
    device op next_step recorded) and the same plan: its numbers are those of the steps
    after, though the host's step stayed; settle() catches the host up."""
    keys = keys_at(5)
    blocks, rows = counters()
    runs = []
    glue_run = runs.append                      # the glue's launch, kept to replay it
    keys.kernel_numbers(SITE, blocks, rows, np, glue_run)
    (plan,) = runs
    out = plan.args[2]
    for replay in range(1, 4):
        keys.counter += 1                       # the captured next_step's device op
        cuda_cpu.run(plan, cs.source("float32", "philox"))
        want = keys_at(5 + replay).philox_numbers(SITE, blocks, rows, np)
        np.testing.assert_array_equal(out, want, err_msg=f"replay {replay}")
    assert keys.step == keys.count == 5
    keys.settle()
    assert keys.step == keys.count == 8 and keys.counter[0] == 8


BROKEN = {   # name -> (old, new, occurrence) in the "philox" part's source
    "one key bump forgotten": ("k1 += 0xBB67AE85u;", "", 0),
    "the high block word dropped": ("(unsigned int)(b >> 32), (unsigned int)rows[i]",
                                    "0u, (unsigned int)rows[i]", 0),
    "the words in reverse": ("unit24(c[j])", "unit24(c[3 - j])", 0),
    "nine rounds": ("r < 10", "r < 9", 0),
    "the step from the counter's next slot": ("count[0] - lag", "count[1] - lag", 0),
    "the lag added": ("count[0] - lag", "count[0] + lag", 0),
    "the lag ignored": ("count[0] - lag", "count[0]", 0),
}


@pytest.mark.parametrize("name", BROKEN)
def test_broken_philox_kernel_fails(name):
    old, new, n = BROKEN[name]
    src = nth_replaced(cs.source("float32", "philox"), old, new, n)
    failed = failing_orders(functools.partial(check_philox), src)
    assert failed, f"{name}: the broken kernel passed in both orders"


def test_philox_plan_hands_the_kernel_its_declared_types():
    blocks, rows = counters()
    counter, lag = keys_at(3).device_step(np)
    assert counter.dtype == np.int64 and counter.shape == (1,) and lag == 0
    plan, out = ckn.philox_uniforms_launch(np, blocks, rows, (counter, lag), (1, 2))
    assert plan.args[4] is counter                 # the counter itself: read when it runs
    want = {"long long": "int64", "float": "float32"}
    params, args = cs.signature(plan.name), ck.describe(plan.args)
    assert cs.part_of(plan.name) == "philox" and len(params) == len(args)
    for (ctype, pointer), arg in zip(params, args):
        assert arg[:2] == (("array" if pointer else "scalar"), want[ctype]), (ctype, arg)
    assert out.shape == (777, 4) and plan.grid == (4,) and plan.block == (256,)


def test_nvcc_compiles_the_philox_kernel(tmp_path):
    """Where a CUDA toolkit is installed (no GPU needed)."""
    assert ".entry" in cuda_cpu.nvcc_ptx(cs.source("float32", "philox"), tmp_path)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["0", "1"])
def test_dropout_numbers_on_a_gpu_equal_the_hosts(device, kernel, monkeypatch):
    """For the GPU session: a site's numbers on cupy (the xp code: kernel "0"; the Philox
    kernel: "1") equal the host's bit for bit: a whole tensor, a TP slice, a tile
    (python -m pytest -m gpu --device cuda tests/test_cuda_philox_cpu.py)."""
    if device != "cuda":
        pytest.skip("needs --device cuda")
    import cupy
    from minidist.autograd.dropout_keys import DropoutSite
    monkeypatch.setenv("MINIDIST_CUDA_NEW_KERNELS", kernel)
    keys = DropoutKeys(7)
    keys.step = 3
    for site in (DropoutSite(keys, SITE), DropoutSite(keys, SITE, axis=1, parts=2, index=1)):
        shape = (3, 2, 33, 33)
        np.testing.assert_array_equal(cupy.asnumpy(site.random(shape, xp=cupy)),
                                      site.random(shape))
        coords = [np.arange(2), np.arange(5, 21), np.arange(8, 24)]
        np.testing.assert_array_equal(cupy.asnumpy(site.block(shape, coords, cupy)),
                                      site.block(shape, coords))
