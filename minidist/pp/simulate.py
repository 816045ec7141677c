"""The pipeline schedules run for p stages inside one process, on a logical clock.

The very functions pipeline.py trains with (`gpipe`, `one_f_one_b`) run here, one thread per
stage, with a `SimLink` in place of the MPI link and `SimSteps` in place of the model: a
forward takes `t_fwd` time units, a backward `t_bwd`, a message none. Each stage keeps its
own clock; a receive moves it to the sender's clock at the send if that is later (the stage
waited). The clocks do not depend on how the threads interleave, so the picture is exact:

    python -m minidist.pp.simulate --stages 4 --micro-batches 8

prints both schedules' timelines (digit i: forward of micro-batch i; letter: its backward,
a = 0, b = 1, ...; '.': idle), the bubble per stage, and the most micro-batches each stage
held at once. The bubble is (p-1)/(m+p-1) for both; 1F1B holds min(p - s, m) on stage s.
Tests: tests/test_pipeline.py::test_simulated_schedules.
"""
import argparse
import queue
import threading

from minidist.pp.schedule import SCHEDULES


class SimLink:
    """StageLink's methods over in-process queues; messages carry the sender's clock."""

    def __init__(self, stage, n_stages, boxes, clock):
        self.stage, self.n_stages = stage, n_stages
        self.first, self.last = stage == 0, stage == n_stages - 1
        self.boxes, self.clock = boxes, clock

    def _send(self, to, kind, i):
        self.boxes[(self.stage, to, kind)].put((self.clock["t"], i))

    def _recv(self, frm, kind, i):
        t, got = self.boxes[(frm, self.stage, kind)].get(timeout=10)
        assert got == i, f"stage {self.stage} expected {kind} of {i}, got {got}"
        self.clock["t"] = max(self.clock["t"], t)        # waited for it if it came later
        return i

    def recv_forward(self, i):
        return None if self.first else self._recv(self.stage - 1, "fwd", i)

    def send_forward(self, out, i):
        if not self.last:
            self._send(self.stage + 1, "fwd", i)

    def recv_backward(self, i):
        return None if self.last else self._recv(self.stage + 1, "bwd", i)

    def send_backward(self, grad, i):
        if not self.first:
            self._send(self.stage - 1, "bwd", i)

    def send_forward_recv_backward(self, out, i_send, i_recv):
        self.send_forward(out, i_send)
        return self.recv_backward(i_recv)

    def send_backward_recv_forward(self, grad, i_send, i_recv):
        self.send_backward(grad, i_send)
        return self.recv_forward(i_recv)


class SimSteps:
    """MicroBatches' forward/backward as time on the clock, recorded as (kind, i, start)."""

    def __init__(self, n_micro, clock, t_fwd, t_bwd):
        self.n_micro, self.clock, self.t = n_micro, clock, {"F": t_fwd, "B": t_bwd}
        self.events, self.live, self.peak_in_flight = [], set(), 0

    def _run(self, kind, i):
        self.events.append((kind, i, self.clock["t"]))
        self.clock["t"] += self.t[kind]

    def forward(self, i, inp):
        self._run("F", i)
        self.live.add(i)
        self.peak_in_flight = max(self.peak_in_flight, len(self.live))
        return i

    def backward(self, i, grad):
        self._run("B", i)
        self.live.remove(i)
        return i


def simulate(schedule, n_stages, n_micro, t_fwd=1, t_bwd=2):
    """Run `schedule` ("gpipe" or "1f1b") for every stage; returns each stage's SimSteps."""
    boxes = {(a, b, k): queue.Queue() for a in range(n_stages) for b in range(n_stages)
             for k in ("fwd", "bwd")}
    clocks = [{"t": 0} for _ in range(n_stages)]
    steps = [SimSteps(n_micro, clocks[s], t_fwd, t_bwd) for s in range(n_stages)]
    errors = []

    def run(s):
        try:
            SCHEDULES[schedule](SimLink(s, n_stages, boxes, clocks[s]), steps[s])
        except Exception as e:       # noqa: BLE001 -- reported below, not lost in a thread
            errors.append(e)
    threads = [threading.Thread(target=run, args=(s,)) for s in range(n_stages)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return steps


def timeline(steps):
    """One text row per stage over the common time axis, and the bubble of each stage."""
    end = max(e[2] + s.t[e[0]] for s in steps for e in s.events)
    rows, bubbles = [], []
    for k, s in enumerate(steps):
        cells = ["."] * end
        for kind, i, start in s.events:
            mark = str(i % 10) if kind == "F" else chr(ord("a") + i % 26)
            cells[start:start + s.t[kind]] = mark * s.t[kind]
        rows.append(f"stage {k} |{''.join(cells)}|")
        bubbles.append(cells.count(".") / end)
    return rows, bubbles


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--micro-batches", type=int, default=8)
    p.add_argument("--t-fwd", type=int, default=1)
    p.add_argument("--t-bwd", type=int, default=2)
    a = p.parse_args()
    theory = (a.stages - 1) / (a.micro_batches + a.stages - 1)
    for name in ("gpipe", "1f1b"):
        steps = simulate(name, a.stages, a.micro_batches, a.t_fwd, a.t_bwd)
        rows, bubbles = timeline(steps)
        print(f"{name}: p = {a.stages}, m = {a.micro_batches}; bubble per stage "
              f"{', '.join(f'{b:.3f}' for b in bubbles)} (theory {theory:.3f}); micro-batches "
              f"in flight per stage {[s.peak_in_flight for s in steps]}")
        print("\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
