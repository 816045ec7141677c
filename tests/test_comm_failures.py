"""The communication layer when a rank fails: an exception, sys.exit or a death before MPI_Init
on one rank ends the whole job, an asynchronous collective that fails names itself, and a
collective or point-to-point that waits past the timeout names the op, the group and the
missing ranks; ranks finishing at different times exit cleanly.

Each starts mpiexec through tests/mpirun.py (with a timeout; a hang is a failure, not a stuck
suite); each docstring gives the command to run it by hand.
"""
import pytest

from minidist import comm
from mpirun import mpi_env


@pytest.mark.mpi
@pytest.mark.parametrize("repeat", range(3))
def test_raise_on_one_rank_aborts(repeat, mpi):
    """A raise on one rank ends the whole job quickly (MPI Abort), never a hang, and the
    traceback always reaches the output (3 runs here; 20 of 20 by hand). By hand:
    mpiexec -n 4 python tests/scripts/comm_small.py abort"""
    out = mpi(4, "tests/scripts/comm_small.py", "abort", timeout=60, check=False)
    assert out.returncode != 0
    assert "boom on rank 1" in out.stderr and "aborting the whole MPI job" in out.stderr
    assert "unreachable" not in out.stdout


@pytest.mark.mpi
def test_sys_exit_on_one_rank_ends_the_job(mpi):
    """sys.exit(3) on rank 1 while the others wait for it in an all_reduce: no exception hook
    sees a SystemExit, the exit handler does; the job ends in seconds, naming the rank and
    the collective. By hand: mpiexec -n 4 python tests/scripts/comm_small.py exit"""
    out = mpi(4, "tests/scripts/comm_small.py", "exit", timeout=60, check=False)
    assert out.returncode != 0, out.stderr
    assert "world rank 1 exited" in out.stderr and "all_reduce #1" in out.stderr, out.stderr
    assert out.stderr.count("world rank 1 exited") == 1, out.stderr    # by rank 0 alone
    assert "unreachable" not in out.stdout


@pytest.mark.mpi
def test_sys_exit_while_the_others_gather_objects_ends_the_job(mpi):
    """The object collectives (checkpoint verdicts, the memory table's rows: ProcessGroup's
    gather_object, all_gather_object, broadcast_object) are watched as the array ones are:
    rank 1 exits while the others wait in one, and the job ends in seconds naming it (they
    were raw mpi4py calls, where the others waited for ever). By hand:
    mpiexec -n 3 python tests/scripts/comm_small.py rawexit"""
    out = mpi(3, "tests/scripts/comm_small.py", "rawexit", timeout=60, check=False)
    assert out.returncode != 0, out.stderr
    assert "world rank 1 exited" in out.stderr and "all_gather_object #1" in out.stderr, \
        out.stderr
    assert "unreachable" not in out.stdout


@pytest.mark.mpi
def test_an_asynchronous_collective_that_fails_ends_the_job_naming_it(mpi):
    """Rank 1's async all_reduce raises in the communication thread (a read-only buffer), and
    the rank goes on to its next collective: the thread ends the job at once, naming the
    operation and the error (it kept the error for a wait() that came too late, and rank 1's
    next collective met the others still in the first: an MPI error naming neither). By
    hand: mpiexec -n 3 python tests/scripts/comm_small.py asyncfail"""
    out = mpi(3, "tests/scripts/comm_small.py", "asyncfail", timeout=60, check=False,
              env=mpi_env(MINIDIST_COMM_TIMEOUT=20))
    assert out.returncode != 0, out.stderr
    # "at once": the thread ended the job, not the 20 s watchdog (whose lines say so)
    assert "waited more than 20 s" not in out.stderr, out.stderr
    assert "have not exited 20 s later" not in out.stderr, out.stderr
    assert "[rank 1] asynchronous all_reduce #1 on group 'world' failed on this rank" \
        in out.stderr and "output array is read-only" in out.stderr, out.stderr
    assert "unreachable" not in out.stdout


@pytest.mark.mpi
def test_an_exiting_rank_waits_for_a_straggler_only_up_to_the_timeout(mpi):
    """Rank 0 exits while rank 1 is stuck where no watchdog looks (compute, or MPI outside a
    ProcessGroup): rank 0 waits for it in its exit handler up to the timeout, 10 s at least
    (a rank slower to exit is no fault), then ends the job saying so (it waited for ever).
    By hand: MINIDIST_COMM_TIMEOUT=3 mpiexec -n 2 python tests/scripts/comm_small.py straggler"""
    out = mpi(2, "tests/scripts/comm_small.py", "straggler", timeout=60, check=False,
              env=mpi_env(MINIDIST_COMM_TIMEOUT=3))
    assert out.returncode != 0, out.stderr
    assert "[rank 0] this rank is exiting, and the others have not exited 10 s later" \
        in out.stderr, out.stderr


@pytest.mark.mpi
def test_a_rank_frozen_after_the_exit_agreement_ends_the_job(mpi):
    """Rank 1 stops (SIGSTOP, a node that hangs) right after the ranks agree to exit: rank 0
    waited in MPI_Finalize for it for ever (MPICH's Finalize waits for every rank; found by
    tests/scripts/chaos.py). Now it exits 1 after the timeout (10 s at least) with a stack
    dump naming _finish, and the launcher ends the job, the frozen rank included. By hand:
    MINIDIST_COMM_TIMEOUT=3 mpiexec -n 2 python tests/scripts/comm_small.py frozen"""
    out = mpi(2, "tests/scripts/comm_small.py", "frozen", timeout=60, check=False,
              env=mpi_env(MINIDIST_COMM_TIMEOUT=3))
    assert out.returncode != 0, out.stderr
    assert "in _finish" in out.stderr, out.stderr


@pytest.mark.mpi
@pytest.mark.parametrize("mode", [pytest.param("stopped", marks=pytest.mark.slow),
                                  "stoppedbig"])
def test_a_rank_stopped_while_the_others_wait_for_it_without_timeout_ends_the_job(mpi, mode):
    """wait_for_all has no timeout (the ranks wait while others write a checkpoint or
    tokenize the text, as long as that takes), so a rank that froze there (SIGSTOP: a node
    that hung while a save in the step wrote; 2026-11-29's chaos campaign) held the others
    for ever. Past the timeout the waiting ranks now ask the others whether they are alive;
    one that answers nothing for 10 s (the timeout when longer) is named, once, and the job
    ends (~15 s). stoppedbig waits on a group whose key (which each question carries)
    pickles to 16 KiB, as the ranks of a world of ~5,000 do: the watchdog's blocking send
    of it, past MPICH's eager limit, waited for ever on the stopped rank (the job hung; a
    review, 2026-11-29: watchdog._send); it runs by default, the plain key (the same
    path, ~15 s more) under -m slow. By hand:
    MINIDIST_COMM_TIMEOUT=3 mpiexec -n 3 python tests/scripts/comm_small.py stopped"""
    out = mpi(3, "tests/scripts/comm_small.py", mode, timeout=90, check=False,
              env=mpi_env(MINIDIST_COMM_TIMEOUT=3))
    assert out.returncode != 0, out.stderr
    assert "world rank 1 answered nothing for 10 s: stopped or hung" in out.stderr, out.stderr
    assert out.stderr.count("answered nothing") == 1, out.stderr      # said once
    assert "done waiting" not in out.stdout


@pytest.mark.mpi
def test_a_rank_stopped_while_the_others_make_a_group_ends_the_job(mpi):
    """Making a group (new_group: an all-gather and MPI_Comm_split; split) is collective, and
    was not watched: a rank frozen before it (SIGSTOP) left the others there for ever (a
    review, 2026-11-29: 40 s, killed). Now watched as a collective (watchdog.making_group,
    numbered apart from the group's collectives): the job ends after the timeout, naming
    it. By hand:
    MINIDIST_COMM_TIMEOUT=3 mpiexec -n 3 python tests/scripts/comm_small.py stoppedgroup"""
    out = mpi(3, "tests/scripts/comm_small.py", "stoppedgroup", timeout=90, check=False,
              env=mpi_env(MINIDIST_COMM_TIMEOUT=3))
    assert out.returncode != 0, out.stderr
    assert "new_group #1 on group 'world (making groups)' (world ranks [0, 1, 2]) waited " \
        "more than 3 s" in out.stderr, out.stderr
    assert "ranks that did not answer: [1]" in out.stderr, out.stderr
    assert "done waiting" not in out.stdout


@pytest.mark.mpi
@pytest.mark.slow          # ~25 s; the rule it checks runs by default in test_comm_misuse.py
def test_a_rank_stopped_in_the_wait_after_it_answered_is_named_once(mpi):
    """The test above, with the frozen rank one that had answered from the wait: rank 3
    works alone, ranks 0-2 wait, and rank 0 stops 6 s into its wait, after its first answer.
    The others ask it again half the silence later (10 s: 5 s), it answers nothing, and the
    job ends naming it, once. Its answer said it waited too, so it was the lowest waiting
    rank to ranks 1 and 2: neither was first, and both printed the line 3 s later (2 runs
    of 2; now rank 1 says it, 2 of 2; the rule's own test: tests/test_comm_misuse.py). By
    hand:
    MINIDIST_COMM_TIMEOUT=3 mpiexec -n 4 python tests/scripts/comm_small.py stoppedlater"""
    out = mpi(4, "tests/scripts/comm_small.py", "stoppedlater", timeout=90, check=False,
              env=mpi_env(MINIDIST_COMM_TIMEOUT=3))
    assert out.returncode != 0, out.stderr
    assert "world rank 0 answered nothing for 10 s" in out.stderr, out.stderr
    assert out.stderr.count("answered nothing") == 1, out.stderr      # said once
    assert "done waiting" not in out.stdout


@pytest.mark.mpi
@pytest.mark.parametrize("mode", [pytest.param("alone", marks=pytest.mark.slow), "held"])
def test_a_rank_busy_or_held_past_the_timeout_is_waited_for(mpi, mode):
    """The other side of the test above, under a 2 s timeout: rank 1 computes alone for
    14 s (Python holding the interpreter 7 s, as a tokenizer would, then numpy), or is held
    (SIGSTOP, then SIGCONT: a loaded node) for 8 s, while the others wait_for_all. Its
    watchdog answers (once it runs again), so they wait, and every rank finishes (the
    reverted first try of this check asked once and gave up after 3 s: it aborted a
    healthy job in CI, tests/test_async_save.py's rank held 3 s under a 1 s timeout); held
    runs by default, alone (~15 s) under -m slow. By hand:
    MINIDIST_COMM_TIMEOUT=2 mpiexec -n 3 python tests/scripts/comm_small.py alone"""
    out = mpi(3, "tests/scripts/comm_small.py", mode, timeout=90,
              env=mpi_env(MINIDIST_COMM_TIMEOUT=2))
    assert out.stdout.count("done waiting") == 3, out.stdout + out.stderr
    assert "aborting" not in out.stderr, out.stderr


@pytest.mark.mpi
def test_a_rank_that_dies_before_mpi_init_ends_the_job(mpi):
    """Rank 1 raises before comm.init: MPICH's launcher leaves the others in MPI_Init for
    ever (pmodels/mpich#6124). With a 3 s timeout the waiting ranks exit with a stack dump
    naming the wait (the first one's always comes through: once it exits the launcher may
    kill the rest before they print); the failing rank's own traceback comes through. Open
    MPI's mpirun ends the job itself once a rank exits non-zero ("exited with non-zero
    status", no dump needed: tests/test_openmpi.py runs this file under it). By hand:
    MINIDIST_COMM_TIMEOUT=3 mpiexec -n 3 python tests/scripts/comm_small.py preinit"""
    out = mpi(3, "tests/scripts/comm_small.py", "preinit", timeout=60, check=False,
              env=mpi_env(MINIDIST_COMM_TIMEOUT=3))
    assert out.returncode != 0, out.stderr
    assert "rank 1 failed before MPI_Init" in out.stderr, out.stderr
    dumps = out.stderr.count("in _wait_in_mpi_init_for_every_rank")
    assert 1 <= dumps <= 2 or "exited with non-zero status" in out.stderr, out.stderr
    assert dumps <= 2, out.stderr
    assert "unreachable" not in out.stdout


def test_a_sub_second_timeout_does_not_bound_mpi_init(monkeypatch):
    """--comm-timeout 0.01 also bounded MPI_Init, which takes up to a second on a busy
    machine: a healthy job was killed while it started (a stack dump, or only MPICH's
    noise). MPI_Init now waits at least MPI_INIT_AT_LEAST_S; 0 still waits for ever, and a
    timeout above the floor (the 3 s of the test above) is kept."""
    monkeypatch.delenv("MINIDIST_COMM_TIMEOUT", raising=False)
    assert comm.mpi_init_wait_s(0.01) == comm.MPI_INIT_AT_LEAST_S == 2.0
    assert comm.mpi_init_wait_s(0) == 0 and comm.mpi_init_wait_s(3) == 3
    assert comm.mpi_init_wait_s(None) == 600
    # walk 37: "a big number for never" overflowed faulthandler's timer, a traceback per rank
    import faulthandler
    assert comm.mpi_init_wait_s(1e30) == comm.MPI_INIT_AT_MOST_S
    faulthandler.dump_traceback_later(comm.mpi_init_wait_s(1e30), exit=True)
    faulthandler.cancel_dump_traceback_later()


@pytest.mark.mpi
def test_collective_timeout_names_op_group_and_missing_ranks(mpi):
    """Rank 1 never reaches the all_reduce; with a 3 s timeout the others abort the job,
    naming the op, the group and rank 1. By hand:
    MINIDIST_COMM_TIMEOUT=3 mpiexec -n 3 python tests/scripts/comm_small.py block"""
    out = mpi(3, "tests/scripts/comm_small.py", "block", timeout=60, check=False,
              env=mpi_env(MINIDIST_COMM_TIMEOUT=3))
    assert out.returncode != 0, out.stderr
    assert "all_reduce #1 on group 'world' (world ranks [0, 1, 2]) waited more than 3 s" \
        in out.stderr, out.stderr
    assert "MINIDIST_COMM_TIMEOUT" in out.stderr
    assert "world ranks that did not arrive: [1]" in out.stderr
    # once, by rank 0, the lowest waiting (walk 37: once per waiting rank)
    assert out.stderr.count("waited more than 3 s") == 1, out.stderr


@pytest.mark.mpi
def test_point_to_point_timeout_names_the_peer(mpi):
    """A pipeline's receive whose sender never comes: with a 3 s timeout the job aborts,
    naming the peer. By hand:
    MINIDIST_COMM_TIMEOUT=3 mpiexec -n 2 python tests/scripts/comm_small.py p2p"""
    out = mpi(2, "tests/scripts/comm_small.py", "p2p", timeout=60, check=False,
              env=mpi_env(MINIDIST_COMM_TIMEOUT=3))
    assert out.returncode != 0, out.stderr
    assert "recv with rank 1 of group 'world' waited more than 3 s for world rank 1" \
        in out.stderr, out.stderr
    assert "unreachable" not in out.stdout


@pytest.mark.mpi
def test_ranks_finishing_at_different_times_exit_cleanly(mpi):
    """A clean finish is not an abort: rank 0 leaves 1.5 s after the others (which announce
    their exit and wait for it). By hand: mpiexec -n 3 python tests/scripts/comm_small.py finish"""
    out = mpi(3, "tests/scripts/comm_small.py", "finish", timeout=60)
    assert all(f"rank {r} finished" in out.stdout for r in range(3)), out.stderr
    assert "abort" not in out.stderr.lower()
