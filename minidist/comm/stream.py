"""A communication thread per group: how `async_op=True` makes progress while Python computes.

MPI moves data only while some thread is inside an MPI call. A `Stream` is a worker thread that
runs queued collectives one after another, in the order they were issued (like a CUDA stream,
hence the name). While it sits in a blocking MPI call, mpi4py has released the GIL, so the main
thread keeps running Python and numpy (numpy releases the GIL too); when the call returns, the
worker needs the GIL only for the few lines between two MPI calls.

Ordering is the whole point: every rank must run the same collectives on a communicator in the
same order. The worker keeps the issue order, and a blocking collective first waits for all
queued ones (`synchronize`) and then runs in the caller's thread, so sync and async calls
never interleave, and a debugger stepping into a blocking collective steps into the ring.

A `Work` is the handle: `wait()` blocks until the operation is done and re-raises its error;
`is_completed()` asks without blocking. In a job of several ranks an error in the thread ends
the job at once (the other ranks are inside the same collective, which can no longer finish).

Tests: tests/test_comm.py (async results equal sync ones; wait/is_completed).
"""
import queue
import threading
import time
import traceback

from mpi4py import MPI

from minidist.comm import trace, watchdog
from minidist.comm.progress import wait_all


class Work:
    """Handle of one queued operation."""

    def __init__(self, label=""):
        self.label = label
        self._done = threading.Event()
        self._error = None

    def wait(self, timeout=None):
        """Block until done; re-raise the operation's exception, if any. True when done."""
        if not self._done.wait(timeout):
            return False
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self):
        return self._done.is_set()

    def _finish(self, error=None):
        self._error = error
        self._done.set()


class CompletedWork(Work):
    """A handle for work that already ran (async requested where threads are not allowed)."""

    def __init__(self, label=""):
        super().__init__(label)
        self._done.set()


class Stream:
    """One worker thread running submitted callables in order. Started on first use."""

    def __init__(self, name):
        self.name = name
        self._queue = queue.SimpleQueue()
        self._thread = None
        self._last = None

    def submit(self, fn, label=""):
        """Queue `fn()`; returns its Work."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
            self._thread.start()
        work = Work(label)
        self._last = work
        self._queue.put((fn, work))
        return work

    def synchronize(self):
        """Wait until everything submitted so far has run (errors stay with their Work)."""
        if self._last is not None:
            self._last._done.wait()

    def close(self):
        """Finish queued work and stop the thread (before MPI_Finalize, which must not run
        while another thread is still inside MPI)."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None

    def _loop(self):
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, work = item
            try:
                fn()
                work._finish()
            except BaseException as e:
                failure = "".join(traceback.format_exception(e))
                if watchdog.watching():   # the other ranks are in it, or will be: none can
                    watchdog.abort_job(   # finish it, so end the job now, as for the main
                        f"[rank {MPI.COMM_WORLD.Get_rank()}] asynchronous {work.label} "
                        f"failed on this rank:\n{failure}"
                        "aborting the whole MPI job")   # thread's uncaught exceptions
                trace.log(f"asynchronous {work.label} failed (raised again by wait()):\n"
                          + failure)      # one process: kept for wait(), shown now too
                work._finish(e)


class RequestWork(Work):
    """Handle of a non-blocking MPI point-to-point request (Isend/Irecv); `on_done` runs once,
    after completion (copying a staged receive back to the GPU, recording the trace event);
    `keep`: a buffer the request reads or writes, held until the handle goes (a host copy)."""

    def __init__(self, request, label="", on_done=None, peer=None, keep=None):
        super().__init__(label)
        self.request, self._on_done, self.peer, self.keep = request, on_done, peer, keep

    def wait(self, timeout=None):
        if timeout is None:
            with watchdog.p2p_wait(self.label, self.peer):  # a peer that never comes: abort
                wait_all([self.request])
        elif not self._test_until(timeout):
            return False
        self._complete()
        return True

    def is_completed(self):
        if not self._done.is_set() and self.request.Test():
            self._complete()
        return self._done.is_set()

    def _test_until(self, timeout):
        deadline = time.monotonic() + timeout
        while not self.request.Test():
            if time.monotonic() > deadline:
                return False
            time.sleep(1e-4)
        return True

    def _complete(self):
        if not self._done.is_set():
            if self._on_done is not None:
                self._on_done()
            self._finish()
