"""The machine the step-time model (minidist/train/cost.py) prices a layout on: `Cluster`
(nodes of GPUs or ranks, their peak FLOP/s and the efficiency reached, the intra- and
inter-node links of minidist/train/comm_cost.py, the optimizer's time per parameter, how much
communication hides under compute), `Elementwise` (the elementwise work tensor parallelism
repeats without sequence parallelism, seconds per activation byte); the preset `H100_IB`,
this machine measured (`cluster_from_calibration`, from the file examples/calibrate_here.py
writes) and the command line's changes to either (`with_links`; examples/plan.py).
Tests: tests/test_plan_time.py, tests/test_plan_calibration.py.
"""
import json
import math
from dataclasses import astuple, dataclass, field, replace

from minidist.train.comm_cost import Link


@dataclass(frozen=True)
class Elementwise:
    """Seconds per byte of one activation (b s h e bytes) of the elementwise work a TP rank
    repeats without SP, forward (_f) and backward (_b): `layer` one block's (ln_1, ln_2, the two
    row-parallel bias adds, the two residual adds), `embed` the token + position add, `head`
    ln_f. Measured by examples/calibrate_here.py; `hbm_elementwise` for a GPU."""
    layer_f: float = 0.0
    layer_b: float = 0.0
    embed_f: float = 0.0
    embed_b: float = 0.0
    head_f: float = 0.0
    head_b: float = 0.0

    def scaled(self, k):
        return Elementwise(*(k * v for v in astuple(self)))


def hbm_elementwise(bw):
    """Elementwise at `bw` bytes/s of memory bandwidth, each op reading and writing its
    activations once (unfused, as minidist runs them; statistics and (C,) vectors ignored),
    in activation-sized passes: layer norm forward 2 (read x, write y), backward 3 (x, dy,
    dx); bias add forward 2, backward 1 (sum dy); residual add forward 3, backward 3 (the two
    gradients summed). A block: 2 norms + 2 bias adds + 2 adds = 14 forward, 14 backward; the
    embedding add 3 forward, 1 backward (the position gradient); ln_f 2 and 3."""
    return Elementwise(14 / bw, 14 / bw, 3 / bw, 1 / bw, 2 / bw, 3 / bw)


@dataclass(frozen=True)
class Cluster:
    """GPUs (or ranks) in nodes, their compute and their links. peak_tflops: dense 16-bit
    (amp) peak; peak_tflops_fp32 for float32 (None: the same); gamma: seconds per byte of a
    collective's local reduction; opt_s_per_param: the optimizer's time per parameter it
    updates; overlap: fraction of a window communication can hide in (1: all of it);
    compute_slots: ranks per node that compute at full speed at once (None: all);
    replicated: the elementwise work TP without SP repeats (Elementwise); sync_s: seconds a
    blocking TP/CP collective waits beyond its alpha-beta time (the ranks' arrival)."""
    name: str
    gpus_per_node: int
    mem_gib: float
    peak_tflops: float
    efficiency: float
    intra: Link
    inter: Link
    peak_tflops_fp32: float = None
    gamma: float = 0.0
    opt_s_per_param: float = 0.0
    overlap: float = 1.0
    compute_slots: int = None
    replicated: Elementwise = Elementwise()
    sync_s: float = 0.0
    notes: dict = field(default_factory=dict, compare=False)


# H100 SXM (DGX/HGX H100): 989 TFLOP/s dense bf16, 80 GB HBM3 at 3.35 TB/s; NVLink 4 at 450
# GB/s per direction per GPU; one 400 Gb/s (50 GB/s) NDR InfiniBand NIC per GPU. Latencies,
# the efficiency and the sync are assumptions (typical published figures: ~3 us NVLink, ~5 us
# IB, 40-50% MFU; 5 us per blocking collective for a kernel launch and the ranks' skew); the
# elementwise work runs at the full HBM bandwidth (a lower bound: no kernel reaches it).
H100_IB = Cluster("h100-sxm-ib400", gpus_per_node=8, mem_gib=80.0, peak_tflops=989.0,
                  peak_tflops_fp32=67.0, efficiency=0.45, intra=Link(3e-6, 450e9),
                  inter=Link(5e-6, 50e9), opt_s_per_param=32 / 3.35e12,
                  replicated=hbm_elementwise(3.35e12), sync_s=5e-6)


def efficiency_for_width(cal, n_embd=None):
    """(efficiency, how it was chosen) for a model `n_embd` wide from a calibration: its
    "efficiency_by_width" ({width: efficiency}, examples/calibrate_here.py measures a few)
    interpolated in log2(width) between the two measured widths around n_embd, the nearest
    one's outside them (said so); a calibration with one figure, that figure, and a warning
    that other shapes differ (first-use walk 32: 0.39 at width 128 against 0.53 at 256 here:
    Python's per-op time does not shrink with the matmuls)."""
    widths = sorted((int(w), e) for w, e in cal.get("efficiency_by_width", {}).items())
    if not widths:
        return cal["efficiency"], ("measured on one model (4 x 256, T 128) only: a model of "
                                   "another width can step up to 2x off")
    if n_embd is None:
        n_embd = widths[-1][0]
    lo = max([p for p in widths if p[0] <= n_embd], default=widths[0])
    hi = min([p for p in widths if p[0] >= n_embd], default=widths[-1])
    measured = "/".join(str(w) for w, _ in widths)
    if lo == hi:
        inside = widths[0][0] <= n_embd <= widths[-1][0]
        return lo[1], (f"measured at width {lo[0]}" if inside else
                       f"width {n_embd} is outside the measured {measured}: width {lo[0]}'s")
    f = (math.log2(n_embd) - math.log2(lo[0])) / (math.log2(hi[0]) - math.log2(lo[0]))
    return lo[1] + f * (hi[1] - lo[1]), f"interpolated between widths {lo[0]} and {hi[0]}"


def cluster_from_calibration(path, ranks=None, n_embd=None):
    """The measured machine (examples/calibrate_here.py writes the file): one node of
    `ranks` ranks sharing `cores` cores; the ring's alpha, bandwidth and gamma fitted from
    bench_collectives.py at that rank count (the nearest one measured; oversubscribed cores
    slow messages too, so each count has its own fit), and the sync of a blocking collective
    likewise; the elementwise work TP repeats, timed in one process. Its `mem_gib` is each
    rank's share of the node's memory (the calibration's, measured with the machine): the
    ranks are processes on this one node sharing it, where a GPU's memory is its own. Its
    name says when, and under what load, the figures were measured; its notes, what was
    measured where the plan asks for something else (efficiency_for_width for a model
    `n_embd` wide; a rank count the collectives were not measured at)."""
    with open(path) as f:
        cal = json.load(f)
    problem = calibration_problem(cal)
    if problem:
        raise ValueError(problem)
    ranks = ranks or cal["cores"]

    def nearest(fits):
        return fits[min(fits, key=lambda k: abs(int(k) - ranks))]
    fit = nearest(cal["links"])
    efficiency, how = efficiency_for_width(cal, n_embd)
    notes = {"calibration": path, "efficiency": how}
    if str(ranks) not in cal["links"]:
        measured = ", ".join(sorted(cal["links"], key=int))
        notes["ranks"] = (f"collectives measured at {measured} ranks; {ranks} priced with "
                          f"{min(cal['links'], key=lambda k: abs(int(k) - ranks))}'s fit and "
                          f"{cal['cores']} cores shared evenly")
    when = (f" {cal['date']} at load {cal['load_before']:.2f}" if "date" in cal and
            "load_before" in cal else "")
    return Cluster(f"here (measured{when})", gpus_per_node=max(ranks, cal["cores"]),
                   mem_gib=cal["mem_gib"] / ranks, peak_tflops=cal["peak_tflops"],
                   efficiency=efficiency, intra=Link(fit["alpha"], fit["bw"]),
                   inter=Link(fit["alpha"], fit["bw"]), gamma=fit["gamma"],
                   opt_s_per_param=cal["opt_s_per_param"], overlap=cal["overlap"],
                   compute_slots=cal["cores"], replicated=Elementwise(**cal["replicated"]),
                   sync_s=nearest(cal["sync"])["sync_s"], notes=notes)


def calibration_problem(cal):
    """What is wrong with a calibration's numbers (a hand-edited file: cores 0 was a
    ZeroDivisionError, a negative peak negative step times; first-use walk 34), or None."""
    def number(x, low=0.0, high=float("inf"), low_ok=False):
        return (isinstance(x, (int, float)) and not isinstance(x, bool) and
                (x >= low if low_ok else x > low) and x <= high)
    checks = [("cores", number(cal.get("cores")) and cal.get("cores") == int(cal["cores"])),
              ("mem_gib", number(cal.get("mem_gib"))),
              ("peak_tflops", number(cal.get("peak_tflops"))),
              ("efficiency", number(cal.get("efficiency"), high=1.0)),
              ("overlap", number(cal.get("overlap"), high=1.0, low_ok=True)),
              ("opt_s_per_param", number(cal.get("opt_s_per_param"), low_ok=True))]
    checks += [(f"efficiency_by_width {w}", number(e, high=1.0))
               for w, e in cal.get("efficiency_by_width", {}).items()]
    checks += [(f"links {r} {k}", number(fit.get(k), low_ok=k != "bw"))
               for r, fit in cal.get("links", {}).items() for k in ("alpha", "bw", "gamma")]
    bad = [name for name, ok in checks if not ok]
    return f"{', '.join(bad)}: not a positive number (or out of range)" if bad else None


def assumptions(cluster):
    """What the step-time model takes as given for `cluster`, for the planners to print: the
    peaks (TFLOP/s; float32's, the 16-bit one where the cluster has no other), the
    efficiency, the share of a compute window communication hides in, each link's latency
    (us) and bandwidth (GB/s per GPU), the wait per blocking collective (us), and the
    cluster's "notes" (a calibration: its file, how the efficiency was chosen, ranks it did
    not measure)."""
    return {"peak_tflops": cluster.peak_tflops,
            "peak_tflops_fp32": cluster.peak_tflops_fp32 or cluster.peak_tflops,
            "efficiency": cluster.efficiency, "overlap": cluster.overlap,
            "intra_us": cluster.intra.alpha * 1e6, "intra_gbps": cluster.intra.bw / 1e9,
            "inter_us": cluster.inter.alpha * 1e6, "inter_gbps": cluster.inter.bw / 1e9,
            "sync_us": cluster.sync_s * 1e6, "compute_slots": cluster.compute_slots,
            "notes": dict(cluster.notes)}


def assumptions_text(cluster, amp=True):
    """assumptions() as one line: "assumed: 989 TFLOP/s (16-bit; float32 67) at 0.45 of it;
    communication hides in 100% of a compute window; intra-node 3 us + 450 GB/s, inter-node
    5 us + 50 GB/s; 5 us per blocking collective". `amp`: which peak the plan computes at
    comes first."""
    a = assumptions(cluster)
    if a["peak_tflops_fp32"] == a["peak_tflops"]:
        peak = f"{a['peak_tflops']:.4g} TFLOP/s"
    elif amp:
        peak = f"{a['peak_tflops']:.4g} TFLOP/s (16-bit; float32 {a['peak_tflops_fp32']:.4g})"
    elif a["compute_slots"]:          # cores: a measured float32 rate, no 16-bit one
        peak = f"{a['peak_tflops_fp32']:.4g} TFLOP/s (float32)"
    else:
        peak = (f"{a['peak_tflops_fp32']:.4g} TFLOP/s (float32; 16-bit "
                f"{a['peak_tflops']:.4g})")
    slots = f" per core, {a['compute_slots']} cores" if a["compute_slots"] else ""
    links = (f"{a['intra_us']:.3g} us + {a['intra_gbps']:.3g} GB/s" if cluster.intra ==
             cluster.inter else
             f"intra-node {a['intra_us']:.3g} us + {a['intra_gbps']:.3g} GB/s, inter-node "
             f"{a['inter_us']:.3g} us + {a['inter_gbps']:.3g} GB/s")
    return (f"assumed: {peak}{slots} at {a['efficiency']:.2f} of it; communication hides in "
            f"{a['overlap']:.0%} of a compute window; links {links}; "
            f"{a['sync_us']:.3g} us per blocking collective")


def fills_nodes(gpus, gpus_per_node):
    """Whether `gpus` ranks fill whole nodes of `gpus_per_node`, or fit in one (a job on part
    of one node). The planners assume every node alike: comm_cost.span prices each group like
    the one holding rank 0, and PP across nodes means whole nodes per stage; launchers fill
    nodes in rank order, so 12 GPUs on nodes of 8 are 8 + 4, and the 4 would be priced as 8."""
    return gpus <= gpus_per_node or gpus % gpus_per_node == 0


def with_links(cluster, intra=None, inter=None, **changes):
    """`cluster` with its links' alpha/bw replaced where given, not None (CLI overrides; a
    latency of 0 is given)."""
    def link(new, old):
        return Link(old.alpha if new[0] is None else new[0], old.bw if new[1] is None else new[1])
    if intra:
        changes["intra"] = link(intra, cluster.intra)
    if inter:
        changes["inter"] = link(inter, cluster.inter)
    return replace(cluster, **{k: v for k, v in changes.items() if v is not None})
