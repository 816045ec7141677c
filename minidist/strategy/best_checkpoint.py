"""--keep-best: DIR/best names the checkpoint folder of the lowest val loss a run measured,
beside DIR/latest, and prune keeps that folder whatever --keep (nanoGPT's training script
saves only when the val loss improves; Hugging Face's Trainer keeps its best checkpoint
beside save_total_limit's newest).

    DIR/best    two lines: the folder's name ("step-00000050") and its val loss, written as
                `latest` is (a temporary file, fsync, os.replace, fsync of DIR)

Its first line is what `--resume DIR/best`, `examples/sample.py --resume DIR/best` and
`examples/export_gpt2.py --resume DIR/best` read (checkpoint_dirs.resolve). Every evaluation
draws the same val batches (minidist/train/loop.py VAL_SEED), so a resumed run compares its
evaluations with the best before it. Only a save that follows its step's evaluation is a
candidate: one of a step that evaluated nothing (--save-every between evaluations, a
signal's) never is; so a --keep-best run saves at every evaluation, whatever --save-every
(minidist/train/loop.py). World rank 0 writes it after the commit (minidist/train/saves.py).
Tests: tests/test_checkpoint_dirs.py, tests/test_keep_best.py.
"""
import os

from minidist.strategy import checkpoint_dirs as dirs


def read(directory):
    """(folder name, val loss) of `directory`'s best checkpoint, or None: no `best` file, or
    one naming a folder that is no longer there, or not as `mark` writes it (edited)."""
    try:
        with open(os.path.join(directory, dirs.BEST), errors="replace") as f:
            name, loss = f.read().split()
        loss = float(loss)
    except (OSError, ValueError):
        return None
    return (name, loss) if name in dirs.numbered(directory) else None


def mark(directory, name, val_loss):
    """Point `directory`'s `best` at its folder `name`, of val loss `val_loss`, atomically."""
    pointer = os.path.join(directory, f".{dirs.BEST}.tmp-{os.getpid()}")
    with open(pointer, "w") as f:
        f.write(f"{name}\n{float(val_loss)!r}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(pointer, os.path.join(directory, dirs.BEST))
    dirs.fsync_dir(directory)


def drop(directory):
    """Remove `directory`'s `best` (a run without --keep-best, or the run an --overwrite run
    replaces, named it); True if there was one."""
    path = os.path.join(directory, dirs.BEST)
    if not os.path.isfile(path):
        return False
    os.remove(path)
    dirs.fsync_dir(directory)
    return True
