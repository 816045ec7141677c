"""What a user meets on the command line of examples/train_gpt.py when the layout or the ranks
are wrong, case by case: one `error:` line, exit status 2, before step 0.

- Flags the layout makes idle (DDP flags with one replica, communication flags on one
  process, a ZeRO shard the layout does not fit); the batch's and the rank count's errors
  name what would run.
- A problem one rank alone finds before MPI_Init, a launcher of another MPI, a second run
  saving into the same folder, a --save folder on each node's own disk.

Bad input in general: tests/test_cli.py.

    mpiexec -n 2 python tests/scripts/node_lacks_data.py --data FILE   # one line naming rank 1
"""
import os
import signal
import socket
import subprocess
import sys

import pytest

from minidist.train.args import train_parser
from minidist.train.cli import UsageError, check_flags
from tests.mpirun import ROOT, lines_of, mpi_env, mpiexec, run_job


@pytest.mark.parametrize("ranks,flags,refused", [
    (1, ["--bucket-mb", "4"], "--bucket-mb 4.0: sets DDP's bucket size, which this run does "
     "not use (this layout has one replica: run more ranks for dp, cp or ep, or leave "
     "--bucket-mb out)"),
    (4, ["--pp", "2", "--tp", "2", "--ddp", "bucketed"], "--ddp bucketed: sets how DDP"),
    (2, ["--ddp", "naive"], None),                             # dp 2: DDP averages
    (2, ["--cp", "2", "--ddp", "naive"], None),                # over the cp ranks
    (2, ["--moe-experts", "2", "--ep", "2", "--bucket-mb", "2"], None),  # the dense ones over ep
])
def test_ddp_flags_with_one_replica_are_refused(ranks, flags, refused):
    """--ddp and --bucket-mb do nothing where no gradient is averaged (one process, or every
    rank a tp / pp shard of one replica): refused by check_layout, which knows the replicas
    (dp x ep x cp), as check_flags refuses them under --zero. Was: accepted, ignored."""
    assert _layout_refusal(ranks, flags, refused)


@pytest.mark.parametrize("ranks,flags,refused", [
    (1, ["--trace", "t.json"], "--trace t.json: sets the file the collectives' trace is "
     "written to, which this run does not use (one process sends nothing: run more ranks "
     "(mpirun -n N), or leave --trace out)"),
    (1, ["--comm", "mpi"], "--comm mpi: sets the collectives' algorithm"),
    (1, ["--sync-comm"], "--sync-comm: sets where the collectives run"),
    (1, ["--comm-timeout", "5"], "--comm-timeout 5.0: sets how long a collective may wait"),
    (1, ["--zero", "1", "--trace", "t.json"], None),   # ZeRO over one rank: a group, a trace
    (2, ["--trace", "t.json", "--comm", "mpi"], None),
])
def test_communication_flags_on_one_process_are_refused(ranks, flags, refused):
    """One process without ZeRO has no group: --trace (it trained the whole run, then said
    there was no trace), --comm and --sync-comm would do nothing; refused before step 0."""
    assert _layout_refusal(ranks, flags, refused)


def _layout_refusal(ranks, flags, refused):
    """check_layout on `ranks` accepts `flags` (refused None) or refuses them with an error
    containing `refused`."""
    from minidist.train.strategy import check_layout
    args = train_parser().parse_args(flags)
    if refused is None:
        check_layout(args, ranks)
        return True
    with pytest.raises(UsageError) as e:
        check_layout(args, ranks)
    return refused in str(e.value)


@pytest.mark.parametrize("ranks,flags,refused", [
    (4, ["--zero", "3", "--zero-shard", "3"], "--zero-shard 3: the ranks each replica is "
     "sharded over must divide dp 4: one of 1, 2, 4 (typically the ranks of one node)"),
    (4, ["--zero", "1", "--zero-shard", "0"], "--zero-shard 0: the ranks each replica"),
    (4, ["--overlap-param-gather"], "--overlap-param-gather: sets when ZeRO-1 and -2 wait for "
     "the updated parameters' all-gathers (ZeRO-3 gathers before each block anyway), which "
     "this run does not use (use --zero 1 or 2, or leave --overlap-param-gather out)"),
    (4, ["--zero", "3", "--overlap-param-gather"], "--overlap-param-gather: sets when"),
    (4, ["--zero", "2", "--overlap-param-gather"], None),
    (4, ["--zero-shard", "2"], "--zero-shard 2: sets the ranks ZeRO shards each replica over, "
     "which this run does not use (add --zero 1, 2 or 3, or leave --zero-shard out)"),
    (4, ["--zero", "2", "--zero-shard", "2", "--moe-experts", "4", "--ep", "2"], None),
    (4, ["--zero", "2", "--zero-shard", "4", "--moe-experts", "4", "--ep", "2"], None),
    (4, ["--zero", "2", "--zero-shard", "3", "--moe-experts", "4", "--ep", "2"],
     "--zero-shard 3: the ranks each replica is sharded over must divide dp x ep = 2 x 2 = "
     "4: one of 1, 2, 4"),
    (4, ["--zero", "2", "--zero-shard", "1", "--tp", "2"], None),   # each tp rank's dp
    (4, ["--zero", "2", "--zero-shard", "2"], None),
    (4, ["--zero", "2", "--zero-shard", "4"], None),            # one group: plain ZeRO
    (4, ["--zero", "3", "--zero-shard", "2", "--cp", "2"], None),   # over dp x cp
    (4, ["--zero", "3", "--zero-shard", "1", "--pp", "2"], None),   # each stage's dp
    (4, ["--zero", "3", "--zero-shard", "3", "--cp", "2"], "--zero-shard 3: the ranks each "
     "replica is sharded over must divide dp x cp = 2 x 2 = 4"),
])
def test_zero_shard_is_checked_against_the_layout(ranks, flags, refused):
    """--zero-shard K (hybrid sharding): K divides ZeRO's dp (x ep x cp) ranks, needs --zero;
    one error line before any communication."""
    assert _layout_refusal(ranks, flags, refused)


@pytest.mark.mpi
def test_a_problem_one_rank_alone_finds_stops_every_rank_naming_it(corpus, tmp_path, mpi):
    """The flags are checked on each rank before MPI starts, and a rank's node may lack what
    another's has (here rank 1's --data path): the ranks agree on the verdict right after
    MPI_Init, and every rank stops with one error line naming the rank, exit 2, in seconds
    (rank 1 left alone before MPI_Init: the others waited there for the timeout, 600 s by
    default, then died with a stack dump; rank 1's line was never printed). By hand:
    mpiexec -n 2 python tests/scripts/node_lacks_data.py --data FILE"""
    # "in seconds": a job left waiting in MPI_Init for the 100 s timeout fails as timed out
    out = mpi(2, "tests/scripts/node_lacks_data.py", "--data", corpus, "--steps", "2",
              "--cache-dir", tmp_path / "cache", timeout=60, check=False,
              env=mpi_env(MINIDIST_COMM_TIMEOUT=100))
    assert out.returncode == 2, out.stderr
    assert out.stderr.count("error: ") == 1 and "Traceback" not in out.stderr, out.stderr
    assert f"error: --data {corpus}.not-on-this-node: no such file" in out.stderr
    assert "(found on rank 1 of 2: do the nodes differ?)" in out.stderr, out.stderr


def test_a_launcher_of_another_mpi_is_one_error_line_not_n_separate_runs(corpus, tmp_path):
    """First-use walk 31: Open MPI's mpirun with the mpich wheel's libmpi starts each rank as
    an MPI job of its own: N copies trained, saved into one folder (prune deleted one run's
    checkpoint) and exited 0. Two processes with Open MPI's variables (what its mpirun sets)
    now stop at MPI_Init: one error line (from the launcher's rank 0) naming both sizes and
    the library mpi4py loaded, exit 2 on both, nothing trained or saved."""
    procs = [subprocess.Popen(
        [sys.executable, os.path.join(ROOT, "examples", "train_gpt.py"), "--data", corpus,
         "--steps", "2", "--n-layer", "1",
         "--n-embd", "16", "--cache-dir", str(tmp_path / "cache"), "--save", "ck"],
        cwd=tmp_path, env=mpi_env(OMPI_COMM_WORLD_SIZE="2", OMPI_COMM_WORLD_RANK=str(r),
                                  OMPI_COMM_WORLD_LOCAL_RANK=str(r),
                                  OMPI_COMM_WORLD_LOCAL_SIZE="2"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [2, 2], outs
    errors = [line for _, err in outs for line in err.splitlines() if line.startswith("error:")]
    assert errors == [errors[0]] and errors[0].startswith(
        "error: the launcher started 2 processes but MPI sees 1: mpi4py loaded another MPI "
        "than the launcher's ("), outs
    assert all("step " not in out for out, _ in outs) and not os.listdir(tmp_path / "ck")


def test_a_pmix_launcher_for_an_mpich_without_pmix_is_one_error_line(corpus, tmp_path):
    """The first-use walk of 2026-11-30: Open MPI 5's mpirun (PRRTE, PMIx) with the mpich
    wheel's python: MPICH aborted inside MPI_Init ("Runtime environment uses unsupported PMI
    version PMIx"), an error stack per rank. Two processes with what that mpirun sets
    (PMIX_NAMESPACE, OMPI_COMM_WORLD_*) now stop before MPI_Init: one error line from the
    launcher's rank 0, exit 2 on both, nothing trained. (`pmix_mismatch` alone: an MPICH
    built with PMIx, another library, no PMIx launcher, or PMI 1 named passes: hydra's
    `PMIX_NAMESPACE=x MPIR_CVAR_PMI_VERSION=1 mpiexec -n 2` initialises, without it aborts:
    that, hydra's rank with an inherited PMIX_NAMESPACE, is its own line.)"""
    from minidist.comm import pmix_mismatch
    wheel = "MPICH Version:      5.0.2\nMPICH configure:    --with-pm=hydra:gforker\n"
    assert pmix_mismatch({}, wheel) is None
    assert pmix_mismatch({"PMIX_NAMESPACE": "x"}, wheel.replace("hydra", "--with-pmix")) is None
    assert pmix_mismatch({"PMIX_NAMESPACE": "x"}, "Open MPI v5.0.11, ...") is None
    inherited = pmix_mismatch({"PMIX_NAMESPACE": "x", "PMI_FD": "9"}, wheel)  # hydra's rank
    assert inherited.startswith("PMIX_NAMESPACE is set, inherited from an outer PMIx launch")
    for var in ("MPIR_CVAR_PMI_VERSION", "MPICH_PMI_VERSION"):   # PMI 1 asked: MPICH ignores
        assert pmix_mismatch({"PMIX_NAMESPACE": "x", var: "1"}, wheel) is None   # PMIX_*
    assert pmix_mismatch({"PMIX_NAMESPACE": "x", "MPIR_CVAR_PMI_VERSION": "x"}, wheel)
    procs = [subprocess.Popen(
        [sys.executable, os.path.join(ROOT, "examples", "train_gpt.py"), "--data", corpus,
         "--steps", "2", "--n-layer", "1", "--n-embd", "16", "--cache-dir",
         str(tmp_path / "cache")],
        cwd=tmp_path, env=mpi_env(PMIX_NAMESPACE="prterun-host-1@1", PMIX_RANK=str(r),
                                  OMPI_COMM_WORLD_SIZE="2", OMPI_COMM_WORLD_RANK=str(r)),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [2, 2], outs
    said = "".join(err for _, err in outs)
    assert said.startswith("error: the launcher speaks PMIx (Open MPI's mpirun, or srun "
                           "--mpi=pmix) but mpi4py loaded an MPI without it (MPICH Version: ")
    assert said.count("\n") == 1 and "Abort" not in said, outs
    assert all("step " not in out for out, _ in outs)


def test_ranks_given_different_amp_types_are_one_error_line(corpus, tmp_path):
    """MINIDIST_AMP_DTYPE set on one rank only (a node's own environment): that rank skipped
    the gather in which the others agreed on --amp's 16-bit type, and they waited in it
    (train/strategy.py amp_dtype). Every rank now takes part: one error line naming the
    ranks, exit 2. (`env VAR=value` starts the first rank: Hydra's `-env VAR value` is
    `-x VAR=value` under Open MPI's mpirun.)

        mpiexec -n 1 env MINIDIST_AMP_DTYPE=bfloat16 python examples/train_gpt.py --amp ... \
            : -n 1 python examples/train_gpt.py --amp ...
    """
    rank = [sys.executable, os.path.join(ROOT, "examples", "train_gpt.py"), "--amp",
            "--data", corpus, "--steps", "2", "--n-layer", "1", "--n-embd", "16",
            "--cache-dir", str(tmp_path / "cache"), "--sample", "0", "--device", "cpu"]
    job = run_job([mpiexec(), "-n", "1", "env", "MINIDIST_AMP_DTYPE=bfloat16", *rank,
                   ":", "-n", "1", *rank], timeout=120, check=False)
    errors = [line for line in job.stderr.splitlines() if line.startswith("error:")]
    assert job.returncode == 2 and errors == [
        "error: --amp: the ranks chose different 16-bit types (bfloat16 on rank 0; float16 on "
        "rank 1: their devices differ, or MINIDIST_AMP_DTYPE is set on some): give "
        "--amp-dtype float16, which every device computes in"], (job.stdout, job.stderr)


def test_a_second_run_saving_into_the_same_folder_is_refused_naming_the_first(corpus,
                                                                             tmp_path):
    """First-use walk 31: two runs on one --save (a job submitted twice; one default folder
    for every submission): one removed the other's temporary folder mid-save, or pruned the
    checkpoint the other was resuming from (a FileNotFoundError traceback). The run holds
    --save's lock (DIR/.lock, flock) until it ends: a second one is one error line naming the
    first, exit 2, before it reads or writes anything; once the first has ended, a run
    takes the folder (here: resumes it)."""
    common = [sys.executable, os.path.join(ROOT, "examples", "train_gpt.py"), "--data",
              corpus, "--n-layer", "1", "--n-embd", "16", "--cache-dir", str(tmp_path / "c"),
              "--save", "ck", "--resume", "auto", "--sample", "0", "--eval-iters", "1"]
    first = subprocess.Popen([*common, "--steps", "400", "--save-every", "1", "--keep", "2"],
                             cwd=tmp_path, env=mpi_env(), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        for line in lines_of(first, timeout=120):                # it trains and saves
            if "saved step" in line:
                break
        else:
            raise AssertionError(f"the first run ended: {first.stderr.read()}")
        second = subprocess.run([*common, "--steps", "2"], cwd=tmp_path, env=mpi_env(),
                                capture_output=True, text=True, timeout=120)
    finally:
        first.send_signal(signal.SIGINT)          # Ctrl-C: saves its step, exits 130
        first.wait(timeout=120)
    assert second.returncode == 2 and "step " not in second.stdout, second.stderr
    assert second.stderr.startswith(f"error: --save ck: another run saves into it "
                                    f"({socket.gethostname()}, pid {first.pid}, since "), \
        second.stderr
    assert second.stderr.count("\n") == 1
    done = int((tmp_path / "ck" / "latest").read_text().strip().split("-")[1])
    again = subprocess.run([*common, "--steps", str(done + 1)], cwd=tmp_path, env=mpi_env(),
                           capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and "resumed from ck/step-" in again.stdout, again.stderr


@pytest.mark.mpi
def test_a_save_folder_on_each_nodes_own_disk_is_refused_before_step_0(corpus, tmp_path, mpi):
    """First-use walk 31: --save on a node's own disk (here: each rank starts in a folder
    of its own, and --save is relative) trained, said "saved step 3", exit 0, and the resume
    found rank 1's shard missing. Every rank now looks for a file rank 0 makes in --save
    right after MPI_Init: one error line naming the rank, exit 2, before step 0.
    By hand: mpiexec -n 2 python tests/scripts/node_own_disk.py --node-dirs A,B --save ck"""
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    for n in nodes:
        n.mkdir()
    out = mpi(2, "tests/scripts/node_own_disk.py", "--node-dirs", ",".join(map(str, nodes)),
              "--save", "ck", "--zero", "1", "--data", corpus, "--steps", "2", "--cache-dir",
              tmp_path / "cache", timeout=120, check=False)
    assert out.returncode == 2 and "step " not in out.stdout, (out.stdout, out.stderr)
    assert out.stderr.count("error: ") == 1 and "Traceback" not in out.stderr, out.stderr
    assert ("error: --save ck: rank 1 of 2 does not see the files world rank 0 writes there; "
            "--save must be a folder every rank sees") in out.stderr, out.stderr
    assert os.listdir(nodes[0] / "ck") == []                 # the probe removed


@pytest.mark.parametrize("ranks,flags,says", [
    (1, ["--batch-size", "6", "--grad-accum", "4"], "--batch-size 6 does not split into dp 1 "
     "x --grad-accum 4 = 4 equal micro-batches"),
    # the multiple it names counts dp: was "a multiple of 4" before the ranks were known,
    # then, for --batch-size 4, "a multiple of 8"
    (2, ["--batch-size", "6", "--grad-accum", "4"], "give --batch-size a multiple of 8"),
])
def test_the_batch_error_names_the_multiple_the_layout_needs(ranks, flags, says):
    from minidist.train.strategy import check_layout
    check_flags(train_parser().parse_args(flags))            # not refused before the layout
    with pytest.raises(UsageError) as e:
        check_layout(train_parser().parse_args(flags), ranks)
    assert says in str(e.value)


@pytest.mark.parametrize("ranks,flags,suggests", [
    (4, ["--tp", "2", "--dp", "4"], "run the same command with `mpirun -n 8`, or leave --dp "
     "out"),
    # --dp not given: no "leave --dp out"; the same command, every flag kept (it was rebuilt
    # from the parallel flags alone, and `mpirun -n 8 ... --ep 4 --cp 2` lost --moe-experts)
    (4, ["--moe-experts", "4", "--ep", "4", "--cp", "2"], "--ep 4 x --cp 2 = 8 ranks per "
     "replica (the processes are dp x 8), but this job has 4 MPI process(es); run the same "
     "command with `mpirun -n 8`"),
    (3, ["--tp", "2", "--n-layer", "2"], "run the same command with `mpirun -n 2`"),
    (4, ["--tp", "3"], None),              # --n-head 4 is not divisible by 3 either
    (4, ["--cp", "3"], None),              # nor --block-size 128 into 6 chunks
    (4, ["--zero", "3", "--zero-shard", "2", "--dp", "3"], None),   # 2 does not divide 3
    # "leave --dp out" only where the processes divide by the other axes (6 by tp x pp 4
    # does not: it was suggested, and refused next)
    (6, ["--tp", "2", "--pp", "2", "--dp", "2", "--n-layer", "2"], "run the same command "
     "with `mpirun -n 8`"),
])
def test_the_rank_count_error_suggests_a_command_only_when_it_would_run(ranks, flags,
                                                                        suggests):
    """A wrong rank count names the mpirun command with the right one, unless another flag
    is wrong too: that command would then fail on it (found by a first-use walk: `--tp 3` on
    4 ranks suggested `mpirun -n 3 ... --tp 3`, refused next for --n-head 4). The same
    command on the rank count it names is accepted."""
    from minidist.train.strategy import check_layout
    with pytest.raises(UsageError) as e:
        check_layout(train_parser().parse_args(flags), ranks)
    assert "but this job has" in str(e.value)
    if suggests is None:
        assert "`mpirun -n" not in str(e.value), str(e.value)
        return
    assert suggests in str(e.value)
    a = train_parser().parse_args(flags)
    leave = "--dp" in flags and ranks % (a.tp * a.pp * a.cp * a.ep) == 0
    assert ("leave --dp out" in str(e.value)) == leave, str(e.value)
    ranks = int(str(e.value).split("`mpirun -n ")[1].split("`")[0])
    check_layout(train_parser().parse_args(flags), ranks)


@pytest.mark.parametrize("ranks,flags,says,not_said", [
    # 16 processes do not split into --pp 3 stages: there is no dp; it said "--batch-size 8
    # does not split into dp 5", a dp of a job nobody ran (found running 16 ranks)
    (16, ["--pp", "3", "--batch-size", "8"], "--pp 3 = 3 ranks per replica", "dp 5"),
    (16, ["--tp", "3"], "--n-head 4 is not divisible by --tp 3", "--batch-size"),
    # the dp it holds --zero-shard to would be 5 as well
    (16, ["--cp", "3", "--zero", "1", "--zero-shard", "2", "--block-size", "12"],
     "--cp 3 = 3 ranks per replica", "--zero-shard"),
    # a batch and a --zero-shard problem on one line: the second came only once the first
    # was fixed
    # fewer processes than one replica: dp 1, as any such job's, and the batch held to it
    (1, ["--pp", "2", "--micro-batches", "2", "--batch-size", "3"], "does not split into dp 1",
     "`mpirun -n"),
    (16, ["--zero", "2", "--zero-shard", "6", "--batch-size", "12"], "give --batch-size a "
     "multiple of 16; --zero-shard 6: the ranks each replica is sharded over must divide dp "
     "16", "`mpirun -n"),
])
def test_a_refusal_names_no_dp_the_processes_do_not_have(ranks, flags, says, not_said):
    """With --dp not given and processes that do not split into tp x pp x cp x ep, the
    refusal is the rank count alone (and the flags wrong whatever the count); every problem
    of the layout is on the one `error:` line."""
    from minidist.train.strategy import check_layout
    with pytest.raises(UsageError) as e:
        check_layout(train_parser().parse_args(flags), ranks)
    assert says in str(e.value) and not_said not in str(e.value), str(e.value)
