"""The benchmarks' flag checks and output (the examples' bench_*.py and calibrate_here.py):
a bad flag is one `error:` line naming it, from rank 0 only, exit status 2, before any work
or collective, with no traceback and no MPI_Abort; stdout is JSON lines, the tables go to
stderr; a failed child run is reported, not shown as a blank.

    python -m pytest -q tests/test_bench_flags.py
    mpiexec -n 2 python examples/bench_collectives.py --factor 1     # one of them by hand
"""
import json
import os
import re
import subprocess
import sys

import pytest

from mpirun import ROOT, mpi_env

EXAMPLES = os.path.join(ROOT, "examples")

# (script, flags, what the error line must name); one process each
ONE_PROCESS = [
    ("bench_step.py", ["--steps", "0"], "--steps"),
    ("bench_step.py", ["--steps", "-1"], "--steps"),
    ("bench_step.py", ["--warmup", "-1"], "--warmup"),
    ("bench_step.py", ["--batch-size", "0"], "--batch-size"),
    ("bench_step.py", ["--n-head", "3", "--n-embd", "32"], "n_head"),
    ("bench_step.py", ["--block-size", "0"], "--block-size"),
    ("bench_step.py", ["--n-layer", "0"], "--n-layer"),
    ("bench_step.py", ["--dropout", "1.5"], "--dropout"),
    ("bench_step.py", ["--threads", "-2"], "--threads"),
    ("bench_step.py", ["--peak-tflops", "-5"], "--peak-tflops"),
    ("bench_step.py", ["--seed", "-1"], "--seed -1: must be at least 0"),   # numpy's traceback
    ("bench_step.py", ["--peak-tflops", "0"], "--peak-tflops"),
    ("bench_plan.py", ["--cases", "99"], "--cases"),
    ("bench_plan.py", ["--cases", "x"], "--cases"),
    ("bench_plan.py", ["--calibration", "/nonexistent"], "--calibration"),
    ("bench_plan.py", ["--repeats", "0"], "--repeats"),
    ("bench_plan.py", ["--steps", "2", "--skip", "2"], "--skip"),
    ("bench_plan.py", ["--steps", "4", "--skip", "2", "--reference"], "--steps"),
    ("bench_polling.py", ["--ranks", "1"], "--ranks"),
    ("bench_polling.py", ["--sizes", "2"], "--sizes"),
    ("bench_polling.py", ["--repeats", "0"], "--repeats"),
    ("bench_resume_memory.py", ["--n-layer", "2", "--n-embd", "64", "--n-head", "2",
                                "--scenario", "tp"], "--n-head"),
    ("calibrate_here.py", ["--ranks", "1,2"], "--ranks"),
    # first-use walk, session 35: a traceback after the measuring (a minute), not before it
    ("calibrate_here.py", ["--out", "examples"], "--out examples: is a folder"),
    # review 38: tracebacks, --seq 1024 0 after measuring T = 1024 first
    ("attention_memory.py", ["--seq", "1024", "0"], "--seq 0"),
    ("attention_memory.py", ["--attention-block", "0"], "--attention-block"),
    ("attention_memory.py", ["--n-head", "3", "--n-embd", "10"], "n_head"),
    ("attention_memory.py", ["--batch-size", "0"], "--batch-size"),
    ("attention_memory.py", ["--max-gib", "nan"], "--max-gib nan"),    # (allocated 16 GiB)
    ("plot.py", ["--bogus", "-o", "x.png"], "--bogus"),        # (argparse's usage block)
    ("ddp_timeline.py", [], "trace"),
    ("bench_collectives.py", [], "mpiexec -n"),          # one process: no collective
    ("bench_zero.py", [], "mpirun -n"),
]

# (script, flags, what the error line must name); under mpiexec -n 2
TWO_RANKS = [
    ("bench_collectives.py", ["--factor", "1"], "--factor"),
    ("bench_collectives.py", ["--factor", "0"], "--factor"),
    ("bench_collectives.py", ["--min-bytes", "0"], "--min-bytes"),
    ("bench_collectives.py", ["--repeats", "0"], "--repeats"),
    ("bench_collectives.py", ["--iters", "-1"], "--iters"),
    ("bench_collectives.py", ["--min-bytes", "8M", "--max-bytes", "1M"], "--max-bytes"),
    ("bench_collectives.py", ["--min-bytes", "3", "--max-bytes", "3"], "--min-bytes"),
    ("bench_collectives.py", ["--algos", "foo"], "--algos"),
    ("bench_collectives.py", ["--algos", "nothing.py"], "--algos nothing.py: no such file"),
    ("bench_collectives.py", ["--algos", "examples/recursive_doubling.py"],  # all_reduce only
     "it has no reduce_scatter(ch, ...), which --ops reduce_scatter times"),
    ("bench_collectives.py", ["--ops", "foo"], "--ops"),
    ("bench_collectives.py", ["--dtype", "int7"], "--dtype"),
    ("bench_collectives.py", ["--trace", "examples"], "--trace examples: is a folder"),
    ("bench_ddp.py", ["--steps", "0"], "--steps"),
    ("bench_ddp.py", ["--rounds", "0"], "--rounds"),
    ("bench_ddp.py", ["--modes", "foo"], "--modes"),
    ("bench_ddp.py", ["--batch-size", "3"], "--batch-size"),
    ("bench_ddp.py", ["--bucket-mb", "-1"], "--bucket-mb"),
    ("bench_ddp.py", ["--bucket-mb", "0"], "--bucket-mb"),
    ("bench_zero.py", ["--stages", "0", "--steps", "0"], "--steps"),
    ("bench_zero.py", ["--comm", "foo"], "--comm"),
    ("bench_zero.py", ["--batch-size", "3"], "--batch-size"),
]


def assert_one_error_line(out, names):
    """Exit status 2, one `error:` line on stderr naming `names`, nothing on stdout, no
    traceback and no MPI abort anywhere."""
    both = out.stdout + out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert out.returncode == 2, both
    assert len(errors) == 1 and names in errors[0], both
    assert out.stdout == "", both
    assert "Traceback" not in both and "MPI_Abort" not in both and "Abort(" not in both, both


@pytest.mark.parametrize("script,flags,names", ONE_PROCESS,
                         ids=[f"{s}{''.join(f)}" for s, f, _ in ONE_PROCESS])
def test_a_bad_flag_is_one_error_line(script, flags, names):
    out = subprocess.run([sys.executable, os.path.join(EXAMPLES, script), *flags], cwd=ROOT,
                         env=mpi_env(), capture_output=True, text=True, timeout=60)
    assert_one_error_line(out, names)


@pytest.mark.mpi
@pytest.mark.parametrize("script,flags,names", TWO_RANKS,
                         ids=[f"{s}{''.join(f)}" for s, f, _ in TWO_RANKS])
def test_a_bad_flag_under_mpiexec_is_one_error_line_from_rank_0(mpi, script, flags, names):
    """mpiexec -n 2 python examples/bench_collectives.py --factor 1 (and the others): every
    rank finds it before MPI starts, rank 0 alone prints it, every rank exits 2."""
    out = mpi(2, f"examples/{script}", *flags, timeout=60, check=False)
    assert_one_error_line(out, names)


@pytest.mark.mpi
def test_bench_zero_prints_json_lines_and_its_tables_on_stderr(mpi):
    """mpiexec -n 2 python examples/bench_zero.py --n-layer 1 --n-embd 32 --n-head 2
    --block-size 16 --batch-size 2 --steps 1: a JSON line per stage on stdout, the markdown
    tables of the same figures on stderr (minidist/zero/README.md quotes them)."""
    out = mpi(2, "examples/bench_zero.py", "--n-layer", "1", "--n-embd", "32", "--n-head",
              "2", "--block-size", "16", "--batch-size", "2", "--steps", "1", timeout=120)
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert [r["stage"] for r in rows] == [0, 1, 2, 3]
    for r in rows:
        states = r["measured_mib"]["model_states"]
        assert r["predicted_mib"]["model_states"] == pytest.approx(states, rel=0.01), r
        cells = f"{r['predicted_mib']['model_states']:.3f} / {states:.3f}"
        assert f"| {r['stage'] or 'DDP'} | " in out.stderr and cells in out.stderr, r
    assert rows[0]["sent_vs_ddp"] == 1.0 and rows[3]["paper_x_psi"] == 1.5
    assert "| stage | params | grads | optimizer |" in out.stderr


@pytest.mark.mpi
def test_bench_ddp_prints_a_json_line_per_mode(mpi):
    """mpiexec -n 2 python examples/bench_ddp.py --n-layer 1 --n-embd 32 --n-head 2
    --block-size 16 --batch-size 2 --steps 1 --rounds 1 --warmup 1: one JSON line per DDP
    mode. It stopped on every rank with AttributeError: 'Namespace' object has no attribute
    'beta1' once the optimizer took --beta1/--beta2 (it set the training's flags one by
    one; now train_gpt.py's defaults: first-use walk, session 35)."""
    out = mpi(2, "examples/bench_ddp.py", "--n-layer", "1", "--n-embd", "32", "--n-head", "2",
              "--block-size", "16", "--batch-size", "2", "--steps", "1", "--rounds", "1",
              "--warmup", "1", timeout=120)
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert [r["mode"] for r in rows] == ["naive", "bucketed", "overlapped"], out.stdout
    assert all(r["ranks"] == 2 and r["tokens_per_s"] > 0 for r in rows), rows


def test_bench_polling_prints_json_lines_and_says_which_runs_failed(monkeypatch):
    """python examples/bench_polling.py --ranks 2 --sizes 4K --repeats 1 (about 8 s here): a
    JSON line per setting and size, the table on stderr; a run that fails carries its error
    line and exit status, and its cell says "failed (rc N)" where it showed `-` (the thread
    level single settings failed so, silently, before minidist refused them)."""
    out = subprocess.run([sys.executable, "examples/bench_polling.py", "--ranks", "2",
                          "--sizes", "4K", "--repeats", "1"], cwd=ROOT, env=mpi_env(),
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert len(rows) == 7 and all(r["bytes"] == 4096 and r["ranks"] == 2 for r in rows)
    assert all(r["ring_busbw_GBps"] > 0 and r["mpi_busbw_GBps"] > 0 for r in rows), rows
    assert not re.search(r" -( |$)", out.stderr, re.M), out.stderr     # no silent blank
    monkeypatch.syspath_prepend(EXAMPLES)
    import bench_polling
    said = bench_polling.failure_line("Traceback ...\nerror: X=1: no\n", "")
    assert said == "error: X=1: no"
    assert bench_polling.cell({"error": said, "rc": 2}, "ring") == "failed (rc 2)"
    assert bench_polling.cell({"error": "timed out", "rc": None}, "mpi") == "timed out"
    assert bench_polling.cell(None, "ring") == "not run"


def test_bench_plan_table_goes_to_stderr_numbered_with_both_errors(capsys, monkeypatch):
    """bench_plan.py's table: each case's number (what --cases takes), the error against
    the fastest and the median step, and a blank reference cell without --reference."""
    monkeypatch.syspath_prepend(EXAMPLES)
    import bench_plan
    row = {"index": 7, "case": "TP4", "ranks": 4, "reference_ms": None, "measured_ms": 100.0,
           "median_ms": 125.0, "slowest_ms": 150.0, "predicted_ms": 110.0, "error": 0.1,
           "error_median": -0.12, "load_1min": [0.5, 0.6],
           "predicted_from_calibration_ms": 90.0}
    bench_plan.table([row])
    out = capsys.readouterr()
    assert out.out == ""
    assert "| 7 | TP4 | 4 | 100 (125, 150) | 110 | +10% (-12%) | 0.5 |  | 90 |  |" in out.err


def test_calibration_divides_the_fastest_step_by_the_fastest_matmul(monkeypatch):
    """calibrate_here.py's compute efficiency: best-of over best-of (bench_step's ms_min
    over its matmul_gflops_max), not the fastest step over the median matmul, which read
    high under load; peak_tflops is that fastest matmul's rate."""
    monkeypatch.syspath_prepend(EXAMPLES)
    import calibrate_here
    from minidist.nn import GPTConfig
    from minidist.train.cost import forward_flops
    row = {"ms_min": 500.0, "matmul_gflops": 100.0, "matmul_gflops_max": 150.0}
    monkeypatch.setattr(calibrate_here, "run", lambda cmd, ranks=1: json.dumps(row))
    config = GPTConfig(**calibrate_here.MODEL, vocab_size=256)
    cal = calibrate_here.compute(config, 0.0)
    assert cal["peak_tflops"] == pytest.approx(0.15)
    flops = 3 * forward_flops(config, calibrate_here.BATCH, config.block_size)
    assert cal["efficiency"] == pytest.approx(flops / 0.5 / 150e9)
