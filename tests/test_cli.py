"""Bad input to examples/train_gpt.py: one `error:` line naming the flag or path, printed once
(under mpiexec too), exit status 2, no traceback; --traceback shows it. A sample never writes
control characters. Table-driven: each row is a case a user hit.

    python examples/train_gpt.py --steps 0          # error: --steps 0: must be at least 1 ...
"""
import subprocess
import sys

import pytest

from minidist.train.args import train_parser
from minidist.train.cli import UsageError, check_flags, printable
from tests.mpirun import ROOT, device_flags, mpi_env

# (flags, what the one error line must contain)
BAD_FLAGS = [
    (["--steps", "0"], "--steps 0: must be at least 1"),
    (["--steps", "-5"], "--steps -5: must be at least 1"),
    (["--lr", "-1"], "--lr -1.0: the learning rate must be positive"),
    (["--lr", "0"], "--lr 0.0: the learning rate must be positive"),
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
    (["--micro-batches", "0"], "--micro-batches 0: must be at least 1"),
    (["--threads", "0"], "--threads 0: must be at least 1"),
    (["--stop-at", "0"], "--stop-at 0: must be at least 1"),
    (["--warmup", "-1"], "--warmup -1: must be at least 0"),
    (["--keep", "0"], "--keep 0: must be at least 1"),
    (["--attention-block", "0"], "--attention-block 0: must be at least 1"),
    (["--comm-timeout", "-1"], "--comm-timeout -1.0: must be at least 0"),
    (["--min-lr", "1"], "--min-lr 1.0: must be between 0 and --lr"),
    (["--dropout", "1"], "--dropout 1.0: a probability in [0, 1)"),
    (["--weight-decay", "-0.1"], "must not be negative"),
    (["--grad-clip", "-1"], "must not be negative"),
    (["--bucket-mb", "0"], "--bucket-mb 0.0: the DDP bucket size must be positive"),
    (["--n-embd", "130"], "--n-embd 130 does not split into --n-head 4 heads"),
    (["--batch-size", "6", "--grad-accum", "4"], "--batch-size 6 does not split into --grad-accum 4"),
    (["--data", "/nonexistent"], "--data /nonexistent: no such file or folder"),
    (["--resume", "/nonexistent"], "--resume /nonexistent: does not exist"),
]


@pytest.mark.parametrize("flags,says", BAD_FLAGS, ids=[" ".join(f) for f, _ in BAD_FLAGS])
def test_check_flags_names_the_flag(flags, says):
    with pytest.raises(UsageError, match=None) as e:
        check_flags(train_parser().parse_args(flags))
    assert says in str(e.value)


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
    out = _run(device, "--resume", str(tmp_path / "empty"), "--steps", "1", "--eval-iters", "1",
               "--sample", "0", timeout=120)
    assert out.returncode == 2 and out.stderr.startswith("error: ")
    assert str(tmp_path / "empty") in out.stderr and "Traceback" not in out.stderr


def test_traceback_flag_shows_the_traceback(device):
    out = _run(device, "--steps", "0", "--traceback")
    assert out.returncode != 0 and "Traceback" in out.stderr and "UsageError" in out.stderr


@pytest.mark.mpi
def test_errors_print_once_under_mpiexec(mpi):
    """    mpiexec -n 4 python examples/train_gpt.py --grad-accum 0"""
    out = mpi(4, "examples/train_gpt.py", "--grad-accum", "0", timeout=60, check=False)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.count("error: --grad-accum 0") == 1, out.stderr


def test_printable_escapes_control_characters():
    assert printable("a\x1b[2Jb\tc\nd\x00") == "a\\x1b[2Jb\tc\nd\\x00"
    assert printable("def f(x):\n    return x") == "def f(x):\n    return x"
