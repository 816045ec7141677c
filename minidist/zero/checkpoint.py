"""Sharded checkpoints: each rank writes its own shard, a manifest ties them together, and any
world size and ZeRO stage reads them back (resharding).

    DIR/shard-00001-of-00004.safetensors   rank 1's flat[lo:hi) of every unit: "<unit>/param",
                                           "<unit>/exp_avg", "<unit>/exp_avg_sq" (+ "/master")
    DIR/state.json                         as in a plain checkpoint: step, config, dtype,
                                           optimizer type, groups and per-parameter step, RNG
                                           states, the run's arguments
    DIR/manifest.json                      format, version, world_size N, "zero": stage, dp,
                                           amp, the flat layout (units: parameter names, shapes,
                                           offsets, numel, padding, shard size); each file's
                                           size and sha256 (a shard's with its "rank"); last

Saving is atomic as in minidist/train/checkpoint.py: rank 0 makes a temporary sibling
directory, every rank writes and fsyncs its shard there and sends rank 0 its size and sha256,
rank 0 writes state.json and the manifest last and renames the directory into place (a
filesystem all ranks see, as on one machine or a cluster's shared disk).

Loading goes by parameter name, whoever wrote the checkpoint: a `ShardReader` cuts a
parameter's pieces out of the old ranks' shards (memory-mapped: only those bytes are read), a
`PlainReader` takes it from a one-process checkpoint. A ZeRO run at any N and stage then copies
its own flat[lo:hi) from those (`load_sharded`); a one-process or DDP run gets whole arrays
(`load_whole`, called by checkpoint.load_checkpoint). 4 ranks at stage 3 -> 1 process, or ->
2 ranks at stage 1: the same parameters, bit for bit.

Errors are agreed on before anyone acts: each rank checks what it reads (files present with
the manifest's sizes, the checksums of the shards it opens, a config and shapes that fit the
model), the ranks all-gather their verdicts, and if any rank failed, every rank raises the
same CheckpointError naming the file and the rank that found it. Nobody waits in a collective.
Tests: tests/scripts/zero_ckpt_check.py (run by tests/test_zero.py).
"""
import json
import math
import os
import shutil

import numpy as np

from minidist import backend
from minidist.nn.safetensors import SafetensorsError, load_file, save_file
from minidist.train import checkpoint
from minidist.train.checkpoint import CheckpointError

STATE_KEYS = ("exp_avg", "exp_avg_sq", "master")     # optimizer arrays, besides "param"
SCALER_KEY = "loss_scaler"                           # as minidist/train/amp.py names it
_ERRORS = (CheckpointError, SafetensorsError, KeyError, ValueError, OSError)


def shard_name(rank, world):
    return f"shard-{rank:05d}-of-{world:05d}.safetensors"


# ---- save --------------------------------------------------------------------------------------

def save_sharded(directory, model, optimizer, group, step, rng_states=None, extra=None):
    """Collective over `group` (the dp group): write this rank's shards of `optimizer`
    (a ShardedAdamW) and, from rank 0, state.json and the manifest, atomically."""
    directory, comm = os.path.abspath(directory), group.comm
    tmp, err = None, None
    if group.rank == 0:
        try:
            tmp = checkpoint.make_temporary(directory)
        except (CheckpointError, OSError) as e:
            err = str(e)
    tmp, err = comm.bcast((tmp, err), root=0)
    if err:
        raise CheckpointError(err)
    name, entry, err = shard_name(group.rank, group.size), None, None
    try:
        path = os.path.join(tmp, name)
        save_file({k: backend.to_host(v) for k, v in optimizer.shard_arrays().items()}, path)
        checkpoint._fsync_file(path)
        entry = {"bytes": os.path.getsize(path), "sha256": checkpoint._sha256(path),
                 "rank": group.rank}
    except OSError as e:
        err = f"rank {group.rank}: {e}"
    gathered = comm.gather((name, entry, err), root=0)
    if group.rank == 0:
        err = "; ".join(e for _, _, e in gathered if e) or None
        if err is None:
            try:
                files = {n: info for n, info, _ in gathered}
                _write_state(tmp, files, model, optimizer, step, rng_states or {}, extra or {})
                checkpoint.commit(tmp, directory)
            except OSError as e:
                err = str(e)
        shutil.rmtree(tmp, ignore_errors=True)
    err = comm.bcast(err, root=0)
    if err:
        raise CheckpointError(f"saving {directory} failed: {err}")


def _write_state(tmp, files, model, optimizer, step, rng_states, extra):
    amp, engine = optimizer.amp, optimizer.engine
    scalars = {n: {"step": optimizer.steps} for n, _ in model.named_parameters()}
    if amp is not None:
        scalars[SCALER_KEY] = amp.scaler.state_dict()
    dtype = str(engine.units[0].dtype)
    state = {"step": int(step), "config": model.config.to_dict(), "dtype": dtype,
             "optimizer": {"type": "MasterWeightOptimizer" if amp else "AdamW",
                           "groups": [dict(g) for g in optimizer.param_groups],
                           "scalars": scalars},
             "rng": rng_states, "extra": extra}
    with open(os.path.join(tmp, "state.json"), "w") as f:
        json.dump(state, f, indent=1)
    checkpoint._fsync_file(os.path.join(tmp, "state.json"))
    files["state.json"] = {"bytes": os.path.getsize(os.path.join(tmp, "state.json")),
                           "sha256": checkpoint._sha256(os.path.join(tmp, "state.json"))}
    keys = ["param"] + [k for k in STATE_KEYS if k in optimizer.state[engine.units[0].name]]
    zero = {"stage": engine.stage, "dp": engine.group.size, "amp": amp is not None,
            "dtype": dtype, "keys": keys, "units": [u.layout() for u in engine.units]}
    manifest = {"format": checkpoint.FORMAT, "version": checkpoint.VERSION,
                "world_size": engine.group.size, "step": int(step), "zero": zero,
                "files": files}
    with open(os.path.join(tmp, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


# ---- read by parameter name --------------------------------------------------------------------

class PlainReader:
    """Whole arrays by name from a one-process checkpoint (model / optimizer.safetensors)."""

    def __init__(self, directory, manifest):
        for name in ("model.safetensors", "optimizer.safetensors"):
            checkpoint.verify_file(directory, name, manifest["files"][name])
        self.params, _ = load_file(os.path.join(directory, "model.safetensors"))
        self.opt, _ = load_file(os.path.join(directory, "optimizer.safetensors"))

    def get(self, name, key="param"):
        """The whole array, or None if the checkpoint has none (optimizer state at step 0)."""
        if key == "param":
            if name not in self.params:
                raise CheckpointError(f"the checkpoint has no parameter {name}")
            return self.params[name]
        return self.opt.get(f"{name}/{key}")


class ShardReader:
    """Whole arrays by name, assembled from the pieces in the old ranks' shards."""

    def __init__(self, directory, manifest, verified=False):
        zero = manifest["zero"]
        self.directory, self.manifest, self.verified = directory, manifest, verified
        self.files = {info["rank"]: n for n, info in manifest["files"].items() if "rank" in info}
        self.where = {p["name"]: (u, p) for u in zero["units"] for p in u["params"]}
        self.keys, self._open = set(zero["keys"]), {}

    def _shard(self, rank):
        if rank not in self._open:
            if rank not in self.files:
                raise CheckpointError(f"{self.directory}: manifest.json lists no shard for "
                                      f"rank {rank}")
            name = self.files[rank]
            if not self.verified:
                checkpoint.verify_file(self.directory, name, self.manifest["files"][name])
            self._open[rank], _ = load_file(os.path.join(self.directory, name))
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
            if k not in shard or shard[k].size != S:
                raise CheckpointError(f"{os.path.join(self.directory, self.files[q])}: no "
                                      f"{k} of {S} elements (a shard of another layout?)")
            pieces.append(shard[k][max(off, q * S) - q * S:min(off + numel, (q + 1) * S) - q * S])
        return np.concatenate(pieces).reshape(p["shape"]) if pieces else np.zeros(p["shape"])


def reader_for(directory, manifest, verified=False):
    return (ShardReader(directory, manifest, verified) if "zero" in manifest
            else PlainReader(directory, manifest))


def _read_state(directory):
    with open(os.path.join(directory, "state.json")) as f:
        return json.load(f)


# ---- load into one process (or DDP): whole arrays ---------------------------------------------

def load_whole(directory, manifest, model, optimizer=None):
    """A sharded checkpoint into a whole model and a per-parameter optimizer (called by
    checkpoint.load_checkpoint, which has verified every file). Returns state.json."""
    state = _read_state(directory)
    checkpoint._check_config(directory, state, model)
    reader = ShardReader(directory, manifest, verified=True)
    try:
        params = {n: reader.get(n) for n, _ in model.named_parameters()}
        model.load_state_dict(params)
        if optimizer is not None:
            arrays = {f"{n}/{k}": reader.get(n, k) for n in params for k in STATE_KEYS}
            checkpoint._load_optimizer(directory, state, optimizer,
                                       {k: a for k, a in arrays.items() if a is not None})
    except (KeyError, ValueError, SafetensorsError) as e:
        raise CheckpointError(f"checkpoint {directory} does not fit this run: {e}") from None
    return state


# ---- load into ZeRO: this rank's flat[lo:hi) of every unit, from any checkpoint ---------------

def load_sharded(directory, model, optimizer, group):
    """Collective over `group`: this rank's shards (parameters, m, v, masters) from a checkpoint
    written at any world size and stage, or by one process. Every rank checks what it reads;
    all agree before any shard changes (a failure anywhere raises on every rank)."""
    err, new = None, None
    try:
        manifest = checkpoint.verify_checkpoint(directory, checksums=False)
        state = _read_state(directory)
        checkpoint._check_config(directory, state, model)
        _check_optimizer(directory, state, optimizer)
        reader = reader_for(directory, manifest)
        units = optimizer.engine.units
        keys = ["param"] + [k for k in STATE_KEYS if k in optimizer.state[units[0].name]]
        new = {(u.name, k): _cut(reader, u, k, optimizer) for u in units for k in keys}
    except _ERRORS as e:
        err = str(e)
    _agree(directory, group.comm.allgather(err))
    _assign(new, state, optimizer)
    return state


def _agree(directory, verdicts):
    """Raise, on every rank alike, if any rank's verdict is an error: each message once, with
    the ranks that found it."""
    found = {}
    for rank, err in enumerate(verdicts):
        if err:
            found.setdefault(err, []).append(str(rank))
    if found:
        raise CheckpointError(f"cannot load {directory}: " + "; ".join(
            f"rank{'s' * (len(r) > 1)} {', '.join(r)}: {e}" for e, r in found.items()))


def _check_optimizer(directory, state, optimizer):
    want = "MasterWeightOptimizer" if optimizer.amp is not None else "AdamW"
    saved = state["optimizer"]
    if saved["type"] != want:
        raise CheckpointError(f"{directory}: optimizer {saved['type']} in the checkpoint, "
                              f"{want} here (--amp must match)")
    if len(saved["groups"]) != len(optimizer.param_groups):
        raise CheckpointError(f"{directory}: {len(saved['groups'])} optimizer groups in the "
                              f"checkpoint, {len(optimizer.param_groups)} here")


def _cut(reader, u, key, optimizer):
    """This rank's flat[lo:hi) of unit u for `key`, on the host; zeros where the checkpoint
    holds no optimizer state yet (saved before the first step)."""
    like = u.param_shard if key == "param" else optimizer.state[u.name][key]
    out = np.zeros(u.shard_size, like.dtype)
    for i, start, stop in u.pieces():
        whole = reader.get(u.names[i], key)
        if whole is None:
            continue
        if tuple(whole.shape) != u.shapes[i]:
            raise CheckpointError(f"{u.names[i]}: shape {tuple(whole.shape)} in the checkpoint, "
                                  f"{u.shapes[i]} here")
        at = u.offsets[i] - u.lo
        out[at + start:at + stop] = whole.reshape(-1)[start:stop]
    return out


def _assign(new, state, optimizer):
    saved = state["optimizer"]
    steps = {s["step"] for n, s in saved["scalars"].items() if n != SCALER_KEY and "step" in s}
    optimizer.steps = max(steps, default=0)
    for group, g in zip(optimizer.param_groups, saved["groups"]):
        group.update({k: v for k, v in g.items() if k not in ("params", "names")})
        group["betas"] = tuple(group["betas"])
    optimizer.weight_decay = max(g["weight_decay"] for g in optimizer.param_groups)
    if optimizer.amp is not None and SCALER_KEY in saved["scalars"]:
        optimizer.amp.scaler.load_state_dict(saved["scalars"][SCALER_KEY])
    xp = backend.xp_of(optimizer.engine.units[0].param_shard)
    for (unit, key), host in new.items():
        u = next(u for u in optimizer.engine.units if u.name == unit)
        target = u.param_shard if key == "param" else optimizer.state[unit][key]
        target[...] = backend.to_device(host, xp)
    optimizer.engine.after_step()      # stages 1, 2: all-gather; stage 3: drop stale copies
