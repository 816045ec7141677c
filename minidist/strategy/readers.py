"""Reading a checkpoint's arrays by parameter name, whoever wrote it:

    PlainReader    a one-process run: model.safetensors and optimizer.safetensors, each
                   array made when asked for (memory-mapped)
    ShardReader    a ZeRO run at any world size and stage: each parameter cut out of the old
                   ranks' flat shards (memory-mapped, so only those bytes are read, and a
                   bfloat16 one widened)
    PartsReader    a TP x ZeRO run: one ShardReader per tp part, each split parameter's pieces
                   glued by the Split the parts record (minidist/strategy/split.py)
    DictReader     dicts already in memory: a pipeline stage's part of a one-process
                   checkpoint, which ZeRO across pipelines cuts its shards from

Each reader makes one parameter's arrays at a time (get(name, key)), so --init-from under
ZeRO-3 reads a unit at a time (minidist/train/gather.py CheckpointWeights).
The format of the shards: minidist/zero/checkpoint.py, which writes them; this module sits
below the strategy packages so that checkpoint.load (one process, DDP, TP, PP) reads ZeRO's
and TP x ZeRO's checkpoints too without importing minidist/zero/ or minidist/tp/.
Tests: tests/scripts/zero_ckpt_check.py (run by tests/test_zero_checkpoint.py),
tests/test_tensor_parallel.py and tests/test_layout_sweep.py (TP x ZeRO's parts).
"""
import hashlib
import math
import os

import numpy as np

from minidist.nn.safetensors import SafetensorsFile
from minidist.strategy.checkpoint_dirs import CheckpointError
from minidist.strategy.split import Split

STATE_KEYS = ("exp_avg", "exp_avg_sq", "master")     # optimizer arrays, besides "param"


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def verify_file(folder, name, info, checksum=True):
    """One file of a checkpoint against its manifest entry {"bytes", "sha256"[, "rank"]}."""
    fpath = os.path.join(folder, name)
    what = f"rank {info['rank']}'s shard " if "rank" in info else ""
    if not os.path.isfile(fpath):
        raise CheckpointError(f"corrupt checkpoint: {what}{fpath} is missing")
    if os.path.getsize(fpath) != info["bytes"] or (
            checksum and sha256_file(fpath) != info["sha256"]):
        raise CheckpointError(f"corrupt checkpoint: {what}{fpath} does not match the checksum "
                              "in manifest.json (truncated, modified, or from another save)")



# ---- read by parameter name ---------------------------------------------------------------------

class PlainReader:
    """Whole arrays by name from a one-process checkpoint (model / optimizer.safetensors),
    each made as it is asked for (memory-mapped; a bfloat16 one widened alone)."""

    def __init__(self, directory):
        self.params = SafetensorsFile(os.path.join(directory, "model.safetensors"))
        self.opt = SafetensorsFile(os.path.join(directory, "optimizer.safetensors"))
        self.names = self.params.names

    def get(self, name, key="param"):
        """The whole array, or None if the checkpoint has none (optimizer state at step 0)."""
        if key == "param":
            if name not in self.params.header:
                raise CheckpointError(f"the checkpoint has no parameter {name}")
            return self.params.tensor(name)
        k = f"{name}/{key}"
        return self.opt.tensor(k) if k in self.opt.header else None


class DictReader:
    """Whole arrays by name from dicts in memory: `params` (name -> array) and `state` (name
    -> {key: array}, an optimizer state_dict's "state"), e.g. a pipeline stage's part of a
    one-process checkpoint that ZeRO cuts its shards from."""

    def __init__(self, params, state):
        self.params, self.state = params, state

    def get(self, name, key="param"):
        if key == "param":
            if name not in self.params:
                raise CheckpointError(f"the checkpoint has no parameter {name}")
            return self.params[name]
        return self.state.get(name, {}).get(key)


class ShardReader:
    """Whole arrays by name, assembled from the pieces in the old ranks' shards."""

    def __init__(self, directory, manifest, verified=False):
        zero = manifest["zero"]
        self.directory, self.manifest, self.verified = directory, manifest, verified
        _check_tiling(directory, zero["units"])
        self.files = {info["rank"]: n for n, info in manifest["files"].items() if "rank" in info}
        self.where = {p["name"]: (u, p) for u in zero["units"] for p in u["params"]}
        self.keys, self._open = set(zero["keys"]), {}
        self.names = list(self.where)

    def _shard(self, rank):
        if rank not in self._open:
            if rank not in self.files:
                raise CheckpointError(f"{self.directory}: manifest.json lists no shard for "
                                      f"rank {rank}")
            name = self.files[rank]
            if not self.verified:
                verify_file(self.directory, name, self.manifest["files"][name])
            self._open[rank] = SafetensorsFile(os.path.join(self.directory, name))
        return self._open[rank]

    def get(self, name, key="param"):
        if name not in self.where:
            raise CheckpointError(f"{self.directory}: the checkpoint has no parameter {name}")
        if key not in self.keys:
            return None
        unit, p = self.where[name]
        S, off, numel = unit["shard_size"], p["offset"], math.prod(p["shape"])
        pieces = []
        for q in range(off // S, (off + numel - 1) // S + 1):      # old ranks holding a piece
            shard, k = self._shard(q), f"{unit['name']}/{key}"
            if k not in shard.header or shard.header[k]["shape"] != [S]:
                raise CheckpointError(f"{os.path.join(self.directory, self.files[q])}: no "
                                      f"{k} of {S} elements (a shard of another layout?)")
            pieces.append(shard.tensor(k, max(off, q * S) - q * S,     # (only these read)
                                       min(off + numel, (q + 1) * S) - q * S))
        return np.concatenate(pieces).reshape(p["shape"]) if pieces else np.zeros(p["shape"])


def _check_tiling(directory, units):
    """Each unit's parameters lie apart in its flat buffer (offsets rising, none overlapping
    the one before): first-use walk 37 moved an offset onto its neighbour's elements and
    rehashed the manifest, and the resume read wrong weights without a word."""
    for unit in units:
        end, before = 0, None
        for p in sorted(unit["params"], key=lambda p: p["offset"]):
            if p["offset"] < end:
                raise CheckpointError(
                    f"corrupt checkpoint: {directory}/manifest.json: {p['name']} (offset "
                    f"{p['offset']}) overlaps {before} in unit {unit['name']} (edited?)")
            end, before = p["offset"] + math.prod(p["shape"]), p["name"]


class PartsReader:
    """Whole arrays by name from a TP x ZeRO checkpoint (`manifest`: checkpoint.verify_parts'):
    one ZeRO folder per tp rank, each read by a ShardReader; a split parameter's pieces (its
    parameter, m, v, master) glued by the Split the parts record, a replicated one (the same
    on every tp rank) taken from tp rank 0's. Any layout, or one process, reads it so."""

    def __init__(self, manifest, verified=False):
        self.parts = [ShardReader(folder, m, verified)
                      for folder, m in zip(manifest["parts"], manifest["manifests"])]
        self.splits = {n: Split.from_dict(d) for n, d in manifest["tp"]["splits"].items()}
        self.names = self.parts[0].names

    def get(self, name, key="param"):
        if name not in self.splits:
            return self.parts[0].get(name, key)
        pieces = [part.get(name, key) for part in self.parts]
        return None if pieces[0] is None else self.splits[name].unshard(pieces)


class PieceReader:
    """Another reader's arrays by name, each passed through keep(name, array) as it is read:
    with TpPiece (minidist/tp/state.py) this rank's tp shard of it, so ZeRO under TP cuts
    its flat shards from any checkpoint holding one whole array at a time."""

    def __init__(self, reader, keep):
        self.reader, self.keep = reader, keep
        self.names = getattr(reader, "names", None)

    def get(self, name, key="param"):
        a = self.reader.get(name, key)
        return None if a is None else self.keep(name, a)


def reader_for(directory, manifest, verified=False, keep=None):
    """The reader of a verified checkpoint folder's arrays by name; keep: PieceReader's."""
    if "parts" in manifest:
        reader = PartsReader(manifest, verified)
    elif "zero" in manifest:
        reader = ShardReader(directory, manifest, verified)
    else:
        reader = PlainReader(directory)
    return reader if keep is None else PieceReader(reader, keep)


# ---- whole arrays, for checkpoint.load (one process, DDP, TP, PP) -------------------------------

def read_whole(directory, manifest, keep=None, only=None, keys=STATE_KEYS):
    """(params, optimizer arrays "<name>/<key>", every parameter name saved) as whole arrays
    from the shards (ZeRO's, or a TP x ZeRO checkpoint's parts) of a folder checkpoint.verify
    has checked; keep(name, array): what of each whole array to hold (checkpoint.load's), one
    array at a time; only: the parameter names to read (None: all), the others never
    assembled; keys: the optimizer arrays to read (the others never assembled)."""
    reader = reader_for(directory, manifest, verified=True)
    keep = keep or (lambda name, a: a)
    names = [n for n in reader.names if only is None or n in only]
    params = {n: keep(n, reader.get(n)) for n in names}
    arrays = {}
    for n in params:
        for k in keys:
            a = reader.get(n, k)
            if a is not None:
                arrays[f"{n}/{k}"] = keep(n, a)
    return params, arrays, set(reader.names)
