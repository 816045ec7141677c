"""Point to point between pipeline stages: `StageLink`, this rank's place in the pp group.

    GPipe, 1F1B         stage s talks to s-1 and s+1 only; the steady state's two opposite
                        exchanges are single calls that post both and wait for both
    interleaved 1F1B,   the ring methods (isend_*, recv_*_chunk). Under interleaving a rank
    ZB-H1               holds v chunks, virtual stage k = chunk * p + rank, so the last rank
                        sends chunk c's output to rank 0's chunk c+1 (a ring; ZB-H1 is the
                        ring with v = 1). Sends are posted and waited for at the end of the
                        step, receives block: a send never waits for its receive, so any order
                        of sends and receives that the schedule's data flow allows runs
                        without deadlock (the simulator's queues have the same semantics), and
                        ZB-H1 can run a W between sending a gradient and receiving the next
                        input. Tags name (direction, chunk, micro-batch), so with 2 ranks the
                        two directions to one peer cannot mix.

Every stage knows the boundary activation's shape and dtype (`expect`), so no message carries
a shape. `VERBOSE=1` logs every send and receive. Tests: tests/test_pipeline.py.
"""
import os

from minidist.autograd import Tensor
from minidist.comm import trace


def verbose():
    return os.environ.get("VERBOSE", "0") == "1"      # (a common name: other values, off)


class StageLink:
    """This rank's place in the pipeline (pp `group`) and its sends/receives to neighbours.

    `expect(shape, dtype, xp)` fixes the boundary activation's shape for this step; receives
    allocate that, so no message carries a shape. On the first stage `recv_forward` returns
    None and `send_backward` does nothing; on the last, `send_forward` / `recv_backward`."""

    def __init__(self, group, n_chunks=1):
        self.group, self.stage, self.n_stages = group, group.rank, group.size
        self.n_chunks, self.posted = n_chunks, []      # chunks per rank; sends not waited
        self.first, self.last = self.stage == 0, self.stage == self.n_stages - 1
        self.shape = self.dtype = self.xp = None

    def __repr__(self):
        """For a debugger in a schedule (`p link`): which stage, its neighbours, the shape."""
        return (f"StageLink(stage {self.stage} of {self.n_stages}, {self.n_chunks} chunk(s) a "
                f"rank, {len(self.posted)} send(s) not waited, activations {self.shape} "
                f"{self.dtype})")

    def expect(self, shape, dtype, xp):
        self.shape, self.dtype, self.xp = tuple(shape), dtype, xp

    def _log(self, what, peer, i):
        if verbose():
            arrow = "->" if what.startswith("send") else "<-"
            trace.log(f"stage {self.stage} {what:13s} micro-batch {i:2d} {arrow} stage {peer} "
                      f"{self.shape} {self.dtype}")

    def _start(self, kind, buf, peer, i):
        self._log(kind, peer, i)
        if kind.startswith("recv"):
            return self.group.recv(buf, peer, async_op=True)
        return self.group.send(self._checked(kind, buf, peer), peer, async_op=True)

    def _checked(self, kind, buf, peer):
        if tuple(buf.shape) != self.shape or buf.dtype != self.dtype:   # no shape messages:
            raise ValueError(f"stage {self.stage} would {kind} {tuple(buf.shape)} {buf.dtype} "
                             f"but stage {peer} expects {self.shape} {self.dtype}")
        return self.xp.ascontiguousarray(buf)

    def _exchange(self, send=None, recv=None):
        """Post (kind, buf, peer, i) sends and receives together, then wait for all."""
        works = [self._start(*s) for s in (send, recv) if s is not None]
        for w in works:
            w.wait()

    def _empty(self):
        return self.xp.empty(self.shape, dtype=self.dtype)

    def recv_forward(self, i):
        """Micro-batch i's input activation from the previous stage (None on the first)."""
        if self.first:
            return None
        buf = self._empty()
        self._exchange(recv=("recv forward", buf, self.stage - 1, i))
        return Tensor(buf, requires_grad=True)

    def send_forward(self, out, i):
        if not self.last:
            self._exchange(send=("send forward", out.data, self.stage + 1, i))

    def recv_backward(self, i):
        """dL/d(output) of micro-batch i from the next stage (None on the last)."""
        if self.last:
            return None
        buf = self._empty()
        self._exchange(recv=("recv backward", buf, self.stage + 1, i))
        return buf

    def send_backward(self, grad, i):
        if not self.first:
            self._exchange(send=("send backward", grad, self.stage - 1, i))

    def send_forward_recv_backward(self, out, i_send, i_recv):
        """Steady state, after a forward: output of i_send out, gradient of i_recv in."""
        if self.last:
            return None
        buf = self._empty()
        self._exchange(send=("send forward", out.data, self.stage + 1, i_send),
                       recv=("recv backward", buf, self.stage + 1, i_recv))
        return buf

    def send_backward_recv_forward(self, grad, i_send, i_recv):
        """Steady state, after a backward: gradient of i_send out, input of i_recv in."""
        if self.first:
            return None
        buf = self._empty()
        self._exchange(send=("send backward", grad, self.stage - 1, i_send),
                       recv=("recv forward", buf, self.stage - 1, i_recv))
        return Tensor(buf, requires_grad=True)

    # ---- the ring of virtual stages (interleaved 1F1B) ------------------------------------
    def _tag(self, direction, chunk, i):
        """A tag per (direction, receiving chunk, micro-batch); 0 is the plain links' tag."""
        return 1 + 2 * (i * self.n_chunks + chunk) + (direction == "bwd")

    def isend_forward(self, out, i, chunk):
        """Chunk `chunk`'s output of micro-batch i to the next virtual stage (posted; nothing
        on the very last one)."""
        if self.last and chunk == self.n_chunks - 1:
            return
        to_chunk = chunk + 1 if self.last else chunk
        self._post("send forward", out.data, (self.stage + 1) % self.n_stages, i,
                   self._tag("fwd", to_chunk, i))

    def isend_backward(self, grad, i, chunk):
        """dL/d(chunk's input) of micro-batch i to the previous virtual stage (posted)."""
        if self.first and chunk == 0:
            return
        to_chunk = chunk - 1 if self.first else chunk
        self._post("send backward", grad, (self.stage - 1) % self.n_stages, i,
                   self._tag("bwd", to_chunk, i))

    def recv_forward_chunk(self, i, chunk):
        """Chunk `chunk`'s input of micro-batch i (None on the very first virtual stage)."""
        if self.first and chunk == 0:
            return None
        buf = self._empty()
        self._wait_recv("recv forward", buf, (self.stage - 1) % self.n_stages, i,
                        self._tag("fwd", chunk, i))
        return Tensor(buf, requires_grad=True)

    def recv_backward_chunk(self, i, chunk):
        """dL/d(chunk's output) of micro-batch i (None on the very last virtual stage)."""
        if self.last and chunk == self.n_chunks - 1:
            return None
        buf = self._empty()
        self._wait_recv("recv backward", buf, (self.stage + 1) % self.n_stages, i,
                        self._tag("bwd", chunk, i))
        return buf

    def _post(self, kind, buf, peer, i, tag):
        self._log(kind, peer, i)
        self.posted.append(self.group.send(self._checked(kind, buf, peer), peer,
                                           async_op=True, tag=tag))

    def _wait_recv(self, kind, buf, peer, i, tag):
        self._log(kind, peer, i)
        self.group.recv(buf, peer, tag=tag)

    def wait_sends(self):
        """Every send posted this step has been received (end of the schedule)."""
        for work in self.posted:
            work.wait()
        self.posted = []
