"""The training loop's checkpoints (--save): each written in the step (the default) or, with
--async-save, on a thread while the next steps train (Megatron-LM's --async-save, PyTorch
DCP's async_save). One code path either way (minidist/strategy/saving.py):

    collect  strategy.save_plan: the ranks' collectives (gathers to rank 0, ZeRO's shards)
             and a host copy of what this rank writes; then begin (rank 0 makes the
             temporary folder). The loop waits for this part in both modes
    write    this rank's files written, fsynced and hashed: here, or on a thread
    commit   collective: rank 0 writes the manifests, renames the folder into place, moves
             `latest`, prunes (--keep) and says "saved step N to DIR/step-0000000N"

Under --async-save at most one save is in flight. It is committed at the first step boundary
where every rank's files are written (commit_if_written: one 1-element all-reduce of host
memory a step, strategy.any_rank, while a save is in flight; the writer thread never calls
MPI), or waited for (finish) before the next save begins, before a signal's save (which is
written in the step: the job is about to end), before a divergence's error line, and before
the end of the run (the last step's save is committed before the final summary and sample).
A write that fails on any rank is one CheckpointError on every rank at that commit, naming
the --save directory (the run stops: exit 2), and `latest` still names the checkpoint before.
claim_save, before step 0: the run's hold on --save (its .lock) and every rank seeing it.
--keep-best: at each commit of a save that followed its step's evaluation, world rank 0 points
DIR/best at it when its val loss is the run's lowest yet, and prune keeps that folder too
(minidist/strategy/best_checkpoint.py).
Tests: tests/test_async_save.py, tests/test_cli_ranks.py, tests/test_keep_best.py.
"""
import math
import os
import time

from minidist.comm.checks import ranks_text
from minidist.strategy import best_checkpoint, checkpoint_dirs, save_lock, saving
from minidist.strategy.checkpoint_dirs import CheckpointError
from minidist.train.cli import UsageError
from minidist.train.inputs import recorded_flags


class Saves:
    """The --save checkpoints of one run; `seconds`: the time the loop spent on them (the
    collect and, in the step, the write; under --async-save the collect, the commits and any
    wait for a write still running)."""

    def __init__(self, args, strategy, log):
        self.args, self.strategy, self.log = args, strategy, log
        self.pending = None              # the save whose files are being written (async)
        self.pending_val = None          # and the val loss of its step (None: not evaluated)
        self.seconds = 0.0
        self.best = None                 # --keep-best, rank 0: (folder name, val loss)
        self.committed = False           # whether this run committed a save yet

    def save(self, model, opt, step, run_state, background=False, say=True, val_loss=None):
        """Collective: save the state after `step` (0-based; `run_state`: the meta's "rng")
        as --save's next folder. `background`: write it on a thread and return None (a later
        commit says "saved step N"); else written and committed now: the folder on rank 0
        (None elsewhere), said if `say`. `val_loss`: the step's, when it evaluated (a
        --keep-best candidate). Waits for a save still in flight first."""
        self.finish()                    # at most one save in flight
        t = time.perf_counter()
        plan = self.strategy.save_plan(model, opt, step + 1, run_state,
                                       recorded_flags(vars(self.args)))
        save = saving.begin(self.args.save, step + 1, plan, self.strategy.job_group(),
                            overwrite=self.args.overwrite)
        if background:
            save.write_in_background()   # the writer thread: files only, no MPI
            self.pending, self.pending_val = save, val_loss
            self.seconds += time.perf_counter() - t
            return None
        save.write()
        self.seconds += time.perf_counter() - t
        return self._commit(save, say, val_loss)

    def commit_if_written(self):
        """At a step boundary, collective while a save is in flight: commit it if every
        rank's files are written (one all-reduce tells), else leave it for a later step."""
        if self.pending is None:
            return
        t = time.perf_counter()
        still_writing = self.strategy.any_rank(not self.pending.written())
        self.seconds += time.perf_counter() - t
        if not still_writing:
            self.finish()

    def finish(self, say=True):
        """Collective: wait for the save in flight (if any) and commit it; its folder on rank
        0, else None."""
        save, self.pending = self.pending, None
        return None if save is None else self._commit(save, say, self.pending_val)

    def _commit(self, save, say, val_loss):
        t = time.perf_counter()
        try:
            try:
                folder = save.commit()   # every rank's files written: rank 0 renames
            except CheckpointError as e:     # what failed, and what is still there
                raise CheckpointError(f"{e} (step {save.step})"
                                      f"{checkpoint_dirs.kept(self.args.save)}") from None
            if self.strategy.rank == 0:  # older folders can go
                args = self.args
                best = self._keep_best(os.path.basename(folder), val_loss, say)
                gone = checkpoint_dirs.prune(args.save, args.keep, replacing=args.overwrite,
                                             also=self.best and self.best[0])
                if self.best and self.best[0] in gone:   # the run --overwrite replaces
                    best_checkpoint.drop(args.save)
                    self.best = None
                if say:                  # (several at once is news: walk 41 lost six)
                    self.log.print0(f"saved step {save.step} to {folder}" + (
                        f" (the best val loss yet, {val_loss:.4f}: "
                        f"{os.path.join(args.save, checkpoint_dirs.BEST)})" if best else "")
                        + (f"; removed {', '.join(gone)} (--keep {args.keep})"
                           if len(gone) > 1 else ""))
            return folder
        finally:
            self.seconds += time.perf_counter() - t

    def _keep_best(self, name, val_loss, say):
        """Rank 0, at a commit, before the prune: with --keep-best, point DIR/best at the
        folder `name` if `val_loss` is the lowest this run has seen (True). At the run's first
        commit, an earlier run's pointer is taken over by a resumed --keep-best run (when it
        names a step up to the one resumed) and removed otherwise (the run --overwrite
        replaces; --no-keep-best)."""
        args = self.args
        if not self.committed:
            self.committed = True
            earlier = best_checkpoint.read(args.save)
            if args.keep_best and earlier and _resumed_within(args, earlier[0]):
                self.best = earlier
            elif best_checkpoint.drop(args.save) and say:      # why, said (review 44 F3)
                typed = "keep_best" in getattr(args, "given", [])    # (else an --overwrite)
                why = (f"this run has {'--no-keep-best' if typed else 'no --keep-best'}"
                       if not args.keep_best else "a run's this one does not continue"
                       if earlier else "not as --keep-best writes it, or naming a folder no "
                       "longer there: this run's evaluations start a new best")
                self.log.print0(f"note: removed {os.path.join(args.save, checkpoint_dirs.BEST)}"
                                f" ({why})")
        if not args.keep_best or val_loss is None or not math.isfinite(val_loss):
            return False
        if self.best is not None and not val_loss < self.best[1]:
            return False
        best_checkpoint.mark(args.save, name, val_loss)
        self.best = (name, val_loss)
        return True


def _resumed_within(args, name):
    """Whether this run resumed from a checkpoint of --save at or past the step of its
    folder `name` (so that folder's val loss is of this run's past)."""
    if not args.resume:
        return False
    here = os.path.realpath(os.path.dirname(os.path.normpath(args.resume)))
    return here == os.path.realpath(args.save) and \
        checkpoint_dirs.step_of(name) <= checkpoint_dirs.step_of(args.resume)


def claim_save(world, save):
    """Before step 0, collective over `world` (None: one process), first-use walk 31: world
    rank 0 holds --save's lock for the run (save_lock.hold: a second run saving into
    the folder is refused, naming the first), and every rank sees a file rank 0 makes there
    (--save on a node's own disk trained until its first save, and before that check at the
    commit, it "saved" a checkpoint missing the other nodes' shards). Returns the lock, to
    keep for the run and save_lock.release() at its end (None: no --save, another
    rank, or no locks on that filesystem); a UsageError on every rank otherwise."""
    if save is None:
        return None
    held, problem = None, None
    if world is None or world.rank == 0:
        try:
            held = save_lock.hold(save)
        except CheckpointError as e:
            problem = str(e)
    several = world is not None and world.size > 1
    if several:
        problem = world.broadcast_object(problem, root=0)
    if problem:
        raise UsageError(problem)
    if several:
        try:
            _check_shared(world, save)
        except UsageError:
            save_lock.release(held)
            raise
    return held


def _check_shared(world, save):
    """Every rank of `world` sees a file world rank 0 makes in `save`, else a UsageError
    naming the ones that do not."""
    probe = None
    if world.rank == 0:
        probe = os.path.join(save, checkpoint_dirs.temporary_name("probe"))
        open(probe, "w").close()
    probe = world.broadcast_object(probe, root=0)
    seen = world.all_gather_object(saving.visible(probe))
    if world.rank == 0:
        os.remove(probe)
    blind = [r for r, s in enumerate(seen) if not s]
    if blind:
        verb = "does" if len(blind) == 1 else "do"
        raise UsageError(f"--save {save}: {ranks_text(blind)} of {world.size} {verb} not see "
                         f"the files world rank 0 writes there; {saving.NOT_SHARED}")
