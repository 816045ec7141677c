"""Resuming a run (--resume): the checkpoint's state into the model, and the line that says
what this run does differently from the one that saved it (loop.py calls `resume_run`).

    lr_schedule       the learning-rate schedule of a run's flags, this run's or the ones a
                      checkpoint recorded (so the two can be compared step by step)
    resume_run        the load, the dropout keys' step and the MoE routers' biases; the
                      "resumed from DIR at step N" line (--eval-only: "evaluating DIR") with
                      its notes: flags that change the numbers (_MUST_MATCH; --data's
                      contents by their digest: _other_contents), schedule flags
                      that changed a rate before the checkpoint's step (a wsd run extended
                      before its decay is the longer run, and says nothing), the checkpoint's
                      pipeline schedule, and a learning rate that jumps over twice the
                      checkpoint's last (_lr_jump; for wsd the checkpoint that extends it)
Tests: tests/test_train_resume.py (the notes, the wsd extension), tests/test_moe_bias.py.
"""
import os

from minidist.optim import WarmupCosine, WarmupStableDecay
from minidist.strategy import checkpoint_dirs
from minidist.strategy.checkpoint_dirs import CheckpointError
from minidist.train.inputs import recorded_flags, schedule_differences

# flags whose change makes a resumed run differ from an uninterrupted one (the MoE loss
# weights and capacity too: first-use walk 35 saw them change the losses without a note);
# the schedule's
_MUST_MATCH = ("seed", "batch_size", "weight_decay", "beta1", "beta2", "grad_clip", "data",
               "dropout", "muon_momentum", "muon_ns_steps", "moe_bias_rate",
               "moe_capacity_factor", "moe_aux_loss_coef", "moe_z_loss_coef", "grad_dtype")
# flags that split the same global batch otherwise: the same numbers up to rounding (walk 35:
# "grad_accum changed, so the run will differ" on a resume equal to 8.9e-16), another memory
_SAME_BATCH = ("grad_accum",)
# the flags a resumed optimizer takes (set_hyperparameters), over a run's checkpoint only
OPTIMIZER = ("weight_decay", "beta1", "beta2")
_SCHEDULE = ("steps", "lr", "min_lr", "warmup", "lr_schedule", "decay_steps")


def lr_schedule(flags):
    """The learning-rate schedule of a run's flags (vars(args), or the flags a checkpoint
    recorded: one from before --lr-schedule is a cosine run)."""
    steps, lr = flags["steps"], flags["lr"]
    warmup = flags["warmup"] if flags.get("warmup") is not None else steps // 20
    min_lr = flags["min_lr"] if flags.get("min_lr") is not None else lr / 10
    if flags.get("lr_schedule", "cosine") == "wsd":
        decay = flags.get("decay_steps") or max(1, steps // 5)
        return WarmupStableDecay(lr, warmup, steps, decay, min_lr)
    return WarmupCosine(lr, warmup, steps, min_lr)


def _schedule_changes(saved, ours, start):
    """The schedule's flags that changed since the checkpoint, where they changed a learning
    rate before its step `start` ([] where not: a wsd run extended before its decay began is
    the run its new --steps would have trained)."""
    saved = {"lr_schedule": "cosine", "decay_steps": None, **saved}   # (before they existed)
    changed = [k for k in _SCHEDULE if k in saved and saved[k] != ours[k]]
    if not changed or not all(k in saved for k in ("steps", "lr")):
        return changed
    before, now = lr_schedule(saved), lr_schedule(ours)
    return changed if any(before(i) != now(i) for i in range(start)) else []


def _lr_jump(args, saved, ours, start):
    """A note (words) where this run's learning rate at step `start` is over twice the one
    the checkpoint's run took its last step with (a finished or decayed run resumed with a
    larger --steps: its schedule starts again from high up, with no warmup), else None. A
    wsd run's names the checkpoint beside --resume's from before its decay, which extends
    it (`_before_decay`)."""
    if start < 1 or not all(k in saved for k in ("steps", "lr")):
        return None
    saved = {"lr_schedule": "cosine", "decay_steps": None, **saved}   # (before they existed)
    last, nxt = lr_schedule(saved)(start - 1), lr_schedule(ours)(start)
    if nxt <= 2 * last:
        return None
    said = (f"the learning rate jumps from {last:.2e} (the checkpoint's last step) to "
            f"{nxt:.2e} (step {start + 1}), with no warmup")
    if saved["lr_schedule"] == "wsd":
        decay = saved["decay_steps"] or max(1, saved["steps"] // 5)
        said += f"; its run's decay began after step {saved['steps'] - decay}: " + \
            _before_decay(args, saved["steps"] - decay)
    return said


def _before_decay(args, last):
    """Words naming the newest checkpoint beside --resume's (its --save directory's) of a
    step <= `last`, which a longer wsd run extends exactly, and whether this run's own saves
    (--keep) would remove it; or saying to resume from one."""
    folder = os.path.dirname(os.path.normpath(args.resume))
    steps = {name: checkpoint_dirs.step_of(os.path.join(folder, name))
             for name in checkpoint_dirs.numbered(folder)}
    before = [name for name, step in steps.items() if step is not None and step <= last]
    if not before:
        return "resume from a checkpoint saved by then to extend it"
    name = max(before, key=lambda n: steps[n])
    said = f"--resume {os.path.join(folder, name)} extends it"
    newer = sum(1 for step in steps.values() if step is not None and step > steps[name])
    same = args.save and os.path.abspath(args.save) == os.path.abspath(folder)
    if same and args.keep and newer + 1 >= args.keep:
        said += (f" (this run's first save, keeping --keep {args.keep}, would remove it: "
                 "--save another folder or raise --keep)")
    return said


def _other_contents(saved, ours):
    """Whether --data is the path the checkpoint's run trained on but holds other tokens
    now (their digests differ: data_open.record_data); a checkpoint from before the digest
    says nothing. First-use walk 33: a corpus regenerated in place was resumed on without a
    word."""
    return (saved.get("data") == ours.get("data") and bool(saved.get("data_digest"))
            and bool(ours.get("data_digest")) and saved["data_digest"] != ours["data_digest"])


def resume_run(args, strategy, log, model, opt):
    """Load --resume into the model and optimizer (and the run's dropout keys and MoE
    biases), say so in one line with what differs from the checkpoint's run (the flags that
    change its numbers, its schedule's, a learning-rate jump); returns its step. `opt` None
    (--eval-only): the model's parameters alone, as the checkpoint holds them (--amp's
    16-bit ones, which its forward used); no optimizer state is read (one process, 4 layers
    of 512: a traced peak of 81.6 MiB, 160.4 with AdamW's state: minidist/train/README.md)."""
    flags = None if opt is None else opt.hyperparameters()   # this run's: the load replaces
    try:
        state = strategy.load(args.resume, model, opt)
    except CheckpointError as e:
        older = _older_checkpoints(args.resume)
        if "corrupt checkpoint" not in str(e) or not older:
            raise
        same = args.save and os.path.realpath(args.save) == \
            os.path.realpath(os.path.dirname(older[-1]))     # (its saves replace the newer)
        raise CheckpointError(f"{e}; older checkpoints beside it: {', '.join(older)} "
                              f"(--resume {older[-1]}{' --overwrite' * bool(same)} "
                              "continues from the newest of them)") from None
    dropout = state["rng"].get("dropout", {})   # before keyed dropout: a generator's state,
    model.dropout_keys.load_state_dict(          # and the keys' step is the steps taken
        dropout if "step" in dropout else {"step": state["step"]},
        seed_may_change=True)                    # (--seed given: the line below notes it)
    model.router_bias.load_state_dict(state["rng"].get("moe_bias", {}))   # before: all 0
    saved, ours = recorded_flags(state.get("extra", {})), recorded_flags(vars(args))
    if saved and opt is not None:   # a run's checkpoint: its settings are this run's flags
        opt.set_hyperparameters(flags)   # (RUN_RESUMED took the run's where not given; a
    # resume given --weight-decay 0.5 trained on with the checkpoint's 0.1, its line saying it
    # changed).
    # One of your own loop's, which records no flags, keeps the settings it saved: said so
    kept = [] if saved or args.eval_only else [f"--{k.replace('_', '-')}" for k in OPTIMIZER
                                               if k in getattr(args, "given", [])]
    if kept:
        log.print0(f"note: {args.resume} records no run's flags (a checkpoint of your own "
                   f"loop?): its optimizer keeps the settings it saved, not {', '.join(kept)}")
    changed = [k for k in _MUST_MATCH if k in saved and saved[k] != ours[k]]
    other_tokens = _other_contents(saved, ours)
    changed += ["data (the same path, other contents)"] if other_tokens else []
    changed += _schedule_changes(saved, ours, state["step"]) if saved else []
    changed = [] if args.eval_only else [          # (nothing trains: nothing differs)
        f"{k} {saved[k]} -> {ours[k]}" if k in saved else k for k in changed]   # (walk 41)
    other = [] if args.eval_only else schedule_differences(args, saved) + [
        f"--{k.replace('_', '-')} {saved[k]}" for k in _SAME_BATCH
        if saved.get(k) is not None and saved[k] != ours[k]]
    jump = None if args.eval_only or not saved else _lr_jump(args, saved, ours,
                                                             state["step"])
    end = min(args.steps, args.stop_at) if args.stop_at else args.steps
    flag = "--stop-at" if end < args.steps else "--steps"
    done = not args.eval_only and state["step"] >= end   # a requeued finished run
    log.print0((f"evaluating {args.resume}, trained {state['step']} steps" if args.eval_only
                else f"resumed from {args.resume} at step {state['step']}") + (
        f": the run is done ({flag} {end}), nothing to train, only its evaluation ({flag} "
        f"above {end} trains it further)" if done else "") + (
        f" (note: {', '.join(changed)} changed, so the run will differ from an uninterrupted"
        " one)" if changed else "")
        + (f"; note: the checkpoint's run had {' '.join(other)} (the same numbers under "
           "any schedule or split of the batch, up to rounding; another speed and memory: "
           "give them to keep its)" if other else "")
        + (f"; note: {jump}" if jump else "")
        + (f"; note: --data {args.data or '(Python sources)'} holds other tokens than when "
           "that run trained (edited or replaced): this val loss is not the one it ended "
           "with" if other_tokens and args.eval_only else "")
        + ("" if args.save or args.eval_only else
           "; no --save DIR: the steps this run trains are not saved"))
    return state["step"]


def _older_checkpoints(path, most=3):
    """The checkpoint folders older than the one --resume `path` names, beside it in its
    --save directory (the newest `most`, oldest first), or []: what a run whose newest
    checkpoint is corrupt can resume from instead (first-use walk 37: a requeued
    --resume auto failed on it again and again, the line naming no way out)."""
    try:
        folder = os.path.normpath(checkpoint_dirs.resolve(path))
    except CheckpointError:
        return []
    parent, name = os.path.split(folder)
    names = checkpoint_dirs.numbered(parent or ".")
    if name not in names:
        return []
    return [os.path.join(parent, n) for n in names[:names.index(name)][-most:]]
