"""What a user meets on the command line of examples/train_gpt.py, case by case: bad input.
Table-driven: each row is a case a user hit.

- Bad input: one `error:` line naming the flag, path or environment variable, printed once
  (under mpiexec too, argparse's own errors included), exit status 2, no traceback;
  --traceback shows it. Output paths (--save, --log-json, --trace) are checked before step 0
  (BAD_FLAGS, UNDER_MPIEXEC).
- Each range's edge is accepted: the limit an error line names (EDGES).
- --help shows the defaults.

The rest of the command line: tests/test_cli_ranks.py (the layout and the ranks),
tests/test_cli_runs.py (runs and Ctrl-C), tests/test_cli_examples.py (examples/sample.py's
bad input, the examples' help texts).

    python examples/train_gpt.py --steps 0          # error: --steps 0: must be at least 1 ...
"""
import os
import subprocess
import sys

import pytest

from minidist.train.args import train_parser
from minidist.train.cli import UsageError, check_flags
from tests.mpirun import ROOT, device_flags, mpi_env, run_mpi


# (flags, what the one error line must contain)
BAD_FLAGS = [
    (["--steps", "0"], "--steps 0: must be at least 1"),
    (["--steps", "-5"], "--steps -5: must be at least 1"),
    (["--lr", "-1"], "--lr -1.0: the learning rate must be positive"),
    (["--lr", "0"], "--lr 0.0: the learning rate must be positive"),
    (["--lr", "inf"], "--lr inf: give a finite number"),         # was: diverged at step 2
    (["--weight-decay", "nan"], "--weight-decay nan: give a finite number"),
    (["--bucket-mb", "nan"], "--bucket-mb nan: give a finite number"),   # was: accepted
    (["--moe-experts", "4", "--moe-capacity-factor", "nan"],
     "--moe-capacity-factor nan: give a finite number"),           # was a traceback
    (["--batch-size", "0"], "--batch-size 0: must be at least 1"),
    (["--log-every", "0"], "--log-every 0: must be at least 1"),
    (["--grad-accum", "0"], "--grad-accum 0: must be at least 1"),
    (["--eval-every", "-1"], "--eval-every -1: must be at least 0"),
    (["--eval-iters", "0"], "--eval-iters 0: must be at least 1"),
    (["--save-every", "-2"], "--save-every -2: must be at least 0"),
    (["--sample", "-1"], "--sample -1: must be at least 0"),
    (["--n-layer", "0"], "--n-layer 0: must be at least 1"),
    (["--n-head", "0"], "--n-head 0: must be at least 1"),
    (["--block-size", "0"], "--block-size 0: must be at least 1"),
    (["--tp", "0"], "--tp 0: must be at least 1"),
    (["--pp", "0"], "--pp 0: must be at least 1"),
    (["--dp", "0"], "--dp 0: must be at least 1"),
    (["--ep", "0"], "--ep 0: must be at least 1"),               # was a ZeroDivisionError
    (["--ep", "-1", "--moe-experts", "4"], "--ep -1: must be at least 1"),
    (["--pp-virtual", "0"], "--pp-virtual 0: must be at least 1"),
    (["--micro-batches", "0"], "--micro-batches 0: must be at least 1"),
    (["--threads", "0"], "--threads 0: must be at least 1"),
    (["--stop-at", "0"], "--stop-at 0: must be at least 1"),
    (["--warmup", "-1"], "--warmup -1: must be at least 0"),
    (["--keep", "-1"], "--keep -1: must be at least 0"),
    (["--amp-dtype", "bfloat16"], "--amp-dtype bfloat16: only used with --amp (add --amp"),
    (["--sequence-parallel"], "--sequence-parallel: splits what tensor parallelism repeats"),
    (["--moe-top-k", "2"], "--moe-top-k 2: only used with --moe-experts (add --moe-experts"),
    (["--moe-z-loss-coef", "0.01"], "--moe-z-loss-coef 0.01: only used with --moe-experts"),
    # flags that would do nothing in this run (found by tests/scripts/layout_sweep.py)
    (["--schedule", "gpipe"], "--schedule gpipe: sets the pipeline schedule, which this run "
     "does not use (add --pp 2 or more"),
    (["--pp-virtual", "2"], "--pp-virtual 2: sets layer chunks per pipeline rank"),
    (["--cp-split", "naive"], "--cp-split naive: sets how context parallelism splits"),
    (["--attention", "materialized", "--attention-block", "16"], "--attention-block 16: sets "
     "the tiled attention's tile size, which this run does not use (use --attention tiled"),
    (["--block-size", "128", "--attention-block", "16"], "--attention-block 16: sets the "
     "tiled attention's tile size, which this run does not use (use --attention tiled, or "
     "auto with --block-size 256 or more, or leave --attention-block out)"),
    (["--zero", "2", "--ddp", "naive"], "--ddp naive: sets how DDP averages gradients"),
    (["--ddp", "naive", "--bucket-mb", "4"], "--bucket-mb 4.0: sets DDP's bucket size "
     "(--ddp naive all-reduces each parameter's gradient on its own), which this run does not "
     "use (use --ddp bucketed or overlapped, or leave --bucket-mb out)"),
    (["--zero", "1", "--bucket-mb", "4"], "--bucket-mb 4.0: sets DDP's bucket size (ZeRO does "
     "not bucket), which this run does not use (drop --zero, or leave --bucket-mb out)"),
    (["--attention-block", "0"], "--attention-block 0: must be at least 1"),
    (["--decay-steps", "3"], "--decay-steps 3: sets the steps of warmup-stable-decay's final "
     "decay, which this run does not use (add --lr-schedule wsd, or leave --decay-steps out)"),
    (["--lr-schedule", "wsd", "--steps", "100", "--decay-steps", "99"], "--decay-steps 99: "
     "with 5 warm-up steps, more than --steps 100; give at most --decay-steps 95"),
    (["--lr-schedule", "wsd", "--decay-steps", "0"], "--decay-steps 0: must be at least 1"),
    (["--comm-timeout", "-1"], "--comm-timeout -1.0: must be at least 0"),
    (["--comm-timeout", "0.001"], "--comm-timeout 0.001: give 0 (never abort) or at least 1 s"),
    (["--seed", "-1"], "--seed -1: must be at least 0 (the random seed)"),   # numpy's traceback
    (["--min-lr", "1"], "--min-lr 1.0: must be between 0 and --lr"),
    (["--dropout", "1"], "--dropout 1.0: a probability in [0, 1)"),
    (["--weight-decay", "-0.1"], "--weight-decay -0.1: must not be negative (0: no weight"),
    (["--beta2", "1"], "--beta2 1.0: a decay in [0, 1) (e.g. 0.95)"),
    (["--peak-tflops", "0"], "--peak-tflops 0.0: must be at least 0.001 (a device's dense "),
    (["--beta1", "-0.1"], "--beta1 -0.1: a decay in [0, 1) (e.g. 0.9)"),
    (["--grad-clip", "-1"], "--grad-clip -1.0: must not be negative (0: no clipping)"),
    # was: accepted and ignored (the --log-json rows of an audit, 2026-11-27)
    (["--stop-at", "10", "--steps", "3"], "--stop-at 10: past --steps 3, where the run ends"),
    (["--warmup", "10", "--steps", "5"], "--warmup 10: more than --steps 5, so the learning "
     "rate would never reach --lr"),
    (["--keep", "3"], "--keep 3: sets the checkpoints kept under --save, which this run does "
     "not use (add --save DIR, or leave --keep out)"),
    (["--save-every", "5"], "--save-every 5: sets steps between checkpoints"),
    (["--keep-best"], "--keep-best: sets whether the best val loss's checkpoint is kept under "
     "--save, which this run does not use (add --save DIR, or leave --keep-best out)"),
    (["--overwrite"], "--overwrite: sets whether --save may replace another run's"),
    (["--bucket-mb", "0"], "--bucket-mb 0.0: the DDP bucket size must be positive"),
    (["--n-embd", "130"], "--n-embd 130 does not split into --n-head 4 heads"),
    # the --moe-* flags by their names (they were GPTConfig's field names, after MPI started)
    (["--moe-experts", "1"], "--moe-experts 1: 0 (a dense model) or at least 2 experts"),
    (["--moe-experts", "-1"], "--moe-experts -1: 0 (a dense model) or at least 2 experts"),
    (["--moe-experts", "4", "--moe-top-k", "0"], "--moe-top-k 0: experts per token, from 1 to "
     "--moe-experts 4"),
    (["--moe-experts", "4", "--moe-top-k", "5"], "--moe-top-k 5: experts per token"),
    (["--moe-experts", "4", "--moe-every", "0"], "--moe-every 0: from 1 (every block is MoE) "
     "to --n-layer 4"),
    (["--moe-experts", "4", "--moe-aux-loss-coef", "-1"], "--moe-aux-loss-coef -1.0: must not "
     "be negative"),
    (["--data", "/nonexistent"], "--data /nonexistent: no such file or folder"),
    (["--resume", "/nonexistent"], "--resume /nonexistent: does not exist"),
    # output paths, before step 0 ({file}: a file; {tmp}: a folder)
    (["--save", "/proc/ck"], "--save /proc/ck: cannot make the folder /proc/ck"),
    (["--save", "{file}/ck"], "/ck: cannot make the folder"),
    (["--save", "{file}"], ": is a file; --save takes a folder"),
    (["--log-json", "{file}/x.jsonl"], "/x.jsonl: cannot make the folder"),
    (["--log-json", "{tmp}"], ": is a folder; give a file name"),
    (["--trace", "/proc/t.json"], "--trace /proc/t.json: cannot write in /proc"),
    (["--cache-dir", "/proc/cache"], "--cache-dir /proc/cache: cannot make the folder "
     "/proc/cache (No such file or directory); choose a path you can write to"),
    (["--cache-dir", "{file}"], ": is a file; give a folder for the tokenized text"),
    # found before step 0, not at the first save after training ran
    (["--save", "{tmp}"], ": holds ['afile'], which are not minidist checkpoints; --save into "
     "an empty or new directory"),
    (["--save", "{tmp}/ck", "--log-json", "{tmp}/ck/log.jsonl"],
     "/ck/log.jsonl: inside --save"),
]
# refused only where there is no GPU (this machine's case; skipped on one)
NO_GPU = [
    (["--device", "cuda"], "--device cuda: CuPy is not installed or sees no GPU"),
    (["--comm", "nccl"], "--comm nccl moves data GPU to GPU: it needs CuPy"),
]


def _gpu():
    from minidist import backend
    return backend.cupy_module() is not None


def _fill(flags, tmp_path):
    (tmp_path / "afile").write_text("x")
    return [f.format(file=tmp_path / "afile", tmp=tmp_path) for f in flags]


@pytest.mark.parametrize("flags,says", BAD_FLAGS + NO_GPU,
                         ids=[" ".join(f) for f, _ in BAD_FLAGS + NO_GPU])
def test_check_flags_names_the_flag(flags, says, tmp_path):
    if (flags, says) in NO_GPU and _gpu():
        pytest.skip("a GPU is here")
    with pytest.raises(UsageError, match=None) as e:
        check_flags(train_parser().parse_args(_fill(flags, tmp_path)))
    assert says in str(e.value)


# (variable, its value, flags, the one error line): each was a traceback (per rank under
# mpiexec) or, for MINIDIST_COMM_TIMEOUT=-5, silently no timeout
BAD_ENV = [
    ("MINIDIST_COMM_TIMEOUT", "abc", [], "MINIDIST_COMM_TIMEOUT='abc': give the seconds"),
    ("MINIDIST_COMM_TIMEOUT", "-5", [], "MINIDIST_COMM_TIMEOUT='-5': give the seconds"),
    ("MINIDIST_COMM_TIMEOUT", "0.3", [], "MINIDIST_COMM_TIMEOUT='0.3': give 0 (never abort)"),
    ("MINIDIST_COMM_WAIT", "spin", [], "MINIDIST_COMM_WAIT='spin': give block"),
    ("MINIDIST_TRACE", "yes", [], "MINIDIST_TRACE='yes': give 0 (off), 1"),
    ("MINIDIST_TRACE", "5", [], "MINIDIST_TRACE='5': give 0 (off), 1"),      # (ran at level 2)
    ("OPENBLAS_NUM_THREADS", "abc", [], "OPENBLAS_NUM_THREADS='abc': give the BLAS threads"),
    ("OPENBLAS_NUM_THREADS", "0", [], "OPENBLAS_NUM_THREADS='0': give the BLAS threads"),
    ("MINIDIST_RANKS_PER_NODE", "0", ["--comm", "hier"],
     "MINIDIST_RANKS_PER_NODE='0': give a positive integer"),
    ("MINIDIST_AMP_DTYPE", "fp16", ["--amp"], "MINIDIST_AMP_DTYPE='fp16': give float16 or"),
    ("MPI4PY_RC_THREAD_LEVEL", "many", [], "MPI4PY_RC_THREAD_LEVEL='many': give one of"),
    ("MINIDIST_SYNC_COMM", "false", [], "MINIDIST_SYNC_COMM='false': give 1 (on) or 0"),  # on
    ("MINIDIST_DEBUG", "no", [], "MINIDIST_DEBUG='no': give 1 (on) or 0 (off)"),     # before
]
# read only where used: a flag that wins over the variable, or no --comm hier, no --amp
UNUSED_ENV = [("MINIDIST_COMM_TIMEOUT", "abc", ["--comm-timeout", "30"]),
              ("MINIDIST_RANKS_PER_NODE", "0", []),
              ("MINIDIST_AMP_DTYPE", "fp16", ["--amp", "--amp-dtype", "float16"]),
              ("OPENBLAS_NUM_THREADS", "abc", ["--threads", "1"])]


@pytest.mark.parametrize("var,value,flags,says", BAD_ENV,
                         ids=[f"{v}={x}" for v, x, *_ in BAD_ENV])
def test_check_flags_names_a_bad_environment_variable(var, value, flags, says, monkeypatch):
    monkeypatch.setenv(var, value)
    with pytest.raises(UsageError) as e:
        check_flags(train_parser().parse_args(flags))
    assert says in str(e.value)


@pytest.mark.parametrize("var,value,flags", UNUSED_ENV, ids=[f"{v} {f}" for v, _, f in UNUSED_ENV])
def test_a_variable_that_is_not_read_is_not_checked(var, value, flags, monkeypatch):
    monkeypatch.setenv(var, value)
    check_flags(train_parser().parse_args(flags))


@pytest.mark.mpi
@pytest.mark.parametrize("var,says", [
    ("MINIDIST_COMM_TIMEOUT", "give the seconds a collective may wait, a number >= 0 (0: "
     "never abort)"),
    # read at import by set_thread_env: was a traceback per rank, --threads 1 or not
    ("OPENBLAS_NUM_THREADS", "give the BLAS threads per rank, a whole number of at least 1 "
     "(or unset it; --threads wins over it)"),
    # mpi4py's own warning came first, once per rank
    ("MPI4PY_RC_THREAD_LEVEL", "give one of single, funneled, serialized, multiple (default: "
     "multiple)")])
def test_a_bad_environment_variable_is_one_line_under_mpiexec(var, says):
    """    MINIDIST_COMM_TIMEOUT=abc mpiexec -n 2 python examples/train_gpt.py"""
    out = run_mpi(2, "examples/train_gpt.py", timeout=60, check=False,
                  env=mpi_env(**{var: "abc"}))
    assert out.returncode == 2 and out.stdout == "", (out.stdout, out.stderr)
    assert out.stderr == f"error: {var}='abc': {says}\n"


@pytest.mark.mpi
def test_a_thread_level_below_multiple_is_refused_on_several_ranks():
    """    MPI4PY_RC_THREAD_LEVEL=single mpiexec -n 2 python examples/train_gpt.py
    The watchdog thread called MPI beside the main thread: MPICH aborted now and then with
    "Message truncated" in a Comm_dup (first-use walk 32). One line, before MPI_Init; one
    process alone (no watchdog, no streams) may still ask for it."""
    out = run_mpi(2, "examples/train_gpt.py", timeout=60, check=False,
                  env=mpi_env(MPI4PY_RC_THREAD_LEVEL="single"))
    assert out.returncode == 2 and out.stdout == "", (out.stdout, out.stderr)
    assert out.stderr.startswith("error: MPI4PY_RC_THREAD_LEVEL=single: minidist's watchdog")
    assert out.stderr.count("\n") == 1 and "needs MPI_THREAD_MULTIPLE" in out.stderr
    from minidist.comm import thread_level_problem    # (first: mpi4py set not to MPI_Init)
    from mpi4py import MPI
    assert thread_level_problem(MPI.THREAD_MULTIPLE, 4) is None
    assert thread_level_problem(MPI.THREAD_SINGLE, 1) is None
    assert "provides thread level serialized" in thread_level_problem(MPI.THREAD_SERIALIZED, 2)


def test_output_folders_are_made_before_step_0(tmp_path):
    """--log-json / --trace in a folder that does not exist yet: made, nothing written."""
    log, trace = tmp_path / "new" / "x.jsonl", tmp_path / "deep" / "er" / "t.json"
    check_flags(train_parser().parse_args(["--log-json", str(log), "--trace", str(trace),
                                           "--save", str(tmp_path / "ck")]))
    assert log.parent.is_dir() and trace.parent.is_dir() and (tmp_path / "ck").is_dir()
    assert not log.exists() and not trace.exists() and not os.listdir(tmp_path / "ck")


def test_a_new_run_does_not_replace_another_runs_log_unless_told(tmp_path):
    """First-use walk 41: a sweep's typo sent two runs to one --log-json and the first run's
    61 rows were truncated away, silently (--save is guarded). Refused now, naming the rows;
    --overwrite replaces it (without --save too), an empty file is fine."""
    log = tmp_path / "x.jsonl"
    log.write_text('{"step": 0, "loss": 5.5}\n{"step": 1, "loss": 5.4}\n')
    with pytest.raises(UsageError, match=r"--log-json .*x.jsonl: holds 2 rows of an earlier "
                                         r"run, which a new run would replace; give another "
                                         r"file, --overwrite to replace it, or --resume"):
        check_flags(train_parser().parse_args(["--log-json", str(log)]))
    check_flags(train_parser().parse_args(["--log-json", str(log), "--overwrite"]))
    log.write_text("")
    check_flags(train_parser().parse_args(["--log-json", str(log)]))


# each range's edge, accepted: the value an error message names as the limit, or says is
# allowed (mutation testing: `>` for `>=` in these checks refused them, and nothing failed)
EDGES = [
    ["--stop-at", "10", "--steps", "10"],               # "past --steps": equal is not past
    ["--warmup", "10", "--steps", "10"],                # "more than --steps"
    ["--lr-schedule", "wsd", "--steps", "100", "--decay-steps", "95"],   # "give at most 95"
    ["--min-lr", "0"],                                  # "between 0 and --lr"
    ["--min-lr", "0.004", "--lr", "0.004"],
    ["--warmup", "0"], ["--sample", "0"], ["--eval-every", "0"], ["--comm-timeout", "0"],
    ["--comm-timeout", "1"], ["--seed", "0"],
    ["--save-every", "0"], ["--dropout", "0"], ["--beta1", "0"], ["--grad-clip", "0"],
    ["--moe-experts", "4", "--moe-top-k", "4"],          # "from 1 to --moe-experts 4"
    ["--moe-experts", "4", "--moe-every", "4", "--n-layer", "4"],   # "to --n-layer 4"
    ["--moe-experts", "2", "--moe-capacity-factor", "0"],           # "0: no dropping"
]


@pytest.mark.parametrize("flags", EDGES, ids=[" ".join(f) for f in EDGES])
def test_each_ranges_edge_is_accepted(flags):
    check_flags(train_parser().parse_args(flags))


def test_a_log_beside_save_whose_name_starts_with_it_is_not_inside(tmp_path):
    """--save ck --log-json ck-log.jsonl: the log is beside the folder, not in it (a prefix
    of the path is not a parent folder)."""
    check_flags(train_parser().parse_args(["--save", str(tmp_path / "ck"), "--log-json",
                                           str(tmp_path / "ck-log.jsonl")]))


def test_help_shows_defaults_and_documents_save_and_resume_auto():
    text = " ".join(train_parser().format_help().split())
    assert "optimizer steps (on --resume: its run's unless given) (default: 800)" in text
    assert "(default: 0.004)" in text
    assert "--save DIR checkpoint folder: DIR/step-<N>/" in text and "Ctrl-C" in text
    assert "`--resume auto`: from --save DIR's newest if it holds one, else start fresh" in text
    assert "--overwrite" in text


def test_defaults_pass_the_checks():
    check_flags(train_parser().parse_args([]))


def _run(device, *flags, timeout=60):
    """examples/train_gpt.py FLAGS --device DEVICE (pytest's --device), one process."""
    return subprocess.run([sys.executable, "examples/train_gpt.py", *flags,
                           *device_flags(device)], cwd=ROOT, env=mpi_env(),
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("flags,says", [
    (["--steps", "0"], "--steps 0"),
    (["--data", "/nonexistent"], "--data /nonexistent"),
    (["--batch-size", "0"], "--batch-size 0"),
    (["--save", ""], "argument --save: an empty path"),    # a traceback from os.makedirs
    (["--log-json", ""], "argument --log-json: an empty path"),    # no log, without a word
    (["--cache-dir", ""], "argument --cache-dir: an empty path"),  # the default, silently
])
def test_one_error_line_exit_2_no_traceback(flags, says, device):
    """Rows past the third: found by tests/scripts/fuzz_cli.py (`--save "$CKPT"` with the
    variable unset)."""
    out = _run(device, *flags)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.startswith("error: ") and says in out.stderr
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr


def test_resume_a_file_or_an_empty_folder(tmp_path, device):
    (tmp_path / "afile").write_text("x")
    (tmp_path / "empty").mkdir()
    out = _run(device, "--resume", str(tmp_path / "afile"))
    assert out.returncode == 2 and "is a file" in out.stderr and "Traceback" not in out.stderr
    # a --save folder's pointer file (first-use walks 26, 27): the folder it names
    ck = tmp_path / "ck"
    out = _run(device, "--steps", "1", "--eval-iters", "1", "--sample", "0", "--save", str(ck),
               timeout=120)
    assert out.returncode == 0, out.stderr
    out = _run(device, "--resume", str(ck / "latest"), "--steps", "2", "--eval-iters", "1",
               "--sample", "0", timeout=120)
    assert out.returncode == 0 and f"resumed from {ck}/step-00000001 at step 1" in out.stdout, \
        out.stdout + out.stderr
    out = _run(device, "--resume", str(tmp_path / "empty"), "--steps", "1", "--eval-iters", "1",
               "--sample", "0", timeout=120)
    assert out.returncode == 2 and out.stderr.startswith("error: ")
    assert str(tmp_path / "empty") in out.stderr and "Traceback" not in out.stderr


def test_data_too_short_for_block_size_is_refused_before_step_0(corpus, tmp_path, device):
    """The corpus's val split (its last 10%, ~900 tokens) is shorter than --block-size 2000:
    one line before step 0 (it was found at the first evaluation, after training ran)."""
    out = _run(device, "--data", corpus, "--cache-dir", str(tmp_path), "--block-size", "2000",
               "--n-layer", "1", "--n-embd", "8", "--n-head", "1", "--steps", "2")
    assert out.returncode == 2 and out.stdout == "" and out.stderr.count("\n") == 1
    assert "the val split has" in out.stderr and "fewer than --block-size 2000" in out.stderr


def test_traceback_flag_shows_the_traceback(device):
    out = _run(device, "--steps", "0", "--traceback")
    assert out.returncode != 0 and "Traceback" in out.stderr and "UsageError" in out.stderr


@pytest.mark.mpi
def test_errors_print_once_under_mpiexec(mpi):
    """    mpiexec -n 4 python examples/train_gpt.py --grad-accum 0"""
    out = mpi(4, "examples/train_gpt.py", "--grad-accum", "0", timeout=60, check=False)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.count("error: --grad-accum 0") == 1, out.stderr


# (flags, the one error line): under mpiexec -n 2, each found on every rank, printed by rank 0
UNDER_MPIEXEC = [
    (["--zero", "4"], "error: argument --zero: invalid choice: 4"),
    (["--device", "gpu"], "error: argument --device: invalid choice: 'gpu'"),
    (["--no-such-flag"], "error: unrecognized arguments: --no-such-flag"),
    (["--save", "/proc/ck"], "error: --save /proc/ck: cannot make the folder"),
    (["--log-json", "{file}/x.jsonl"], "/x.jsonl: cannot make the folder"),
    (["--trace", "/proc/t.json"], "error: --trace /proc/t.json: cannot write in /proc"),
    (["--tp", "2", "--ddp", "naive"], "error: --ddp naive: sets how DDP averages gradients "
     "over replicas, which this run does not use (this layout has one replica"),
] + [(f, "error: " + says) for f, says in NO_GPU]


@pytest.mark.mpi
@pytest.mark.parametrize("flags,says", UNDER_MPIEXEC,
                         ids=[" ".join(f) for f, _ in UNDER_MPIEXEC])
def test_startup_errors_are_one_line_from_rank_0(flags, says, tmp_path):
    """No usage block, no traceback per rank (the job's own --device is left out: some rows
    are about it):

        mpiexec -n 2 python examples/train_gpt.py --zero 4
    """
    if (flags, says[len("error: "):]) in NO_GPU and _gpu():
        pytest.skip("a GPU is here")
    out = run_mpi(2, "examples/train_gpt.py", *_fill(flags, tmp_path), timeout=60,
                  check=False)
    assert out.returncode == 2 and out.stdout == "", (out.stdout, out.stderr)
    assert out.stderr.count("\n") == 1 and says in out.stderr, out.stderr
