"""ProcessGroup: a set of ranks, the collectives they run together, and how they run them.

    world = comm.init(algo="ring")                  # every rank (MPI_Init, hooks: once)
    pair = world.new_group([0, 1])                  # every rank, same list; None outside it
    world.all_reduce(grads, op="avg")               # in place, returns when done
    work = world.all_reduce(bucket, async_op=True)  # returns at once ...
    work.wait()                                     # ... done (and bucket reduced) after this

Attributes: `rank`, `size` (in this group), `name`, `algo`, `comm` (the mpi4py communicator),
`ranks` (the group's members as COMM_WORLD ranks, in group order).

Collectives act in place on C-contiguous xp arrays (numpy or cupy; flattened, so think 1-D):
`all_reduce(buf, op)`, `reduce_scatter(out, inp, op)`, `all_gather(out, inp)`,
`broadcast(buf, root)`, `all_to_all(out, inp)`, `all_to_all_v(out, inp, send_counts,
recv_counts)` (alltoall.py), `barrier()` (`wait_for_all()`: one that naps); point-to-point
`send(buf, peer)`, `recv(buf, peer)`.
`op` is "sum", "avg", "max" or "min". Every call takes `async_op`; with True it returns a Work
whose `wait()` finishes it. Every rank of the group must issue the same collectives in the same
order (debug mode checks it: minidist/comm/debug.py). With `sync_comm` (for a debugger:
`world(sync_comm=True)`, MINIDIST_SYNC_COMM=1, train_gpt.py --sync-comm) async_op=True runs the
call at once in the caller's thread and returns a finished Work: no communication thread.

Uneven lengths: reduce_scatter and all_gather cut a length-n buffer with `chunk_bounds(n,
size)` (numpy.array_split's rule: the first n % size ranks get one element more). Rank r's `out`
of reduce_scatter, and `inp` of all_gather, is chunk r: `group.chunk(n)` gives its bounds.
`all_gather(out, out[lo:hi])` (in place) is allowed, and `reduce_scatter(buf[lo:hi], buf)`.

Algorithms, per group: "ring" (minidist/comm/ring.py), "naive" (naive.py), "mpi" (mpi.py),
"hier" (hier.py: all-reduce in the node, across nodes, in the node; the rest as "ring"),
"nccl" (nccl.py, cupy arrays only; imported only when asked for). Communication runs on the
group's private duplicates of `comm` (one for collectives, one for send/recv), never on `comm`
itself, so user traffic on `comm` cannot be mistaken for ours.

Every collective is announced to the watchdog (watchdog.py), which ends the job when one waits
longer than the timeout. An MPI error inside a collective is raised again as
debug.CollectiveFailed naming the call (the ranks probably disagree on it). Misuse that every
rank sees alike (a list for an array, avg on integers, bad new_group ranks) raises before any
communication. Tests: tests/test_comm.py, tests/scripts/comm_check.py and
tests/test_comm_misuse.py.
"""
import os
import sys
import time

from mpi4py import MPI

from minidist.comm import checks, debug, hier, mpi, trace, watchdog
from minidist.comm.algos import algo_for_buffer, algos, module_of
from minidist.comm.channel import Channel
from minidist.comm.ring import chunk_bounds
from minidist.comm.staging import (buffer_plan, cuda_aware_mpi, device_of, host_staging,
                                   post, ready_event, write_back)
from minidist.comm.stream import CompletedWork, RequestWork, Stream
from minidist.backend import is_cupy, xp_of

P2P_TAG = 0
SYNC_COMM_NOTE = (
    "sync comm (--sync-comm, MINIDIST_SYNC_COMM=1): every collective runs in the calling "
    "thread, so a breakpoint in the ring also stops for DDP's gradient buckets. Traded for it: "
    "the overlap of communication with compute (overlapped DDP's bucket all-reduces now block "
    "backward, one after another; ZeRO's reduce-scatters likewise)")
_groups = []  # live groups: their threads must stop before MPI_Finalize (see shutdown_all)
_made = {}    # (name, ranks) -> groups made so far: the same count on every member


class ProcessGroup:
    """The ranks of one mpi4py communicator, with collectives by algorithm `algo`."""

    def __init__(self, comm, algo="ring", name="world", sync_comm=False):
        if algo not in algos():
            raise ValueError(f"algo must be one of {algos()}, not {algo!r} (an algorithm of "
                             "your own: comm.register_algo(name, module) first)")
        self.comm, self.algo, self.name = comm, algo, name
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.ranks = MPI.Group.Translate_ranks(comm.Get_group(), list(range(self.size)),
                                               MPI.COMM_WORLD.Get_group())
        self._coll = comm.Dup()  # collectives, in issue order (the stream's, or the caller's)
        self._p2p = comm.Dup()   # send/recv, which may run beside a queued collective
        self._stream = Stream(f"minidist-comm-{name}")
        # the stream thread calls MPI beside the main thread: that needs THREAD_MULTIPLE
        self._threads_ok = MPI.Query_thread() == MPI.THREAD_MULTIPLE
        self.sync_comm = sync_comm   # True: async_op runs here too, no thread (a debugger)
        self._seq = 0
        self._scratch = {}
        self._inflight = []      # async send/recv Works: their buffers must outlive them
        # the same on every member (groups are made collectively, in the same order), so the
        # watchdog's messages about a group mean the same group on every rank
        _made[(name, tuple(self.ranks))] = _made.get((name, tuple(self.ranks)), 0) + 1
        self.key = (name, tuple(self.ranks), _made[(name, tuple(self.ranks))])
        self._algo = module_of(algo)       # (None for hier and nccl: made below)
        self._nccl = self._hier = None
        if algo == "hier":       # the node split: two more communicators, made here
            self._algo = self._hier = hier.Hierarchy(self._coll, self.ranks,
                                                     hier.ranks_per_node(), self._get_scratch)
        if algo == "nccl":
            from minidist.comm import nccl   # imports cupy: only when asked for
            self._algo, self._nccl = nccl, nccl.NcclComm(self._coll)
        _groups.append(self)

    @classmethod
    def world(cls, algo="ring", sync_comm=None):
        """All ranks (MPI.COMM_WORLD), once MPI is initialised: minidist.comm.init() does it
        (and returns this group; it also installs the abort-on-exception hook).
        `sync_comm` (default: MINIDIST_SYNC_COMM=1 in the environment): run every collective,
        async_op=True ones too, in the calling thread; sub-groups inherit it."""
        if not MPI.Is_initialized() or MPI.Is_finalized():
            raise RuntimeError("MPI is not initialised: call minidist.comm.init() first (the "
                               "entry point's setup; it also installs the abort hooks)")
        if sync_comm is None:
            sync_comm = os.environ.get("MINIDIST_SYNC_COMM", "0") == "1"   # (comm.init checks)
        if sync_comm and MPI.COMM_WORLD.Get_rank() == 0 and not any(g.sync_comm for g in _groups):
            sys.stderr.write(SYNC_COMM_NOTE + "\n")     # once per process
        return cls(MPI.COMM_WORLD, algo, "world", sync_comm)

    def new_group(self, ranks, algo=None, name=None):
        """A group of `ranks` (distinct ranks of this group, in the new group's order).
        Collective: call on every rank of this group with the same list; returns None on
        ranks not in `ranks`. A list that differs between the ranks, a rank outside 0..size-1
        or one given twice raises ValueError on every rank (the lists are all-gathered first,
        one small collective beside the Split, so every rank judges the same lists)."""
        ranks = [int(r) if checks.is_int(r) else r
                 for r in ranks]             # numpy ints as ints: the lists compare alike
        with watchdog.making_group(self.key, "new_group"):   # a rank frozen before it
            checks.check_new_group(self, self.comm.allgather(ranks))   # ends the job
            member = self.rank in ranks
            comm = self.comm.Split(0 if member else MPI.UNDEFINED,
                                   ranks.index(self.rank) if member else 0)
        if not member:
            return None
        return ProcessGroup(comm, algo or self.algo, name or f"{self.name}{ranks}",
                            self.sync_comm)

    def split(self, color, key=None, algo=None, name=None):
        """MPI_Comm_split: ranks with the same `color` form a group, ordered by `key`
        (default: rank here). Collective over this group."""
        with watchdog.making_group(self.key, "split"):
            comm = self.comm.Split(color, self.rank if key is None else key)
        return ProcessGroup(comm, algo or self.algo, name or f"{self.name}/{color}",
                            self.sync_comm)

    def chunk(self, n):
        """(start, stop) of this rank's chunk of a length-n buffer (see chunk_bounds)."""
        return chunk_bounds(n, self.size)[self.rank]

    def algo_text(self, ring_ops=None):
        """The algorithm, for the logs: its name, and under "hier" the node split it runs (or
        why it runs the flat ring, `ring_ops` one reason: hier.Hierarchy.describe)."""
        return self._hier.describe(ring_ops) if self._hier is not None else self.algo

    def __repr__(self):
        return (f"ProcessGroup(name={self.name!r}, algo={self.algo!r}, rank={self.rank}, "
                f"size={self.size}, ranks={self.ranks})")

    # ---------------------------------------------------------------------------------------
    # collectives
    # ---------------------------------------------------------------------------------------

    def _algo_for(self, buf, function):
        """The algorithm module for `buf`: this group's, but on an "nccl" group a host (numpy)
        buffer goes to the MPI library's (algos.algo_for_buffer). A registered module
        without `function` is refused here, before any communication."""
        algo = mpi if algo_for_buffer(self.algo, is_cupy(buf)) == "mpi" else self._algo
        if not hasattr(algo, function):
            raise NotImplementedError(f"algo {self.algo!r} has no {function}(ch, ...): give "
                                      f"its module one, or use a group of another algo")
        return algo

    def all_reduce(self, buf, op="sum", async_op=False):
        """buf = buf reduced over the group (sum, avg, max or min), in place."""
        buf = checks.flat(buf)
        checks.check_op(op, buf, "all_reduce")
        algo = self._algo_for(buf, "all_reduce")
        return self._issue("all_reduce", buf, None, buf.size, async_op, op, 0,
                           lambda ch, out, _: algo.all_reduce(ch, out, op))

    def reduce_scatter(self, out, inp, op="sum", async_op=False):
        """out = chunk `rank` of inp, reduced over the group. out.size == chunk(inp.size)."""
        out, inp = checks.flat(out), checks.flat(inp)
        checks.check_op(op, inp, "reduce_scatter")
        checks.check_chunk(self, "reduce_scatter", "out", out, inp)
        algo = self._algo_for(out, "reduce_scatter")
        return self._issue("reduce_scatter", out, inp, inp.size, async_op, op, 0,
                           lambda ch, o, i: algo.reduce_scatter(ch, o, i, op))

    def all_gather(self, out, inp, async_op=False):
        """out = every rank's inp, concatenated in rank order. inp.size == chunk(out.size)."""
        out, inp = checks.flat(out), checks.flat(inp)
        checks.check_chunk(self, "all_gather", "inp", inp, out)
        algo = self._algo_for(out, "all_gather")
        return self._issue("all_gather", out, inp, out.size, async_op, "", 0,
                           lambda ch, o, i: algo.all_gather(ch, o, i))

    def broadcast(self, buf, root=0, async_op=False):
        """buf = root's buf on every rank (root: a rank of this group)."""
        buf = checks.flat(buf)
        algo = self._algo_for(buf, "broadcast")
        return self._issue("broadcast", buf, None, buf.size, async_op, "", root,
                           lambda ch, out, _: algo.broadcast(ch, out, root))

    def all_to_all(self, out, inp, async_op=False):
        """Chunk j of inp (size/N elements each) to rank j; out = the chunks from every rank."""
        out, inp = checks.flat(out), checks.flat(inp)
        if inp.size % self.size or out.size != inp.size:
            raise ValueError(f"all_to_all: inp ({inp.size}) and out ({out.size}) must have the "
                             f"same size, a multiple of the group size {self.size}; for uneven "
                             f"chunks use all_to_all_v")
        counts = [inp.size // self.size] * self.size
        return self.all_to_all_v(out, inp, counts, counts, async_op)

    def all_to_all_v(self, out, inp, send_counts, recv_counts, async_op=False):
        """inp's first send_counts[0] elements to rank 0, the next send_counts[1] to rank 1,
        ...; out = recv_counts[i] elements from each rank i, in rank order (alltoall.py).
        recv_counts[i] must be rank i's send_counts[rank]. Algorithm: "ring" (and "hier") is
        the pairwise exchange, "naive" relays through rank 0, "mpi" is MPI_Alltoallv, "nccl"
        the pairwise exchange's chunks as one group of NCCL sends and receives."""
        out, inp = checks.flat(out), checks.flat(inp)
        if sum(send_counts) != inp.size or sum(recv_counts) != out.size or \
                len(send_counts) != self.size or len(recv_counts) != self.size:
            raise ValueError(f"all_to_all_v: {self.size} send_counts summing to inp.size "
                             f"({inp.size}) and recv_counts summing to out.size ({out.size}) "
                             f"expected, got {list(send_counts)} and {list(recv_counts)}")
        algo = self._algo_for(out, "all_to_all_v")
        sc, rc = list(send_counts), list(recv_counts)
        return self._issue("all_to_all", out, inp, inp.size, async_op, "", 0,
                           lambda ch, o, i: algo.all_to_all_v(ch, o, i, sc, rc))

    def barrier(self, async_op=False):
        """Return once every rank of the group has reached its barrier."""
        return self._issue("barrier", None, None, 0, async_op, "", 0,
                           lambda ch, out, inp: ch.comm.Barrier())

    def wait_for_all(self, nap_s=0.02):
        """A barrier for ranks that wait while another works alone (the first rank on each
        node tokenizing the text: minidist/train/data_open.py open_data_shared): MPI_Ibarrier,
        then test and nap, 1 ms first, doubling up to `nap_s`, so the waiting ranks leave the
        cores to the working one (MPICH's blocking wait spins). The barrier's rounds move on
        only in a Test: napping `nap_s` from the start, one whose ranks came together took
        40-120 ms (a job's five: ~0.35 s). No timeout (the work takes what it takes), but a
        rank that exits first still ends the job (watchdog.py); a Ctrl-C stops the nap."""
        self._stream.synchronize()
        self._seq += 1
        watchdog.entered(self.key, "wait_for_all", self._seq, timed=False)
        request, nap = self._coll.Ibarrier(), min(0.001, nap_s)
        while not request.Test():
            time.sleep(nap)
            nap = min(2 * nap, nap_s)
        watchdog.left(self.key, self._seq)

    # ---- Python objects (pickled by mpi4py): verdicts, table rows, whole states ------------
    def gather_object(self, obj, root=0):
        """Every rank's `obj`, in rank order, as a list on `root` (None elsewhere)."""
        return self._objects("gather_object", lambda comm: comm.gather(obj, root=root), root)

    def all_gather_object(self, obj):
        """Every rank's `obj`, in rank order, as a list on every rank."""
        return self._objects("all_gather_object", lambda comm: comm.allgather(obj))

    def broadcast_object(self, obj, root=0):
        """`root`'s `obj` on every rank."""
        return self._objects("broadcast_object", lambda comm: comm.bcast(obj, root=root), root)

    def _objects(self, op, call, root=0):
        """A blocking object collective on the collectives' communicator, after everything
        queued, numbered and announced to the watchdog as the others are (a rank that exits
        or never comes ends the job instead of leaving this one waiting), and checked against
        the other ranks' call in debug mode as the array collectives are (first-use walk 43:
        a rank here and another in an array collective's check waited for ever)."""
        self._stream.synchronize()
        self._seq += 1
        watchdog.entered(self.key, op, self._seq)
        if debug.enabled():
            debug.check_same_call(self._coll, self.name, self._seq, op, 0, "", "", root)
        if trace.logging():     # logged, not recorded: the events are the arrays' traffic
            trace.log(f"#{self._seq} {op} group={self.name} (Python objects)")
        out = call(self._coll)
        watchdog.left(self.key, self._seq)
        return out

    def synchronize(self):
        """Wait until every collective and send/recv issued so far on this group finished."""
        self._stream.synchronize()
        for work in self._inflight:
            work.wait()
        self._inflight = []

    def _issue(self, op, out, inp, count, async_op, reduction, root, body):
        """Number the call, then run it: queued on the stream, or here after the queue."""
        self._seq += 1
        args = (self._seq, op, out, inp, count, reduction, root, body, async_op,
                trace.now(), ready_event(out, inp) if async_op else None)
        label = f"{op} #{self._seq} on group {self.name!r}"
        if async_op and self._threads_ok and not self.sync_comm:
            return self._stream.submit(lambda: self._run(*args), label)
        self._stream.synchronize()  # everything issued before this call goes first
        self._run(*args)
        return CompletedWork(label) if async_op else None

    def _run(self, seq, op, out, inp, count, reduction, root, body, is_async, issued, ready):
        """Run one collective: debug check, staging, the algorithm, counters and trace."""
        if ready is not None:
            ready.synchronize()      # the caller's GPU kernels that produce `out`/`inp`
        dtype = "" if out is None else str(out.dtype)
        watchdog.entered(self.key, op, seq)
        with device_of(out):
            if debug.enabled():
                debug.check_same_call(self._coll, self.name, seq, op,
                                      -1 if op == "all_to_all" else count,   # counts differ
                                      dtype, reduction, root)
            nbytes = count * (0 if out is None else out.itemsize)
            trace.count_call(self.name, op, nbytes, nominal=self.algo in ("mpi", "nccl"))
            ch = Channel(self._coll, self.name, op, self._get_scratch, self._nccl)
            start = trace.now()
            try:
                if self.algo == "nccl" or out is None:
                    body(ch, out, inp)
                else:
                    with host_staging(op, out, inp, root=self.rank == root) as (h_out, h_inp):
                        body(ch, h_out, h_inp)
            except MPI.Exception as e:   # costs nothing until MPI fails: say what failed
                watchdog.left(self.key, seq)
                raise debug.failed_in_mpi(self.name, seq, op, count, dtype, e) from e
            end = trace.now()
        watchdog.left(self.key, seq)
        if trace.enabled():
            trace.record(dict(seq=seq, op=op, algo=self.algo, group=self.name, dtype=dtype,
                              bytes=nbytes, issued=issued, start=start, end=end,
                              reduction=reduction, root=root, **{"async": is_async}))

    def _get_scratch(self, slot, n, like):
        """A cached work array per (slot, xp, dtype), grown as needed, never shrunk."""
        xp = xp_of(like)
        key = (slot, xp.__name__, like.dtype.str)
        if key not in self._scratch or self._scratch[key].size < n:
            self._scratch[key] = xp.empty(max(n, 1), dtype=like.dtype)
        return self._scratch[key][:n]

    # ---------------------------------------------------------------------------------------
    # point to point
    # ---------------------------------------------------------------------------------------

    def send(self, buf, peer, async_op=False, tag=P2P_TAG):
        """Send buf to rank `peer` of this group (matched by its recv with the same tag)."""
        buf = checks.flat(buf)
        plan = buffer_plan("send", is_cupy(buf), cuda_aware_mpi())
        request, host = post(plan, buf, lambda handed: self._p2p.Isend(handed, peer, tag))
        return self._p2p_call("send", buf, peer, async_op, request, host)

    def recv(self, buf, peer, async_op=False, tag=P2P_TAG):
        """Receive into buf from rank `peer` of this group (staged: into a host buffer,
        copied back when done; unstaged: the device waited for before MPI writes buf)."""
        buf = checks.flat(buf)
        plan = buffer_plan("recv", is_cupy(buf), cuda_aware_mpi())
        request, host = post(plan, buf, lambda handed: self._p2p.Irecv(handed, peer, tag))
        return self._p2p_call("recv", buf, peer, async_op, request, host,
                              lambda: write_back(buf, host, plan))

    def _p2p_call(self, op, buf, peer, async_op, request, host, on_done=None):
        issued = trace.now()
        if op == "send":
            trace.count_sent(self.name, "send", buf.nbytes)
        trace.count_call(self.name, op, buf.nbytes)

        def done():
            if on_done is not None:
                on_done()
            if trace.enabled():
                trace.record(dict(seq=0, op=op, algo="mpi", group=self.name,
                                  dtype=str(buf.dtype), bytes=buf.nbytes, issued=issued,
                                  start=issued, end=trace.now(), peer=peer,
                                  **{"async": async_op}))
        work = RequestWork(request, f"{op} with rank {peer} of group {self.name!r}", done,
                           peer=self.ranks[peer],     # its world rank, for the watchdog
                           keep=host)                 # the buffer must outlive the request
        if async_op:   # keep it even if the caller drops the handle; forget finished ones
            self._inflight = [w for w in self._inflight if not w.is_completed()] + [work]
            return work
        work.wait()
        return None

    def destroy(self):
        """Stop the stream thread and free the private communicators."""
        self._stream.close()
        if self._hier is not None:
            self._hier.free()
        for comm in (self._coll, self._p2p):
            if comm != MPI.COMM_NULL:
                comm.Free()
        self._coll = self._p2p = MPI.COMM_NULL
        if self in _groups:
            _groups.remove(self)


def shutdown_all():
    """Finish queued work and stop every group's stream thread (comm.init's exit handler calls
    this before MPI_Finalize, which must not run while another thread is inside MPI)."""
    for group in list(_groups):
        group._stream.close()
        for work in group._inflight:
            work.wait()
