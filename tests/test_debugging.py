"""Debugging a distributed job: sync comm (every collective in the calling thread), pdb on one
rank that ends the job cleanly (minidist/comm/rankpdb.py, attach.py, debug.breakpoint_on), and
the README's debugging recipes, run with their pdb commands fed on stdin under mpiexec.

Each test's docstring gives the command to run it by hand.
"""
import os
import re
import signal
import socket
import subprocess
import sys

import pytest

from minidist.train.args import train_parser
from mpirun import ROOT, mpi_env, mpiexec, run_job, run_mpi, tagged_json

RECIPE_RANK0 = ["import minidist.comm.ring",
                "b minidist.comm.ring.ring_reduce_scatter_in_place",
                "c", "p ch.rank, buf.size", "q"]
RECIPE_WALKTHROUGH = ["p bufs", "s"]
DDP_SCRIPT = "tests/scripts/sync_comm_check.py"


def readme_text():
    """The top README and the comm chapter, where the recipes are written down."""
    text = ""
    for path in ("README.md", "minidist/comm/README.md"):
        if os.path.exists(os.path.join(ROOT, path)):
            text += open(os.path.join(ROOT, path)).read()
    return text


def run_fed(cmd, lines, timeout=90, env=None):
    """Run `cmd` (mpiexec ...) with `lines` on its stdin (run_job: a timeout kills its
    process group); (exit status, stdout, stderr)."""
    job = run_job(cmd, input="".join(line + "\n" for line in lines), timeout=timeout, env=env,
                  check=False)
    return job.returncode, job.stdout, job.stderr


def attach_to_rank1(script_args, lines, port_offset):
    """Start `mpiexec -n 2 python *script_args` (rank 1 serving pdb), attach, feed `lines`;
    returns (attach console output, job's return code, job's stdout, job's stderr)."""
    base = 20000 + (os.getpid() * 7 + port_offset) % 20000
    env = mpi_env(MINIDIST_PDB_PORT=base, MINIDIST_COMM_TIMEOUT=0)
    job = subprocess.Popen([mpiexec(), "-n", "2", sys.executable, *script_args], cwd=ROOT,
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           start_new_session=True)
    try:
        client = subprocess.run([sys.executable, "-m", "minidist.comm.attach", str(base + 1),
                                 "--wait", "60"], cwd=ROOT, env=env, timeout=90, text=True,
                                input="".join(line + "\n" for line in lines),
                                capture_output=True)
        out, err = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    return client.stdout + client.stderr, job.returncode, out, err


def test_sync_comm_flag_in_help():
    """`python examples/train_gpt.py --help` shows --sync-comm and what it costs."""
    text = " ".join(train_parser().format_help().split())
    assert "--sync-comm" in text and "overlap" in text


@pytest.mark.mpi
def test_sync_comm_ddp_exact_and_in_the_calling_thread():
    """Overlapped DDP with sync comm equals one process (float64), starts no communication
    thread, and a tracer on the main thread (what pdb is) sees the gradient buckets in the
    ring; without it, only the 1-element loss average. By hand:

        MINIDIST_SYNC_COMM=1 mpiexec -n 2 python tests/scripts/sync_comm_check.py --watch
        mpiexec -n 2 python tests/scripts/sync_comm_check.py --watch
    """
    on = tagged_json(run_mpi(2, DDP_SCRIPT, "--watch", env=mpi_env(MINIDIST_SYNC_COMM=1)))[0]
    off = tagged_json(run_mpi(2, DDP_SCRIPT, "--watch", env=mpi_env(MINIDIST_SYNC_COMM=0)))[0]
    for r in (on, off):
        assert r["loss_diff"] <= 1e-10 and r["param_diff"] <= 1e-10, r
    assert on["sync_comm"] and not [t for t in on["comm_threads"] if "comm" in t], on
    assert on["traced_max_size"] > 1 and on["traced_calls"] > on["buckets"], on
    assert not off["sync_comm"] and off["traced_max_size"] == 1, off


@pytest.mark.mpi
def test_readme_recipe_rank0_stops_in_a_gradient_bucket_and_q_ends_the_job():
    """The README's recipe, on a DDP script: pdb on rank 0 stops in the ring in a gradient
    bucket (sync comm on the debugged rank), and `q` ends both ranks at once. By hand:

        mpiexec -n 2 python -m minidist.comm.rankpdb tests/scripts/sync_comm_check.py
    """
    text = readme_text()
    assert "mpiexec -n 4 python -m minidist.comm.rankpdb my_script.py" in text
    for line in RECIPE_RANK0:
        assert re.search(rf"\(Pdb rank 0\) {re.escape(line)}\s*(#|\n)", text), line
    rc, out, err = run_fed([mpiexec(), "-n", "2", sys.executable, "-m", "minidist.comm.rankpdb",
                            DDP_SCRIPT], RECIPE_RANK0)
    size = re.search(r"\(0, (\d+)\)", out)
    assert size and int(size.group(1)) > 1, (out, err)     # a bucket, not the loss
    # said once (the debugger printed it, then the abort again: found by a first-use walk)
    assert (out + err).count("[rank 0] debugger quit: ending the whole MPI job") == 1, (out,
                                                                                       err)
    assert rc != 0 and "RESULT" not in out, (rc, out, err)


@pytest.mark.mpi
def test_readme_recipe_on_train_gpt_stops_in_a_gradient_bucket(corpus, tmp_path):
    """The same recipe on examples/train_gpt.py (overlapped DDP): rankpdb's
    MINIDIST_SYNC_COMM=1 reaches comm.init (--sync-comm left unset defers to it), so the
    first stop is in a gradient bucket, not the 1-element loss average. By hand:

        mpiexec -n 2 python -m minidist.comm.rankpdb examples/train_gpt.py --steps 1
    """
    flags = ["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "16",
             "--batch-size", "4", "--steps", "1", "--eval-iters", "1", "--sample", "0",
             "--data", corpus, "--cache-dir", str(tmp_path / "cache")]
    rc, out, err = run_fed([mpiexec(), "-n", "2", sys.executable, "-m", "minidist.comm.rankpdb",
                            "examples/train_gpt.py", *flags], RECIPE_RANK0)
    size = re.search(r"\(0, (\d+)\)", out)
    assert size and int(size.group(1)) > 1, (out, err)     # a bucket, not the loss
    assert (out + err).count("[rank 0] debugger quit: ending the whole MPI job") == 1, (out,
                                                                                       err)


def test_sync_comm_flag_defers_to_the_environment():
    """--sync-comm unset is None (comm.init then reads MINIDIST_SYNC_COMM), not False."""
    assert train_parser().parse_args([]).sync_comm is None
    assert train_parser().parse_args(["--sync-comm"]).sync_comm is True


@pytest.mark.mpi
def test_rankpdb_finishing_ends_the_job_without_restarting():
    """`c` runs to the end; the script is not restarted (pdb would, alone, and hang):

        mpiexec -n 2 python -m minidist.comm.rankpdb tests/scripts/sync_comm_check.py
    """
    rc, out, err = run_fed([mpiexec(), "-n", "2", sys.executable, "-m", "minidist.comm.rankpdb",
                            DDP_SCRIPT], ["c", "c", "c"])
    assert rc == 0, (out, err)
    assert out.count("RESULT") == 1 and "finished; not restarted" in out, (out, err)


@pytest.mark.mpi
def test_rankpdb_stops_in_post_mortem_where_the_debugged_rank_raised():
    """An uncaught exception on the debugged rank stops it in pdb where it was raised, as
    `python -m pdb` does (the abort handler ended the job at once, the frames gone: first-use
    walk of 2026-11-30), the other rank waiting in its next all-reduce; `q` there, or `c`,
    ends the job once, nothing run past the error. By hand:

        mpiexec -n 2 python -m minidist.comm.rankpdb tests/scripts/comm_small.py raise
    """
    cmd = [mpiexec(), "-n", "2", sys.executable, "-m", "minidist.comm.rankpdb",
           "tests/scripts/comm_small.py", "raise"]
    rc, out, err = run_fed(cmd, ["c", "p seen, world.rank", "q"], timeout=60)
    assert "[rank 0] uncaught KeyError: post mortem debugging" in out, (out, err)
    assert "({'sum': 3.0}, 0)" in out and "KeyError: 'mean'" in err, (out, err)
    assert (out + err).count("[rank 0] debugger quit: ending the whole MPI job") == 1, (out,
                                                                                       err)
    assert rc != 0 and "done" not in out, (rc, out, err)
    rc, out, err = run_fed(cmd, ["c", "c"], timeout=60)
    assert "[rank 0] uncaught KeyError (above): ending the whole MPI job" in out + err, (out,
                                                                                         err)
    assert rc != 0 and "done" not in out, (rc, out, err)


@pytest.mark.mpi
def test_rankpdb_warns_of_an_exported_timeout_at_its_first_stop():
    """rankpdb keeps an exported MINIDIST_COMM_TIMEOUT (train.sbatch exports one), and the
    others then end the job that long into a person's stepping: its first stop says so, as
    breakpoint_on's does (it said nothing: first-use walk of 2026-11-30). By hand:

        MINIDIST_COMM_TIMEOUT=60 mpiexec -n 2 python -m minidist.comm.rankpdb \
            tests/scripts/comm_small.py finish
    """
    rc, out, err = run_fed([mpiexec(), "-n", "2", sys.executable, "-m", "minidist.comm.rankpdb",
                            "tests/scripts/comm_small.py", "finish"], ["c"], timeout=60,
                           env=mpi_env(MINIDIST_COMM_TIMEOUT=60))
    assert out.count("[rank 0] note: the other ranks end the job once they wait 60 s for "
                     "this one; MINIDIST_COMM_TIMEOUT=0") == 1, (out, err)
    assert rc == 0 and "rank 1 finished" in out, (rc, out, err)


@pytest.mark.mpi
def test_rankpdb_bad_script_is_one_line():
    """mpiexec -n 2 python -m minidist.comm.rankpdb nonexistent.py"""
    rc, out, err = run_fed([mpiexec(), "-n", "2", sys.executable, "-m", "minidist.comm.rankpdb",
                            "nonexistent.py"], [], timeout=60)
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert rc == 2 and len(errors) == 1 and "nonexistent.py" in errors[0], (rc, out, err)


@pytest.mark.mpi
def test_rankpdb_a_rank_the_job_lacks_is_one_line():
    """mpiexec -n 2 python -m minidist.comm.rankpdb --rank 2 script.py: no rank 2 to stop
    in pdb, so one error line naming the ranks there are, exit 2 (not the script run with
    no debugger)."""
    rc, out, err = run_fed([mpiexec(), "-n", "2", sys.executable, "-m", "minidist.comm.rankpdb",
                            "--rank", "2", "tests/scripts/sync_comm_check.py"], [], timeout=60)
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert rc == 2 and errors == ["error: --rank 2: this job has ranks 0 to 1"], (rc, out, err)


@pytest.mark.mpi
def test_attach_clear_asks_on_the_console():
    """`cl` with no argument asks "Clear all breaks?" on the attach console, not on rank 1's
    stdin; the answer clears the breakpoint, and `c` runs the job to its end. By hand:

        mpiexec -n 2 python tests/scripts/comm_small.py breakpoint
        python -m minidist.comm.attach 4445          # in a second terminal
    """
    console, rc, out, err = attach_to_rank1(
        ["tests/scripts/comm_small.py", "breakpoint"],
        ["import minidist.comm.ring", "b minidist.comm.ring.ring_reduce_scatter_in_place",
         "cl", "y", "c"], port_offset=1)
    assert "Clear all breaks? Deleted breakpoint 1" in console, (console, err)
    assert rc == 0 and "rank 0 done 3.0" in out and "rank 1 done 3.0" in out, (out, err)


@pytest.mark.mpi
def test_the_builtin_breakpoint_on_rank_1_is_served_to_the_attach_console():
    """breakpoint() on rank 1 showed a (Pdb) prompt that read a stdin mpiexec feeds rank 0
    alone: the job hung (first-use walk 43). comm.init makes it breakpoint_on's pdb, served
    as `debug.breakpoint_on(1)` is, stopped in the caller's frame; a second breakpoint()
    reuses the console (a second server on the port ended the job: review 43). By hand:

        mpiexec -n 2 python tests/scripts/comm_small.py builtin
        python -m minidist.comm.attach 4445          # in a second terminal
    """
    console, rc, out, err = attach_to_rank1(["tests/scripts/comm_small.py", "builtin"],
                                            ["p buf", "c", "p buf", "c"], port_offset=4)
    assert "comm_small.py" in console and "-> world.all_reduce(buf)" in console and \
        "array([2., 2., 2., 2.])" in console, (console, err)       # stopped in the script
    assert "array([3., 3., 3., 3.])" in console, (console, err)    # again, the same console
    assert rc == 0 and "rank 0 done 6.0" in out and "rank 1 done 6.0" in out, (out, err)


@pytest.mark.mpi
def test_a_debugger_port_in_use_is_one_line_naming_the_variable():
    """Rank 1's pdb port held by another program (another job's debugger on a shared node):
    one `error:` line naming the port and MINIDIST_PDB_PORT, the job ended (it was OSError's
    traceback, "Address already in use", and no word of the variable: first-use walk of
    2026-11-30). By hand, with port 4445 taken:

        mpiexec -n 2 python tests/scripts/comm_small.py breakpoint
    """
    base = 20000 + (os.getpid() * 7 + 5) % 20000
    holder = socket.create_server(("127.0.0.1", base + 1))
    try:
        job = run_job([mpiexec(), "-n", "2", sys.executable, "tests/scripts/comm_small.py",
                       "breakpoint"], timeout=60, check=False,
                      env=mpi_env(MINIDIST_PDB_PORT=base, MINIDIST_COMM_TIMEOUT=0))
    finally:
        holder.close()
    errors = [line for line in job.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"127.0.0.1:{base + 1}" in errors[0], job.stderr
    assert "MINIDIST_PDB_PORT" in errors[0] and "Traceback" not in job.stderr, job.stderr
    assert job.returncode != 0 and "done" not in job.stdout, (job.returncode, job.stdout)


def test_attach_with_nothing_listening_says_to_run_it_on_the_ranks_host():
    """python -m minidist.comm.attach PORT, nothing listening: one error line, exit 2, that
    says to run it on the host the rank's waiting line names (a rank of a job on another node
    listens on that node's 127.0.0.1: first-use walk of 2026-11-30)."""
    with socket.create_server(("127.0.0.1", 0)) as probe:
        port = probe.getsockname()[1]          # a port nothing listens on once closed
    done = subprocess.run([sys.executable, "-m", "minidist.comm.attach", str(port)], cwd=ROOT,
                          timeout=60, capture_output=True, text=True)
    assert done.returncode == 2 and done.stderr.startswith(
        f"error: nothing listens on 127.0.0.1:{port}"), done.stderr
    assert "'waiting for a debugger on HOST' line, then run this on HOST" in done.stderr


@pytest.mark.mpi
def test_attach_quit_ends_the_job():
    """`q` on rank 1 ends the job, rank 0 (waiting in the all-reduce) included; the line it
    waited with named its host, where attach must run on a cluster (first-use walk of
    2026-11-30: it named the port alone)."""
    console, rc, out, err = attach_to_rank1(["tests/scripts/comm_small.py", "breakpoint"],
                                            ["q"], port_offset=2)
    assert "[rank 1] debugger quit: ending the whole MPI job" in console, (console, err)
    assert rc != 0 and "done" not in out, (rc, out, err)
    # the host to attach on: a rank on another node listens on that node's 127.0.0.1
    assert f"[rank 1] waiting for a debugger on {socket.gethostname()}: python -m " \
        "minidist.comm.attach" in err, err


@pytest.mark.mpi
def test_rankpdb_on_rank1_through_attach():
    """The README's `--rank 1` recipe: rank 1 under pdb, served to the attach console.

        mpiexec -n 2 python -m minidist.comm.rankpdb --rank 1 tests/scripts/sync_comm_check.py
        python -m minidist.comm.attach 4445
    """
    assert "python -m minidist.comm.attach 4445" in readme_text()
    console, rc, out, err = attach_to_rank1(
        ["-m", "minidist.comm.rankpdb", "--rank", "1", DDP_SCRIPT],
        RECIPE_RANK0[:3] + ["p ch.rank, buf.size", "c"] + ["cl", "y", "c"], port_offset=3)
    size = re.search(r"\(1, (\d+)\)", console)
    assert size and int(size.group(1)) > 1, (console, err)
    assert rc == 0 and "RESULT" in out, (rc, out, err)


@pytest.mark.mpi
def test_under_rankpdb_ctrl_c_is_the_debugged_ranks_and_the_others_nap():
    """Ctrl-C reaches every rank of mpiexec's job: under rankpdb the others ignore it, so it
    breaks into pdb on the debugged rank as plain pdb's does (first-use walk 43: they died of
    it at the next `c`); and the ranks waiting for it nap instead of spinning (walk 43: 30 s
    of system CPU in 20 s at a prompt). By hand:

        mpiexec -n 2 python -m minidist.comm.rankpdb tests/scripts/comm_small.py handlers
    """
    job = run_job([mpiexec(), "-n", "2", sys.executable, "-m", "minidist.comm.rankpdb",
                   "tests/scripts/comm_small.py", "handlers"], input="c\n", timeout=60)
    assert "rank 1 SIGINT ignored True, wait poll" in job.stdout, (job.stdout, job.stderr)
    assert "rank 0 SIGINT ignored False, wait poll" in job.stdout, (job.stdout, job.stderr)


def test_ring_walkthrough_pdb_recipe():
    """python examples/ring_walkthrough.py --pdb, then `p bufs` and `s`, then `p bufs`."""
    text = readme_text()
    assert "python examples/ring_walkthrough.py --pdb" in text
    for line in RECIPE_WALKTHROUGH:
        assert re.search(rf"\(Pdb\) {re.escape(line)}\s*(#|\n)", text), line
    done = subprocess.run([sys.executable, "examples/ring_walkthrough.py", "--pdb", "--ranks",
                           "3", "--n", "5"], cwd=ROOT, timeout=60, capture_output=True,
                          text=True, input="p bufs\ns\np bufs\nc\n")
    first = ", ".join(f"array([{r}., {r}., {r}., {r}., {r}.])" for r in (1, 2, 3))
    assert done.stdout.count(f"[{first}]") == 2 and "NameError" not in done.stdout, done.stdout
    assert "_ring_phase()" in done.stdout and "OK" in done.stdout, done.stdout


@pytest.mark.parametrize("script, lines, shows", [
    ("examples/zero_walkthrough.py", ["p shards[1]", "p shards[1][0].grad", "n", "c"],
     "Shard(rank 1, root[21:42]: wte.weight[21:42])"),
    ("examples/moe_walkthrough.py", ["p sends", "c"], "array([[11,  9],"),
    ("examples/ring_attention_walkthrough.py", ["p held, src, kp", "b attend_block", "c",
                                                "p q_pieces", "cl", "y", "c", "c", "c", "c"],
     "([0, 1, 2, 3], 1, array([ 2,  3, 12, 13]))")])
def test_the_walkthroughs_stop_in_pdb_where_their_docstrings_say(script, lines, shows):
    """The MoE and ring-attention walkthroughs take --pdb as the ring and ZeRO ones do
    (first-use walk 43 found none there), the names their docstrings print in scope (the
    ZeRO one's `p shards[1]`, which minidist/zero/README.md shows too):

        python examples/zero_walkthrough.py --pdb
        python examples/moe_walkthrough.py --pdb
        python examples/ring_attention_walkthrough.py --pdb
    """
    done = subprocess.run([sys.executable, script, "--pdb"], cwd=ROOT, timeout=60,
                          capture_output=True, text=True, input="\n".join(lines) + "\n")
    assert shows in done.stdout and "Error" not in done.stdout, done.stdout
    assert done.returncode == 0, done.stderr


ZERO3_COMMAND = ("mpiexec -n 2 python -m minidist.comm.rankpdb examples/train_gpt.py --zero 3 "
                 "--n-layer 2 --n-embd 32")


def zero3_recipe():
    """minidist/zero/README.md's ZeRO-3 session under ZERO3_COMMAND: the lines typed at
    `(Pdb rank 0)` (their comments cut) and the lines it shows pdb printing."""
    text = open(os.path.join(ROOT, "minidist/zero/README.md")).read()
    block = text.split(ZERO3_COMMAND + "\n", 1)[1].split("```", 1)[0]
    typed = [line[len("(Pdb rank 0) "):].split("#")[0].strip() for line in block.splitlines()
             if line.startswith("(Pdb rank 0) ")]
    shown = [line.split("#")[0].strip() for line in block.splitlines()
             if line.strip() and not line.startswith("(Pdb rank 0) ")]
    return typed, shown


@pytest.mark.mpi
def test_the_zero_chapters_zero3_session_stops_in_the_gathers_it_shows(corpus, tmp_path):
    """The ZeRO chapter's rankpdb session, typed as written: stopped in
    ZeroStage3.before_block, block 0's slot holds nothing, then h.0; in the backward of the
    last block the two block buffers and the root's still hold h.0, h.1 and the root (no
    second gather), and `w` runs through train_step (the chapter's names were untested):

        mpiexec -n 2 python -m minidist.comm.rankpdb examples/train_gpt.py --zero 3 \\
            --n-layer 2 --n-embd 32
    """
    typed, shown = zero3_recipe()
    assert typed[:2] == ["import minidist.zero.stage3",
                         "b minidist.zero.stage3.ZeroStage3.before_block"], typed
    assert shown == ["(1, ['h.0', 'h.1', 'root'])"], shown
    flags = ZERO3_COMMAND.split()[6:] + [
        "--block-size", "16", "--batch-size", "4", "--steps", "1", "--eval-iters", "1",
        "--sample", "0", "--data", corpus, "--cache-dir", str(tmp_path / "cache")]
    rc, out, err = run_fed([mpiexec(), "-n", "2", sys.executable, "-m", "minidist.comm.rankpdb",
                            *flags], typed + ["q"])
    for printed in ["(0, None)", *shown, "train_step()"]:
        assert printed in out, (printed, out, err)
    assert "Error" not in out and rc != 0, (rc, out, err)
