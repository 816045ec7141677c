"""What a rank's step holds beyond the planner's rows, for the start-up's memory check
(minidist/train/memory_check.py rank_bill "buffers"). The planner (train/planner.py bill)
counts the model states as the ZeRO paper does and the activations the graph keeps; a step
also holds, counted here from the rank's own parameter shapes:

    optimizer scratch   AdamW's (and Muon's) update goes through one reusable temporary per
                        parameter shape (optim/optimizer.py scratch), --amp's unscaling
                        through one float32 buffer per shape (train/amp.py unscaled): kept
                        for the run, one of each distinct shape the rank holds.
    ZeRO, any stage     its optimizer's float32 temporary of a unit's shard (zero/optim.py
                        _scratch_buffer, per shard size: a block's and the root's; --amp's
                        unscaling one more of each), and the communication layer's work
                        array, grown to the largest unit a reduce-scatter took (comm/
                        group.py _get_scratch): kept for the run.
    ZeRO-2, 3           a block's gradients while its backward runs, whole (.grad, until the
                        unit's hook flattens them), and the flat buffers of the reduce-
                        scatters in flight (zero/stage2.py: max_inflight + 1 units at once);
                        the root's (wte, tied to the head: its gradient starts at the head and
                        ends at the embedding) whole through backward.
    ZeRO-3              the gathered parameters: two shared block buffers (this block's and
                        the prefetched next one, zero/stage3.py) and the root's, gathered for
                        the step.
    --ckpt-activations  the block whose backward runs is computed again: its activations as a
                        graph keeps them, for one block at a time (autograd/recompute.py);
                        under TP Korthikanti's split block (tp_block).
    --amp on the CPU    numpy has no 16-bit BLAS: a matmul multiplies float32 copies of its
                        operands into a float32 product (backend.matmul), the largest of the
                        rank's (a weight, its rows of input and of output) at once.

Measured with tracemalloc (the live arrays' peak over a run, the largest rank's: `python
examples/train_gpt.py --steps 2 --n-layer 4 --n-embd 512 --n-head 8 --block-size 128
--batch-size 4` with the flags below): billed without these, 2 ranks, ZeRO-3 135.2 MiB for
212.4, ZeRO-2 159.7 for 215.4, --ckpt-activations (1 process) 216.5 for 243.3; with them,
ZeRO-3 227.3 for 208.3, ZeRO-2 226.9 for 208.6, recompute 246.3 for 237.0, and 4 ranks
--amp ZeRO-1 113.9 for 117.5, ZeRO-2 120.0 for 110.9, ZeRO-3 114.1 for 105.0; DDP 245.7 for
257.1, --tp 2 151.1 for 138.0, --pp 4 82.9 for 90.7, --cp 2 241.7 for 256.4.
Tests: tests/test_memory_check.py.
"""
import functools
import math

from minidist.nn.config import config_key, config_of_key, gpt_param_specs
from minidist.pp.schedule import block_stages
from minidist.train.activations import (layer_activation_bytes, minidist_activation_bytes,
                                        mlp_saved)
from minidist.train.planner import Layout, local_size, state_bytes

MAX_INFLIGHT = 2          # zero/stage2.py ZeroStage2.max_inflight: reduce-scatters in flight


def rank_shapes(config, layout, stage, v=1):
    """(name, whole shape, elements on this rank) of each parameter a rank of pipeline
    `stage` holds: its blocks' (block_stages', of its v chunks under interleaving; an
    expert's on E/ep ranks: those of its own), the embeddings on the first stage, ln_f and
    the tied head's wte on the last; split by tp."""
    out, stages = [], block_stages(config.n_layer, layout.pp, v)
    for name, (shape, _) in gpt_param_specs(config).items():
        if name.startswith("transformer.h."):
            block = int(name.split(".")[2])
            if stages[block] != stage:
                continue
            if ".mlp.experts." in name and int(name.split(".")[5]) % layout.ep:
                continue                        # (E/ep of them: counted by one rank's share)
        elif name == "transformer.wte.weight":
            if stage not in (0, layout.pp - 1):
                continue
        elif name == "transformer.wpe.weight" and stage != 0:
            continue
        elif name.startswith("transformer.ln_f.") and stage != layout.pp - 1:
            continue
        out.append((name, shape, local_size(name, shape, layout.tp)))
    return out


def optimizer_scratch(distinct, layout):
    """Elements (float32, or the run's dtype) of the optimizer's per-shape temporaries, for a
    rank whose distinct shapes hold `distinct` elements (_distinct): one per distinct shape
    for the update, one more under --amp for the unscaling; none under ZeRO (its flat
    shards' temporaries are the units' below)."""
    return 0 if layout.zero else (2 if layout.amp else 1) * distinct


def _distinct(shapes):
    """Elements of one of each distinct (shape, elements) among `shapes`."""
    return sum(n for _, n in {(shape, n) for _, shape, n in shapes})


def zero_units(shapes, layout):
    """(the largest block unit's elements, the root's): what ZeRO gathers and reduce-scatters
    a unit at a time; the experts under --ep are units of their own (ZeRO-1 over their
    replicas, gradients whole: the planner's rows), not in a block's."""
    return _padded(_units(shapes, layout.ep), layout)


def _units(shapes, ep):
    """zero_units' (block, root) before padding to a multiple of ZeRO's ranks."""
    blocks, root = {}, 0
    for name, _, n in shapes:
        if name.startswith("transformer.h."):
            if ".mlp.experts." in name and ep > 1:
                continue
            key = int(name.split(".")[2])
            blocks[key] = blocks.get(key, 0) + n
        else:
            root += n
    return max(blocks.values(), default=0), root


def _padded(units, layout):
    """Each of `units` rounded up to a multiple of ZeRO's ranks (its flat shards' padding)."""
    ranks = layout.zero_ranks
    block, root = (math.ceil(n / ranks) * ranks for n in units)
    return block, root


def _matrices(shapes):
    """(elements on the rank, rows + columns) of each distinct matrix among `shapes`."""
    return tuple(sorted({(n, sum(shape)) for _, shape, n in shapes if len(shape) == 2}))


def half_matmul_copies(matrices, rows):
    """Elements of the float32 copies numpy's 16-bit matmul makes at once, at most, for a
    rank holding `matrices` (_matrices': wte the head's): the weight, `rows` rows of its
    input and of its output (the whole widths: an upper bound under tp)."""
    return max((n + rows * width for n, width in matrices), default=0)


@functools.lru_cache(maxsize=4096)
def _held(key, tp, pp, ep, stage, v):
    """What the buffers need of rank_shapes of the model `key` (config_key) on a rank of
    `stage` (tp, pp, ep: the layout's; nothing else of it decides which parameters a rank
    holds): (_distinct, _units, _matrices) of them. Cached: the layout search (search.py
    evaluate) bills every stage of thousands of layouts of one model, and walking the
    parameters for each made a 64-GPU search of a 7B model 12.4 s instead of 1.7."""
    shapes = rank_shapes(config_of_key(key), Layout(tp=tp, pp=pp, ep=ep), stage, v)
    return _distinct(shapes), _units(shapes, ep), _matrices(shapes)


def _rank_held(config, layout, stage, v):
    """_held of this layout's rank of `stage`."""
    return _held(config_key(config), layout.tp, layout.pp, layout.ep, stage, v)


def kept_buffers(config, layout, stage, training=True, v=1):
    """Bytes (as step_buffers) of the buffers kept for the run once the first step made
    them: the optimizer's per-shape scratch, ZeRO's shard scratch and comm work array.
    The rest of step_buffers' lives inside a step only (freed by its end: ZeRO-3's
    gathers by after_step), so a checkpoint's copy, held after a step or before the first
    (a --resume's load), is never beside it (memory_check.py rank_bill)."""
    return _kept(_rank_held(config, layout, stage, v), layout) if training else 0


def _kept(held, layout):
    """kept_buffers of a rank holding `held` (_held's)."""
    distinct, units, _ = held
    total = 4 * optimizer_scratch(distinct, layout)
    if layout.zero:
        g = state_bytes(layout.amp, layout.grad32)[1]
        block, root = _padded(units, layout)
        shard_scratch = (2 if layout.amp else 1) * (block + root) // layout.zero_ranks
        total += g * max(block, root) + 4 * shard_scratch
    return total


def step_buffers(config, layout, stage, micro, dropout=False, training=True, cpu=True, v=1):
    """Bytes (float32 arithmetic; the caller doubles them under --dtype float64) of the
    module docstring's buffers on a rank of pipeline `stage`, `micro` sequences a
    micro-batch, kept_buffers' among them; not `training` (--eval-only): ZeRO-3's gathered
    parameters and the 16-bit matmul's copies alone; `cpu`: the device is the CPU (numpy's
    16-bit matmul); v: chunks a stage (rank_shapes)."""
    held = _rank_held(config, layout, stage, v)
    total = _kept(held, layout) if training else 0
    if layout.amp and cpu:
        total += 4 * half_matmul_copies(held[2], micro * config.block_size // layout.cp)
    p, g, _ = state_bytes(layout.amp, layout.grad32)
    block, root = _padded(held[1], layout)
    if layout.zero >= 2 and training:
        inflight = max((MAX_INFLIGHT + 1) * block, root + MAX_INFLIGHT * block)
        total += g * (block + root + inflight)
    if layout.zero >= 3:
        total += p * (2 * block + root)
    if layout.recompute == "full" and layout.tp == 1 and training:
        one = minidist_activation_bytes(config, config.block_size // layout.cp, micro,
                                        layout.amp, dropout=dropout, tiled=layout.tiled)
        kept = minidist_activation_bytes(config, config.block_size // layout.cp, micro,
                                         layout.amp, ckpt=True, dropout=dropout,
                                         tiled=layout.tiled)
        total += int(one - kept) // config.n_layer
    elif layout.recompute == "full" and training:      # TP: Korthikanti's split block
        total += int(tp_block(config, layout, micro, dropout, "none") -
                     tp_block(config, layout, micro, dropout, "full"))
    return total


def tp_block(config, layout, micro, dropout, recompute):
    """Bytes one block keeps for `micro` sequences under the layout's tensor parallelism
    (activations.layer_activation_bytes): whole, the recomputed block of --ckpt-activations
    (--tp 2, 4 layers of 128: a live peak of 51.0 MiB was billed 21.1 without it)."""
    return layer_activation_bytes(config.block_size, micro, config.n_embd, config.n_head,
                                  layout.tp, layout.sp, recompute, 2 if layout.amp else 4,
                                  dropout, layout.tiled, layout.cp,
                                  layout.cp_attention == "ulysses", mlp_saved(config),
                                  config.kv_heads / config.n_head)
