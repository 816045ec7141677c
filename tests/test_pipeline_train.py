"""Pipeline parallelism in examples/train_gpt.py under mpiexec: end to end with checkpoints and a
resume, the sample equal to one process's, 3D and --amp runs, a batch too small to split and
bad input refused on every rank; and examples/bench_pipeline.py's schedules, refusals and model.
Each test's docstring gives the command to run it by hand.
"""
import json

import numpy as np
import pytest

from minidist.nn import GPTConfig
from minidist.strategy import checkpoint
from minidist.train.args import train_parser
from minidist.strategy.base import SingleProcess
from mpirun import logged_losses, tagged_json
from tests.pipeline_cases import _parse


TINY = ["--n-layer", "2", "--n-head", "2", "--n-embd", "16", "--block-size", "16",
        "--batch-size", "8", "--lr", "1e-2", "--eval-iters", "2", "--log-every", "1",
        "--eval-every", "0", "--pp", "2", "--micro-batches", "4"]


@pytest.mark.mpi
def test_a_batch_too_small_to_split_is_said(corpus, tmp_path, mpi):
    """    mpiexec -n 2 python examples/train_gpt.py --pp 2 --batch-size 5
    splits into 1 micro-batch (5 has no divisor from 2 to 4): the stages wait for each other
    the whole step. First-use walk 35 found it said only as "1 micro-batches"."""
    flags = [a for a in TINY if a not in ("--micro-batches", "4")]
    flags[flags.index("--batch-size") + 1] = "5"
    out = mpi(2, "examples/train_gpt.py", *flags, "--data", corpus, "--cache-dir",
              tmp_path / "cache", "--steps", "1", "--sample", "0", timeout=120).stdout
    assert "1f1b over 1 micro-batch; rank 0" in out, out
    assert "; note: fewer micro-batches than stages, so a stage waits while the others " \
        "compute (most of the step a bubble): give --micro-batches M" in out, out


@pytest.mark.mpi
def test_train_gpt_pp2_end_to_end_with_resume(corpus, tmp_path, mpi):
    """train_gpt --pp 2: summary lines, a trace with every micro-batch, a sample through the
    pipeline; a checkpoint that one process loads, and a resume that repeats the straight run
    (with dropout: every stage's own generator is saved and restored):

        mpiexec -n 2 python examples/train_gpt.py --pp 2 --micro-batches 4 --trace t.json ...
    """
    common = [*TINY, "--data", corpus, "--cache-dir", tmp_path / "cache", "--steps", "6",
              "--dropout", "0.1"]                # each stage's dropout stream is resumed
    straight, resumed, t = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "t.json"
    out = mpi(2, "examples/train_gpt.py", *common, "--log-json", straight, "--trace", t,
              "--sample", "20", timeout=120)
    assert "micro-batches in flight per stage [2, 1]" in out.stdout
    assert "vs theory 0.20" in out.stdout and "---- sample" in out.stdout
    events = [e for e in json.load(open(t))["traceEvents"] if e.get("ph") == "X"]
    assert {e["name"] for e in events if e["pid"] == 1} >= {f"F{i}" for i in range(4)}
    mpi(2, "examples/train_gpt.py", *common, "--save", tmp_path / "ck", "--stop-at", "3",
        "--sample", "0", "--schedule", "gpipe", timeout=120)
    # the schedule flags left out: this run's defaults (1f1b), and the log names the
    # checkpoint's (they changed silently); the numbers are the same either way
    out = mpi(2, "examples/train_gpt.py", *common, "--resume", tmp_path / "ck", "--log-json",
              resumed, "--sample", "0", timeout=120).stdout
    assert "; note: the checkpoint's run had --schedule gpipe (the same numbers under any " \
        "schedule" in out and "pipeline (1f1b, pp 2, 4 micro-batches)" in out, out
    assert logged_losses(resumed)[:3] == logged_losses(straight)[3:6]
    _check_resumed_schedule(tmp_path / "ck")
    state = checkpoint.load(tmp_path / "ck")[2]          # plain dicts: (params, opt, meta)
    one = SingleProcess()                   # the whole model, in the one-process format
    model = one.build_model(GPTConfig(**state["config"]), 0, "float32")
    opt = one.build_optimizer(model, _parse("--lr", "1e-2"))
    assert checkpoint.load_checkpoint(tmp_path / "ck", model, opt)["step"] == 3


def _check_resumed_schedule(ck):
    """--resume ck (a --pp 2 --schedule gpipe --micro-batches 4 --batch-size 8 run) takes no
    schedule flag (a taken one could be refused beside this run's others: zb-h1 with
    --ckpt-activations, a count that no longer divides the batch), and names those that
    differ under the same --pp only."""
    from minidist.train.cli import check_flags
    from minidist.train.inputs import schedule_differences

    def resumed(*flags):
        args = train_parser().parse_args(["--resume", str(ck), "--batch-size", "8", *flags])
        check_flags(args)
        saved = checkpoint.saved_model(str(ck))[3]
        return (args.schedule, args.micro_batches), schedule_differences(args, saved)
    assert resumed("--pp", "2") == (("1f1b", None), ["--schedule gpipe", "--micro-batches 4"])
    assert resumed("--pp", "2", "--schedule", "gpipe", "--micro-batches", "4") == \
        (("gpipe", 4), [])
    assert resumed("--pp", "2", "--ckpt-activations", "--schedule", "zb-h1")[1] == \
        ["--schedule gpipe", "--micro-batches 4"]
    assert resumed("--pp", "4")[1] == [] and resumed()[1] == []   # another pipeline: none


@pytest.mark.mpi
def test_pipeline_sample_equals_one_process(corpus, tmp_path, mpi):
    """generate through 2 stages (forward over the pipeline, the last stage samples and
    broadcasts) writes the very sample one process writes after the same float64 training:

        mpiexec -n 2 python examples/train_gpt.py --pp 2 --dtype float64 --sample 40 ...
    """
    pp = TINY.index("--pp")
    assert TINY[pp:pp + 4] == ["--pp", "2", "--micro-batches", "4"]
    flags = [*TINY[:pp], *TINY[pp + 4:], "--data", corpus, "--cache-dir", tmp_path / "cache",
             "--steps", "2", "--dtype", "float64", "--sample", "40"]
    one = mpi(1, "examples/train_gpt.py", *flags, timeout=120).stdout
    two = mpi(2, "examples/train_gpt.py", *flags, *TINY[pp:pp + 4], timeout=120).stdout

    def sample(out):
        return out[out.index("---- sample"):out.rindex("----------------")]
    assert "---- sample" in two and sample(two) == sample(one)


@pytest.mark.mpi
def test_bad_input_is_refused_on_every_rank(mpi):
    """No collective is reached, so nothing hangs; one `error:` line (rank 0's), exit 2, no
    traceback:

        mpiexec -n 2 python examples/train_gpt.py --pp 2 --n-layer 1
        mpiexec -n 2 python examples/train_gpt.py --pp 2 --micro-batches 3
        mpiexec -n 2 python examples/train_gpt.py --pp 2 --pp-virtual 2 --micro-batches 1
    """
    for flags, says in ((["--n-layer", "1"], "--pp 2 stages for --n-layer 1 blocks"),
                        (["--micro-batches", "3"], "--micro-batches 3 = 3 equal"),
                        (["--pp-virtual", "2", "--micro-batches", "1"],
                         "--micro-batches 1 must be a multiple of --pp 2")):
        out = mpi(2, "examples/train_gpt.py", "--pp", "2", *flags, timeout=60,
                  check=False)
        assert out.returncode == 2 and "Traceback" not in out.stderr
        assert out.stderr.count(says) == 1 and out.stderr.startswith("error: "), out.stderr


@pytest.mark.mpi
def test_train_gpt_3d_trains(corpus, tmp_path, mpi):
    """The issue's headline, small: dp 2 x tp 2 x pp 2 through train_gpt on 8 ranks, the loss
    falls, one line per step from rank 0, the sample runs through the first replica:

        mpiexec -n 8 python examples/train_gpt.py --dp 2 --tp 2 --pp 2 --data CORPUS ...
    """
    log = tmp_path / "log.jsonl"
    out = mpi(8, "examples/train_gpt.py", *TINY, "--dp", "2", "--tp", "2", "--micro-batches",
              "2", "--data", corpus, "--cache-dir", tmp_path / "cache", "--steps", "8",
              "--log-json", log, "--sample", "20", timeout=240)
    rows = [row for row in map(json.loads, open(log)) if "loss" in row]
    assert len(rows) == 8 and rows[-1]["loss"] < rows[0]["loss"]
    assert "pp 2 x tp 2 x dp 2, 1f1b over 2 micro-batches" in out.stdout
    assert out.stdout.count("step     1/") == 1 and "---- sample" in out.stdout


@pytest.mark.mpi
def test_train_gpt_pp2_amp(mpi):
    """Mixed precision through the pipeline (1F1B, interleaved, ZB-H1): the last stage scales
    the loss, every stage's overflow check sees the global norm; float16 activations cross
    the boundary; an overflow in the tied head's gradient skips the step on both stages:

        mpiexec -n 2 python tests/scripts/pp_check.py --amp
    """
    out = mpi(2, "tests/scripts/pp_check.py", "--amp", timeout=120)
    rows = tagged_json(out, "AMP")                 # 1F1B, interleaved, ZB-H1
    assert len(rows) == 3
    for r in rows:
        assert r["boundary_dtype"] == "float16" and r["loss_diff"] < 1e-2, r
    # an inf in the last stage's wte gradient at step 1: skipped on both stages, NaN norm,
    # and the clip's inf - inf (its tied copy left out) prints no RuntimeWarning
    ranks = tagged_json(out, "OVERFLOW")[0]
    assert len(ranks) == 2
    for r in ranks:
        assert r["skipped"] == 1 and r["scale"] == 2048.0, r
        assert np.isnan(r["norms"][1]) and np.isfinite([r["norms"][0], r["norms"][2]]).all(), r
        assert r["warnings"] == [], r


BENCH_SMALL = ["--n-layer", "2", "--n-embd", "64", "--steps", "1", "--batch-size", "8"]


@pytest.mark.mpi
def test_bench_pipeline_skips_default_schedules_the_model_cannot_run(mpi):
    """The default --schedules and --micro-batches on a 2-block model over 2 stages: 1f1b-v2
    (4 chunks) and M = 16 (of 8 rows) are skipped, one note each on stderr; stdout stays JSON.

        mpiexec -n 2 python examples/bench_pipeline.py --n-layer 2 --n-embd 64 --steps 1 \\
            --batch-size 8
    """
    out = mpi(2, "examples/bench_pipeline.py", *BENCH_SMALL, timeout=120)
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert {(r["schedule"], r["virtual"]) for r in rows} == {("gpipe", 1), ("1f1b", 1),
                                                            ("zb-h1", 1)}
    assert sorted({r["micro_batches"] for r in rows}) == [1, 2, 4, 8]
    notes = out.stderr.splitlines()
    assert len(notes) == 2 and all(n.startswith("note: skipped ") for n in notes), out.stderr
    assert "1f1b-v2" in notes[1] and "4 chunks for --n-layer 2 blocks" in notes[1]


@pytest.mark.mpi
@pytest.mark.parametrize("flags, says", [
    (["--schedules", "gpipe,1f1b-v2"], "--schedules 1f1b-v2: "),
    (["--schedules", "foo"], "--schedules 'foo': "),
    (["--micro-batches", "3"], "--micro-batches 3 = 3 equal"),
    (["--micro-batches", "x"], "--micro-batches x: "),
    (["--steps", "0"], "--steps 0: "),
])
def test_bench_pipeline_refuses_what_cannot_run_before_running(mpi, flags, says):
    """A schedule or M asked for that the model cannot run: one `error:` line before any row,
    exit 2, no traceback (was: rows, then a UsageError and MPI_Abort).

        mpiexec -n 2 python examples/bench_pipeline.py --n-layer 2 --schedules gpipe,1f1b-v2
    """
    out = mpi(2, "examples/bench_pipeline.py", *BENCH_SMALL, *flags, timeout=60, check=False)
    assert out.returncode == 2 and out.stdout == "" and "Traceback" not in out.stderr
    assert out.stderr.startswith("error: ") and out.stderr.count("error:") == 1, out.stderr
    assert says in out.stderr, out.stderr


def test_bench_pipeline_on_one_process_says_to_use_mpiexec():
    """python examples/bench_pipeline.py: one stage is no pipeline; one `error:` line, exit 2."""
    import subprocess
    import sys
    from mpirun import ROOT
    out = subprocess.run([sys.executable, "examples/bench_pipeline.py", *BENCH_SMALL],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.startswith("error: one process:") and out.stderr.count("\n") == 1


@pytest.mark.mpi
def test_bench_pipeline_runs_the_model_its_flags_describe(mpi):
    """--dtype float64 holds twice float32's activations per micro-batch (the flag was
    accepted and ignored: every run was float32, dropout 0, dense); --device cuda, which the
    host-clock timing cannot serve, is one error line.

        mpiexec -n 2 python examples/bench_pipeline.py --n-layer 2 --n-embd 64 --steps 1 \\
            --batch-size 8 --schedules 1f1b --micro-batches 2 --dtype float64
    """
    one = ["--schedules", "1f1b", "--micro-batches", "2"]
    mib = {}
    for dtype in ("float32", "float64"):
        out = mpi(2, "examples/bench_pipeline.py", *BENCH_SMALL, *one, "--dtype", dtype,
                  timeout=120)
        (row,) = [json.loads(line) for line in out.stdout.splitlines()]
        mib[dtype] = row["mib_per_micro"]
    assert all(d == pytest.approx(2 * s, rel=0.02) for s, d in zip(mib["float32"],
                                                                  mib["float64"])), mib
    import subprocess
    import sys
    from mpirun import ROOT
    out = subprocess.run([sys.executable, "examples/bench_pipeline.py", *BENCH_SMALL,
                          "--device", "cuda"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and out.stderr.startswith("error: --device cuda: this "
                                                         "benchmark times the stages")
