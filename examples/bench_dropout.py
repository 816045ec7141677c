"""Dropout's keyed numbers (Philox4x32-10, minidist/autograd/dropout_keys.py) against numpy's
own generator, on the host, measured in one run.

    python examples/bench_dropout.py
    python examples/bench_dropout.py --batch 16 --block-size 1024

The sites of one forward of the default model (train_gpt's: 4 layers, 4 heads, n_embd 128,
block 128) for one rank's rows (--batch, default 4: 16 sequences over 4 ranks): the
embedding's and each block's two residual dropouts (B, T, C) and its attention weights'
(B, nh, T, T). Prints one JSON line per way of getting the numbers, best of --repeats:

    pcg64          numpy's PCG64 drawing every site's numbers at once (the floor: no key)
    keyed          DropoutSite.random for every site (what the materialised path would
                   draw for a whole (B, nh, T, T) tensor)
    keyed_causal   the attention weights through attention.py's mask (the causal half
                   only, 16 query rows a call), the residual sites whole: what a step draws

with ms per forward, "numbers" (every site's elements: what the masks cover, the same for
each way), "numbers_drawn" (what this way computes: all of them, but for keyed_causal,
which skips the weights above each band's last query, about 56% of the attention's at
block 128), "ns_per_number" (ms over numbers_drawn) and the ratio to pcg64's ns per number.
"""
import json
import time

import numpy as np

from minidist.autograd.attention import CAUSAL_BAND, keep_mask
from minidist.autograd.dropout_keys import DropoutKeys, DropoutSite
from minidist.train.args import example_parser


def sites(args, keys):
    B, T, C, nh = args.batch, args.block_size, args.n_embd, args.n_head
    out = [(DropoutSite(keys, "transformer.drop"), (B, T, C), False)]
    for i in range(args.n_layer):
        h = f"transformer.h.{i}."
        out += [(DropoutSite(keys, h + "attn.attn_dropout"), (B, nh, T, T), True),
                (DropoutSite(keys, h + "attn.resid_dropout"), (B, T, C), False),
                (DropoutSite(keys, h + "mlp.dropout"), (B, T, C), False)]
    return out


def causal_numbers(shape):
    """The numbers keep_mask draws on the host for attention weights of `shape` (B, nh, T,
    T): CAUSAL_BAND query rows a call, each band's keys up to its last query, rounded up to
    Philox's blocks of 4 (but never past T)."""
    B, nh, T, _ = shape
    per_head = 0
    for r0 in range(0, T, CAUSAL_BAND):
        r1 = min(r0 + CAUSAL_BAND, T)
        per_head += (r1 - r0) * min(-(-r1 // 4) * 4, T)
    return B * nh * per_head


def best(fn, repeats):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main():
    p = example_parser(__doc__)
    p.add_argument("--batch", type=int, default=4, help="rows (one rank's)")
    p.add_argument("--block-size", type=int, default=128, help="context length, in tokens")
    p.add_argument("--n-embd", type=int, default=128, help="embedding width")
    p.add_argument("--n-head", type=int, default=4, help="attention heads")
    p.add_argument("--n-layer", type=int, default=4, help="transformer blocks")
    p.add_argument("--repeats", type=int, default=7, help="timed runs per way, best kept")
    args = p.parse_args()
    for name, value in vars(args).items():     # 0 numbers or 0 repeats: nothing to time
        if value < 1:
            p.error(f"--{name.replace('_', '-')} {value}: must be at least 1")
    keys = DropoutKeys(1337)
    every = sites(args, keys)
    n = sum(int(np.prod(shape)) for _, shape, _ in every)
    drawn = {"pcg64": n, "keyed": n,
             "keyed_causal": sum(causal_numbers(shape) if attention else int(np.prod(shape))
                                 for _, shape, attention in every)}
    gen = np.random.default_rng(0)

    def pcg64():
        for _, shape, _ in every:
            gen.random(shape, dtype=np.float32)

    def keyed():
        for site, shape, _ in every:
            site.random(shape)

    def keyed_causal():
        for site, shape, attention in every:
            if attention:
                keep_mask(site, shape, 0.1, np)
            else:
                site.random(shape)

    times = {name: best(fn, args.repeats) for name, fn in
             (("pcg64", pcg64), ("keyed", keyed), ("keyed_causal", keyed_causal))}
    base = times["pcg64"] / n       # one measurement, so pcg64's own ratio is exactly 1
    for name, t in times.items():
        per = t / drawn[name]
        print(json.dumps({"way": name, "numbers": n, "numbers_drawn": drawn[name],
                          "ms": round(t * 1e3, 2), "ns_per_number": round(per * 1e9, 2),
                          "ratio_to_pcg64": round(per / base, 2), **vars(args)}), flush=True)


if __name__ == "__main__":
    main()
