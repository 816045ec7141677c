"""Checkpoints: everything a run needs to continue bit-identically, written atomically.

    DIR/model.safetensors      parameters by GPT-2 name, dtype as trained
    DIR/optimizer.safetensors  optimizer state arrays as "<param name>/<key>" (exp_avg, ...)
    DIR/state.json             step, model config and dtype, optimizer groups and per-
                               parameter step counts, RNG states, the run's arguments
    DIR/manifest.json          format, version, world size, and for each file its size and
                               sha256; written last

Atomic: the files are written into a temporary sibling directory, fsynced, and the directory
is renamed into place (an existing checkpoint is moved aside first and removed after), so a
crash leaves the old checkpoint or the new one, never a mix. A directory without
manifest.json is not a checkpoint; a size or checksum that disagrees with the manifest is
corruption; a config that differs from the model's is a mismatch: each raises
CheckpointError naming the file or field. Data position needs no file: batches are a pure
function of (seed, step). Extensible: ZeRO adds per-rank shard files to the manifest's
"files" (with a "rank"), raises "world_size" and adds "zero" (the flat layout);
load_checkpoint reads such a checkpoint too (minidist/zero/checkpoint.py).
Tests: tests/test_checkpoint.py.
"""
import hashlib
import json
import os
import shutil
import tempfile

from minidist import backend
from minidist.nn.safetensors import SafetensorsError, load_file, save_file

FORMAT, VERSION = "minidist-checkpoint", 1


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete, corrupt or does not fit the model."""


def _sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_file(path):
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def save_checkpoint(directory, model, optimizer, step, rng_states=None, extra=None):
    """Write model, optimizer, `step` (steps done), RNG states (name -> JSON-able state) and
    `extra` (JSON-able, e.g. the run's arguments) to `directory`, atomically."""
    directory = os.path.abspath(directory)
    tmp = make_temporary(directory)
    try:
        _write_files(tmp, model, optimizer, step, rng_states or {}, extra or {})
        commit(tmp, directory)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def make_temporary(directory):
    """A new empty sibling directory to write a checkpoint for `directory` into (refuses a
    `directory` that exists and is not a checkpoint)."""
    if os.path.isdir(directory) and os.listdir(directory) and not os.path.isfile(
            os.path.join(directory, "manifest.json")):
        raise CheckpointError(f"--save {directory}: exists and is not a minidist checkpoint; "
                              "refusing to replace it")
    parent = os.path.dirname(directory)
    os.makedirs(parent, exist_ok=True)
    return tempfile.mkdtemp(prefix=f".{os.path.basename(directory)}.tmp-", dir=parent)


def commit(tmp, directory):
    """Rename the complete checkpoint `tmp` to `directory`, replacing an old one atomically."""
    parent, old = os.path.dirname(directory), None
    if os.path.exists(directory):
        old = tempfile.mkdtemp(prefix=f".{os.path.basename(directory)}.old-", dir=parent)
        os.rename(directory, os.path.join(old, "ckpt"))
    os.rename(tmp, directory)
    if old:
        shutil.rmtree(old, ignore_errors=True)


def _write_files(tmp, model, optimizer, step, rng_states, extra):
    sd = optimizer.state_dict()
    opt_arrays = {f"{name}/{k}": v for name, s in sd["state"].items()
                  for k, v in s.items() if hasattr(v, "shape")}
    opt_scalars = {name: {k: v for k, v in s.items() if not hasattr(v, "shape")}
                   for name, s in sd["state"].items()}
    dtype = str(next(iter(model.state_dict().values())).dtype)
    state = {"step": int(step), "config": model.config.to_dict(), "dtype": dtype,
             "optimizer": {"type": type(optimizer).__name__, "groups": sd["groups"],
                           "scalars": opt_scalars},
             "rng": rng_states, "extra": extra}
    save_file({n: backend.to_host(a) for n, a in model.state_dict().items()},
              os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    save_file(opt_arrays, os.path.join(tmp, "optimizer.safetensors"))
    with open(os.path.join(tmp, "state.json"), "w") as f:
        json.dump(state, f, indent=1)
    files = {}
    for name in ("model.safetensors", "optimizer.safetensors", "state.json"):
        path = os.path.join(tmp, name)
        _fsync_file(path)
        files[name] = {"bytes": os.path.getsize(path), "sha256": _sha256(path)}
    manifest = {"format": FORMAT, "version": VERSION, "world_size": 1, "step": int(step),
                "files": files}
    with open(os.path.join(tmp, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def verify_checkpoint(directory, checksums=True):
    """Check the manifest and every file's size and checksum (`checksums` False: presence and
    size only; a sharded load checks the checksums of the shards it reads); returns the
    manifest."""
    path = os.path.join(directory, "manifest.json")
    if not os.path.isdir(directory):
        raise CheckpointError(f"--resume {directory}: no such checkpoint directory")
    if not os.path.isfile(path):
        raise CheckpointError(f"--resume {directory}: no manifest.json, so not a complete "
                              "minidist checkpoint")
    try:
        with open(path) as f:
            manifest = json.load(f)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: corrupt manifest ({e})") from None
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise CheckpointError(f"{path}: format {manifest.get('format')!r} version "
                              f"{manifest.get('version')!r}, expected {FORMAT!r} {VERSION}")
    for name, info in manifest["files"].items():
        verify_file(directory, name, info, checksums)
    return manifest


def verify_file(directory, name, info, checksum=True):
    """One file of a checkpoint against its manifest entry {"bytes", "sha256"[, "rank"]}."""
    fpath = os.path.join(directory, name)
    what = f"rank {info['rank']}'s shard " if "rank" in info else ""
    if not os.path.isfile(fpath):
        raise CheckpointError(f"corrupt checkpoint: {what}{fpath} is missing")
    if os.path.getsize(fpath) != info["bytes"] or (checksum and _sha256(fpath) != info["sha256"]):
        raise CheckpointError(f"corrupt checkpoint: {what}{fpath} does not match the checksum "
                              "in manifest.json (truncated, modified, or from another save)")


def load_checkpoint(directory, model, optimizer=None):
    """Verify `directory`, check it fits `model`, load parameters (and optimizer state).
    Returns the state.json dict ("step", "rng", "extra", ...)."""
    manifest = verify_checkpoint(directory)
    if "zero" in manifest:           # per-rank shards: assembled by parameter name
        from minidist.zero.checkpoint import load_whole
        return load_whole(directory, manifest, model, optimizer)
    if manifest.get("world_size", 1) != 1:
        raise CheckpointError(f"{directory} holds {manifest['world_size']} rank shards; "
                              "this loader reads single-process checkpoints")
    with open(os.path.join(directory, "state.json")) as f:
        state = json.load(f)
    _check_config(directory, state, model)
    try:
        params, _ = load_file(os.path.join(directory, "model.safetensors"))
        model.load_state_dict(params)
        if optimizer is not None:
            _load_optimizer(directory, state, optimizer)
    except (KeyError, ValueError, SafetensorsError) as e:
        raise CheckpointError(f"checkpoint {directory} does not fit this run: {e}") from None
    return state


# GPTConfig fields that change how attention is computed, not the model: a run may resume
# with either attention (and older checkpoints do not have them).
HOW_COMPUTED = ("attention", "attention_block")


def _check_config(directory, state, model):
    ours = {**model.config.to_dict(),
            "dtype": str(next(iter(model.state_dict().values())).dtype)}
    theirs = {**state["config"], "dtype": state.get("dtype")}
    diffs = [f"{k}: {theirs.get(k)!r} in the checkpoint, {v!r} here"
             for k, v in ours.items() if theirs.get(k) != v and k not in HOW_COMPUTED]
    if diffs:
        raise CheckpointError(f"checkpoint config mismatch ({directory}): " + "; ".join(diffs))


def _load_optimizer(directory, state, optimizer, arrays=None):
    """Optimizer state from optimizer.safetensors, or from `arrays` ("<name>/<key>" ->
    array: a sharded checkpoint's, assembled)."""
    saved = state["optimizer"]
    if saved["type"] != type(optimizer).__name__:
        raise CheckpointError(f"checkpoint optimizer is {saved['type']}, this run uses "
                              f"{type(optimizer).__name__}")
    if arrays is None:
        arrays, _ = load_file(os.path.join(directory, "optimizer.safetensors"))
    per_param = {name: dict(scalars) for name, scalars in saved["scalars"].items()}
    for key, a in arrays.items():
        name, k = key.rsplit("/", 1)
        per_param.setdefault(name, {})[k] = a
    optimizer.load_state_dict({"groups": saved["groups"], "state": per_param})
