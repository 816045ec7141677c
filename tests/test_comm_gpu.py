"""Collectives on GPU buffers: host staging (ring, naive, mpi) and NCCL.

Marked gpu: run with `python -m pytest -m gpu --device cuda` on a machine with cupy and GPUs.
NCCL needs one GPU per rank, so its test is skipped on a single-GPU machine.
Not run on the development machine (no GPU there); the bfloat16 check runs on numpy there
(tests/test_bfloat16.py).
"""
import pytest

from mpirun import mpi_env, run_mpi

pytestmark = [pytest.mark.gpu, pytest.mark.mpi]


def _gpus():
    from minidist.backend import cupy_module
    cp = cupy_module()
    return cp.cuda.runtime.getDeviceCount() if cp is not None else 0


def test_staged_collectives_on_gpu():
    """MINIDIST_DEVICE=cuda mpiexec -n 2 python tests/scripts/comm_gpu_check.py ring,naive,mpi"""
    if _gpus() < 1:
        pytest.skip("needs cupy and a GPU")
    out = run_mpi(2, "tests/scripts/comm_gpu_check.py", "ring,naive,mpi", timeout=300,
                  env=mpi_env(MINIDIST_DEVICE="cuda"))
    assert out.stdout.count("comm_gpu_check OK") == 3


def test_nccl_collectives():
    """MINIDIST_DEVICE=cuda mpiexec -n 2 python tests/scripts/comm_gpu_check.py nccl"""
    if _gpus() < 2:
        pytest.skip("NCCL needs one GPU per rank: at least 2 GPUs")
    out = run_mpi(2, "tests/scripts/comm_gpu_check.py", "nccl", timeout=300,
                  env=mpi_env(MINIDIST_DEVICE="cuda"))
    assert "comm_gpu_check OK: nccl" in out.stdout


def test_bfloat16_collectives_on_gpu():
    """MINIDIST_DEVICE=cuda mpiexec -n 2 python tests/scripts/comm_bf16_check.py ring,naive,mpi
    (cupy bfloat16 buffers, staged or CUDA-aware: uint16 views on the wire)"""
    if _gpus() < 1:
        pytest.skip("needs cupy and a GPU")
    out = run_mpi(2, "tests/scripts/comm_bf16_check.py", "ring,naive,mpi", timeout=300,
                  env=mpi_env(MINIDIST_DEVICE="cuda"))
    assert out.stdout.count("comm_bf16_check OK") == 3
