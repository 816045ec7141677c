"""How a tensor-parallel parameter is cut into per-rank shards and glued back (`Split`), in
one place for the layers that cut it (minidist/tp/layers.py) and for the checkpoint readers
that glue a TP x ZeRO checkpoint's pieces back together (minidist/strategy/readers.py). Such
a checkpoint records each split parameter's Split (`to_dict`), so any layout, or one process,
reads it back without knowing how the model was cut.
Tests: tests/test_tensor_parallel.py.
"""
from minidist.backend import xp_of


class Split:
    """A parameter split over tp ranks along `axis` (full length `size`): the axis is seen as
    blocks (`blocks` equal ones, or a tuple of their lengths: c_attn's q|k|v, of nh, nkv,
    nkv heads under grouped-query attention; SwiGLU's [gate|up]), each block cut into tp
    equal chunks; rank r keeps chunk r of every block, in block order, so each rank gets its
    heads' q, k and v. A block that does not divide by tp is padded with zeros at its end
    (the vocabulary)."""

    def __init__(self, axis, size, blocks=1):
        self.axis, self.size = axis, size
        self.parts = tuple(blocks) if isinstance(blocks, (tuple, list)) else \
            (size // blocks,) * blocks
        if sum(self.parts) != size:
            raise ValueError(f"Split: blocks {self.parts} do not add up to {size}")
        equal = len(set(self.parts)) == 1
        self.blocks = len(self.parts) if equal else self.parts

    def chunks(self, tp):
        """Each block's chunk length on every rank (padding included)."""
        return [-(-n // tp) for n in self.parts]

    def chunk(self, tp):
        """The chunk length of one block (all blocks being equal)."""
        return self.chunks(tp)[0]

    def local(self, tp):
        """The length along `axis` of each rank's shard: its chunk of every block."""
        return sum(self.chunks(tp))

    def padding(self, tp):
        """Zeros added to a (one-block) split's end, so it divides by tp."""
        return self.chunk(tp) * tp - self.parts[0]

    def shard(self, full, tp, rank):
        """Rank `rank`'s shard of the full array."""
        xp, a, lo, out = xp_of(full), xp_of(full).moveaxis(full, self.axis, 0), 0, []
        for n, c in zip(self.parts, self.chunks(tp)):
            block = a[lo:lo + n]
            if c * tp > n:                                            # padded with zeros
                block = xp.concatenate([block, xp.zeros((c * tp - n,) + a.shape[1:], a.dtype)])
            out.append(block[rank * c:(rank + 1) * c])
            lo += n
        part = xp.concatenate(out) if len(out) > 1 else out[0]
        return xp.ascontiguousarray(xp.moveaxis(part, 0, self.axis))

    def unshard(self, shards):
        """The full array from every rank's shard (in rank order); padding dropped."""
        xp = xp_of(shards[0])
        parts = [xp.moveaxis(s, self.axis, 0) for s in shards]
        blocks, lo = [], 0
        for n, c in zip(self.parts, self.chunks(len(shards))):
            blocks.append(xp.concatenate([p[lo:lo + c] for p in parts])[:n])
            lo += c
        a = xp.concatenate(blocks) if len(blocks) > 1 else blocks[0]
        return xp.ascontiguousarray(xp.moveaxis(a, 0, self.axis))

    def to_dict(self):
        """As a checkpoint's manifest records it (blocks: a count, or unequal lengths)."""
        blocks = self.blocks if isinstance(self.blocks, int) else list(self.blocks)
        return {"axis": self.axis, "size": self.size, "blocks": blocks}

    @classmethod
    def from_dict(cls, d):
        blocks = d.get("blocks", 1)
        return cls(int(d["axis"]), int(d["size"]),
                   tuple(blocks) if isinstance(blocks, list) else int(blocks))

    def __repr__(self):
        return f"Split(axis={self.axis}, size={self.size}, blocks={self.blocks})"
