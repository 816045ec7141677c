"""Which blocks ZeRO-3 gathers in a step, micro-batch by micro-batch, for the step-time model
(minidist/train/cost.py): read off the stage's order of forwards and backwards, the
schedule's own (minidist/pp/simulate.py stage_order; without a pipeline, --grad-accum's
F0 B0 F1 B1 ...), as minidist/zero/stage3.py runs it:

- the stage's blocks share two gather buffers by index parity (under interleaving, over
  the stage's blocks of all its chunks, chunk after chunk); a unit still in its buffer is
  not gathered again;
- a forward of a chunk gathers each of its blocks in order, each prefetching the next
  block of the stage; a backward (ZB-H1: its B, the input gradient; a W gathers nothing)
  gathers them in reverse, each prefetching the one below;
- the root (each root unit has a buffer of its own) once a step, in the first forward;
  every buffer is freed after the optimizer's step, so each step starts empty.

Without a pipeline that is (N-1)/N (M Psi + R + (2M(L-2) + 2) b) a step (zero/README.md);
under 1F1B the order keeps more in the buffers than under GPipe (pp 2, 4 blocks a stage,
4 micro-batches: 22 block gathers a step on stage 0, GPipe 30; the runs' traces count the
same). Full recompute (--ckpt-activations) gathers nothing more: its forward in backward
runs on the block that backward's re-gather fetched (zero/README.md; a run's bytes are the
same with it and without, tests/test_plan_vs_runs.py).
Tests: tests/test_plan_time.py, tests/test_plan_vs_runs.py.
"""
import functools

from minidist.pp.schedule import chunk_layers
from minidist.pp.simulate import stage_order


def block_gathers(order, chunks):
    """((kind, blocks gathered), ...) for each F or B of `order` ((kind, micro-batch, chunk)
    events; I counts as B, W is left out), `chunks` the stage's block count of each chunk."""
    starts = [sum(chunks[:c]) for c in range(len(chunks))]
    total, held, out = sum(chunks), [None, None], []

    def gather(block):                  # 1 if block was not still in its buffer
        if held[block % 2] == block:
            return 0
        held[block % 2] = block
        return 1
    for kind, _, chunk in order:
        if kind == "W":
            continue
        blocks = range(starts[chunk], starts[chunk] + chunks[chunk])
        n = 0
        if kind == "F":
            for b in blocks:
                n += gather(b) + (gather(b + 1) if b + 1 < total else 0)
        else:
            for b in reversed(blocks):
                n += gather(b) + (gather(b - 1) if b > 0 else 0)
        out.append(("F" if kind == "F" else "B", n))
    return tuple(out)


@functools.lru_cache(maxsize=None)
def zero3_gathers(schedule, pp, stage, m, layers, v=1, n_layer=None):
    """((kind, blocks gathered), ...) for each forward and backward ZeRO-3 runs on `stage` in a
    step of m micro-batches (chunk-micro-batches under interleaving, v > 1: then n_layer,
    the model's blocks, cuts the chunks as training does); layers: the stage's blocks.
    Cached: the search asks for the same few many times."""
    if pp == 1:
        order = tuple(e for i in range(m) for e in (("F", i, 0), ("B", i, 0)))
    else:
        order = stage_order("1f1b" if schedule == "interleaved" else schedule, pp, stage, m,
                            v)
    chunks = [layers] if v == 1 else [len(r) for r in chunk_layers(n_layer, pp, v, stage)]
    return block_gathers(order, chunks)
