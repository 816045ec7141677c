"""What the training loop reports, and when it reads the device to report it.

Each step's loss and gradient norm stay on the device until the loop needs them.

A step returns its loss and norm as 0-d device arrays (minidist/train/step.py). Reading one
to the host (float(loss)) would make the CPU wait for the GPU to finish the step, every step.
So the loop writes them into a small device table, one row per step, and reads the rows
since the last read in ONE `backend.host_read` only at the steps that need a number on the
host: a log line (--log-every), a --log-json row (every step), an evaluation, a save, the
last step, a stop. At those steps the loop also checks that the values are finite: a loss
(or, without --amp, a norm) that is not names the FIRST such step, as a check every step
would, and the run stops before anything is saved.

    values = StepValues(capacity=args.log_every)
    values.add(step, loss, norm)          # a device copy; nothing waits
    if values.due(...): rows = values.read()      # [(step, loss, norm)] as Python floats

Tests: tests/test_no_sync.py (the reads counted per step), tests/test_cli_runs.py (divergence).
"""
import contextlib
import json
import math
import os
import sys

from minidist import backend


class Logger:
    """Rank 0's output: `print0` for people, `json0` for --log-json (one object per line).
    A row that cannot be written (the log's disk full) is taken back, the log stops there
    with one warning, and training goes on: first-use walk 37's full disk aborted the run
    at its next logged step, losing the steps since the last save, for a metrics file."""

    def __init__(self, rank, log_json=None):
        self.rank, self.log_json = rank, log_json

    def print0(self, *args):
        if self.rank == 0:
            print(*args, flush=True)

    def json0(self, row):
        if self.rank != 0 or not self.log_json:
            return
        data = (json.dumps(_finite(row), allow_nan=False) + "\n").encode()
        try:                                  # (unbuffered: a failed write is known here)
            fd = os.open(self.log_json, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
            try:
                end = os.lseek(fd, 0, os.SEEK_END)
                try:
                    written = 0
                    while written < len(data):            # (a full disk: a part, then
                        written += os.write(fd, data[written:])    # ENOSPC)
                except OSError:
                    with contextlib.suppress(OSError):    # (a device: nothing to take)
                        os.ftruncate(fd, end)     # no half row for a reader to choke on
                    raise
            finally:
                os.close(fd)
        except OSError as e:
            since = f"from step {row['step'] + 1} on" if "step" in row else "from here on"
            print(f"warning: --log-json {self.log_json}: cannot write ({e.strerror or e}); "
                  f"no rows {since}, training goes on", file=sys.stderr, flush=True)
            self.log_json = None


def holds_summary(path, steps):
    """Whether the --log-json at `path` ends a run of `steps` steps already: a summary row of
    that many steps done, not --stop-at's, --eval-only's or a divergence's. A requeued run
    that finished (resumed at its last step: nothing to train) writes no second one."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError:
        return False
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if (isinstance(row, dict) and row.get("final") and row.get("steps") == steps
                and not {"stopped_at", "eval_only", "diverged"} & set(row)):
            return True
    return False


def drop_rows_from(path, start):
    """A resumed run's --log-json: its rows of steps `start` on taken out (the run that wrote
    them was cut off after its last checkpoint, at `start`; the resumed run logs them again:
    first-use walk 41 found steps 40-52 twice after a kill -9), and a half row a kill left.
    Rows of no step (summaries) stay. Returns how many rows went. Rank 0 alone calls it."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError:
        return 0
    kept = []
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue                              # (half a row: the kill's)
        if not (isinstance(row, dict) and row.get("step", -1) >= start):
            kept.append(line)
    gone = sum(bool(line.strip()) for line in lines) - len(kept)
    if gone:
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            f.write("".join(line + "\n" for line in kept))
        os.replace(tmp, path)
    return gone


class StepValues:
    """A (capacity, 2) float64 table on the values' device: (loss, norm) of each step since
    the last read. Full: `due` says so, so the table never overflows."""

    def __init__(self, capacity):
        self.capacity = max(int(capacity), 1)
        self.table, self.steps = None, []

    def add(self, step, loss, norm):
        """Row for `step`: loss and norm (0-d device arrays, or host numbers), copied on the
        device (no host read)."""
        if self.table is None:
            self.table = backend.xp_of(loss, norm).empty((self.capacity, 2), "float64")
        row = len(self.steps)
        self.table[row, 0] = loss
        self.table[row, 1] = norm
        self.steps.append(step)

    def due(self, wanted):
        """Whether to read now: `wanted` (the loop needs a number), or the table is full."""
        return bool(wanted) or len(self.steps) == self.capacity

    def read(self):
        """[(step, loss, norm)] of every row since the last read, as Python floats: one host
        read (on a GPU: waits for every step queued so far)."""
        rows = backend.host_read(self.table[:len(self.steps)], "loss and norm")
        out = [(s, float(loss), float(norm)) for s, (loss, norm) in zip(self.steps, rows)]
        self.steps = []
        return out


def _finite(value):
    """`value` with every float that is not finite as None: JSON has no NaN or Infinity
    (first-use walk 41: a diverged run's rows were no JSON to node, and 1.8e308 to jq)."""
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def first_not_finite(rows, amp):
    """The first (step, loss, norm) whose loss is not finite (nor, without --amp, the norm:
    under --amp an inf/nan gradient only skips the step, the loss scaler's job); None."""
    for step, loss, norm in rows:
        if not math.isfinite(loss) or (not amp and not math.isfinite(norm)):
            return step, loss, norm
    return None


def eta(elapsed, done, left):
    """"0:12 elapsed, ETA 1:05": from the mean time of this run's steps so far."""
    return f"{clock(elapsed)} elapsed, ETA {clock(elapsed / max(done, 1) * left)}"


def clock(seconds):
    m, s = divmod(int(round(seconds)), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"
