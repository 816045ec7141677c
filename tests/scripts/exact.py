"""What the exactness scripts share: the global batch of a step, and N steps of the real loop;
a pipeline's tied-embedding check (pp_check, cp_pp_check); the scripts' common start (`start`);
the NaN-safe largest difference (`max_abs`), on one rank and over all (`worst_over_ranks`).

Each script (ddp_check, tp_check, zero_check, ep_check, dropout_check) trains a strategy and
the one-process reference through these same functions, so any difference comes from the
strategy alone; `whole_params` is what a checkpoint of it would hold.
"""
import zlib

import numpy as np

import minidist.comm
from minidist import backend
from minidist.train.step import train_step


def batch(step, rows, config, seed):
    """The global batch of `step`: a pure function of (seed, step), like TokenData's."""
    rng = np.random.default_rng([seed, step])
    x = rng.integers(0, config.vocab_size, size=(rows, config.block_size))
    return x, np.roll(x, -1, axis=1)


def run_steps(strategy, args, config, seed, dtype):
    """args.steps steps of train_step on the global batches of args.batch_size rows.
    Returns (model, optimizer, losses, grad norms, the last step's memory row)."""
    model = strategy.build_model(config, seed, dtype)
    opt = strategy.build_optimizer(model, args)
    losses, norms, mem = [], [], None
    for step in range(args.steps):
        x, y = batch(step, args.batch_size, config, seed)
        loss, norm, mem = train_step(strategy, model, opt, x, y, args)
        losses.append(loss)
        norms.append(norm)
    return model, opt, losses, norms, mem


def whole_params(strategy, model, opt):
    """name -> host array: on world rank 0 the whole model as a checkpoint gathers it
    (strategy.whole_state: ZeRO's shards, tp's pieces, every expert); under a pipeline each
    stage's part (pp/checkpoint.py stage_state, gathered over tp and dp; {} off its first
    replica); {} on the other ranks. Collective."""
    from minidist.pp import checkpoint as pp_checkpoint   # imports mpi4py.MPI: after comm.init
    if hasattr(strategy, "embedding"):                      # PipelineParallel
        return pp_checkpoint.stage_state(strategy, opt)[0] or {}
    whole, _ = strategy.whole_state(model, opt)
    return whole if strategy.rank == 0 else {}


def whole_masters(strategy, model, opt):
    """name -> float32 master weight (host, as float64) of what this rank holds whole, as
    whole_params places them: world rank 0 the whole model (whole_state: ZeRO's shards, tp's
    pieces, every expert gathered); a pipeline stage its own part on its first replica; {}
    elsewhere. Collective."""
    from minidist.pp import checkpoint as pp_checkpoint   # imports mpi4py.MPI: after comm.init
    if hasattr(strategy, "embedding"):                      # PipelineParallel
        _, sd = pp_checkpoint.stage_state(strategy, opt)
    else:
        _, sd = strategy.whole_state(model, opt)
        sd = sd if strategy.rank == 0 else None
    return {} if not sd else {n: np.asarray(s["master"], np.float64)
                              for n, s in sd["state"].items() if "master" in s}


def max_abs(values):
    """The largest |value| over `values` (numbers and arrays of any shape, host or device,
    mixed) as a float; NaN if any entry is NaN, 0.0 if there are none. Python's max() is no
    substitute: it keeps its best so far unless the next value is greater, and `nan > x` is
    False, so a NaN anywhere but first is dropped (max(0.0, nan) == 0.0). np.max propagates
    it, and a NaN compared with `<= tol` is False: a NaN difference fails the check."""
    flat = [np.abs(backend.to_host(v).astype(np.float64)).ravel() for v in values]
    return float(np.max(np.concatenate(flat), initial=0.0)) if flat else 0.0


def worst_over_ranks(comm, value):
    """max_abs of `value` (one rank's largest difference) over every rank of the mpi4py
    communicator `comm`: NaN if it is NaN on any rank. Gathered to every rank and reduced
    with max_abs rather than allreduce(op=MPI.MAX): MPI leaves MAX of a NaN undefined, and
    the usual `a > b ? a : b` keeps or drops it depending on which rank's value comes first.
    (One float per rank: the gather costs nothing.) Collective."""
    return max_abs(comm.allgather(float(value)))


def check_tied_copies(strategy, state):
    """The first and last stage's wte are bitwise equal (summed gradients, same steps)."""
    if strategy.embedding is None or not state:
        return
    crc = zlib.crc32(np.ascontiguousarray(state["transformer.wte.weight"]).tobytes())
    crcs = strategy.embedding.comm.allgather(crc)
    assert crcs[0] == crcs[1], f"tied wte copies differ: {crcs}"


def issued_before_waits(events, wanted):
    """Per step, how many traced collectives `wanted(event)` picks were issued before the
    step's "wait for gradients" (sync_grads) began: started by backward's hooks. The fewest
    over the steps (0 where nothing waits for gradients)."""
    waits = [e["start"] for e in events if e["op"] == "wait for gradients"]
    issued = [e["issued"] for e in events if wanted(e)]
    counts, before = [], 0.0
    for wait in waits:
        counts.append(sum(1 for t in issued if before <= t < wait))
        before = wait
    return min(counts, default=0)


def start(parser):
    """What every exactness script does first: --tol and --device added to `parser` and
    parsed, MPI started (minidist.comm.init) and the device set. Returns (cli, the world's
    MPI communicator)."""
    parser.add_argument("--tol", type=float, default=1e-10)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    cli = parser.parse_args()
    minidist.comm.init()
    backend.set_device(cli.device)
    from mpi4py import MPI     # after comm.init(): importing mpi4py.MPI starts MPI
    return cli, MPI.COMM_WORLD
