"""Generate text from a saved checkpoint, whichever strategy trained it.

    python examples/train_gpt.py --steps 400 --save ckpt
    python examples/sample.py --resume ckpt --prompt "def main(" --tokens 200
    python examples/sample.py --resume ckpt/step-00000200 --temperature 0 --prompt "import "

--resume takes what train_gpt.py's --resume takes (a --save directory: its newest checkpoint;
or one checkpoint folder), written by one process, DDP, ZeRO-1/2/3, TP, PP, CP or TP x ZeRO:
the pieces are gathered into the whole model in this one process
(minidist/train/gather.py). A GPT-2 folder (config.json + model.safetensors) loads too when
its vocabulary is minidist's bytes; an imported GPT-2 (50,257 BPE tokens) is refused, since
minidist has no GPT-2 tokenizer to turn --prompt into its tokens.
The prompt and its continuation go to stdout (control characters escaped), the line saying
what was loaded to stderr. --temperature 0 is greedy; the same --seed gives the same text.
Tests: tests/test_sample.py.
"""
from minidist.launcher import set_thread_env, world_size_from_env

set_thread_env()            # BLAS threads, before numpy loads (as examples/train_gpt.py)

import math  # noqa: E402
import sys  # noqa: E402

from minidist import backend  # noqa: E402
from minidist.nn import GPT  # noqa: E402
from minidist.train.args import HelpWithDefaults, Parser  # noqa: E402
from minidist.strategy.checkpoint import CheckpointError  # noqa: E402
from minidist.train.cli import UsageError, check_device, printable, run_main  # noqa: E402
from minidist.train.data import ByteTokenizer  # noqa: E402
from minidist.train.gather import model_config, whole_model  # noqa: E402


def sample_parser():
    p = Parser(description="Generate text from a checkpoint (minidist/train/README.md: "
                           "Sampling a checkpoint).",
               formatter_class=HelpWithDefaults)
    p.add_argument("--resume", required=True, metavar="DIR",
                   help="a --save directory (its newest checkpoint), a checkpoint folder, or "
                   "a GPT-2 folder with minidist's byte vocabulary")
    p.add_argument("--prompt", default="\n",
                   help="the text to continue (default: %(default)r, a newline)")
    p.add_argument("--tokens", type=int, default=200, metavar="N",
                   help="tokens (bytes) to generate")
    p.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    p.add_argument("--top-k", type=int, default=40, help="sample among the k likeliest; 0: all")
    p.add_argument("--seed", type=int, default=0, help="the same seed, the same text")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--traceback", action="store_true",
                   help="on a user error, show the traceback (also MINIDIST_DEBUG=1)")
    return p


def check(args):
    if world_size_from_env() > 1:          # every rank would print the whole sample
        raise UsageError(f"sample.py runs on one process, not {world_size_from_env()}: run "
                         "`python examples/sample.py ...` without mpirun")
    if args.tokens < 1:
        raise UsageError(f"--tokens {args.tokens}: must be at least 1")
    if not 0 <= args.temperature < math.inf:
        raise UsageError(f"--temperature {args.temperature}: must be a number >= 0 (0: "
                         "greedy)")
    if args.top_k < 0:
        raise UsageError(f"--top-k {args.top_k}: must not be negative (0: no top-k)")
    if not args.prompt:
        raise UsageError("--prompt '': give at least one character to continue")
    check_device(args)


def main(args):
    check(args)
    tokenizer = ByteTokenizer()
    config = model_config(args.resume)          # state.json / config.json only: cheap
    if config.vocab_size != tokenizer.vocab_size:
        raise UsageError(
            f"--resume {args.resume}: a model with a {config.vocab_size:,}-token vocabulary "
            f"(an imported GPT-2's BPE tokens); minidist has only its byte tokenizer "
            f"({tokenizer.vocab_size} tokens) and no GPT-2 tokenizer, so it cannot turn "
            "--prompt into this model's tokens. Sample a model trained by "
            "examples/train_gpt.py")
    backend.setup(device=args.device)
    config, params, what = whole_model(args.resume)
    dtype = "float64" if any(str(a.dtype) == "float64" for a in params.values()) else "float32"
    model = GPT(config, seed=0, dtype=dtype)
    model.load_state_dict(params)
    print(f"sampling {args.tokens} tokens from {what}: {model.num_parameters():,} parameters, "
          f"{dtype} on {backend.device()}", file=sys.stderr, flush=True)
    idx = tokenizer.encode(args.prompt)[None, :]
    out = model.generate(idx, args.tokens, temperature=args.temperature,
                         top_k=args.top_k or None, seed=args.seed)
    text = tokenizer.decode(out[0])
    print(printable(text), flush=True)
    return text


if __name__ == "__main__":
    run_main(main, sample_parser().parse_args(), user_errors=(CheckpointError,))
