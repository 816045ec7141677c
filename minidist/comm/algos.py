"""The collective algorithms a ProcessGroup can be built with: minidist's (ALGOS: ring.py,
naive.py, mpi.py, hier.py, nccl.py) and modules of your own (register_algo).

An algorithm module has ALGO_FUNCTIONS' functions, or some of them (a group refuses the
others before any communication), each taking the group's Channel (channel.py: counted,
traced send/recv/sendrecv, scratch buffers) first, as ring.py's do:
    all_reduce(ch, buf, op)                    buf reduced over the group, in place
    reduce_scatter(ch, out, inp, op)           out = chunk ch.rank of inp, reduced
    all_gather(ch, out, inp)                   out = every rank's inp, in rank order
    broadcast(ch, buf, root)                   buf = root's
    all_to_all_v(ch, out, inp, send_counts, recv_counts)
Chunks are chunk_bounds(n, size)'s. `out` may be inp's own chunk (ZeRO reduce-scatters its
gradient buffer in place, all-gathers its parameters from their own shard): read a chunk of
inp before writing out (walk 40: an out zeroed first broke ZeRO, 6e-2 off, while DDP passed).
A broadcast must not read a non-root's buf before writing it: on GPUs without CUDA-aware MPI
it is handed an empty host copy there (comm/staging.py buffer_plan).
op "avg" is a sum divided by the group's size. Every rank must register the same module under
the same name: nothing can compare them.
Tests: tests/test_own_algorithm.py (a recursive-doubling all-reduce and broadcast registered
and run).
"""
from minidist.comm import mpi, naive, ring

ALGOS = ("ring", "naive", "mpi", "hier", "nccl")
ALGO_FUNCTIONS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all_v")
_registered = {}   # name -> a module of your own, beside ALGOS


def register_algo(name, module):
    """Make `module` a collective algorithm groups can be built with (`comm.init(name)`,
    `ProcessGroup(comm, name)`, examples/bench_collectives.py `--algos`). Every rank
    registers the same before building a group of it."""
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"register_algo: the name {name!r} must be a word (letters, digits, _)")
    if name in ALGOS:
        raise ValueError(f"register_algo: {name!r} is minidist's own; give another name")
    if _registered.get(name, module) is not module:
        raise ValueError(f"register_algo: {name!r} is registered already, to "
                         f"{_registered[name]!r}; give another name")
    if not any(callable(getattr(module, f, None)) for f in ALGO_FUNCTIONS):
        raise TypeError(f"register_algo: {module!r} has none of {', '.join(ALGO_FUNCTIONS)}")
    _registered[name] = module


def algos():
    """The algorithms a group can be built with: ALGOS, then the registered ones."""
    return ALGOS + tuple(_registered)


def module_of(algo):
    """The module of algorithm `algo` (None for "hier" and "nccl", which a group builds)."""
    return {"ring": ring, "naive": naive, "mpi": mpi}.get(algo) or _registered.get(algo)


def algo_for_buffer(algo, on_device):
    """The algorithm a group of `algo` runs a collective on a buffer with: its own, but on
    an "nccl" group a host buffer (`on_device` False), which NCCL cannot take, goes to the
    MPI library's, "mpi" (nccl.py's docstring; strategy.base.any_rank_of relies on it)."""
    return "mpi" if algo == "nccl" and not on_device else algo
