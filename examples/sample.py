"""Generate text from a saved checkpoint, whichever strategy trained it.

    python examples/train_gpt.py --steps 400 --save ckpt
    python examples/sample.py --resume ckpt --prompt "def main(" --tokens 200
    python examples/sample.py --resume ckpt/step-00000200 --temperature 0 --prompt "import "

--resume takes what train_gpt.py's --resume takes (a --save directory: its newest checkpoint;
or one checkpoint folder), written by one process, DDP, ZeRO-1/2/3, TP, PP, CP or TP x ZeRO:
the pieces are gathered into the whole model in this one process
(minidist/train/gather.py). A GPT-2 folder (config.json + model.safetensors) loads too: a
real GPT-2 (`--resume gpt2`, a Hugging Face download: its vocab.json and merges.txt are the
tokenizer, minidist/train/bpe.py) or one minidist wrote.
The tokenizer: bytes for a 256-token model; else --tokenizer DIR's, the --resume folder's,
or that of the folders its run named (--tokenizer, --init-from, --data: a GPT-2 tokenizer
or nanoGPT's meta.pkl, minidist/train/token_files.py tokenizer_in).
The prompt and its continuation go to stdout (control characters escaped), the line saying
what was loaded to stderr. --temperature 0 is greedy; the same --seed gives the same text.
Tests: tests/test_sample.py.
"""
from minidist.launcher import set_thread_env

set_thread_env()            # BLAS threads, before numpy loads (as examples/train_gpt.py)

import math  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

from minidist import backend  # noqa: E402
from minidist.nn import GPT  # noqa: E402
from minidist.train.args import HelpWithDefaults, Parser, a_path  # noqa: E402
from minidist.strategy.checkpoint import CheckpointError  # noqa: E402
from minidist.train.cli import (UsageError, check_device, check_one_process,  # noqa: E402
                               run_main)
from minidist.train.bpe import TokenizerError  # noqa: E402
from minidist.train.data import ByteTokenizer, DataError  # noqa: E402
from minidist.train.end_sample import printable, start_ids  # noqa: E402
from minidist.train.gather import model_config, router_bias, whole_model  # noqa: E402
from minidist.train.model_tokenizer import not_its_tokenizer, own_tokenizer  # noqa: E402
from minidist.train.token_files import tokenizer_in  # noqa: E402


def sample_parser():
    p = Parser(description="Generate text from a checkpoint (minidist/train/README.md: "
                           "Sampling a checkpoint).",
               formatter_class=HelpWithDefaults)
    p.add_argument("--resume", type=a_path, required=True, metavar="DIR",
                   help="a --save directory (its newest checkpoint), a checkpoint folder, or "
                   "a GPT-2 or Llama folder (config.json, model.safetensors)")
    p.add_argument("--prompt", default=None,
                   help="the text to continue (default: a newline; the first token of a "
                   "character vocabulary without one, as train_gpt.py's sample)")
    p.add_argument("--tokens", "--sample", dest="tokens", type=int, default=200, metavar="N",
                   help="tokens to generate (bytes, for a model in bytes; --sample: "
                   "train_gpt.py's name)")
    p.add_argument("--tokenizer", type=a_path, default=None, metavar="DIR",
                   help="for a model not in bytes: a folder with its vocab.json and "
                   "merges.txt (GPT-2's), or nanoGPT's meta.pkl (default: the --resume "
                   "folder's, else the --init-from or --data folder of the run)")
    p.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    p.add_argument("--top-k", type=int, default=40, help="sample among the k likeliest; 0: all")
    p.add_argument("--seed", type=int, default=0, help="the same seed, the same text")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: cuda when CuPy sees a GPU, else cpu")
    p.add_argument("--traceback", action="store_true",
                   help="on a user error, show the traceback (also MINIDIST_DEBUG=1)")
    return p


def check(args):
    check_one_process("sample.py")         # every rank would print the whole sample
    if args.tokens < 1:
        raise UsageError(f"--tokens/--sample {args.tokens}: must be at least 1")
    if not 0 <= args.temperature < math.inf:
        raise UsageError(f"--temperature {args.temperature}: must be a number >= 0 (0: "
                         "greedy)")
    if args.top_k < 0:
        raise UsageError(f"--top-k {args.top_k}: must not be negative (0: no top-k)")
    if args.seed < 0:                      # (was numpy's traceback)
        raise UsageError(f"--seed {args.seed}: must not be negative")
    if args.prompt == "":
        raise UsageError("--prompt '': give at least one character to continue")
    check_device(args)


def pick_tokenizer(args, vocab_size):
    """The model's tokenizer (module docstring), checked against its vocabulary; one given
    that is not the model's own (another of the same size) is refused."""
    if args.tokenizer is not None:
        tokenizer, where = tokenizer_in(args.tokenizer), f"--tokenizer {args.tokenizer}"
        if tokenizer is None:
            what = "no vocab.json and merges.txt (nor meta.pkl) there" if os.path.isdir(
                args.tokenizer) else "no such folder"
            raise UsageError(f"{where}: {what}")
    elif vocab_size == ByteTokenizer.vocab_size:
        tokenizer, where = ByteTokenizer(), "bytes"
    else:
        tokenizer, where = own_tokenizer(args.resume)
        if tokenizer is None:
            raise UsageError(f"--resume {args.resume}: a model of a {vocab_size:,}-token "
                             f"vocabulary, and no tokenizer found for it (looked in "
                             f"{', '.join(where)}); give --tokenizer DIR, a folder with its "
                             "vocab.json and merges.txt (as every GPT-2 download has them) "
                             "or nanoGPT's meta.pkl")
    if tokenizer.vocab_size != vocab_size:
        raise UsageError(f"the tokenizer of {where} has {tokenizer.vocab_size:,} tokens, the "
                         f"model {vocab_size:,}: give --tokenizer DIR of the model's own")
    why = args.tokenizer is not None and not_its_tokenizer(args.resume, tokenizer)
    if why:
        raise UsageError(f"{where}: {why}; its ids would mean other strings: leave "
                         "--tokenizer out (the model's own is found through --resume)")
    return tokenizer


def main(args):
    check(args)
    config = model_config(args.resume)          # state.json / config.json only: cheap
    tokenizer = pick_tokenizer(args, config.vocab_size)
    try:
        idx = start_ids(tokenizer) if args.prompt is None else \
            tokenizer.encode(args.prompt)[None, :]
    except (DataError, TokenizerError) as e:
        raise UsageError(f"--prompt {args.prompt!r}: {e}") from None
    backend.setup(device=args.device)
    config, params, what = whole_model(args.resume)
    dtype = "float64" if any(str(a.dtype) == "float64" for a in params.values()) else "float32"
    model = GPT(config, seed=0, dtype=dtype)
    model.load_state_dict(params)
    model.router_bias.load_state_dict(router_bias(args.resume))    # MoE: how it routes
    print(f"sampling {args.tokens} tokens from {what}: {model.num_parameters():,} parameters, "
          f"{dtype} on {backend.device()}", file=sys.stderr, flush=True)
    if idx.shape[1] > config.block_size:       # (walk 38: cropped without a word)
        print(f"note: the prompt's {idx.shape[1]:,} tokens are more than the model's "
              f"{config.block_size:,}: it reads the last {config.block_size:,} (and each new "
              "token the last as many before it)", file=sys.stderr, flush=True)
    out = model.generate(idx, args.tokens, temperature=args.temperature,
                         top_k=args.top_k or None, seed=args.seed)
    text = tokenizer.decode(out[0])
    print(printable(text), flush=True)
    return text


if __name__ == "__main__":
    run_main(main, parser=sample_parser,
             user_errors=(CheckpointError, DataError, TokenizerError))
