"""Checkpoints as plain dicts: everything a run needs to continue bit-identically, every file
verified on load, one code path for every strategy.

    save(directory, params, optimizer_state, meta)      -> the checkpoint folder written
    plain_plan(params, optimizer_state, meta)            -> the same as a SavePlan: what one
                                                            rank writes (saving.py writes it)
    load(directory) -> (params, optimizer_state, meta)  whole host arrays, whoever wrote it

    params           {GPT-2 name: host array}, the whole model
    optimizer_state  the optimizer's state_dict(): {"groups": [...], "state": {name: {key:
                     array or scalar}}}
    meta             {"step": steps done, "config": GPTConfig.to_dict(), "dtype", "optimizer":
                     its class name, "rng": the run's state beside the arrays, {"dropout":
                     the dropout keys' state_dict, "moe_bias": the MoE routers' biases
                     (minidist/nn/moe_bias.py)}, "extra": the run's flags}

`directory` is a --save directory: each save is a new numbered folder and a `latest` pointer
(minidist/strategy/checkpoint_dirs.py). One checkpoint folder holds

    model.safetensors       parameters, dtype as trained
    optimizer.safetensors   optimizer arrays as "<param name>/<key>" (exp_avg, ...)
    state.json              meta, the optimizer's groups and per-parameter scalars
    manifest.json           format, version, world size, step, each file's bytes and sha256
    manifest.sha256         the sha256 of manifest.json: the manifest is checked too

A save is planned, written, then committed (minidist/strategy/saving.py: the same steps for
every strategy, the writing on a thread under --async-save). ZeRO plans per-rank shards
instead of the two .safetensors (minidist/zero/checkpoint.py: shards carry a "rank", "zero"
the flat layout).
verify() is the one check for all of them: the manifest against its digest, then every file's
size and sha256 (a shard's checksum optionally left to whoever reads it). An edited "step",
"weight_decay" or manifest "offset" fails as a flipped byte does: CheckpointError naming the
file. check_fits() names the config fields that differ from the model's.
Tests: tests/test_checkpoint.py.
"""
import contextlib
import json
import os
import re

from minidist.nn.pretrained import is_gpt2_folder
from minidist.nn.safetensors import SafetensorsError, load_file
from minidist.strategy import checkpoint_dirs as dirs
from minidist.strategy import saving
from minidist.strategy.checkpoint_dirs import CheckpointError
from minidist.strategy.readers import STATE_KEYS, read_whole, sha256_file, verify_file
from minidist.strategy.saving import DIGEST, FORMAT, VERSION

__all__ = ["CheckpointError", "save", "load", "verify", "check_fits", "make_meta",
           "save_checkpoint", "load_checkpoint"]
PART = re.compile(r"^tp(\d+)-of-(\d+)$")       # a TP x ZeRO checkpoint's part folders
META_KEYS = ("step", "config", "dtype", "rng", "extra")


# ---- writing a checkpoint folder (minidist/strategy/saving.py writes the plan) -----------------

def state_record(meta, optimizer_state):
    """state.json's content, and the optimizer's arrays ("<name>/<key>" -> array)."""
    arrays = {f"{name}/{k}": v for name, s in optimizer_state["state"].items()
              for k, v in s.items() if hasattr(v, "shape")}
    scalars = {name: {k: v for k, v in s.items() if not hasattr(v, "shape")}
               for name, s in optimizer_state["state"].items()}
    record = {k: meta[k] for k in META_KEYS}
    record["step"] = int(record["step"])
    record["optimizer"] = {"type": meta["optimizer"], "groups": optimizer_state["groups"],
                           "scalars": scalars}
    return record, arrays


def plain_plan(params, optimizer_state, meta):
    """A one-process checkpoint of plain dicts as a SavePlan (minidist/strategy/saving.py):
    model.safetensors, optimizer.safetensors, state.json and the manifest of the three.
    `params` and `optimizer_state`'s arrays are host arrays the plan keeps until it is
    written: copies, not the model's own (save_checkpoint_plan's saving.host_copy; a state_dict's
    and every gather's arrays are copies already)."""
    record, arrays = state_record(meta, optimizer_state)
    return saving.SavePlan(
        files=[saving.arrays_file("model.safetensors", params, metadata={"format": "pt"}),
               saving.arrays_file("optimizer.safetensors", arrays),
               saving.json_file("state.json", record)],
        manifests=[saving.Manifest("")])


def save(directory, params, optimizer_state, meta):
    """Write a checkpoint of plain dicts as the next numbered folder of `directory`, now;
    returns the folder."""
    return saving.save_now(directory, meta["step"], plain_plan(params, optimizer_state, meta))


def make_meta(config, dtype, optimizer, step, rng_states=None, extra=None):
    """meta for save(): `optimizer` the object (its class name is recorded)."""
    return {"step": int(step), "config": config.to_dict(), "dtype": str(dtype),
            "optimizer": type(optimizer).__name__, "rng": rng_states or {},
            "extra": extra or {}}


# ---- verifying and reading ----------------------------------------------------------------------

def verify(folder, shard_checksums=True):
    """Check manifest.json against its digest, then every file it lists (size and sha256;
    with `shard_checksums` False a rank shard's size only: its reader checks the checksum).
    Returns the manifest."""
    path = os.path.join(folder, "manifest.json")
    if not os.path.isdir(folder):
        raise CheckpointError(f"--resume {folder}: no such checkpoint directory")
    parts = sorted(n for n in os.listdir(folder) if PART.match(n))
    if not os.path.isfile(path) and parts:
        return verify_parts(folder, parts, shard_checksums)
    if not os.path.isfile(path):
        raise CheckpointError(f"--resume {folder}: " + (
            f"a GPT-2 folder, not a minidist checkpoint: start from its weights with "
            f"--init-from {folder}" if is_gpt2_folder(folder) else
            "no manifest.json, so not a complete minidist checkpoint"))
    digest = os.path.join(folder, DIGEST)
    if not os.path.isfile(digest):
        raise CheckpointError(f"{folder}: no {DIGEST} (an incomplete checkpoint, or one from "
                              "an older minidist: resave it with that version)")
    with open(digest) as f:
        if f.read().strip() != sha256_file(path):
            raise CheckpointError(f"corrupt checkpoint: {path} does not match {DIGEST} "
                                  "(edited or truncated)")
    with open(path) as f:
        manifest = json.load(f)
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise CheckpointError(f"{path}: format {manifest.get('format')!r} version "
                              f"{manifest.get('version')!r}, expected {FORMAT!r} {VERSION}")
    for name, info in manifest["files"].items():
        verify_file(folder, name, info, shard_checksums or "rank" not in info)
    return manifest


def verify_parts(folder, parts, shard_checksums=True):
    """A TP x ZeRO checkpoint: one ZeRO folder per tp rank (`parts`, named tp<r>-of-<T>),
    each verified as a checkpoint of its own, their "tp" sections checked against each other
    (every rank 0..T-1 once, the same step and splits). Returns the manifest of the whole:
    the step, world size, "tp" (size, splits), "parts" (the folders in tp rank order) and
    "manifests" (theirs), which checkpoint.load and ZeRO's load_sharded read by parameter
    name (minidist/strategy/readers.py PartsReader)."""
    manifests = {n: verify(os.path.join(folder, n), shard_checksums) for n in parts}
    if any("tp" not in m for m in manifests.values()):
        raise CheckpointError(f"--resume {folder}: a checkpoint of --tp with --zero "
                              f"({', '.join(parts)}) saved before its parts recorded how "
                              "they were cut; resume it with the same --tp and --zero "
                              "(a --save from that run can be resumed in any layout)")
    tps = {n: m["tp"] for n, m in manifests.items()}
    size = tps[parts[0]]["size"]
    by_rank = {t["rank"]: n for n, t in tps.items()}
    moved = [f"{n} holds tp rank {t['rank']} of {t['size']}'s part" for n, t in tps.items()
             if n != f"tp{t['rank']}-of-{t['size']}"]
    if moved:                    # (walk 37: two parts swapped read "not the 2 of tp 2")
        raise CheckpointError(f"corrupt checkpoint: in {folder}, {'; '.join(moved)} "
                              "(renamed or moved?)")
    if sorted(by_rank) != list(range(size)) or len(parts) != size:
        raise CheckpointError(f"corrupt checkpoint: {folder} holds the parts "
                              f"{', '.join(parts)}, not the {size} of tp {size}")
    steps = {m["step"] for m in manifests.values()}
    if len(steps) != 1 or any(t["splits"] != tps[parts[0]]["splits"] for t in tps.values()):
        raise CheckpointError(f"corrupt checkpoint: the parts of {folder} disagree on the "
                              "step or on how the parameters were cut")
    order = [by_rank[r] for r in range(size)]
    return {"format": FORMAT, "version": VERSION, "step": steps.pop(),
            "world_size": sum(m["world_size"] for m in manifests.values()),
            "tp": {"size": size, "splits": tps[parts[0]]["splits"]},
            "parts": [os.path.join(folder, n) for n in order],
            "manifests": [manifests[n] for n in order]}


def read_record(folder, manifest=None):
    """state.json of a verified folder (of a TP x ZeRO checkpoint: its tp rank 0 part's; the
    parts' records are the same but for the tp part each describes)."""
    where = manifest["parts"][0] if manifest and "parts" in manifest else folder
    path = os.path.join(where, "state.json")
    with open(path) as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:    # (walk 37: the line named no file)
            raise CheckpointError(f"corrupt checkpoint: {path} is not JSON ({e})") from None


def record_folder(folder):
    """The folder whose state.json describes the checkpoint folder `folder`: itself, or for a
    TP x ZeRO checkpoint (no manifest of its own, one part per tp rank) its tp rank 0 part,
    as read_record reads after verification. For reading the record before any is done."""
    if os.path.isfile(os.path.join(folder, "manifest.json")):
        return folder
    parts = sorted((int(m.group(1)), n) for n in os.listdir(folder)
                   if (m := PART.match(n)) and os.path.isdir(os.path.join(folder, n)))
    return os.path.join(folder, parts[0][1]) if parts else folder


def saved_model(directory):
    """(folder, config dict, dtype, the run's flags) of the checkpoint `directory` names (a
    checkpoint or a --save directory), read from its record before any work and NOT verified
    (load does that): what a resumed run takes its model from. CheckpointError where it
    cannot be read."""
    folder = dirs.resolve(directory)
    try:
        record = read_record(record_folder(folder))
        return folder, dict(record["config"]), str(record["dtype"]), record.get("extra") or {}
    except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
        raise CheckpointError(f"checkpoint {folder}: its record cannot be read ({e})") from None


def load(directory, keep=None, only=None, keys=STATE_KEYS):
    """(params, optimizer_state, meta) of the checkpoint `directory` (a checkpoint folder, or
    a --save directory: its latest), every file verified; ZeRO's shards assembled by name,
    a TP x ZeRO checkpoint's tp pieces glued as its parts record.
    keep(name, array): what to keep of the whole array `array` of parameter `name` (the
    parameter, or one of its optimizer arrays), applied as each is read, so that a rank
    keeping a piece (its tp shard) never holds every whole array at once; None: all.
    only: the parameter names this rank holds (a pipeline stage's, an expert-parallel rank's
    own experts); the checkpoint's other parameters, their optimizer arrays and scalars, are
    not read at all. Optimizer entries that are no parameter (the loss scaler's) are kept.
    None: every parameter. keys: the parameters' optimizer arrays to read (the weights
    alone need "master": AdamW's moments, twice the model, are then never assembled)."""
    folder = dirs.resolve(directory)
    manifest = verify(folder)
    record = read_record(folder, manifest)
    with does_not_fit(folder):
        if holds_shards(manifest):
            params, arrays, saved_names = read_whole(folder, manifest, keep, only, keys)
        else:                                   # memory-mapped: `keep` reads only its piece
            params, _ = load_file(os.path.join(folder, "model.safetensors"))
            arrays, _ = load_file(os.path.join(folder, "optimizer.safetensors"))
            saved_names = set(params)
            arrays = {k: a for k, a in arrays.items() if k.rsplit("/", 1)[-1] not in
                      STATE_KEYS or k.rsplit("/", 1)[-1] in keys}
            if only is not None:
                params = {n: a for n, a in params.items() if n in only}
                arrays = {k: a for k, a in arrays.items() if _wanted(k.rsplit("/", 1)[0],
                                                                      saved_names, only)}
            if keep is not None:
                params = {n: keep(n, a) for n, a in params.items()}
                arrays = {k: keep(k.rsplit("/", 1)[0], a) for k, a in arrays.items()}
    saved = record["optimizer"]
    per_param = {name: dict(scalars) for name, scalars in saved["scalars"].items()
                 if _wanted(name, saved_names, only)}
    for key, a in arrays.items():
        name, k = key.rsplit("/", 1)
        per_param.setdefault(name, {})[k] = a
    meta = {**{k: record[k] for k in META_KEYS}, "optimizer": saved["type"], "folder": folder}
    return params, {"groups": saved["groups"], "state": per_param}, meta


def holds_shards(manifest):
    """Whether a checkpoint's manifest is ZeRO's rank shards or TP x ZeRO's parts, which load
    glues into whole arrays (read_whole), not one process's whole arrays (memory-mapped)."""
    return "zero" in manifest or "parts" in manifest


def _wanted(name, saved_names, only):
    """An optimizer entry load keeps: every one when `only` is None, else those of the
    parameters in `only` and those that are no parameter of the checkpoint (the scaler's)."""
    return only is None or name in only or name not in saved_names


@contextlib.contextmanager
def does_not_fit(folder):
    """Turn a loader's KeyError / ValueError (names, shapes) into a CheckpointError."""
    try:
        yield
    except (KeyError, ValueError, SafetensorsError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"checkpoint {folder} does not fit this run: {e}") from None


# GPTConfig fields no parameter depends on: how attention is computed, the dropout rate, the
# MoE losses' weights and capacity. A run may resume with others (a fine-tuning run often
# changes dropout; older checkpoints do not have the attention fields).
HOW_COMPUTED = ("attention", "attention_block", "dropout", "moe_capacity_factor",
                "moe_aux_loss_coef", "moe_z_loss_coef")


def check_fits(folder, meta, config, dtype, optimizer_type=None):
    """Raise naming every config field (and the dtype, the optimizer) that differs. A dense
    model's config has no moe_* fields (GPTConfig.to_dict): it counts as moe_experts 0, and
    the other moe_* fields are compared only between two Mixtures of Experts."""
    ours = {"moe_experts": 0, **config.to_dict(), "dtype": str(dtype)}
    theirs = {"moe_experts": 0, **meta["config"], "dtype": meta.get("dtype")}
    moe = ours["moe_experts"] and theirs["moe_experts"]
    diffs = [f"{k}: {theirs.get(k)!r} in the checkpoint, {ours.get(k)!r} here"
             for k in {**ours, **theirs} if theirs.get(k) != ours.get(k)
             and k not in HOW_COMPUTED and (moe or k == "moe_experts" or k[:4] != "moe_")]
    if optimizer_type is not None and meta["optimizer"] != optimizer_type:
        diffs.append(f"optimizer: {meta['optimizer']} in the checkpoint, {optimizer_type} "
                     "here (--amp must match)")
        if len(diffs) == 1:         # (walk 39: the hint on model flags read oddly here)
            raise CheckpointError(f"checkpoint config mismatch ({folder}): {diffs[0]}; one "
                                  "optimizer's state is not another's: load it into "
                                  f"{meta['optimizer']}, or start the new optimizer from the "
                                  "model alone (train_gpt.py --init-from)")
    if diffs:
        data = ("; vocab_size follows --data (and --init-from): give the data it was trained "
                "on" if theirs.get("vocab_size") != ours.get("vocab_size") else "")
        raise CheckpointError(f"checkpoint config mismatch ({folder}): " + "; ".join(diffs)
                              + " (examples/train_gpt.py takes the model flags, --dtype and "
                              "--amp from the checkpoint it resumes: leave them out; a script "
                              "of its own builds the model from checkpoint.saved_model(DIR)'s "
                              f"config and dtype{data})")


# ---- one whole model and its optimizer (one process, DDP's rank 0) ---------------------------

def model_dtype(model):
    """The parameters' dtype, read off the parameters themselves: no state_dict (a tensor-
    parallel model's is collective), and under ZeRO-3 the freed ones are placeholders of it."""
    return next(p.dtype for p in model.parameters())


def save_checkpoint_plan(model, optimizer, step, rng_states=None, extra=None):
    """plain_plan of a whole model's and its optimizer's state dicts: the parameters copied
    to the host (host_copy: the next step changes them in place)."""
    params = {n: saving.host_copy(a) for n, a in model.state_dict().items()}
    meta = make_meta(model.config, model_dtype(model), optimizer, step, rng_states, extra)
    return plain_plan(params, optimizer.state_dict(), meta)


def save_checkpoint(directory, model, optimizer, step, rng_states=None, extra=None,
                    overwrite=False):
    """A whole model's and its optimizer's checkpoint, written now as `directory`'s next
    numbered folder; returns the folder. Refuses (CheckpointError) a `directory` whose
    latest checkpoint is past `step`, which the save would make `latest` name no more,
    unless `overwrite`."""
    plan = save_checkpoint_plan(model, optimizer, step, rng_states, extra)
    return saving.save_now(directory, step, plan, overwrite=overwrite)


def optimizer_keys(optimizer):
    """load()'s `keys` for a load into `optimizer`: every optimizer array, or with None (a
    weights-only load: --eval-only) none, so that AdamW's moments and --amp's float32 masters
    are never read (a one-process checkpoint's are memory-mapped and left unread; a sharded
    one's never assembled)."""
    return STATE_KEYS if optimizer is not None else ()


def load_checkpoint(directory, model, optimizer=None):
    """load() into a whole model (and optimizer; None: its parameters alone, no optimizer
    array read), after check_fits; returns meta."""
    params, optimizer_state, meta = load(directory, keys=optimizer_keys(optimizer))
    check_fits(meta["folder"], meta, model.config, model_dtype(model),
               type(optimizer).__name__ if optimizer is not None else None)
    with does_not_fit(meta["folder"]):
        model.load_state_dict(params)
        if optimizer is not None:
            optimizer.load_state_dict(optimizer_state)
    return meta
