"""Expert parallelism, stepped through in one process: which tokens go to which rank.

    python examples/moe_walkthrough.py [--experts 4] [--ep 2] [--top-k 2] [--capacity 1.0]
    python examples/moe_walkthrough.py --pdb     # stop before the experts run, rank by rank:
    (Pdb) p sends                                # the all-to-all's rows, rank i to rank j
    (Pdb) p routings[0].expert, routings[0].token   # rank 0's kept (expert, token) pairs

A Mixture-of-Experts layer (minidist/nn/moe.py) routes a small batch; the batch's rows are cut
over `--ep` ranks as data parallelism would (rank r holds rows r B/ep ..), and each rank holds
E/ep experts (minidist/ep/). For each rank this prints its tokens' choices, what capacity
dropped, and the all-to-all's count matrix (rows sent from each rank to each rank), then runs
the experts rank by rank on what they would receive and checks the combined output against
the layer's own forward on one process. Nothing here sends a message: the same arithmetic as
minidist/ep/exchange.py, laid out so you can read it.
"""
import pdb

import numpy as np

from minidist.autograd import Tensor, no_grad
from minidist.comm.simulate import simulate_all_to_all
from minidist.nn import GPTConfig
from minidist.nn.block import MLP
from minidist.nn.moe import MoE, capacity, route
from minidist.train.args import example_parser


def parse():
    p = example_parser(__doc__)
    p.add_argument("--experts", type=int, default=4, help="experts E, a multiple of --ep")
    p.add_argument("--ep", type=int, default=2, help="simulated expert-parallel ranks")
    p.add_argument("--top-k", type=int, default=2, help="experts each token chooses")
    p.add_argument("--capacity", type=float, default=1.0, help="capacity factor (0: no limit)")
    p.add_argument("--batch", type=int, default=4, help="sequences")
    p.add_argument("--tokens", type=int, default=6, help="tokens per sequence")
    p.add_argument("--pdb", action="store_true",
                   help="stop in pdb once every rank has routed, before the experts run")
    args = p.parse_args()
    # checked here, so a bad flag is named rather than surfacing as GPTConfig's ValueError
    if args.ep < 1:
        p.error(f"--ep {args.ep}: use at least 1 rank")
    if args.experts < 2 or args.experts % args.ep:
        p.error(f"--experts {args.experts}: choose at least 2, a multiple of --ep ({args.ep})")
    if args.batch < 1 or args.batch % args.ep:
        p.error(f"--batch {args.batch}: choose at least 1, a multiple of --ep ({args.ep})")
    if not 1 <= args.top_k <= args.experts:
        p.error(f"--top-k {args.top_k}: choose from 1 to --experts ({args.experts})")
    if not 0 <= args.capacity < float("inf"):                      # also rejects nan
        p.error(f"--capacity {args.capacity}: use a finite factor >= 0 (0: no limit)")
    if args.tokens < 1:
        p.error(f"--tokens {args.tokens}: use at least 1 token per sequence")
    return args


def layer_and_input(args):
    config = GPTConfig(n_layer=1, n_head=1, n_embd=8, block_size=args.tokens, vocab_size=16,
                       moe_experts=args.experts, moe_top_k=args.top_k,
                       moe_capacity_factor=args.capacity)
    layer = MoE(config, MLP, dtype="float64")
    rng = np.random.default_rng(0)
    for _, p in layer.named_parameters():          # random weights: a router with opinions
        p.data = rng.standard_normal(p.shape) * 0.5
    return layer, rng.standard_normal((args.batch, args.tokens, 8))


def show_rank(r, rows, r_routing, args, per_rank):
    """One rank's routing: each token's kept experts, the drops, counts per expert."""
    T = args.tokens
    print(f"rank {r}: sequences {rows.start}..{rows.stop - 1}, experts "
          f"{list(range(r * per_rank, (r + 1) * per_rank))}")
    for n in range(len(rows) * T):
        kept = sorted(int(e) for e in r_routing.expert[r_routing.token == n])
        lost = args.top_k - len(kept)         # each token chooses top_k experts, each once
        print(f"  token {n:2d} (seq {rows.start + n // T}, pos {n % T}) -> experts {kept}"
              + (f" ({lost} of its {args.top_k} choices dropped: over capacity)"
                 if lost else ""))
    print(f"  kept per expert {r_routing.counts.tolist()}, dropped {r_routing.dropped}")


def main():
    args = parse()
    layer, x = layer_and_input(args)
    B, T, C = x.shape
    E, N, per_rank = args.experts, args.ep, args.experts // args.ep
    cap = capacity(T, E, args.top_k, args.capacity)
    print(f"{B} sequences x {T} tokens, E={E} experts, top-{args.top_k}, capacity {cap} tokens "
          f"per sequence per expert, ep={N}: {per_rank} experts per rank\n")
    with no_grad():
        want = layer(Tensor(x)).data.reshape(B * T, C)              # one process
        probs = layer.router(Tensor(x.reshape(-1, C))).data
        probs = np.exp(probs - probs.max(1, keepdims=True))
        probs /= probs.sum(1, keepdims=True)
        rows_per = B // N
        routings, sends = [], np.zeros((N, N), dtype=int)
        for r in range(N):                                           # each rank routes its rows
            rows = range(r * rows_per, (r + 1) * rows_per)
            rr = route(probs[r * rows_per * T:(r + 1) * rows_per * T], args.top_k, cap, T)
            routings.append(rr)
            show_rank(r, rows, rr, args, per_rank)
            sends[r] = rr.counts.reshape(N, per_rank).sum(1)
        print(f"\nall-to-all rows (from rank i, to rank j):\n{sends}")
        print("the pairwise exchange (minidist/comm/alltoall.py), rows per message:")
        simulate_all_to_all([np.arange(int(c.sum())) for c in sends], sends.tolist())
        out0, in0 = sends[0].sum() - sends[0, 0], sends[:, 0].sum() - sends[0, 0]
        print(f"rank 0 sends {out0} rows in the dispatch and {in0} in the combine (the outputs "
              f"of the rows it received), the same again in backward: exchange_bytes = "
              f"{N - 1} x {per_rank} x 8 (counts) + 2 x ({out0} + {in0}) x C x itemsize\n")
        if args.pdb:                  # routings, sends and probs in scope (the docstring)
            pdb.set_trace()
        got = np.zeros((B * T, C))
        for r, rr in enumerate(routings):                           # experts on their ranks
            base = r * rows_per * T
            for e in range(E):
                pick = rr.expert == e
                tok = rr.token[pick] + base
                y = getattr(layer.experts, str(e))(Tensor(x.reshape(-1, C)[tok])).data
                got[tok] += probs[tok, e][:, None] * y               # the combine
        diff = np.abs(got - want).max()
    print(f"expert outputs combined by rank: max |diff| against one process = {diff:.1e}")


if __name__ == "__main__":
    main()
