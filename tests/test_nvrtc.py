"""Every CUDA kernel part, in every dtype, compiled by NVRTC as CuPy compiles it, on a
machine without a GPU (review 40 compiled them all by hand; the nvcc test of
tests/test_cuda_kernels.py covers the fused part only, where nvcc is installed): no error and
no warning, each kernel within the H100's limits for a block of 1024 threads (64 registers
a thread) and static shared memory without an opt-in (48 KiB). Skipped where NVRTC is not
found (tests/nvrtc_cpu.py says how to give it):

    pip install --target /tmp/nvrtc "nvidia-cuda-nvrtc==13.0.*" "nvidia-cuda-runtime==13.0.*" \\
        "nvidia-cuda-crt==13.0.*"
    MINIDIST_NVRTC_LIB=/tmp/nvrtc/nvidia/cu13/lib/libnvrtc.so.13 \\
    MINIDIST_CUDA_INCLUDE=/tmp/nvrtc/nvidia/cu13/include python -m pytest -q tests/test_nvrtc.py
"""
import pytest

import nvrtc_cpu
from minidist.autograd import cuda_source as cs

DTYPES = ("float16", "bfloat16", "float32", "float64")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("part", sorted(cs.PARTS))
def test_every_part_compiles_under_nvrtc_within_the_limits(part, dtype):
    found = nvrtc_cpu.find()
    if found is None:
        pytest.skip("no NVRTC (MINIDIST_NVRTC_LIB and MINIDIST_CUDA_INCLUDE, or the nvidia "
                    "pip packages)")
    rc, log = nvrtc_cpu.compile_source(*found, cs.source(dtype, part))
    assert rc == 0 and "warning" not in log.lower(), log[-3000:]
    used = nvrtc_cpu.resources(log)
    assert set(used) == set(cs.PARTS[part][1]), sorted(used)
    for name, (registers, shared) in used.items():
        assert registers <= 64 and shared <= 48 * 1024, (name, registers, shared)
