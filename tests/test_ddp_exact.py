"""Data parallelism's exactness runs: N ranks under mpiexec against one process in float64, for
every mode x algorithm, with grad-accum and clipping; a rank that raises aborts the job, and a
rank that skips a step is named in debug mode.

The exactness checks run tests/scripts/ddp_check.py, which batches many comparisons into one
mpiexec start; each test's docstring gives the command to run it by hand.
"""
import json
import re

import pytest

from mpirun import mpi_env, tagged_json, within


def _assert_exact(results, n, tol=1e-10):
    assert len(results) == n, results
    for r in results:
        assert within(r, tol), r
        print(f"{r['ranks']} ranks {r['algo']:5s} {r['mode']:10s} accum {r['grad_accum']} "
              f"clip {r['clip']}: |loss diff| {r['loss_diff']:.1e}, |param diff| "
              f"{r['param_diff']:.1e}, sent {r['bytes_sent']} B for {r['grad_bytes']} B")


@pytest.mark.mpi
def test_four_ranks_equal_one_process_every_mode_and_algo(tmp_path, mpi):
    """4 ranks x {naive, bucketed, overlapped} x {ring, naive, mpi}, float64, 3 steps: losses,
    norms and parameters equal to one process to 1e-10, replicas bitwise equal, bytes per step
    = 2(N-1)/N x gradient bytes; then a traced overlapped run shows all-reduces in backward.

        mpiexec -n 4 python tests/scripts/ddp_check.py --trace /tmp/ddp_trace.json
    """
    path = tmp_path / "trace.json"
    out = mpi(4, "tests/scripts/ddp_check.py", "--trace", path, timeout=240)
    results = tagged_json(out)
    _assert_exact(results, 9)
    overlap = tagged_json(out, "OVERLAP")[0]
    assert min(overlap["started_inside_by_rank"]) > 0
    events = json.load(open(path))["traceEvents"]
    ranks = {e["pid"] for e in events if e.get("name") == "all_reduce"}
    assert ranks == {0, 1, 2, 3}
    assert {e["name"] for e in events if e.get("ph") == "X"} >= {"forward", "backward",
                                                                 "all_reduce"}


@pytest.mark.mpi
def test_two_ranks_with_grad_accum_equal_one_process(mpi):
    """dp 2 x grad-accum 2 (hooks silent under no_sync until the last micro-batch):

        mpiexec -n 2 python tests/scripts/ddp_check.py --grad-accum 2
    """
    out = mpi(2, "tests/scripts/ddp_check.py", "--grad-accum", "2", timeout=180)
    _assert_exact(tagged_json(out), 9)


@pytest.mark.mpi
def test_global_grad_clipping_under_dp(mpi):
    """A max norm small enough to clip every step: the same norms and parameters as one
    process, the same norm on every rank (replicated gradients, so the local norm is global):

        mpiexec -n 4 python tests/scripts/ddp_check.py --clip 0.05 --algos ring
    """
    out = mpi(4, "tests/scripts/ddp_check.py", "--clip", "0.05", "--algos", "ring",
              timeout=180)
    results = tagged_json(out)
    _assert_exact(results, 3)
    assert all(min(r["norms"]) > 0.05 for r in results)


@pytest.mark.mpi
def test_exception_on_one_rank_aborts_the_job(mpi):
    """Rank 1 raises; rank 0, waiting in sync_grads, must not hang:

        mpiexec -n 2 python tests/scripts/ddp_abort.py
    """
    out = mpi(2, "tests/scripts/ddp_abort.py", timeout=60, check=False)   # (a hang: timed out)
    assert out.returncode != 0 and "deliberate failure on rank 1" in out.stderr
    assert "NOT aborted" not in out.stdout


@pytest.mark.mpi
def test_a_rank_that_skips_a_step_is_named_in_debug_mode(mpi):
    """Rank 1 catches an exception after its forward and `continue`s (first-use walk 37):
    its next step's gradients paired with rank 0's current ones, the same collectives in
    the same order, and the replicas drifted apart without a word, MINIDIST_DEBUG=1 too,
    until rank 1 ran out of steps a sync early. In debug mode the next sync_grads now
    raises on every rank, naming the counts:

        MINIDIST_DEBUG=1 mpiexec -n 2 python tests/scripts/ddp_skip.py
        MINIDIST_DEBUG=1 mpiexec -n 2 python tests/scripts/ddp_skip.py --skip backward \
            [--mode bucketed]

    A rank that swallows only its backward is named too (first-use walk 43: its zeros were
    averaged in without a word)."""
    out = mpi(2, "tests/scripts/ddp_skip.py", timeout=60, check=False,
              env=mpi_env(MINIDIST_DEBUG="1"))
    assert out.returncode != 0 and "NOT caught" not in out.stdout, out.stdout
    assert "CollectiveMismatch: DDP: the ranks ran different numbers of forwards since " \
        "the last sync_grads (rank 0: 1; rank 1: 2): a rank skipped the rest of a step " \
        "after its forward" in out.stderr, out.stderr[-2000:]
    out = mpi(2, "tests/scripts/ddp_skip.py", "--skip", "backward", "--mode", "bucketed",
              timeout=60, check=False, env=mpi_env(MINIDIST_DEBUG="1"))
    assert out.returncode != 0 and "NOT caught" not in out.stdout, out.stdout
    assert re.search(r"CollectiveMismatch: DDP: the ranks' backwards since the last "
                     r"sync_grads completed different numbers of parameter gradients "
                     r"\(rank 0: \d+; rank 1: 0\) after as many forwards: a rank skipped a "
                     r"backward", out.stderr), out.stderr[-2000:]
    out = mpi(2, "tests/scripts/ddp_skip.py", "--skip", "backward", timeout=60, check=False,
              env=mpi_env(MINIDIST_DEBUG="1"))          # overlapped: the buckets' own check
    assert out.returncode != 0 and "NOT caught" not in out.stdout, out.stdout
    assert re.search(r"CollectiveMismatch: group 'world': ranks disagree on the next "
                     r"collective: ranks \[0\] called #\d+ all_reduce avg\(count=\d+, float32\); "
                     r"ranks \[1\] called #\d+ all_gather_object\(\)", out.stderr), \
        out.stderr[-2000:]


@pytest.mark.mpi
def test_the_start_up_broadcast_is_one_per_bucket_and_gives_every_rank_the_roots_params(mpi):
    """Every rank draws other parameters (its own seed); after the wrap each equals its DDP
    group's root's draw bit for bit, under dp, --ddp naive, --amp, tp x dp, pp x dp, cp x dp,
    ep x dp (the experts over edp too) and ep x tp; each group saw one broadcast per bucket
    of broadcast_buckets (trace counters), not one per tensor (28 tensors, 1 broadcast here);
    broadcast_parameters itself from root 1 in 4 buckets of 7 float32 and float64 tensors,
    one not contiguous:

        mpiexec -n 4 python tests/scripts/bcast_check.py
    """
    results = tagged_json(mpi(4, "tests/scripts/bcast_check.py", timeout=180))
    got = {r["run"]: (r["tensors"], r["broadcasts"]) for r in results}
    assert got == {"direct": (7, 4), "dp4": (28, 1), "dp4+naive": (28, 1),
                   "dp4+amp": (28, 1), "tp2xdp2": (28, 1), "pp2xdp2": (14, 1),
                   "cp2xdp2": (28, 1), "ep2xdp2": (38, 2), "ep2xtp2": (22, 1)}, got
