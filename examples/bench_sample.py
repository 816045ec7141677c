"""Sampling with the key/value cache against without it: tokens/s of `model.generate` (each
token run alone against the cached k and v: minidist/nn/kv_cache.py) and of the uncached
step (the whole context through the model for every token), in one process.

    python examples/bench_sample.py --threads 2
    python examples/bench_sample.py --threads 2 --arch llama --n-kv-head 2

prints one JSON line: {"cached_s", "uncached_s", "cached_tokens_per_s",
"uncached_tokens_per_s", "speedup", "same_tokens"} for --tokens sampled from a one-token
prompt (temperature 1, seed 1). The model is drawn from the seed (untrained: the speed does
not depend on the weights). Tests: tests/test_gpt.py (the cache's numbers).
"""
import json
import time

import numpy as np

from minidist import backend
from minidist.autograd import no_grad
from minidist.nn import GPT, GPTConfig
from minidist.train.args import example_parser


def uncached(model, prompt, n, seed):
    """generate's loop without the cache: the last block_size tokens through the model for
    every token (what generate did before the cache)."""
    rng, idx = backend.rng(seed), prompt
    with no_grad():
        for _ in range(n):
            ctx = idx[:, -model.config.block_size:]
            idx = np.concatenate([idx, model.next_token(ctx, 1.0, None, rng)[:, None]], 1)
    return idx


def main():
    p = example_parser(__doc__)
    p.add_argument("--threads", type=int, default=1, help="BLAS threads")
    p.add_argument("--tokens", type=int, default=200, help="tokens to generate, each way")
    p.add_argument("--n-layer", type=int, default=6, help="transformer blocks")
    p.add_argument("--n-head", type=int, default=6, help="attention heads")
    p.add_argument("--n-embd", type=int, default=384, help="embedding width")
    p.add_argument("--block-size", type=int, default=512, help="context length, in tokens")
    p.add_argument("--arch", choices=("gpt2", "llama"), default="gpt2",
                   help="the block: gpt2, or llama (RMSNorm, SwiGLU, rotary, no biases)")
    p.add_argument("--n-kv-head", type=int, default=0,
                   help="k and v heads (grouped-query attention); 0: --n-head")
    args = p.parse_args()
    for flag in ("threads", "tokens", "n_layer", "n_head", "n_embd", "block_size"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be at least 1")
    backend.setup(threads=args.threads, device="cpu")
    try:
        config = GPTConfig(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd,
                           block_size=args.block_size, vocab_size=256, arch=args.arch,
                           n_kv_head=args.n_kv_head, bias=args.arch == "gpt2")
    except ValueError as e:
        p.error(f"model flags: {e}")
    model = GPT(config, seed=0).eval()
    prompt = np.zeros((1, 1), dtype=np.int64)
    t = time.perf_counter()
    cached = model.generate(prompt, args.tokens, temperature=1.0, seed=1)
    tc = time.perf_counter() - t
    t = time.perf_counter()
    plain = uncached(model, prompt, args.tokens, seed=1)
    tu = time.perf_counter() - t
    print(json.dumps({"arch": args.arch, "n_kv_head": config.kv_heads, "tokens": args.tokens,
                      "cached_s": round(tc, 3), "uncached_s": round(tu, 3),
                      "cached_tokens_per_s": round(args.tokens / tc, 1),
                      "uncached_tokens_per_s": round(args.tokens / tu, 1),
                      "speedup": round(tu / tc, 2),
                      "same_tokens": bool(np.array_equal(cached, plain))}))


if __name__ == "__main__":
    main()
