"""The composition sweep: does every layout check_layout accepts train one process's numbers?

    python tests/scripts/layout_sweep.py                   # the list (2 and 4 ranks), then runs
    python tests/scripts/layout_sweep.py --list            # only print the list
    python tests/scripts/layout_sweep.py --ranks 8 --count 6   # an 8-rank part

Layouts are drawn from the flags' values by a seeded sampler (`candidates`), each relevant
flag set only where it does something (--schedule only with --pp, --cp-split only with --cp,
...), kept where check_flags and check_layout accept them, and a deterministic greedy pick
(`select`) keeps the fewest that show every flag value at least twice and at every rank count
it was accepted at. Each layout runs examples/train_gpt.py under mpiexec (tests/mpirun.py) on
a tiny float64 GPT, with --log-json and --save; its reference is one process with the same
model, data, dropout, MoE and --amp flags (`reference_flags`), run once per distinct setting.
Compared: every step's loss and the final val loss (relative), and every parameter of the
saved checkpoint read back whole (minidist/train/gather.py whole_model; --amp: the float32
masters), relative to that parameter's largest entry (`differences`). float64 runs are
held to TOL; --amp computes in float16, so its runs are held to AMP_TOL (a few float16
roundings), and the sweep prints beside them what merely reordering the same sums on one
process changes (its "amp floor": --grad-accum 2). Exit 1 if any layout fails.
Tests: tests/test_layout_sweep.py (the whole sweep under -m slow).
"""
import argparse
import json
import os
import random
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))         # tests/mpirun.py
from mpirun import ROOT, logged_losses, mpi_env, run_mpi  # noqa: E402

TRAIN = "examples/train_gpt.py"
BASE = ["--n-layer", "4", "--n-head", "4", "--n-embd", "32", "--block-size", "16",
        "--batch-size", "8", "--steps", "3", "--lr", "1e-2", "--eval-every", "0",
        "--eval-iters", "1", "--sample", "0", "--log-every", "1"]
TOL = 1e-9
AMP_TOL = {"loss": 1e-3, "val_loss": 1e-3, "grad_norm": 1e-2, "params_l2": 2e-2}
# the flags the one-process reference shares with a layout; the rest is the layout
REF = ("--dropout", "--moe-experts", "--moe-top-k", "--moe-capacity-factor", "--moe-every",
       "--moe-aux-loss-coef", "--moe-z-loss-coef", "--amp", "--no-bias")


def _pick(rng, values, p_default=0.5):
    """values[0] (the default) with probability p_default, else one of the others."""
    return values[0] if rng.random() < p_default else rng.choice(values[1:])


def _axes(rng, ranks, moe):
    """{flag: size} for --tp --pp --cp --ep whose product divides `ranks`; dp takes the rest."""
    sizes = {}
    for flag in rng.sample(["--tp", "--pp", "--cp", "--ep"], 4):
        left = ranks // int(np.prod(list(sizes.values()) or [1]))
        options = [n for n in (2, 4) if left % n == 0 and n <= 4]
        if flag == "--ep" and not moe or not options or rng.random() < 0.55:
            continue
        sizes[flag] = rng.choice(options)
    return sizes


def candidate(rng, ranks):
    """One layout: {flag: value or True} (a switch), only flags that act on it."""
    f = {}
    moe = rng.random() < 0.3
    if moe:
        f["--moe-experts"] = 4
        f["--moe-top-k"] = rng.choice([1, 2])
        f["--moe-capacity-factor"] = _pick(rng, [1.25, 0.0])
        f["--moe-every"] = _pick(rng, [1, 2, 4])      # 4: a pipeline stage may hold none
        f["--moe-aux-loss-coef"] = _pick(rng, [0.01, 0.0], 0.7)
        f["--moe-z-loss-coef"] = _pick(rng, [0.0, 0.001], 0.7)
    f.update(_axes(rng, ranks, moe))
    tp, pp, cp, ep = (f.get(k, 1) for k in ("--tp", "--pp", "--cp", "--ep"))
    dp = ranks // (tp * pp * cp * ep)
    f["--dp"] = dp if rng.random() < 0.3 else None      # given, or left to default
    f["--zero"] = _pick(rng, [0, 1, 2, 3], 0.4)
    if f["--zero"] == 0 and dp * cp * ep > 1:
        f["--ddp"] = rng.choice(["overlapped", "bucketed", "naive"])
        if f["--ddp"] != "naive":
            f["--bucket-mb"] = _pick(rng, [1.0, 0.01])
    if tp > 1 and rng.random() < 0.5:
        f["--sequence-parallel"] = True
    if pp > 1:
        f["--schedule"] = rng.choice(["1f1b", "gpipe", "zb-h1"])
        f["--pp-virtual"] = _pick(rng, [1, 2], 0.6) if f["--schedule"] == "1f1b" else 1
        f["--micro-batches"] = _pick(rng, [None, 2, 4, 8])
    if cp > 1:
        f["--cp-split"] = _pick(rng, ["zigzag", "naive"])
    f["--grad-accum"] = _pick(rng, [1, 2], 0.6)
    f["--ckpt-activations"] = rng.random() < 0.3
    f["--dropout"] = _pick(rng, [0.0, 0.1], 0.6)
    f["--attention"] = _pick(rng, ["auto", "materialized", "tiled"])
    if f["--attention"] == "tiled":
        f["--attention-block"] = _pick(rng, [8, 64])
    f["--amp"] = rng.random() < 0.15
    f["--comm"] = _pick(rng, ["ring", "naive", "mpi", "hier"])
    f["--sync-comm"] = rng.random() < 0.15
    f["--no-bias"] = rng.random() < 0.15
    return {k: v for k, v in f.items() if v is not None and v is not False}


def argv(flags):
    """The command line of a layout's flags (a switch: the flag alone)."""
    out = []
    for k, v in flags.items():
        out += [k] if v is True else [k, str(v)]
    if flags.get("--amp"):
        out += ["--amp-dtype", "float16", "--dtype", "float32"]
    else:
        out += ["--dtype", "float64"]
    return out


def accepted(ranks, flags):
    """None if check_flags and check_layout accept the layout on `ranks`, else the error."""
    from minidist.train.args import train_parser
    from minidist.train.cli import UsageError, check_flags
    from minidist.train.strategy import check_layout
    args = train_parser().parse_args(BASE + argv(flags) + ["--device", "cpu"])
    try:
        check_flags(args)
        check_layout(args, ranks)
    except UsageError as e:
        return str(e)
    return None


def _traits(flags):
    """The layout's strategies and switches, for the pairs `features` counts."""
    out = [k for k in ("--tp", "--pp", "--cp", "--ep", "--sequence-parallel", "--amp",
                       "--ckpt-activations", "--moe-experts") if k in flags]
    out += [f"--zero {flags['--zero']}"] if flags.get("--zero") else []
    out += [f"--schedule {flags['--schedule']}"] if "--schedule" in flags else []
    out += ["--pp-virtual 2"] if flags.get("--pp-virtual") == 2 else []
    out += ["--dropout"] if flags.get("--dropout") else []
    out += ["--grad-accum 2"] if flags.get("--grad-accum") == 2 else []
    out += ["--attention tiled"] if flags.get("--attention") == "tiled" else []
    return sorted(out)


def features(ranks, flags):
    """What a layout shows: each (flag, value), each at this rank count, and each pair of its
    strategies and switches (`_traits`: --tp with --zero 3, --pp with --moe-experts, ...)."""
    items = [("ranks", ranks)] + sorted((k, str(v)) for k, v in flags.items())
    traits = _traits(flags)
    pairs = {(a, b, "pair") for i, a in enumerate(traits) for b in traits[i + 1:]}
    return set(items) | {(k, v, ranks) for k, v in items} | pairs


def candidates(seed, ranks_list, n=4000):
    """n seeded draws over `ranks_list`, the accepted ones, deduplicated, in draw order."""
    rng, seen, out = random.Random(seed), set(), []
    for _ in range(n):
        ranks = rng.choice(ranks_list)
        flags = candidate(rng, ranks)
        key = (ranks, tuple(sorted(flags.items())))
        if key not in seen and accepted(ranks, flags) is None:
            seen.add(key)
            out.append((ranks, flags))
    return out


def select(cands, want=3, pairs=2, limit=None):
    """Greedy, deterministic: add the candidate that brings the most features still short of
    their showings (a (flag, value): `want`; a pair of traits: `pairs`; a (flag, value,
    ranks): one), until none brings any (or `limit`)."""
    need = {}
    for ranks, flags in cands:
        for f in features(ranks, flags):
            need[f] = want if len(f) == 2 else pairs if f[2] == "pair" else 1
    chosen, left = [], list(cands)
    while left and (limit is None or len(chosen) < limit):
        gain = [sum(1 for f in features(*c) if need[f] > 0) for c in left]
        best = max(range(len(left)), key=lambda i: (gain[i], -i))
        if gain[best] == 0:
            break
        c = left.pop(best)
        for f in features(*c):
            need[f] -= 1
        chosen.append(c)
    return chosen


def reference_flags(flags):
    return {k: v for k, v in flags.items() if k in REF}


def differences(ref, got):
    """{what: the largest relative difference} of a run against its reference: each step's
    loss and gradient norm (before clipping: AdamW alone would hide a gradient off by a
    constant factor), the final val loss, every parameter's entries relative to its largest
    entry (`params`), and the whole model's L2 distance relative to its norm (`params_l2`)."""
    rel = lambda a, b: float(np.max(np.abs(np.subtract(a, b)) / np.abs(b)))  # noqa: E731
    if len(got["losses"]) != len(ref["losses"]) or set(got["params"]) != set(ref["params"]):
        return {"shape": float("inf")}
    names = sorted(ref["params"])
    flat = [np.concatenate([d[n].ravel().astype(np.float64) for n in names])
            for d in (got["params"], ref["params"])]
    return {"loss": rel(got["losses"], ref["losses"]),
            "grad_norm": rel(got["norms"], ref["norms"]),
            "val_loss": rel(got["val_loss"], ref["val_loss"]),
            "params": max(float(np.max(np.abs(got["params"][n] - p)) / np.max(np.abs(p)))
                          for n, p in ref["params"].items()),
            "params_l2": float(np.linalg.norm(flat[0] - flat[1]) / np.linalg.norm(flat[1]))}


def compare(ref, got, amp=False):
    """(passed, differences): float64, every difference within TOL; --amp, those of AMP_TOL
    within it (float16's unit roundoff is 2^-11 = 4.9e-4). Entry by entry the parameters are
    not held to anything under --amp: AdamW's step m / sqrt(v) turns a gradient that is
    rounding noise (the key bias's, zero in exact arithmetic) into a full +-lr step either
    way, on one process too (see the amp floor)."""
    if got["rc"] != 0:
        return False, {"rc": got["rc"]}
    errs = differences(ref, got)
    if not amp:
        return max(errs.values()) <= TOL, errs
    return all(errs.get(k, float("inf")) <= tol for k, tol in AMP_TOL.items()), errs


def layouts(ranks_list=(2, 4), seed=0, count=None):
    return select(candidates(seed, list(ranks_list)), limit=count)


def describe(ranks, flags):
    return f"-n {ranks} " + " ".join(argv(flags)[:-2] if not flags.get("--amp")
                                     else argv(flags))


def corpus(workdir):
    """The training text: 300 tiny Python functions (as tests/conftest.py's corpus)."""
    path = os.path.join(workdir, "code.py")
    with open(path, "w") as f:
        f.write("".join(f"def f{i}(x):\n    return x * {i}\n\n" for i in range(300)))
    return path


class Sweep:
    """Runs layouts in `workdir` on `device`, each against its one-process reference (run
    once per distinct reference_flags; under --amp also its noise floor)."""

    def __init__(self, workdir, device="cpu", say=print):
        self.workdir, self.device, self.say = workdir, device, say
        self.data, self.refs, self.floors, self.runs = corpus(workdir), {}, {}, 0

    def run(self, ranks, flags, name, timeout=240):
        """Train one layout (ranks 1: one process, no mpiexec): {rc, stdout, stderr} and,
        if it ran, its losses, final val loss and the saved parameters, whole."""
        from minidist.train.gather import whole_model
        log, ck = (os.path.join(self.workdir, name + e) for e in (".jsonl", ""))
        args = [*BASE, *argv(flags), "--data", self.data, "--cache-dir",
                os.path.join(self.workdir, "cache"), "--log-json", log, "--save", ck]
        if ranks == 1:
            proc = subprocess.run([sys.executable, TRAIN, *args, "--device", self.device],
                                  cwd=ROOT, env=mpi_env(), text=True, capture_output=True,
                                  timeout=timeout)
        else:
            proc = run_mpi(ranks, TRAIN, *args, device=self.device, timeout=timeout,
                           check=False)
        out = {"rc": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr}
        if proc.returncode == 0:
            rows = [json.loads(line) for line in open(log)]
            out["losses"] = logged_losses(log)
            out["norms"] = [r["grad_norm"] for r in rows if "grad_norm" in r]
            out["val_loss"] = [r["val_loss"] for r in rows if r.get("final")][0]
            out["params"] = whole_model(ck)[1]
        return out

    def reference(self, flags):
        """(the one-process run for `flags`, its --amp noise floor or None), cached."""
        key = json.dumps(reference_flags(flags), sort_keys=True)
        if key not in self.refs:
            n = len(self.refs)
            ref = self.run(1, reference_flags(flags), f"ref{n}")
            assert ref["rc"] == 0, ref["stderr"]
            self.refs[key] = ref
            if flags.get("--amp"):      # the float16 noise floor: the same sums reordered
                again = self.run(1, {**reference_flags(flags), "--grad-accum": 2}, f"floor{n}")
                self.floors[key] = differences(ref, again)
                self.say(f"amp floor {key}: " + _show(self.floors[key]))
        return self.refs[key], self.floors.get(key)

    def check(self, ranks, flags):
        """(passed, differences, the run) of one layout against its reference; says a line."""
        ref, _ = self.reference(flags)
        self.runs += 1
        got = self.run(ranks, flags, f"run{self.runs}")
        ok, errs = compare(ref, got, bool(flags.get("--amp")))
        self.say(f"{'PASS' if ok else 'FAIL'} {describe(ranks, flags)}  " + _show(errs))
        if got["rc"]:
            self.say("   " + (got["stderr"].strip().splitlines() or ["(no stderr)"])[-1][:300])
        return ok, errs, got


def _show(errs):
    return " ".join(f"{k} {v:.1e}" if isinstance(v, float) else f"{k} {v}"
                    for k, v in errs.items())


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--count", type=int, default=None, help="at most this many layouts")
    p.add_argument("--list", action="store_true", help="print the layouts, run nothing")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    cli = p.parse_args()
    chosen = layouts(cli.ranks, cli.seed, cli.count)
    for i, c in enumerate(chosen):
        print(f"{i:3d} {describe(*c)}", flush=True)
    if cli.list:
        return 0
    with tempfile.TemporaryDirectory() as workdir:
        sweep = Sweep(workdir, cli.device, say=lambda s: print(s, flush=True))
        failed = [i for i, c in enumerate(chosen) if not sweep.check(*c)[0]]
    print(json.dumps({"layouts": len(chosen), "failed": failed}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
