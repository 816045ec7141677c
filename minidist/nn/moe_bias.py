"""Auxiliary-loss-free load balancing (Wang et al. 2024, "Auxiliary-Loss-Free Load Balancing
Strategy for Mixture-of-Experts", as DeepSeek-V3 trains): each MoE block keeps a bias b (E,),
one number per expert, that no gradient trains.

    selection   each token's top-k experts by probs + b (moe.py route); capacity drops in
                GShard's order of that choice; the combine's weights stay probs, so b
                changes which experts run, never how much an expert's output counts
    update      after each optimizer step (--moe-bias-rate gamma > 0; DeepSeek-V3: 0.001)
                    b_e += gamma sign(mean_load - load_e)
                load_e: the assignments (before capacity dropping) expert e got over the
                GLOBAL batch of the step (every rank's rows, every micro-batch and
                --grad-accum step), mean_load their mean over the E experts: an overloaded
                expert's b falls, an idle one's rises, by gamma whatever the gap (a step
                --amp skips for an overflow moves b too: its tokens were routed, in one
                process as in any layout)
    gamma 0     b is not updated but still routes (DeepSeek-V3 set gamma to 0 for its last
                500B tokens): a run resumed with --moe-bias-rate 0 keeps its checkpoint's b

Global counts, so that every rank holding a block has one process's b: MoE.forward adds each
training forward's `chosen` (per WHOLE sequence, before dropping) to the layer's `load`;
`global_loads` sums them over the world, every MoE block of the model in one float64
all-reduce of host memory (nothing waits for the GPU), zeros for blocks another pipeline
stage holds, and divides by the ranks that hold each sequence (tensor-parallel ranks hold the
same rows; context- and sequence-parallel ranks each hold a sequence's whole `chosen`). The
sums are of integers, so every rank gets the same bits and makes the same update: every rank
holds every block's b (`RouterBias`, the GPT's table; each MoE layer routes by a view of its
block's row, as DDP's .grad are views into its buckets), a pipeline stage the others' too.
Where b is saved (with the run's state, beside the parameters), and why there: the docstring
of minidist/nn/moe.py. The --log-json rows' routing figures (`global_load_stats`: tokens and
drops per expert, the aux loss, over the global batch) are summed the same way.
Tests: tests/test_moe_bias.py (the update and the biased routing by hand, the counts, the
imbalance falling; every layout = one process, resumed bit for bit and in another layout).
"""
import numpy as np

from minidist.nn.moe import load_stats, moe_layers, moe_layers_by_block


class RouterBias:
    """Every MoE block's b, on the host: `table` (blocks, E) float64, row i block
    `blocks[i]`'s (all of the model's, on every rank). Changed in place only, so the MoE
    layers' views (`row`) see every update and every load."""

    def __init__(self, config):
        self.blocks = [i for i in range(config.n_layer) if config.is_moe(i)]
        self.table = np.zeros((len(self.blocks), config.moe_experts))

    def row(self, block):
        """Block `block`'s b (E,), a view into the table: what its MoE layer routes by."""
        return self.table[self.blocks.index(block)]

    def update(self, loads, rate):
        """b += rate sign(mean load - load) for every block: `loads` (blocks, E), a step's
        global assignments per expert (global_loads)."""
        self.table += rate * np.sign(loads.mean(axis=1, keepdims=True) - loads)

    def state_dict(self):
        """{block number (a string, as JSON keys are): b as a list of floats}; {} when dense."""
        return {str(b): row.tolist() for b, row in zip(self.blocks, self.table)}

    def load_state_dict(self, state):
        """state_dict's inverse; a block it lacks (a checkpoint from before the biases: {})
        starts at 0."""
        self.table[...] = 0.0
        for block, values in state.items():
            self.row(int(block))[...] = values


def world_block_sums(rows, held, world, copies):
    """(sums, h, per_row) of `rows` (blocks, n): this rank's numbers for every MoE block of
    the whole model, `held` (blocks,) 1 for the blocks this rank holds (zeros in their rows
    where another pipeline stage holds them). One float64 all-reduce over `world` of host
    memory (nothing waits for the GPU; as strategy/base.py any_rank_of), `held` appended:
    h (blocks, 1) the ranks holding each block (the world, or its stage's). `copies`: the
    ranks holding each row of the batch (loop._copies: tp, cp and the stages, times 1 under
    dp and ep), of which per_row = copies x h / world hold the block (the tp group, which
    routes the same rows alike); each counted its sequences whole, so sums / per_row count
    every sequence once."""
    vec = np.concatenate([rows, np.asarray(held, dtype=np.float64)[:, None]], axis=1)
    world.all_reduce(vec, op="sum")                                       # in place
    sums, h = vec[:, :-1], vec[:, -1:]
    return sums, h, copies * h / world.size


def global_loads(model, world=None, copies=1):
    """(blocks, E) float64: each MoE block's assignments per expert, before dropping, over the
    GLOBAL batch of the training forwards since the last call (the layers' `load`, taken:
    zeroed), summed over `world` (None: one process) by world_block_sums."""
    bias = model.router_bias
    rows, held = np.zeros_like(bias.table), np.zeros(len(bias.blocks))
    for block, m in moe_layers(model).items():
        i = bias.blocks.index(block)
        rows[i], held[i] = m.load, 1
        m.load[...] = 0
    if world is None or world.size == 1:
        return rows
    sums, _, per_row = world_block_sums(rows, held, world, copies)
    return np.rint(sums / per_row)


def global_load_stats(model, world, copies):
    """moe.py's load_stats over the GLOBAL batch (this rank's rows of the step's
    micro-batches, summed over the ranks: every rank of the world calls this). One float64
    all-reduce over the world of [tokens, dropped, aux] per MoE block of the whole model
    (world_block_sums,
    host memory), zeros for the blocks this rank does not hold (another pipeline stage's).
    Of the h ranks holding a block
    (the world, or its stage's ranks under --pp), those holding the same rows computed the
    same routing: `copies` (the ranks holding each row, the loop's count) x h / world of
    them (the tp group), so the sums / that are the sums over the ranks that hold different
    rows (dp x ep), and aux summed / h is their mean (every rank holds as many rows). A rank
    holding 1/R of each sequence's tokens (cp, sequence parallelism: Routing.parts) counts
    R times its own, as if it held them whole (the aux is already the whole sequence's). {}
    for a dense model; as is on one process."""
    config = model.config
    if not config.moe_experts or world is None or world.size == 1:
        return load_stats(model)
    blocks, E = model.router_bias.blocks, config.moe_experts
    rows, mine = np.zeros((len(blocks), E + 2)), np.zeros(len(blocks))  # tokens, dropped, aux
    for b, m in moe_layers_by_block(model).items():
        kept, dropped, aux = m.logged.take()          # the step's micro-batches, summed
        parts = m.routing.parts
        i = blocks.index(b)
        rows[i] = [*(kept * parts), dropped * parts, aux]
        mine[i] = 1
    total, held, per_row = world_block_sums(rows, mine, world, copies)
    counts = np.rint(total[:, :E + 1] / per_row).astype(np.int64)
    return {"moe_tokens": counts[:, :E].tolist(), "moe_dropped": counts[:, E].tolist(),
            "moe_aux": (total[:, E + 1] / held[:, 0]).tolist()}


def imbalance(loads):
    """max / mean of each block's loads (blocks, E): 1 when balanced, E / k when one expert
    is in every token's top-k."""
    return (loads.max(axis=1) / loads.mean(axis=1)).tolist()


class LoadBalance:
    """The loop's part (minidist/train/loop.py): `after_step`, on every rank after each
    optimizer step, updates the biases from the step's global loads (one all-reduce) when
    `rate` > 0; `report` gives each block's imbalance since the last report, for the eval
    line (with rate 0 the loads wait on each rank until then: one all-reduce a report)."""

    def __init__(self, model, world, rate):
        self.model, self.world, self.rate = model, world, rate
        self.period = np.zeros_like(model.router_bias.table)    # global loads since reported
        self.steps = 0

    def after_step(self, copies):
        """After an optimizer step (`copies`: global_loads')."""
        if not self.model.router_bias.blocks:                 # a dense model
            return
        self.steps += 1
        if self.rate:
            loads = global_loads(self.model, self.world, copies)
            self.model.router_bias.update(loads, self.rate)
            self.period += loads

    def report(self, copies):
        """{"moe_imbalance": max / mean load per block, "moe_loads": the loads (blocks, E),
        "moe_steps": how many steps, "moe_bias": [min, max] of b} over the steps since the
        last report (then forgotten); {} for a dense model or no step. Collective (every rank
        calls it) when rate is 0."""
        if not self.steps:
            return {}
        if not self.rate:
            self.period += global_loads(self.model, self.world, copies)
        table = self.model.router_bias.table
        out = {"moe_imbalance": imbalance(self.period), "moe_steps": self.steps,
               "moe_loads": self.period.astype(np.int64).tolist(),
               "moe_bias": [float(table.min()), float(table.max())]}
        self.period[...] = 0
        self.steps = 0
        return out


def report_line(stats):
    """The eval log's words for `report`'s dict."""
    ratios = ", ".join(f"{r:.2f}" for r in stats["moe_imbalance"])
    lo, hi = stats["moe_bias"]
    n = stats["moe_steps"]
    return (f"MoE load max/mean {ratios} (per block, last {n} step{'s' * (n != 1)}; 1 is "
            "balanced)" + (f"; router biases {lo:+.4f} .. {hi:+.4f}" if lo or hi else ""))
