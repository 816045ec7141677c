"""What the launcher tells a process before MPI starts: its local rank, the job's size, its cores.

mpiexec (MPICH's Hydra, Open MPI's mpirun) and Slurm's srun put each rank's place in the job
into environment variables. Reading them needs no MPI and no numpy, so an entry point can call
these functions first thing, before numpy loads its BLAS library:

    from minidist.launcher import set_thread_env
    set_thread_env()        # OPENBLAS_NUM_THREADS & co. = cores on this node // ranks on it
    import numpy            # BLAS starts its thread pool with that size

`backend.setup()` then also sets the live limit through the BLAS library (it works after
numpy loaded, but the library's idle threads of the default pool stay around). Once MPI is
up, `bound_threads(all ranks' placement(), rank)` sees ranks the launcher bound to cores of
their own (examples/train_gpt.py then gives each its cores, unless a count was given).

    launcher        local rank (GPU choice)              ranks on this node    ranks in job
    MPICH (Hydra)   MPI_LOCALRANKID                      MPI_LOCALNRANKS       PMI_SIZE
    Open MPI        OMPI_COMM_WORLD_LOCAL_RANK           ..._LOCAL_SIZE        OMPI_COMM_WORLD_SIZE
    PMIx / Cray     PMI_LOCAL_RANK                       PMI_LOCAL_SIZE        PMIX_SIZE
    MVAPICH         MV2_COMM_WORLD_LOCAL_RANK            ..._LOCAL_SIZE        MV2_COMM_WORLD_SIZE
    Slurm srun      SLURM_LOCALID                        SLURM_STEP_TASKS_PER_NODE[SLURM_NODEID]
                                                                               SLURM_STEP_NUM_TASKS
No launcher: rank 0 of 1. Importing this module sets nothing.
Tests: tests/test_backend.py (each launcher's variables; threads per rank under mpiexec).
"""
import os
import socket
import sys

# (local rank, ranks on this node) variables, in lookup order; Slurm's are read last because an
# mpirun started inside an allocation sees both, and mpirun's are the ones that count.
_LOCAL_ENV = (
    ("MPI_LOCALRANKID", "MPI_LOCALNRANKS"),                          # MPICH / Hydra
    ("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),    # Open MPI
    ("PMI_LOCAL_RANK", "PMI_LOCAL_SIZE"),                            # PMIx / Cray
    ("MV2_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_SIZE"),      # MVAPICH's mpirun_rsh
)
_WORLD_ENV = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "MV2_COMM_WORLD_SIZE",
              "SLURM_STEP_NUM_TASKS")
THREAD_ENV = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
              "VECLIB_MAXIMUM_THREADS")


def launcher_rank(environ=os.environ):
    """This process's rank in the job, from the launcher's environment (0 without one):
    known before MPI starts, so an error found before any communication is printed once.
    `environ`: another process's environment (tests/mpirun.py's rank_pids reads one)."""
    for var in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK",
                "SLURM_PROCID"):
        if environ.get(var, "").isdigit():
            return int(environ[var])
    return 0


def interrupted_while_loading():
    """Ctrl-C while an entry point loads numpy, MPI and the package, before run_main can take
    it (minidist/train/cli.py): one line from rank 0 and exit status 130 on every rank,
    without Python's teardown, which an MPI library loaded half-way turned into a traceback
    per rank and a "BAD TERMINATION ... Segmentation fault" report."""
    if launcher_rank() == 0:
        print("interrupted (Ctrl-C) while starting: nothing trained, nothing saved",
              file=sys.stderr, flush=True)
    os._exit(130)


def slurm_tasks_on_node(tasks_per_node, node_id):
    """Tasks on node `node_id` from Slurm's compressed list, e.g. "4(x2),3" -> 4, 4, 3."""
    counts = []
    for item in tasks_per_node.split(","):
        count, _, repeat = item.partition("(x")
        counts += [int(count)] * (int(repeat.rstrip(")")) if repeat else 1)
    return counts[min(node_id, len(counts) - 1)]


def local_rank_and_size(environ=os.environ):
    """(rank among the processes on this node, number of processes on this node).

    Read from the launcher's environment, so it is known before MPI is initialised;
    (0, 1) when not launched by an MPI launcher or srun.
    """
    for rank_var, size_var in _LOCAL_ENV:
        if environ.get(rank_var, "").isdigit():
            rank, size = int(environ[rank_var]), environ.get(size_var, "")
            return rank, max(int(size) if size.isdigit() else 1, rank + 1)
    if environ.get("SLURM_LOCALID", "").isdigit() and "SLURM_STEP_TASKS_PER_NODE" in environ:
        rank = int(environ["SLURM_LOCALID"])
        size = slurm_tasks_on_node(environ["SLURM_STEP_TASKS_PER_NODE"],
                                   int(environ.get("SLURM_NODEID", "0")))
        return rank, max(size, rank + 1)
    return 0, 1


def gpu_sharing_problem(places, what="--comm nccl"):
    """Why the ranks cannot each have a GPU of their own, or None. `places`: per rank, (its
    node's name, its GPU's PCI bus id), all-gathered. NCCL refuses two ranks of a
    communicator on one GPU ("Duplicate GPU detected" from every rank, a traceback each:
    review 40); minidist's own algorithms stage through host memory and share a GPU fine.
    A GPU is told by its bus id, not its index: a rank may see only its own GPU (srun
    --gpus-per-task, CUDA_VISIBLE_DEVICES), where each one's index is 0 (walk 40)."""
    first = {}
    for rank, (host, bus) in enumerate(places):
        if (host, bus) in first:
            ranks = sum(h == host for h, _ in places)
            gpus = len({b for h, b in places if h == host})
            return (f"{what} needs a GPU per rank: on {host} {ranks} ranks share {gpus} "
                    f"GPU(s) (ranks {first[host, bus]} and {rank} both on {bus}), and NCCL "
                    "refuses two ranks on one GPU; start one rank per GPU, or use --comm "
                    "ring or mpi (through host memory)")
        first[host, bus] = rank
    return None


def world_size_from_env(environ=os.environ):
    """Processes in this job, read from the launcher's environment (1 without a launcher)."""
    for var in _WORLD_ENV:
        if environ.get(var, "").isdigit():
            return int(environ[var])
    return 1


def available_cores():
    """Cores this process may run on (its CPU affinity), not the machine's total."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS has no sched_getaffinity
        return os.cpu_count() or 1


def default_threads():
    """BLAS threads per rank: cores on this node shared among the ranks on it, at least 1.
    Where the launcher bound each rank to cores of its own, bound_threads says more, once
    MPI is up."""
    return max(1, available_cores() // local_rank_and_size()[1])


def placement():
    """(host, the cores this process may run on): what bound_threads compares between ranks."""
    try:
        cores = tuple(sorted(os.sched_getaffinity(0)))
    except AttributeError:  # macOS: no affinity to read, so no binding to see
        cores = None
    return socket.gethostname(), cores


def bound_threads(placements, rank):
    """BLAS threads for `rank` when the launcher bound each rank on its host to cores of its
    own (srun's --cpu-bind, Open MPI's --bind-to, Hydra's -bind-to): the cores of its
    affinity mask, which no other rank on the host may run on. None where it shares a core
    with another rank on the host (no binding: default_threads divides the cores), where it
    is alone on the host (default_threads gives it every core already), or where a mask
    cannot be read. `placements`: placement() of every rank, in rank order (an
    all_gather_object's). default_threads alone divides a bound rank's cores again: 8 ranks
    bound to 8 cores each of a 64-core node get 8 // 8 = 1 BLAS thread each (walk 31)."""
    host, mine = placements[rank]
    here = [cores for r, (h, cores) in enumerate(placements) if h == host and r != rank]
    if mine is None or not here or any(cores is None for cores in here):
        return None
    if any(set(cores) & set(mine) for cores in here):
        return None
    return len(mine)


def load_average():
    """The 1-minute load average, or None where the system keeps none (Windows)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def busy_cores_note(threads, load=None, cores=None):
    """A note (a sentence) when `threads` BLAS threads > 1 were chosen for this rank on
    cores other processes already keep busy, else None: OpenBLAS's threads spin waiting for
    each other, so a busy core stalls every matmul (measured on this 2-core machine under a
    load of 6-8: --threads 1 2.4x to 9x faster). `load`: the 1-minute load average
    (load_average() when None), `cores`: available_cores()."""
    if threads is None or threads <= 1:
        return None
    load = load_average() if load is None else load
    if load is None:
        return None
    cores = cores or available_cores()
    if load < cores - 0.5:                      # (this process has not started its work)
        return None
    return (f"the load average is {load:.1f} on {cores} core(s) before training starts: "
            f"other processes keep them busy, and {threads} BLAS threads wait for each "
            f"other on busy cores; if steps are slow, try --threads 1")


def thread_env_problem(environ=os.environ):
    """What is wrong with an exported OPENBLAS_NUM_THREADS (a sentence), or None: unset, or
    a whole number >= 1. set_thread_env leaves a bad one alone (it runs at import, before
    any error can be one line); examples/train_gpt.py's flag checks name it."""
    value = environ.get("OPENBLAS_NUM_THREADS", "")
    if value == "" or (value.isdigit() and int(value) >= 1):
        return None
    return (f"OPENBLAS_NUM_THREADS={value!r}: give the BLAS threads per rank, a whole number "
            "of at least 1 (or unset it; --threads wins over it)")


def set_thread_env(threads=None):
    """Put the BLAS thread count in the environment (read when numpy loads BLAS, and inherited
    by child processes): `threads`, else an exported OPENBLAS_NUM_THREADS, else
    `default_threads()`. Returns the count. An exported value that is not a count, with no
    `threads`, is left as it is, for the entry point's checks to name (thread_env_problem);
    the count returned is then the default."""
    if threads is None and thread_env_problem():
        return default_threads()
    n = str(threads or os.environ.get("OPENBLAS_NUM_THREADS") or default_threads())
    for var in THREAD_ENV:
        os.environ[var] = n
    return int(n)
