"""Small jobs for tests/test_comm.py and tests/test_comm_failures.py that must run alone.

    mpiexec -n 4 python tests/scripts/comm_small.py abort   # rank 1 raises; the job must end
    mpiexec -n 4 python tests/scripts/comm_small.py exit    # rank 1 calls sys.exit(3)
    MINIDIST_COMM_TIMEOUT=3 mpiexec -n 3 python tests/scripts/comm_small.py block   # rank 1 sleeps
    MINIDIST_COMM_TIMEOUT=3 mpiexec -n 2 python tests/scripts/comm_small.py p2p     # never sent
    mpiexec -n 2 python tests/scripts/comm_small.py finish  # ranks exit 60 ms apart: clean
    mpiexec -n 3 python tests/scripts/comm_small.py asyncfail  # rank 1's async op raises
    mpiexec -n 3 python tests/scripts/comm_small.py rawexit    # exits; the others gather
    MINIDIST_COMM_TIMEOUT=3 mpiexec -n 2 python tests/scripts/comm_small.py straggler
    MINIDIST_COMM_TIMEOUT=3 mpiexec -n 2 python tests/scripts/comm_small.py frozen  # rank 1
                                                            # stops after the exit agreement
    MINIDIST_COMM_TIMEOUT=3 mpiexec -n 3 python tests/scripts/comm_small.py stopped  # rank 1
                                                  # stops while the others wait_for_all
                                                  # (stoppedbig: a group's, key 16 KiB;
                                                  # stoppedgroup: while they make a group)
    MINIDIST_COMM_TIMEOUT=3 mpiexec -n 4 python tests/scripts/comm_small.py stoppedlater
                                   # rank 3 works alone; rank 0 stops 6 s into its wait
    MINIDIST_COMM_TIMEOUT=2 mpiexec -n 3 python tests/scripts/comm_small.py alone  # rank 1
                                                  # computes 14 s alone: they wait
    MINIDIST_COMM_TIMEOUT=2 mpiexec -n 3 python tests/scripts/comm_small.py held  # rank 1
                                                  # stopped 8 s, then goes on: they wait
    MINIDIST_COMM_TIMEOUT=3 mpiexec -n 3 python tests/scripts/comm_small.py preinit  # rank 1
                                                            # dies before MPI_Init
    MINIDIST_TRACE=2 mpiexec -n 2 python tests/scripts/comm_small.py log
    mpiexec -n 2 python tests/scripts/comm_small.py breakpoint   # (or builtin: breakpoint())
    mpiexec -n 2 python -m minidist.comm.rankpdb tests/scripts/comm_small.py raise  # rank 0
                                                  # raises: pdb's post mortem there
    python -m minidist.comm.attach 4445          # in a second terminal: pdb on rank 1
    mpiexec -n 2 python tests/scripts/comm_small.py finish --device cuda   # cupy buffers

--device (cpu, the default, or cuda; tests/mpirun.py passes pytest's) picks the buffers' array
module on every rank.
"""
import argparse
import sys
import time

from minidist import backend, comm
from minidist.launcher import launcher_rank

cli = argparse.ArgumentParser()
cli.add_argument("mode")
cli.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
cli = cli.parse_args()
if cli.mode == "preinit" and launcher_rank() == 1:    # the launcher's rank, before MPI_Init
    raise ImportError("rank 1 failed before MPI_Init (as a missing module would)")
world = comm.init("ring")   # MPI_Init, the abort hooks and the watchdog (MINIDIST_COMM_TIMEOUT)
backend.set_device(cli.device)
xp = backend.get_xp()      # numpy or cupy: the buffers below live on --device
mode = cli.mode
if mode == "abort":
    if world.rank == 1:
        time.sleep(0.5)  # let the others get into the collective first
        raise RuntimeError("boom on rank 1")
    world.all_reduce(xp.ones(1000))   # would wait forever for rank 1 without the abort
    print("unreachable: the all_reduce cannot finish")
elif mode == "exit":
    if world.rank == 1:
        time.sleep(0.5)
        sys.exit(3)                   # no exception hook sees this: the exit handler must
    world.all_reduce(xp.ones(1000))
    print("unreachable: the all_reduce cannot finish")
elif mode == "block":
    if world.rank == 1:
        time.sleep(3600)              # never arrives
    world.all_reduce(xp.ones(10))
    print("unreachable: the all_reduce cannot finish")
elif mode == "p2p":
    if world.rank == 1:
        time.sleep(3600)              # never sends (a pipeline stage stuck in compute)
    world.recv(xp.ones(10), peer=1)
    print("unreachable: the recv cannot finish")
elif mode == "asyncfail":
    buf = xp.ones(1000)
    if world.rank == 1:
        time.sleep(0.5)               # the others are in the all_reduce by now
        buf.flags.writeable = False   # the ring's first write raises, in the thread
    work = world.all_reduce(buf, async_op=True)
    world.all_reduce(xp.ones(10))     # rank 1 would come here with its first one failed
    work.wait()
    print("unreachable: the all_reduce cannot finish")
elif mode == "rawexit":
    if world.rank == 1:
        time.sleep(0.5)
        sys.exit(3)                   # as a user error on this rank alone would
    world.all_gather_object({"rank": world.rank})   # an object collective: watched too
    print("unreachable: the gather cannot finish")
elif mode == "straggler":
    if world.rank == 1:
        time.sleep(3600)              # stuck where no watchdog looks (compute, a raw call)
    sys.exit(0)                       # the others exit and wait for it: not for ever
elif mode == "frozen":
    if world.rank == 1:              # at exit, once past the ranks' agreement to end, freeze
        import atexit
        import os
        import signal
        from minidist.comm import watchdog

        def freeze():                # (runs before comm's own exit handler: LIFO)
            watchdog.announce_exit()          # rank 0's exit handler meets this one
            os.kill(os.getpid(), signal.SIGSTOP)        # a node that hangs, for good
        atexit.register(freeze)
    sys.exit(0)                       # rank 0 ends in MPI_Finalize: not for ever
elif mode in ("stopped", "stoppedbig", "stoppedgroup", "held", "alone", "stoppedlater"):
    import os                                 # the others wait_for_all (untimed) while
    import signal                             # rank 1 (stoppedlater: 3)
    import subprocess
    start, group = time.monotonic(), world
    if mode == "stoppedbig":                  # a group whose key pickles to 16 KiB, as a
        group = world.new_group(range(world.size), name="w" * 16384)   # ~5,000 ranks' does
    if mode == "stoppedlater" and world.rank == 3:
        while time.monotonic() < start + 60:   # ... works alone, alive, past the end, while
            sum(i * i for i in range(10_000))
    elif mode == "stoppedlater" and world.rank == 0:   # rank 0, in the wait and answering
        subprocess.Popen(["sh", "-c", f"sleep 6; kill -STOP {os.getpid()}"])  # , freezes
    elif world.rank == 1 and mode in ("stopped", "stoppedbig", "stoppedgroup"):
        os.kill(os.getpid(), signal.SIGSTOP)  # ... freezes (a node that hangs mid-save)
    elif world.rank == 1 and mode == "held":  # ... is held 8 s (a loaded node), goes on
        subprocess.Popen(["sh", "-c", f"kill -STOP {os.getpid()}; sleep 8; "
                          f"kill -CONT {os.getpid()}"]).wait()
    elif world.rank == 1 and mode == "alone":  # ... works alone past the timeout, alive:
        while time.monotonic() - start < 14:  # Python holding the interpreter (as a
            sum(i * i for i in range(10_000))  # tokenizer would) 7 s, then numpy 7 s
            if time.monotonic() - start > 7:
                xp.linalg.eigvalsh(xp.ones((300, 300)))
    if mode == "stoppedgroup":                # the others make a group (timed, as a
        group = world.new_group(range(world.size))   # collective: it was not)
    group.wait_for_all()
    print(f"rank {world.rank} done waiting", flush=True)
elif mode == "preinit":
    print("unreachable: MPI_Init cannot finish without rank 1", flush=True)
elif mode == "finish":
    world.all_reduce(xp.ones(10))
    time.sleep(0.06 * world.rank + (1.5 if world.rank == 0 else 0))  # rank 0 leaves last
    print(f"rank {world.rank} finished", flush=True)
elif mode == "log":
    world.all_reduce(xp.ones(7, xp.float32))
    world.broadcast(xp.ones(3), root=1)
    world.all_gather_object(world.rank)
elif mode == "handlers":     # under rankpdb: what Ctrl-C does on each rank, and the waits
    import signal
    from minidist.comm import progress
    ignored = signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    print(f"rank {world.rank} SIGINT ignored {ignored}, wait {progress.wait_policy()}",
          flush=True)
elif mode == "raise":        # under rankpdb: rank 0 raises, the others wait in the next call
    buf = xp.full(4, world.rank + 1.0)
    world.all_reduce(buf)
    seen = {"sum": float(buf[0])}
    if world.rank == 0:
        print(seen["mean"])      # KeyError
    world.all_reduce(buf)
    print(f"rank {world.rank} done {buf[0]}")
elif mode in ("breakpoint", "builtin"):
    from minidist.comm import debug
    buf = xp.full(4, world.rank + 1.0)
    for _ in range(1 if mode == "breakpoint" else 2):   # builtin: stops twice, one console
        if mode == "breakpoint":
            debug.breakpoint_on(1)   # rank 1 serves pdb on MINIDIST_PDB_PORT + 1
        elif world.rank == 1:
            breakpoint()             # the builtin: comm.init's hook serves it the same way
        world.all_reduce(buf)
    print(f"rank {world.rank} done {buf[0]}")
