"""Where the memory check looks and what it says: what a host has free (meminfo, cgroups v1
and v2, `ulimit -v`, a GPU's: minidist/train/memory_room.py), the verdict over the ranks and
its lines (minidist/train/memory_check.py); then runs refused before the model is built, a
run that runs out anyway ended with one line, and the line beside the run's own ledger:

    (ulimit -v 1500000; python examples/train_gpt.py --data F --n-embd 64 --n-layer 2 \\
        --n-head 2 --batch-size 8192 --steps 1)          # error: memory: ..., exit 2
    ... --no-memory-check                                # error: out of memory: ..., exit 1
    (ulimit -v 1500000; mpiexec -n 2 python examples/train_gpt.py ...)   # the same, once
The bill itself (the flags' layout, each rank's count, the advice): tests/test_memory_check.py.
"""
import gc
import os
import subprocess
import sys

import numpy as np
import pytest

from minidist import backend
from minidist.train.args import train_parser
from minidist.train.memory_check import ADDRESS_MARGIN, MARGIN, size_text, verdict
from minidist.train.memory_room import address_room, cgroup_room, host_room, where_and_room
from minidist.nn import GPTConfig
from minidist.train.planner import GiB, Layout
from minidist.train.step_buffers import step_buffers
from mpirun import ROOT, mpiexec, mpi_env, run_job


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.mark.parametrize("version", ["v1", "v2", "v2 unlimited", "none"])
def test_host_room_is_meminfo_or_the_cgroups_limit(version, tmp_path):
    """MemAvailable, or less where the cgroup's limit (less its usage but the reclaimable
    inactive file cache) leaves less; "max" or v1's huge number limits nothing."""
    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    _write(proc / "meminfo", "MemTotal:  8000000 kB\nMemAvailable:  4000000 kB\n")
    limit = "max" if version == "v2 unlimited" else str(2 * GiB)
    if version.startswith("v2"):
        _write(proc / "self" / "cgroup", "0::/job/step\n")
        _write(root / "job" / "step" / "memory.max", limit + "\n")
        _write(root / "job" / "step" / "memory.current", f"{GiB}\n")
        _write(root / "job" / "step" / "memory.stat", f"anon 5\ninactive_file {2 ** 20}\n")
    elif version == "v1":
        _write(proc / "self" / "cgroup", "5:cpu,cpuacct:/\n4:memory:/slurm/job1\n0::/\n")
        _write(root / "memory" / "slurm" / "job1" / "memory.limit_in_bytes", limit)
        _write(root / "memory" / "slurm" / "job1" / "memory.usage_in_bytes", str(GiB))
        _write(root / "memory" / "slurm" / "job1" / "memory.stat",
               f"inactive_file 7\ntotal_inactive_file {2 ** 20}\n")
    else:
        _write(proc / "self" / "cgroup", "0::/\n")
    room = host_room(str(proc), str(root))
    if version in ("v1", "v2"):
        assert cgroup_room(str(proc), str(root)) == GiB + 2 ** 20 == room
    else:
        assert cgroup_room(str(proc), str(root)) is None and room == 4000000 * 1024
    assert host_room(str(tmp_path / "nothing"), str(root)) is None      # macOS: no /proc


def test_a_container_sees_its_cgroup_at_the_root(tmp_path):
    """Inside a container the path /proc/self/cgroup names is not under the mount: the
    mount's own files are the container's."""
    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    _write(proc / "self" / "cgroup", "0::/kubepods/pod1/c1\n")
    _write(root / "memory.max", str(3 * GiB))
    _write(root / "memory.current", str(GiB))
    assert cgroup_room(str(proc), str(root)) == 2 * GiB


def test_address_room_under_ulimit():
    code = ("from minidist.train.memory_room import address_room; print(address_room())")
    limited = subprocess.run(["bash", "-c", f'ulimit -v 2000000 && exec "$0" -c "{code}"',
                              sys.executable], capture_output=True, text=True, cwd=ROOT,
                             env=mpi_env(), timeout=60, check=True)
    assert 0 < int(limited.stdout) < 2000000 * 1024
    if address_room() is not None:
        pytest.skip("this suite runs under a ulimit -v of its own")


MiB = 2 ** 20
BILL = {"params": 2 * MiB, "grads": 2 * MiB, "optimizer": 4 * MiB, "activations": 8 * MiB,
        "logits": 0, "evaluation": 0, "checkpoint": 0, "total": 16 * MiB}


def test_verdict_sums_the_ranks_of_a_host():
    """Ranks on one host share what it has free: 4 x 16 MiB fit in 70 MiB (above 90% of it:
    said), not in 60; on two hosts the fuller one is named; a GPU is its own place."""
    four = [(("a",), 70 * MiB, None, True)] * 4
    problem, line = verdict(four, [BILL] * 4)
    assert problem is None
    assert line == ("memory: 16.0 MiB a rank by the planner (parameters 2.0 MiB, gradients "
                    "2.0 MiB, optimizer 4.0 MiB, activations 8.0 MiB); the 4 ranks on this "
                    "host: 64.0 MiB of 70.0 MiB free (near the limit: Python's own memory "
                    "is not in the count)")
    problem, _ = verdict([(("a",), 60 * MiB, None, True)] * 4, [BILL] * 4)
    assert problem == ("memory: the 4 ranks on this host need 64.0 MiB by the planner's "
                       "count (the largest rank 16.0 MiB: parameters 2.0 MiB, gradients 2.0 "
                       "MiB, optimizer 4.0 MiB, activations 8.0 MiB) but there is 60.0 MiB "
                       "free there", 15 * MiB, True, MARGIN)
    two = [(("a",), 100 * MiB, None, True)] * 2 + [(("b",), 20 * MiB, None, True)] * 2
    problem, line = verdict(two, [BILL] * 4)
    assert problem[0].startswith("memory: the 2 ranks on host b need 32.0 MiB")
    gpus = [(("a", "0000:01:00.0"), 20 * MiB, None, True),
            (("a", "0000:02:00.0"), 20 * MiB, None, True)]
    problem, line = verdict(gpus, [BILL] * 2)
    assert problem is None and line.endswith("rank 0 on the GPU 0000:01:00.0 on this host: "
                                             "16.0 MiB of 20.0 MiB free")
    problem, line = verdict([(("a",), None, None, False)] * 2, [BILL] * 2)
    assert problem is None and "free" not in line


def test_without_a_count_of_free_memory_all_of_it_is_the_room(tmp_path):
    """Where /proc cannot be read (macOS), the room is the host's physical memory, and the
    line says so: a run that needs more than all of it cannot fit anywhere there."""
    if backend.device() == "cuda":
        pytest.skip("a GPU's room is its free memory (cudaMemGetInfo)")
    where, room, free = where_and_room(str(tmp_path / "no-proc"))
    assert (room, free) == (os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), False)
    problem, line = verdict([(where, 64 * MiB, None, False)] * 2, [BILL] * 2)
    assert problem is None and line.endswith("the 2 ranks on this host: 32.0 MiB of 64.0 MiB "
                                             "of memory in all (no count of free memory here)")
    problem, _ = verdict([(where, 20 * MiB, None, False)] * 2, [BILL] * 2)
    assert problem[0].endswith("but there is 20.0 MiB of memory in all (no count of free "
                               "memory here) there")
    assert where_and_room()[2] is True                        # Linux: MemAvailable


def test_verdict_holds_each_rank_to_its_address_space():
    """A rank's bill against what `ulimit -v` leaves it; above ADDRESS_MARGIN of it, near the
    limit: the address space grows ~1.25 x the bill (malloc's arenas, its kept heap), and
    2 ranks of ZeRO-3 billed 352.9 MiB in 406.1 (0.87) ran out in their first step:

        (ulimit -v 750000; mpiexec -n 2 python examples/train_gpt.py --n-layer 8 \\
            --n-embd 512 --batch-size 8 --block-size 64 --steps 2 --zero 3)
    """
    seen = [(("a",), GiB, None, True), (("a",), GiB, 10 * MiB, True)]
    problem, _ = verdict(seen, [BILL] * 2)
    assert problem == ("memory: rank 1 needs 16.0 MiB by the planner's count but `ulimit -v` "
                       "leaves it 10.0 MiB of address space", 10 * MiB, False, ADDRESS_MARGIN)
    problem, _ = verdict([(("a",), GiB, 10 * MiB, True)], [BILL])
    assert problem[0].startswith("memory: the run needs 16.0 MiB")
    problem, line = verdict([(("a",), GiB, 30 * MiB, True)], [BILL])    # fits: says the limit
    assert not problem and line.endswith("; `ulimit -v` leaves a rank 30.0 MiB of address space")
    problem, line = verdict([(("a",), GiB, 20 * MiB, True)], [BILL])    # 0.8 of it: near
    assert not problem and line.endswith("; `ulimit -v` leaves a rank 20.0 MiB of address "
                                         "space (near the limit: `ulimit -v` counts the "
                                         "address space malloc reserves too)")


# a model whose activations (materialized attention) are ~11.5 GiB at batch 8192 (5.8 a rank
# on 2), params tiny. At 2048 (2.9 GiB) the forward that runs out anyway computed ~3 s before
# its last allocation failed (1 rank: the logits'); at 8192 its first big one fails, <1 s
BIG_BATCH = ["--n-embd", "64", "--n-layer", "2", "--n-head", "2", "--batch-size", "8192",
             "--steps", "1", "--sample", "0"]


def _limited(ranks, corpus, *flags):
    """examples/train_gpt.py on `ranks` (1: no mpiexec) under `ulimit -v 1500000` (1.4 GiB)."""
    launch = [] if ranks == 1 else [mpiexec(), "-n", str(ranks)]
    cmd = launch + [sys.executable, "examples/train_gpt.py", "--data", corpus, *BIG_BATCH,
                    *flags]
    return run_job(["bash", "-c", 'ulimit -v 1500000 && exec "$0" "$@"', *cmd], timeout=120,
                   check=False)


@pytest.mark.parametrize("ranks", [1, pytest.param(2, marks=pytest.mark.mpi)])
def test_a_run_that_cannot_fit_is_refused_then_ends_in_one_line(ranks, corpus, mpi):
    """Refused before the model is built (exit 2, one line, no traceback); with
    --no-memory-check it starts, says so, and the MemoryError of its first forward is one
    line naming the rank (exit 1), not a traceback per rank:

        (ulimit -v 1500000; mpiexec -n 2 python examples/train_gpt.py --data F --n-embd 64 \\
            --n-layer 2 --n-head 2 --batch-size 8192 --steps 1 [--no-memory-check])
    """
    if mpi.device == "cuda":
        pytest.skip("ulimit -v holds the host's allocations; a GPU's are CUDA's")
    refused = _limited(ranks, corpus)
    assert refused.returncode == 2, refused.stderr
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: memory: "), refused.stderr
    assert "by the planner's count but `ulimit -v` leaves it" in lines[0]
    assert "model:" not in refused.stdout
    ran = _limited(ranks, corpus, "--no-memory-check")
    assert ran.returncode == 1, ran.stderr
    assert "of address space: --no-memory-check started it anyway" in ran.stdout
    errors = [line for line in ran.stderr.splitlines() if line.strip()]
    rank = " on rank 0" if ranks > 1 else ""
    assert len(errors) == 1 and errors[0].startswith(f"error: out of memory{rank}: Unable to "
                                                      "allocate"), ran.stderr
    assert "Traceback" not in ran.stderr + ran.stdout


def test_the_memory_line_is_the_ledgers(corpus, tmp_path, mpi):
    """One process, the default model's shape on the test corpus: the start's line names the
    bytes the run's own ledger then counts (--log-json's "mem"), to 8 bytes a token:

        python examples/train_gpt.py --data F --steps 1 --batch-size 4 --block-size 64 \\
            --log-json L      # its `memory:` line beside L's first row's "mem"
    """
    import json
    log = tmp_path / "log.jsonl"
    cmd = [sys.executable, "examples/train_gpt.py", "--data", corpus, "--steps", "1",
           "--sample", "0", "--batch-size", "4", "--block-size", "64", "--log-json", log,
           "--cache-dir", tmp_path / "cache", "--device", mpi.device or "cpu"]
    out = run_job(cmd, timeout=120).stdout
    line = next(line for line in out.splitlines() if line.startswith("memory: "))
    mem = json.loads(open(log).readline())["mem"]
    total = float(line.split()[1]) * (GiB if line.split()[2] == "GiB" else MiB)
    logits = 4 * 4 * 64 * 256                      # the step's (B, T, V) float32, beside it
    config = GPTConfig(n_layer=4, n_head=4, n_embd=128, block_size=64, vocab_size=256)
    buffers = step_buffers(config, Layout(amp=False), 0, 4)     # AdamW's scratch, no graph's
    assert f", logits {size_text(logits)}, buffers {size_text(buffers)})" in line
    assert abs(total - logits - buffers - mem["total"]) <= 0.05 * MiB + 8 * 4 * 64, (line, mem)
    assert f"(parameters {size_text(mem['params'])}, gradients {size_text(mem['grads'])}, " \
        f"optimizer {size_text(mem['optimizer'])}, " in line


def test_a_benchmark_that_runs_out_is_one_line():
    """examples/bench_step.py goes through run_main too: its MemoryError is the one line:

        (ulimit -v 1500000; python examples/bench_step.py --n-embd 64 --n-layer 2 \\
            --n-head 2 --batch-size 8192 --steps 1 --warmup 0)
    """
    cmd = [sys.executable, "examples/bench_step.py", *BIG_BATCH[:8], "--steps", "1",
           "--warmup", "0"]
    ran = run_job(["bash", "-c", 'ulimit -v 1500000 && exec "$0" "$@"', *cmd], timeout=120,
                  check=False)
    assert ran.returncode == 1 and ran.stdout == "", ran.stderr
    assert ran.stderr.startswith("error: out of memory: Unable to allocate ")
    assert len(ran.stderr.splitlines()) == 1, ran.stderr


def _weight_dicts():
    """Dicts of {parameter name: numpy array} alive now (a loaded model's weights)."""
    return [o for o in gc.get_objects() if isinstance(o, dict) and "transformer.wte.weight" in o
            and isinstance(o["transformer.wte.weight"], np.ndarray)]


def test_init_from_weights_are_let_go_once_the_model_holds_them(corpus, tmp_path):
    """--init-from's weights (the whole model, on every rank) were held by the loop for the
    whole run: 90 MiB of RSS for a 25.4M-parameter model's checkpoint, about 500 MB a rank
    for GPT-2's 124M; no dict of them is alive at a step's end now:

        python examples/train_gpt.py --data F --steps 1 --save CK
        python examples/train_gpt.py --data F --steps 1 --init-from CK
    """
    from minidist.train.loop import train
    flags = ["--data", corpus, "--cache-dir", str(tmp_path / "cache"), "--n-layer", "1",
             "--n-embd", "32", "--n-head", "2", "--block-size", "32", "--batch-size", "2",
             "--steps", "1", "--sample", "0", "--eval-iters", "1"]
    train(train_parser().parse_args(flags + ["--save", str(tmp_path / "ck")]))
    before = {id(d) for d in _weight_dicts()}     # (earlier tests' loads the suite still has)
    held = []
    train(train_parser().parse_args(flags + ["--init-from", str(tmp_path / "ck")]),
          each_step=lambda step: held.extend(d for d in _weight_dicts()
                                             if id(d) not in before))
    assert held == []
