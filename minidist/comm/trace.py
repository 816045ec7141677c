"""Seeing the collectives: byte counters, a per-rank event log, and a merged Chrome trace.

Three things, all per process (per rank):

- **Counters**, always on: for every (group, op), how many calls, how many payload bytes, and
  how many bytes this rank actually handed to MPI as a sender. For `ring` and `naive` the bytes
  are counted at each point-to-point call, so they are what went on the wire; for `mpi` and
  `nccl` the library's own traffic cannot be seen from Python, so the count is what the ring
  would send for the same call and the entry says `"nominal": True`. Reset them once per
  training step to get bytes per step. DDP checks `bytes_sent == 2(N-1)/N x gradient bytes`.
- **Events**, when tracing is on (`MINIDIST_TRACE=1` or `enable()`): one record per
  collective with sequence number, op, algorithm, group, dtype, bytes, issue/start/end time;
  the last `MAX_EVENTS` of them (a long run's trace is its end, `kept_note` says what fell out).
  `MINIDIST_TRACE=1` also logs one line per collective to stderr; `MINIDIST_TRACE=2` also logs
  every point-to-point step of the ring (which chunk went where), picotron's `VERBOSE=1`.
- **A Chrome trace**: `write_chrome_trace(path, group)` gathers every rank's events to the
  group's rank 0 and writes one JSON file, one process row per rank and one thread row per
  group, that chrome://tracing or https://ui.perfetto.dev opens.

Tests: tests/test_comm.py (counters against 2(N-1)/N, the Chrome trace file).
"""
import collections
import contextlib
import json
import os
import sys
import threading
import time

_lock = threading.Lock()          # worker threads of several groups update the same tables
_counters = {}                    # (group name, op) -> {"calls", "bytes", "bytes_sent", ...}
# the events of the last MAX_EVENTS collectives and computations of this rank: a run of hours
# under --trace kept every one (several a step: tests/scripts/soak.py measured 3.4 MB more
# RSS per 1000 steps, the tiny model under DDP on 2 ranks, ~34 interpreter blocks a step) and
# gathered them all to rank 0 at the end; the window holds some tens of MB at most
MAX_EVENTS = 50_000
_events = collections.deque(maxlen=MAX_EVENTS)
_recorded = [0]                   # events recorded since the last clear_events(), kept or not


def env_level(environ=os.environ):
    """MINIDIST_TRACE as a number: 0 off, 1 log every collective, 2 also every ring step.
    A value that is not one raises ValueError naming it (comm.env_problems)."""
    value = environ.get("MINIDIST_TRACE", "") or "0"
    if value not in ("0", "1", "2"):
        raise ValueError(f"MINIDIST_TRACE={value!r}: give 0 (off), 1 (log every collective) "
                         "or 2 (also every ring step)")
    return int(value)


# off until enable(), or comm.init under MINIDIST_TRACE=1|2 (enable_from_env)
_state = {"on": False, "log": False, "steps": False, "rank": None}


def enable(log=False, steps=False):
    """Record an event per collective; `log` also prints each one to stderr, `steps` also
    prints every point-to-point step of the hand-written algorithms. MINIDIST_TRACE=1 is
    enable(log=True), MINIDIST_TRACE=2 is enable(log=True, steps=True)."""
    _state.update(on=True, log=bool(log), steps=bool(steps))


def enable_from_env(environ=os.environ):
    """enable(log=True[, steps=True]) where MINIDIST_TRACE is 1 or 2 (comm.init; a bad value
    raises ValueError, as env_level); 0 or unset leaves an enable() made before as it is."""
    level = env_level(environ)
    if level:
        enable(log=True, steps=level >= 2)


def disable():
    _state.update(on=False, log=False, steps=False)


def enabled():
    return _state["on"]


def logging():
    """True when every collective is logged to stderr (MINIDIST_TRACE=1 or 2)."""
    return _state["log"]


def log_steps():
    """True when every point-to-point step should be logged (MINIDIST_TRACE=2)."""
    return _state["steps"]


def set_rank(rank):
    """The world rank printed in log lines (set by comm.init)."""
    _state["rank"] = rank


def log(msg):
    """One line to stderr, prefixed with the rank, flushed at once (ranks interleave)."""
    sys.stderr.write(f"[rank {_state['rank']}] {msg}\n")
    sys.stderr.flush()


# -------------------------------------------------------------------------------------------
# counters
# -------------------------------------------------------------------------------------------

def _entry(group, op, nominal):
    e = _counters.setdefault((group, op), {"calls": 0, "bytes": 0, "bytes_sent": 0,
                                           "nominal": False})
    e["nominal"] = e["nominal"] or nominal   # any library call makes the total nominal
    return e


def count_call(group, op, nbytes, nominal=False):
    """One call of `op` on `group` over a payload of `nbytes`."""
    with _lock:
        e = _entry(group, op, nominal)
        e["calls"] += 1
        e["bytes"] += int(nbytes)


def count_sent(group, op, nbytes, nominal=False):
    """`nbytes` handed to the transport by this rank (nominal: computed, not observed)."""
    with _lock:
        _entry(group, op, nominal)["bytes_sent"] += int(nbytes)


def counters(group=None):
    """{op: {"calls", "bytes", "bytes_sent", "nominal"}} summed over groups, or for one group
    (its name). "bytes" is the payload the caller passed; "bytes_sent" what this rank sent."""
    out = {}
    with _lock:
        for (g, op), e in _counters.items():
            if group is not None and g != group:
                continue
            acc = out.setdefault(op, {"calls": 0, "bytes": 0, "bytes_sent": 0,
                                      "nominal": False})
            for k in ("calls", "bytes", "bytes_sent"):
                acc[k] += e[k]
            acc["nominal"] = acc["nominal"] or e["nominal"]
    return out


def bytes_sent(group=None, op=None):
    """Total bytes this rank sent, over all ops (or one op) of all groups (or one group)."""
    return sum(e["bytes_sent"] for o, e in counters(group).items() if op in (None, o))


def reset_counters():
    """Zero every counter, e.g. at the start of each training step."""
    with _lock:
        _counters.clear()


# -------------------------------------------------------------------------------------------
# events and the Chrome trace
# -------------------------------------------------------------------------------------------

def record(event):
    """Keep one finished collective (a dict with at least op, group, start, end)."""
    with _lock:
        _events.append(event)
        _recorded[0] += 1
    if not _state["log"]:
        return
    ms = (event["end"] - event["start"]) * 1e3
    log(f"#{event['seq']} {event['op']} algo={event['algo']} group={event['group']} "
        f"dtype={event['dtype']} bytes={event['bytes']} start={event['start']:.6f} "
        f"end={event['end']:.6f} ({ms:.3f} ms){' async' if event.get('async') else ''}")


def events():
    """This rank's recorded events (a copy)."""
    with _lock:
        return list(_events)


def clear_events():
    with _lock:
        _events.clear()
        _recorded[0] = 0


def left_out():
    """How many of this rank's events fell out of the kept window (the oldest ones)."""
    with _lock:
        return _recorded[0] - len(_events)


def kept_note():
    """'' when every event was kept, else a few words for the line that names the trace."""
    lost = left_out()
    return (f" (the last {MAX_EVENTS:,} events of each rank; rank {_state['rank'] or 0} left "
            f"out {lost:,} earlier ones)") if lost else ""


def chrome_events(events_by_rank):
    """Chrome trace "X" events: process = rank (one row each), thread = group; an async
    collective's args carry `issued`, when it was queued (its ts is when it began to run)."""
    out, tids = [], {}
    t0 = min((e["start"] for evs in events_by_rank for e in evs), default=0.0)
    for rank, evs in enumerate(events_by_rank):
        out.append({"name": "process_name", "ph": "M", "pid": rank,
                    "args": {"name": f"rank {rank}"}})
        for e in evs:
            tid = tids.setdefault(e["group"], len(tids))
            args = {k: e[k] for k in ("seq", "algo", "group", "dtype", "bytes") if k in e}
            if e.get("async"):    # when the caller queued it (a hook, say), in ts's units
                args["issued"] = (e["issued"] - t0) * 1e6
            out.append({"name": e["op"], "cat": e["algo"], "ph": "X", "pid": rank, "tid": tid,
                        "ts": (e["start"] - t0) * 1e6, "dur": (e["end"] - e["start"]) * 1e6,
                        "args": args})
    for rank in range(len(events_by_rank)):
        for g, tid in tids.items():
            out.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid,
                        "args": {"name": f"group {g}"}})
    return out


def write_chrome_trace(path, group):
    """Gather every rank's events to `group` rank 0 and write one Chrome-trace JSON there.

    Call on every rank of `group` (it is a collective). Queued asynchronous work is finished
    first so its events are complete. Returns the path on rank 0, None elsewhere.
    """
    group.synchronize()
    gathered = group.gather_object(events(), root=0)
    if group.rank != 0:
        return None
    with open(path, "w") as f:
        json.dump({"traceEvents": chrome_events(gathered), "displayTimeUnit": "ms"}, f)
    return path


def now():
    """Wall-clock seconds: the same clock on every rank of a node, so rows line up."""
    return time.time()


@contextlib.contextmanager
def compute(name):
    """Record the enclosed computation as an event on the trace's "compute" row (a no-op
    unless tracing is on): the forward, backward and waits of a step beside the collectives."""
    start = now()
    yield
    if enabled():
        record(dict(seq=0, op=name, algo="compute", group="compute", dtype="", bytes=0,
                    issued=start, start=start, end=now()))
