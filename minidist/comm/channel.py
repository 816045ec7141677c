"""The point-to-point calls the hand-written collectives make, counted and logged in one place.

`ring.py` and `naive.py` never touch MPI directly: they call `ch.sendrecv`, `ch.send` and
`ch.recv` on a `Channel`, which adds the bytes this rank sends to `trace` counters (so the
counters are what really went to MPI, not a formula) and, under `MINIDIST_TRACE=2`, logs each
step. Every wait goes through `progress.wait_all`, which decides between MPI's spinning wait
and polling that lets other ranks have the core (cores shared with other work). A `Channel`
lives for one collective call: it knows the group, the op being run, and where the group keeps
its scratch buffers.

Tests: tests/test_comm.py (bytes counted by the channel equal the ring's theory).
"""
from mpi4py import MPI

from minidist.comm import trace
from minidist.comm.progress import wait_all
from minidist.comm.staging import device_ready, wire

COLL_TAG = 7  # collectives on the group's private communicator; p2p uses another communicator


class Channel:
    """Send/receive for one collective `op` on one group's communicator `comm`."""

    def __init__(self, comm, group, op, scratch=None, nccl=None):
        self.comm, self.group, self.op = comm, group, op
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.nccl = nccl            # the group's NCCL communicator, for algo "nccl"
        self._scratch = scratch     # callable (slot, n, like) -> array, owned by the group

    def __repr__(self):
        """For a debugger in ring.py (`p ch`): the collective, the group, this rank of it."""
        return (f"Channel({self.op!r} on group {self.group!r}, rank {self.rank} of "
                f"{self.size})")

    def sendrecv(self, sendbuf, dest, recvbuf, source, note=""):
        """Send `sendbuf` to `dest` while receiving `recvbuf` from `source` (either may be
        MPI.PROC_NULL). Both at once, so a ring of blocking calls cannot deadlock: MPI_Sendrecv,
        written as Irecv + Isend + wait so that the wait can be polite. (`wire`: bfloat16
        travels as its uint16 view; the caller adds the bfloat16 arrays.) The device first:
        queued kernels may still write `sendbuf`, or read `recvbuf` (a reused scratch, which
        a CUDA-aware MPI would write under them: review 43)."""
        device_ready(sendbuf, recvbuf)
        wait_all([self.comm.Irecv(wire(recvbuf), source, COLL_TAG),
                  self.comm.Isend(wire(sendbuf), dest, COLL_TAG)])
        sent = sendbuf.nbytes if dest != MPI.PROC_NULL else 0
        trace.count_sent(self.group, self.op, sent)
        if trace.log_steps():
            trace.log(f"{self.op} {note}: sent {sent} B to {dest}, received "
                      f"{recvbuf.nbytes if source != MPI.PROC_NULL else 0} B from {source}")

    def send(self, buf, dest, note=""):
        device_ready(buf)
        wait_all([self.comm.Isend(wire(buf), dest, COLL_TAG)])
        trace.count_sent(self.group, self.op, buf.nbytes)
        if trace.log_steps():
            trace.log(f"{self.op} {note}: sent {buf.nbytes} B to {dest}")

    def recv(self, buf, source, note=""):
        device_ready(buf)             # (queued kernels may still read it: sendrecv's note)
        wait_all([self.comm.Irecv(wire(buf), source, COLL_TAG)])
        if trace.log_steps():
            trace.log(f"{self.op} {note}: received {buf.nbytes} B from {source}")

    def count_nominal(self, nbytes):
        """For library collectives (mpi, nccl): bytes we cannot see, as the ring would send."""
        trace.count_sent(self.group, self.op, nbytes, nominal=True)

    def scratch(self, slot, n, like):
        """A reusable array of `n` elements like `like` (same xp and dtype), never freshly
        allocated per call: a fresh 16 MiB numpy array costs thousands of page faults."""
        return self._scratch(slot, n, like)
