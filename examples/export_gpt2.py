"""Write a checkpoint of any strategy as a GPT-2 folder (Hugging Face's layout), in one process:
what `transformers.GPT2LMHeadModel.from_pretrained(dir)` loads, what sample.py --resume and
train_gpt.py --init-from take (a new run from trained weights: new data, a new schedule).
A Llama-style model (--arch llama) is written as a Llama folder instead, what
`LlamaForCausalLM.from_pretrained(dir)` loads (minidist/nn/pretrained_llama.py).

    python examples/train_gpt.py --steps 400 --save ckpt
    python examples/export_gpt2.py --resume ckpt --out exported
    python examples/train_gpt.py --init-from exported --data other.txt --lr 1e-3 --steps 200

The whole model is gathered from the checkpoint as sample.py gathers it (one process, DDP,
ZeRO-1/2/3, TP, PP, CP, TP x ZeRO: minidist/train/gather.py; under --amp the float32
masters), then written by minidist/nn/pretrained.py (config.json, model.safetensors). A model
in a BPE's tokens gets the tokenizer's vocab.json and merges.txt copied beside it, found as
sample.py finds it (--tokenizer DIR, else the folders the run named), so the folder is whole.
A Mixture of Experts is refused: GPT-2's and Llama's formats have no experts.
Tests: tests/test_init_from_gpt2.py (test_a_checkpoint_exports_as_a_gpt2_folder_that_starts_a_run).
"""
from minidist.launcher import set_thread_env

set_thread_env()            # BLAS threads, before numpy loads (as examples/train_gpt.py)

import importlib.util  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402

from minidist import backend  # noqa: E402
from minidist.nn.pretrained import save_state_pretrained, unwritten_fields  # noqa: E402
from minidist.strategy.checkpoint import CheckpointError  # noqa: E402
from minidist.train.amp import bfloat16  # noqa: E402
from minidist.train.args import HelpWithDefaults, Parser, a_path  # noqa: E402
from minidist.train.bpe import (EOT, MERGES, VOCAB, BPETokenizer,  # noqa: E402
                                TokenizerError, tokenizer_files)
from minidist.train.cli import (UsageError, check_one_process, check_out_folder,  # noqa: E402
                               run_main)
from minidist.train.data import DataError  # noqa: E402
from minidist.train.gather import model_config, whole_model  # noqa: E402
from minidist.train.model_tokenizer import not_its_tokenizer, tokenizer_folders  # noqa: E402


TOKENIZER_CONFIG = "tokenizer_config.json"
WRITTEN = ("config.json", "model.safetensors", VOCAB, MERGES, TOKENIZER_CONFIG)   # --out's


def export_parser():
    p = Parser(description="Write a checkpoint as a GPT-2 (or, --arch llama, a Llama) folder "
                           "(config.json, model.safetensors).", formatter_class=HelpWithDefaults)
    p.add_argument("--resume", type=a_path, required=True, metavar="DIR",
                   help="a --save directory (its newest checkpoint) or a checkpoint folder")
    p.add_argument("--out", type=a_path, required=True, metavar="DIR",
                   help="the folder to write: new, empty, or a GPT-2 folder whose files are "
                   "replaced (a folder of other files or of checkpoints is refused)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                   help="the parameters' type in model.safetensors")
    p.add_argument("--tokenizer", type=a_path, default=None, metavar="DIR",
                   help="where the model's vocab.json and merges.txt are (default: the "
                   "--tokenizer, --init-from or --data folder of the run, when it has them)")
    p.add_argument("--traceback", action="store_true",
                   help="on a user error, show the traceback (also MINIDIST_DEBUG=1)")
    return p


def tokenizer_folder(args, vocab_size):
    """The folder of the model's GPT-2 tokenizer files, or None (a model in bytes, or
    characters: nothing to copy); one of another vocabulary than the model's is refused
    (sample.py would refuse the folder it went into), and so is one given that is not the
    model's own (model_tokenizer.not_its_tokenizer: the folder would pair the model with
    other merges)."""
    if args.tokenizer is not None:
        if not tokenizer_files(args.tokenizer):
            raise UsageError(f"--tokenizer {args.tokenizer}: no {VOCAB} and {MERGES} there")
        folder, where = args.tokenizer, f"--tokenizer {args.tokenizer}"
    else:       # the folder read first (a GPT-2 folder holds its own), as sample.py looks
        folder = next((f for f in tokenizer_folders(args.resume) if tokenizer_files(f)), None)
        where = (f"--resume {folder}" if folder == args.resume else
                 f"{folder}, a folder the run named,")
    if folder is None:
        return None
    tokens = BPETokenizer.from_folder(folder).vocab_size
    if tokens != vocab_size:
        raise UsageError(f"the tokenizer in {where} has {tokens:,} tokens, the model "
                         f"{vocab_size:,}: give --tokenizer DIR of the model's own"
                         + (" (a model of 256 tokens reads bytes: it needs none)"
                            if vocab_size == 256 else ""))
    why = args.tokenizer is not None and not_its_tokenizer(args.resume,
                                                           BPETokenizer.from_folder(folder))
    if why:
        raise UsageError(f"{where}: {why}; its ids would mean other strings: leave "
                         "--tokenizer out (the model's own is found through --resume)")
    return folder


def check_out(args):
    """--out is a new or empty folder, or a GPT-2 folder to replace: not the folder read (its
    weights are read while written), nor a file, a --save directory or a folder of other files
    (cli.check_out_folder)."""
    if os.path.isdir(args.out) and os.path.realpath(args.out) == os.path.realpath(args.resume):
        raise UsageError(f"--out {args.out}: is the folder --resume reads; give another")
    check_out_folder("--out", args.out, WRITTEN, "a GPT-2 folder's config.json, "
                     "model.safetensors, vocab.json and merges.txt are replaced")


def main(args):
    check_one_process("export_gpt2.py")
    config = model_config(args.resume)                  # state.json only: cheap
    if args.dtype == "bfloat16" and importlib.util.find_spec("ml_dtypes") is None:
        raise UsageError("--dtype bfloat16 needs the ml_dtypes package (pip install ml_dtypes)")
    if config.moe_experts:
        raise UsageError(f"--resume {args.resume}: a Mixture of Experts ({config.moe_experts} "
                         "experts); GPT-2's and Llama's formats have no experts, so it cannot "
                         "be exported")
    lost = unwritten_fields(config)
    if lost:
        raise UsageError(f"--resume {args.resume}: {lost}, so it cannot be exported")
    tokenizer = tokenizer_folder(args, config.vocab_size)
    check_out(args)
    backend.setup(device="cpu")
    config, params, what = whole_model(args.resume)
    bpe = BPETokenizer.from_folder(tokenizer) if tokenizer else None
    save_state_pretrained(config, params, args.out,
                          dtype=bfloat16() if args.dtype == "bfloat16" else args.dtype,
                          eot_id=bpe.eot if bpe else None)
    for name in (VOCAB, MERGES) if tokenizer else ():
        shutil.copyfile(os.path.join(tokenizer, name), os.path.join(args.out, name))
    if bpe:
        write_tokenizer_config(args.out, bpe, config)
    print(f"wrote {what} to {args.out}: config.json, model.safetensors ({args.dtype})"
          + (f", {TOKENIZER_CONFIG}; {VOCAB} and {MERGES} from {tokenizer}" if tokenizer
             else "; no tokenizer: the model reads bytes (id = the byte's value, 0-255: "
             "list(text.encode('utf-8')) gives its input)" if config.vocab_size == 256
             else ""))


def write_tokenizer_config(out, tokenizer, config):
    """tokenizer_config.json: the class that reads vocab.json and merges.txt (GPT-2's byte
    BPE), so that Hugging Face's AutoTokenizer loads the folder whatever its model_type
    (first-use walk 38: a Llama folder's went to LlamaTokenizer, which wants
    tokenizer.model), and <|endoftext|> as its special tokens where the vocabulary has it."""
    fields = {"tokenizer_class": "GPT2Tokenizer", "model_max_length": config.block_size,
              "add_prefix_space": False}
    if tokenizer.eot is not None:
        fields.update(bos_token=EOT, eos_token=EOT, unk_token=EOT)
    with open(os.path.join(out, TOKENIZER_CONFIG), "w") as f:
        json.dump(fields, f, indent=2)


if __name__ == "__main__":
    run_main(main, parser=export_parser,
             user_errors=(CheckpointError, DataError, TokenizerError))
