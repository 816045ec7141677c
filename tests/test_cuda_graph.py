"""examples/bench_step.py --cuda-graph: one GPT step captured as a CUDA graph and replayed.

On the CPU: which steps it refuses to capture, and why (`graph_refusal`: a graph freezes every
kernel argument, so the step may neither read the device nor hand a kernel a number the host
changes each step; dropout is captured, its step on the device), the one-line error, and
that a multi-tensor address table is never made on numpy under the capture guard. On a GPU
(python -m pytest -m gpu --device cuda tests/test_cuda_graph.py): the replayed run's loss
equals the eager run's after the same steps, with no host read per step, with dropout too
(replay after replay, each step's masks its own), and a table made during a capture is
refused.
"""
import argparse
import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from minidist.optim import multi_tensor as mt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--block-size", "8",
         "--batch-size", "2", "--threads", "1"]


def bench_module():
    spec = importlib.util.spec_from_file_location(
        "bench_step", os.path.join(ROOT, "examples", "bench_step.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def flags(**kw):
    args = {"cuda_graph": True, "amp": True, "dropout": 0.0, "moe_experts": 0}
    args.update(kw)
    return argparse.Namespace(**args)


def test_graph_refusals_name_what_a_graph_would_freeze(monkeypatch):
    refusal = bench_module().graph_refusal
    monkeypatch.setenv("MINIDIST_CUDA_NEW_KERNELS", "1")
    assert refusal(flags(cuda_graph=False), "cpu") is None
    assert "needs --device cuda" in refusal(flags(), "cpu")
    assert refusal(flags(), "cuda") is None
    assert "--amp with MINIDIST_CUDA_NEW_KERNELS=1" in refusal(flags(amp=False), "cuda")
    assert refusal(flags(dropout=0.1), "cuda") is None      # the masks' step on the device
    monkeypatch.setenv("MINIDIST_CUDA_NEW_KERNELS", "0")
    assert "would freeze them" in refusal(flags(), "cuda")
    assert refusal(flags(moe_experts=4), "cuda").startswith(
        "--cuda-graph cannot capture a Mixture of Experts step")     # its routing reads the host


def test_cuda_graph_on_the_cpu_is_one_error_line():
    out = subprocess.run([sys.executable, "examples/bench_step.py", "--device", "cpu",
                          "--cuda-graph", *SMALL], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip() == ("error: --cuda-graph needs --device cuda (CUDA graphs are "
                                  "a GPU feature)")


def test_numpy_tables_pass_the_capture_guard_and_are_counted_when_made():
    """The guard asks CuPy only for cupy tables: numpy ones are made as before. tables_made
    counts the tables made, not those found in the cache (captured() warms up until a step
    makes none)."""
    a = [np.ones(3, np.float32), np.ones(5, np.float32)]
    assert mt.address_table(np, a).dtype == np.uint64
    made = mt.tables_made()
    sizes = (3, 5, 7919)             # a key no other test makes (tables are cached by key)
    assert len(mt.chunk_tables(np, sizes, 2)[2]) == 2 + 3 + 3960
    assert mt.tables_made() == made + 1
    mt.address_table(np, a), mt.chunk_tables(np, sizes, 2)       # cached: none made
    assert mt.tables_made() == made + 1


# ---- on a GPU ------------------------------------------------------------------------------

def bench_row(*extra):
    env = dict(os.environ, MINIDIST_CUDA_NEW_KERNELS="1")
    out = subprocess.run([sys.executable, "examples/bench_step.py", "--device", "cuda",
                          "--amp", "--steps", "4", "--warmup", "2", *SMALL, *extra], cwd=ROOT,
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.gpu
def test_gpu_a_replayed_step_is_the_eager_step(device):
    if device != "cuda":
        pytest.skip("needs --device cuda")
    eager, graph = bench_row(), bench_row("--cuda-graph")
    assert graph["cuda_graph"] and graph["host_reads_per_step"] == 0
    assert eager["host_reads_per_step"] == 0          # the --amp verdict on the device
    assert np.isfinite(graph["loss"]) and graph["loss"] == pytest.approx(eager["loss"],
                                                                       rel=1e-3)


@pytest.mark.gpu
def test_gpu_a_replayed_step_with_dropout_is_the_eager_step(device):
    """bench_step with --dropout 0.1: the graph run's last loss and the step its masks were
    drawn for (read back from the device counter) are the eager run's."""
    if device != "cuda":
        pytest.skip("needs --device cuda")
    eager, graph = bench_row("--dropout", "0.1"), bench_row("--dropout", "0.1", "--cuda-graph")
    assert graph["host_reads_per_step"] == 0 and graph["dropout_step"] == eager["dropout_step"]
    assert np.isfinite(graph["loss"]) and graph["loss"] == pytest.approx(eager["loss"],
                                                                       rel=1e-3)


def amp_gpt_step(dropout, seed=0):
    """(one_step, keys) of bench_step's step on cupy: a 2-layer GPT under --amp (bfloat16),
    FlatAdamW, a fixed batch; one_step returns the loss Tensor."""
    from minidist import backend
    from minidist.nn import GPT, GPTConfig
    from minidist.optim import FlatAdamW
    from minidist.train.amp import MixedPrecision
    config = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64,
                       dropout=dropout, attention="tiled", vocab_multiple=64)
    model = GPT(config, seed=seed, dtype="float32")
    amp = MixedPrecision(dtype="bfloat16")
    amp.cast_model(model)
    opt = amp.optimizer(model.named_parameters(), lambda named: FlatAdamW(named, lr=1e-3))
    r = np.random.default_rng(seed)
    x, y = (backend.to_device(r.integers(0, 64, (4, 16))) for _ in range(2))

    def one_step():
        _, loss = model(x, y)
        amp.backward(loss)
        opt.clip_grad_norm(1.0)
        opt.step()
        opt.zero_grad()
        return loss
    return one_step, model.dropout_keys


@pytest.mark.gpu
@pytest.mark.bfloat16
def test_gpu_each_replay_with_dropout_is_its_eager_step(device, monkeypatch):
    """A captured step with dropout 0.1 (tiled attention: the flash kernels' masks, the
    Philox kernel's on the residual sites), replay after replay, against an eager twin:
    the same loss each step (float32 tolerance, 1e-4 relative: the same kernels on the same
    numbers), losses that move (new masks and weights every step), and the keys settled
    at the eager twin's step."""
    if device != "cuda":
        pytest.skip("needs --device cuda")
    monkeypatch.setenv("MINIDIST_CUDA_NEW_KERNELS", "1")
    steps = 14                     # the warm-up takes 2 to 10 eager steps: 4 replays or more
    eager_step, eager_keys = amp_gpt_step(0.1)
    eager = [float(eager_step().item()) for _ in range(steps)]
    graph_step, graph_keys = amp_gpt_step(0.1)
    replay, done = bench_module().captured(graph_step, 2, steps)
    replays = [float(replay().item()) for _ in range(steps - done)]    # steps done+1 ..
    assert replays == pytest.approx(eager[done:], rel=1e-4), (done, replays, eager)
    assert len(set(replays)) == len(replays) >= 4
    graph_keys.settle()
    assert graph_keys.step == eager_keys.step == steps


@pytest.mark.gpu
def test_gpu_a_table_made_while_capturing_is_refused(device):
    if device != "cuda":
        pytest.skip("needs --device cuda")
    import cupy
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        try:       # sizes no other test uses: an address table could be a cached one (the
            #        pool hands out the addresses of freed arrays again)
            with pytest.raises(RuntimeError, match="during CUDA graph capture"):
                mt.chunk_tables(cupy, (7, 9, 4099), 61)
        finally:
            stream.end_capture()
