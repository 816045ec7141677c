"""Context parallelism inside pipeline stages (--cp with --pp) against one process, float64.

    mpiexec -n 4 python tests/scripts/cp_pp_check.py          # cp 2 x pp 2, every schedule
    mpiexec -n 8 python tests/scripts/cp_pp_check.py          # x dp 2 (ZeRO), x tp 2
    mpiexec -n 4 python tests/scripts/cp_pp_check.py --runs cp2xpp2-m2-1f1b --files ""

A run's name lists its flags: cp2, pp2, dp2, tp2 (sizes), m2/m4 (--micro-batches), ga2
(--grad-accum 2), gpipe, 1f1b or zbh1 (--schedule), v2 (--pp-virtual 2: interleaved 1F1B),
naive (--cp-split naive), ckpt (--ckpt-activations), z1, z3 (--zero k), sp
(--sequence-parallel). Every rank also trains the one-process reference (SingleProcess, the
whole global batch, no recompute); each run builds its strategy from train_gpt's own flags
(make_strategy) and trains through the loop's train_step (tests/scripts/exact.py). Checks,
each run: losses, gradient norms and every parameter of every stage (gathered as a
checkpoint gathers them) equal the reference to --tol; the tied wte bitwise equal on the
first and the last stage of each pipeline; the bytes each rank sent on its stage's cp group
= minidist/cp/ring.py's formula x the blocks this stage holds; runs that differ only in the
schedule (1F1B, GPipe, ZB-H1) or in recompute end bitwise equal. --files runs: evaluation
(on the ring) and sampling (without) give one process's loss and tokens; the checkpoint (one
process loads the whole model and Adam state: the reference's) and a fresh cp x pp run that
loads it back, bitwise, and takes the next step as the saved run does. Rank 0 prints
`RESULT {json}` per run for tests/test_cp_pp.py; any failure raises and the abort
handler ends the job.
"""
import argparse
import json
import os
import re
import sys
import tempfile
import zlib

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from exact import (batch, check_tied_copies, max_abs, run_steps, start,  # noqa: E402
                   whole_params, worst_over_ranks)

from minidist.comm import ProcessGroup, trace  # noqa: E402
from mpi4py import MPI  # noqa: E402  (after exact, so minidist.comm.init() starts MPI)
from minidist.cp.ring import ring_bytes  # noqa: E402
from minidist.autograd import no_grad  # noqa: E402
from minidist.nn import GPTConfig  # noqa: E402
from minidist.strategy import checkpoint  # noqa: E402
from minidist.strategy.base import SingleProcess  # noqa: E402
from minidist.train.args import train_parser  # noqa: E402
from minidist.train.step import train_step  # noqa: E402
from minidist.train.strategy import make_strategy  # noqa: E402

# block 16: zig-zag over 2 ranks cuts it in 4 chunks of 4; tiles of 2 cross the chunks
CONFIG = GPTConfig(n_layer=4, n_head=4, n_embd=16, block_size=16, vocab_size=30,
                   dropout=0.0, attention_block=2)
SEED = 7
DEFAULT_RUNS = {
    4: "cp2xpp2-m2-1f1b,cp2xpp2-m2-gpipe,cp2xpp2-m2-zbh1,cp2xpp2-m4-v2-1f1b,"
       "cp2xpp2-m2-1f1b-ckpt,cp2xpp2-m4-v2-1f1b-ckpt,cp2xpp2-m4-gpipe-naive,"
       "cp2xpp2-m2-ga2-zbh1",
    8: "cp2xpp2xdp2-m2-1f1b-z1,cp2xpp2xdp2-m2-gpipe-z3-ckpt,cp2xpp2xtp2-m2-zbh1,"
       "cp2xpp2xtp2-m4-v2-1f1b"}
DEFAULT_FILES = {4: "cp2xpp2-m4-v2-1f1b", 8: "cp2xpp2xdp2-m2-1f1b-z1"}


def flags(name, steps=3):
    """train_gpt's flags for run `name` (see the module docstring)."""
    extra = []
    for t in re.split(r"[-x]", name):
        size = re.fullmatch(r"(cp|dp|tp|pp|m|ga)(\d+)", t)
        if size:
            key = {"m": "--micro-batches", "ga": "--grad-accum"}.get(size[1], f"--{size[1]}")
            extra += [key, size[2]]
        else:
            extra += {"gpipe": ["--schedule", "gpipe"], "1f1b": ["--schedule", "1f1b"],
                      "zbh1": ["--schedule", "zb-h1"], "v2": ["--pp-virtual", "2"],
                      "naive": ["--cp-split", "naive"], "ckpt": ["--ckpt-activations"],
                      "z1": ["--zero", "1"], "z3": ["--zero", "3"],
                      "sp": ["--sequence-parallel"]}[t]
    c = CONFIG
    return train_parser().parse_args([
        "--n-layer", str(c.n_layer), "--n-head", str(c.n_head), "--n-embd", str(c.n_embd),
        "--block-size", str(c.block_size), "--dropout", "0", "--batch-size", "8",
        "--attention-block", str(c.attention_block), "--steps", str(steps), "--lr", "1e-2",
        "--grad-clip", "0.05", "--dtype", "float64", "--seed", str(SEED), *extra])


def step_ring_bytes(args, strategy):
    """Bytes one rank sends on its stage's cp group in one step: the ring formula for each
    block this stage holds, over all its rows (the micro-batches add up to them)."""
    mesh, n = strategy.mesh, args.cp
    rows = args.batch_size // mesh.shape["dp"]
    S = rows * (CONFIG.block_size // n) * (CONFIG.n_embd // mesh.shape["tp"]) * 8  # float64
    return ring_bytes(S, n, args.ckpt_activations) * len(strategy.stage.layers)


def crcs_of(state, comm):
    """name -> crc32 of the whole array, from every rank's part (any layout compares)."""
    out = {}
    for part in comm.allgather({n: zlib.crc32(np.ascontiguousarray(a).tobytes())
                                for n, a in state.items()}):
        out.update(part)
    return dict(sorted(out.items()))


def run(name, ref, comm, cli):
    args = flags(name)
    strategy = make_strategy(args, ProcessGroup.world(args.comm))
    sent0 = trace.bytes_sent("cp")
    model, opt, losses, norms, _ = run_steps(strategy, args, CONFIG, SEED, "float64")
    sent = (trace.bytes_sent("cp") - sent0) / args.steps
    state = whole_params(strategy, model, opt)
    r_model, r_losses, r_norms = ref
    want = {n: np.asarray(p.data) for n, p in r_model.named_parameters()}
    d_par = max_abs(a - want[n] for n, a in state.items())
    check_tied_copies(strategy, state)
    crcs = crcs_of(state, comm)
    row = {"run": name,
           "loss_diff": max_abs([float(a) - float(b) for a, b in zip(losses, r_losses)]),
           "norm_diff": max_abs([float(a) - float(b) for a, b in zip(norms, r_norms)]),
           "param_diff": worst_over_ranks(comm, d_par), "compared": len(crcs),
           "ref_params": len(want), "bytes_sent": sent,
           "theory_sent": step_ring_bytes(args, strategy), "crcs": crcs,
           "losses": [float(v) for v in losses]}
    worst = worst_over_ranks(comm, max_abs([row[k] for k in ("loss_diff", "norm_diff",
                                                             "param_diff")]))
    assert worst < cli.tol and len(crcs) == len(want), (name, row, worst)
    assert not comm.allreduce(sent != row["theory_sent"], op=MPI.LOR), (name, row)
    if name in cli.files.split(","):
        row.update(check_eval_and_sample(strategy, model, r_model, comm, cli.tol))
        row.update(check_files(strategy, model, opt, args, r_model, comm, cli.tol))
    return row


def check_eval_and_sample(strategy, model, r_model, comm, tol):
    """Evaluation runs the pipeline on the ring (each cp rank's loss over its tokens, their
    mean over dp x cp = one process's loss); sampling runs it without (any length, the whole
    sequence on every rank): the ranks that sample get one process's tokens."""
    x, y = batch(99, 4, CONFIG, SEED)
    sent0, n = trace.bytes_sent("cp"), strategy.mesh.shape["cp"]
    with no_grad():
        model.eval()
        got = float(strategy.global_mean(model(x, y)[1].data))
        want = float(r_model.eval()(x, y)[1].data)
    assert abs(got - want) <= tol, (got, want)
    S = 4 * (CONFIG.block_size // n) * (CONFIG.n_embd // strategy.mesh.shape["tp"]) * 8
    ring = 2 * S * (n - 1) * len(strategy.stage.layers)       # the ring's forward hops
    assert trace.bytes_sent("cp") - sent0 == ring, "evaluation did not run on the ring"
    prompt = x[:2, :5]
    tokens = model.generate(prompt, 12, seed=3) if strategy.takes_part_in_sampling() \
        else None
    same = tokens is None or np.array_equal(tokens, r_model.generate(prompt, 12, seed=3))
    assert comm.allreduce(same, op=MPI.LAND), "a sample differs from one process's"
    model.train()
    return {"eval_diff": worst_over_ranks(comm, got - want)}


def check_files(strategy, model, opt, args, r_model, comm, tol):
    """--save writes the whole model and Adam state in the one-process format (one process
    loads them: the reference's parameters), and a fresh cp x pp run loads its parts back
    bitwise and takes the next step as the saved run does (losses bitwise equal)."""
    path = comm.bcast(tempfile.mkdtemp(prefix="cp_pp_check_") if comm.rank == 0 else None)
    path = os.path.join(path, "ckpt")
    strategy.save(path, model, opt, args.steps, {}, {})
    one = SingleProcess()
    m1 = one.build_model(CONFIG, SEED + 1, "float64")
    checkpoint.load_checkpoint(path, m1, one.build_optimizer(m1, args))
    ckpt_diff = max_abs(a - np.asarray(r_model.state_dict()[n])
                        for n, a in m1.state_dict().items())
    again = make_strategy(args, ProcessGroup.world(args.comm))
    m2 = again.build_model(CONFIG, SEED + 1, "float64")
    o2 = again.build_optimizer(m2, args)
    again.load(path, m2, o2)
    mine, back = whole_params(strategy, model, opt), whole_params(again, m2, o2)
    assert all(np.array_equal(mine[n], back[n]) for n in mine), "reload differs"
    x, y = batch(args.steps, args.batch_size, CONFIG, SEED)
    next_losses = [float(train_step(s, m, o, x, y, args)[0])
                   for s, m, o in ((strategy, model, opt), (again, m2, o2))]
    assert next_losses[0] == next_losses[1], next_losses
    out = {"ckpt_diff": worst_over_ranks(comm, ckpt_diff), "next_loss": next_losses[0]}
    assert out["ckpt_diff"] <= tol, out
    return out


def check_bitwise_twins(rows):
    """Runs that differ only in the schedule (or in recompute) end bitwise equal."""
    groups = {}
    for r in rows:
        key = re.sub(r"-(gpipe|1f1b|zbh1|ckpt)", "", r["run"])
        groups.setdefault(key, []).append(r)
    for key, twins in groups.items():
        for r in twins[1:]:
            assert r["crcs"] == twins[0]["crcs"], f"{r['run']} != {twins[0]['run']}"
            assert r["losses"] == twins[0]["losses"], f"{r['run']} != {twins[0]['run']}"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--runs", default=None, help="comma-separated run names (docstring)")
    p.add_argument("--files", default=None, help="runs whose checkpoint is checked")
    cli, comm = start(p)
    runs = (cli.runs or DEFAULT_RUNS[comm.size]).split(",")
    cli.files = DEFAULT_FILES.get(comm.size, "") if cli.files is None else cli.files
    model, _, losses, norms, _ = run_steps(SingleProcess(), flags("cp1"), CONFIG, SEED,
                                           "float64")
    rows = []
    for name in runs:
        rows.append(run(name, (model, losses, norms), comm, cli))
        if comm.rank == 0:
            print("RESULT " + json.dumps({k: v for k, v in rows[-1].items() if k != "crcs"}),
                  flush=True)
    check_bitwise_twins(rows)


if __name__ == "__main__":
    main()
