"""--init-from DIR: a new run that starts from trained weights instead of the seed's draws,
with a fresh optimizer and learning-rate schedule from step 0 (fine-tuning). DIR is

    a GPT-2 or Llama folder   config.json + model.safetensors, as Hugging Face writes them
                              (minidist/nn/pretrained.py; examples/export_gpt2.py writes one
                              of any checkpoint): memory-mapped, each rank reads what it holds;
                              its tokenizer is the folder's vocab.json and merges.txt
    a minidist checkpoint     a --save directory (its newest) or one checkpoint folder, of any
                              layout, every file verified first, then each parameter read as
                              the build asks for it (minidist/train/gather.py
                              CheckpointWeights): a rank reads what it holds (ZeRO-3 its units
                              in turn, never the whole model: tests/test_zero_build.py). Its
                              parameters, the float32 masters under --amp; its run's dtype,
                              --moe-bias-rate and --data unless given; its optimizer state,
                              step and schedule are left (--resume continues those); an MoE's
                              router biases come with it (initial_router_bias). Its tokenizer
                              is its run's (model_tokenizer.own_tokenizer), taken as this
                              run's --tokenizer. --save must be another folder. First-use
                              walk 33 was sent from here to --resume, which continued the old
                              run's schedule instead

    take_init_from_sizes  cli.check_flags, on each rank before any work: the model flags
                          become the saved model's (one given with another size refused),
                          --block-size at most its positions, a --tokenizer not its own refused
    initial_weights       loop.train, once the data is open: the data must be in the model's
                          vocabulary; the weights, for gpt_init in every layout
                          (minidist/nn/config.py), and the log's "init:" line
    initial_router_bias   loop.train: a checkpoint's MoE router biases (--moe-bias-rate), so
                          its experts are picked as they were
With --resume the checkpoint's weights are loaded instead, so the same command (plus
--resume auto) continues a fine-tuning run.
Tests: tests/test_init_from_gpt2.py (folders), tests/test_init_from.py (a checkpoint, its
tokenizer), tests/test_eval_only.py (across layouts), tests/test_moe_bias.py (its biases).
"""
import json
import os
from dataclasses import asdict

from minidist.nn.config import ARCH_DEFAULTS, gpt_param_specs
from minidist.nn.pretrained import is_gpt2_folder, pretrained_weights, read_config
from minidist.strategy import checkpoint_dirs
from minidist.strategy.checkpoint import CheckpointError, saved_model
from minidist.train.bpe import BPETokenizer, TokenizerError, same_tokenizer, tokenizer_files
from minidist.train.cli import UsageError
from minidist.train.data import ByteTokenizer
from minidist.train.gather import CheckpointWeights, model_config, router_bias, run_flags
from minidist.train.inputs import (MAY_CHANGE, RESUMED, flag_of, resolved_size,
                                   run_tokenizer, take_model_fields)
from minidist.train.model_tokenizer import not_its_tokenizer, own_tokenizer

FOLDER = "a GPT-2 or Llama folder (config.json, model.safetensors, as Hugging Face writes them)"
# held by no parameter, and a new run may set them where a resume keeps its run's: RoPE's
# base (a long-context fine-tune raises it: Code Llama's 1e4 -> 1e6; first-use walk 38 was
# refused it, "its model has rope_theta") and RMSNorm's epsilon
NEW_RUN_MAY_CHANGE = ("rope_theta", "norm_eps")


def is_checkpoint(folder):
    """Whether `folder` is a minidist checkpoint or a --save directory of them."""
    names = set(os.listdir(folder))
    return bool(names & {"manifest.json", "latest"}) or any(n.startswith("step-")
                                                           for n in names)


def saved_config(folder):
    """The GPTConfig of the model --init-from names (a folder's config.json, a checkpoint's
    record); UsageError naming what cannot be read."""
    try:
        return model_config(folder) if is_checkpoint(folder) else read_config(folder)
    except json.JSONDecodeError as e:
        raise UsageError(f"--init-from {folder}: its config.json is not JSON ({e})") from None
    except CheckpointError as e:
        raise UsageError(f"--init-from {folder}: {str(e).removeprefix('--resume ')}") from None
    except (ValueError, KeyError, OSError) as e:
        why = str(e).removeprefix("from_pretrained: ")
        raise UsageError(f"--init-from {folder}: {why}") from None


def take_init_from_sizes(args):
    """--init-from DIR (module docstring): the model's sizes become DIR's (--n-layer,
    --n-head, --n-embd, biases, --arch, --n-kv-head, --rope-theta, --ffn-hidden; a
    checkpoint's --moe-* too) and --block-size at most its positions, so every later check
    sees them; one of these given (args.given: minidist/train/given.py) with another value, or
    --moe-experts for a folder (a dense model), is refused. Reads config.json or the
    checkpoint's record only. A checkpoint's tokenizer becomes --tokenizer unless given."""
    folder = getattr(args, "init_from", None)
    if folder is None:
        return
    if checkpoint_dirs.is_pointer(folder):       # DIR/best, DIR/latest: the folder it names
        try:
            folder = args.init_from = checkpoint_dirs.resolve(folder, "--init-from")
        except CheckpointError as e:
            raise UsageError(str(e)) from None
    _check_init_folder(folder)
    checkpoint = is_checkpoint(folder)
    saved = saved_config(folder)
    given, model = getattr(args, "given", []), asdict(saved)
    names = ("n_layer", "n_head", "n_embd", "bias") + tuple(ARCH_DEFAULTS)
    if checkpoint and saved.moe_experts:      # its experts' sizes and routing, as --resume's
        names += tuple(n for n in RESUMED if n.startswith("moe_"))
    clash = take_model_fields(args, model, names, keep=MAY_CHANGE + NEW_RUN_MAY_CHANGE)
    if clash:
        name, value = clash
        said = ("--no-bias: its model has biases" if name == "bias" else
                f"{flag_of(name)} {value}: its model has {name} "
                f"{resolved_size(name, model[name], model)}")    # (0: the size it means)
        raise UsageError(f"{said} (--init-from {folder}); leave {flag_of(name)} out, the "
                         "saved model's sizes are used")
    if "block_size" not in given and (args.block_size > saved.block_size or
                                      getattr(args, "eval_only", False)):
        args.block_size = saved.block_size     # the default past its positions; --eval-only
                                               # at the model's own context (walk 38: 128)
    elif args.block_size > saved.block_size and not saved.llama:  # (RoPE: any length asked)
        raise UsageError(f"--block-size {args.block_size}: --init-from {folder} has "
                         f"{saved.block_size} positions; give at most {saved.block_size}")
    if args.moe_experts and not saved.moe_experts:
        raise UsageError(f"--moe-experts {args.moe_experts}: --init-from {folder} holds a "
                         "dense model (no experts); leave the --moe-* flags out")
    if checkpoint:
        _check_save_elsewhere(args, folder)
        _take_checkpoint_run(args, folder)
        _take_checkpoint_tokenizer(args, folder)
    else:
        _check_init_tokenizer(args, folder)


def _check_save_elsewhere(args, folder):
    """--save is not the checkpoint --init-from reads (or a folder holding it): its
    check_save advice (--resume auto continues the old run, --overwrite prunes the model
    this run starts from) would undo the fine-tune (first-use walk 36)."""
    if not args.save:
        return
    save, init = os.path.realpath(args.save), os.path.realpath(folder)
    if init == save or init.startswith(save + os.sep):
        raise UsageError(f"--save {args.save}: holds the checkpoint --init-from {folder} "
                         "starts this run from; save the new run elsewhere (--save "
                         f"{args.save.rstrip(os.sep)}-ft)")


def _take_checkpoint_run(args, folder):
    """From the checkpoint's run, unless given: its dtype (a float64 run goes on in float64;
    an --amp run's 16-bit record is float32, its masters'), its --moe-bias-rate (its loaded
    router biases keep moving as they did: walk 36 found them frozen at 0) and its --data
    where still there (without, --eval-only evaluated Python's sources in its tokens)."""
    try:
        _, _, dtype, flags = saved_model(folder)
    except CheckpointError:
        return                                 # saved_config named what cannot be read
    given = getattr(args, "given", [])
    if dtype in ("float32", "float64") and "dtype" not in given and not args.amp:
        args.dtype = dtype                     # (--amp: float32 masters, 16-bit compute)
    if args.moe_experts and "moe_bias_rate" not in given and flags.get("moe_bias_rate") \
            and not getattr(args, "eval_only", False):           # (nothing moves under it)
        args.moe_bias_rate = flags["moe_bias_rate"]
    if args.data is None and flags.get("data") and os.path.exists(flags["data"]):
        args.data = flags["data"]


def _take_checkpoint_tokenizer(args, folder):
    """A checkpoint's tokenizer (its run's --tokenizer, or the BPE its run found) is this
    run's --tokenizer unless one is given; one given that is not it is refused."""
    given, flags = getattr(args, "tokenizer", None), run_flags(folder)
    if given is not None:
        if flags.get("tokenizer_key") == "bytes":
            raise UsageError(f"--tokenizer {given}: --init-from {folder} was trained without "
                             "one, in bytes (256 tokens); leave --tokenizer out")
        if tokenizer_files(given):
            try:
                why = not_its_tokenizer(folder, BPETokenizer.from_folder(given))
            except TokenizerError:
                return                         # check_data_path and the load name the file
            if why:
                raise UsageError(f"--tokenizer {given}: --init-from {folder}: {why}; its ids "
                                 "would mean other strings: leave --tokenizer out")
        return
    recorded, flag = run_tokenizer(flags)
    if recorded and not tokenizer_files(recorded):     # moved away (walk 36: "vocabulary")
        raise UsageError(f"--init-from {folder} was trained in the tokenizer of {flag} "
                         f"{recorded}, which holds no vocab.json and merges.txt now; give "
                         "--tokenizer DIR with the same two files")
    _, where = own_tokenizer(folder)
    if isinstance(where, str) and tokenizer_files(where):
        args.tokenizer = where


def _check_init_tokenizer(args, folder):
    """--tokenizer beside an --init-from folder that holds its model's own (vocab.json and
    merges.txt) must be that one: another of the same size fine-tuned the weights on text
    cut into other ids (first-use walk 33)."""
    given = getattr(args, "tokenizer", None)      # (also under --resume: `--resume auto`'s
    if given is None or not (tokenizer_files(given) and    # first launch is a new run)
                             tokenizer_files(folder)):
        return
    if same_tokenizer(given, folder) is False:     # (None: check_data_path names the file)
        raise UsageError(f"--tokenizer {given}: --init-from {folder} holds its model's own "
                         "tokenizer (vocab.json, merges.txt), whose vocabulary or merges "
                         "differ (its ids would mean other strings); leave --tokenizer out")


def _check_init_folder(folder):
    """--init-from names a GPT-2 or Llama folder or a minidist checkpoint, not a file or
    PyTorch files."""
    if not os.path.isdir(folder):
        what = "is a file; give the folder that holds it" if os.path.exists(folder) \
            else "no such folder"
        raise UsageError(f"--init-from {folder}: {what} ({FOLDER}, or a minidist checkpoint)")
    if is_gpt2_folder(folder) or is_checkpoint(folder):
        return
    names = set(os.listdir(folder))
    torch = sorted(n for n in names if n.endswith((".bin", ".pt", ".pth")))
    missing = [f for f in ("config.json", "model.safetensors") if f not in names]
    raise UsageError(f"--init-from {folder}: no {' or '.join(missing)} there; give {FOLDER}, "
                     "a sharded one's model.safetensors.index.json, or a minidist checkpoint"
                     + (f"; {', '.join(torch)} are PyTorch pickles, which minidist does not "
                        "read: re-save the model with safe_serialization=True" if torch else ""))


def initial_weights(args, config, data, log):
    """--init-from's parameters for gpt_init (read(name): a folder's memory-mapped, a
    checkpoint's CheckpointWeights, verified here and each parameter made as it is read, so
    every rank reads only what it holds: ZeRO-3 a unit at a time), or None: the seed's
    draws. None too when resuming: the checkpoint's weights are loaded over the model. The
    data must be in the saved model's vocabulary; the log says where the weights came from."""
    if args.init_from is None or args.resume:
        return None
    folder = args.init_from
    checkpoint = is_checkpoint(folder)
    saved = saved_config(folder)      # (its sizes were taken: take_init_from_sizes)
    if data.vocab_size != saved.vocab_size:
        raise UsageError(
            f"--init-from {folder}: its model reads a {saved.vocab_size:,}-token "
            f"vocabulary, --data {args.data or '(Python sources)'} is in "
            f"{data.vocab_size:,} tokens "
            f"({data.tokenizer.name if data.tokenizer else 'token files'}); " + (
                "give --data text (read as bytes, the vocabulary this model was trained in)"
                if saved.vocab_size == ByteTokenizer.vocab_size else
                "give --data token files of its tokenizer (train.bin and val.bin, as nanoGPT "
                "or llm.c write them), or text with its tokenizer (" + (
                    "--tokenizer" if checkpoint else
                    f"its vocab.json and merges.txt in {folder}") + ")"))
    if checkpoint:              # verified now; each parameter read as the build asks for it
        try:
            weights = CheckpointWeights(folder, positions=config.block_size)
        except CheckpointError as e:
            raise UsageError(f"--init-from {folder}: "
                             f"{str(e).removeprefix('--resume ')}") from None
        missing = [n for n in gpt_param_specs(config) if n not in weights.names]
        if missing:
            raise UsageError(f"--init-from {folder}: its checkpoint holds no "
                             f"{', '.join(missing[:4])} (of the model its record describes)")
        what = weights.what
    else:
        try:
            weights = pretrained_weights(folder, config)
        except ValueError as e:                 # a tensor missing or of another shape
            raise UsageError(f"--init-from {e}") from None
        what = None
    longer = saved.llama and config.block_size > saved.block_size
    log.print0(f"init: the weights of --init-from {folder}" + (f" ({what})" if what else "")
               + (f" (wpe's first {config.block_size} positions)"
                  if config.block_size < saved.block_size and not saved.llama else "")
               + (f" (a context of {config.block_size} of its {saved.block_size} positions: "
                  "--block-size sets it)" if config.block_size < saved.block_size and
                  saved.llama else "")
               + (f" (RoPE past the {saved.block_size} positions it was trained on"
                  + (f", theta {config.rope_theta:g} for its {saved.rope_theta:g}"
                     if config.rope_theta != saved.rope_theta else
                     ": --rope-theta raises its base") + ")" if longer else ""))
    return weights


def initial_router_bias(args):
    """The MoE routers' biases to start from ({block: [E floats]}, RouterBias.load_state_dict):
    an --init-from checkpoint's (its run's --moe-bias-rate learnt them; without them its
    experts would be picked otherwise); {} (all 0) for a folder, the seed or a resume (the
    checkpoint's are loaded with it)."""
    if args.init_from is None or args.resume or not is_checkpoint(args.init_from):
        return {}
    return router_bias(args.init_from)
