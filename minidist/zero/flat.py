"""Flat parameter units: the memory layout every ZeRO stage shards.

A unit is a few parameters laid end to end in ONE flat 1-D buffer, padded at the end with
zeros to a multiple of N (the data-parallel group size), so that it cuts into N equal shards
of S = padded / N elements, rank r owning flat[r*S : (r+1)*S]:

    unit "h.0": ln_1.weight (3) and ln_1.bias (3), numel 6, N = 4 -> padded 8, S = 2

        flat    w0 w1 w2 b0 b1 b2 .. ..          .. = padding (zeros)
        offset   0  1  2  3  4  5  6  7
        owner   [rank 0][rank 1][rank 2][rank 3]
        rank 1's shard = flat[2:4] = (w2, b0): a shard may cut through a parameter

The gradient buffers are in the parameters' grad_dtype (`FlatUnit.grad_dtype`: float32 under
--amp --grad-dtype float32, so they accumulate and are reduce-scattered in float32).
The padding is part of every flat buffer (parameters, gradients, Adam's m and v) and stays
zero: its gradient is zero, so AdamW moves it by 0 (m = v = 0, m / (sqrt(v) + eps) = 0).
Equal shards let reduce-scatter and all-gather use equal chunks (the comm layer's
`chunk_bounds` of a padded length gives exactly [r*S, (r+1)*S)).

GPT's units (`gpt_units`) are the root -- every parameter outside the blocks: wte (tied to
the output head), wpe, ln_f -- and one unit per transformer block, the granularity FSDP wraps.
A pipeline stage's tied wte (the first and the last stage each hold a copy) is a unit of its
own, so both copies are cut alike and their gradient shards can be summed shard by shard.
The blocks have identical shapes, so at stage 3 they can share gather buffers.
A freed parameter (stage 3, not gathered) points at a `placeholder` (minidist/nn/module.py: a
model built on placeholders uses them too): a zero-strided NaN array of the right shape and
dtype, one element of memory shared by all of them; a forward that forgot
to gather would give NaN, never plausible numbers. On numpy it is read-only, so a stray write
raises, and the CPU tests, which run every code path the GPU does, would find the writer. CuPy
has no read-only arrays (its flags are the contiguity ones and OWNDATA): there a write would
succeed and un-NaN every placeholder of that dtype, which is why no write must slip past the
CPU tests.
Tests: tests/test_zero.py (layout, padding, shard ranges) and tests/scripts/zero_check.py.
"""
from minidist.backend import xp_of
from minidist.nn.module import placeholder
from minidist.optim.optimizer import wants_decay

class FlatUnit:
    """The layout of `named_params` in one flat buffer padded to a multiple of `world`, and
    this rank's shard bounds [lo, hi). Holds no data: the engine keeps its arrays for the
    unit in a ZeroUnit (minidist/zero/zero.py); the parameters' .data point where it says."""

    def __init__(self, name, named_params, world, rank, module=None):
        self.name, self.module, self.world, self.rank = name, module, world, rank
        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        self.shapes = [tuple(p.shape) for p in self.params]
        self.sizes = [int(p.size) for p in self.params]
        self.offsets = [sum(self.sizes[:i]) for i in range(len(self.sizes))]
        self.decay = [wants_decay(p) for p in self.params]
        self.numel = sum(self.sizes)
        self.padded = -(-self.numel // world) * world       # round up to a multiple of N
        self.padding = self.padded - self.numel              # zeros at the end
        self.shard_size = self.padded // world               # S
        self.lo, self.hi = rank * self.shard_size, (rank + 1) * self.shard_size
        self.dtype = self.params[0].dtype
        self.grad_dtype = self.params[0].grad_dtype      # the gradient buffers' (--grad-dtype)

    def __repr__(self):
        return (f"FlatUnit({self.name!r}, {len(self.params)} params, numel {self.numel} + "
                f"padding {self.padding} = {self.world} x {self.shard_size})")

    def flatten(self, arrays=None, dtype=None):
        """A new padded flat buffer holding `arrays` (default: the parameters' values) end to
        end; None entries and the padding are zeros."""
        arrays = [p.data for p in self.params] if arrays is None else arrays
        like = next(a for a in arrays if a is not None)
        flat = xp_of(like).zeros(self.padded, dtype=dtype or like.dtype)
        for a, off, n in zip(arrays, self.offsets, self.sizes):
            if a is not None:
                flat[off:off + n] = a.reshape(-1)
        return flat

    def shard_of(self, arrays, dtype):
        """This rank's [lo, hi) of the padded flat buffer `arrays` (one per parameter) would
        make, without making it (a new S-element array of `dtype`; the padding zeros)."""
        shard = xp_of(arrays[0]).zeros(self.shard_size, dtype=dtype)
        for i, start, stop in self.pieces():
            at = self.offsets[i] + start - self.lo
            shard[at:at + stop - start] = arrays[i].reshape(-1)[start:stop]
        return shard

    def views(self, flat):
        """Each parameter's view (its shape) into a padded flat buffer."""
        return [flat[off:off + n].reshape(shape)
                for off, n, shape in zip(self.offsets, self.sizes, self.shapes)]

    def point_params_at(self, flat):
        """Make every parameter's .data its view into `flat` (no copy)."""
        for p, view in zip(self.params, self.views(flat)):
            p.data = view

    def release_params(self):
        """Every parameter's .data becomes a placeholder (stage 3: only shards are kept)."""
        for p, shape in zip(self.params, self.shapes):
            p.data = placeholder(shape, p.data)

    def pieces(self, lo=None, hi=None):
        """For each parameter overlapping flat[lo:hi) (default: this rank's shard):
        (index, start, stop) with [start, stop) in the parameter's own flat numbering; the
        piece sits at flat[offset + start : offset + stop]."""
        lo, hi = (self.lo, self.hi) if lo is None else (lo, hi)
        for i, (off, n) in enumerate(zip(self.offsets, self.sizes)):
            start, stop = max(lo, off), min(hi, off + n)
            if start < stop:
                yield i, start - off, stop - off

    def shard_pieces(self):
        """(index, a, b): each parameter's piece of this rank's shard, [a, b) in shard
        coordinates (0..S)."""
        for i, s, e in self.pieces():
            yield i, self.offsets[i] + s - self.lo, self.offsets[i] + e - self.lo

    def decay_ranges(self):
        """[(a, b)] in shard coordinates (0..S) of the elements that get weight decay."""
        return [(a, b) for i, a, b in self.shard_pieces() if self.decay[i]]

    def update_ranges(self):
        """(decayed, plain): this rank's shard [0, S) cut into runs of elements that get weight
        decay and runs that do not (the padding among them), adjacent pieces merged, empty
        runs left out: together they cover the shard once. ZeRO's multi-tensor update runs
        each list as one table (minidist/zero/optim.py)."""
        decayed, plain, at = [], [], 0
        for a, b in self.decay_ranges():
            if a > at:
                plain.append((at, a))
            if decayed and decayed[-1][1] == a:
                decayed[-1] = (decayed[-1][0], b)
            else:
                decayed.append((a, b))
            at = b
        if at < self.shard_size:
            plain.append((at, self.shard_size))
        return decayed, plain

    def layout(self):
        """The unit as JSON (checkpoint manifests)."""
        return {"name": self.name, "numel": self.numel, "padded": self.padded,
                "shard_size": self.shard_size,
                "params": [{"name": n, "shape": list(s), "offset": o}
                           for n, s, o in zip(self.names, self.shapes, self.offsets)]}


def gpt_units(model, world, rank, apart=()):
    """[root unit(s), block 0, ..., block L-1] for a GPT-shaped model: blocks are
    `model.transformer.h` (each its own unit, `module` set), the root everything else; each
    parameter in `apart` (a pipeline stage's tied wte: GPT.tied_copies) a root unit of its
    own, named by the parameter, so every rank holding a copy cuts it into the same shards.
    Experts under expert parallelism (`expert_parallel`, minidist/ep/) stay out: they differ
    from rank to rank, and the ep strategy updates them."""
    named = [(n, p) for n, p in model.named_parameters() if not p.expert_parallel]
    blocks = list(getattr(getattr(model, "transformer", None), "h", []))
    owner = {id(p): i for i, b in enumerate(blocks) for p in b.parameters()}
    alone = {id(p) for p in apart}
    root = [(n, p) for n, p in named if id(p) not in owner and id(p) not in alone]
    units = [FlatUnit("root", root, world, rank)] if root else []
    units += [FlatUnit(n, [(n, p)], world, rank) for n, p in named if id(p) in alone]
    for i, block in enumerate(blocks):
        mine = [(n, p) for n, p in named if owner.get(id(p)) == i]
        units.append(FlatUnit(f"h.{i}", mine, world, rank, module=block))
    return units
