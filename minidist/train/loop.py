"""The training loop every strategy shares: one step is

    batch (seed, step) -> this rank's rows -> forward/backward over --grad-accum micro-batches
    -> gradient sync -> global grad-norm clip -> AdamW step -> loss averaged over ranks

with the schedule's lr, logs and --log-json rows from rank 0 (`print0`), periodic val loss,
checkpoints (--save, --resume) and a text sample at the end. What a parallel run does
differently lives in its Strategy (minidist/train/strategy.py); this file does not change.
Resume is bit-identical: the checkpoint holds parameters, optimizer state, the dropout RNG and
the step, and batches depend only on (seed, step).
Tests: tests/test_train.py.
"""
import json
import time

from minidist import backend
from minidist.autograd import no_grad
from minidist.nn import GPTConfig
from minidist.optim import WarmupCosine
from minidist.train import checkpoint_dirs, preemption
from minidist.train.data import TokenData
from minidist.train.step import train_step
from minidist.train.strategy import make_strategy
from minidist.train.cli import UsageError, printable


class Logger:
    """Rank 0's output: `print0` for people, `json0` for --log-json (one object per line)."""

    def __init__(self, rank, log_json=None):
        self.rank, self.log_json = rank, log_json

    def print0(self, *args):
        if self.rank == 0:
            print(*args, flush=True)

    def json0(self, row):
        if self.rank == 0 and self.log_json:
            with open(self.log_json, "a") as f:
                f.write(json.dumps(row) + "\n")


@no_grad()
def evaluate(model, data, seed, batch_size, block_size, iters):
    """Mean val loss over `iters` fixed batches (the same ones at every eval)."""
    was_training = model.training
    model.eval()
    total = 0.0
    for i in range(iters):
        x, y = data.get_batch(seed, "val", i, batch_size, block_size)
        total += float(model(x, y)[1].item())
    model.train(was_training)
    return total / iters


def sample_text(model, data, n, seed, prompt="\n", temperature=0.8, top_k=40):
    idx = data.tokenizer.encode(prompt)[None, :]
    out = model.generate(idx, n, temperature=temperature, top_k=top_k, seed=seed)
    return data.tokenizer.decode(out[0])


def _rng_states(model):
    return {"dropout": model.dropout_rng.bit_generator.state}


def _config(args, data):
    try:
        return GPTConfig(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd,
                         block_size=args.block_size, vocab_size=data.vocab_size,
                         dropout=args.dropout, bias=args.bias, attention=args.attention,
                         attention_block=args.attention_block)
    except ValueError as e:
        raise UsageError(f"model flags: {e}") from None


def _schedule(args):
    return WarmupCosine(args.lr, args.warmup if args.warmup is not None else args.steps // 20,
                        args.steps, args.min_lr if args.min_lr is not None else args.lr / 10)


def _resume(args, strategy, log, model, opt):
    state = strategy.load(args.resume, model, opt)
    model.dropout_rng.bit_generator.state = state["rng"]["dropout"]
    saved = state.get("extra", {})
    changed = [k for k in _MUST_MATCH if k in saved and saved[k] != getattr(args, k)]
    log.print0(f"resumed from {args.resume} at step {state['step']}" + (
        f" (note: {', '.join(changed)} changed, so the run will differ from an uninterrupted"
        " one)" if changed else ""))
    return state["step"]


_MUST_MATCH = ("seed", "steps", "lr", "min_lr", "warmup", "batch_size", "grad_accum",
               "weight_decay", "grad_clip", "data")


def train(args, world=None):
    """Run the training described by the parsed flags; returns the final summary dict.
    `world`: comm.init's world group (None: one process). The caller has set up the
    backend (backend.setup: threads, device), as examples/train_gpt.py shows."""
    args.resume = checkpoint_dirs.resume_dir(args.resume, args.save)   # "auto": None or newest
    strategy = make_strategy(args, world)
    log = Logger(strategy.rank, args.log_json)
    if strategy.rank == 0 and args.log_json and not args.resume:
        open(args.log_json, "w").close()         # a new run starts a new log; --resume appends
    threads, device = backend.blas_threads(), backend.device()
    data = TokenData(args.data, args.cache_dir)
    model = strategy.build_model(_config(args, data), args.seed, args.dtype)
    opt = strategy.build_optimizer(model, args)
    schedule = _schedule(args)
    start = _resume(args, strategy, log, model, opt) if args.resume else 0
    log.print0(f"data: {data.source} ({data.meta['train_tokens']:,} train / "
               f"{data.meta['val_tokens']:,} val tokens, cache {data.cache})")
    log.print0(f"model: {model.num_parameters():,} parameters, {model.config}, {args.dtype} "
               f"on {device}, {threads} BLAS thread(s), {strategy.world_size} process(es); "
               f"unigram entropy of the data {data.unigram_entropy:.4f} nats/token")
    for line in strategy.notes():                 # --amp, --ckpt-activations
        log.print0(line)
    tokens_per_step = args.batch_size * args.block_size
    val_loss, t_start = None, time.perf_counter()
    stop = min(args.steps, args.stop_at) if args.stop_at else args.steps
    preempted = preemption.Flag() if args.save else None    # SIGTERM / SIGUSR1: save, exit
    for step in range(start, stop):
        t0 = time.perf_counter()
        lr = schedule(step)
        opt.set_lr(lr)
        x, y = data.get_batch(args.seed, "train", step, args.batch_size, args.block_size)
        loss, norm, mem = train_step(strategy, model, opt, x, y, args)
        backend.synchronize()
        loss, norm = float(loss), float(norm)    # device -> host only here, to log them
        dt = time.perf_counter() - t0
        log.json0({"step": step, "loss": loss, "lr": lr, "tokens_per_s": tokens_per_step / dt,
                   "ms_per_step": dt * 1e3, "grad_norm": norm, "mem": mem,
                   "comm_bytes": strategy.comm_bytes()})
        last = step == stop - 1
        if step % args.log_every == 0 or last:
            log.print0(f"step {step:5d} | loss {loss:.4f} | lr {lr:.2e} | "
                       f"{tokens_per_step / dt:8.0f} tok/s | {dt * 1e3:7.1f} ms/step")
        if (args.eval_every and (step + 1) % args.eval_every == 0) or last:
            log.print0(f"step {step:5d} | evaluating on {args.eval_iters} val batches ...")
            val_loss = evaluate(model, data, args.seed, args.batch_size, args.block_size,
                                args.eval_iters)
            # every rank computed the same number; averaging it also lines the ranks up, so
            # the next step's time does not include another rank's evaluation
            val_loss = float(strategy.global_mean(val_loss))
            log.print0(f"step {step:5d} | val loss {val_loss:.4f} (unigram entropy "
                       f"{data.unigram_entropy:.4f})")
        every = args.save_every or args.eval_every
        stopping = preempted is not None and strategy.any_rank(preempted.is_set())
        if args.save and (last or stopping or (every and (step + 1) % every == 0)):
            strategy.save(args.save, model, opt, step + 1, _rng_states(model), vars(args))
            if strategy.rank == 0:      # every rank has written: older folders can go
                checkpoint_dirs.prune(args.save, args.keep)
        if stopping:
            log.print0(f"preempted ({preempted.name}) after step {step}: saved to {args.save};"
                       f" run the same command with --resume {args.save} (or --resume auto)"
                       f" to continue")
            raise SystemExit(preemption.EXIT_STATUS)
    return _finish(args, strategy, log, model, data, val_loss, time.perf_counter() - t_start)


def _finish(args, strategy, log, model, data, val_loss, seconds):
    if val_loss is None:              # nothing trained (resumed at the end): measure anyway
        val_loss = evaluate(model, data, args.seed, args.batch_size, args.block_size,
                            args.eval_iters)
    text = ""
    if args.sample and strategy.takes_part_in_sampling():     # tp: every rank of a replica
        text = sample_text(model, data, args.sample, args.seed)
        log.print0("---- sample ----\n" + printable(text) + "\n----------------")
    summary = {"final": True, "val_loss": val_loss, "unigram_entropy": data.unigram_entropy,
               "steps": args.steps, "train_seconds": seconds, "sample": text}
    log.print0(f"final val loss {val_loss:.4f} nats/token vs unigram entropy "
               f"{data.unigram_entropy:.4f} (a model that ignores context); "
               f"{seconds:.1f} s of training")
    strategy.finish(args, log)         # e.g. DDP's communication summary, the --trace file
    log.json0(summary)
    return summary
