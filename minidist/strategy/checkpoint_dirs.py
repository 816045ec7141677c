"""Checkpoint folders under a --save directory: at every instant it holds a complete
checkpoint that --resume finds.

    DIR/step-00000040/        complete checkpoints (the files: minidist/strategy/checkpoint.py),
    DIR/step-00000050/        each renamed into place only once every file in it is fsynced
    DIR/latest                "step-00000050": the newest, replaced atomically (a temporary
                              file, fsync, os.replace, fsync of DIR)
    DIR/.tmp-<host>-<pid>-<random>/  a save in progress, or one killed mid-way (the next
                              save removes it once its process is gone, and any .old-* an
                              older minidist left)
    DIR/.lock                 while a run saves here: its flock, naming it
                              (minidist/strategy/save_lock.py)
    DIR/best                  --keep-best: the folder of the lowest val loss the run measured
                              (minidist/strategy/best_checkpoint.py), which prune keeps

A save: begin(DIR) makes the temporary folder (mode from the user's umask, not mkdtemp's
0700); the writers fill it; commit(tmp, DIR, step) renames it to the next numbered folder
(step-<step>, or step-<step>.<n> when that step was saved before), fsyncs DIR and points
`latest` at it. prune(DIR, keep) then removes all but the newest `keep` folders, never the
one `latest` names, nor `also` (the best one's; an --overwrite run removes any past its step,
the run it replaces, whatever they are).
A kill at any point leaves the old pointer and its folder, or the new.

resolve(path) finds the checkpoint to read: `path` itself when it is one (manifest.json), the
folder a `latest` or `best` file given by its path names, else the folder `latest` names,
else the newest numbered folder (a save killed between its rename and the pointer).
resume_dir(resume, save) is --resume, "auto" included: --save's newest checkpoint if it
holds one, else None (start fresh), so a requeued job reruns one command.
check_save(save, resume, overwrite) refuses, before any work, a --save directory whose newest
checkpoint is newer than where this run starts (a fresh run: any checkpoint), since this run's
saves would replace it and prune would delete it; --overwrite allows it.
Tests: tests/test_checkpoint_dirs.py, tests/test_cli_runs.py.
"""
import json
import os
import re
import secrets
import shutil
import socket
import time

LATEST, BEST, LOCK = "latest", "best", ".lock"
_NUMBERED = re.compile(r"^step-(\d+)(?:\.(\d+))?$")
_OURS = re.compile(r"^(latest|best|\.lock|\.latest\.tmp-.*|\.tmp-.*|\..*\.(tmp|old)-.*|\.old-.*)$")


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete, corrupt or does not fit the model."""


def fsync_dir(directory):
    """Make renames and new entries in `directory` durable (POSIX: fsync the directory)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def numbered(directory):
    """The numbered checkpoint folders in `directory`, oldest first (by step, then n)."""
    found = []
    for name in os.listdir(directory) if os.path.isdir(directory) else []:
        m = _NUMBERED.match(name)
        if m and os.path.isdir(os.path.join(directory, name)):
            found.append(((int(m.group(1)), int(m.group(2) or 0)), name))
    return [name for _, name in sorted(found)]


def read_latest(directory, pointer=LATEST):
    """The folder name `latest` (or the `pointer` file, `best`) holds, or None without one."""
    path = os.path.join(directory, pointer)
    if not os.path.isfile(path):
        return None
    with open(path, errors="replace") as f:       # (bytes not UTF-8: a traceback per rank
        name = f.readline().strip()               # before first-use walk 37; best: line 1)
    if not _NUMBERED.match(name):
        left = numbered(directory)[-3:]
        raise CheckpointError(f"{path}: {name!r} is not a checkpoint folder name (edited?); " + (
            f"write one of {', '.join(left)} into it, or remove it" if left else
            "no checkpoint folder is left beside it: remove it"))
    return name


def has_checkpoint(directory):
    return os.path.isdir(directory) and (
        os.path.isfile(os.path.join(directory, "manifest.json"))
        or read_latest(directory) is not None or bool(numbered(directory)))


def is_pointer(path):
    """Whether `path` is a --save directory's `latest` or `best` file, which --resume,
    --init-from, sample.py and export_gpt2.py take for the folder it names."""
    return os.path.basename(os.path.normpath(path)) in (LATEST, BEST) and os.path.isfile(path)


def resolve(path, flag="--resume"):
    """The checkpoint folder to read for `path`: a checkpoint, a --save directory, or the
    `latest` or `best` file in one (the folder it names). `flag`: the flag errors name."""
    path, pointer = os.fspath(path), LATEST
    if is_pointer(path):                                        # DIR/latest: DIR's newest;
        path, pointer = os.path.split(os.path.normpath(path))   # DIR/best: its best one
    path = path or "."
    if not os.path.isdir(path):
        raise CheckpointError(f"{flag} {path}: no such checkpoint directory")
    if os.path.isfile(os.path.join(path, "manifest.json")):
        return path
    name = read_latest(path, pointer)
    if name is not None:
        if not os.path.isdir(os.path.join(path, name)):
            left = [os.path.join(path, n) for n in numbered(path)[-3:]]
            said, pointer = pointer, os.path.join(path, pointer)
            raise CheckpointError(
                f"{flag} {path}: {said} names {name}, which is missing; " + (
                    f"resume from one by its path: {', '.join(left)}" if left and said == BEST
                    else f"remove {pointer} (then {path} means its newest, {left[-1]}), or "
                    f"resume from one by its path: {', '.join(left)}" if left else
                    f"no checkpoint is left in it: remove {pointer} to start afresh there, or "
                    "--save another folder"))
        return os.path.join(path, name)
    folders = numbered(path)
    return os.path.join(path, folders[-1]) if folders else path


def kept(save):
    """What the --save directory `save` holds, for a line saying a run stopped: "; DIR keeps
    step N (DIR/step-0000000N)", or "" (nothing there, or nothing readable)."""
    try:
        if not save or not has_checkpoint(save):
            return ""
        folder = resolve(save, "--save")
    except CheckpointError:
        return ""
    return f"; {save} keeps step {step_of(folder)} ({folder})"


def resume_dir(resume, save):
    """The checkpoint folder --resume asks for, or None to start fresh. "auto": --save's
    newest checkpoint if it holds one (a requeued job runs the same command every time)."""
    if resume is None:
        return None
    if resume == "auto":
        if save is None:
            raise CheckpointError("--resume auto resumes from the --save directory: give "
                                  "--save DIR too")
        return resolve(save, "--resume auto: --save") if has_checkpoint(save) else None
    return resolve(resume)


def step_of(folder):
    """The step a checkpoint folder holds: from its name (step-<N>), else its manifest."""
    m = _NUMBERED.match(os.path.basename(os.path.normpath(folder)))
    if m:
        return int(m.group(1))
    try:
        with open(os.path.join(folder, "manifest.json")) as f:
            return int(json.load(f)["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def check_save(save, resume, overwrite=False, steps=None):
    """Refuse (CheckpointError) a --save directory holding a checkpoint newer than the one
    this run resumes from (`resume`: a checkpoint folder, or None: a fresh run, step 0): its
    saves would replace that checkpoint and prune would delete it. `overwrite`: allow it.
    `steps`: this run's --steps; a checkpoint already there is a finished run, and the hint
    says how to train it further."""
    if not save or overwrite:
        return
    try:
        if not has_checkpoint(save):
            return
        newest = resolve(save, "--save")
    except CheckpointError:      # a latest naming a missing folder, or edited: its newest
        folders = numbered(save)     # (the commit rewrites latest; --resume names it)
        if not folders:
            return
        newest = os.path.join(save, folders[-1])
    theirs = step_of(newest)
    if resume is None:
        finished = steps is not None and theirs is not None and theirs >= steps
        go_on = (f"It is a finished run: add --resume auto --steps N, N above {theirs}, to "
                 "train it further" if finished else "Add --resume auto to continue it")
        raise CheckpointError(
            f"--save {save}: already holds a checkpoint (step {theirs}: {newest}); this run "
            f"starts at step 0 and its saves would replace it. {go_on}, --overwrite to start "
            "over, or --save a new directory")
    ours = step_of(resume)
    if theirs is not None and ours is not None and theirs > ours:
        raise CheckpointError(
            f"--save {save}: holds step {theirs} ({newest}), newer than step {ours} this run "
            f"resumes from (--resume {resume}); its saves would replace it. Resume from "
            f"{save} instead, add --overwrite, or --save a new directory")


def save_problem(directory):
    """Why checkpoints cannot be saved into `directory` (it holds anything else than
    checkpoints and their temporaries), or None. Checked before a run starts
    (minidist/train/cli.py check_outputs), so no training is lost to it, and at each save."""
    directory = os.fspath(directory)
    if os.path.isfile(os.path.join(directory, "manifest.json")):
        return (f"--save {directory}: this is one checkpoint (the older layout); --save into "
                f"a new directory (--resume {directory} still reads it)")
    if not os.path.isdir(directory):
        return None
    strangers = [n for n in os.listdir(directory) if not (_OURS.match(n) or _NUMBERED.match(n))]
    if strangers:
        return (f"--save {directory}: holds {sorted(strangers)[:3]}, which are not minidist "
                "checkpoints; --save into an empty or new directory")
    return None


def begin(directory, step=None, overwrite=False):
    """A new empty folder in `directory` (created if needed) to write a checkpoint into,
    after removing the temporaries of saves that were killed. Refuses a directory that holds
    anything else than checkpoints, and (unless `overwrite`) one whose `latest` is past
    `step`: the commit would move `latest` back to an older step."""
    directory = os.fspath(directory)
    problem = save_problem(directory) or (None if overwrite or step is None
                                          else moves_latest_back(directory, step))
    if problem:
        raise CheckpointError(problem)
    os.makedirs(directory, exist_ok=True)
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if name not in (LATEST, BEST, LOCK) and _OURS.match(name) and left_behind(path):
            shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else \
                _remove_if_there(path)
    tmp = os.path.join(directory, temporary_name())
    os.mkdir(tmp)                       # 0777 & ~umask, as any folder the user makes
    return tmp


# a temporary of another machine's process is taken as left behind after this long (its
# process cannot be asked; no save takes hours)
FOREIGN_AFTER_S = 6 * 3600


def temporary_name(what="save"):
    """`.tmp-<host>-<pid>-<random>` (what="probe": ...-probe): whose it is, so that another
    job's save into the same folder leaves it alone while its process runs (left_behind)."""
    tail = secrets.token_hex(4) if what == "save" else what
    return f".tmp-{_host()}-{os.getpid()}-{tail}"


def _host():
    """This host's name as temporary names carry it (no '-': the name's separator)."""
    return socket.gethostname().replace("-", "_")


def left_behind(path, now=None):
    """Whether the temporary `path` (begin's, commit's pointer, an older minidist's) belongs to
    no running save: its process, on this host, is gone, or another host's has not touched it
    for FOREIGN_AFTER_S. Until walk 31 every save removed every temporary, and a second job
    saving into the same folder lost its files mid-write."""
    host, pid = _owner(os.path.basename(path))
    if host not in (None, _host()):
        try:
            return (now or time.time()) - os.path.getmtime(path) > FOREIGN_AFTER_S
        except OSError:
            return False
    return pid is None or not _running(pid)


def _owner(name):
    """(host or None, pid or None) of a temporary's name."""
    m = re.match(r"^\.tmp-(?:(.+)-)?(\d+)-[^-]+$", name) or re.match(
        r"^\.latest\.tmp-()(\d+)$", name)
    return (None, None) if m is None else (m.group(1) or None, int(m.group(2)))


def _running(pid):
    """Whether process `pid` runs on this host (another user's counts). A zombie does not: a
    rank killed with its launcher stays one until something reaps it, and kill(pid, 0)
    answers for it (the chaos campaign, tests/scripts/chaos.py: a resume's every save kept
    the killed save's temporary)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        with open(f"/proc/{pid}/stat") as f:          # (Linux; elsewhere: running)
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _remove_if_there(path):
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def moves_latest_back(directory, step):
    """Why saving `step` into `directory` would move its `latest` back to an older step (the
    next load_checkpoint would read it), or None. The CLI refuses the run before it starts
    (check_save); this catches a script's own save_checkpoint / save_sharded."""
    try:
        name = read_latest(directory) if os.path.isdir(directory) else None
    except CheckpointError:         # an edited `latest`: the commit replaces it
        return None
    theirs = None if name is None else step_of(name)
    if theirs is None or theirs <= int(step):
        return None
    return (f"{directory}: its latest checkpoint is step {theirs} ({name}), newer than step "
            f"{int(step)} this save writes, and the save would make `latest` name the older "
            "one; save into a new directory, or pass overwrite=True to replace that run")


def commit(tmp, directory, step):
    """Rename the complete checkpoint `tmp` to the next numbered folder of `directory` and
    point `latest` at it; returns its path."""
    name = f"step-{int(step):08d}"
    taken, n = set(os.listdir(directory)), 0
    while (name if n == 0 else f"{name}.{n}") in taken:
        n += 1
    name = name if n == 0 else f"{name}.{n}"
    os.rename(tmp, os.path.join(directory, name))
    fsync_dir(directory)
    pointer = os.path.join(directory, f".latest.tmp-{os.getpid()}")
    with open(pointer, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(pointer, os.path.join(directory, LATEST))
    fsync_dir(directory)
    return os.path.join(directory, name)


def prune(directory, keep, replacing=False, also=None):
    """Remove all but the newest `keep` numbered folders (0: keep all); the one `latest`
    names always stays, and so does `also` (a folder name: --keep-best's, not counted in
    `keep`). `replacing` (a run with --overwrite, which replaces the run that saved here):
    also every folder of a step past latest's, whatever `keep` or `also`, since they are that
    run's, and counted as the newest they would outlive this run's own. Without it those
    stay (a `latest` set back by hand, a save killed before its pointer moved).
    Returns the names removed. Each folder is first renamed to a temporary (atomic), then
    removed: a kill in the middle of removing it left a numbered folder of some files, one
    that no longer verifies, for ever under --keep 0 (tests/scripts/chaos.py found it);
    now what it leaves is a temporary the next save removes."""
    if not os.path.isdir(directory):
        return []
    latest = read_latest(directory)
    folders = numbered(directory)
    past = [n for n in folders if replacing and latest is not None
            and step_of(n) > step_of(latest)]
    others = [n for n in folders if n not in (latest, also) and n not in past]
    stay = keep - 1 if latest is not None else keep
    gone = past + (others[:max(len(others) - stay, 0)] if keep else [])
    doomed = []
    for name in gone:
        doomed.append(os.path.join(directory, temporary_name()))
        try:
            os.rename(os.path.join(directory, name), doomed[-1])
        except FileNotFoundError:        # (gone already: what it was to be)
            doomed.pop()
    if gone:
        fsync_dir(directory)
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return gone
