"""minidist: distributed GPT training from first principles on NumPy/CuPy and MPI.

Importing minidist limits BLAS threads per rank (see minidist/backend.py) before numpy loads.
"""
from minidist import backend  # noqa: F401  (sets BLAS threads per rank on import)

__version__ = "0.1.0"
