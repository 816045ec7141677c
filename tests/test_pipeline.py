"""Pipeline parallelism: the stage split, the schedules on a logical clock (bubbles equal to
bubble_fraction's formulas), bad input refused in-process; then 2, 4 and 8 ranks under mpiexec
against one process in float64 (pp 2 and pp 4 with several micro-batch counts and the four
schedules: GPipe, 1F1B, interleaved 1F1B, ZB-H1; pp 2 x dp 2, dp 2 x tp 2 x pp 2) and the
VERBOSE log. train_gpt end to end and examples/bench_pipeline.py:
tests/test_pipeline_train.py.

The distributed checks run tests/scripts/pp_check.py, which batches many comparisons into one
mpiexec start; each test's docstring gives the command to run it by hand.
"""
import os
import sys

import pytest

from minidist.pp.schedule import bubble_fraction, chunk_layers, peak_in_flight, split_layers
from minidist.pp.simulate import simulate, timeline
from minidist.pp.strategy import default_micro_batches
from minidist.train.strategy import check_layout
from minidist.train.cli import UsageError
from mpirun import ROOT, mpiexec, run_job, tagged_json, within
from tests.pipeline_cases import _parse


TOL = 1e-10


def test_split_layers_contiguous_balanced_and_refuses_empty_stages():
    assert split_layers(4, 2) == [range(0, 2), range(2, 4)]
    assert split_layers(7, 3) == [range(0, 3), range(3, 5), range(5, 7)]
    assert split_layers(4, 4) == [range(i, i + 1) for i in range(4)]
    with pytest.raises(ValueError, match="5 stages for 4 blocks"):
        split_layers(4, 5)


def test_default_micro_batches_divide_the_rows():
    assert default_micro_batches(8, 2) == 4
    assert default_micro_batches(6, 4) == 6
    assert default_micro_batches(7, 2) == 1


def test_chunk_layers_round_robin():
    assert chunk_layers(8, 2, 2, 0) == [range(0, 2), range(4, 6)]
    assert chunk_layers(8, 2, 2, 1) == [range(2, 4), range(6, 8)]
    assert chunk_layers(4, 2, 1, 1) == [range(2, 4)]


@pytest.mark.parametrize("p, m", [(2, 1), (2, 4), (4, 4), (4, 8), (3, 5), (3, 6)])
def test_simulated_schedules(p, m):
    """The training code's own schedule functions on a logical clock (forward 1 unit, a
    whole backward 2, B and W 1 each): GPipe holds m micro-batches on every stage, 1F1B
    min(p - s, m) on stage s, ZB-H1 min(p, m) on every stage (1F1B's first stage's peak),
    interleaved 1F1B Megatron's warmup + 1 chunk-micro-batches; every micro-batch's
    backward (or its W) comes in micro-batch order on each chunk."""
    for name, v in (("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("1f1b", 2), ("1f1b", 3)):
        if v > 1 and m % p:
            continue
        steps = simulate(name, p, m, v)
        held = [s.peak_in_flight for s in steps]
        want = {"gpipe": [m] * p, "1f1b": [min(p - s, m) for s in range(p)],
                "zb-h1": [min(p, m)] * p}[name]
        if v > 1:
            want = [min((p - s - 1) * 2 + (v - 1) * p + 1, m * v) for s in range(p)]
        assert held == want, (name, v, held)
        assert held == [peak_in_flight(name, p, s, m, v) for s in range(p)]   # the planner's
        for s in steps:
            for c in range(v):
                done = [i for k, i, _, chunk in s.events if k in "BW" and chunk == c]
                assert done == list(range(m)), (name, v, c, done)


def test_the_chapters_pictures_are_the_simulators():
    """minidist/pp/README.md's four timelines (p = 4, m = 8: GPipe, 1F1B, interleaved 1F1B
    with v = 2 and its chunk rows, ZB-H1), and the bubble and micro-batches held written
    above each, are the simulator's, character for character:

        python -m minidist.pp.simulate
    """
    text = open(f"{ROOT}/minidist/pp/README.md").read()
    for name, v in (("gpipe", 1), ("1f1b", 1), ("1f1b", 2), ("zb-h1", 1)):
        steps = simulate(name, 4, 8, v)
        rows, bubbles = timeline(steps, chunks=v > 1)
        assert "\n".join(rows) + "\n" in text, (name, v, rows)
        assert len({f"{b:.3f}" for b in bubbles}) == 1, bubbles
        said = (f"bubble {bubbles[0]:.3f} on every stage; holds "
                + ", ".join(str(s.peak_in_flight) for s in steps))
        assert said in text, said


@pytest.mark.parametrize("times", [(1, 1, 1), (1, 2, 1), (2, 2, 1), (2, 3, 2)])
def test_simulated_bubble_formulas(times):
    """Every schedule's simulated idle share equals bubble_fraction on every stage, for
    p = 2..5, m = 1..12 (multiples of p when interleaved) and several F/B/W times (t_w <
    t_f + t_b): the formulas the README and the benchmark quote are the schedules' own."""
    for p in (2, 3, 4, 5):
        for m in range(1, 13):
            for name, v in (("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("1f1b", 2),
                            ("1f1b", 3)):
                if v > 1 and m % p:
                    continue
                _, bubbles = timeline(simulate(name, p, m, v, *times))
                want = bubble_fraction(name, p, m, v, *times)
                assert max(abs(b - want) for b in bubbles) < 1e-12, (name, v, p, m, bubbles)


def test_simulate_draws_every_schedule(monkeypatch, capsys):
    """`python -m minidist.pp.simulate` prints the four timelines, each bubble next to its
    formula (equal on every stage)."""
    import sys
    from minidist.pp import simulate as sim
    monkeypatch.setattr(sys, "argv", ["simulate", "--stages", "3", "--micro-batches", "6"])
    sim.main()
    out = capsys.readouterr().out
    for title in ("GPipe:", "1F1B:", "interleaved 1F1B, v = 2:", "ZB-H1 (B and W split"):
        assert title in out
    assert out.count("stage 2 |") == 4 and out.count("  chunk |") == 3
    for line in out.splitlines():
        if "formula" in line:
            per_stage = line.split("bubble per stage ")[1].split(" (formula ")
            assert set(per_stage[0].split(", ")) == {per_stage[1][:5]}, line


@pytest.mark.parametrize("argv,says", [
    (["--stages", "0"], "--stages 0: must be at least 1"),
    (["--stages", "4", "--micro-batches", "3", "--virtual", "2"], "--virtual 2: "
     "--micro-batches 3 must be a multiple of --stages 4")])
def test_simulate_refuses_sizes_it_cannot_draw(argv, says):
    """    python -m minidist.pp.simulate --stages 4 --micro-batches 3 --virtual 2
    was a KeyError in a thread after two timelines (--stages 0: a ValueError from max()):
    now one usage error before any timeline."""
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "minidist.pp.simulate", *argv], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stdout == "" and says in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


def test_simulate_takes_any_stage_count_alone(monkeypatch, capsys):
    """python -m minidist.pp.simulate --stages 3: 2 x 3 micro-batches by default (training's
    default), so the interleaved timeline fits; a fixed 8 refused it, naming --virtual 2."""
    import sys
    from minidist.pp import simulate as sim
    monkeypatch.setattr(sys, "argv", ["simulate", "--stages", "3"])
    sim.main()
    out = capsys.readouterr().out
    assert "interleaved 1F1B, v = 2: p = 3, m = 6;" in out and out.count("stage 2 |") == 4


def test_bubble_formulas_compare():
    """Interleaving divides 1F1B's idle time by v; ZB-H1's is a third of it (equal times)."""
    p, m = 4, 8
    idle = {k: b / (1 - b) for k, b in (                  # idle time / busy time
        ("1f1b", bubble_fraction("1f1b", p, m)), ("v2", bubble_fraction("1f1b", p, m, 2)),
        ("zb", bubble_fraction("zb-h1", p, m)))}
    assert abs(idle["1f1b"] - (p - 1) / m) < 1e-12
    assert abs(idle["v2"] - (p - 1) / (2 * m)) < 1e-12
    assert abs(idle["zb"] - idle["1f1b"] / 3) < 1e-12
    with pytest.raises(ValueError, match="no bubble formula"):
        bubble_fraction("gpipe", p, m, 2)


def test_a_link_and_the_micro_batches_say_where_a_schedule_is_in_a_debugger():
    """`p link` and `p steps` in a debugger stopped in a schedule (one_f_one_b(link, steps))
    printed object addresses: one line each now, the stage and its neighbours' activation
    shape, the micro-batches in flight (first-use walk of 2026-11-30). A one-rank pipeline
    holding every block, one forward run."""
    import numpy as np
    from mpi4py import MPI
    from minidist.comm import ProcessGroup
    from minidist.nn import GPTConfig
    from minidist.pp.microbatches import MicroBatches
    from minidist.pp.stage import GPTStage
    config = GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=8, vocab_size=32)
    stage = GPTStage(config, ProcessGroup(MPI.COMM_SELF, name="pp"), range(2), 0, "float64")
    x = np.random.default_rng(0).integers(0, 32, (4, 8))
    steps = MicroBatches(stage, x, np.roll(x, -1, axis=1), 2, lambda loss: loss.backward())
    steps.forward(0, None)
    assert repr(steps) == "MicroBatches(2 of 2 rows, in flight [(0, 0)], peak 1, 1 loss(es) " \
        "at the head)", repr(steps)
    assert repr(stage.link) == "StageLink(stage 0 of 1, 1 chunk(s) a rank, 0 send(s) not " \
        "waited, activations None None)", repr(stage.link)


@pytest.mark.mpi
def test_stage_names_are_gpt2_names_with_global_block_numbers(mpi):
    """Two stages' parameters are exactly GPT's, split, the tied wte on both ends, with
    gpt_init's numbers (each stage built on its rank of a real pp group).

        mpiexec -n 2 python tests/scripts/pp_stages_check.py --n-layer 4"""
    out = mpi(2, "tests/scripts/pp_stages_check.py", "--n-layer", "4", timeout=120)
    said = tagged_json(out, "STAGES")[0]
    names = [st["names"] for st in said["stages"]]
    assert names[0][:2] == ["transformer.wte.weight", "transformer.wpe.weight"]
    assert names[0][2].startswith("transformer.h.0.")
    assert names[1][0].startswith("transformer.h.2.")
    assert names[1][-1] == "transformer.wte.weight" and "transformer.ln_f.weight" in names[1]
    assert set(names[0]) | set(names[1]) == set(said["full"])
    assert all(st["gpt_numbers"] for st in said["stages"])


# ---- bad input: refused in-process, before any communication ------------------------------

@pytest.mark.parametrize("world, flags, says", [
    (4, ["--pp", "4", "--n-layer", "2"], "--pp 4 stages for --n-layer 2 blocks"),
    (2, ["--pp", "2", "--micro-batches", "3", "--batch-size", "16"],
     "does not split into dp 1 x --grad-accum 1 x --micro-batches 3"),
    (4, ["--pp", "2", "--micro-batches", "4", "--batch-size", "12"],
     "dp 2 x --grad-accum 1 x --micro-batches 4 = 8"),
    # not given: the default count is named as such (it read as a --micro-batches 1 typed)
    (6, ["--pp", "2", "--dp", "3"], r"dp 3 x --grad-accum 1 x 1 micro-batches \(the "
     r"pipeline's default: give --micro-batches\) = 3"),
    (6, ["--pp", "4"], r"--pp 4 = 4 ranks per replica \(the processes are dp x 4\), but "
     "this job has 6"),
    (8, ["--pp", "2", "--tp", "2", "--dp", "3"], "= 12 ranks, but this job has 8"),
    (4, ["--pp", "2", "--tp", "2", "--n-head", "3", "--n-embd", "48"],
     "--n-head 3 is not divisible by --tp 2"),
    (2, ["--pp", "2", "--pp-virtual", "2", "--micro-batches", "3", "--batch-size", "12"],
     "--micro-batches 3 must be a multiple of --pp 2"),
    (2, ["--pp", "2", "--pp-virtual", "2", "--schedule", "gpipe"],
     "needs --schedule 1f1b [(]it interleaves 1F1B[)], not --schedule gpipe$"),
    (2, ["--pp", "2", "--pp-virtual", "0"], "--pp-virtual 0: must be at least 1$"),
    (2, ["--pp", "2", "--pp-virtual", "2", "--n-layer", "3"], "= 4 chunks for --n-layer 3"),
    (2, ["--pp", "2", "--schedule", "zb-h1", "--ckpt-activations"],
     "zb-h1 with --ckpt-activations"),
    (1, ["--micro-batches", "4"], "--grad-accum instead")])
def test_bad_sizes_are_refused_before_any_communication(world, flags, says):
    with pytest.raises(UsageError, match=says):
        check_layout(_parse(*flags), world)


# ---- N ranks under mpiexec ---------------------------------------------------------------

def _assert_exact(results, n):
    assert len(results) == n, results
    for r in results:
        assert within(r, TOL), r
        print(f"{r['run']:24s}: |loss diff| {r['loss_diff']:.1e}, |norm diff| "
              f"{r['norm_diff']:.1e}, |param diff| {r['param_diff']:.1e}; per stage "
              f"(in flight, activation bytes) {[tuple(s[1:]) for s in r['stages']]}")


@pytest.mark.mpi
def test_pp2_equals_one_process_every_schedule(mpi):
    """pp 2 with 1, 2 and 8 micro-batches: 1F1B, GPipe, interleaved 1F1B (v 2), ZB-H1, and
    --grad-accum 2; float64, clipping every step; the first run's and an interleaved run's
    checkpoints:

        mpiexec -n 2 python tests/scripts/pp_check.py
    """
    results = tagged_json(mpi(2, "tests/scripts/pp_check.py", timeout=120))
    _assert_exact(results, 11)
    by_run = {r["run"]: r for r in results}
    assert {r["schedule"] for r in results} == {"gpipe", "1f1b", "zb-h1"}
    assert [s[1] for s in by_run["pp2-m8-zbh1"]["stages"]] == [2, 2]     # min(p, m)
    assert [s[1] for s in by_run["pp2-m8-v2-1f1b"]["stages"]] == [5, 3]  # chunk-micro-batches


@pytest.mark.mpi
def test_pp4_and_pp2_x_dp2_equal_one_process(mpi):
    """pp 4 (2 and 8 micro-batches, 1F1B, GPipe, ZB-H1), pp 2 x dp 2 (1F1B, also with
    --grad-accum 2: DDP's no_sync nests the pipeline's inside the accumulation's; GPipe +
    checkpointing; interleaved + checkpointing; ZB-H1; the last two with 16 KiB DDP
    buckets); 1F1B's first stage holds pp of GPipe's m micro-batches, in measured activation
    bytes; ZB-H1 holds p micro-batches on every stage (1F1B's first stage's count; the first
    stage's bytes exactly), each costing at most what it costs under 1F1B; every DDP bucket's
    all-reduce starts in the last micro-batch's backward (its W under ZB-H1), none waits
    for sync_grads:

        mpiexec -n 4 python tests/scripts/pp_check.py
    """
    results = tagged_json(mpi(4, "tests/scripts/pp_check.py", timeout=180))
    _assert_exact(results, 9)
    by_run = {r["run"]: r for r in results}
    for r in results:
        if r["dp"] > 1:
            assert r["in_backward"] == r["buckets"], r
    assert by_run["pp2-dp2-m4-zbh1-b16k"]["buckets"] > 2
    one, gp = by_run["pp4-m8-1f1b"]["stages"], by_run["pp4-m8-gpipe"]["stages"]
    assert [s[1] for s in one] == [4, 3, 2, 1] and [s[1] for s in gp] == [8] * 4
    assert abs(one[0][2] / gp[0][2] - 4 / 8) < 0.02        # bytes scale with micro-batches
    zb = by_run["pp4-m8-zbh1"]["stages"]
    assert [s[1] for s in zb] == [4, 4, 4, 4] and zb[0][2] == one[0][2]
    for z, o in zip(zb, one):        # a micro-batch waiting for its W costs at most 1F1B's
        assert z[2] / z[1] <= o[2] / o[1], (z, o)
    # stage s holds p - s micro-batches waiting for B (1F1B's bytes each) and s for W: the
    # middle stages (one block each) hold one W-waiting cost, whatever s
    waiting_w = [(zb[s][2] - (4 - s) * one[s][2] / one[s][1]) / s for s in (1, 2)]
    assert waiting_w[0] == waiting_w[1] < one[1][2] / one[1][1], (zb, one)


@pytest.mark.mpi
@pytest.mark.slow
def test_pp4_interleaved_and_zb_h1_on_8_layers(mpi):
    """pp 4 x --pp-virtual 2 needs 8 blocks (8 chunks); ZB-H1 with m = pp:

        mpiexec -n 4 python tests/scripts/pp_check.py --n-layer 8 \
            --runs pp4-m8-v2-1f1b,pp4-m4-v2-1f1b,pp4-m4-zbh1
    """
    out = mpi(4, "tests/scripts/pp_check.py", "--n-layer", "8", "--runs",
              "pp4-m8-v2-1f1b,pp4-m4-v2-1f1b,pp4-m4-zbh1", timeout=180)
    _assert_exact(tagged_json(out), 3)


@pytest.mark.mpi
def test_3d_dp2_tp2_pp2_equals_one_process(mpi):
    """dp 2 x tp 2 x pp 2 on 8 ranks (1F1B; interleaved 1F1B; GPipe and ZB-H1 with sequence
    parallelism):

        mpiexec -n 8 python tests/scripts/pp_check.py
    """
    _assert_exact(tagged_json(mpi(8, "tests/scripts/pp_check.py", timeout=240)), 4)


@pytest.mark.mpi
def test_verbose_logs_every_send_and_receive(mpi):
    """One step of pp 2 over 2 micro-batches: 2 forwards and 2 gradients cross the boundary,
    each logged by its sender and its receiver:

        VERBOSE=1 mpiexec -n 2 python tests/scripts/pp_check.py --runs pp2-m2-1f1b --steps 1
    """
    from mpirun import mpi_env
    out = mpi(2, "tests/scripts/pp_check.py", "--runs", "pp2-m2-1f1b", "--steps", "1",
              env=mpi_env(VERBOSE=1), timeout=60)
    lines = [line for line in out.stderr.splitlines() if "micro-batch" in line]
    assert len(lines) == 8, "\n".join(lines)
    assert sum("send forward" in line for line in lines) == 2
    assert any("stage 1 recv forward" in line and "(4, 8, 16) float64" in line
               for line in lines)


@pytest.mark.mpi
def test_the_chapters_rankpdb_session_stops_in_one_f_one_b(corpus, tmp_path):
    """The PP chapter's debugger session, typed as written (the default 4 micro-batches of a
    --pp 2 run): rank 0 stops in one_f_one_b as stage 0, `p link, steps` shows both, and three
    `n` later the warmup and steady counts are (1, 3). By hand:

        mpiexec -n 2 python -m minidist.comm.rankpdb examples/train_gpt.py --pp 2
    """
    text = open(os.path.join(ROOT, "minidist/pp/README.md")).read()
    typed = ["import minidist.pp.schedule", "b minidist.pp.schedule.one_f_one_b", "c",
             "p link, steps"]
    for line in typed:
        assert f"(Pdb rank 0) {line}" in text, line
    assert "mpiexec -n 2 python -m minidist.comm.rankpdb examples/train_gpt.py --pp 2" in text
    flags = ["--n-layer", "2", "--n-embd", "16", "--block-size", "16", "--steps", "1",
             "--eval-iters", "1", "--sample", "0", "--data", corpus,
             "--cache-dir", str(tmp_path / "cache")]
    job = run_job([mpiexec(), "-n", "2", sys.executable, "-m", "minidist.comm.rankpdb",
                   "examples/train_gpt.py", "--pp", "2", *flags], timeout=120, check=False,
                  input="\n".join(typed + ["n", "n", "n", "p n_warmup, n_steady", "q"]) + "\n")
    assert "(StageLink(stage 0 of 2, 1 chunk(s) a rank" in job.stdout, (job.stdout, job.stderr)
    assert "MicroBatches(4 of 4 rows, in flight []" in job.stdout, job.stdout
    assert "(Pdb rank 0) (1, 3)" in job.stdout and "Error" not in job.stdout, job.stdout
