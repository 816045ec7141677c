"""The composition: which strategy objects the flags ask for, nested in one function.

    make_strategy(args, world)
        check_layout      every flag of the layout, on this rank alone (no communication yet)
        DeviceMesh        world = dp x cp x tp x pp: this rank's groups (minidist/comm/mesh.py)
        then the model's path, in picotron's order:
        1. tensor parallelism inside each layer   --tp   minidist/tp/strategy.py
        2. pipeline stages across the layers      --pp   minidist/pp/strategy.py (TP inside)
        3. context parallelism over sequences     --cp   minidist/cp/strategy.py
        3'. expert parallelism: the MoE experts   --ep   minidist/ep/strategy.py (its ranks
            sharded over ranks carved out of dp          carved out of dp: dense group dp x ep)
        4. data parallelism across the replicas   --dp   DDP minidist/ddp/strategy.py, or
                                                         ZeRO-k minidist/zero/strategy.py

The objects nest the other way round: the data-parallel strategy is built first (it gets
--amp and --ckpt-activations), and each model-parallel one is built around the one before,
as its `inner`; the step talks to the outermost, whose build_model makes this rank's part of
the model and hands it inward (TP builds, PP cuts, CP rings, DDP/ZeRO wraps). The base class
and what every strategy implements: minidist/strategy/base.py.
Tests: tests/test_train.py, tests/test_ddp.py (refusals), tests/scripts/*_check.py.
"""
import os
import re
import socket

from minidist import backend, comm
from minidist.comm import trace
from minidist.comm.checks import ranks_by_value, ranks_text
from minidist.launcher import gpu_sharing_problem
from minidist.cp.strategy import ContextParallel, cp_problems
from minidist.ddp.strategy import DataParallel
from minidist.ep.strategy import ExpertParallel, ep_problems, expert_groups, moe_problems
from minidist.pp.strategy import PipelineParallel, default_micro_batches, pp_problems
from minidist.strategy.base import SingleProcess
from minidist.tp.strategy import TensorParallel, tp_problems
from minidist.train.amp import MixedPrecision, half_dtype
from minidist.train.cli import UsageError
from minidist.train.idle_flags import check_idle_flags
from minidist.train.inputs import RESUMED, flag_of
from minidist.zero.strategy import ZeroDataParallel, zero_shard_problem


def make_strategy(args, world=None):
    """The strategy the flags ask for over `world` (comm.init's group; None: one process)."""
    size = 1 if world is None else world.size
    dp, micro_batches = check_layout(args, size)
    if args.comm == "nccl":
        _nccl_device(args, world)
    if args.trace:
        trace.enable()
    mesh = None
    if size > 1 or args.zero:                       # ZeRO over one rank still has a group
        mesh = comm.DeviceMesh(dp=dp * args.ep, cp=args.cp, tp=args.tp, pp=args.pp,
                               algo=args.comm, world=world)
    # 4. data parallelism, innermost: over dp (x ep: the dense parameters), or dp x cp (every
    # cp rank holds the replica)
    strategy = make_data_parallel(args, None if mesh is None else mesh.dpcp,
                                  MixedPrecision(dtype=amp_dtype(args, world),
                                                 grad_dtype=args.grad_dtype,
                                                 masters=not getattr(args, "eval_only", False))
                                  if args.amp else None)
    # 3'. expert parallelism: this rank's experts over ep, the tokens sent by all-to-all
    if args.ep > 1:
        strategy = ExpertParallel(mesh, *expert_groups(mesh, args.ep), strategy)
    # 3. context parallelism: the ring over cp, on each replica's sequences
    if args.cp > 1:
        strategy = ContextParallel(mesh, args.cp_split, strategy, args.cp_attention)
    # 2. pipeline stages, with 1. tensor parallelism inside each stage (it builds them)
    if args.pp > 1:
        strategy = PipelineParallel(mesh, micro_batches, args.schedule, args.pp_virtual,
                                    args.sequence_parallel, strategy)
    # 1. tensor parallelism inside each layer (it builds the model)
    elif args.tp > 1:
        strategy = TensorParallel(mesh, args.sequence_parallel, strategy)
    return strategy


def amp_dtype(args, world):
    """--amp's 16-bit type: --amp-dtype, else MINIDIST_AMP_DTYPE, else the one this rank's
    device computes best in (half_dtype: bfloat16 on a GPU whose CuPy computes with it,
    float16 elsewhere). Every rank must hold the same: agreed over `world` (Collective, on
    every rank whatever it was given: a rank given the variable skipped the gather the others
    waited in), refused where they differ, as a job of CPU and GPU ranks under --device auto,
    or the variable set on some nodes only, would (their gradients would be summed bit
    pattern against bit pattern, with no error). One process: --amp-dtype as given."""
    if world is None:
        return args.amp_dtype
    return agreed_half_dtype(world.all_gather_object(
        args.amp_dtype or os.environ.get("MINIDIST_AMP_DTYPE")
        or half_dtype(backend.get_xp()).name))


def agreed_half_dtype(names):
    """The one 16-bit type every rank chose (`names`, by rank), or UsageError."""
    chosen = ranks_by_value(names)
    if len(chosen) == 1:
        return names[0]
    where = "; ".join(f"{n} on {ranks_text(ranks)}" for n, ranks in chosen.items())
    raise UsageError(f"--amp: the ranks chose different 16-bit types ({where}: their devices "
                     "differ, or MINIDIST_AMP_DTYPE is set on some): give --amp-dtype "
                     "float16, which every device computes in")


def make_data_parallel(args, group, amp):
    """ZeRO-k (--zero k), DDP (more than one replica), or one replica, over `group`.
    --eval-only: no gradient buffers (nothing runs backward): ZeRO's engines make none, and
    DDP is its naive mode, which has no buckets (--ddp is refused under --eval-only)."""
    ckpt, training = args.ckpt_activations, not getattr(args, "eval_only", False)
    if args.zero:
        return ZeroDataParallel(group, args.zero, amp=amp, ckpt_activations=ckpt,
                                shard_size=args.zero_shard,
                                overlap_gather=args.overlap_param_gather, training=training)
    if group is None or group.size == 1:
        return SingleProcess(amp, ckpt)
    return DataParallel(group, args.ddp if training else "naive", args.bucket_mb, amp=amp,
                        ckpt_activations=ckpt)


def check_layout(args, size):
    """(dp, the pipeline's micro-batches) after checking every size and combination on this
    rank alone, so a bad flag stops every rank with the same `error:` line before any
    communication. --dp defaults to the processes left by ep x cp x tp x pp."""
    moe = moe_problems(args)                           # --moe-experts with --pp, --cp, ...
    if moe:
        raise UsageError("mixture of experts: " + "; ".join(moe))
    if args.micro_batches not in (None, 1) and args.pp == 1:
        raise UsageError(
            f"--micro-batches {args.micro_batches} splits the batch for a pipeline (--pp > 1); "
            "with one stage, accumulate gradients with --grad-accum instead.")
    if args.amp and args.dtype != "float32":
        raise UsageError(f"--amp computes in 16 bits with float32 master weights; it does not "
                         f"combine with --dtype {args.dtype} (leave --dtype at float32)")
    split = {"ep": args.ep, "cp": args.cp, "tp": args.tp, "pp": args.pp}
    others = split["ep"] * split["cp"] * split["tp"] * split["pp"]
    dp = args.dp if args.dp is not None else max(size // others, 1)
    rows = dp * args.ep                                # ep ranks read their own rows, as dp
    accum, m = args.grad_accum, 1
    if args.pp > 1:
        m = args.micro_batches or default_micro_batches(
            args.batch_size // (rows * accum), args.pp, args.pp if args.pp_virtual > 1 else 1)
    problems = []
    # --dp not given and the processes do not split into the other axes: the job has no dp
    # to hold the batch or --zero-shard to, only the size problem does (16 processes with
    # --pp 3 said "--batch-size 8 does not split into dp 5"); dp is that of the command the
    # size problem may suggest (15 ranks), which is suggested only if they fit it. Fewer
    # processes than one replica: dp 1 is every such job's, held to as before
    phantom = args.dp is None and size % others != 0 and size > others
    batch_bad = m < 1 or args.batch_size % (rows * accum * m)
    if batch_bad and not phantom:
        problems.append(_batch_problem(args, dp, m))
    axis = {}                   # the parallelism whose check found each problem
    for name, found in (("tensor", tp_problems(args) if args.tp > 1 else []),
                        ("pipeline", pp_problems(args, m) if args.pp > 1 else []),
                        ("context", cp_problems(args) if args.cp > 1 else []),
                        ("expert", ep_problems(args) if args.ep > 1 else [])):
        problems += found
        axis.update(dict.fromkeys(found, f"{name} parallelism: "))
    shard = zero_shard_problem(args, dp) if args.zero and args.zero_shard is not None else None
    if dp * others != size:     # the command it suggests must not fail on something else
        problems.insert(0, _size_problem(dp, split, size, not (problems or shard or batch_bad),
                                          args.dp is not None))
        shard = None if phantom else shard
    if shard and problems:      # all on the one line (it came only once the others were fixed)
        problems, shard = problems + [shard], None
    if problems:               # named by the check that found the first (walk 38: a tp
        what = axis.get(problems[0]) or (                   # problem said "context ...")
            "expert parallelism: " if args.ep > 1 else "context parallelism: "
            if args.cp > 1 else "pipeline parallelism: " if args.pp > 1 else
            "tensor parallelism: " if args.tp > 1 else "")
        said = "; ".join(problems)
        raise UsageError(what + said + fixed_by_resume(args, said))
    check_idle_flags(args, replicas=dp * args.ep * args.cp, ranks=size)   # --ddp, one replica
    if shard:
        raise UsageError(shard)
    return dp, m


def fixed_by_resume(args, said):
    """Under --resume, words naming the model sizes a layout refusal (`said`) asks to change
    that the checkpoint set (not typed: a resume refuses another value), so the fix is the
    layout; "" otherwise. First-use walk 35: `--resume ck --cp 3` said "--block-size 32 ...
    choose a multiple of 6", which the resume would then refuse."""
    if not getattr(args, "resume", None):
        return ""
    given = getattr(args, "given", [])
    named = [f"{flag_of(n)} {getattr(args, n)}" for n in RESUMED     # (0: the default size,
             if n != "bias" and n not in given and getattr(args, n)   # named by the refusal)
             and re.search(rf"{flag_of(n)}\b", said)]
    return (f" (under --resume {args.resume}, {', '.join(named)} "
            f"{'is' if len(named) == 1 else 'are'} its model's and cannot change: choose a "
            "layout that fits them)") if named else ""


def _batch_problem(args, dp, m):
    n = dp * args.ep * args.grad_accum * m
    micro = "" if args.pp == 1 else f" x --micro-batches {m}" if args.micro_batches else \
        f" x {m} micro-batches (the pipeline's default: give --micro-batches)"
    return (f"--batch-size {args.batch_size} does not split into dp {dp} x "
            + (f"ep {args.ep} x " if args.ep > 1 else "") + f"--grad-accum {args.grad_accum}"
            + micro
            + f" = {n} equal micro-batches (the batch is global, in sequences); give "
            f"--batch-size a multiple of {n}")


def _size_problem(dp, split, size, suggest, dp_given):
    """The rank count's problem; `suggest`: say how many ranks the same command needs (only
    when nothing else is wrong, or that run would fail too). `dp_given`: --dp was on the
    command line (else it defaulted to what the other axes leave, at least 1)."""
    axes = [f"--{k} {v}" for k, v in split.items() if v > 1]
    others = split["ep"] * split["cp"] * split["tp"] * split["pp"]
    n = dp * others
    run = f"run the same command with `mpirun -n {n}`" if suggest else ""
    if not dp_given:                       # the axes alone do not fit: dp would be 0 or split
        return (f"{' x '.join(axes)} = {others} ranks per replica (the processes are dp x "
                f"{others}), but this job has {size} MPI process(es)"
                + (f"; {run}" if run else ""))
    rest = " x ".join(k for k, v in split.items() if v > 1)
    leave = ("leave --dp out (it defaults to the processes" + (f" / ({rest}))" if rest else ")")
             if size % others == 0 else "")       # only where the processes divide that way
    said = "; ".join(w for w in (run, leave) if w).replace("; leave", ", or leave")
    return (f"--dp {dp}{''.join(' x ' + a for a in axes)} = {n} ranks, but this job has "
            f"{size} MPI process(es)" + (f"; {said}" if said else ""))


def _nccl_device(args, world):
    """--comm nccl moves data GPU to GPU: each rank's GPU must be chosen before any group
    builds its NCCL communicator (the loop's set_device comes later). Without CuPy and a GPU
    it is refused on every rank, before any communication; ranks that share a GPU (NCCL
    refuses them) after one all-gather of each rank's (node, GPU bus id), alike on every
    rank."""
    from minidist import backend
    if args.device == "cpu" or backend.cupy_module() is None:
        raise UsageError("--comm nccl moves data GPU to GPU: it needs CuPy and a GPU per rank "
                         "(pip install -e '.[cuda]'; --device cuda or auto). On CPUs use "
                         "--comm ring, naive or mpi.")
    backend.set_device(args.device)
    cp = backend.cupy_module()
    here = (socket.gethostname(), cp.cuda.runtime.deviceGetPCIBusId(cp.cuda.Device().id))
    shared = gpu_sharing_problem([here] if world is None else world.all_gather_object(here))
    if shared:                                  # the same on every rank
        raise UsageError(shared)
