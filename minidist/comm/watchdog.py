"""No hangs: a collective that waits too long, or a rank that left, ends the whole job.

`comm.init()` starts one watchdog thread per rank (when there is more than one rank). Every
collective a ProcessGroup runs is announced to it (`entered` / `left`). Once a second it

- aborts the job when a collective has waited longer than the timeout (`comm.init(timeout=)`,
  or MINIDIST_COMM_TIMEOUT seconds; default 600, 0 turns it off). Before aborting it asks the
  group's other ranks which collective of that group they reached (its number and op), so the
  message names the op, the group, the ranks that did not arrive and the ranks that sit in
  another collective at the same number (rank 0 in all_reduce #1, rank 1 in barrier #1: the
  ranks called different collectives);
- aborts the job when a rank that exited (end of script, `sys.exit`, SystemExit: anything
  that runs Python's exit handlers) had not finished a collective this rank is waiting in.
  The exiting rank announces its exit (`announce_exit`) and waits for the others to exit too;
- does the same for a point-to-point send or receive (a pipeline's activations): one that
  waits longer than the timeout, or whose peer exited, aborts the job naming the peer;
- once an untimed wait (`wait_for_all`: a save's commit, the tokenizing wait) outlives the
  timeout, ends the job when a rank answers nothing for `silent_limit_s` (a node frozen);
- answers the other ranks' questions about this rank's progress.

An uncaught exception never gets here: debug.install_abort_handler aborts at once. A killed
rank ends the job through the launcher. All messages travel on the watchdog's own duplicate
of COMM_WORLD. `abort_job` writes the message, then waits a moment before MPI_Abort (so the
launcher forwards it). Tests: tests/test_comm_failures.py, tests/test_comm_misuse.py.
"""
import contextlib
import os
import sys
import threading
import time

from mpi4py import MPI

EXIT, ASK, ANSWER, ALIVE, ALIVE_ANSWER = 11, 12, 13, 14, 15   # tags on the watchdog's comm
POLL_S = 0.5                            # how often the thread looks (stop() wakes it)
ASK_S = 3.0                             # how long a timed-out rank waits for answers
FLUSH_S = 1.0                           # output's head start before MPI_Abort kills
LATER_S = 3.0                           # a rank not the first to abort waits (abort_job)
SILENT_AT_LEAST_S = 10.0                # an untimed wait's peer may be silent this long
MIN_TIMEOUT_S = 1.0                     # the shortest timeout but 0 (check_timeout)
_lock = threading.Lock()
_active = {}      # thread id -> (key, op, seq, start, timed): the collective each thread is in
_progress = {}    # group key -> [entered seq, done seq, op entered]: what ASK answers
_p2p = {}         # thread id -> (label, world rank of the peer, start): a p2p wait
_state = {"comm": None, "thread": None, "stop": threading.Event(), "timeout": 600.0,
          "exited": {}, "answers": {}, "later": None,   # later: abort_job's deferred line
          "asked": {}, "alive": {},   # _check_alive: rank -> (key, seq, when asked) and
#                                       rank -> (when it last answered, its answer)
          "sending": []}              # _send's requests not yet complete

# where the timeout came from, for the abort line: train_gpt.py's flag, the variable, the call
TIMEOUT_FROM = "--comm-timeout, MINIDIST_COMM_TIMEOUT or comm.init(timeout=...)"


def default_timeout(environ=os.environ):
    """MINIDIST_COMM_TIMEOUT in seconds (600 when unset; 0: never abort). A value that is
    not a finite number >= 0 raises ValueError naming it."""
    value = environ.get("MINIDIST_COMM_TIMEOUT", "") or "600"
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds < float("inf"):
        raise ValueError(f"MINIDIST_COMM_TIMEOUT={value!r}: give the seconds a collective may "
                         "wait, a number >= 0 (0: never abort)")
    check_timeout(seconds, f"MINIDIST_COMM_TIMEOUT={value!r}")
    return seconds


def check_timeout(seconds, source):
    """ValueError naming `source` (the flag or variable) unless `seconds` is 0 (never abort)
    or at least MIN_TIMEOUT_S: the thread looks every POLL_S, and a shorter timeout aborted
    healthy jobs at random (--comm-timeout 1e-3: tests/scripts/fuzz_cli.py)."""
    if 0 < seconds < MIN_TIMEOUT_S:
        raise ValueError(f"{source}: give 0 (never abort) or at least {MIN_TIMEOUT_S:g} s; "
                         "the watchdog looks twice a second, so a shorter timeout aborts "
                         "healthy collectives at random")


def abort_job(message, code=1, first=True):
    """Print `message` on stderr, give the launcher time to forward it, abort every rank.
    `first` False (the watchdog's thread only): another rank waiting in the same collective
    says the same and aborts first (the lowest of them); this one notes it and goes on
    answering the others' questions, and says it LATER_S seconds later if that rank has not
    ended the job by then (its own timeout ran from a later start): the job prints it once,
    not once per waiting rank (first-use walk 37)."""
    if not first:
        if _state["later"] is None:
            _state["later"] = (time.monotonic() + LATER_S, message, code)
        return
    sys.stdout.flush()
    sys.stderr.write(message.rstrip("\n") + "\n")
    sys.stderr.flush()
    time.sleep(FLUSH_S)   # Hydra drops output still in its pipes when the abort arrives
    MPI.COMM_WORLD.Abort(code)


# -------------------------------------------------------------------------------------------
# what the groups tell the watchdog
# -------------------------------------------------------------------------------------------

def entered(key, op, seq, timed=True):
    """The calling thread starts collective #seq `op` of the group `key` (name, ranks, n).
    `timed` False: no timeout (ranks waiting while one works alone, as long as it takes:
    ProcessGroup.wait_for_all); a rank that exits before it still ends the job, and so does
    one whose watchdog stops answering once the wait has outlived the timeout (_check_alive)."""
    with _lock:
        _active[threading.get_ident()] = (key, op, seq, time.monotonic(), timed)
        progress = _progress.setdefault(key, [0, 0, ""])
        progress[0], progress[2] = seq, op


def left(key, seq):
    with _lock:
        _active.pop(threading.get_ident(), None)
        _progress.setdefault(key, [0, 0, ""])[1] = seq


@contextlib.contextmanager
def p2p_wait(label, peer):
    """The calling thread waits for a send to or a receive from world rank `peer`."""
    tid = threading.get_ident()
    with _lock:
        _p2p[tid] = (label, peer, time.monotonic())
    try:
        yield
    finally:
        with _lock:
            _p2p.pop(tid, None)


@contextlib.contextmanager
def making_group(key, op):
    """The calling thread makes a group out of the group `key` (`op`: new_group's all-gather
    and MPI_Comm_split, split's): collective over its ranks, and watched as a collective is,
    so a rank frozen (or gone astray) before it ends the job after the timeout; unwatched,
    the others waited there for ever (a review, 2026-11-29). Numbered on a key of its own,
    so the group's collectives keep their numbers."""
    name, ranks, n = key
    made = (f"{name} (making groups)", ranks, n)
    with _lock:
        seq = _progress.get(made, [0])[0] + 1
    entered(made, op, seq)
    try:
        yield
    finally:
        left(made, seq)


def describe(key):
    name, ranks, _ = key
    return f"group {name!r} (world ranks {list(ranks)})"


# -------------------------------------------------------------------------------------------
# the thread
# -------------------------------------------------------------------------------------------

def start(timeout=None):
    """Start the watchdog thread (call once, after MPI_Init, on every rank)."""
    _state["timeout"] = default_timeout() if timeout is None else float(timeout)
    _state["comm"] = MPI.COMM_WORLD.Dup()
    _state["thread"] = threading.Thread(target=_loop, name="minidist-watchdog", daemon=True)
    _state["thread"].start()


def watching():
    """Whether the watchdog runs (comm.init on a job of more than one rank)."""
    return _state["thread"] is not None


def timeout_s():
    """The collective timeout the watchdog holds waits to (0: none, or not watching)."""
    return _state["timeout"] if watching() else 0.0


def stop():
    """Stop the thread and free its communicator (before MPI_Finalize)."""
    if _state["thread"] is not None:
        _state["stop"].set()        # ends the nap (a sleep: each rank's exit waited ~0.5 s)
        _state["thread"].join()
        _state["thread"] = None
        _state["comm"].Free()


def _loop():
    while not _state["stop"].is_set():
        _serve()
        if _state["later"] is None:
            _check_stranded()
            _check_timeouts()
        elif time.monotonic() > _state["later"][0]:      # the first has not ended the job
            abort_job(*_state["later"][1:])
        _state["stop"].wait(POLL_S)


def _serve():
    """Handle every message that has arrived: exit notices, questions and answers."""
    comm, status = _state["comm"], MPI.Status()
    while comm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG, status):
        source, tag = status.Get_source(), status.Get_tag()
        msg = comm.recv(source=source, tag=tag)
        if tag == EXIT:
            _state["exited"][source] = msg
        elif tag in (ASK, ALIVE):
            with _lock:
                answer = list(_progress.get(msg, [0, 0, ""]))
            _send(answer, source, ANSWER if tag == ASK else ALIVE_ANSWER)
        elif tag == ALIVE_ANSWER:
            _state["asked"].pop(source, None)
            _state["alive"][source] = (time.monotonic(), msg)
        else:
            _state["answers"][source] = msg


def _send(obj, dest, tag):
    """Send `obj` to world rank `dest` on the watchdog's communicator without waiting for
    it to be received: a question carries the group's key, whose ranks pickle to ~3 bytes
    each, and a blocking send past MPICH's eager limit (between 4 and 8 KiB on one node: a
    group of ~2,000 ranks) waited for ever on a stopped rank, the watchdog with it, so the
    job hung where it should end (a review, 2026-11-29: comm_small stoppedbig). The
    requests are kept until done (mpi4py's holds the pickled buffer)."""
    _state["sending"] = [r for r in _state["sending"] if not r.Test()]
    _state["sending"].append(_state["comm"].isend(obj, dest=dest, tag=tag))


def _check_stranded():
    """Abort if a rank that exited never finished the collective this rank waits in."""
    with _lock:
        calls = list(_active.values())
    me = MPI.COMM_WORLD.Get_rank()
    for rank, done in list(_state["exited"].items()):
        for key, op, seq, _, _ in calls:
            if rank in key[1] and done.get(key, 0) < seq:
                stayed = [r for r in key[1] if r not in _state["exited"]]
                abort_job(f"[rank {me}] world rank {rank} exited (end "
                          f"of script, sys.exit or SystemExit) after #{done.get(key, 0)} on "
                          f"{describe(key)}, while this rank waits for it in {op} #{seq}; "
                          f"aborting the whole MPI job", first=me == min(stayed))


def _check_p2p():
    """Abort if a point-to-point wait outlived the timeout or its peer exited."""
    with _lock:
        waits = list(_p2p.values())
    now, timeout, me = time.monotonic(), _state["timeout"], MPI.COMM_WORLD.Get_rank()
    for label, peer, start in waits:
        if peer in _state["exited"]:
            abort_job(f"[rank {me}] world rank {peer} exited while this rank waits in "
                      f"{label}; aborting the whole MPI job")
        if timeout > 0 and now - start > timeout:
            abort_job(f"[rank {me}] {label} waited more than {timeout:g} s for world rank "
                      f"{peer} ({TIMEOUT_FROM}); aborting "
                      "the whole MPI job")


def _check_timeouts():
    _check_p2p()
    with _lock:
        calls = list(_active.values())
    now, timeout = time.monotonic(), _state["timeout"]
    me = MPI.COMM_WORLD.Get_rank()
    for key, op, seq, start, timed in calls:
        if timeout > 0 and not timed and now - start > timeout:
            _check_alive(key, op, seq, now, timeout)
        elif timeout > 0 and now - start > timeout:
            answers = _ask_the_others(key)
            abort_job(f"[rank {me}] {op} #{seq} on {describe(key)} "
                      f"waited more than {timeout:g} s ({TIMEOUT_FROM}); "
                      + why_waiting(op, seq, answers)
                      + "; aborting the whole MPI job",
                      first=says_it_first(me, op, seq, answers))


def _check_alive(key, op, seq, now, timeout):
    """An untimed wait (wait_for_all: the ranks wait while others write a checkpoint or
    tokenize, as long as that takes) has outlived the timeout: ask each other rank of the
    group whether it is alive, again every half `silent_limit_s` once it answered. A rank
    whose watchdog answers is alive, however slow its work; one that answers nothing for
    `silent_limit_s` is stopped or hung (a node that froze, SIGSTOP: the others waited for
    it for ever, 2026-11-29's chaos campaign), and the job ends, naming it. Not sooner: a
    rank held a few seconds (swapping, a loaded machine) is not a dead one."""
    me, limit, silent = MPI.COMM_WORLD.Get_rank(), silent_limit_s(timeout), []
    for rank in key[1]:
        if rank == me:
            continue
        asked = _state["asked"].get(rank)
        if asked is not None and asked[:2] == (key, seq):
            if now - asked[2] > limit:
                silent.append(rank)
        elif now - _state["alive"].get(rank, (-limit, None))[0] > limit / 2:
            _state["asked"][rank] = (key, seq, now)
            _send(key, rank, ALIVE)
    if silent:
        answers = {r: None if r in silent else a        # the silent ones' last answers are
                   for r, (_, a) in _state["alive"].items() if r in key[1]}   # no longer true
        many = len(silent) > 1
        abort_job(f"[rank {me}] {op} #{seq} on {describe(key)} has waited more than "
                  f"{timeout:g} s (it has no timeout: {TIMEOUT_FROM} only starts the "
                  f"watchdog asking), and world rank{'s' * many} "
                  f"{', '.join(map(str, silent))} answered nothing for {limit:g} s: stopped "
                  "or hung (a node that froze?); aborting the whole MPI job",
                  first=says_it_first(me, op, seq, answers))


def says_it_first(me, op, seq, answers):
    """Whether this rank (world rank `me`) says why `op` #`seq` waits and ends the job, or
    leaves that to another (abort_job's `first`): the lowest of the ranks waiting in it,
    whose `answers` ({world rank: [entered seq, done seq, op], or None: no answer}) say they
    are in it and not done. A rank that answers nothing says nothing (None), though it
    answered from the wait before it froze: counted, it was the lowest waiting rank to every
    other, none was first and each printed the line (a review, 2026-11-29)."""
    waiting = [r for r, a in answers.items()
               if a is not None and (a[0], a[2]) == (seq, op) and a[1] < seq]
    return me == min([me, *waiting])


def silent_limit_s(timeout):
    """How long an untimed wait's peer may answer nothing before the job ends: the
    timeout, or SILENT_AT_LEAST_S when that is longer (a short --comm-timeout is no reason
    to end a job whose rank was held a few seconds)."""
    return max(float(timeout), SILENT_AT_LEAST_S)


def why_waiting(op, seq, answers):
    """What the other ranks' `answers` ({world rank: [entered seq, done seq, op]} or None for
    no answer) say about this rank waiting in `op` #`seq`: who did not arrive, who is in
    another collective at that number (or past it), who did not answer."""
    late = [r for r, a in answers.items() if a is not None and a[0] < seq]
    silent = [r for r, a in answers.items() if a is None]
    past = {}        # (op, seq) -> the world ranks past this one: late to it, or elsewhere
    elsewhere = {}   # (finished it?, op, seq) -> the world ranks in that one at this number
    for r, a in answers.items():
        if a is not None and a[0] > seq:
            past.setdefault((a[2], a[0]), []).append(r)
        elif a is not None and a[0] == seq and a[2] != op:
            elsewhere.setdefault((a[1] >= a[0], a[2], a[0]), []).append(r)
    parts = [f"world ranks that did not arrive: {late}"] if late else []
    for (other, at), who in past.items():   # (a broadcast's root returns as it sends: walk
        many = len(who) > 1                 # 37's rank 0 came late and went on)
        parts.append(f"world rank{'s' * many} {', '.join(map(str, who))} "
                     f"{'are' if many else 'is'} past it, in {other} #{at}: "
                     f"{'they' if many else 'it'} came late to {op} #{seq}, or called "
                     "another collective there")
    for (finished, other, at), who in elsewhere.items():
        many = len(who) > 1
        verb = ("have finished" if many else "has finished") if finished else \
            ("are in" if many else "is in")
        parts.append(f"world rank{'s' * many} {', '.join(map(str, who))} {verb} {other} #{at} "
                     f"while this rank is in {op} #{seq}")
    if elsewhere:
        parts[-1] += ": the ranks called different collectives"
    if not parts and not silent:
        parts = [f"every rank is in {op} #{seq}: they may disagree on its size, dtype or root "
                 "(MINIDIST_DEBUG=1 checks every collective's signature)"]
    return "; ".join(parts + ([f"ranks that did not answer: {silent}"] if silent else []))


def _ask_the_others(key):
    """Ask the group's other ranks how far they got on `key`: {world rank: their answer,
    [entered seq, done seq, op], or None when none came within ASK_S}."""
    me = MPI.COMM_WORLD.Get_rank()
    others = [r for r in key[1] if r != me]
    _state["answers"].clear()
    for rank in others:
        _send(key, rank, ASK)
    deadline = time.monotonic() + ASK_S
    while time.monotonic() < deadline and len(_state["answers"]) < len(others):
        _serve()
        time.sleep(0.05)
    return {r: _state["answers"].get(r) for r in others}


# -------------------------------------------------------------------------------------------
# leaving
# -------------------------------------------------------------------------------------------

def announce_exit(wait_s=1.0):
    """This rank is exiting: wait for every rank to exit too. If they have not all arrived
    within `wait_s`, tell them (they abort if they wait for this rank) and keep waiting, up
    to the timeout (silent_limit_s: 10 s at least, as a rank slower to exit is no fault:
    --comm-timeout 1e-3 aborted jobs whose ranks all exited with one error line,
    tests/scripts/fuzz_cli.py): a rank still away by then waits where no watchdog sees it
    (in MPI outside a ProcessGroup's calls, or in compute that never ends), so end the job."""
    comm, timeout = _state["comm"], _state["timeout"]
    limit = silent_limit_s(timeout)
    barrier, start, told = comm.Ibarrier(), time.monotonic(), []
    while not barrier.Test():
        if timeout > 0 and time.monotonic() - start > limit:
            abort_job(f"[rank {MPI.COMM_WORLD.Get_rank()}] this rank is exiting, and the "
                      f"others have not exited {limit:g} s later (MINIDIST_COMM_TIMEOUT or "
                      "comm.init(timeout=...), 10 s at least); aborting the whole MPI job")
        if not told and time.monotonic() - start > wait_s:
            with _lock:
                done = {key: p[1] for key, p in _progress.items()}
            told = [comm.isend(done, dest=r, tag=EXIT) for r in range(comm.Get_size())
                    if r != comm.Get_rank()]
            _state["told"] = told   # their buffers must live until MPI_Finalize
        time.sleep(min(0.01, max(0.001, (time.monotonic() - start) / 4)))  # 1 ms up to 10 ms
