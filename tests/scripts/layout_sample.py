"""The layouts the composition sweep runs (tests/scripts/layout_sweep.py): drawn from the
flags' values by a seeded sampler (`candidates`), each relevant flag set only where it does
something (--schedule only with --pp, --cp-split only with --cp, ...), kept where check_flags
and check_layout accept them, and a deterministic greedy pick (`select`) keeps the fewest
that show every flag value three times, each at every rank count it was accepted at, and
every pair of strategies and switches (`_traits`) twice. `LARGE`: 12- and 16-rank layouts
picked by hand instead (layout_sweep.py --large).

    python tests/scripts/layout_sweep.py --list      # the list this draws
Tests: tests/test_layout_sweep.py (the sampler alone, in the default run).
"""
import random

import numpy as np

BASE = ["--n-layer", "4", "--n-head", "4", "--n-embd", "32", "--block-size", "16",
        "--batch-size", "8", "--steps", "3", "--lr", "1e-2", "--eval-every", "0",
        "--eval-iters", "1", "--sample", "0", "--log-every", "1"]

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
    if f["--amp"]:
        f["--amp-dtype"] = rng.choice(["float16", "bfloat16"])     # bfloat16: ml_dtypes
    f["--comm"] = _pick(rng, ["ring", "naive", "mpi", "hier"])
    f["--sync-comm"] = rng.random() < 0.15
    f["--no-bias"] = rng.random() < 0.15
    if cp > 1:           # drawn last: the draws above are the ones before Ulysses existed
        f["--cp-attention"] = _pick(rng, ["ring", "ulysses"])
    zero_ranks = dp * ep * cp             # ZeRO's group; hybrid sharding: K of them per replica
    if f["--zero"] and zero_ranks > 1:    # after Ulysses' draw, for the same
        f["--zero-shard"] = _pick(rng, [None] + [k for k in (1, 2) if k < zero_ranks])
    if f["--zero"] in (1, 2):             # drawn last, after the hybrid sharding's
        f["--overlap-param-gather"] = rng.random() < 0.5
    if rng.random() < 0.3:                # drawn last: Llama's block (no biases to drop)
        f["--arch"] = "llama"
        f["--n-kv-head"] = _pick(rng, [None, 2, 1])      # grouped-query, multi-query
        f["--no-bias"] = False
    if f["--attention"] == "materialized" and rng.random() < 0.5:   # drawn last: selective
        f["--attention"] = "recompute"                               # recompute
    if moe and rng.random() < 0.4:        # drawn last: shared experts beside the routed
        f["--moe-shared"] = 1
    if rng.random() < 0.3:                # drawn last: Muon for the blocks' matrices
        f["--optimizer"] = "muon"
    if moe and rng.random() < 0.4:        # drawn last: auxiliary-loss-free balancing
        f["--moe-bias-rate"] = 0.01       # (10 x DeepSeek-V3's: it moves routing in 3 steps)
    return {k: v for k, v in f.items() if v is not None and v is not False}


def argv(flags):
    """The command line of a layout's flags (a switch: the flag alone)."""
    out = []
    for k, v in flags.items():
        out += [k] if v is True else [k, str(v)]
    if flags.get("--amp"):
        out += ([] if "--amp-dtype" in flags else ["--amp-dtype", "float16"]) + ["--dtype",
                                                                                "float32"]
    else:
        out += ["--dtype", "float64"]
    return out


def accepted(ranks, flags):
    """None if check_flags and check_layout accept the layout on `ranks`, else the error."""
    from minidist.train.args import parse_train_flags
    from minidist.train.cli import UsageError, check_flags
    from minidist.train.strategy import check_layout
    args = parse_train_flags(BASE + argv(flags) + ["--device", "cpu"])
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
    out += ["--amp-dtype bfloat16"] if flags.get("--amp-dtype") == "bfloat16" else []
    out += ["--dropout"] if flags.get("--dropout") else []
    out += ["--grad-accum 2"] if flags.get("--grad-accum") == 2 else []
    out += ["--attention tiled"] if flags.get("--attention") == "tiled" else []
    out += ["--cp-attention ulysses"] if flags.get("--cp-attention") == "ulysses" else []
    out += ["--zero-shard"] if "--zero-shard" in flags else []
    out += ["--overlap-param-gather"] if "--overlap-param-gather" in flags else []
    out += ["--arch llama"] if flags.get("--arch") == "llama" else []
    out += ["--attention recompute"] if flags.get("--attention") == "recompute" else []
    out += ["--moe-shared"] if "--moe-shared" in flags else []
    out += ["--optimizer muon"] if flags.get("--optimizer") == "muon" else []
    out += ["--moe-bias-rate"] if "--moe-bias-rate" in flags else []
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
        if key in seen:                 # drawn before: accepted then, or refused
            continue
        seen.add(key)
        if accepted(ranks, flags) is None:
            out.append((ranks, flags))
    return out


def select(cands, want=3, pairs=2, limit=None):
    """Greedy, deterministic: add the candidate that brings the most features still short of
    their showings (a (flag, value): `want`; a pair of traits: `pairs`; a (flag, value,
    ranks): one), until none brings any (or `limit`)."""
    need = {}
    left = [(c, features(*c)) for c in cands]          # each candidate's, computed once
    for _, feats in left:
        for f in feats:
            need[f] = want if len(f) == 2 else pairs if f[2] == "pair" else 1
    chosen = []
    while left and (limit is None or len(chosen) < limit):
        gain = [sum(1 for f in feats if need[f] > 0) for _, feats in left]
        best = max(range(len(left)), key=lambda i: (gain[i], -i))
        if gain[best] == 0:
            break
        c, feats = left.pop(best)
        for f in feats:
            need[f] -= 1
        chosen.append(c)
    return chosen


def layouts(ranks_list=(2, 4), seed=0, count=None):
    return select(candidates(seed, list(ranks_list)), limit=count)


# The 12- and 16-rank layouts (layout_sweep.py --large), picked by hand: every axis > 1 at
# once, sizes the sampler (2, 4 and 8 ranks, axes of 2 and 4) never draws (dp 3, --pp 3, --cp
# 3, --ep 3 and --zero-shard 3: rings and ZeRO shards of three, padded), hybrid ZeRO-3 groups,
# interleaved stages over tp x dp, cp rings of 4 inside tp 2. --n-layer, --batch-size and
# --block-size are the reference's too (layout_sweep.REF): 8 layers for 4 x 2 virtual stages,
# 6 for 3 stages, batches of 12 for dp 3, sequences of 24 for cp 3's zigzag halves.
LARGE = [
    (16, {"--dp": 2, "--tp": 2, "--pp": 2, "--cp": 2, "--schedule": "1f1b"}),
    (16, {"--tp": 2, "--pp": 2, "--cp": 2, "--cp-attention": "ulysses",
          "--sequence-parallel": True}),
    (16, {"--dp": 4, "--tp": 2, "--pp": 2, "--schedule": "gpipe", "--micro-batches": 2}),
    (16, {"--tp": 2, "--pp": 2, "--cp": 2, "--zero": 1}),
    (16, {"--tp": 2, "--pp": 2, "--cp": 2, "--zero": 2, "--sequence-parallel": True}),
    (16, {"--tp": 2, "--pp": 2, "--cp": 2, "--zero": 3}),
    (16, {"--tp": 2, "--cp": 2, "--zero": 3, "--zero-shard": 2}),
    (16, {"--tp": 2, "--zero": 3, "--zero-shard": 4}),
    (16, {"--moe-experts": 8, "--ep": 2, "--tp": 2, "--sequence-parallel": True, "--cp": 2}),
    (16, {"--moe-experts": 8, "--ep": 4, "--tp": 2, "--sequence-parallel": True,
          "--zero": 1}),
    (16, {"--pp": 4, "--pp-virtual": 2, "--schedule": "1f1b", "--tp": 2, "--dp": 2,
          "--n-layer": 8}),
    (16, {"--pp": 4, "--schedule": "zb-h1", "--dp": 4}),
    (16, {"--cp": 4, "--tp": 2, "--dp": 2}),
    (16, {"--tp": 2, "--cp": 2, "--zero": 1, "--overlap-param-gather": True}),
    (16, {"--tp": 2, "--pp": 2, "--optimizer": "muon", "--zero": 1}),
    (16, {"--arch": "llama", "--n-kv-head": 2, "--tp": 2, "--cp": 2,
          "--cp-attention": "ulysses"}),
    (16, {"--arch": "llama", "--n-kv-head": 2, "--tp": 2, "--cp": 4}),
    (12, {"--batch-size": 12}),
    (12, {"--tp": 2, "--zero": 3, "--batch-size": 12}),
    (12, {"--tp": 2, "--zero": 1, "--zero-shard": 3, "--batch-size": 12}),
    (12, {"--pp": 3, "--tp": 2, "--dp": 2, "--n-layer": 6}),
    (12, {"--cp": 3, "--tp": 2, "--dp": 2, "--block-size": 24}),
    (12, {"--moe-experts": 6, "--ep": 3, "--tp": 2, "--zero": 2, "--batch-size": 12}),
    # sizes and switches at 12 and 16 ranks: --comm hier's groups of 3 over nodes of 2, a
    # bucketed ring of 3, dropout's keys, a stage without MoE blocks, --amp, tiled attention
    (12, {"--comm": "hier", "--dp": 3, "--tp": 2, "--pp": 2, "--zero": 1, "--batch-size": 12}),
    (12, {"--comm": "hier", "--tp": 2, "--zero": 3, "--zero-shard": 3, "--batch-size": 12}),
    (12, {"--ddp": "bucketed", "--bucket-mb": 0.01, "--dp": 3, "--cp": 2, "--tp": 2,
          "--cp-split": "naive", "--batch-size": 12}),
    (16, {"--dropout": 0.1, "--tp": 2, "--cp": 2, "--sequence-parallel": True, "--pp": 2,
          "--grad-accum": 2}),
    (16, {"--pp": 4, "--micro-batches": 8, "--moe-experts": 8, "--moe-every": 4, "--ep": 2,
          "--tp": 2, "--n-layer": 8, "--batch-size": 16}),
    (16, {"--comm": "naive", "--sync-comm": True, "--zero": 2, "--ep": 4, "--moe-experts": 8,
          "--moe-shared": 1, "--moe-bias-rate": 0.01, "--moe-top-k": 2, "--cp": 2}),
    (16, {"--amp": True, "--tp": 2, "--pp": 2, "--dp": 4}),
    (16, {"--attention": "tiled", "--attention-block": 8, "--cp": 4, "--cp-split": "naive",
          "--tp": 2, "--ckpt-activations": True}),
    (12, {"--cp": 3, "--cp-split": "naive", "--tp": 2, "--pp": 2, "--block-size": 24,
          "--zero": 2}),
    (12, {"--moe-experts": 6, "--ep": 3, "--moe-capacity-factor": 1.25, "--moe-top-k": 2,
          "--pp": 2, "--schedule": "zb-h1", "--batch-size": 12}),
    (16, {"--pp": 2, "--pp-virtual": 2, "--cp": 2, "--cp-attention": "ulysses", "--tp": 2,
          "--zero": 1, "--overlap-param-gather": True}),
    (12, {"--zero": 3, "--zero-shard": 4, "--batch-size": 12}),
    (12, {"--optimizer": "muon", "--zero": 3, "--tp": 2, "--batch-size": 12}),
    (12, {"--comm": "mpi", "--dp": 3, "--pp": 4, "--schedule": "zb-h1", "--batch-size": 12,
          "--dropout": 0.1}),
    (16, {"--comm": "hier", "--tp": 2, "--cp": 2, "--ep": 2, "--moe-experts": 4, "--zero": 1,
          "--zero-shard": 2}),
]

# What LARGE's checkpoints resume in under --reshard (layout_sweep.partner; every fourth:
# one process): 4-rank layouts, each cut otherwise than the 12 and 16 ranks that saved.
LARGE_INTO = [
    (4, {"--tp": 2, "--zero": 1}),
    (4, {"--pp": 2, "--cp": 2}),
    (4, {"--zero": 3, "--zero-shard": 2}),
    (4, {"--tp": 4}),
    (4, {"--pp": 2, "--tp": 2, "--zero": 2}),
    (4, {"--cp": 2, "--dp": 2, "--zero": 1}),
]


def describe(ranks, flags):
    return f"-n {ranks} " + " ".join(argv(flags)[:-2] if not flags.get("--amp")
                                     else argv(flags))
