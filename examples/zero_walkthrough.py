"""Watch ZeRO's step for N ranks inside one process: the flat units and who owns what, the
gradients' reduce-scatter, AdamW on each rank's shard, the all-gather, and at the end the same
parameters as one process.

    python examples/zero_walkthrough.py                  # 4 ranks, a one-block GPT of width 6
    python examples/zero_walkthrough.py --ranks 3 --rings    # and every ring step's table
    python examples/zero_walkthrough.py --pdb            # stop where the shards are to step:
    (Pdb) p shards[1]                                    # what rank 1 keeps of each unit
    (Pdb) p shards[1][0].grad                            # its slice of the averaged gradient
    (Pdb) n                                              # on through step_shards

Everything that moves numbers is the library's own: the units are zero/flat.py's `gpt_units`
(rank r of N owns flat[r*S:(r+1)*S] of every unit), the collectives run ring.py's schedule
through comm/simulate.py, each shard steps with `adamw_update` as ShardedAdamW does
(zero/optim.py), the gradients come from the model's own backward. It is what `mpiexec -n 4
python examples/train_gpt.py --zero 1` does in a step, one list entry per rank; the stages
differ in what a rank keeps between these moves and when they run (the table at the end).
Tests: tests/test_zero.py::test_zero_walkthrough_equals_one_process.
"""
import pdb
import sys
import textwrap

import numpy as np

from minidist.comm.simulate import simulate_all_gather, simulate_reduce_scatter
from minidist.nn import GPT, GPTConfig
from minidist.optim import AdamW, adamw_update
from minidist.zero.flat import gpt_units
from minidist.train.args import example_parser

CONFIG = GPTConfig(n_layer=1, n_head=2, n_embd=6, block_size=4, vocab_size=8)
LR, WEIGHT_DECAY = 0.01, 0.1


class Shard:
    """What one rank keeps of one unit at every ZeRO stage: its slice [lo, hi) of the
    parameters (here a copy: at stages 1 and 2 it is a view into the full flat buffer), of
    the averaged gradient, and Adam's m and v."""

    def __init__(self, unit, param):
        self.unit, self.param, self.grad = unit, param, None
        self.m, self.v = np.zeros_like(param), np.zeros_like(param)

    def __repr__(self):
        u = self.unit
        return f"Shard(rank {u.rank}, {u.name}[{u.lo}:{u.hi}]: {pieces_text(u)})"


def pieces_text(unit):
    """Which parameters' elements fall in this rank's shard, e.g. 'wte[42:48] wpe[0:15]'."""
    parts = [f"{short(unit.names[i])}[{a}:{b}]" for i, a, b in unit.pieces()]
    pad = max(0, unit.hi - unit.numel) - max(0, unit.lo - unit.numel)
    return " ".join(parts + ([f"+{pad} padding"] if pad else []))


def short(name):
    return name.replace("transformer.h.0.", "").replace("transformer.", "")


def show_units(layouts):
    """Each unit's layout, and for each rank the elements its shard holds."""
    for k, unit in enumerate(layouts[0]):
        print(f"unit {unit.name}: {len(unit.params)} parameters, {unit.numel} elements + "
              f"{unit.padding} padding = {unit.world} shards x {unit.shard_size}")
        for units in layouts:
            u = units[k]
            print(textwrap.fill(pieces_text(u), 96, initial_indent=f"  rank {u.rank} owns "
                                f"[{u.lo:4d}, {u.hi:4d}): ", subsequent_indent=" " * 8))


def rank_gradients(model, layouts, x, y):
    """Each rank's gradient on its own rows, one padded flat buffer per unit (what a rank's
    backward leaves in its gradient buffers before any communication)."""
    rows, out = len(x) // len(layouts), []
    for r, units in enumerate(layouts):
        for p in model.parameters():
            p.grad = None
        _, loss = model(x[r * rows:(r + 1) * rows], y[r * rows:(r + 1) * rows])
        loss.backward()
        out.append([u.flatten([p.grad for p in u.params]) for u in units])
    return out


def step_shards(shards, step):
    """Every rank's AdamW on its own shards, as ShardedAdamW._update does: decoupled weight
    decay on the shard's decayed ranges only (a shard may hold a matrix and a LayerNorm
    weight), then adamw_update on the plain slices with decay 0."""
    for mine in shards:
        for s in mine:
            for a, b in s.unit.decay_ranges():
                s.param[a:b] *= 1.0 - LR * WEIGHT_DECAY
            adamw_update(s.param, s.grad, s.m, s.v, step, LR, weight_decay=0.0)


def one_process(x, y, steps):
    """The reference: one process, the whole batch, minidist's AdamW."""
    model = GPT(CONFIG, seed=0, dtype="float64")
    opt = AdamW(list(model.named_parameters()), lr=LR, weight_decay=WEIGHT_DECAY)
    grads = []
    for step in range(steps):
        opt.zero_grad()
        _, loss = model(x[step], y[step])
        loss.backward()
        grads.append({n: p.grad.copy() for n, p in model.named_parameters()})
        opt.step()
    return dict(model.named_parameters()), grads


def main(argv=None):
    p = example_parser(__doc__)
    p.add_argument("--ranks", type=int, default=4, help="simulated data-parallel ranks")
    p.add_argument("--rows", type=int, default=2, help="sequences per rank per step")
    p.add_argument("--steps", type=int, default=1, help="training steps to simulate")
    p.add_argument("--rings", action="store_true", help="print every ring step's table")
    p.add_argument("--pdb", action="store_true", help="stop in pdb before the shards step")
    args = p.parse_args(argv)
    for flag in ("ranks", "rows", "steps"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag} {getattr(args, flag)}: give 1 or more")
    n = args.ranks
    rng = np.random.default_rng(0)
    x = rng.integers(0, CONFIG.vocab_size, (args.steps, n * args.rows, CONFIG.block_size))
    y = np.roll(x, -1, axis=2)
    ref_params, ref_grads = one_process(x, y, args.steps)

    model = GPT(CONFIG, seed=0, dtype="float64")        # every rank starts from these
    layouts = [gpt_units(model, n, r) for r in range(n)]  # one layout, each rank its [lo, hi)
    print(f"ZeRO over {n} simulated ranks, {args.rows} sequences each: a GPT of "
          f"{sum(u.numel for u in layouts[0])} parameter elements (float64) in "
          f"{len(layouts[0])} flat units\n")
    show_units(layouts)
    flats = [[u.flatten() for u in units] for units in layouts]   # stage 1: full parameters
    shards = [[Shard(u, f[u.lo:u.hi].copy()) for u, f in zip(units, mine)]
              for units, mine in zip(layouts, flats)]
    ring_show = print if args.rings else (lambda *_: None)
    worst = 0.0
    for step in range(args.steps):
        print(f"\n---- step {step + 1}: backward on each rank's rows, then per unit:")
        grads = rank_gradients(model, layouts, x[step], y[step])
        for k, unit in enumerate(layouts[0]):
            averaged = simulate_reduce_scatter([g[k] for g in grads], "avg", ring_show)
            want = unit.flatten([ref_grads[step][nm] for nm in unit.names])
            diff = 0.0
            for r in range(n):
                s = shards[r][k]
                s.grad = averaged[r][s.unit.lo:s.unit.hi].copy()
                diff = np.maximum(diff, np.abs(s.grad - want[s.unit.lo:s.unit.hi]).max())
            print(f"  reduce-scatter {unit.name} (avg): rank r keeps slice r of the mean "
                  f"gradient; max |slice - one process's| = {diff:.1e}")
        if args.pdb:
            pdb.Pdb().runcall(step_shards, shards, step + 1)
        else:
            step_shards(shards, step + 1)
        print(f"  AdamW: each rank steps only its shards, "
              f"{sum(u.shard_size for u in layouts[0])} of the "
              f"{sum(u.numel for u in layouts[0])} elements, and keeps m, v for them alone")
        for k, unit in enumerate(layouts[0]):
            for r in range(n):
                s = shards[r][k]
                flats[r][k][s.unit.lo:s.unit.hi] = s.param
            gathered = simulate_all_gather([f[k] for f in flats], ring_show)
            want = unit.flatten([ref_params[nm].data for nm in unit.names]) \
                if step == args.steps - 1 else None
            for r in range(n):
                flats[r][k][...] = gathered[r]
                shards[r][k].param = gathered[r][layouts[r][k].lo:layouts[r][k].hi].copy()
            if want is not None:
                diff = np.max([np.abs(g[:unit.numel] - want[:unit.numel]).max()
                               for g in gathered])             # (a NaN stays NaN)
                worst = np.maximum(worst, diff)
                print(f"  all-gather {unit.name}: every rank holds every updated shard; max "
                      f"|parameters - one process's after AdamW| = {diff:.1e}")
        for u, f in zip(layouts[0], flats[0]):     # the model (every rank's copy: equal)
            u.point_params_at(f)                     # computes the next step from them
    show_stages(layouts[0])
    ok = worst <= 1e-12
    print(f"\nevery rank's parameters = one process's after {args.steps} "
          f"step{'s' * (args.steps > 1)}: "
          f"{'OK' if ok else 'MISMATCH'} (max difference {worst:.1e})")
    return 0 if ok else 1


def show_stages(units):
    """Elements one rank keeps between steps at each stage, and when the moves run."""
    full = sum(u.numel for u in units)
    mine = sum(u.shard_size for u in units)
    gather = max(u.padded for u in units if u.module is not None)
    print("\nwhat one rank keeps between steps, in elements (Adam's m and v: 2 per "
          "parameter),\nand when the moves above run:")
    print(f"  {'':8}{'params':>8}{'grads':>8}{'m, v':>8}")
    rows = [("DDP", full, full, 2 * full, "no sharding: one all-reduce of the gradients"),
            ("ZeRO-1", full, full, 2 * mine, "each block's reduce-scatter as backward "
                                               "finishes it (the full gradients kept), the "
                                               "all-gather after the step"),
            ("ZeRO-2", full, mine, 2 * mine, "each block's reduce-scatter as backward "
                                               "finishes it, the all-gather after the step"),
            ("ZeRO-3", mine, mine, 2 * mine, f"each block all-gathered before its forward "
                                               f"and again before its backward ({gather} "
                                               f"elements at a time), then dropped (in "
                                               f"training the last two blocks are still "
                                               f"held at the turn, and the root is gathered "
                                               f"once a step: minidist/zero/stage3.py)")]
    for name, prm, grd, opt, _ in rows:
        print(f"  {name:8}{prm:>8}{grd:>8}{opt:>8}")
    for name, *_, when in rows[1:]:
        print(f"  {name}: {when}")
    print("  (minidist/zero/zero.py: ZeroStage1._grad_complete; minidist/zero/stage2.py: "
          "ZeroStage2._grad_ready; minidist/zero/stage3.py: ZeroStage3.before_block)")


if __name__ == "__main__":
    sys.exit(main())
