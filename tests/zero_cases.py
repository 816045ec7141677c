"""Shared by the ZeRO tests (tests/test_zero.py, test_zero_checkpoint.py, test_zero_hooks.py):
the model, seed and batches of tests/scripts/zero_check.py, which their in-process checks use
as its mpiexec runs do."""
import os
import sys

from mpirun import ROOT

sys.path.insert(0, os.path.join(ROOT, "tests", "scripts"))
from zero_check import CONFIG, SEED, batch  # noqa: E402

__all__ = ["CONFIG", "SEED", "batch"]
