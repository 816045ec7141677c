"""What a run starts from, besides the seed: its data (`--data`: text, or a folder of token
files), or the checkpoint it resumes (`--resume`: its model, tokenizer, data and run
settings). Checked before any work, on each rank alone (`check_data_path`,
`take_resume_model`, called by cli.check_flags); --init-from's weights:
minidist/train/init_from.py; --data opened after the strategy is made:
minidist/train/data_open.py.

    text            minidist/train/data.py: bytes, or --tokenizer's (else --init-from's) BPE,
                    tokenized once, cached
    token files     minidist/train/token_files.py: nanoGPT's and llm.c's, read in place

A checkpoint records --data and --init-from as absolute paths (`recorded_flags`), so
examples/sample.py finds their tokenizer from any folder.
Tests: tests/test_token_files.py, tests/test_init_from_gpt2.py.
"""
import os

from minidist.nn.config import ARCH_DEFAULTS, ffn_size
from minidist.strategy.checkpoint import CheckpointError, saved_model
from minidist.strategy.checkpoint_dirs import resume_dir
from minidist.train.bpe import BPETokenizer, TokenizerError, same_tokenizer, tokenizer_files
from minidist.train.cli import UsageError
from minidist.train.token_files import token_file_names

PATHS = ("data", "init_from", "cache_dir", "tokenizer")   # recorded as absolute paths


def check_data_path(args):
    """--data is text or a folder of token files: a token file itself (the likely slip from
    nanoGPT: --data owt/train.bin), or a folder of .bin files none of which is named as a
    token file, would be read as text, bytes of binary; token files are not cached, so
    --cache-dir with them does nothing."""
    tokenizer = getattr(args, "tokenizer", None)
    if tokenizer is not None and not tokenizer_files(tokenizer):
        what = "no such folder" if not os.path.exists(tokenizer) else \
            "is a file; give its folder" if not os.path.isdir(tokenizer) else \
            "holds no vocab.json and merges.txt"
        raise UsageError(f"--tokenizer {tokenizer}: {what} (a BPE tokenizer folder: a GPT-2 "
                         "download, or what examples/train_tokenizer.py writes)")
    data = args.data
    if data is None:
        return
    if os.path.isfile(data) and data.endswith(".bin"):
        folder = os.path.dirname(data) or "."
        raise UsageError(f"--data {data}: a .bin file is read as a set of token files with "
                         f"its split: give their folder, --data {folder} (text is given as "
                         "any other file)")
    names = token_file_names(data)
    if os.path.isdir(data) and not names:
        files = [n for n in os.listdir(data) if not n.startswith(".")
                 and os.path.isfile(os.path.join(data, n))]
        if files and all(n.endswith(".bin") for n in files):
            raise UsageError(f"--data {data}: holds .bin files, none named as token files "
                             "(train.bin and val.bin, or <name>_train_<N>.bin and "
                             "<name>_val_<N>.bin): rename them so")
    if names and args.cache_dir is not None:
        raise UsageError(f"--cache-dir {args.cache_dir}: --data {data} holds token files, "
                         "read where they are (nothing is cached); leave --cache-dir out")
    if os.path.isdir(data) and not names:
        _check_outputs_outside(args, data)


def _check_outputs_outside(args, data):
    """A file this run writes (--log-json, --trace, --cache-dir's meta.json) inside the text
    folder --data would be read as text by the next run on it (first-use walk 36: a resume
    trained on its own log, then said the data had changed); a hidden folder is not read."""
    root = os.path.realpath(data)
    for flag in ("log_json", "trace", "cache_dir"):
        path = getattr(args, flag, None)
        if not path:
            continue
        inside = os.path.relpath(os.path.realpath(path), root)     # ".": the folder itself
        below = inside != os.pardir and not inside.startswith(os.pardir + os.sep)
        hidden = any(part.startswith(".") for part in inside.split(os.sep))
        if inside == os.curdir or (below and not hidden):
            name = "--" + flag.replace("_", "-")
            raise UsageError(f"{name} {path}: inside --data {data}, whose files are the text "
                             "trained on: the next run would train on what this one writes "
                             f"there; give {name} a path outside it")


# the flags that pick the val batches (loop.VAL_SEED draws them, whatever --seed), which
# --eval-only of a checkpoint takes from its run (unless given), so that it reports the val
# loss that run ended with
EVALUATED_AS = ("batch_size", "eval_iters")

# the run's hyperparameters, which a resume takes from its checkpoint's run unless given
# (so `--resume ck --steps N` continues that run, not one at this parser's defaults); one
# given with another value is the run's, and the "resumed from" line notes the change
RUN_RESUMED = ("seed", "batch_size", "grad_accum", "lr", "min_lr", "warmup", "lr_schedule",
               "decay_steps", "weight_decay", "beta1", "beta2", "grad_clip", "moe_bias_rate",
               "grad_dtype",
               "eval_every", "eval_iters",   # (walk 33: the val curve changed basis there)
               "steps")     # (walk 35: `--resume ck` alone trained to the parser's 800)

# how the run saves and logs, which a resume takes from its run too unless given (first-use
# walk 41: `--resume ck --steps N` fell back to --keep 1 and removed the checkpoints the run
# had kept with --keep 100, without a word); the first three only when it saves (--save):
# without, a run saved with --keep 3 resumed was refused for a --keep 3 nobody typed
RUN_SAVING = ("keep", "keep_best", "save_every", "log_every", "peak_tflops")
SAVES_ONLY = ("keep", "keep_best", "save_every")

# the flags of the model a checkpoint holds (GPTConfig's fields), taken from it on --resume
RESUMED = ("n_layer", "n_head", "n_embd", "block_size", "bias", "moe_experts", "moe_top_k",
           "moe_capacity_factor", "moe_aux_loss_coef", "moe_z_loss_coef", "moe_every",
           "moe_shared", "dropout") + tuple(ARCH_DEFAULTS)
# ... of which these hold no parameter (a rate, a loss weight, a capacity): a resumed run may
# change them (checkpoint.HOW_COMPUTED lets them differ)
MAY_CHANGE = ("dropout", "moe_capacity_factor", "moe_aux_loss_coef", "moe_z_loss_coef")


def take_model_fields(args, model, names, keep=()):
    """Set each model field of `names` on `args` to `model`'s (a GPTConfig's fields as a dict:
    an --init-from folder's or a --resume checkpoint's), so that every later check sees the
    sizes its weights have; `keep`: fields no parameter depends on, which keep a value given.
    Returns the first other field given (args.given) with another size than the model's, as
    (name, the value given), for the caller to refuse in its own words; None when none is.
    (Sizes are compared as resolved_size reads them: typing the size the model holds is fine.)"""
    given = getattr(args, "given", [])
    for name in names:
        value, theirs = getattr(args, name), model[name]
        if name in given and name not in keep \
                and resolved_size(name, value, model) != resolved_size(name, theirs, model):
            return name, value
        if name not in given or name not in keep:
            setattr(args, name, theirs)
    return None


def flag_of(name):
    """The flag that sets model field `name` away from its default (bias: --no-bias)."""
    return "--no-bias" if name == "bias" else "--" + name.replace("_", "-")


# the pipeline's schedule flags: no number depends on them (tests/test_pipeline.py: every
# schedule gives the same losses), but memory and speed do
SCHEDULE_FLAGS = ("schedule", "pp_virtual", "micro_batches")


def schedule_differences(args, flags):
    """The schedule flags (SCHEDULE_FLAGS) the checkpoint's run (`flags`) gave another value
    than this run has, as "--schedule gpipe", where both run the same pipeline (the same --pp
    above 1): a resumed run names them rather than taking them, since a value taken could
    be one this run's other flags refuse (--schedule zb-h1 beside --ckpt-activations, a
    --micro-batches that no longer divides the batch at another world size)."""
    if args.pp == 1 or flags.get("pp") != args.pp:
        return []
    return [f"--{k.replace('_', '-')} {flags[k]}" for k in SCHEDULE_FLAGS
            if flags.get(k) is not None and flags[k] != getattr(args, k)]


def resolved_size(name, value, model):
    """A model field's `value` as the size it means in `model` (a GPTConfig's fields, as a
    dict): --n-kv-head 0 is --n-head's heads, --ffn-hidden 0 the block's default width; any
    other as it is. So typing the size a checkpoint or folder holds is not refused."""
    if name == "n_kv_head":
        return value or model["n_head"]
    if name == "ffn_hidden":
        return ffn_size(model["n_embd"], model.get("arch", "gpt2"), value)
    return value


def _take_resume_data(args, folder, recorded):
    """--data on --resume: the checkpoint's run's (`recorded`, an absolute path) unless given,
    so the command without it continues on the same text (it trained on Python's sources
    instead, silently); a recorded path that is gone is one error line."""
    if args.data is not None or not recorded:
        return
    if not os.path.exists(recorded):
        raise UsageError(f"--resume {folder} was trained on --data {recorded}, which is not "
                         "there now; give --data with the same text or token files")
    args.data = recorded


def run_tokenizer(flags):
    """(the folder of the BPE the checkpoint's run (its `flags`) tokenized its text in, the
    flag that named it): its --tokenizer, else its --init-from folder where that holds one
    (a fine-tune's: first-use walk 33 found `--resume` of one re-reading the text as bytes,
    refused as a "config mismatch"); (None, None): bytes, or token files without one."""
    if flags.get("tokenizer"):
        return flags["tokenizer"], "--tokenizer"
    init, key = flags.get("init_from"), flags.get("tokenizer_key") or ""
    if init and (tokenizer_files(init) or key.startswith("gpt2-bpe-")):   # (a BPE's key: its
        return init, "--init-from"          # folder gone is named; a meta.pkl's chars are not
    return None, None                       # a --tokenizer, and travel with the token files)


def _take_resume_tokenizer(args, folder, flags, vocab_size):
    """--tokenizer on --resume: the checkpoint's run's (run_tokenizer: its --tokenizer, or
    its --init-from folder's) unless given; one given with other files (another vocabulary
    or other merges: the ids would mean other strings), or a recorded folder that no longer
    holds them, is one error line; so is one given to a checkpoint trained without one
    (bytes, or token files) whose vocabulary is of another size (its `vocab_size`): the load
    would say the model does not fit, naming the data. One of the same size is taken
    (GPT-2's files on a run of GPT-2 token ids)."""
    given = getattr(args, "tokenizer", None)
    recorded, flag = run_tokenizer(flags)
    if not recorded:
        if given is not None and tokenizer_files(given):
            try:
                size = BPETokenizer.from_folder(given).vocab_size
            except TokenizerError:
                return                                   # check_data_path names the file
            if size != vocab_size:
                raise UsageError(
                    f"--tokenizer {given}: --resume {folder} was trained without one, on a "
                    f"vocabulary of {vocab_size:,} tokens, and its {size:,} ids would not "
                    "fit the model; leave --tokenizer out, or start a new run with it")
        return
    if given is None:
        if not tokenizer_files(recorded):
            raise UsageError(f"--resume {folder} was trained in the tokenizer of {flag} "
                             f"{recorded}, which holds no vocab.json and merges.txt now; "
                             "give --tokenizer DIR with the same two files")
        args.tokenizer = recorded
    elif tokenizer_files(given) and tokenizer_files(recorded):
        if same_tokenizer(given, recorded) is False:     # (None: check_data_path names it)
            raise UsageError(f"--tokenizer {given}: --resume {folder} was trained with "
                             f"the tokenizer of {flag} {recorded}, whose vocabulary or "
                             "merges differ (its ids would mean other strings); leave "
                             "--tokenizer out")


def take_resume_model(args):
    """--resume: the model is the checkpoint's, so a resumed run needs no model flag. Each
    of RESUMED not given (args.given) becomes the checkpoint's (a dense model's record has no
    moe_* fields: 0 experts), and so do --dtype and --amp (a 16-bit record is an --amp run:
    --amp and --amp-dtype follow it), --tokenizer (where its folder is still there) and
    --data (the text or token files it trained on), its optimizer, and the run's
    hyperparameters not given (RUN_RESUMED: --lr, --batch-size, ...; one given is the run's);
    its pipeline schedule is this run's flags' (the log names the checkpoint's where it
    differs: schedule_differences).
    A model flag given with another value is refused here, before any work, naming it; but
    MAY_CHANGE (--dropout, the MoE loss weights and capacity), which no parameter depends on,
    may change (fine-tuning). A checkpoint that
    cannot be read is left to the load, whose verification names what is wrong; so is an
    --amp or --init-from that does not fit it."""
    if getattr(args, "resume", None) is None:
        return
    try:
        folder = resume_dir(args.resume, args.save)
        if folder is None:                              # --resume auto, nothing saved yet
            return
        folder, config, dtype, flags = saved_model(folder)
    except CheckpointError:
        return
    _take_resume_tokenizer(args, folder, flags, config.get("vocab_size"))
    _take_resume_data(args, folder, flags.get("data"))
    if getattr(args, "eval_only", False):        # its run's val batches: its final val loss
        for name in EVALUATED_AS:
            if name not in getattr(args, "given", []) and flags.get(name) is not None:
                setattr(args, name, flags[name])
    given = getattr(args, "given", [])
    config.setdefault("moe_experts", 0)
    config = {**ARCH_DEFAULTS, **config}      # a GPT-2's checkpoint leaves these out
    dense = not config["moe_experts"]         # a dense model: its other moe_* left alone
    names = [n for n in RESUMED if n in config
             and not (dense and n.startswith("moe_") and n != "moe_experts")]
    clash = take_model_fields(args, config, names, keep=MAY_CHANGE)
    if clash:
        name, value = clash
        said = (f"--no-bias: --resume {folder} holds a model with biases" if name == "bias"
                else f"{flag_of(name)} {value}: --resume {folder} holds a model with {name} "
                f"{resolved_size(name, config[name], config)}")
        why = "a resumed run takes its model from the checkpoint"
        if name == "block_size" and getattr(args, "eval_only", False):   # another context:
            reads = value <= config[name] or config["arch"] == "llama"    # --init-from's, but
            why = (f"--eval-only --resume evaluates the model its run trained; --init-from "
                   f"{folder} --eval-only {flag_of(name)} {value} evaluates its weights at "
                   "another context") if reads else (       # past GPT-2's learned positions
                f"its {config[name]} learned positions are as far as it reads; --init-from "
                f"{folder} --eval-only --block-size N, N < {config[name]}, evaluates its "
                "weights at a shorter context")
        raise UsageError(f"{said}; leave {flag_of(name)} out ({why})")
    if dtype in ("float32", "float64"):
        if "dtype" in given and args.dtype != dtype:
            raise UsageError(f"--dtype {args.dtype}: --resume {folder} was trained in {dtype}; "
                             "leave --dtype out")
        if args.amp:             # its state is a float32 optimizer's, not --amp's masters'
            raise UsageError(f"--amp: --resume {folder} was trained in {dtype}, without "
                             "--amp; leave --amp out (a resumed run takes its precision from "
                             "the checkpoint)")
        args.dtype = dtype
    elif dtype in ("float16", "bfloat16"):                     # an --amp run's 16-bit model
        if args.amp_dtype and args.amp_dtype != dtype:
            raise UsageError(f"--amp-dtype {args.amp_dtype}: --resume {folder} was trained "
                             f"with --amp in {dtype}; leave --amp-dtype out")
        args.amp, args.amp_dtype = True, dtype
    _take_resume_optimizer(args, folder, flags)


def _take_resume_optimizer(args, folder, flags):
    """--optimizer is the checkpoint's: its state is that optimizer's (Muon's momentum is not
    AdamW's m and v); another one given is refused. --muon-momentum, --muon-ns-steps and the
    run's hyperparameters (RUN_RESUMED) and how it saves and logs (RUN_SAVING) are the
    checkpoint's unless given (they hold no state: a run may change them)."""
    theirs, given = flags.get("optimizer") or "adamw", getattr(args, "given", [])
    if "optimizer" in given and args.optimizer != theirs:      # (before the flag: AdamW)
        raise UsageError(f"--optimizer {args.optimizer}: --resume {folder} was trained with "
                         f"{theirs}, whose state it holds; leave --optimizer out (a resumed "
                         "run takes its optimizer from the checkpoint), or start a new run "
                         f"from its weights: --init-from {folder} --optimizer "
                         f"{args.optimizer} (step 0, a fresh optimizer; --save a new folder)")
    args.optimizer = theirs
    if getattr(args, "eval_only", False):          # nothing steps: they stay unset
        return
    for name in ("muon_momentum", "muon_ns_steps") + RUN_RESUMED + RUN_SAVING:
        if name in SAVES_ONLY and not args.save:
            continue
        if name not in given and flags.get(name) is not None:
            setattr(args, name, flags[name])


def recorded_flags(flags):
    """The run's flags as a checkpoint records them (state.json's "extra"), its folders made
    absolute: sample.py, run from anywhere, finds the tokenizer through them."""
    return {k: os.path.abspath(v) if k in PATHS and v else v for k, v in flags.items()}
