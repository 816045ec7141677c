"""Activation memory of the GPT with materialised vs tiled attention, from the memory ledger.

    python examples/attention_memory.py --seq 1024 4096

For each sequence length T and each attention (--attention materialized | tiled) prints one
JSON line: the bytes the autograd graph keeps between forward and backward
(minidist/strategy/memory.py activation_bytes, parameters excluded) for train_gpt.py's default
model (4 layers, 4 heads, n_embd 128, vocab 256, batch 16, float32). The materialised
attention keeps P, L B nh T^2 floats (16 GiB at T = 4096): where that exceeds --max-gib the
run is made at two smaller batches and extrapolated ("measured_batch"): every activation
but the (T, C) position embedding has the batch as its leading axis, so the ledger is
affine in it. The tiled attention keeps L B nh T
log-sum-exp floats instead (minidist/autograd/flash.py). Tests: tests/test_attention_tiled.py.
"""
import json

import numpy as np

from minidist.nn import GPT, GPTConfig
from minidist.strategy.memory import activation_bytes
from minidist.train.args import check_at_least, example_parser

# (flag, lowest allowed value, what it is)
AT_LEAST = (("--batch-size", 1, "sequences"), ("--n-layer", 1, "transformer blocks"),
            ("--n-head", 1, "attention heads"), ("--n-embd", 1, "the embedding width"),
            ("--attention-block", 1, "the tile size"), ("--max-gib", 0, "GiB"))


def measure(config, batch):
    """Activation bytes of one forward (with the loss) at `batch` sequences of block_size."""
    model = GPT(config, seed=0)
    r = np.random.default_rng(0)
    x = r.integers(0, config.vocab_size, (batch, config.block_size))
    _, loss = model(x, x)
    return activation_bytes(loss, model.parameters())


def main():
    p = example_parser(__doc__)
    p.add_argument("--seq", type=int, nargs="+", default=[1024, 4096],
                   help="sequence lengths T to measure")
    p.add_argument("--batch-size", type=int, default=16, help="batch, in sequences")
    p.add_argument("--n-layer", type=int, default=4, help="transformer blocks")
    p.add_argument("--n-head", type=int, default=4, help="attention heads")
    p.add_argument("--n-embd", type=int, default=128, help="embedding width")
    p.add_argument("--attention-block", type=int, default=64,
                   help="tile size of the tiled attention")
    p.add_argument("--max-gib", type=float, default=3.0,
                   help="largest attention-probability memory to really allocate")
    args = p.parse_args()
    configs = check_flags(p, args)            # every flag, before seconds of measuring
    for T in args.seq:
        for attention in ("materialized", "tiled"):
            config = configs[T, attention]
            b = args.batch_size
            p_bytes = 4 * args.n_layer * args.n_head * T * T     # P per sequence, float32
            while attention == "materialized" and b > 1 and b * p_bytes > args.max_gib * 2**30:
                b //= 2
            act = measure(config, b)
            if b < args.batch_size:                 # affine in the batch: a + b * per_seq
                small = measure(config, b // 2) if b > 1 else 0
                act += (act - small) / (b - b // 2) * (args.batch_size - b)
            kept = p_bytes if attention == "materialized" else 4 * args.n_layer * args.n_head * T
            print(json.dumps({"T": T, "attention": attention, "batch": args.batch_size,
                              "measured_batch": b, "activations_mib": round(act / 2**20, 1),
                              "attention_kept_mib": round(args.batch_size * kept / 2**20, 2)}),
                  flush=True)


def check_flags(p, args):
    """The flags' ranges and every model the run will build ({(T, attention): GPTConfig}),
    before any is measured: a bad one is p.error's one `error:` line, exit status 2 (review
    38: tracebacks, one of them after a minute of measuring the first length)."""
    check_at_least(p, args, AT_LEAST)
    bad = [T for T in args.seq if T < 1]
    if bad:
        p.error(f"--seq {bad[0]}: a sequence length is at least 1")
    try:
        return {(T, attention): GPTConfig(
                    n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, block_size=T,
                    vocab_size=256, attention=attention, attention_block=args.attention_block)
                for T in args.seq for attention in ("materialized", "tiled")}
    except ValueError as e:                   # n_embd not a multiple of n_head, ...
        p.error(f"model flags: {e}")


if __name__ == "__main__":
    main()
