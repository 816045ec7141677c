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
    `blocks` equal blocks (3 for c_attn's q|k|v, so each rank gets its heads' q, k and v), each
    block cut into tp equal chunks; rank r keeps chunk r of every block, in block order. A
    block that does not divide by tp is padded with zeros at its end (the vocabulary)."""

    def __init__(self, axis, size, blocks=1):
        self.axis, self.size, self.blocks = axis, size, blocks

    def chunk(self, tp):
        """Chunk length per block on each rank (padding included)."""
        return -(-(self.size // self.blocks) // tp)

    def padding(self, tp):
        return self.chunk(tp) * tp - self.size // self.blocks

    def shard(self, full, tp, rank):
        """Rank `rank`'s shard of the full array."""
        xp, n, c = xp_of(full), self.size // self.blocks, self.chunk(tp)
        a = xp.moveaxis(full, self.axis, 0)
        a = a.reshape((self.blocks, n) + a.shape[1:])                 # (blocks, n, ...)
        if self.padding(tp):
            zeros = xp.zeros((self.blocks, self.padding(tp)) + a.shape[2:], a.dtype)
            a = xp.concatenate([a, zeros], axis=1)                    # (blocks, tp * c, ...)
        part = a[:, rank * c:(rank + 1) * c].reshape((self.blocks * c,) + a.shape[2:])
        return xp.ascontiguousarray(xp.moveaxis(part, 0, self.axis))

    def unshard(self, shards):
        """The full array from every rank's shard (in rank order); padding dropped."""
        xp, n, c = xp_of(shards[0]), self.size // self.blocks, self.chunk(len(shards))
        parts = [xp.moveaxis(s, self.axis, 0) for s in shards]
        parts = [p.reshape((self.blocks, c) + p.shape[1:]) for p in parts]
        a = xp.concatenate(parts, axis=1)[:, :n]                      # (blocks, n, ...)
        a = a.reshape((self.size,) + a.shape[2:])
        return xp.ascontiguousarray(xp.moveaxis(a, 0, self.axis))

    def to_dict(self):
        """As a checkpoint's manifest records it."""
        return {"axis": self.axis, "size": self.size, "blocks": self.blocks}

    @classmethod
    def from_dict(cls, d):
        return cls(int(d["axis"]), int(d["size"]), int(d.get("blocks", 1)))

    def __repr__(self):
        return f"Split(axis={self.axis}, size={self.size}, blocks={self.blocks})"
