"""The step-time model's calibration (minidist/train/cluster.py): a calibration file read back
for the ranks asked (the here cluster), bench_collectives' --interleave row (sync_s), the
efficiency by model width, what plan.py says it assumed and its --peak-tflops, and the
calibration and overlap flags checked, hand-edited files refused."""
import json
import math
import subprocess
import sys

import pytest

from minidist.train.cluster import Elementwise
from minidist.train.cost import step_time
from minidist.train.planner import Layout

from tests.plan_cases import TOY, plan_cli


def test_here_cluster_reads_the_calibration(tmp_path):
    """cluster_from_calibration: the link fit and the sync of the rank count nearest the
    asked one, the elementwise seconds as measured, ranks sharing the cores and the
    node's memory."""
    from minidist.train.cluster import cluster_from_calibration
    link = {"alpha": 1e-5, "bw": 1e9, "gamma": 0.0}
    cal = {"cores": 2, "mem_gib": 4.0, "peak_tflops": 0.1, "efficiency": 0.5, "overlap": 0.0,
           "opt_s_per_param": 1e-9, "links": {"2": link, "4": dict(link, alpha=7e-5)},
           "sync": {"2": {"sync_s": 1e-4}, "4": {"sync_s": 2e-3}},
           "replicated": dict(zip(("layer_f", "layer_b", "embed_f", "embed_b", "head_f",
                                   "head_b"), (1e-9, 2e-9, 3e-9, 4e-9, 5e-9, 6e-9)))}
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(cal))
    four = cluster_from_calibration(str(path), 4)
    assert four.intra.alpha == 7e-5 and four.sync_s == 2e-3 and four.compute_slots == 2
    assert four.replicated == Elementwise(1e-9, 2e-9, 3e-9, 4e-9, 5e-9, 6e-9)
    assert cluster_from_calibration(str(path), 2).sync_s == 1e-4
    # each rank's share of the node's memory (it was the whole node's for every rank: 4
    # ranks of 8.7 GiB "fit" in 11.8; first-use walk 18)
    assert (four.mem_gib, cluster_from_calibration(str(path), 2).mem_gib) == (1.0, 2.0)
    t = step_time(TOY, Layout(tp=4, amp=False), four, seq=2, global_batch=1)
    assert t["replicated"] > 0 and t["sync"] == pytest.approx((2 * 2 + 3 + 2 * 2 + 1) * 2e-3)


def test_bench_collectives_interleave_row(mpi):
    """--interleave: compute alone, the all-reduce alone, both in turn, and sync_s, the cost of
    the blocking all-reduce beyond the two timed apart (BENCHMARKS: where TP4's step goes).

        mpiexec -n 2 python examples/bench_collectives.py --interleave --max-bytes 64K \
            --repeats 1
    """
    out = mpi(2, "examples/bench_collectives.py", "--interleave", "--max-bytes", "64K",
              "--repeats", "1", timeout=120)
    row = json.loads(out.stdout.strip().splitlines()[-1])
    assert row["ranks"] == 2 and row["bytes"] == 64 * 1024
    assert min(row["compute"], row["all_reduce"], row["interleaved"]) > 0
    assert row["sync_s"] == pytest.approx(row["interleaved"] - row["compute"]
                                          - row["all_reduce"], abs=1e-12)
    assert isinstance(row["sync_median_s"], float) and row["compute_iters"] >= 1


def test_efficiency_by_model_width():
    """A calibration with efficiencies at widths 128 and 256 gives 128's at 128, halfway (in
    log2) at 181, the nearest outside, and says which; one with a single figure warns."""
    from minidist.train.cluster import efficiency_for_width
    cal = {"efficiency": 0.5, "efficiency_by_width": {"128": 0.4, "256": 0.6}}
    assert efficiency_for_width(cal, 128) == (0.4, "measured at width 128")
    e, how = efficiency_for_width(cal, 181)
    assert e == pytest.approx(0.4 + 0.2 * (math.log2(181) - 7)) and "between" in how
    assert efficiency_for_width(cal, 1024)[0] == 0.6
    assert "outside" in efficiency_for_width(cal, 64)[1]
    assert "one model" in efficiency_for_width({"efficiency": 0.5}, 128)[1]


def test_the_plan_says_what_it_assumed_and_peaks_are_separate(capsys):
    """plan.py prints (and --json carries) the peaks, efficiency, overlap, links and sync it
    assumed; --peak-tflops is the 16-bit peak only (it was also float32's: restating 989 made
    --fp32 15x faster), --peak-tflops-fp32 the other; --overlap changes the overlap."""
    cli = plan_cli()
    base = ["--params", "1.3e9", "--seq", "2048", "--global-batch", "256", "--gpus", "64",
            "--fp32", "--layout", "dp=64,zero=1", "--json"]

    def run(*extra):
        cli.main(base + list(extra))
        return json.loads(capsys.readouterr().out)
    plain, restated = run(), run("--peak-tflops", "989")
    assert plain["assumed"]["peak_tflops_fp32"] == 67 and plain["assumed"]["overlap"] == 1
    assert restated["rows"][0]["step"] == pytest.approx(plain["rows"][0]["step"])
    faster = run("--peak-tflops-fp32", "134")
    assert faster["rows"][0]["compute"] == pytest.approx(plain["rows"][0]["compute"] / 2)
    assert run("--overlap", "0.5")["assumed"]["overlap"] == 0.5
    cli.main(base[:-1])
    out = capsys.readouterr().out
    assert "assumed: 989 TFLOP/s" not in out and "assumed: 67 TFLOP/s (float32" in out
    assert "never measured by minidist on a GPU" in out


@pytest.mark.parametrize("flags, says", [
    (["--calibration", "/nonexistent.json", "--preset", "here"],
     "--calibration /nonexistent.json: no such file"),
    (["--calibration", "examples/calibration_here.json"], "only with --preset here"),
    (["--calibration", "README.md", "--preset", "here"], "not a calibration"),
    (["--overlap", "1.5"], "--overlap 1.5:"),
    (["--calibration", "", "--preset", "here"], "--calibration : no such file"),
])
def test_plan_calibration_and_overlap_flags_are_checked(flags, says):
    out = subprocess.run([sys.executable, "examples/plan.py", "--n-layer", "2", "--gpus", "2",
                          *flags], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and says in out.stderr, out.stderr
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr


def test_hand_edited_calibrations_are_refused_and_zeros_are_values(tmp_path, capsys):
    """First-use walk 34: cores 0 was a ZeroDivisionError, a text efficiency a TypeError, a
    negative peak negative step times; --overlap 0 (the calibration's own value) was refused
    and --intra-lat 0 silently ignored."""
    from minidist.train.cluster import calibration_problem
    good = json.load(open("examples/calibration_here.json"))
    assert calibration_problem(good) is None
    for key, value in (("cores", 0), ("efficiency", "0.5"), ("peak_tflops", -1.0),
                       ("overlap", 2.0)):
        assert key in calibration_problem({**good, key: value})
    bad = tmp_path / "cal.json"
    bad.write_text(json.dumps({**good, "cores": 0}))
    out = subprocess.run([sys.executable, "examples/plan.py", "--preset", "here",
                          "--calibration", str(bad), "--n-layer", "2", "--gpus", "2"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "cores: not a positive number" in out.stderr
    assert "Traceback" not in out.stderr
    cli = plan_cli()
    cli.main(["--params", "1e9", "--gpus", "16", "--overlap", "0", "--intra-lat", "0",
                   "--inter-lat", "0", "--json"])
    assumed = json.loads(capsys.readouterr().out)["assumed"]
    assert (assumed["overlap"], assumed["intra_us"], assumed["inter_us"]) == (0, 0, 0)
