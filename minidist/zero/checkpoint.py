"""Sharded checkpoints: each rank writes its own shard, a manifest ties them together, and any
world size and ZeRO stage reads them back (resharding).

    shard-00001-of-00004.safetensors   rank 1's flat[lo:hi) of every unit: "<unit>/param",
                                       "<unit>/exp_avg", "<unit>/exp_avg_sq" (+ "/master")
    state.json                         as in a plain checkpoint: step, config, dtype,
                                       optimizer type, groups and per-parameter step, RNG
                                       states, the run's arguments
    manifest.json, manifest.sha256     format, version, world_size N, "zero": stage, dp, amp,
                                       the flat layout (units: parameter names, shapes,
                                       offsets, numel, padding, shard size); each file's size
                                       and sha256 (a shard's with its "rank"); the digest

One folder of a --save directory, saved as every checkpoint is (minidist/strategy/saving.py):
`shard_plan` is what a rank writes (a host copy of its shards; rank 0 also state.json and
the manifest's "zero" section); every rank writes and fsyncs its shard into the temporary
folder world rank 0 made, and at commit world rank 0 writes the manifest of every rank's
sizes and sha256s last and renames the folder into place (a filesystem all ranks see, as on
one machine or a cluster's shared disk). Tensor parallelism puts one such folder per tp rank
into one checkpoint (`part`).

Loading goes by parameter name, whoever wrote the checkpoint: a `ShardReader` cuts a
parameter's pieces out of the old ranks' shards (memory-mapped: only those bytes are read), a
`PlainReader` takes it from a one-process checkpoint (both: minidist/strategy/readers.py). A
ZeRO run at any N and stage then copies its own flat[lo:hi) from those (`load_sharded`);
checkpoint.load gets whole arrays (`read_whole`) for one process, DDP, TP or PP. 4 ranks at
stage 3 -> 1 process, or -> 2 ranks at stage 1: the same parameters, bit for bit.

Verification is checkpoint.verify's, as for every checkpoint (the manifest by its digest,
state.json by its checksum); a shard's checksum is checked by the rank that reads it. Errors
are agreed on before anyone acts: the ranks all-gather their verdicts, and if any rank failed,
every rank raises the same CheckpointError naming the file and the rank that found it.
Nobody waits in a collective.
Tests: tests/scripts/zero_ckpt_check.py (run by tests/test_zero_checkpoint.py).
"""
import os

import numpy as np

from minidist import backend
from minidist.comm.checks import ranks_by_value, ranks_text
from minidist.nn.safetensors import SafetensorsError
from minidist.strategy import checkpoint, saving
from minidist.strategy import checkpoint_dirs as dirs
from minidist.strategy.checkpoint import CheckpointError
from minidist.strategy.readers import STATE_KEYS, DictReader, reader_for

SCALER_KEY = "loss_scaler"                           # as minidist/train/amp.py names it
_ERRORS = (CheckpointError, SafetensorsError, KeyError, ValueError, OSError)


def shard_name(rank, world):
    return f"shard-{rank:05d}-of-{world:05d}.safetensors"


# ---- save --------------------------------------------------------------------------------------

def shard_plan(model, optimizer, group, step, rng_states=None, extra=None, part=None,
               tp=None, writes=True):
    """What this rank writes of a sharded checkpoint (a saving.SavePlan; no collective): a
    host copy of its shards of `optimizer` (a ShardedOptimizer over `group`, the shard
    group), and on group rank 0 state.json and the manifest of the group's files. With
    `part` and `tp` (tensor parallelism: one ZeRO folder per tp rank) the files go to the
    subfolder `part` of the checkpoint, whose manifest's "tp" section is `tp` (this tp rank,
    the tp size, each split parameter's Split: what lets any layout read the pieces back,
    minidist/strategy/readers.py PartsReader). `writes` False (hybrid sharding: a replica of
    the first shard group's shards): nothing (the rank only commits with the others)."""
    optimizer.engine.wait_params()     # --overlap-param-gather: no gather still writing
    optimizer.settle()                 # --amp verdicts taken on the device: the step count
    if not writes:
        return saving.SavePlan()
    where = "" if part is None else part
    shards = {k: saving.host_copy(v) for k, v in optimizer.shard_arrays().items()}
    plan = saving.SavePlan(files=[saving.arrays_file(
        os.path.join(where, shard_name(group.rank, group.size)), shards, rank=group.rank)])
    if group.rank == 0:
        record, sections = _state(model, optimizer, step, rng_states, extra, tp)
        plan.files.append(saving.json_file(os.path.join(where, "state.json"), record))
        plan.manifests.append(saving.Manifest(where, optimizer.engine.group.size, sections))
    return plan


def save_sharded(directory, model, optimizer, group, step, rng_states=None, extra=None,
                 overwrite=False):
    """A sharded checkpoint of `optimizer`'s shards over `group`, written now (collective:
    every rank writes its shards, rank 0 the manifest and `latest`): what a script's own
    loop calls, as save_checkpoint in one process; load_sharded reads it back at any world
    size and stage. Refuses a `directory` whose latest checkpoint is past `step` unless
    `overwrite`. Returns the folder on rank 0 (None elsewhere)."""
    plan = shard_plan(model, optimizer, group, step, rng_states, extra)
    return saving.save_now(directory, step, plan, group, overwrite)


def _state(model, optimizer, step, rng_states, extra, tp):
    """state.json's record and the manifest's sections ("zero": the flat layout; "tp")."""
    amp, engine = optimizer.amp, optimizer.engine
    scalars = {n: {"step": optimizer.steps} for n, _ in model.named_parameters()}
    if amp is not None:
        scalars[SCALER_KEY] = amp.scaler.state_dict()
    dtype = str(engine.units[0].flat.dtype)
    meta = {"step": step, "config": model.config.to_dict(), "dtype": dtype,
            "optimizer": optimizer_type(optimizer), "rng": rng_states or {},
            "extra": extra or {}}
    record, _ = checkpoint.state_record(
        meta, {"groups": [{k: v for k, v in g.items() if k not in ("params", "names")}
                          for g in optimizer.param_groups], "state": scalars})
    keys = ["param"] + [k for k in STATE_KEYS if k in optimizer.state[engine.units[0].flat.name]]
    zero = {"stage": engine.stage, "dp": engine.group.size, "amp": amp is not None,
            "dtype": dtype, "keys": keys, "units": [u.flat.layout() for u in engine.units]}
    return record, {"zero": zero, **({"tp": tp} if tp is not None else {})}


def optimizer_type(optimizer):
    """The class a one-process run of the same flags uses (a checkpoint loads in either);
    a sharded optimizer that names none (one_process), its own class (walk 40: "None");
    no optimizer (a weights-only load), None: check_fits compares none."""
    if optimizer is None:
        return None
    if optimizer.amp is not None:
        return "MasterWeightOptimizer"
    return optimizer.one_process or type(optimizer).__name__


# ---- load into ZeRO: this rank's flat[lo:hi) of every unit, from any checkpoint ---------------

def load_sharded(directory, model, optimizer, group, keep=None, leading_groups=False,
                 world=None, engine=None):
    """Collective over `world` (default: `group`, the ranks `optimizer` is sharded over):
    this rank's shards (parameters, m, v, masters) from a checkpoint written at any world
    size and stage, or by one process (`directory`: a checkpoint folder, or a --save
    directory). Every rank checks what it reads; all of `world` agree before any shard
    changes (a failure anywhere raises on every rank; hybrid sharding: `world` holds every
    shard group). keep(name, array): what of each whole array the model holds (under TP:
    TpPiece, its tp shard), applied as it is read. leading_groups: `optimizer` holds the
    checkpoint's first parameter groups only (the experts' engine, minidist/ep/optim.py:
    matrices, biases only with config.bias). `optimizer` None: the parameters' shards alone,
    into `engine` (--eval-only: only the "param" key is read, no m, v or master). Returns the
    checkpoint's meta."""
    engine = engine if optimizer is None else optimizer.engine
    engine.wait_params()               # --overlap-param-gather: none still reading a shard
    err, new, record = None, None, None
    try:
        folder = dirs.resolve(directory)
        manifest = checkpoint.verify(folder, shard_checksums=False)   # shards: when read
        record = checkpoint.read_record(folder, manifest)
        meta = {**record, "optimizer": record["optimizer"]["type"]}
        checkpoint.check_fits(folder, meta, model.config, engine.units[0].flat.dtype,
                              optimizer_type(optimizer))
        if optimizer is not None:
            _check_groups(folder, record["optimizer"]["groups"], optimizer, leading_groups)
        reader = reader_for(folder, manifest, keep=keep)
        keys = _keys(engine, optimizer)
        new = {(u.flat.name, k): _cut(reader, u, k, optimizer) for u in engine.units
               for k in keys}
    except _ERRORS as e:
        err = str(e)
    _agree(directory, (world or group).all_gather_object(err))
    _assign(new, record["optimizer"]["groups"], record["optimizer"]["scalars"], optimizer,
            engine)
    return {**meta, "folder": folder}              # as checkpoint.load's meta


def _keys(engine, optimizer):
    """The arrays a load cuts for each unit: "param", and the optimizer's state arrays (none
    without an optimizer; no units: an expert engine on a pipeline stage holding no MoE
    block, --moe-every)."""
    held = optimizer.state[engine.units[0].flat.name] \
        if optimizer is not None and engine.units else {}
    return ["param"] + [k for k in STATE_KEYS if k in held]


def _agree(directory, verdicts):
    """Raise, on every rank alike, if any rank's verdict is an error: each message once, with
    the ranks that found it."""
    found = {err: ranks for err, ranks in ranks_by_value(verdicts).items() if err}
    if found:
        raise CheckpointError(f"cannot load {directory}: " + "; ".join(
            f"{ranks_text(r)}: {e}" for e, r in found.items()))


def _check_groups(directory, saved, optimizer, leading=False):
    n = len(optimizer.param_groups)
    if len(saved) < n or (len(saved) != n and not leading):
        raise CheckpointError(f"{directory}: {len(saved)} optimizer groups in the "
                              f"checkpoint, {len(optimizer.param_groups)} here")


def _cut(reader, u, key, optimizer):
    """This rank's flat[lo:hi) of unit u for `key`, on the host; zeros where the checkpoint
    holds no optimizer state yet (saved before the first step)."""
    like = u.param_shard if key == "param" else optimizer.state[u.flat.name][key]
    f = u.flat                                      # the layout (minidist/zero/flat.py)
    out = np.zeros(f.shard_size, like.dtype)
    for i, start, stop in f.pieces():
        whole = reader.get(f.names[i], key)
        if whole is None:
            continue
        if tuple(whole.shape) != f.shapes[i]:
            raise CheckpointError(f"{f.names[i]}: shape {tuple(whole.shape)} in the checkpoint, "
                                  f"{f.shapes[i]} here")
        at = f.offsets[i] - f.lo
        out[at + start:at + stop] = whole.reshape(-1)[start:stop]
    return out


def _assign(new, groups, scalars, optimizer, engine):
    """The shards `new` ((unit, key) -> host array) into `engine`'s units and `optimizer`
    (None: parameters alone), with the groups' hyperparameters and the scalars (name ->
    {"step"}, the loss scaler's); then the engine's after_step (stages 1, 2: all-gather, a
    collective)."""
    if optimizer is not None:
        steps = {s["step"] for n, s in scalars.items() if n != SCALER_KEY and "step" in s}
        optimizer.steps = max(steps, default=0)
        optimizer.set_hyperparameters([{k: v for k, v in g.items()
                                        if k not in ("params", "names")} for g in groups])
        if optimizer.amp is not None and SCALER_KEY in scalars:
            optimizer.amp.scaler.load_state_dict(scalars[SCALER_KEY])
    for (unit, key), host in new.items():
        u = next(u for u in engine.units if u.flat.name == unit)
        target = u.param_shard if key == "param" else optimizer.state[unit][key]
        target[...] = backend.to_device(host, backend.xp_of(u.param_shard))
    engine.after_step()                # stages 1, 2: all-gather; stage 3: drop stale copies


# ---- whole arrays by name: a pipeline's checkpoints (minidist/pp/checkpoint.py) ----------------

def gather_whole(optimizer, root=0):
    """(params, optimizer state_dict) of the model the engine shards as one process's AdamW
    (MasterWeightOptimizer under amp) holds them: host arrays by parameter name (per
    parameter "step", "exp_avg", "exp_avg_sq", "master"), on group rank `root`; (None, None)
    elsewhere. Collective over the engine's group, one unit and key at a time."""
    optimizer.settle()              # --amp verdicts taken on the device: the step count
    engine = optimizer.engine
    group = engine.group
    params, state = engine.full_state_dict(root), {}
    for u in engine.units:
        f = u.flat
        for key, shard in optimizer.state[f.name].items():
            full = backend.xp_of(shard).empty(f.padded, shard.dtype)
            group.all_gather(full, shard)
            if group.rank == root and optimizer.steps:      # no state before the first step
                for n, v in zip(f.names, f.views(full)):
                    entry = state.setdefault(n, {"step": optimizer.steps})
                    entry[key] = backend.to_host(v).copy()
    if group.rank != root:
        return None, None
    if optimizer.amp is not None:
        state[SCALER_KEY] = optimizer.amp.scaler.state_dict()
    groups = [{k: v for k, v in g.items() if k not in ("params", "names")}
              for g in optimizer.param_groups]
    return params, {"groups": groups, "state": state}


def load_whole(params, opt_sd, optimizer, engine=None):
    """This rank's shards of every unit cut from whole arrays by name: `params` and `opt_sd`
    (an optimizer state_dict, as checkpoint.load returns them: one process's, or a pipeline
    stage's part of it); `optimizer` None: `params` alone into `engine`'s shards (opt_sd
    unread). Collective over the engine's group (after_step's all-gather)."""
    engine = engine if optimizer is None else optimizer.engine
    engine.wait_params()               # --overlap-param-gather: none still reading a shard
    if optimizer is not None:
        _check_groups("the checkpoint", opt_sd["groups"], optimizer)
    reader = DictReader(params, {} if optimizer is None else opt_sd["state"])
    keys = _keys(engine, optimizer)
    new = {(u.flat.name, k): _cut(reader, u, k, optimizer) for u in engine.units for k in keys}
    scalars = {} if optimizer is None else {
        n: {k: v for k, v in s.items() if not hasattr(v, "shape")}
        for n, s in opt_sd["state"].items()}
    _assign(new, None if optimizer is None else opt_sd["groups"], scalars, optimizer, engine)
