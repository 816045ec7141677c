"""Flags that would do nothing in a run, refused rather than ignored: one `error:` line
naming the flag, what it sets and what would use it (--schedule without --pp, --cp-split
without --cp, --bucket-mb under ZeRO, a training flag under --eval-only, ...). `idle_flags`
lists them for a run's flags; `check_idle_flags` raises cli.UsageError for the first one
changed from its default. cli.check_flags calls it on each rank alone, and
train/strategy.py's check_layout again once the world size says how many replicas and
ranks there are.
Tests: tests/test_cli.py, tests/test_cli_ranks.py (check_layout),
tests/test_eval_only.py.
"""
from minidist.train.args import train_default
from minidist.train.cli import UsageError


def idle_flags(args, replicas=None, ranks=None):
    """(flag, what it sets, what would use it) for each flag that does nothing in this run
    (the --moe-* flags are check_moe's). `replicas`: the ranks DDP would average over (dp x
    ep x cp), `ranks`: the processes, both known once the world size is (check_layout); None
    before."""
    from minidist.nn.config import TILED_FROM_T, uses_tiled    # (numpy: after BLAS setup)
    idle = []
    if getattr(args, "eval_only", False):     # no step, no backward: first, so they say it
        drop = "drop --eval-only to train"
        idle += [(f"--{name.replace('_', '-')}", what, drop) for name, what in (
            ("steps", "the steps to train"), ("stop_at", "the step to stop training at"),
            ("lr", "the learning rate"), ("lr_schedule", "the learning rate's schedule"),
            ("decay_steps", "the learning rate's decay"),
            ("min_lr", "the learning rate's floor"), ("warmup", "the warmup steps"),
            ("weight_decay", "the weight decay"), ("grad_clip", "the gradients' clip"),
            ("muon_momentum", "Muon's momentum"),
            ("muon_ns_steps", "Muon's Newton-Schulz iterations"),
            ("moe_bias_rate", "how fast the MoE routers' biases move"),
            ("eval_every", "the steps between evaluations"),
            ("log_every", "the steps between log lines"),
            ("ckpt_activations", "what backward recomputes"),
            ("grad_dtype", "the dtype gradients accumulate in"),
            ("ddp", "how DDP averages gradients"), ("bucket_mb", "DDP's bucket size"),
            ("schedule", "the pipeline's training schedule"),
            ("overlap_param_gather", "when ZeRO waits for the updated parameters"),
            ("save", "where to save"), ("save_every", "steps between checkpoints"),
            ("async_save", "whether checkpoints are written on a thread while training "
             "goes on"),
            ("trace", "the file the training's collectives are traced to"),
            ("keep", "the checkpoints kept"), ("overwrite", "whether --save may replace"),
            ("keep_best", "whether the best val loss's checkpoint is kept"))]
        if args.attention == "recompute":
            idle.append(("--attention", "what the attention's backward recomputes", drop))
        if "dropout" in getattr(args, "given", []):   # (a checkpoint's, taken, is no flag)
            idle.append(("--dropout", "the training's dropout (an evaluation drops nothing)",
                         drop))
    if ranks == 1 and not args.zero:          # one process, no group: nothing is sent
        alone = "one process sends nothing: run more ranks (mpirun -n N)"
        idle += [("--trace", "the file the collectives' trace is written to", alone),
                 ("--comm", "the collectives' algorithm", alone),
                 ("--sync-comm", "where the collectives run", alone),
                 ("--comm-timeout", "how long a collective may wait", alone)]
    if args.pp == 1:
        idle += [("--schedule", "the pipeline schedule", "add --pp 2 or more"),
                 ("--pp-virtual", "layer chunks per pipeline rank", "add --pp 2 or more")]
    if args.cp == 1:
        idle += [("--cp-split", "how context parallelism splits the sequence",
                  "add --cp 2 or more"),
                 ("--cp-attention", "how context parallelism computes attention",
                  "add --cp 2 or more")]
        if not uses_tiled(args.attention, args.block_size):     # auto: tiled from T 256
            idle.append(("--attention-block", "the tiled attention's tile size",
                         "use --attention tiled" + (f", or auto with --block-size "
                                                    f"{TILED_FROM_T} or more"
                                                    if args.attention == "auto" else
                                                    " or auto")))
    if args.lr_schedule != "wsd":
        idle.append(("--decay-steps", "the steps of warmup-stable-decay's final decay",
                     "add --lr-schedule wsd"))
    if args.optimizer != "muon" and not getattr(args, "eval_only", False):
        muon = (f"--resume {args.resume} was trained with {args.optimizer}, which a resumed "
                "run keeps" if getattr(args, "resume", None) else "add --optimizer muon")
        idle += [("--muon-momentum", "Muon's momentum", muon),
                 ("--muon-ns-steps", "Muon's Newton-Schulz iterations", muon)]
    if not args.save:
        idle += [("--save-every", "steps between checkpoints", "add --save DIR"),
                 ("--keep", "the checkpoints kept under --save", "add --save DIR"),
                 ("--async-save", "whether checkpoints are written on a thread while "
                  "training goes on", "add --save DIR"),
                 ("--keep-best", "whether the best val loss's checkpoint is kept under "
                  "--save", "add --save DIR")]
    if not args.save and not args.log_json:
        idle.append(("--overwrite", "whether --save may replace another run's checkpoints "
                     "(and --log-json another run's log)", "add --save DIR"))
    if not args.zero:
        idle.append(("--zero-shard", "the ranks ZeRO shards each replica over",
                     "add --zero 1, 2 or 3"))
    if args.zero not in (1, 2):
        idle.append(("--overlap-param-gather", "when ZeRO-1 and -2 wait for the updated "
                     "parameters' all-gathers (ZeRO-3 gathers before each block anyway)",
                     "use --zero 1 or 2"))
    if args.zero:
        idle += [("--ddp", "how DDP averages gradients (ZeRO does under --zero)",
                  "drop --zero"),
                 ("--bucket-mb", "DDP's bucket size (ZeRO does not bucket)", "drop --zero")]
    elif replicas == 1:
        more = "this layout has one replica: run more ranks for dp, cp or ep"
        idle += [("--ddp", "how DDP averages gradients over replicas", more),
                 ("--bucket-mb", "DDP's bucket size", more)]
    elif args.ddp == "naive":
        idle.append(("--bucket-mb", "DDP's bucket size (--ddp naive all-reduces each "
                     "parameter's gradient on its own)", "use --ddp bucketed or overlapped"))
    return idle


def check_idle_flags(args, replicas=None, ranks=None):
    """A flag changed from its default where it would do nothing is refused, not ignored
    (`replicas`, `ranks`: as idle_flags)."""
    for flag, what, remedy in idle_flags(args, replicas, ranks):
        name = flag[2:].replace("-", "_")
        value = getattr(args, name)
        if value != train_default(name):
            given = flag if isinstance(value, bool) else f"{flag} {value}"    # --overwrite
            raise UsageError(f"{given}: sets {what}, which this run does not use ({remedy}, "
                             f"or leave {flag} out)")
