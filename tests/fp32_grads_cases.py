"""Shared by the float32-gradient tests (tests/test_fp32_grads.py,
tests/test_fp32_grads_kernels.py): a one-rank group standing in for a strategy's."""


def one_rank(name):
    from mpi4py import MPI
    from minidist.comm import ProcessGroup
    return ProcessGroup(MPI.COMM_SELF, name=name)
