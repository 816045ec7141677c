"""What a user meets on the command line of examples/train_gpt.py, case by case. Table-driven:
each row is a case a user hit.

- Bad input: one `error:` line naming the flag or path, printed once (under mpiexec too, argparse's
  own errors included), exit status 2, no traceback; --traceback shows it. Output paths
  (--save, --log-json, --trace) are checked before step 0 (BAD_FLAGS, UNDER_MPIEXEC).
- Runs (RUNS): a --save holding a newer checkpoint is refused unless --resume / --overwrite;
  each save says `saved step N to DIR`; a diverged run stops with one line naming the step
  and saves nothing; log lines show step N/total, elapsed and ETA; the model line under TP
  and PP gives the whole model and this rank's share.
- Ctrl-C (CTRL_C): SIGINT to the job's process group (mpiexec forwards it to every rank)
  saves at the step boundary with --save, prints one line, exits 130.
- examples/sample.py's bad input (SAMPLE_BAD), an imported GPT-2's BPE vocabulary included.
- A sample never writes control characters; --help shows the defaults.

    python examples/train_gpt.py --steps 0          # error: --steps 0: must be at least 1 ...
"""
import ast
import math
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from minidist.nn import GPT, GPTConfig
from minidist.nn.config import gpt_param_specs
from minidist.train.args import train_parser
from minidist.train.cli import UsageError, check_flags, printable
from tests.mpirun import ROOT, device_flags, mpi_env, mpiexec, run_mpi

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
    (["--keep", "0"], "--keep 0: must be at least 1"),
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
    (["--min-lr", "1"], "--min-lr 1.0: must be between 0 and --lr"),
    (["--dropout", "1"], "--dropout 1.0: a probability in [0, 1)"),
    (["--weight-decay", "-0.1"], "--weight-decay -0.1: must not be negative (0: no weight"),
    (["--grad-clip", "-1"], "--grad-clip -1.0: must not be negative (0: no clipping)"),
    # was: accepted and ignored (the --log-json rows of an audit, 2026-11-27)
    (["--stop-at", "10", "--steps", "3"], "--stop-at 10: past --steps 3, where the run ends"),
    (["--warmup", "10", "--steps", "5"], "--warmup 10: more than --steps 5, so the learning "
     "rate would never reach --lr"),
    (["--keep", "3"], "--keep 3: sets the checkpoints kept under --save, which this run does "
     "not use (add --save DIR, or leave --keep out)"),
    (["--save-every", "5"], "--save-every 5: sets steps between checkpoints"),
    (["--overwrite"], "--overwrite: sets whether --save may replace another run's"),
    (["--bucket-mb", "0"], "--bucket-mb 0.0: the DDP bucket size must be positive"),
    (["--n-embd", "130"], "--n-embd 130 does not split into --n-head 4 heads"),
    # the --moe-* flags by their names (they were GPTConfig's field names, after MPI started)
    (["--moe-experts", "1"], "--moe-experts 1: 0 (a dense model) or at least 2 experts"),
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
])
def test_one_error_line_exit_2_no_traceback(flags, says, device):
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


@pytest.mark.parametrize("ranks,flags,refused", [
    (1, ["--bucket-mb", "4"], "--bucket-mb 4.0: sets DDP's bucket size, which this run does "
     "not use (this layout has one replica: run more ranks for dp, cp or ep, or leave "
     "--bucket-mb out)"),
    (4, ["--pp", "2", "--tp", "2", "--ddp", "bucketed"], "--ddp bucketed: sets how DDP"),
    (2, ["--ddp", "naive"], None),                             # dp 2: DDP averages
    (2, ["--cp", "2", "--ddp", "naive"], None),                # over the cp ranks
    (2, ["--moe-experts", "2", "--ep", "2", "--bucket-mb", "2"], None),  # the dense ones over ep
])
def test_ddp_flags_with_one_replica_are_refused(ranks, flags, refused):
    """--ddp and --bucket-mb do nothing where no gradient is averaged (one process, or every
    rank a tp / pp shard of one replica): refused by check_layout, which knows the replicas
    (dp x ep x cp), as check_flags refuses them under --zero. Was: accepted, ignored."""
    assert _layout_refusal(ranks, flags, refused)


@pytest.mark.parametrize("ranks,flags,refused", [
    (1, ["--trace", "t.json"], "--trace t.json: sets the file the collectives' trace is "
     "written to, which this run does not use (one process sends nothing: run more ranks "
     "(mpirun -n N), or leave --trace out)"),
    (1, ["--comm", "mpi"], "--comm mpi: sets the collectives' algorithm"),
    (1, ["--sync-comm"], "--sync-comm: sets where the collectives run"),
    (1, ["--comm-timeout", "5"], "--comm-timeout 5.0: sets how long a collective may wait"),
    (1, ["--zero", "1", "--trace", "t.json"], None),   # ZeRO over one rank: a group, a trace
    (2, ["--trace", "t.json", "--comm", "mpi"], None),
])
def test_communication_flags_on_one_process_are_refused(ranks, flags, refused):
    """One process without ZeRO has no group: --trace (it trained the whole run, then said
    there was no trace), --comm and --sync-comm would do nothing; refused before step 0."""
    assert _layout_refusal(ranks, flags, refused)


def _layout_refusal(ranks, flags, refused):
    """check_layout on `ranks` accepts `flags` (refused None) or refuses them with an error
    containing `refused`."""
    from minidist.train.strategy import check_layout
    args = train_parser().parse_args(flags)
    if refused is None:
        check_layout(args, ranks)
        return True
    with pytest.raises(UsageError) as e:
        check_layout(args, ranks)
    return refused in str(e.value)


@pytest.mark.parametrize("ranks,flags,refused", [
    (4, ["--zero", "3", "--zero-shard", "3"], "--zero-shard 3: the ranks each replica is "
     "sharded over must divide dp 4: one of 1, 2, 4 (typically the ranks of one node)"),
    (4, ["--zero", "1", "--zero-shard", "0"], "--zero-shard 0: the ranks each replica"),
    (4, ["--overlap-param-gather"], "--overlap-param-gather: sets when ZeRO-1 and -2 wait for "
     "the updated parameters' all-gathers (ZeRO-3 gathers before each block anyway), which "
     "this run does not use (use --zero 1 or 2, or leave --overlap-param-gather out)"),
    (4, ["--zero", "3", "--overlap-param-gather"], "--overlap-param-gather: sets when"),
    (4, ["--zero", "2", "--overlap-param-gather"], None),
    (4, ["--zero-shard", "2"], "--zero-shard 2: sets the ranks ZeRO shards each replica over, "
     "which this run does not use (add --zero 1, 2 or 3, or leave --zero-shard out)"),
    (4, ["--zero", "2", "--zero-shard", "2", "--moe-experts", "4", "--ep", "2"], None),
    (4, ["--zero", "2", "--zero-shard", "4", "--moe-experts", "4", "--ep", "2"], None),
    (4, ["--zero", "2", "--zero-shard", "3", "--moe-experts", "4", "--ep", "2"],
     "--zero-shard 3: the ranks each replica is sharded over must divide dp x ep = 2 x 2 = "
     "4: one of 1, 2, 4"),
    (4, ["--zero", "2", "--zero-shard", "1", "--tp", "2"], None),   # each tp rank's dp
    (4, ["--zero", "2", "--zero-shard", "2"], None),
    (4, ["--zero", "2", "--zero-shard", "4"], None),            # one group: plain ZeRO
    (4, ["--zero", "3", "--zero-shard", "2", "--cp", "2"], None),   # over dp x cp
    (4, ["--zero", "3", "--zero-shard", "1", "--pp", "2"], None),   # each stage's dp
    (4, ["--zero", "3", "--zero-shard", "3", "--cp", "2"], "--zero-shard 3: the ranks each "
     "replica is sharded over must divide dp x cp = 2 x 2 = 4"),
])
def test_zero_shard_is_checked_against_the_layout(ranks, flags, refused):
    """--zero-shard K (hybrid sharding): K divides ZeRO's dp (x ep x cp) ranks, needs --zero;
    one error line before any communication."""
    assert _layout_refusal(ranks, flags, refused)


@pytest.mark.mpi
def test_a_problem_one_rank_alone_finds_stops_every_rank_naming_it(corpus, tmp_path, mpi):
    """The flags are checked on each rank before MPI starts, and a rank's node may lack what
    another's has (here rank 1's --data path): the ranks agree on the verdict right after
    MPI_Init, and every rank stops with one error line naming the rank, exit 2, in seconds
    (rank 1 left alone before MPI_Init: the others waited there for the timeout, 600 s by
    default, then died with a stack dump; rank 1's line was never printed). By hand:
    mpiexec -n 2 python tests/scripts/node_lacks_data.py --data FILE"""
    start = time.monotonic()
    out = mpi(2, "tests/scripts/node_lacks_data.py", "--data", corpus, "--steps", "2",
              "--cache-dir", tmp_path / "cache", timeout=120, check=False,
              env=mpi_env(MINIDIST_COMM_TIMEOUT=100))
    assert out.returncode == 2 and time.monotonic() - start < 60, out.stderr
    assert out.stderr.count("error: ") == 1 and "Traceback" not in out.stderr, out.stderr
    assert f"error: --data {corpus}.not-on-this-node: no such file" in out.stderr
    assert "(found on rank 1 of 2: do the nodes differ?)" in out.stderr, out.stderr


def test_a_launcher_of_another_mpi_is_one_error_line_not_n_separate_runs(corpus, tmp_path):
    """First-use walk 31: Open MPI's mpirun with the mpich wheel's libmpi starts each rank as
    an MPI job of its own: N copies trained, saved into one folder (prune deleted one run's
    checkpoint) and exited 0. Two processes with Open MPI's variables (what its mpirun sets)
    now stop at MPI_Init: one error line (from the launcher's rank 0) naming both sizes and
    the library mpi4py loaded, exit 2 on both, nothing trained or saved."""
    procs = [subprocess.Popen(
        [sys.executable, os.path.join(ROOT, "examples", "train_gpt.py"), "--data", corpus,
         "--steps", "2", "--n-layer", "1",
         "--n-embd", "16", "--cache-dir", str(tmp_path / "cache"), "--save", "ck"],
        cwd=tmp_path, env=mpi_env(OMPI_COMM_WORLD_SIZE="2", OMPI_COMM_WORLD_RANK=str(r),
                                  OMPI_COMM_WORLD_LOCAL_RANK=str(r),
                                  OMPI_COMM_WORLD_LOCAL_SIZE="2"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [2, 2], outs
    errors = [line for _, err in outs for line in err.splitlines() if line.startswith("error:")]
    assert errors == [errors[0]] and errors[0].startswith(
        "error: the launcher started 2 processes but MPI sees 1: mpi4py loaded another MPI "
        "than the launcher's ("), outs
    assert all("step " not in out for out, _ in outs) and not os.listdir(tmp_path / "ck")


def test_a_second_run_saving_into_the_same_folder_is_refused_naming_the_first(corpus,
                                                                             tmp_path):
    """First-use walk 31: two runs on one --save (a job submitted twice; one default folder
    for every submission): one removed the other's temporary folder mid-save, or pruned the
    checkpoint the other was resuming from (a FileNotFoundError traceback). The run holds
    --save's lock (DIR/.lock, flock) until it ends: a second one is one error line naming the
    first, exit 2, before it reads or writes anything; once the first has ended, a run
    takes the folder (here: resumes it)."""
    common = [sys.executable, os.path.join(ROOT, "examples", "train_gpt.py"), "--data",
              corpus, "--n-layer", "1", "--n-embd", "16", "--cache-dir", str(tmp_path / "c"),
              "--save", "ck", "--resume", "auto", "--sample", "0", "--eval-iters", "1"]
    first = subprocess.Popen([*common, "--steps", "400", "--save-every", "1", "--keep", "2"],
                             cwd=tmp_path, env=mpi_env(), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        while "saved step" not in first.stdout.readline():        # it trains and saves
            assert first.poll() is None, first.stderr.read()
        second = subprocess.run([*common, "--steps", "2"], cwd=tmp_path, env=mpi_env(),
                                capture_output=True, text=True, timeout=120)
    finally:
        first.send_signal(signal.SIGINT)          # Ctrl-C: saves its step, exits 130
        first.wait(timeout=120)
    assert second.returncode == 2 and "step " not in second.stdout, second.stderr
    assert second.stderr.startswith(f"error: --save ck: another run saves into it "
                                    f"({socket.gethostname()}, pid {first.pid}, since "), \
        second.stderr
    assert second.stderr.count("\n") == 1
    done = int((tmp_path / "ck" / "latest").read_text().strip().split("-")[1])
    again = subprocess.run([*common, "--steps", str(done + 1)], cwd=tmp_path, env=mpi_env(),
                           capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and "resumed from ck/step-" in again.stdout, again.stderr


@pytest.mark.mpi
def test_a_save_folder_on_each_nodes_own_disk_is_refused_before_step_0(corpus, tmp_path, mpi):
    """First-use walk 31: --save on a node's own disk (here: each rank starts in a folder
    of its own, and --save is relative) trained, said "saved step 3", exit 0, and the resume
    found rank 1's shard missing. Every rank now looks for a file rank 0 makes in --save
    right after MPI_Init: one error line naming the rank, exit 2, before step 0.
    By hand: mpiexec -n 2 python tests/scripts/node_own_disk.py --node-dirs A,B --save ck"""
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    for n in nodes:
        n.mkdir()
    out = mpi(2, "tests/scripts/node_own_disk.py", "--node-dirs", ",".join(map(str, nodes)),
              "--save", "ck", "--zero", "1", "--data", corpus, "--steps", "2", "--cache-dir",
              tmp_path / "cache", timeout=120, check=False)
    assert out.returncode == 2 and "step " not in out.stdout, (out.stdout, out.stderr)
    assert out.stderr.count("error: ") == 1 and "Traceback" not in out.stderr, out.stderr
    assert ("error: --save ck: rank 1 of 2 does not see the files world rank 0 writes there; "
            "--save must be a folder every rank sees") in out.stderr, out.stderr
    assert os.listdir(nodes[0] / "ck") == []                 # the probe removed


@pytest.mark.parametrize("ranks,flags,says", [
    (1, ["--batch-size", "6", "--grad-accum", "4"], "--batch-size 6 does not split into dp 1 "
     "x --grad-accum 4 = 4 equal micro-batches"),
    # the multiple it names counts dp: was "a multiple of 4" before the ranks were known,
    # then, for --batch-size 4, "a multiple of 8"
    (2, ["--batch-size", "6", "--grad-accum", "4"], "give --batch-size a multiple of 8"),
])
def test_the_batch_error_names_the_multiple_the_layout_needs(ranks, flags, says):
    from minidist.train.strategy import check_layout
    check_flags(train_parser().parse_args(flags))            # not refused before the layout
    with pytest.raises(UsageError) as e:
        check_layout(train_parser().parse_args(flags), ranks)
    assert says in str(e.value)


@pytest.mark.parametrize("ranks,flags,suggests", [
    (4, ["--tp", "2", "--dp", "4"], "run the same command with `mpirun -n 8`, or leave --dp "
     "out"),
    # --dp not given: no "leave --dp out"; the same command, every flag kept (it was rebuilt
    # from the parallel flags alone, and `mpirun -n 8 ... --ep 4 --cp 2` lost --moe-experts)
    (4, ["--moe-experts", "4", "--ep", "4", "--cp", "2"], "--ep 4 x --cp 2 = 8 ranks per "
     "replica (the processes are dp x 8), but this job has 4 MPI process(es); run the same "
     "command with `mpirun -n 8`"),
    (3, ["--tp", "2", "--n-layer", "2"], "run the same command with `mpirun -n 2`"),
    (4, ["--tp", "3"], None),              # --n-head 4 is not divisible by 3 either
    (4, ["--cp", "3"], None),              # nor --block-size 128 into 6 chunks
    (4, ["--zero", "3", "--zero-shard", "2", "--dp", "3"], None),   # 2 does not divide 3
    # "leave --dp out" only where the processes divide by the other axes (6 by tp x pp 4
    # does not: it was suggested, and refused next)
    (6, ["--tp", "2", "--pp", "2", "--dp", "2", "--n-layer", "2"], "run the same command "
     "with `mpirun -n 8`"),
])
def test_the_rank_count_error_suggests_a_command_only_when_it_would_run(ranks, flags,
                                                                        suggests):
    """A wrong rank count names the mpirun command with the right one, unless another flag
    is wrong too: that command would then fail on it (found by a first-use walk: `--tp 3` on
    4 ranks suggested `mpirun -n 3 ... --tp 3`, refused next for --n-head 4). The same
    command on the rank count it names is accepted."""
    from minidist.train.strategy import check_layout
    with pytest.raises(UsageError) as e:
        check_layout(train_parser().parse_args(flags), ranks)
    assert "but this job has" in str(e.value)
    if suggests is None:
        assert "run `mpirun" not in str(e.value), str(e.value)
        return
    assert suggests in str(e.value)
    a = train_parser().parse_args(flags)
    leave = "--dp" in flags and ranks % (a.tp * a.pp * a.cp * a.ep) == 0
    assert ("leave --dp out" in str(e.value)) == leave, str(e.value)
    ranks = int(str(e.value).split("`mpirun -n ")[1].split("`")[0])
    check_layout(train_parser().parse_args(flags), ranks)


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


# examples/sample.py: (flags, the one error line). {gpt2}: a GPT-2 folder with 50,257 BPE tokens
SAMPLE_BAD = [
    (["--resume", "/nonexistent"], "--resume /nonexistent: no such directory"),
    (["--resume", ".", "--tokens", "0"], "--tokens/--sample 0: must be at least 1"),
    (["--resume", ".", "--sample", "0"], "--tokens/--sample 0: must be at least 1"),
    (["--resume", ".", "--temperature", "-1"], "--temperature -1.0: must be a number >= 0"),
    (["--resume", ".", "--temperature", "nan"], "--temperature nan: must be a number >= 0"),
    (["--resume", "{file}"], ": is a file, not a folder (give a --save directory"),
    (["--resume", ".", "--top-k", "-1"], "--top-k -1: must not be negative"),
    (["--resume", ".", "--prompt", ""], "--prompt '': give at least one character"),
    (["--resume", "examples"], "not a minidist checkpoint"),
    (["--tokens", "5"], "the following arguments are required: --resume"),
    (["--resume", "{gpt2}"], "a model of a 50,257-token vocabulary, and no tokenizer found "
     "for it (looked in "),
    (["--resume", "{gpt2}", "--tokenizer", "examples"], "--tokenizer examples: no vocab.json "
     "and merges.txt (nor meta.pkl) there"),
]


@pytest.mark.parametrize("flags,says", SAMPLE_BAD, ids=[" ".join(f) for f, _ in SAMPLE_BAD])
def test_sample_errors_are_one_line(flags, says, tmp_path, device):
    """python examples/sample.py --resume GPT2_FOLDER: refused before any array is read."""
    if "{gpt2}" in flags:
        GPT(GPTConfig(n_layer=1, n_head=1, n_embd=4, block_size=8, vocab_size=50257)
            ).save_pretrained(tmp_path / "gpt2")
    (tmp_path / "afile").write_text("x")
    out = subprocess.run([sys.executable, "examples/sample.py",
                          *[f.format(gpt2=tmp_path / "gpt2", file=tmp_path / "afile")
                            for f in flags],
                          *device_flags(device)], cwd=ROOT, env=mpi_env(),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stdout == "" and "Traceback" not in out.stderr
    assert out.stderr.startswith("error: ") and says in out.stderr, out.stderr
    assert out.stderr.count("\n") == 1


def test_printable_escapes_control_characters():
    assert printable("a\x1b[2Jb\tc\nd\x00") == "a\\x1b[2Jb\tc\nd\\x00"
    assert printable("def f(x):\n    return x") == "def f(x):\n    return x"
    # first-use walk 33: the zero-width joiner of an emoji sequence came back escaped; text
    # Python calls unprintable (joiners, no-break and ideographic spaces) stays, while a
    # bidirectional override (it reorders the screen) and a lone surrogate are escaped
    kept = "👩\u200d💻 \u0930\u094d\u200d \xa0\u3000"
    assert printable(kept) == kept
    assert printable("a\u202eb\ud800") == "a\\u202eb\\ud800"


# ---- whole runs ------------------------------------------------------------------------------
TINY = ["--n-layer", "2", "--n-head", "2", "--n-embd", "16", "--block-size", "16",
        "--batch-size", "4", "--eval-every", "0", "--eval-iters", "1", "--sample", "0"]
_WHOLE = sum(math.prod(s) for s, _ in gpt_param_specs(GPTConfig(
    n_layer=2, n_head=2, n_embd=16, block_size=16, vocab_size=256)).values())
# (case, ranks, runs before it, its flags, exit status, lines its output must hold, lines
# it must not). {ck}, {old}: --save folders; each run adds TINY, the corpus and --steps 3.
RUNS = [
    ("each save says where", 1, [], ["--save", "{ck}", "--save-every", "2"], 0,
     ["saved step 2 to {ck}/step-00000002", "saved step 3 to {ck}/step-00000003"], []),
    ("same --save again is refused", 1, [["--save", "{ck}"]], ["--save", "{ck}"], 2,
     ["error: --save {ck}: already holds a checkpoint (step 3: {ck}/step-00000003)",
      "It is a finished run: add --resume auto --steps N, N above 3, to train it further",
      "--overwrite"], ["step     1/3"]),
    ("same --save again after a stop is refused", 1, [["--save", "{ck}", "--stop-at", "2"]],
     ["--save", "{ck}"], 2, ["already holds a checkpoint (step 2: {ck}/step-00000002)",
                             "Add --resume auto to continue it"], ["finished run"]),
    ("same --save again is refused, DDP", 2, [["--save", "{ck}"]], ["--save", "{ck}"], 2,
     ["error: --save {ck}: already holds a checkpoint (step 3: {ck}/step-00000003)"], []),
    ("--overwrite replaces it", 1, [["--save", "{ck}"]],
     ["--save", "{ck}", "--overwrite", "--steps", "2"], 0, ["saved step 2 to {ck}"], []),
    ("--resume auto continues it", 1, [["--save", "{ck}", "--steps", "2"]],
     ["--save", "{ck}", "--resume", "auto"], 0,
     ["at step 2", "step     3/3", "saved step 3 to {ck}"], []),
    ("--resume auto on an empty --save says it starts fresh", 1, [],
     ["--save", "{ck}", "--resume", "auto"], 0,
     ["--resume auto: no checkpoint in {ck} yet: starting at step 0", "step     3/3"], []),
    ("--muon-* on an AdamW checkpoint names it", 1, [["--save", "{ck}", "--steps", "2"]],
     ["--resume", "{ck}", "--muon-momentum", "0.9"], 2,
     ["error: --muon-momentum 0.9: sets Muon's momentum, which this run does not use "
      "(--resume {ck}", "was trained with adamw, which a resumed run keeps"], []),
    ("--resume older, --save newer is refused", 1,
     [["--save", "{old}", "--steps", "1"], ["--save", "{ck}"]],
     ["--resume", "{old}", "--save", "{ck}"], 2,
     ["error: --save {ck}: holds step 3", "newer than step 1"], []),
    ("diverged: one line, nothing saved", 1, [],
     ["--lr", "1e30", "--grad-clip", "0", "--save", "{ck}", "--steps", "20"], 2,
     ["error: step 2: loss nan", "training diverged (--lr 1e+30 too high?)", "nothing saved"],
     ["saved step", "RuntimeWarning"]),
    ("diverged under ZeRO-2: every rank stops", 2, [],
     ["--lr", "1e30", "--grad-clip", "0", "--zero", "2", "--save", "{ck}", "--steps", "20"], 2,
     ["error: step 2: loss nan"], ["saved step"]),
    ("progress: step N/total, elapsed, ETA", 1, [], ["--log-every", "1"], 0,
     ["step     1/3 | loss", "step     3/3 | loss", "elapsed, ETA"], []),
    ("TP: the whole model and this rank's share", 2, [], ["--tp", "2"], 0,
     [f"model: {_WHOLE:,} parameters ("], []),
    ("PP: the whole model and this rank's share", 2, [], ["--pp", "2"], 0,
     [f"model: {_WHOLE:,} parameters ("], []),
]


def _train(ranks, flags, corpus, tmp_path):
    launch = [mpiexec(), "-n", str(ranks)] if ranks > 1 else []
    cmd = [*launch, sys.executable, "examples/train_gpt.py", *TINY, "--data", corpus,
           "--cache-dir", str(tmp_path / "cache"), "--steps", "3", *flags]
    return subprocess.run(cmd, cwd=ROOT, env=mpi_env(), capture_output=True, text=True,
                          timeout=120)


@pytest.mark.mpi
@pytest.mark.parametrize("case,ranks,before,flags,status,says,never", RUNS,
                         ids=[r[0] for r in RUNS])
def test_runs(case, ranks, before, flags, status, says, never, corpus, tmp_path, device):
    """Each row by hand: python examples/train_gpt.py FLAGS (after the runs before it)."""
    fill = {"ck": tmp_path / "ck", "old": tmp_path / "old"}
    for earlier in before:
        assert _train(1, [f.format(**fill) for f in earlier], corpus, tmp_path).returncode == 0
    saved = sorted(os.listdir(fill["ck"])) if os.path.isdir(fill["ck"]) else []
    out = _train(ranks, [f.format(**fill) for f in flags] + device_flags(device), corpus,
                 tmp_path)
    text = out.stdout + out.stderr
    assert out.returncode == status and "Traceback" not in text, text[-3000:]
    for line in says:
        assert line.format(**fill) in text, (line, text[-3000:])
    for line in never:
        assert line not in text, (line, text[-3000:])
    if status:     # one error line from rank 0, and --save holds what it held
        assert out.stderr.count("\n") == 1, out.stderr
        assert (sorted(os.listdir(fill["ck"])) if os.path.isdir(fill["ck"]) else []) == saved


# (ranks, with --save): Ctrl-C to the job's process group, as a terminal sends it
CTRL_C = [(1, True), (2, True), (2, False)]


@pytest.mark.mpi
@pytest.mark.parametrize("ranks,save", CTRL_C, ids=[f"{r} rank(s), save {s}" for r, s in CTRL_C])
def test_ctrl_c_saves_at_the_step_boundary(ranks, save, corpus, tmp_path, device):
    """By hand: mpiexec -n 2 python examples/train_gpt.py --save ck ..., then Ctrl-C."""
    log, ck = tmp_path / "log.jsonl", tmp_path / "ck"
    launch = [mpiexec(), "-n", str(ranks)] if ranks > 1 else []
    cmd = [*launch, sys.executable, "examples/train_gpt.py", *TINY, "--data", corpus,
           "--cache-dir", str(tmp_path / "cache"), "--steps", "100000", "--log-every", "1",
           "--log-json", str(log), *(["--save", str(ck)] if save else []),
           *device_flags(device)]
    job = subprocess.Popen(cmd, cwd=ROOT, env=mpi_env(), stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.time() + 60
        while not (log.exists() and len(log.read_text().splitlines()) >= 3):
            assert time.time() < deadline and job.poll() is None, job.communicate()
            time.sleep(0.1)
        os.killpg(job.pid, signal.SIGINT)
        out, err = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode == 130 and "Traceback" not in err and "KeyboardInterrupt" not in err
    lines = [line for line in out.splitlines() if line.startswith("interrupted (Ctrl-C)")]
    assert len(lines) == 1, out[-2000:]
    step = len(log.read_text().splitlines())             # steps done, all logged
    if save:
        assert f"after step {step}: saved to {ck}/step-{step:08d}" in lines[0]
        assert f"--resume {ck}" in lines[0] and (ck / f"step-{step:08d}").is_dir()
    else:
        assert lines[0] == f"interrupted (Ctrl-C) after step {step}: nothing saved (no --save DIR)"


def test_the_flag_modules_load_no_numpy():
    """train_gpt.py sets the BLAS thread count in the environment, then imports the flag
    modules: numpy loaded by them would have read it first (cli.py imports numpy's users
    inside the checks that need them)."""
    out = subprocess.run([sys.executable, "-c", "import sys, minidist.train.args, "
                          "minidist.train.cli; print(sorted(m for m in sys.modules "
                          "if m.split('.')[0] == 'numpy')[:3])"], cwd=ROOT, env=mpi_env(),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout == "[]\n", (out.stdout, out.stderr)


def test_every_example_states_its_defaults_and_its_first_paragraph():
    """Every script in examples/ (but plot.py and ddp_timeline.py, whose --help is their
    whole docstring) builds its parser with args.example_parser: --help shows each flag's
    default and the docstring's first paragraph (plan.py showed no default; bench_plan.py's
    description stopped mid-sentence, at its docstring's first line break). Two run here."""
    scripts = sorted(f for f in os.listdir(os.path.join(ROOT, "examples"))
                     if f.endswith(".py") and f not in ("plot.py", "ddp_timeline.py")
                     and f != "own_loop_reference.py")   # (not a script: the scripts' part)
    for name in scripts:
        source = open(os.path.join(ROOT, "examples", name)).read()
        if "parse_args(" in source and "train_parser()" not in source:
            assert "example_parser(__doc__)" in source or name in ("sample.py",
                                                                   "export_gpt2.py"), name
    for name, default, ends in (("plan.py", "(default: 64)", "fastest first."),
                                ("bench_plan.py", "(default: 8)", "EP2 x CP2).")):
        out = subprocess.run([sys.executable, f"examples/{name}", "--help"], cwd=ROOT,
                             env=mpi_env(), capture_output=True, text=True, timeout=60)
        text = " ".join(out.stdout.split())
        assert out.returncode == 0 and default in text, (name, text)
        assert text.split(" options: ")[0].endswith(ends), (name, text[:600])


def test_every_flag_of_every_example_has_a_help_text():
    """Every flag of examples/*.py and minidist/train/*.py has a help text: HelpWithDefaults
    adds "(default: X)" to a flag's help text, so a flag without one shows no default, and
    README.md says --help shows every default (a first-use walk found plan_memory.py's --gpus
    and bench_sample.py's flags with no default in --help)."""
    missing = []
    for folder in ("examples", os.path.join("minidist", "train")):
        for name in sorted(os.listdir(os.path.join(ROOT, folder))):
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            for node in ast.walk(ast.parse(open(os.path.join(ROOT, path)).read(), path)):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and node.func.attr == "add_argument"
                        and any(isinstance(a, ast.Constant) and str(a.value).startswith("-")
                                for a in node.args)
                        and "help" not in {k.arg for k in node.keywords}):
                    missing.append(f"{path}:{node.lineno}")
    assert not missing, f"flags without help= (their default is not shown): {missing}"


@pytest.mark.parametrize("flags,unknown", [(["--seq", "256"], "--seq 256"),
                                           (["--step", "3"], "--step 3"),
                                           (["--opt", "muon"], "--opt muon")])
def test_a_flag_is_not_taken_for_its_abbreviation(flags, unknown, capsys):
    """argparse's prefixes are off (args.Parser): plan.py's --seq was read as
    --sequence-parallel (the error named a stray 256), and --step 3 ran as --steps 3."""
    with pytest.raises(SystemExit) as e:
        train_parser().parse_args(flags)
    assert e.value.code == 2
    assert capsys.readouterr().err.startswith(f"error: unrecognized arguments: {unknown} (")


def test_ctrl_c_while_the_flags_are_read_is_one_line(capsys):
    """First-use walk 26: a Ctrl-C landing in `train_parser().parse_args()`, evaluated as
    run_main's argument between the import guard and run_main's own, was a traceback (2 in
    25 tries at 2.0-2.4 s). The entry points now hand run_main their parser, built and read
    inside its guard: the one interrupted line, exit 130."""
    from minidist.train.cli import run_main

    def interrupted_parser():
        raise KeyboardInterrupt
    with pytest.raises(SystemExit) as e:
        run_main(lambda args: None, parser=interrupted_parser)
    assert e.value.code == 130
    assert capsys.readouterr().err == "interrupted (Ctrl-C): stopped at once, nothing saved\n"
    for script in ("train_gpt", "sample", "export_gpt2", "train_tokenizer"):
        tree = ast.parse(open(os.path.join(ROOT, "examples", f"{script}.py")).read())
        calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)
                 and getattr(n.func, "id", None) == "run_main"]
        assert len(calls) == 1 and not calls[0].args[1:], script    # nothing parsed outside
        assert [k.arg for k in calls[0].keywords][:1] == ["parser"], script


@pytest.mark.mpi
@pytest.mark.parametrize("ranks,flags,signum", [(1, (), signal.SIGINT),
                                                (2, ("--tp", "2"), signal.SIGINT),
                                                (2, ("--tp", "2"), signal.SIGTERM)])
def test_ctrl_c_during_the_sample_is_one_line_and_130(ranks, flags, signum, corpus, tmp_path):
    """First-use walk 26: the end's sample (--sample 400 by default, under --eval-only too)
    never looked at the flag a Ctrl-C sets, so it ran to its end and the run exited 0, the
    Ctrl-C lost. Now the ranks agree every 16 tokens whether a signal came, so one process
    and the ranks of a split model (here TP: the same tokens through its collectives) stop
    at the same token, and the run says so in one line, exit 130, its steps saved. A
    scheduler's SIGTERM the same, exit 0: the run is done (walk 37: it cut the sample
    without a word).

        python examples/train_gpt.py --save ck --sample 100000, then Ctrl-C as it samples
    """
    ck, out_path = tmp_path / "ck", tmp_path / "out.txt"
    launch = [mpiexec(), "-n", str(ranks)] if ranks > 1 else []
    tokens = "100000"                 # minutes to sample whole: the cut is what ends it
    cmd = [*launch, sys.executable, "examples/train_gpt.py", *TINY, "--data", corpus,
           "--cache-dir", str(tmp_path / "cache"), "--steps", "2", "--save", str(ck),
           "--sample", tokens, *flags]
    with open(out_path, "w") as out:
        job = subprocess.Popen(cmd, cwd=ROOT, env=mpi_env(), stdout=out,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            deadline = time.time() + 120
            while "sampling " not in out_path.read_text():
                assert time.time() < deadline and job.poll() is None, job.communicate()
                time.sleep(0.1)
            os.killpg(job.pid, signum)
            t = time.time()
            _, err = job.communicate(timeout=120)
            took = time.time() - t
        finally:
            if job.poll() is None:
                os.killpg(job.pid, signal.SIGKILL)
    said = out_path.read_text()
    what, status = ("interrupted (Ctrl-C)", 130) if signum == signal.SIGINT else \
        ("preempted (SIGTERM)", 0)
    assert job.returncode == status and "Traceback" not in err, (said[-1500:], err)
    assert said.count(f"{what} during the sample") == 1, said[-1500:]
    assert f"the 2 steps are done and saved in {ck}" in said and (ck / "step-00000002").is_dir()
    sample = said.split("---- sample ----\n")[1].split("\n----------------")[0]
    assert len(sample) < 20000 and took < 60, (len(sample), took)
