"""Misusing the communication layer gives a clear error, the same on every rank, never a hang.

One-process checks build a one-rank ProcessGroup on COMM_SELF (the suite's conftest has
started MPI). The distributed ones run this file itself as the rank script (`rank_script`,
at the end) under mpiexec through tests/mpirun.py, with a timeout; each docstring gives the
command to run it by hand.
"""
import re
import subprocess
import sys

import numpy as np
import pytest

from minidist import comm
from minidist.comm import CollectiveFailed, ProcessGroup, debug, watchdog
from mpirun import mpi_env

SCRIPT = "tests/test_comm_misuse.py"



@pytest.fixture
def one_rank():
    from mpi4py import MPI   # here: minidist.comm first, so that rank_script's init starts MPI
    group = ProcessGroup(MPI.COMM_SELF, "ring", name="one")
    yield group
    group.destroy()


# ---- one process ---------------------------------------------------------------------------

def test_debug_trace_and_wait_variables_are_read_by_init_not_at_import():
    """MINIDIST_DEBUG, MINIDIST_TRACE and MINIDIST_COMM_WAIT were read when minidist.comm
    was imported (review 38: a side effect of the import; a variable set after it, as
    rankpdb sets its defaults, was ignored). comm.init reads them, after checking them."""
    code = ("import os\n"
            "from minidist import comm\n"
            "from minidist.comm import debug, progress, trace\n"
            "print(debug.enabled(), trace.enabled(), progress.wait_policy())\n"
            "os.environ.update(MINIDIST_TRACE='1', MINIDIST_COMM_WAIT='poll')\n"
            "comm.init()\n"
            "print(debug.enabled(), trace.enabled(), progress.wait_policy())\n")
    out = subprocess.run([sys.executable, "-c", code], env=mpi_env(MINIDIST_DEBUG=1),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["False False block", "True True poll"], out.stdout


@pytest.mark.parametrize("ranks,says", [
    ([0, 1], "not ranks of it: [1]"),
    ([0, -1], "not ranks of it: [-1]"),
    ([0, 0], "given more than once: [0]"),
    ([0.0], "not ranks of it: [0.0]"),
    ([True], "not ranks of it: [True]"),
])
def test_new_group_refuses_ranks_that_are_not_distinct_ranks_of_the_group(one_rank, ranks,
                                                                          says):
    """A rank that does not exist was dropped (a 1-member group named 'one[0, 1]'), and a
    duplicate passed; both raise now, naming the bad ranks and the group's size."""
    with pytest.raises(ValueError) as err:
        one_rank.new_group(ranks)
    assert f"on group 'one' of size 1: ranks must be distinct ints in 0..0; {says}" \
        in str(err.value), err.value


def test_new_group_of_valid_ranks_still_works(one_rank):
    sub = one_rank.new_group([np.int64(0)], name="sub")
    try:
        assert (sub.size, sub.ranks, sub.name) == (1, [0], "sub")
    finally:
        sub.destroy()


def test_avg_on_integers_and_a_list_as_buffer_are_clear_errors(one_rank):
    """numpy's UFuncTypeError (avg divides in place) and an AttributeError ('list' object has
    no attribute 'flags') before; now a ValueError and a TypeError, before any call to MPI."""
    with pytest.raises(ValueError, match=r"all_reduce: avg needs a floating buffer .* not int64"):
        one_rank.all_reduce(np.arange(4, dtype=np.int64), op="avg")
    with pytest.raises(ValueError, match=r"reduce_scatter: avg needs a floating buffer"):
        one_rank.reduce_scatter(np.zeros(3, np.int32), np.zeros(3, np.int32), op="avg")
    with pytest.raises(TypeError, match=r"take a numpy or cupy array, .* not a list"):
        one_rank.all_reduce([1.0, 2.0])
    with pytest.raises(TypeError, match=r"not a list"):
        one_rank.all_to_all([1.0], [1.0])
    with pytest.raises(ValueError, match=r"all_reduce: avg needs a floating buffer .* not bool"):
        one_rank.all_reduce(np.ones(4, dtype=bool), op="avg")
    buf = np.arange(4, dtype=np.int64)
    one_rank.all_reduce(buf, op="sum")        # integers are fine for the other ops
    assert buf.tolist() == [0, 1, 2, 3]


def test_a_chunk_of_another_dtype_is_a_clear_error(one_rank):
    """reduce_scatter's `out` and all_gather's `inp` must be of the whole buffer's dtype
    (checks.check_chunk): refused before any byte moves, not cast on the way."""
    with pytest.raises(ValueError, match=r"reduce_scatter: out and inp dtypes differ "
                                         r"\(float32 vs float64\)"):
        one_rank.reduce_scatter(np.zeros(4, np.float32), np.zeros(4, np.float64))
    with pytest.raises(ValueError, match=r"all_gather: out and inp dtypes differ"):
        one_rank.all_gather(np.zeros(4, np.float64), np.zeros(4, np.float32))


def test_an_unset_wait_variable_keeps_a_policy_set_in_code():
    """progress.policy_from_env (comm.init) sets MINIDIST_COMM_WAIT's policy where it is set;
    unset, a set_wait_policy("poll") made before stays (as debug.enable_from_env keeps an
    enable())."""
    from minidist.comm import progress
    try:
        progress.set_wait_policy("poll")
        progress.policy_from_env({})
        assert progress.wait_policy() == "poll"
        progress.policy_from_env({"MINIDIST_COMM_WAIT": "block"})
        assert progress.wait_policy() == "block"
    finally:
        progress.set_wait_policy("block")


def test_an_mpi_error_in_a_collective_names_the_call():
    """failed_in_mpi, which ProcessGroup raises from MPI's exception: the op, its number, the
    group, count and dtype, and the advice; MPI's text unless it only points to a status."""
    from mpi4py import MPI
    in_status = debug.failed_in_mpi("world", 3, "all_reduce", 10, "float64",
                                    MPI.Exception(MPI.ERR_IN_STATUS))
    assert isinstance(in_status, CollectiveFailed)
    assert str(in_status).startswith(
        "all_reduce #3 on group 'world' (count 10, float64) failed inside MPI: the ranks "
        "probably disagree on the collective"), in_status
    assert "rerun with MINIDIST_DEBUG=1" in str(in_status)
    truncated = debug.failed_in_mpi("dp", 1, "barrier", 0, "", MPI.Exception(MPI.ERR_TRUNCATE))
    assert str(truncated).startswith("barrier #1 on group 'dp' (count 0) failed inside MPI (")


def test_the_watchdog_names_the_collective_each_other_rank_is_in():
    """Everyone reached #1, rank 1 in barrier: "world ranks that did not arrive: []" before,
    which named no op; now what each other rank is in, and the cause."""
    said = watchdog.why_waiting("all_reduce", 1, {1: [1, 0, "barrier"], 2: [1, 0, "barrier"],
                                                  3: [1, 0, "all_reduce"]})
    assert said == ("world ranks 1, 2 are in barrier #1 while this rank is in all_reduce #1: "
                    "the ranks called different collectives"), said
    said = watchdog.why_waiting("all_reduce", 2, {1: [1, 1, "barrier"], 2: None})
    assert said == "world ranks that did not arrive: [1]; ranks that did not answer: [2]"
    said = watchdog.why_waiting("broadcast", 4, {1: [4, 3, "broadcast"]})
    assert said.startswith("every rank is in broadcast #4: they may disagree on its size, "
                           "dtype or root"), said
    # first-use walk 37: the root of a broadcast came late (writing a checkpoint), sent and
    # went on; "the ranks called different collectives" blamed a healthy job
    said = watchdog.why_waiting("broadcast_object", 186, {0: [188, 187, "all_reduce"]})
    assert said == ("world rank 0 is past it, in all_reduce #188: it came late to "
                    "broadcast_object #186, or called another collective there"), said



def test_the_rank_that_says_why_is_the_lowest_waiting_one_that_answers():
    """One line per job: the lowest rank waiting in the collective says it, the others leave
    it to that one (abort_job's `first`). A rank that answers nothing is not counted even
    where it answered from the wait before it froze: counted, it was the lowest "waiting"
    rank to ranks 1 and 2 alike, none was first, and both printed the line
    (tests/test_comm_failures.py, stoppedlater)."""
    waiting, elsewhere = [1, 0, "wait_for_all"], [0, 0, ""]
    assert watchdog.says_it_first(1, "wait_for_all", 1, {0: None, 2: waiting, 3: elsewhere})
    assert not watchdog.says_it_first(2, "wait_for_all", 1, {0: None, 1: waiting, 3: None})
    assert not watchdog.says_it_first(1, "wait_for_all", 1, {0: waiting, 2: waiting})
    assert watchdog.says_it_first(1, "wait_for_all", 1, {0: [1, 1, "wait_for_all"]})  # done
    assert watchdog.says_it_first(2, "all_reduce", 3, {0: [3, 2, "barrier"], 1: None})


# ---- under mpiexec -----------------------------------------------------------------------

@pytest.mark.mpi
@pytest.mark.cpu_only("the script's buffers are numpy; the checks are the device's alike")
def test_new_group_misuse_raises_alike_on_every_rank(mpi):
    """Bad ranks, duplicates, and lists that differ between the ranks (in order: the group
    was silently ordered [0, 2, 1]; in members) raise ValueError on all 3 ranks, and no rank
    is left waiting: a valid group and a world all_reduce still work. By hand:
    mpiexec -n 3 python tests/test_comm_misuse.py new_group"""
    out = mpi(3, SCRIPT, "new_group", timeout=90)
    for r in range(3):   # (mpiexec may join two ranks' lines: look for each, not for lines)
        for says in ("new_group([0, 3]) on group 'world' of size 3: ranks must be distinct "
                     "ints in 0..2; not ranks of it: [3]",
                     "new_group([0, 1, 1]) on group 'world' of size 3: ranks must be distinct "
                     "ints in 0..2; given more than once: [1]",
                     "new_group on group 'world': the ranks passed different lists (rank 0 "
                     "passed [0, 1, 2]; ranks 1, 2 passed [2, 1, 0]); every rank must pass "
                     "the same list",
                     "new_group on group 'world': the ranks passed different lists (ranks 0, "
                     "1 passed [0, 2]; rank 2 passed [0, 1])",
                     "done 3.0"):
            assert f"rank {r} {'' if says == 'done 3.0' else 'ValueError: '}{says}" \
                in out.stdout, (r, says, out.stdout)
    assert "no error" not in out.stdout
    assert "rank 0 pair rank 1 of [2, 0]: 4.0" in out.stdout       # ranks 0 and 2: 1 + 3
    assert "rank 2 pair rank 0 of [2, 0]: 4.0" in out.stdout


@pytest.mark.mpi
@pytest.mark.cpu_only("the script's buffers are numpy; the checks are the device's alike")
def test_avg_on_integers_and_a_list_raise_on_every_rank_before_any_communication(mpi):
    """By hand: mpiexec -n 2 python tests/test_comm_misuse.py buffers"""
    out = mpi(2, SCRIPT, "buffers", timeout=90)
    for r in range(2):
        assert f"rank {r} ValueError: all_reduce: avg needs a floating buffer" in out.stdout
        assert f"rank {r} ValueError: reduce_scatter: avg needs a floating" in out.stdout
        assert f"rank {r} TypeError: collectives take a numpy or cupy array" in out.stdout
        assert f"rank {r} done 2.0" in out.stdout, out.stdout


@pytest.mark.mpi
@pytest.mark.cpu_only("the script's buffers are numpy")
def test_a_size_mismatch_without_debug_mode_names_the_collective(mpi):
    """10 elements on rank 0, 12 on rank 1, MINIDIST_DEBUG unset: mpi4py's "See the MPI_ERROR
    field in MPI_Status" before, naming nothing; now CollectiveFailed naming the call, and
    MINIDIST_DEBUG=1. By hand: mpiexec -n 2 python tests/test_comm_misuse.py size_mismatch"""
    out = mpi(2, SCRIPT, "size_mismatch", timeout=90, check=False,
              env=mpi_env(MINIDIST_DEBUG=0, MINIDIST_COMM_TIMEOUT=30))
    assert out.returncode != 0, out.stderr
    assert re.search(r"CollectiveFailed: all_reduce #2 on group 'world' \(count 1[02], "
                     r"float64\) failed inside MPI: the ranks probably disagree on the "
                     r"collective .* rerun with MINIDIST_DEBUG=1", out.stderr), out.stderr
    assert "unreachable" not in out.stdout


@pytest.mark.mpi
@pytest.mark.cpu_only("the script's buffers are numpy")
def test_the_timeout_names_the_other_collective_a_rank_is_in(mpi):
    """Rank 0 in all_reduce #2, rank 1 in barrier #2: both reached #2, so the timeout's
    message said "world ranks that did not arrive: []". By hand:
    MINIDIST_COMM_TIMEOUT=3 mpiexec -n 2 python tests/test_comm_misuse.py different_ops"""
    out = mpi(2, SCRIPT, "different_ops", timeout=90, check=False,
              env=mpi_env(MINIDIST_COMM_TIMEOUT=3))
    assert out.returncode != 0, out.stderr
    assert ("world rank 1 is in barrier #2 while this rank is in all_reduce #2: the ranks "
            "called different collectives" in out.stderr
            or "world rank 0 is in all_reduce #2 while this rank is in barrier #2: the ranks "
            "called different collectives" in out.stderr), out.stderr
    assert "did not arrive: []" not in out.stderr
    assert "unreachable" not in out.stdout


# ---- the rank script: python tests/test_comm_misuse.py CASE, under mpiexec --------------

def rank_script(case):
    """Each rank's part of the distributed tests above; misuse that must raise alike on every
    rank is caught and printed, then a world all_reduce shows that no rank was left waiting."""
    world = comm.init("ring")
    r = world.rank

    def report(call):
        try:
            call()
            print(f"rank {r} no error", flush=True)
        except (TypeError, ValueError) as e:
            print(f"rank {r} {type(e).__name__}: {e}", flush=True)

    if case == "new_group":
        report(lambda: world.new_group([0, 3]))                          # no rank 3 of 3
        report(lambda: world.new_group([0, 1, 1]))                       # 1 twice
        report(lambda: world.new_group([0, 1, 2] if r == 0 else [2, 1, 0]))   # orders differ
        report(lambda: world.new_group([0, 1] if r == 2 else [0, 2]))    # members differ
        pair = world.new_group([np.int64(2), 0])                         # numpy ints: ints
        if pair is not None:
            x = np.full(5, r + 1.0)
            pair.all_reduce(x)
            print(f"rank {r} pair rank {pair.rank} of {pair.ranks}: {x[0]}", flush=True)
    elif case == "buffers":
        report(lambda: world.all_reduce(np.arange(4), op="avg"))
        report(lambda: world.reduce_scatter(np.zeros(2, np.int32), np.zeros(4, np.int32),
                                            "avg"))
        report(lambda: world.all_reduce([1.0, 2.0]))
    x = np.ones(3)
    world.all_reduce(x)            # #1, or #2 after new_group's: nobody is left in another
    print(f"rank {r} done {x[0]}", flush=True)
    if case == "size_mismatch":
        world.all_reduce(np.ones(10 if r == 0 else 12))   # the ring's messages do not fit
        print("unreachable: the sizes differ", flush=True)
    elif case == "different_ops":
        if r == 0:
            world.all_reduce(np.ones(4))
        else:
            world.barrier()
        print("unreachable: the ranks called different collectives", flush=True)


if __name__ == "__main__":
    rank_script(sys.argv[1])        # (the mpi fixture appends --device: numpy buffers here)
