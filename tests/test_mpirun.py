"""pytest's --device reaches the ranks: tests/mpirun.py's run_mpi and the `mpi` fixture
(tests/conftest.py) hand it to every rank script as `--device`, and an unknown one is refused;
a job past its timeout is killed with its whole process group (run_job).

    python -m pytest -q tests/test_mpirun.py                  # the device: cpu
    python -m pytest -q tests/test_mpirun.py --device cuda    # on a GPU machine
"""
import ast
import glob
import os
import re
import subprocess
import sys
import time

import pytest

from mpirun import ROOT, MpiRunner, device_flags, run_job, run_mpi, tagged_json


@pytest.mark.mpi
def test_the_suites_device_reaches_every_rank(mpi, device):
    """mpiexec -n 2 python tests/scripts/device_echo.py --device cpu"""
    rows = tagged_json(mpi(2, "tests/scripts/device_echo.py", timeout=60))
    assert sorted(r["rank"] for r in rows) == [0, 1]
    xp = {"cpu": "numpy", "cuda": "cupy"}[device]
    assert all(r["device"] == device and r["xp"] == xp for r in rows), rows
    assert mpi.device == device


def test_an_unknown_device_is_refused_before_any_job():
    assert device_flags("cpu") == ["--device", "cpu"] and device_flags(None) == []
    for make in (lambda: MpiRunner("gpu"),
                 lambda: run_mpi(2, "tests/scripts/device_echo.py", device="tpu")):
        with pytest.raises(ValueError, match="device must be one of cpu, cuda"):
            make()


def test_pytest_refuses_an_unknown_device():
    out = subprocess.run([sys.executable, "-m", "pytest", "--device", "tpu", "--co", "-q",
                          "tests/test_mpirun.py"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 4 and "invalid choice: 'tpu'" in out.stderr, out.stderr


def _scripts_run_under_mpi():
    """Every script a test file starts through the `mpi` fixture: `mpi(N, "path", ...)`."""
    found = set()
    for path in glob.glob(os.path.join(ROOT, "tests", "test_*.py")):
        for node in ast.walk(ast.parse(open(path).read())):
            if (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "mpi"
                    and len(node.args) > 1 and isinstance(node.args[1], ast.Constant)):
                found.add(node.args[1].value)
    return sorted(found)


def test_every_script_run_under_mpi_parses_device():
    """A rank script that did not take --device would fail every distributed test on its
    first argument; the train_parser scripts (ddp_abort.py; train_gpt.py hands run_main its
    parser) and the benches built on add_model_args (bench_zero.py, bench_ddp.py) take
    train_gpt's own flag, the
    scripts started by exact.start (tests/scripts/exact.py) its --device."""
    scripts = _scripts_run_under_mpi()
    assert "examples/train_gpt.py" in scripts and "tests/scripts/ddp_check.py" in scripts
    for script in scripts:
        text = open(os.path.join(ROOT, script)).read()
        assert '"--device"' in text or "train_parser()" in text or \
            "parser=train_parser" in text or "add_model_args(" in text or \
            "from exact import" in text and "start(" in text, script


def test_a_job_past_its_timeout_is_killed_with_its_process_group():
    """run_job (run_mpi's runner, and the tests' own mpiexec lines): on timeout every process
    the job started dies with it (subprocess.run's timeout killed only mpiexec: the ranks
    lived on), and the failure carries the job's output."""
    # 2 s: bash forks and echoes in milliseconds, even on a loaded machine (5 s waited 3 more)
    with pytest.raises(AssertionError, match=r"(?s)timed out after 2s: .*child \d+") as e:
        run_job(["bash", "-c", "sleep 300 >/dev/null 2>&1 & echo child $!; wait"], timeout=2)
    pid = int(re.search(r"child (\d+)", str(e.value)).group(1))
    for _ in range(100):                # killed; gone once reaped (a zombie till then)
        try:
            state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            break
        if state == "Z":
            break
        time.sleep(0.05)
    else:
        raise AssertionError(f"the job's child {pid} outlived the timeout")
