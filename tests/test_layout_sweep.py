"""The composition sweep (tests/scripts/layout_sweep.py): every layout check_layout accepts,
of a seeded sample covering every flag value and every pair of strategies, trains one
process's numbers (float64 to 1e-10: each step's loss and gradient norm, the val loss, every
saved parameter; --amp: to a few float16 roundings, --amp-dtype bfloat16 to a few of its
own), prints only sizes the layout has,
resumes bit for bit, and resumed in another layout continues one process's run.

    python -m pytest -m slow tests/test_layout_sweep.py          # 2 and 4 ranks, resumed,
                                                                 # resharded, 8
    python tests/scripts/layout_sweep.py                         # the same, line by line
    python tests/scripts/layout_sweep.py --large [--reshard]     # 12 and 16 ranks, by hand

The default run checks the sampler and the log-line check without MPI, and what the sweep
found broken (a pipeline stage without MoE blocks under --ep; the log lines under --ep;
TP x ZeRO checkpoints resumed in no other layout) on 2 and 4 ranks.
"""
import collections
import os
import sys

import numpy as np
import pytest

from mpirun import ROOT

sys.path.insert(0, os.path.join(ROOT, "tests", "scripts"))
import exact  # noqa: E402
import layout_sample  # noqa: E402
import layout_sweep  # noqa: E402


def test_the_list_is_deterministic_accepted_and_covers_every_flag_value():
    """Small draws keep this fast; the sweep's own list is drawn the same way, only longer."""
    sample = layout_sample
    cands = sample.candidates(seed=3, ranks_list=[2, 4], n=300)
    chosen = sample.select(cands, want=2, pairs=1)
    assert chosen == sample.select(sample.candidates(3, [2, 4], 300), 2, 1)
    assert all(sample.accepted(r, f) is None for r, f in chosen)
    shown = collections.Counter(f for c in chosen for f in sample.features(*c))
    drawn = collections.Counter(f for c in cands for f in sample.features(*c))
    for f, n in drawn.items():                  # each at least `want` times, if drawn so
        assert shown[f] >= min(2 if len(f) == 2 else 1, n), f


def test_a_refused_layout_is_not_drawn():
    """--pp-virtual 2 with --schedule gpipe is refused by check_layout: never in the list."""
    flags = {"--pp": 2, "--schedule": "gpipe", "--pp-virtual": 2, "--zero": 0}
    assert "needs --schedule 1f1b" in layout_sample.accepted(2, flags)
    cands = layout_sample.candidates(seed=3, ranks_list=[2, 4], n=300)
    assert not any(f.get("--pp-virtual") == 2 and f["--schedule"] != "1f1b" for _, f in cands)


def test_banner_problems_names_a_size_the_layout_does_not_have():
    """Lines a --dp 1 --ep 2 --cp 2 run printed before the fix (dp x ep called dp; dp x ep
    x cp called dp x ep), and the cp line after it."""
    flags = {"--moe-experts": 4, "--ep": 2, "--cp": 2}
    before = ("context parallel: cp 2 x dp 2 x tp 1, --cp-split zigzag; gradients averaged "
              "over the 2 dp x cp ranks")
    after = ("context parallel: cp 2 x dp 1 x ep 2 x tp 1, --cp-split zigzag; gradients "
             "averaged over the 4 dp x ep x cp ranks")
    ep_line = ("expert parallel: ep 2 x dp 1 x tp 1; this rank holds 8 expert parameter "
               "tensors (16,704 values); dense gradients averaged over the 4 dp x ep ranks")
    problems = layout_sweep.banner_problems(4, flags, before + "\n" + ep_line)
    assert [p.split(":")[0] for p in problems] == ["dp 2", "4 dp x ep"], problems
    assert layout_sweep.banner_problems(4, flags, "step 1 | tp 3\n" + after) == []


def _saved_run(**changes):
    """What Sweep reads back from a run (its log and its saved checkpoint), tiny, with
    `changes` applied: two parameters, so a NaN can sit in one that is not the first."""
    run = {"rc": 0, "losses": [4.0, 3.5, 3.25], "norms": [1.0, 0.75, 0.5], "val_loss": [3.5],
           "params": {"wte": np.array([1.0, -2.0, 3.0]), "ln.bias": np.array([0.5, -0.25])},
           "biases": {}}
    return {**run, **changes}


def test_compare_fails_a_nan_parameter_or_a_later_nan_gradient_norm():
    """A NaN anywhere fails the run: in a saved parameter (what a checkpoint writer that
    saved ZeRO-3's or --overlap-param-gather's NaN placeholders would leave), or in the
    gradient norm of the last step only. Each difference is compared with TOL on its own;
    max() over them skipped a NaN that was not first (`nan > x` is False), so both passed."""
    ref = _saved_run()
    assert layout_sweep.compare(ref, _saved_run())[0]
    nan = float("nan")
    for got in (_saved_run(params={**ref["params"], "ln.bias": np.array([nan, nan])}),
                _saved_run(norms=[1.0, 0.75, nan])):
        ok, errs = layout_sweep.compare(ref, got)
        assert not ok and any(np.isnan(e) for e in errs.values()), errs
        # under --amp (MoE: the parameters are held to nothing) a NaN fails too
        assert not layout_sweep.compare(ref, got, amp="float16", moe=True)[0], errs
    off = _saved_run(params={**ref["params"], "ln.bias": np.array([0.5, -0.25 * (1 + 1e-8)])})
    assert not layout_sweep.compare(ref, off)[0]


def test_max_abs_keeps_a_nan_that_max_drops():
    """tests/scripts/exact.py's max_abs, which every exactness script's differences use:
    the largest |entry| over numbers and arrays, NaN if any entry is, 0.0 for none; and
    worst_over_ranks, the same over the ranks (here the one rank of COMM_SELF)."""
    from mpi4py import MPI          # started by conftest (comm.init)
    nan = float("nan")
    assert max(0.0, nan, 1e-12) == 1e-12                      # the pitfall
    assert np.isnan(exact.max_abs([0.0, np.array([[1e-12, nan]]), 2e-12]))
    assert np.isnan(exact.max_abs(np.zeros(3) + v for v in (0.0, nan)))
    assert exact.max_abs([np.array([-3.0, 2.0]), 1.0, np.zeros(0)]) == 3.0
    assert exact.max_abs([]) == 0.0 and exact.max_abs([np.inf, 0.0]) == np.inf
    assert np.isnan(exact.worst_over_ranks(MPI.COMM_SELF, nan))
    assert exact.worst_over_ranks(MPI.COMM_SELF, -2.0) == 2.0


@pytest.mark.mpi
def test_a_pipeline_stage_without_moe_blocks_under_ep_trains_one_process_numbers(sweep):
    """Found by the sweep: with --moe-every 4 stage 0 of 2 holds no MoE block, so no experts.
    The gradient norm's sum over ep took its device from the first expert (IndexError, every
    rank aborted); under ZeRO, --resume cut the experts' empty engine's state (IndexError,
    then `max()` of no parameter groups, reported as "checkpoint does not fit this run").
    Now DDP's and ZeRO's runs are exact, and ZeRO's resumes bit for bit:

        mpiexec -n 4 python examples/train_gpt.py --moe-experts 4 --moe-every 4 --pp 2 --ep 2
    """
    for zero in (0, 3):
        flags = {"--moe-experts": 4, "--moe-every": 4, "--pp": 2, "--ep": 2, "--zero": zero}
        ok, errs, run = sweep.check(4, flags, resume=zero == 3)
        assert ok, (errs, run["stderr"][-2000:])
    assert errs["resumed"] == "same"


@pytest.mark.mpi
def test_log_lines_under_ep_name_dp_and_ep_apart(sweep):
    """Found by the sweep: the mesh's dp axis holds dp x ep ranks, and the tp, pp and cp
    lines called it dp (`tensor parallel: tp 2 x dp 2` for --dp 1 --ep 2); the cp line
    counted the ep group as the ranks averaging the gradients. Now every size they name is
    the layout's (Sweep.check fails on any that is not), and the runs are exact:

        mpiexec -n 4 python examples/train_gpt.py --moe-experts 4 --ep 2 --cp 2 --zero 1
    """
    for axis in ("--cp", "--tp"):
        flags = {"--moe-experts": 4, "--ep": 2, axis: 2, "--zero": 1}
        ok, errs, run = sweep.check(4, flags)
        assert ok, (errs, run["stdout"][-3000:])
        assert "dp 1 x ep 2" in run["stdout"]


# (stopped in, resumed in): each checkpoint read back by another layout. The first two the
# sweep found refused (TP x ZeRO's parts resumed only with the same --tp, and nothing else
# resumed under TP x ZeRO); the rest take each other way through the parts' reader.
RESHARDED = [
    ((4, {"--cp": 2, "--tp": 2, "--zero": 3, "--sequence-parallel": True}), (2, {"--cp": 2})),
    ((2, {"--pp": 2, "--zero": 1}), (4, {"--tp": 2, "--cp": 2, "--zero": 2})),
    ((4, {"--tp": 4, "--zero": 1}), (4, {"--tp": 2, "--zero": 3})),       # other tp's parts
    ((4, {"--tp": 2, "--zero": 1}), (2, {"--zero": 3})),       # parts -> ZeRO's shards
    ((2, {"--tp": 2, "--zero": 2, "--amp": True}), (1, {"--amp": True})),     # the masters
]


@pytest.mark.mpi
def test_checkpoints_resume_in_another_layout_with_one_process_numbers(sweep):
    """Found by the sweep (--reshard): a TP x ZeRO checkpoint (one ZeRO folder per tp rank)
    resumed only with the same --tp, and no other checkpoint resumed under TP x ZeRO. Now
    each part records how its parameters were cut, any layout glues them back, and every
    pair below continues one process's run (float64 to 1e-10; --amp to float16's):

        mpiexec -n 4 python examples/train_gpt.py --tp 4 --zero 1 --stop-at 2 --save ck
        mpiexec -n 4 python examples/train_gpt.py --tp 2 --zero 3 --resume ck
    """
    failed = []
    for source, into in RESHARDED:
        ok, errs = sweep.check_resharded(*source, into)
        if not ok:
            failed.append((source, into, errs))
    assert not failed, failed


@pytest.mark.mpi
def test_bfloat16_amp_trains_one_process_numbers_through_tp_zero_and_the_pipeline(sweep):
    """--amp --amp-dtype bfloat16 (numpy + ml_dtypes here; what a GPU runs) through TP x
    ZeRO-1 and a pipeline over DDP on 4 ranks: each step's loss and gradient norm, the val
    loss and the parameters' L2 distance within BF16_TOL of one bfloat16 process (until now
    bfloat16 through the strategies was held to finite and decreasing only):

        mpiexec -n 4 python examples/train_gpt.py --amp --amp-dtype bfloat16 --tp 2 --zero 1
    """
    pytest.importorskip("ml_dtypes", reason="bfloat16 on numpy needs ml_dtypes")
    for flags in ({"--tp": 2, "--zero": 1}, {"--pp": 2, "--dp": 2}):
        ok, errs, run = sweep.check(4, {**flags, "--amp": True, "--amp-dtype": "bfloat16"})
        assert ok, (flags, errs, run["stderr"][-2000:])
        assert "mixed precision: bfloat16 compute" in run["stdout"]


def test_every_layout_has_a_partner_to_resume_in():
    """layout_sweep --reshard: each layout's partner is accepted, keeps its model flags and
    differs from it; every fourth is one process; the others prefer another rank count."""
    chosen = layout_sample.layouts((2, 4), seed=0, count=12)
    for i, (ranks, flags) in enumerate(chosen):
        r, into = layout_sweep.partner(chosen, i)
        assert layout_sample.accepted(r, into) is None and (r, into) != (ranks, flags)
        assert layout_sweep.reference_flags(into) == layout_sweep.reference_flags(flags)
        assert (r == 1) == (i % 4 == 3)
    assert sum(layout_sweep.partner(chosen, i)[0] not in (1, r)
               for i, (r, _) in enumerate(chosen)) >= 6


def _sweep(mpi, tmp_path, ranks, count=None, resume=False):
    chosen = layout_sample.layouts(ranks, seed=0, count=count)
    lines = []
    sweep = layout_sweep.Sweep(str(tmp_path), mpi.device or "cpu", say=lines.append)
    failed = [layout_sample.describe(*c) for c in chosen if not sweep.check(*c, resume)[0]]
    print("\n".join(lines))
    assert not failed, "\n".join(["layouts that do not train one process's numbers:",
                                  *failed, "all runs:", *lines])


@pytest.mark.mpi
@pytest.mark.slow
def test_every_sampled_layout_on_2_and_4_ranks_trains_one_process_numbers(mpi, tmp_path):
    """59 layouts (python tests/scripts/layout_sweep.py --list), about 1.7 minutes quiet."""
    _sweep(mpi, tmp_path, (2, 4))


@pytest.mark.mpi
@pytest.mark.slow
def test_every_sampled_layout_on_2_and_4_ranks_resumes_bit_for_bit(mpi, tmp_path):
    """Each layout also stopped after step 2 (--stop-at 2 --save) and resumed in the same
    layout: step 3, the val loss and the saved parameters bit for bit the uninterrupted
    run's (python tests/scripts/layout_sweep.py --resume; about 4 minutes quiet)."""
    _sweep(mpi, tmp_path, (2, 4), resume=True)


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.parametrize("ranks, count", [((2, 4), None), ((4, 8), 16)])
def test_every_sampled_layout_resumes_in_another_with_one_process_numbers(mpi, tmp_path, ranks,
                                                                           count):
    """Each layout stopped after step 2 and resumed in its partner (another layout, another
    rank count where one fits, every fourth one process): step 3, the val loss and the saved
    parameters are one process's (python tests/scripts/layout_sweep.py --reshard [--ranks 4 8
    --count 16]; about 2 and 1 minutes quiet)."""
    chosen = layout_sample.layouts(ranks, seed=0, count=count)
    lines = []
    sweep = layout_sweep.Sweep(str(tmp_path), mpi.device or "cpu", say=lines.append)
    failed = [layout_sample.describe(*c) for i, c in enumerate(chosen)
              if not sweep.check_resharded(*c, layout_sweep.partner(chosen, i))[0]]
    print("\n".join(lines))
    assert not failed, "\n".join(["layouts whose checkpoint another does not continue:",
                                  *failed, "all runs:", *lines])


@pytest.mark.mpi
@pytest.mark.slow
def test_sampled_layouts_on_8_ranks_train_one_process_numbers(mpi, tmp_path):
    """The first 10 of the 8-rank list (python tests/scripts/layout_sweep.py --ranks 8)."""
    _sweep(mpi, tmp_path, (8,), count=10)


def test_the_12_and_16_rank_list_is_accepted_and_resumes_in_4_ranks_or_one_process():
    """layout_sample.LARGE (layout_sweep --large): every layout accepted at its rank count;
    under --reshard each resumes in a 4-rank layout of LARGE_INTO, every fourth in one
    process, with its own model flags."""
    chosen = layout_sample.LARGE
    assert {r for r, _ in chosen} == {12, 16}
    assert all(layout_sample.accepted(r, f) is None for r, f in chosen)
    for i, (ranks, flags) in enumerate(chosen):
        r, into = layout_sweep.partner(chosen, i, layout_sample.LARGE_INTO)
        assert r == (1 if i % 4 == 3 else 4) and layout_sample.accepted(r, into) is None
        assert layout_sweep.reference_flags(into) == layout_sweep.reference_flags(flags)


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.parametrize("reshard", [False, True])
def test_the_12_and_16_rank_layouts_train_one_process_numbers(mpi, tmp_path, reshard):
    """layout_sample.LARGE: 38 layouts on 12 and 16 ranks with every axis > 1 at once and
    sizes the sampler never draws (dp, pp, cp, ep and --zero-shard of 3, cp 4 inside tp 2,
    pp 4 x 2 virtual stages, hybrid ZeRO-3 groups), each against one process; with
    `reshard`, each stopped after step 2 and resumed on 4 ranks in another layout (every
    fourth: one process). About 4 minutes each on 2 cores:

        python tests/scripts/layout_sweep.py --large [--reshard]
    """
    chosen, lines = layout_sample.LARGE, []
    sweep = layout_sweep.Sweep(str(tmp_path), mpi.device or "cpu", say=lines.append)
    pool = layout_sample.LARGE_INTO
    failed = [layout_sample.describe(*c) for i, c in enumerate(chosen)
              if not (sweep.check_resharded(*c, layout_sweep.partner(chosen, i, pool))
                      if reshard else sweep.check(*c))[0]]
    print("\n".join(lines))
    assert not failed, "\n".join(["12/16-rank layouts that fail:", *failed, "all runs:",
                                  *lines])
