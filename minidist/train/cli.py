"""What a user sees when the input is wrong: one line, once, exit status 2.

    $ mpirun -n 4 python examples/train_gpt.py --steps 0
    error: --steps 0: must be at least 1 (the number of optimizer steps)

Every user error (a flag out of range or a combination that does not fit, a missing data
file, a checkpoint that is missing, corrupt or does not fit) is raised as UsageError (or the
data and checkpoint layers' own DataError / CheckpointError) and reaches `run_main`, which
prints `error: <message>` on the launcher's rank 0 only and exits with status 2, no
traceback: every rank raises the same error, as the ranks agree on each verdict one of them
could reach alone (agree_on_flags below; a sharded checkpoint's verdict is agreed by every
rank too, minidist/zero/checkpoint.py). `--traceback` or MINIDIST_DEBUG=1 shows the
traceback instead.
Flags are checked by `check_flags` before any work (no MPI communication, no data read), on
each rank alone; in a job of several ranks they agree on the verdict right after MPI_Init
(`agree_on_flags`: a path or a GPU one node lacks stops every rank, naming the rank):
their ranges and combinations, the MINIDIST_* variables the communication layer reads
(`check_env`), the device and --comm this machine can give, and every output path
(`check_outputs`: --save, --log-json and --trace must be writable, their folders are made;
--save holds checkpoints only), so nothing is lost to a late error after training ran.
argparse's own errors (an unknown flag, `--zero 4`) take the same path
(minidist/train/args.py Parser).
Ctrl-C before the training loop (which saves at the step boundary: minidist/train/
preemption.py), or a second one in it, ends the run at once with one line and exit status 130,
no traceback per rank.
Tests: tests/test_cli.py, tests/test_cli_runs.py.
"""
import importlib.util
import math
import os
import sys
import tempfile

from minidist.launcher import launcher_rank, thread_env_problem, world_size_from_env
from minidist.strategy import checkpoint_dirs
from minidist.train import preemption

# (flag, attribute, lowest allowed value, what it is), checked in this order. None: unset.
_AT_LEAST = (
    ("--steps", "steps", 1, "the number of optimizer steps"),
    ("--seed", "seed", 0, "the random seed"),
    ("--batch-size", "batch_size", 1, "the global batch, in sequences"),
    ("--grad-accum", "grad_accum", 1, "micro-steps per optimizer step"),
    ("--log-every", "log_every", 1, "steps between log lines"),
    ("--eval-every", "eval_every", 0, "steps between evaluations (0: only at the end)"),
    ("--eval-iters", "eval_iters", 1, "validation batches per evaluation"),
    ("--save-every", "save_every", 0, "steps between checkpoints (0: at evals and the end)"),
    ("--sample", "sample", 0, "tokens sampled at the end"),
    ("--n-layer", "n_layer", 1, "transformer blocks"),
    ("--n-head", "n_head", 1, "attention heads"),
    ("--n-embd", "n_embd", 1, "the embedding width"),
    ("--block-size", "block_size", 1, "the context length"),
    ("--dp", "dp", 1, "data-parallel ranks"),
    ("--tp", "tp", 1, "tensor-parallel ranks"),
    ("--pp", "pp", 1, "pipeline stages"),
    ("--cp", "cp", 1, "context-parallel ranks"),
    ("--ep", "ep", 1, "expert-parallel ranks"),
    ("--pp-virtual", "pp_virtual", 1, "chunks of layers per pipeline rank"),
    ("--micro-batches", "micro_batches", 1, "pipeline micro-batches"),
    ("--threads", "threads", 1, "BLAS threads"),
    ("--stop-at", "stop_at", 1, "the step to stop at"),
    ("--warmup", "warmup", 0, "warm-up steps"),
    ("--peak-tflops", "peak_tflops", 1e-3, "a device's dense peak, TFLOP/s"),
    ("--decay-steps", "decay_steps", 1, "wsd's decay steps"),
    ("--muon-ns-steps", "muon_ns_steps", 1, "Muon's Newton-Schulz iterations"),
    ("--keep", "keep", 0, "checkpoints kept; 0: all"),
    ("--attention-block", "attention_block", 1, "the tiled attention's tile size"),
    ("--n-kv-head", "n_kv_head", 0, "k and v heads (0: --n-head)"),
    ("--ffn-hidden", "ffn_hidden", 0, "the MLP's hidden width (0: the default)"),
    ("--comm-timeout", "comm_timeout", 0, "seconds a collective may wait (0: never abort)"),
)


class UsageError(ValueError):
    """A user error: a flag, a file or a combination; the message names it and says what
    to do. run_main exits with `exit_status`."""
    exit_status = 2


def flag_problem(args):
    """check_flags' UsageError, or None: what a rank found wrong before MPI starts, for
    agree_on_flags to share once it has."""
    try:
        check_flags(args)
    except UsageError as e:
        return e
    return None


def agree_on_flags(world, problem):
    """Every rank's `problem` (flag_problem's), agreed over `world` right after MPI_Init,
    before any other communication: if any rank found one, raise it on every rank (rank 0
    prints it), naming the ranks that found it when not all did (a --data path, a GPU or a
    package one node lacks). Without it, a rank alone in exiting left the others in MPI_Init
    until the timeout, and a rank other than 0 printed nothing. Collective over `world`."""
    from minidist.comm.checks import ranks_by_value, ranks_text   # (MPI is up: `world`)
    found = ranks_by_value(world.all_gather_object(None if problem is None else str(problem)))
    messages = {message: ranks for message, ranks in found.items() if message is not None}
    if not messages:
        return
    if len(messages) == 1 and len(next(iter(messages.values()))) == world.size:
        raise UsageError(next(iter(messages)))        # every rank found it: as one process
    raise UsageError("; ".join(
        f"{message} (found on {ranks_text(ranks)} of {world.size}: do the nodes differ?)"
        for message, ranks in messages.items()))


def check_flags(args):
    """Every flag's range and the combinations that cannot work, on this rank alone."""
    for flag, name, low, what in _AT_LEAST:
        value = getattr(args, name, None)
        if value is not None and value < low:
            raise UsageError(f"{flag} {value}: must be at least {low} ({what})")
    for name, value in sorted(vars(args).items()):     # --lr nan, --bucket-mb inf, ...
        if isinstance(value, float) and not math.isfinite(value):
            raise UsageError(f"--{name.replace('_', '-')} {value}: give a finite number")
    if not args.lr > 0:
        raise UsageError(f"--lr {args.lr}: the learning rate must be positive (e.g. 4e-3)")
    if args.min_lr is not None and not 0 <= args.min_lr <= args.lr:
        raise UsageError(f"--min-lr {args.min_lr}: must be between 0 and --lr {args.lr}")
    if not 0 <= args.dropout < 1:
        raise UsageError(f"--dropout {args.dropout}: a probability in [0, 1)")
    if args.weight_decay < 0:
        raise UsageError(f"--weight-decay {args.weight_decay}: must not be negative (0: no "
                         "weight decay)")
    for name, e_g in (("muon_momentum", 0.95), ("beta1", 0.9), ("beta2", 0.95)):
        if not 0 <= getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} {getattr(args, name)}: a decay in "
                             f"[0, 1) (e.g. {e_g})")
    if args.grad_clip < 0:
        raise UsageError(f"--grad-clip {args.grad_clip}: must not be negative (0: no "
                         "clipping)")
    if args.bucket_mb <= 0:
        raise UsageError(f"--bucket-mb {args.bucket_mb}: the DDP bucket size must be positive")
    # --init-from: the model's sizes are the folder's; --resume: the checkpoint's model
    from minidist.train.inputs import check_data_path, take_resume_model   # (they import
    from minidist.train.init_from import take_init_from_sizes             # this module)
    from minidist.train.model_flags import check_arch, check_moe     # (so does it)
    from minidist.train.idle_flags import check_idle_flags           # (and it)
    if getattr(args, "eval_only", False) and args.resume and args.init_from:
        raise UsageError(f"--init-from {args.init_from}: --eval-only evaluates one model, and "
                         f"--resume {args.resume}'s would be it; give one of the two")
    take_init_from_sizes(args)
    take_resume_model(args)
    if getattr(args, "eval_only", False):
        if not (args.resume or args.init_from):
            raise UsageError("--eval-only: no weights to evaluate; give --resume DIR (a "
                             "checkpoint or a --save folder) or --init-from DIR (a GPT-2 or "
                             "Llama folder, or a checkpoint)")
        if args.resume == "auto":
            raise UsageError("--resume auto: --eval-only evaluates the checkpoint you name; "
                             "give --resume DIR")
    if args.n_embd % args.n_head:
        raise UsageError(f"--n-embd {args.n_embd} does not split into --n-head {args.n_head} "
                         f"heads: choose a multiple of {args.n_head}")
    check_arch(args)                      # minidist/train/model_flags.py
    if args.stop_at is not None and args.stop_at > args.steps:
        raise UsageError(f"--stop-at {args.stop_at}: past --steps {args.steps}, where the run "
                         "ends anyway; give a step below --steps, or leave --stop-at out")
    warmup = args.warmup if args.warmup is not None else args.steps // 20
    if args.decay_steps is not None and args.lr_schedule == "wsd" and \
            args.decay_steps + warmup > args.steps:
        said = f"--warmup {warmup}" if args.warmup is not None else f"{warmup} warm-up steps"
        raise UsageError(f"--decay-steps {args.decay_steps}: with {said}, more than --steps "
                         f"{args.steps}; give at most --decay-steps {args.steps - warmup}")
    if args.warmup is not None and args.warmup > args.steps:
        raise UsageError(f"--warmup {args.warmup}: more than --steps {args.steps}, so the "
                         f"learning rate would never reach --lr {args.lr:g}; give at most "
                         f"--warmup {args.steps}")
    if args.data is not None and not os.path.exists(args.data):
        raise UsageError(f"--data {args.data}: no such file or folder (give a text file or a "
                         "folder of text files or of token files, or leave --data out for "
                         "Python's sources)")
    check_data_path(args)                 # minidist/train/inputs.py
    if args.resume not in (None, "auto") and not os.path.isdir(args.resume):
        what = "is a file" if os.path.exists(args.resume) else "does not exist"
        if not checkpoint_dirs.is_pointer(args.resume):     # DIR/latest: DIR's newest
            raise UsageError(f"--resume {args.resume}: {what}; give a checkpoint directory "
                             "or the --save directory of an earlier run")
    if args.sequence_parallel and args.tp == 1:
        raise UsageError("--sequence-parallel: splits what tensor parallelism repeats over the "
                         "--tp ranks; with --tp 1 it does nothing (add --tp 2 or more, or "
                         "leave it out)")
    check_moe(args)
    check_idle_flags(args)
    check_amp_dtype(args)
    check_env(args)
    check_device(args)
    check_outputs(args)


def check_amp_dtype(args):
    """--amp-dtype and --grad-dtype mean nothing without --amp; MINIDIST_AMP_DTYPE, read
    under --amp without it, names one of the two types; bfloat16 needs ml_dtypes (numpy and
    CuPy both take their bfloat16 from it)."""
    dtype, given = getattr(args, "amp_dtype", None), "--amp-dtype "
    if dtype is not None and not args.amp:
        raise UsageError(f"--amp-dtype {dtype}: only used with --amp (add --amp, or leave "
                         "--amp-dtype out)")
    grads = getattr(args, "grad_dtype", None)
    if grads is not None and not args.amp:     # without --amp gradients are --dtype's
        raise UsageError(f"--grad-dtype {grads}: only used with --amp (without it the "
                         f"gradients are --dtype {args.dtype}'s; add --amp, or leave "
                         "--grad-dtype out)")
    if dtype is None and args.amp and os.environ.get("MINIDIST_AMP_DTYPE"):
        dtype, given = os.environ["MINIDIST_AMP_DTYPE"], "MINIDIST_AMP_DTYPE="
        if dtype not in ("float16", "bfloat16"):
            raise UsageError(f"MINIDIST_AMP_DTYPE={dtype!r}: give float16 or bfloat16 (or "
                             "unset it; --amp-dtype wins over it)")
    if dtype == "bfloat16" and importlib.util.find_spec("ml_dtypes") is None:
        raise UsageError(f"{given}bfloat16 needs the ml_dtypes package (pip install "
                         "ml_dtypes), or use float16")


def check_env(args):
    """The environment variables the communication layer reads (MINIDIST_COMM_TIMEOUT,
    MINIDIST_COMM_WAIT, MINIDIST_TRACE, MINIDIST_RANKS_PER_NODE under --comm hier, ...) and
    OPENBLAS_NUM_THREADS (the launcher's, without --threads):
    a bad value is this run's one `error:` line, not a traceback per rank from comm.init."""
    from minidist import comm       # imports no MPI state (comm.init starts MPI)
    problems = comm.env_problems(args.comm, args.comm_timeout)
    threads = None if args.threads else thread_env_problem()     # --threads wins over it
    problems += [threads] if threads else []
    if problems:
        raise UsageError("; ".join(problems))


def check_device(args):
    """--device cuda and --comm nccl need CuPy and a GPU: refused here, on every rank alike,
    before MPI starts (comm.init would import CuPy for nccl and fail on every rank)."""
    problem = device_problem(args.device, getattr(args, "comm", None) == "nccl")
    if problem:
        raise UsageError(problem)


def device_problem(device, nccl, nccl_flag="--comm nccl"):
    """Why --device `device` (and NCCL, asked for by `nccl_flag`) cannot run here: a sentence,
    or None. train_gpt.py's check_device and every example's parser (args.ExampleParser)."""
    from minidist import backend       # numpy: imported by the entry point after BLAS setup
    if device == "cuda" and backend.cupy_module() is None:
        return ("--device cuda: CuPy is not installed or sees no GPU (pip install -e "
                "'.[cuda]' on a machine with one); --device cpu or auto runs on CPUs")
    if nccl and (device == "cpu" or backend.cupy_module() is None):
        return (f"{nccl_flag} moves data GPU to GPU: it needs CuPy and a GPU per rank (pip "
                f"install -e '.[cuda]'; --device cuda or auto). On CPUs use "
                f"{nccl_flag.split()[0]} ring, naive or mpi.")
    return None


def check_outputs(args):
    """Every file the run will write can be written: --save DIR (a folder, made if needed),
    --log-json and --trace FILE (their folders made if needed), a new --cache-dir. Checked
    by trying: a temporary file is made and removed in each folder (permission bits do not
    tell root); its name is one a --save folder's next save clears away if a kill left it
    there."""
    if args.save:
        if os.path.exists(args.save) and not os.path.isdir(args.save):
            raise UsageError(f"--save {args.save}: is a file; --save takes a folder for the "
                             "checkpoints (made if missing)")
        _writable_folder("--save", args.save, args.save)
        problem = checkpoint_dirs.save_problem(args.save)     # not at the first save, after
        if problem:                                           # training ran
            raise UsageError(problem)
    if args.cache_dir and not os.path.isdir(args.cache_dir):   # (an existing folder may be a
        # read-only cache: data.py); isdir asked again: another rank may have made it since
        if os.path.exists(args.cache_dir) and not os.path.isdir(args.cache_dir):
            raise UsageError(f"--cache-dir {args.cache_dir}: is a file; give a folder for "
                             "the tokenized text (made if missing)")
        _writable_folder("--cache-dir", args.cache_dir, args.cache_dir)
    for flag, path in (("--log-json", args.log_json), ("--trace", args.trace)):
        if path:
            if args.save and _inside(path, args.save):
                raise UsageError(f"{flag} {path}: inside --save {args.save}, which must hold "
                                 "checkpoints only (the first save would refuse it); write "
                                 "it beside the folder")
            check_out_file(flag, path)
    if args.log_json and not args.resume and not args.overwrite:   # (a resume appends)
        _check_fresh_log(args.log_json)


def _check_fresh_log(path):
    """A new run starts its --log-json afresh: one holding an earlier run's rows is refused
    (first-use walk 41: a sweep's typo sent two runs to one file and the first's curve was
    truncated away, where --save is guarded)."""
    try:
        with open(path, "rb") as f:
            rows = sum(1 for line in f if line.strip())
    except OSError:
        return                      # none yet (or unreadable: _writable_folder says so)
    if rows:
        raise UsageError(f"--log-json {path}: holds {rows} rows of an earlier run, which a "
                         "new run would replace; give another file, --overwrite to replace "
                         "it, or --resume that run's checkpoint (a resume appends)")


def check_out_file(flag, path):
    """An output file (--log-json, --trace; the benches' --trace and --out): not a folder,
    its folder made if missing and checked writable, before any work (_writable_folder)."""
    if os.path.isdir(path):
        raise UsageError(f"{flag} {path}: is a folder; give a file name")
    _writable_folder(flag, path, os.path.dirname(os.path.abspath(path)))


def check_out_folder(flag, out, replaced=(), replaced_note=""):
    """An output folder a script writes whole files into (examples/export_gpt2.py's and
    examples/train_tokenizer.py's --out): refused when it is a file, holds minidist
    checkpoints (a --save directory: other files there stop --resume auto) or holds files
    other than `replaced`, the ones the script writes again (`replaced_note` says so); else
    made if missing and checked writable (_writable_folder)."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise UsageError(f"{flag} {out}: is a file; give a folder")
    if os.path.isdir(out):
        if checkpoint_dirs.has_checkpoint(out):
            raise UsageError(f"{flag} {out}: holds minidist checkpoints (a --save directory); "
                             "give a new folder")
        others = sorted(n for n in os.listdir(out) if n not in replaced)
        if others:
            raise UsageError(f"{flag} {out}: holds {others[:3]}{' ...' * (len(others) > 3)}, "
                             "which this does not write; give a new or empty folder"
                             + (f" ({replaced_note})" if replaced_note else ""))
    _writable_folder(flag, out, out)


def _inside(path, folder):
    """Whether the file `path` would be written somewhere inside `folder`."""
    folder = os.path.realpath(folder)
    return os.path.realpath(path).startswith(folder + os.sep)


def _writable_folder(flag, path, folder):
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        why = "a file is in the way" if isinstance(e, (FileExistsError, NotADirectoryError)) \
            else e.strerror or str(e)
        raise UsageError(f"{flag} {path}: cannot make the folder {folder} ({why}); choose a "
                         "path you can write to") from None
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".tmp-minidist-probe-"):
            pass
    except OSError as e:
        raise UsageError(f"{flag} {path}: cannot write in {folder} ({e.strerror or e}); "
                         "choose a path you can write to") from None


def check_one_process(script):
    """UsageError where a launcher started `script`, an examples/ script that trains nothing
    (sampling, exporting, planning, training a tokenizer), on more than one rank: each
    would do all of it, print all of it, and write over the others' files."""
    n = world_size_from_env()
    if n > 1:
        raise UsageError(f"{script} runs on one process, not {n}: run `python examples/"
                         f"{script} ...` without mpirun")


def run_main(main, args=None, user_errors=(), parser=None):
    """Call main(args), or main(parser().parse_args()) with `parser` (a function making the
    entry point's parser: built and read inside, so a Ctrl-C there is the one line too); a
    UsageError or one of `user_errors` becomes one `error:` line from rank 0 and exit status
    2 (its exit_status: 3 for a run that diverged; with --traceback or MINIDIST_DEBUG=1: the
    traceback); output piped into a reader that stops early (`| head`) ends quietly, status
    141; a MemoryError is one line from the rank that met it and exit status 1, the job
    ended (preemption.end_job)."""
    try:
        if parser is not None:
            args = parser().parse_args()
        return main(args)
    except BrokenPipeError:     # stdout closed early (`| head`): stop quietly, as cat does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())   # (exit's flush)
        sys.exit(141)           # 128 + SIGPIPE, the status a shell tool killed by it has
    except KeyboardInterrupt:   # Ctrl-C before the loop takes it over, or a second one in it
        if launcher_rank() == 0:
            print("interrupted (Ctrl-C): stopped at once, nothing saved", file=sys.stderr,
                  flush=True)
        sys.exit(130)
    except preemption.Preempted as e:   # a scheduler's signal before step 1 (stop_at_once)
        save = bool(getattr(args, "save", None))    # 75 (143 without); every rank, blocked too
        preemption.end_job(preemption.starting_line(e, save), preemption.exit_status(False, save))
    except (UsageError, *user_errors) as e:
        if getattr(args, "traceback", False) or os.environ.get("MINIDIST_DEBUG") == "1":
            raise
        if launcher_rank() == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(getattr(e, "exit_status", 2))
    except MemoryError as e:    # numpy's, CuPy's OutOfMemoryError: one line, the job ends
        if getattr(args, "traceback", False) or os.environ.get("MINIDIST_DEBUG") == "1":
            raise
        preemption.end_job(out_of_memory_line(e, world_size_from_env() > 1), status=1)


def out_of_memory_line(error, several):
    """run_main's one line for a MemoryError the start's count (memory_check.py) did not
    foresee, or a script without one met: what could not be allocated, and where."""
    where = f" on rank {launcher_rank()}" if several else ""
    return (f"error: out of memory{where}: {error}; a smaller model, --batch-size or "
            "--block-size needs less (examples/train_gpt.py: its `memory:` start-up line, and "
            "examples/plan_memory.py; MINIDIST_DEBUG=1 shows where)")

