"""The training loop every strategy shares: one step is

    batch (seed, step) -> this rank's rows -> forward/backward over --grad-accum micro-batches
    -> gradient sync -> global grad-norm clip -> AdamW step -> loss averaged over ranks

with the schedule's lr, logs and --log-json rows from rank 0 (`print0`), periodic val loss,
checkpoints (--save, --resume; --async-save writes them on a thread while the next steps
train: minidist/train/saves.py) and a text sample at the end. What a parallel run does
differently lives in its Strategy (composed by minidist/train/strategy.py, the methods in
minidist/strategy/base.py); this file does not change.
Resume is bit-identical: the checkpoint holds parameters, optimizer state, the dropout RNG, the
MoE routers' biases (--moe-bias-rate: minidist/nn/moe_bias.py) and the step, and batches
depend only on (seed, step).
No device -> host read in a step that does not log: each step's loss and gradient norm stay
on the device (minidist/train/progress.py StepValues) and are read in one go at the steps
that log (--log-every, every step with --log-json), evaluate, save or end.
At the end of each step the ranks agree (strategy.any_rank, one 1-element all-reduce of host
memory) whether to stop: a signal on any rank (Ctrl-C, SIGTERM, SIGUSR1:
minidist/train/preemption.py) saves that step with --save and exits; a loss or gradient norm
that is not finite, found at the next read, raises Diverged (one `error:` line naming the
first such step) before anything is saved, so no checkpoint holds NaNs.
Log lines count steps done, `step N/total`, with the time elapsed and the ETA; a --save that
would replace a newer checkpoint is refused before step 0 (checkpoint_dirs.check_save).
Tests: tests/test_train.py, tests/test_cli_runs.py (RUNS, CTRL_C).
"""
import math
import os
import time

import numpy as np

from minidist import backend
from minidist.autograd import no_grad
from minidist.nn import GPTConfig
from minidist.nn.moe_bias import LoadBalance, global_load_stats, report_line
from minidist.strategy import checkpoint_dirs
from minidist.train import preemption
from minidist.train.args import arch_fields
from minidist.train.cost import model_flops
from minidist.train.saves import Saves
from minidist.train.end_sample import sample_at_end
from minidist.train.startup import describe_run, run_record
from minidist.train.data_open import check_resume_vocabulary, open_data_shared, record_data
from minidist.train.memory_check import check_memory
from minidist.train.init_from import initial_router_bias, initial_weights
from minidist.train.resume import lr_schedule, resume_run
from minidist.train.step import train_step
from minidist.train.progress import (Logger, StepValues, drop_rows_from, eta, holds_summary,
                                     first_not_finite)
from minidist.train.strategy import make_strategy
from minidist.train.cli import UsageError


# the val batches' draw: one set for every run, whatever its --seed (first-use walk 41: one
# checkpoint's val loss moved 0.09 nats between seeds, the windows' choice alone, and a seed
# sweep compared runs on other text)
VAL_SEED = 0


@no_grad()
def evaluate(strategy, model, data, batch_size, block_size, iters, signals=None, parts=1):
    """Mean val loss over `iters` fixed batches (the same ones at every eval and in every
    run, whatever its seed: VAL_SEED), a 0-d float64 on the device: the caller reads it
    (one host read per evaluation, not one per batch). Split as training splits a batch:
    each replica evaluates its rows (local_rows) in `parts` forwards (--grad-accum's: no
    more memory than a training micro-batch's; its whole share at once took 7x a step's at
    --grad-accum 16), the replicas' means averaged (global_mean; equal rows: the mean of all
    of them), so 4 data-parallel ranks do a quarter of the work each, not all of it 4 times.
    `signals` (preemption.Flag): before each batch the ranks ask whether any was signalled
    (Ctrl-C; with --save SIGTERM, SIGUSR1), and all stop together: None, nothing measured."""
    was_training = model.training
    model.eval()
    total = 0.0
    try:
        for i in range(iters):
            if signals is not None and strategy.any_rank(signals.is_set()):
                return None
            x, y = strategy.local_rows(*data.get_batch(VAL_SEED, "val", i, batch_size,
                                                       block_size))
            for xs, ys in zip(np.split(x, parts), np.split(y, parts)):
                total = total + model(xs, ys)[1].data.astype("float64")   # summed on device
    finally:
        model.train(was_training)
    return strategy.global_mean(total / (iters * parts))


def _run_state(model):
    """What a checkpoint's meta "rng" holds beside the parameters and optimizer state: the
    dropout keys' step and the MoE routers' biases (minidist/nn/moe_bias.py; every rank holds
    all of them, so whichever rank writes has them all)."""
    return {"dropout": model.dropout_keys.state_dict(),
            "moe_bias": model.router_bias.state_dict()}


def _config(args, data):
    try:
        return GPTConfig(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd,
                         block_size=args.block_size, vocab_size=data.vocab_size,
                         dropout=args.dropout, attention=args.attention,
                         attention_block=args.attention_block, **arch_fields(args),
                         **moe_fields(args))
    except ValueError as e:
        raise UsageError(f"model flags: {e}") from None


def moe_fields(args):
    """GPTConfig's moe_* fields from the --moe-* flags (minidist/nn/moe.py)."""
    return dict(moe_experts=args.moe_experts, moe_top_k=args.moe_top_k,
                moe_capacity_factor=args.moe_capacity_factor,
                moe_aux_loss_coef=args.moe_aux_loss_coef, moe_z_loss_coef=args.moe_z_loss_coef,
                moe_every=args.moe_every, moe_shared=args.moe_shared)


class Diverged(UsageError):
    """The loss or the gradients stopped being finite (or --amp skipped too many steps in a
    row): one `error:` line naming the step (minidist/train/cli.py run_main), nothing saved,
    exit status 3 (a sweep's script tells it from a bad flag's 2: first-use walk 41)."""
    exit_status = 3


def _check_stop(args, start):
    """The step this run stops at (--steps, or --stop-at before it); UsageError if the
    checkpoint it resumes from is past it already (`start`: its step, None: unknown)."""
    stop = min(args.steps, args.stop_at) if args.stop_at else args.steps
    if start is not None and start > stop:   # (start == stop: a requeued finished run: it
        flag = "--stop-at" if stop < args.steps else "--steps"   # evaluates, as below)
        raise UsageError(f"{flag} {stop}: the checkpoint {args.resume} is at step {start} "
                         f"already; give {flag} above {start} to train it further, or --save "
                         "a new folder without --resume to start over")
    return stop


def train(args, world=None, each_step=None):
    """Run the training described by the parsed flags; returns the final summary dict.
    `world`: comm.init's world group (None: one process). The caller has set up the
    backend (backend.setup: threads, device), as examples/train_gpt.py shows. The signal
    handlers it takes (preemption.py) are the caller's again when it returns or raises.
    `each_step(step)`, if given, is called at the end of each step, after its evaluation
    and save (a watcher's: tests/scripts/soak.py samples memory and objects there)."""
    with preemption.handlers_kept():
        return _train(args, world, each_step)


def _train(args, world, each_step):
    preemption.stop_at_once()       # SIGTERM before step 1: exit 75 at once (143: no --save)
    auto = args.resume == "auto"
    args.resume = checkpoint_dirs.resume_dir(args.resume, args.save)   # "auto": None or newest
    checkpoint_dirs.check_save(args.save, args.resume, getattr(args, "overwrite", False),
                               args.steps)
    if args.resume and not args.eval_only:   # by its folder's name or manifest, first
        _check_stop(args, checkpoint_dirs.step_of(args.resume))
    strategy = make_strategy(args, world)
    log = Logger(strategy.rank, args.log_json)
    if auto and args.resume is None:         # a requeued job's first run, or a --save typo
        log.print0(f"--resume auto: no checkpoint in {args.save} yet: starting at step 0")
    if strategy.rank == 0 and args.log_json and not args.resume:
        open(args.log_json, "w").close()         # a new run starts a new log; --resume appends
    data = open_data_shared(args, strategy.job_group())  # text or token files (data_open.py)
    record_data(args, data)                      # its digest and tokenizer, for checkpoints
    check_resume_vocabulary(args, data)          # --resume's model reads its ids
    data.check_block_size(args.block_size,       # both splits, before step 0
                          fixed=args.resume and f"--resume {args.resume}")
    config = _config(args, data)
    fits = check_memory(args, config, strategy.job_group())   # the planner's bill vs free
    model = strategy.build_model(config, args.seed, args.dtype,   # --init-from's weights
                                 initial_weights(args, config, data, log))   # (None: seed's)
    model.router_bias.load_state_dict(initial_router_bias(args))   # an MoE checkpoint's
    opt = None if args.eval_only else strategy.build_optimizer(model, args)  # (weights only)
    schedule = lr_schedule(vars(args))
    start = resume_run(args, strategy, log, model, opt) if args.resume else 0
    folder, name = os.path.split(os.path.abspath(args.resume or "."))
    if start and strategy.rank == 0 and args.log_json and not args.eval_only \
            and checkpoint_dirs.numbered(folder)[-1:] == [name]:     # (not a branch from an
        dropped = drop_rows_from(args.log_json, start)   # older one: its run's rows, saved)
        if dropped:
            log.print0(f"note: --log-json {args.log_json}: {dropped} row(s) of steps past "
                       f"step {start} taken out (the run that wrote them stopped before "
                       "saving them; this run logs those steps again)")
    stop = start if args.eval_only else _check_stop(args, start)   # --eval-only: no steps
    describe_run(args, strategy, log, model, data, fits)
    tokens_per_step = args.batch_size * args.block_size
    flops_per_rank = model_flops(config, args.batch_size, args.block_size) / (   # the model's
        1 if world is None else world.size)             # in theory (MFU's numerator), a rank's
    val_loss, t_start, reads_before = None, time.perf_counter(), backend.host_reads()
    t_aside = 0.0                # of the run's seconds, those spent evaluating (saving: saves)
    signals = preemption.Flag()     # Ctrl-C, SIGTERM, SIGUSR1: stop at the step boundary
    balance = LoadBalance(model, world, args.moe_bias_rate)   # MoE: the router biases
    saves = Saves(args, strategy, log)       # --save: written here, or on a thread (--async-save)
    values, t_mark = StepValues(args.log_every), t_start    # each step's loss and norm
    for step in range(start, stop):
        lr = schedule(step)
        opt.set_lr(lr)
        x, y = data.get_batch(args.seed, "train", step, args.batch_size, args.block_size)
        try:    # overflow is checked below, after the step: numpy need not warn on each op
            with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
                loss, norm, mem = train_step(strategy, model, opt, x, y, args)
        except FloatingPointError as e:     # --amp: too many overflowing steps in a row
            raise Diverged(f"step {step + 1}: {e}; stopped, nothing saved") from None
        copies = _copies(strategy, world, x, y)     # ranks holding each row (MoE's sums)
        balance.after_step(copies)           # --moe-bias-rate: one all-reduce
        values.add(step, loss, norm)         # on the device: nothing waits for the GPU here
        last, at = step == stop - 1, f"step {step + 1:5d}/{stop}"
        evals = (args.eval_every and (step + 1) % args.eval_every == 0) or last
        every = args.save_every or args.eval_every
        saving = args.save and (last or (every and (step + 1) % every == 0)   # --keep-best:
                                or (evals and args.keep_best))     # each evaluation's too
        printed = step == start or (step + 1) % args.log_every == 0 or last
        rows = bad = row = None
        if values.due(printed or args.log_json or evals or saving):
            rows = values.read()        # the loss and norm of each step since the last read
            _settle(strategy, step)     # --amp verdicts taken on the device: read back too
            bad = first_not_finite(rows, strategy.amp is not None)
            dt, (_, loss, norm) = (time.perf_counter() - t_mark) / len(rows), rows[-1]
            row = {"step": step, "loss": loss, "lr": lr, "tokens_per_s": tokens_per_step / dt,
                   "ms_per_step": dt * 1e3, "grad_norm": norm, "mem": mem,
                   "comm_bytes": strategy.comm_bytes(), "model_tflops": flops_per_rank / dt / 1e12}
            if args.peak_tflops:
                row["mfu"] = row["model_tflops"] / args.peak_tflops
            if args.log_json:    # the same on every rank: every rank joins the stats' reduce
                row.update(global_load_stats(model, world, copies))
            if not evals:        # an evaluating step's row waits for its val loss, below
                log.json0(row)
            if printed:
                eta_ = eta(time.perf_counter() - t_start, step + 1 - start, stop - step - 1)
                log.print0(f"{at} | loss {loss:.4f} | lr {lr:.2e} | {tokens_per_step / dt:8.0f}"
                           f" tok/s | {dt * 1e3:7.1f} ms/step | " + (
                               f"mfu {100 * row['mfu']:5.2f}% | " if "mfu" in row else "")
                           + eta_)
            t_mark = time.perf_counter()
        saves.commit_if_written()            # --async-save: once every rank's files are written
        if strategy.any_rank(signals.is_set() or bad is not None):  # every rank stops together
            if rows is None:                  # a signal between reads: check before saving
                bad = first_not_finite(values.read(), strategy.amp is not None)
                _settle(strategy, step)       # (not inside the save: rank 0's state_dict)
            if evals and row is not None:     # stopping before its evaluation: the row now
                log.json0(row)
            if strategy.any_rank(bad is not None):
                saves.finish()                # a save in flight holds an earlier, finite step
                bad = bad or (step, math.nan, math.nan)
                log.json0({"final": True, "diverged": True, "steps": bad[0] + 1,
                           "schedule_steps": args.steps, "loss": bad[1], "grad_norm": bad[2],
                           "val_loss": None, "run": run_record(args, strategy)})
                raise Diverged(_diverged(args, bad))
            _stop(args, saves, strategy, log, model, opt, step, signals)
        t_eval_from = time.perf_counter()
        if evals:
            log.print0(f"{at} | evaluating on {args.eval_iters} val batch"
                       f"{'es' * (args.eval_iters != 1)} ...")
            # its all-reduce also lines the ranks up, so the next step's time does not
            # include another rank's evaluation
            mean = evaluate(strategy, model, data, args.batch_size, args.block_size,
                            args.eval_iters, signals, args.grad_accum)
            if mean is None:                  # a signal during it: save this step, stop
                _stop(args, saves, strategy, log, model, opt, step, signals,
                      " (its evaluation cut)")
            val_loss = float(backend.host_read(mean, "eval loss"))
            log.print0(f"{at} | val loss {val_loss:.4f} (unigram entropy "
                       f"{data.unigram_entropy:.4f})")
            moe = balance.report(copies)     # MoE: the experts' loads
            if moe:
                log.print0(f"{at} | {report_line(moe)}")
            log.json0({**row, "val_loss": val_loss, **moe})   # (every evaluating step was read)
            t_aside += time.perf_counter() - t_eval_from
        if saving:    # every rank's host copies now; the files on a thread with --async-save
            folder = saves.save(model, opt, step, _run_state(model),
                                background=args.async_save, val_loss=val_loss if evals else None)
            if not (args.async_save or last) and strategy.any_rank(signals.is_set()):
                _stop(args, saves, strategy, log, model, opt, step, signals, saved=True,
                      folder=folder)
        if evals or saving:              # the next step's time starts after them
            t_mark = time.perf_counter()
        if each_step is not None:
            each_step(step)
    saves.finish()              # the last save committed before the summary and the sample
    return _finish(args, strategy, log, model, data, val_loss, time.perf_counter() - t_start,
                   t_aside + saves.seconds, reads_before, stop, signals, saves.seconds)


def _settle(strategy, step):
    """--amp on cupy with the multi-tensor kernels decides each step's overflow on the device
    (minidist/train/amp.py): read those verdicts back where the losses are read, so too many
    skipped steps in a row stop the run here (the host verdict would have stopped it at
    that step)."""
    if strategy.amp is None:
        return
    try:
        strategy.amp.settle()
    except FloatingPointError as e:
        raise Diverged(f"by step {step + 1}: {e}; stopped, nothing saved") from None


def _diverged(args, bad):
    step, loss, norm = bad
    return (f"step {step + 1}: loss {loss:.4g}, gradient norm {norm:.4g}: training diverged "
            f"(--lr {args.lr:g} too high?); stopped, nothing saved"
            + checkpoint_dirs.kept(args.save))


def _copies(strategy, world, x, y):
    """How many ranks hold each row of the global batch (x, y): world size x this rank's
    rows / the batch's rows (1 on one process and under plain dp or ep; tp under --tp)."""
    return 1 if world is None else world.size * len(strategy.local_rows(x, y)[0]) // len(x)


def _stop(args, saves, strategy, log, model, opt, step, signals, when="", saved=False,
          folder=None):
    """A signal on some rank: every rank saves this step (with --save; a save in flight is
    committed first, and this one is written in the step, --async-save or not: the job is
    about to end), one line, exit. `when`: what the line adds after "after step N" (an
    evaluation cut short). `saved`: this step was just saved, in `folder` (a signal during
    a periodic save: first-use walk 37 found the run trained a step more and saved again,
    twice the time a scheduler's grace period must cover). Only called after a step whose
    loss and gradient norm were finite on every rank, so the parameters saved are finite."""
    interrupted = strategy.any_rank(signals.interrupted())      # Ctrl-C anywhere: 130
    what = preemption.describe(interrupted, signals.name)
    if args.save:
        if not saved:
            folder = saves.save(model, opt, step, _run_state(model), say=False)
        log.print0(f"{what} after step {step + 1}{when}: saved to {folder}; run the same "
                   f"command with --resume {args.save} (or --resume auto) to continue")
    else:
        log.print0(f"{what} after step {step + 1}{when}: nothing saved (no --save DIR)")
    raise SystemExit(preemption.exit_status(interrupted, bool(args.save)))


def _finish(args, strategy, log, model, data, val_loss, seconds, aside, reads_before, stop,
            signals, save_seconds=0.0):
    """The final evaluation (if none ran), the sample, the summary lines and JSON row.
    `seconds`: the steps' wall time, `aside` of it evaluating and saving, `save_seconds` the
    loop's time in saves (Saves.seconds: with --async-save, not the writes); `stop`: the steps
    done (--stop-at's, below --steps, whose schedule the run follows: "schedule_steps");
    `signals`: a Ctrl-C during that evaluation ends the run there (nothing trained, so
    nothing to save): one line, exit 130."""
    requeued = val_loss is None and not args.eval_only    # (nothing trained: at the end)
    if val_loss is None:              # nothing trained (resumed at the end): measure anyway
        mean = evaluate(strategy, model, data, args.batch_size, args.block_size,
                        args.eval_iters, signals, args.grad_accum)
        if mean is None:
            interrupted = strategy.any_rank(signals.interrupted())
            log.print0(f"{preemption.describe(interrupted, signals.name)} during the "
                       f"evaluation at step {stop}: nothing evaluated, nothing saved")
            raise SystemExit(preemption.exit_status(interrupted, bool(args.save)))
        val_loss = float(backend.host_read(mean, "eval loss"))
    if args.eval_only:                # the number asked for, before the sample's text
        tokens = args.eval_iters * args.batch_size * args.block_size
        split = data.meta["val_tokens"]        # (windows drawn at random: some repeat)
        batches = f"{args.eval_iters} batch{'es' * (args.eval_iters != 1)}"
        log.print0(f"val loss {val_loss:.4f} nats/token, perplexity {math.exp(val_loss):.2f}, "
                   f"over {tokens:,} tokens of the val split ({batches} of {args.batch_size} x "
                   f"{args.block_size} windows drawn at random from its {split:,} tokens) vs "
                   f"unigram entropy {data.unigram_entropy:.4f}; nothing trained")
    text, cut, interrupted = "", False, False
    if args.sample and data.tokenizer is None:
        log.print0(f"no sample: no tokenizer for {data.source} to turn tokens into text "
                   "(GPT-2's vocab.json and merges.txt beside the token files, or a meta.pkl "
                   "with its itos table, would be one)")
    elif args.sample:
        text, cut, interrupted = sample_at_end(args, strategy, log, model, data, signals)
    reads = {k: n - reads_before.get(k, 0) for k, n in backend.host_reads().items()
             if n > reads_before.get(k, 0)}
    summary = {"final": True, "val_loss": val_loss, "unigram_entropy": data.unigram_entropy,
               "steps": stop, "schedule_steps": args.steps, "train_seconds": seconds,
               "eval_save_seconds": aside, "save_seconds": save_seconds,
               "sample": text, "host_reads": reads,
               # what ran, for a sweep's logs (first-use walk 41: none said which run it was)
               "run": run_record(args, strategy)}
    if stop < args.steps and not args.eval_only:    # (walk 41: read as the run's end)
        summary["stopped_at"] = stop
    if args.eval_only:
        summary.update(eval_only=True, perplexity=math.exp(val_loss), eval_tokens=tokens,
                       evaluated=args.resume or args.init_from,   # (walk 41: unnamed, and
                       schedule_steps=None)                        # --steps' default 800)
    else:
        said = ("final val loss" if stop == args.steps else
                f"val loss at step {stop} of {args.steps} (--stop-at)")
        log.print0(f"{said} {val_loss:.4f} nats/token vs unigram entropy "
                   f"{data.unigram_entropy:.4f} (a model that ignores context); "
                   f"{seconds:.1f} s of training, {aside:.1f} s of it evaluating"
                   + (f" and saving ({save_seconds:.1f} s in saves"
                      + (", their files written on a thread: --async-save" if args.async_save
                         else "") + ")" if args.save else ""))
    log.print0("device -> host reads on rank 0 (backend.host_read): " + (", ".join(
        f"{why} {n}" for why, n in reads.items()) or "none"))
    if not args.eval_only:             # (its figures are per training step)
        strategy.finish(args, log)     # e.g. DDP's communication summary, the --trace file
    if requeued and strategy.rank == 0 and args.log_json and holds_summary(args.log_json, stop):
        log.print0(f"note: --log-json {args.log_json} holds this run's summary of {stop} "
                   "steps already: not written again")     # (walk 41: a second final row)
    else:
        log.json0(summary)
    if cut:                            # a signal during the sample: the run is done, say so
        log.print0(f"{preemption.describe(interrupted, signals.name)} during the sample "
                   "(--sample 0 skips it): " + (
                       "the evaluation is done (above)" if args.eval_only else
                       f"the {stop} steps are done" + (f" and saved in {args.save}"
                                                      if args.save else "")))
        if interrupted:                # Ctrl-C: 130; a scheduler's signal: the job is done,
            raise SystemExit(preemption.exit_status(True))      # 0 (a requeue has no work)
    return summary
