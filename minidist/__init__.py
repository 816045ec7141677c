"""minidist: distributed GPT training from first principles on NumPy/CuPy and MPI.

Importing minidist (or any module of it) changes nothing in the process: an entry point sets
up explicitly, in this order (examples/train_gpt.py shows it):

    minidist.launcher.set_thread_env()   # before numpy loads BLAS: threads per rank
    backend.setup(threads, device)       # the live BLAS limit; numpy or cupy, this rank's GPU
    world = comm.init(algo)              # MPI_Init, the abort-on-error hooks, the watchdog
"""
__version__ = "0.1.0"
