"""A run's hold on its --save directory (first-use walk 31: a second job saving into the
same folder removed the first's files mid-save, or read a checkpoint the first pruned):
DIR/.lock, an open file holding an exclusive flock, written with who holds it; hold() before
step 0, release() at the end (minidist/train/saves.py claim_save, examples/train_gpt.py).
Tests: tests/test_checkpoint_dirs.py.
"""
import fcntl
import os
import socket
import time

from minidist.strategy.checkpoint_dirs import LOCK, CheckpointError


def hold(directory):
    """This process's claim on `directory` (made if needed) as the one run saving into it: an
    open file holding an exclusive flock on DIR/.lock, released when it is closed or the
    process ends (a crashed node's, on NFS, when its lease runs out). Raises CheckpointError
    naming the holder where another process holds it (walk 31: a second job on the same
    --save removed the first's files mid-save, or read a checkpoint the first pruned);
    returns None where the filesystem has no locks (Lustre mounted without flock).
    A lock won on a file that release() unlinked in the meantime is no claim (the next run
    makes a new .lock and locks that): it is taken again, on the file the path names now."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, LOCK)
    while True:
        f = open(path, "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "its .lock is held"
            f.close()
            raise CheckpointError(f"--save {directory}: another run saves into it ({holder}); "
                                  "let it end, or --save another folder") from None
        except OSError:                      # no locks here: nothing to hold
            f.close()
            return None
        if same_file(f, path):
            break
        f.close()                            # released and unlinked under us: again
    f.seek(0)
    f.truncate()
    job = os.environ.get("SLURM_JOB_ID")
    f.write(f"{socket.gethostname()}, pid {os.getpid()}" + (f", job {job}" if job else "")
            + time.strftime(", since %Y-%m-%d %H:%M:%S") + "\n")
    f.flush()
    return f


def same_file(f, path):
    """Whether the open file `f` is the one `path` names now."""
    try:
        now = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(f.fileno())
    return (mine.st_dev, mine.st_ino) == (now.st_dev, now.st_ino)


def release(held):
    """Give up hold()'s claim (None: nothing held): DIR/.lock removed, then closed, so the
    folder holds checkpoints only again. A run that opened the file in the instant between
    finds, once it has the lock, that the path no longer names it, and locks again (hold)."""
    if held is None:
        return
    try:
        os.remove(held.name)
    except FileNotFoundError:
        pass
    except OSError:             # a folder turned read-only mid-run (walk 37): the lock goes
        pass                    # with the close; the error that ended the run is the one said
    held.close()
