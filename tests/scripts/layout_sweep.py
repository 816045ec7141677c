"""The composition sweep: does every layout check_layout accepts train one process's numbers?

    python tests/scripts/layout_sweep.py                   # the list (2 and 4 ranks), then runs
    python tests/scripts/layout_sweep.py --list            # only print the list
    python tests/scripts/layout_sweep.py --ranks 8 --count 6   # an 8-rank part
    python tests/scripts/layout_sweep.py --resume          # each also stopped and resumed
    python tests/scripts/layout_sweep.py --reshard         # each resumed in another layout
    python tests/scripts/layout_sweep.py --large           # the 12- and 16-rank list

The layouts: tests/scripts/layout_sample.py. Each runs examples/train_gpt.py under mpiexec
(tests/mpirun.py) on a tiny float64 GPT, with --log-json and --save; its reference is one
process with the same model, data, dropout, MoE and --amp flags (`reference_flags`), run
once per distinct setting. Compared (`differences`): each step's loss and gradient norm, the
final val loss, and every parameter of the saved checkpoint read back whole
(minidist/train/gather.py whole_model; --amp: the float32 masters) and the MoE routers'
biases (`router_bias`, --moe-bias-rate). float64 runs are held to
TOL; --amp computes in 16 bits, so its runs are held to AMP_TOL (a few float16 roundings;
--amp-dtype bfloat16: BF16_TOL, eight times wider as its unit roundoff is;
`compare`), and the sweep prints beside them what merely reordering the same sums on one
process changes (its "amp floor": --grad-accum 2). The log lines are checked too
(`banner_problems`): every size they name (`tp 2`, `dp 1 x ep 2`, `over the 4 dp x cp
ranks`) must be the layout's. Exit 1 if any layout fails.
Tests: tests/test_layout_sweep.py (the whole sweep under -m slow).
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))         # tests/mpirun.py
from mpirun import ROOT, logged_losses, mpi_env, run_mpi  # noqa: E402
from layout_sample import BASE, LARGE, LARGE_INTO, accepted, argv, describe, layouts  # noqa: E402
from exact import max_abs  # noqa: E402

TRAIN = "examples/train_gpt.py"
# float64, relative (`differences`): the standard's 1e-10. Measured (2026-11-29, every sweep
# test of the default run): losses, norms, val loss <= 5e-15, parameters <= 3.1e-12 (relative
# to each parameter's largest entry; the worst an MoE one), their L2 distance <= 8.4e-15.
TOL = 1e-10
# grad_norm_1: step 1's, the gradient of the very parameters one process has (the layout's
# own 16-bit rounding alone: <= 2e-5 seen); grad_norm: every step's, after AdamW has turned
# rounding noise into +-lr steps (module docstring of compare; up to 1.7e-2 seen on layouts
# exact in float64, 5.2e-3 on one process merely reordering its sums), still far below
# the factor a mis-scaled gradient is off by
AMP_TOL = {"loss": 1e-3, "val_loss": 1e-3, "grad_norm_1": 1e-3, "grad_norm": 5e-2,
           "params_l2": 2e-2}
BF16_TOL = {k: 8 * t for k, t in AMP_TOL.items()}        # 2^-8 against float16's 2^-11
# the flags the one-process reference shares with a layout; the rest is the layout
REF = ("--dropout", "--amp-dtype", "--moe-experts", "--moe-top-k", "--moe-capacity-factor",
       "--moe-every", "--moe-aux-loss-coef", "--moe-z-loss-coef", "--moe-shared", "--amp",
       "--no-bias", "--arch", "--n-kv-head", "--rope-theta", "--ffn-hidden", "--optimizer",
       "--muon-momentum", "--muon-ns-steps", "--moe-bias-rate", "--n-layer", "--batch-size",
       "--block-size")


def reference_flags(flags):
    return {k: v for k, v in flags.items() if k in REF}


AXIS = re.compile(r"\b(dp|tp|pp|cp|ep) (\d+)\b")
OVER = re.compile(r"over the (\d+) ((?:dp|tp|pp|cp|ep)(?: x (?:dp|tp|pp|cp|ep))*) ranks")


def sizes(ranks, flags):
    """{axis: size} of a layout: --tp --pp --cp --ep as given, dp the ranks left."""
    s = {a: flags.get("--" + a, 1) for a in ("tp", "pp", "cp", "ep")}
    return {**s, "dp": ranks // (s["tp"] * s["pp"] * s["cp"] * s["ep"])}


def banner_problems(ranks, flags, stdout):
    """The log lines that name a size the layout does not have: `dp 2` where dp is 1, `over
    the 2 dp x cp ranks` where dp x cp is 4. The step, data and model lines are skipped."""
    want, bad = sizes(ranks, flags), []
    for line in stdout.splitlines():
        if line.startswith(("step ", "data:", "model:")):
            continue
        wrong = [f"{a} {n}" for a, n in AXIS.findall(line) if int(n) != want[a]]
        wrong += [f"{n} {axes}" for n, axes in OVER.findall(line)
                  if int(n) != np.prod([want[a] for a in axes.split(" x ")])]
        bad += [f"{', '.join(wrong)}: {line[:160]}"] if wrong else []
    return bad


def differences(ref, got, first=1):
    """{what: the largest relative difference} of a run against its reference: each step's
    loss and gradient norm (before clipping: AdamW alone would hide a gradient off by a
    constant factor; `grad_norm_1` step 1's alone), the final val loss, every parameter's
    entries relative to its largest entry (`params`), the whole model's L2 distance relative
    to its norm (`params_l2`), and the MoE routers' biases, absolute (`router_bias`:
    multiples of the rate, often 0). `first`: the step the runs' rows start at (a resumed
    run's: 3), step 1's norm only when it is 1."""
    rel = lambda a, b: float(np.max(np.abs(np.subtract(a, b)) / np.abs(b)))  # noqa: E731
    if len(got["losses"]) != len(ref["losses"]) or set(got["params"]) != set(ref["params"]):
        return {"shape": float("inf")}
    names = sorted(ref["params"])
    flat = [np.concatenate([d[n].ravel().astype(np.float64) for n in names])
            for d in (got["params"], ref["params"])]
    if set(got["biases"]) != set(ref["biases"]):
        return {"router_bias_blocks": float("inf")}
    bias = [np.array([d["biases"][b] for b in sorted(ref["biases"])]) for d in (got, ref)]
    step_1 = {"grad_norm_1": rel(got["norms"][:1], ref["norms"][:1])} if first == 1 else {}
    return {"loss": rel(got["losses"], ref["losses"]), **step_1,
            "grad_norm": rel(got["norms"], ref["norms"]),
            "val_loss": rel(got["val_loss"], ref["val_loss"]),
            "params": max_abs([np.max(np.abs(got["params"][n] - p)) / np.max(np.abs(p))
                               for n, p in ref["params"].items()]),
            "params_l2": float(np.linalg.norm(flat[0] - flat[1]) / np.linalg.norm(flat[1])),
            "router_bias": float(np.max(np.abs(bias[0] - bias[1]), initial=0.0))}


def compare(ref, got, amp=False, moe=False, first=1):
    """(passed, differences): float64, every difference within TOL (each compared on its
    own: a NaN one fails, where max() over them would skip it); --amp (`amp`: the 16-bit
    dtype), those of AMP_TOL within it (float16's unit roundoff is 2^-11 = 4.9e-4), of
    BF16_TOL under bfloat16 (2^-8 = 3.9e-3). Entry by entry the parameters are
    not held to anything under --amp: AdamW's step m / sqrt(v) turns a gradient that is
    rounding noise (the key bias's, zero in exact arithmetic) into a full +-lr step either
    way, on one process too (see the amp floor). MoE under --amp: nor is their L2 distance;
    top-k routing is discrete, and a token near a tie whose router logits differ in float16
    goes to another expert (seen from step 1 under --cp 2: one token of 64; more each step as
    the tiny router collapses). A NaN difference fails, held or not (a NaN saved parameter:
    `params` is NaN)."""
    if got["rc"] != 0:
        return False, {"rc": got["rc"]}
    errs = differences(ref, got, first)
    if not amp:
        return all(e <= TOL for e in errs.values()), errs
    tols = BF16_TOL if amp == "bfloat16" else AMP_TOL
    held = {k: t for k, t in tols.items() if not (moe and k == "params_l2")
            and (first == 1 or k != "grad_norm_1")}
    within = all(errs.get(k, float("inf")) <= tol for k, tol in held.items())
    return within and not any(np.isnan(e) for e in errs.values()), errs


def amp_dtype(flags):
    """The 16-bit dtype a layout computes in under --amp (float16 unless it says), or False."""
    return flags.get("--amp-dtype", "float16") if flags.get("--amp") else False


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

    def run(self, ranks, flags, name, extra=(), timeout=None):
        """Train one layout (ranks 1: one process, no mpiexec) with `extra` flags, saving to
        workdir/name: {rc, stdout, stderr} and, if it ran, its losses and gradient norms, the
        final val loss and the saved parameters, whole."""
        from minidist.train.gather import router_bias, whole_model
        log, ck = (os.path.join(self.workdir, name + e) for e in (".jsonl", ""))
        timeout = timeout or 240 + 60 * max(ranks - 8, 0)      # 16 ranks on 2 cores: 12 min
        args = [*BASE, *argv(flags), "--data", self.data, "--cache-dir",
                os.path.join(self.workdir, "cache"), "--log-json", log, "--save", ck, *extra]
        if ranks == 1:
            proc = subprocess.run([sys.executable, TRAIN, *args, "--device", self.device],
                                  cwd=ROOT, env=mpi_env(), text=True, capture_output=True,
                                  timeout=timeout)
        else:       # --comm hier: nodes of 2 ranks, so groups of 4 and 8 span two or more
            env = mpi_env(MINIDIST_RANKS_PER_NODE=2) if flags.get("--comm") == "hier" else None
            proc = run_mpi(ranks, TRAIN, *args, device=self.device, timeout=timeout,
                           check=False, env=env)
        out = {"rc": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr}
        if proc.returncode == 0:
            rows = [json.loads(line) for line in open(log)]
            out["losses"] = logged_losses(log)
            out["norms"] = [r["grad_norm"] for r in rows if "grad_norm" in r]
            out["val_loss"] = [r["val_loss"] for r in rows if r.get("final")][0]
            out["params"] = whole_model(ck)[1]
            out["biases"] = router_bias(ck)
            out["rows"] = rows
        return out

    def reference(self, flags):
        """(the one-process run for `flags`, its --amp noise floor or None), cached."""
        key = json.dumps(reference_flags(flags), sort_keys=True)
        if key not in self.refs:
            n = len(self.refs)
            ref = self.run(1, reference_flags(flags), f"ref{n}")
            assert ref["rc"] == 0, ref["stderr"]
            self.refs[key] = ref
            if flags.get("--amp"):      # the 16-bit noise floor: the same sums reordered
                again = self.run(1, {**reference_flags(flags), "--grad-accum": 2}, f"floor{n}")
                self.floors[key] = differences(ref, again)
                self.say(f"amp floor {key}: " + _show(self.floors[key]))
        return self.refs[key], self.floors.get(key)

    def check(self, ranks, flags, resume=False):
        """(passed, differences, the run) of one layout against its reference; says a line.
        `resume`: also stopped after step 2 and resumed (`resumed`)."""
        ref, _ = self.reference(flags)
        self.runs += 1
        got = self.run(ranks, flags, f"run{self.runs}")
        ok, errs = compare(ref, got, amp_dtype(flags), bool(flags.get("--moe-experts")))
        banners = banner_problems(ranks, flags, got["stdout"])
        ok, errs = ok and not banners, {**errs, **({"banners": len(banners)} if banners else {})}
        if resume and got["rc"] == 0:
            again, errs["resumed"] = self.resumed(ranks, flags, got)
            ok = ok and again
        self.say(f"{'PASS' if ok else 'FAIL'} {describe(ranks, flags)}  " + _show(errs))
        if got["rc"]:
            self.say("   " + (got["stderr"].strip().splitlines() or ["(no stderr)"])[-1][:300])
        for line in banners:
            self.say("   log line: " + line)
        return ok, errs, got


    def check_resharded(self, ranks, flags, into):
        """`resharded`, with a line said."""
        ok, errs = self.resharded(ranks, flags, into)
        self.say(f"{'PASS' if ok else 'FAIL'} {describe(ranks, flags)}  ->  "
                 f"{describe(*into)}  " + _show(errs))
        return ok, errs

    def resharded(self, ranks, flags, into):
        """(passed, differences): the layout stopped after step 2 (--stop-at 2 --save), then
        resumed from that checkpoint in another layout `into` = (ranks, flags: the same
        reference_flags), against the one-process reference: step 3's loss and gradient
        norm, the val loss and every saved parameter, to TOL (AMP_TOL under --amp). Another
        layout sums in another order, so equal bits are not expected, only one process's
        numbers."""
        ref, _ = self.reference(flags)
        self.runs += 1
        name = f"stop{self.runs}"
        first = self.run(ranks, flags, name, ["--stop-at", "2"])
        if first["rc"]:
            return False, {"stop_rc": first["rc"], "stderr": first["stderr"][-300:]}
        back = self.run(*into, f"back{self.runs}", ["--resume", os.path.join(self.workdir, name)])
        tail = {**ref, "losses": ref["losses"][2:], "norms": ref["norms"][2:]}
        ok, errs = compare(tail, back, amp_dtype(flags), bool(flags.get("--moe-experts")),
                           first=3)
        if back["rc"]:
            errs["stderr"] = (back["stderr"].strip().splitlines() or ["(no stderr)"])[-1][:300]
        return ok, errs

    def resumed(self, ranks, flags, straight):
        """(bit-identical?, what differs): the layout stopped after step 2 with --save
        (--stop-at 2), then resumed from that checkpoint in the same layout, against the
        uninterrupted run `straight`: step 3's loss and norm, the val loss, every parameter
        saved at the end and the MoE routers' biases, all bit for bit (the checkpoint holds
        the parameters, the optimizer state, the dropout keys' step and the biases; batches
        depend on (seed, step) alone)."""
        name = f"stop{self.runs}"
        first = self.run(ranks, flags, name, ["--stop-at", "2"])
        if first["rc"]:
            return False, "the --stop-at 2 run failed: " + first["stderr"][-300:]
        back = self.run(ranks, flags, f"back{self.runs}",
                        ["--resume", os.path.join(self.workdir, name)])
        if back["rc"]:
            return False, "the --resume run failed: " + back["stderr"][-300:]
        same = {"loss": back["losses"] == straight["losses"][2:],
                "norm": back["norms"] == straight["norms"][2:],
                "val_loss": back["val_loss"] == straight["val_loss"],
                "params": all(np.array_equal(p, straight["params"][n])
                              for n, p in back["params"].items()),
                "router_bias": back["biases"] == straight["biases"]}
        return all(same.values()), "same" if all(same.values()) else \
            "differs: " + ", ".join(k for k, v in same.items() if not v)


def partner(chosen, i, pool=None):
    """The layout chosen[i] resumes into under --reshard: the next layout in the list (cyclic)
    whose strategy flags, with chosen[i]'s reference_flags (the same model, data, dropout,
    MoE and --amp), check_layout accepts and that differs from chosen[i], preferring another
    number of ranks; every fourth layout resumes into one process instead. `pool`: take
    the next of these layouts instead, from pool[i] on (--large: LARGE_INTO, 4 ranks). None
    if none fits."""
    ranks, flags = chosen[i]
    if i % 4 == 3:
        return 1, reference_flags(flags)
    order = ([pool[(i + k) % len(pool)] for k in range(len(pool))] if pool else
             [chosen[(i + k) % len(chosen)] for k in range(1, len(chosen))])
    options = []
    for k, (r, f) in enumerate(order):
        into = {**{a: v for a, v in f.items() if a not in REF}, **reference_flags(flags)}
        if (r, into) != (ranks, flags) and accepted(r, into) is None:
            options.append((r != ranks, -k, (r, into)))
    return max(options)[2] if options else None


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
    p.add_argument("--resume", action="store_true",
                   help="also stop each layout after step 2 and resume it: bit for bit?")
    p.add_argument("--reshard", action="store_true",
                   help="instead, stop each layout after step 2 and resume it in another "
                        "(`partner`): one process's numbers?")
    p.add_argument("--large", action="store_true",
                   help="run layout_sample.LARGE (12 and 16 ranks, by hand) instead")
    cli = p.parse_args()
    chosen = LARGE[:cli.count] if cli.large else layouts(cli.ranks, cli.seed, cli.count)
    pool = LARGE_INTO if cli.large else None
    for i, c in enumerate(chosen):
        into = f"  ->  {describe(*partner(chosen, i, pool))}" if cli.reshard else ""
        print(f"{i:3d} {describe(*c)}{into}", flush=True)
    if cli.list:
        return 0
    with tempfile.TemporaryDirectory() as workdir:
        sweep = Sweep(workdir, cli.device, say=lambda s: print(s, flush=True))
        if cli.reshard:
            failed = [i for i, c in enumerate(chosen)
                      if not sweep.check_resharded(*c, partner(chosen, i, pool))[0]]
        else:
            failed = [i for i, c in enumerate(chosen) if not sweep.check(*c, cli.resume)[0]]
    print(json.dumps({"layouts": len(chosen), "failed": failed}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
