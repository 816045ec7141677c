"""The CUDA kernel counter (minidist/kernel_count.py) and bench_step's "kernels_per_step".

On the CPU: where libcupti is looked for, in order, and bench_step printing null. On a GPU
(python -m pytest -m gpu --device cuda tests/test_kernel_count.py): one elementwise op is one
kernel, and the fused AdamW (minidist/optim/adamw.py) one kernel for a whole flat buffer,
the xp twin many (MINIDIST_CUDA_KERNELS=0).
"""
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from minidist.kernel_count import cupti_candidates

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_cupti_search_order_env_first_then_cuda_home_then_loader(tmp_path):
    lib = tmp_path / "extras" / "CUPTI" / "lib64" / "libcupti.so.12"
    lib.parent.mkdir(parents=True)
    lib.write_bytes(b"")
    found = cupti_candidates({"MINIDIST_CUPTI": "/opt/x/libcupti.so",
                              "CUDA_HOME": str(tmp_path)})
    assert found[0] == "/opt/x/libcupti.so"
    assert str(lib) in found and found.index(str(lib)) > 0
    assert found[-1] == "libcupti.so"                  # the dynamic loader's own search
    assert cupti_candidates({})[0] != "/opt/x/libcupti.so"


def test_cupti_in_a_toolkit_lib_folder_is_found(tmp_path):
    """A toolkit laid out as CUDA 13's wheels are (CUPTI in lib/, no extras/): found after
    MINIDIST_CUPTI, before the loader's bare name."""
    lib = tmp_path / "lib" / "libcupti.so.13"
    lib.parent.mkdir()
    lib.write_bytes(b"")
    found = cupti_candidates({"CUDA_HOME": str(tmp_path)})
    assert str(lib) in found and found.index(str(lib)) < len(found) - 1


@pytest.mark.cpu_only("bench_step on the CPU prints null")
def test_bench_step_reports_no_kernel_count_on_the_cpu():
    out = subprocess.run([sys.executable, "examples/bench_step.py", "--device", "cpu",
                          "--n-layer", "1", "--n-embd", "16", "--n-head", "2",
                          "--block-size", "8", "--batch-size", "2", "--steps", "1",
                          "--warmup", "0", "--threads", "1"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, check=True)
    row = json.loads(out.stdout.strip().splitlines()[-1])
    assert row["kernels_per_step"] is None and row["adamw"] == "flat"


@pytest.mark.gpu
def test_counts_one_kernel_per_elementwise_op_and_one_per_fused_adamw(device, monkeypatch):
    import cupy
    from minidist.kernel_count import KernelCounter
    from minidist.optim import adamw_update
    a = cupy.ones(1000, cupy.float32)
    counter = KernelCounter()
    with counter:
        a + a
    assert counter.count == 1
    p, g, m, v = (cupy.full(4096, 0.5, cupy.float32) for _ in range(4))
    with counter:
        adamw_update(p, g, m, v, 1, 1e-3, weight_decay=0.1)
    assert counter.count == 1
    monkeypatch.setenv("MINIDIST_CUDA_KERNELS", "0")
    with counter:
        adamw_update(p, g, m, v, 2, 1e-3, weight_decay=0.1)
    assert counter.count > 5
    assert os.environ["MINIDIST_CUDA_KERNELS"] == "0" and np.isfinite(float(p[0]))
