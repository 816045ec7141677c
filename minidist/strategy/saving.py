"""One save of a checkpoint, for every strategy, in three phases; the middle one touches no
MPI, so it can run on a thread while the next steps train (--async-save, as Megatron-LM's
--async-save or PyTorch DCP's async_save):

    collect  Strategy.save_plan (collective; the main thread): what this rank writes, as a
             SavePlan of host arrays that are the plan's own copies (the optimizer step
             changes the live arrays in place; under CuPy they are copied to the host), JSON
             already encoded, and the manifests it describes; then begin() (collective):
             world rank 0 makes the temporary folder (checkpoint_dirs.begin) and every rank
             learns its name, or the same CheckpointError
    write    Save.write (this rank alone): each file written, fsynced and hashed (its
             manifest entry: bytes, sha256); Save.write_in_background does the same on a
             thread. An OSError is kept as this rank's error, for commit to share
    commit   Save.commit (collective; the main thread, after this rank's write is done):
             every rank's entries and errors gathered to world rank 0, which writes each
             manifest and its digest, renames the folder into place and moves `latest`
             (checkpoint_dirs.commit); if any rank failed, nothing is committed, the
             temporary folder goes, and every rank raises the same CheckpointError naming
             the directory, so `latest` still names the previous checkpoint

A synchronous save is the three in a row (save_now); the loop's --async-save starts the write
on a thread and commits at a later step boundary once every rank's files are written
(minidist/train/saves.py). A process killed before commit leaves only `.tmp-*`, which the next
begin removes. Tests: tests/test_checkpoint_dirs.py, tests/test_async_save.py.
"""
import json
import os
import shutil
import threading
import time
from dataclasses import dataclass, field

from minidist import backend
from minidist.nn.safetensors import save_file
from minidist.strategy import checkpoint_dirs as dirs
from minidist.strategy.checkpoint_dirs import CheckpointError
from minidist.strategy.readers import sha256_file

FORMAT, VERSION = "minidist-checkpoint", 2
DIGEST = "manifest.sha256"


# ---- what a rank writes --------------------------------------------------------------------

@dataclass
class File:
    """One file of a checkpoint folder as this rank writes it: `path` inside the folder,
    and either `arrays` ({name: host array}, written as safetensors with `metadata`) or
    `text` (JSON, encoded when the plan was made); `entry`: what its manifest entry adds
    to the size and sha256 (a ZeRO shard's "rank")."""
    path: str
    arrays: dict = None
    metadata: dict = None
    text: str = None
    entry: dict = field(default_factory=dict)


@dataclass
class Manifest:
    """A manifest.json that world rank 0 writes at commit: in `folder` ("" the checkpoint's
    own, or a TP x ZeRO part's), listing every file written into that folder, with
    `world_size` and `sections` (ZeRO's "zero", TP's "tp")."""
    folder: str
    world_size: int = 1
    sections: dict = field(default_factory=dict)


@dataclass
class SavePlan:
    """What one rank writes of a checkpoint (none of it: a rank whose state another rank
    gathered and writes) and the manifests it describes."""
    files: list = field(default_factory=list)
    manifests: list = field(default_factory=list)


def host_copy(a):
    """`a` as a host array of its own memory: CuPy's copy to the host, or a copy of a numpy
    array (backend.to_host gives numpy's own array back, which the next step changes)."""
    host = backend.to_host(a)
    return host.copy() if host is a else host


def arrays_file(path, arrays, metadata=None, **entry):
    """A safetensors File of `arrays`, host arrays the plan owns (host_copy of live ones)."""
    return File(path, arrays=arrays, metadata=metadata, entry=entry)


def json_file(path, obj):
    """A JSON File, encoded now: the objects it came from may change before the write."""
    return File(path, text=json.dumps(obj, indent=1))


# ---- writing: no MPI, any thread --------------------------------------------------------------

def _entry(path):
    """fsync a written file; its manifest entry."""
    with open(path, "rb") as f:
        os.fsync(f.fileno())
    return {"bytes": os.path.getsize(path), "sha256": sha256_file(path)}


# a folder another node just made may take a moment to be seen here (NFS attribute caches)
VISIBLE_WITHIN_S = 3.0
NOT_SHARED = ("--save must be a folder every rank sees: on a filesystem the nodes share, not "
              "a node's own disk")


def visible(path, within_s=None):
    """Whether `path` exists, looking again for up to `within_s` seconds (VISIBLE_WITHIN_S)."""
    deadline = time.monotonic() + (VISIBLE_WITHIN_S if within_s is None else within_s)
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def write_file(folder, f):
    """File `f` into `folder` (world rank 0's temporary folder, which must be there: a rank
    on a node that does not see it made its own, and saved its files where rank 0 never
    looked) and its subfolder (made if needed), fsynced; its manifest entry."""
    if not visible(folder):
        raise OSError(f"{folder}, made by world rank 0, is not there on this rank; "
                      + NOT_SHARED)
    path = os.path.join(folder, f.path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if f.arrays is not None:
        save_file(f.arrays, path, metadata=f.metadata)
    else:
        with open(path, "w") as out:
            out.write(f.text)
    return {**_entry(path), **f.entry}


def finish(folder, files, step, world_size=1, **sections):
    """Write manifest.json (the files' entries, `sections` such as ZeRO's "zero") and its
    digest, last."""
    manifest = {"format": FORMAT, "version": VERSION, "world_size": world_size,
                "step": int(step), **sections, "files": files}
    write_file(folder, json_file("manifest.json", manifest))
    with open(os.path.join(folder, DIGEST), "w") as f:
        f.write(sha256_file(os.path.join(folder, "manifest.json")) + "\n")
        f.flush()
        os.fsync(f.fileno())


# ---- one save: begin, write, commit ------------------------------------------------------------

class Save:
    """A save between begin and commit: `tmp` the temporary folder every rank writes into,
    `step` the step it holds, `group` the ranks that commit it together (None: one process).
    """

    def __init__(self, directory, tmp, step, plan, group):
        self.directory, self.tmp, self.step, self.group = directory, tmp, int(step), group
        self.files, self.manifests = plan.files, plan.manifests
        self.entries, self.error = {}, None      # this rank's written files; its OSError
        self._thread, self._raised = None, None

    def _rank_text(self):
        return f"rank {self.group.rank}: " if self.group is not None and \
            self.group.size > 1 else ""

    def write(self):
        """Write this rank's files (no MPI). An OSError is kept for commit to share; the
        arrays are let go once written, so the copies do not outlive the write."""
        try:
            for f in self.files:
                self.entries[f.path] = write_file(self.tmp, f)
        except OSError as e:
            self.error = self._rank_text() + str(e)
        finally:
            self.files = []

    def write_in_background(self):
        """write() on a thread (daemon: a process that ends before commit leaves `.tmp-*`,
        as a kill does); written() says when it is done."""
        self._thread = threading.Thread(target=self._write_keeping_errors, daemon=True,
                                        name=f"checkpoint writer (step {self.step})")
        self._thread.start()

    def _write_keeping_errors(self):
        try:
            self.write()
        except BaseException as e:     # not an OSError (a bug): raised again by wait()
            self._raised = e

    def written(self):
        """Whether this rank's files are written (or failed to be)."""
        return self._thread is None or not self._thread.is_alive()

    def wait(self):
        """Until this rank's files are written."""
        if self._thread is not None:
            self._thread.join()
        if self._raised is not None:
            raise self._raised

    def commit(self):
        """Collective over `group`: once this rank's files are written, world rank 0 writes
        the manifests of every rank's files and renames the folder into place; every rank
        raises the same CheckpointError if any rank failed. Returns the checkpoint folder on
        rank 0 (None elsewhere). The ranks first wait for every rank's files untimed
        (wait_for_all): under DDP, TP or PP rank 0 writes what the others hold too, and a
        write longer than --comm-timeout (a big model on a slow file system) aborted the job
        in every save (first-use walk 37), however healthy. They wait for rank 0's part
        (_commit_here) untimed as well: under a 1 s timeout its 3 s look for a shard it did
        not see (VISIBLE_WITHIN_S) aborted the job beside the error it was to say (a review,
        2026-11-29)."""
        self.wait()
        if self.group is not None:
            self.group.wait_for_all()
        mine = (self.entries, self.error, self.manifests)
        everyone = [mine] if self.group is None else self.group.gather_object(mine, root=0)
        if everyone is None:                                   # not rank 0
            errors, folder = None, None
        else:
            errors, folder = self._commit_here(everyone)
        if self.group is not None:   # untimed too: rank 0 alone writes the manifests, renames
            self.group.wait_for_all()   # and looks for each rank's files (up to 3 s per rank)
            errors = self.group.broadcast_object(errors, root=0)
        if errors:
            raise CheckpointError(f"saving {self.directory} failed: {'; '.join(errors)}")
        return folder

    def _commit_here(self, everyone):
        """World rank 0's part of commit: (errors, the committed folder or None)."""
        errors = [err for _, err, _ in everyone if err]
        folder = None
        if not errors:
            entries = {path: e for written, _, _ in everyone for path, e in written.items()}
            errors = _not_seen(self.tmp, self.directory, everyone)
        if not errors:
            try:
                for m in (m for _, _, manifests in everyone for m in manifests):
                    files = {os.path.basename(p): entries[p] for p in sorted(entries)
                             if os.path.dirname(p) == m.folder}
                    finish(os.path.join(self.tmp, m.folder), files, self.step, m.world_size,
                           **m.sections)
                folder = dirs.commit(self.tmp, self.directory, self.step)
            except OSError as e:
                errors.append(str(e))
        shutil.rmtree(self.tmp, ignore_errors=True)            # gone already once committed
        return errors, folder


def _not_seen(tmp, directory, everyone):
    """World rank 0, before it commits: each rank's first file that is not in `tmp` with
    the bytes that rank wrote, as rank 0 sees it (a --save on a node's own disk: the rank
    wrote into a folder of the same name there; "saved", and the resume found a shard
    missing)."""
    errors = []
    for r, (written, _, _) in enumerate(everyone):
        for path, entry in written.items():
            full = os.path.join(tmp, path)
            if not (visible(full) and os.path.getsize(full) == entry["bytes"]):
                errors.append(f"rank {r}'s {path} is not in {directory} as world rank 0 "
                              f"sees it; {NOT_SHARED}")
                break
    return errors


def begin(directory, step, plan, group=None, overwrite=False):
    """Collective over `group` (None: one process): world rank 0 makes the temporary folder
    of a save of `plan` (this rank's SavePlan) under `directory`; every rank gets the Save,
    or the same CheckpointError (a directory holding other files, one that cannot be
    written, one whose `latest` is past `step` unless `overwrite`: checkpoint_dirs.begin).
    The ranks first wait for each other untimed (wait_for_all), as commit's do: rank 0
    collects what it writes before it comes here (under DDP, the whole model and optimizer;
    the others, nothing), and 42.7M parameters on 4 ranks sharing 2 cores took it past
    --comm-timeout 1, which ended a healthy job in begin's broadcast (a review, 2026-11-29:
    tests/test_async_save.py, tests/scripts/save_late.py)."""
    tmp, err = None, None
    if group is None or group.rank == 0:
        try:
            tmp = dirs.begin(directory, step, overwrite)
        except CheckpointError as e:
            err = str(e)
        except OSError as e:
            err = f"saving {directory} failed: {e}"
    if group is not None:        # untimed, as commit's: rank 0 comes late, copying what it
        group.wait_for_all()     # writes (under DDP all of it: a healthy job aborted here)
        tmp, err = group.broadcast_object((tmp, err), root=0)
    if err:
        raise CheckpointError(err)
    return Save(directory, tmp, step, plan, group)


def save_now(directory, step, plan, group=None, overwrite=False):
    """begin, write, commit: a save that is complete when it returns. Returns the folder on
    rank 0 (None elsewhere)."""
    save = begin(directory, step, plan, group, overwrite)
    save.write()
    return save.commit()
