"""The whole model out of any checkpoint, in one process: what examples/sample.py generates
from. Every strategy's checkpoint is read back by parameter name into whole arrays:

    one process, DDP, TP, PP, CP     model.safetensors, the whole model already (TP and PP
                                     gather on save: minidist/tp/strategy.py, pp/checkpoint.py)
    ZeRO-1/2/3 (and CP over ZeRO)    rank shards, cut back into whole arrays by name
                                     (minidist/strategy/readers.py read_whole)
    TP with ZeRO                     one ZeRO folder per tp rank (tp<r>-of-<n>/): each read
                                     whole, then the tp pieces glued along their split axis
                                     (minidist/tp/region.py Split, `tp_splits` below)
    a GPT-2 folder                   config.json + model.safetensors (minidist/nn/pretrained.py)

Under --amp the float32 master weights are taken where the checkpoint holds them (the 16-bit
parameters are their rounded copies). Every file is verified as --resume verifies it.
Tests: tests/test_sample.py.
"""
import json
import os
import re

from minidist.nn import GPTConfig
from minidist.nn.pretrained import read_config, read_state
from minidist.tp.region import Split
from minidist.strategy import checkpoint, checkpoint_dirs
from minidist.strategy.checkpoint import CheckpointError
from minidist.strategy.readers import read_whole

_PART = re.compile(r"^tp(\d+)-of-(\d+)$")


def tp_splits(config):
    """{name: Split} of the parameters TensorParallelGPT splits, as its layers cut them
    (minidist/tp/layers.py): wte by vocabulary rows, c_attn and c_fc by output columns (c_attn
    as three blocks q|k|v), the c_proj weights by input rows. The rest are whole on every tp
    rank. tests/test_sample.py checks this against a TensorParallelGPT's own `tp_split`s."""
    C, out = config.n_embd, {"transformer.wte.weight": Split(0, config.vocab_size)}
    for i in range(config.n_layer):
        h = f"transformer.h.{i}."
        out[h + "attn.c_attn.weight"] = Split(1, 3 * C, blocks=3)
        out[h + "attn.c_proj.weight"] = Split(0, C)
        out[h + "mlp.c_fc.weight"] = Split(1, 4 * C)
        out[h + "mlp.c_proj.weight"] = Split(0, 4 * C)
        if config.bias:
            out[h + "attn.c_attn.bias"] = Split(0, 3 * C, blocks=3)
            out[h + "mlp.c_fc.bias"] = Split(0, 4 * C)
    return out


def model_config(path):
    """The GPTConfig of the checkpoint or GPT-2 folder `path`, read before any array is."""
    path = _existing(path)
    if os.path.isfile(os.path.join(path, "config.json")):
        try:
            return read_config(path)
        except (OSError, ValueError, KeyError, json.JSONDecodeError) as e:
            raise CheckpointError(f"--resume {path}: {e}") from None
    folder = checkpoint_dirs.resolve(path)
    parts = _parts(folder)
    where = parts[0] if parts else folder
    try:
        return _config(checkpoint.read_record(where), where)
    except (OSError, KeyError, json.JSONDecodeError):
        raise CheckpointError(f"--resume {path}: no readable state.json in {where}, so not a "
                              "minidist checkpoint (nor a GPT-2 folder: no config.json)") from None


def whole_model(path):
    """(GPTConfig, {name: whole host array}, what it is) of the checkpoint or GPT-2 folder
    `path` (a --save directory: its newest checkpoint)."""
    path = _existing(path)
    if os.path.isfile(os.path.join(path, "config.json")):
        return _pretrained(path)
    folder = checkpoint_dirs.resolve(path)
    parts = _parts(folder)
    if parts:
        return _tp_parts(folder, parts)
    params, opt_state, meta = checkpoint.load(folder)
    what = f"step {meta['step']} of {folder}"
    return _config(meta, folder), _masters(params, opt_state["state"]), what


def _existing(path):
    path = os.fspath(path)
    if not os.path.isdir(path):
        what = "is a file, not a folder" if os.path.exists(path) else "no such directory"
        raise CheckpointError(f"--resume {path}: {what} (give a --save directory, one "
                              "checkpoint folder in it, or a GPT-2 folder)")
    return path


def _parts(folder):
    """A TP x ZeRO checkpoint's per-tp-rank folders, in tp rank order; [] for any other."""
    if os.path.isfile(os.path.join(folder, "manifest.json")):
        return []
    found = sorted((int(m.group(1)), n) for n in os.listdir(folder)
                   if (m := _PART.match(n)) and os.path.isdir(os.path.join(folder, n)))
    return [os.path.join(folder, n) for _, n in found]


def _config(meta, folder):
    try:
        return GPTConfig(**meta["config"])
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{folder}: its model config does not read ({e})") from None


def _masters(params, state):
    """The float32 master weights (--amp) where the optimizer state holds them."""
    return {n: state.get(n, {}).get("master", a) for n, a in params.items()}


def _tp_parts(folder, parts):
    """A TP x ZeRO checkpoint: each tp rank's ZeRO folder read whole, the pieces glued."""
    pieces, config, record = [], None, None
    for part in parts:
        manifest = checkpoint.verify(part)
        record = checkpoint.read_record(part)
        config = _config(record, part)
        params, arrays = read_whole(part, manifest)
        pieces.append({n: arrays.get(f"{n}/master", a) for n, a in params.items()})
    splits = tp_splits(config)
    with checkpoint.does_not_fit(folder):
        whole = {n: splits[n].unshard([p[n] for p in pieces]) if n in splits else a
                 for n, a in pieces[0].items()}
    return config, whole, f"step {record['step']} of {folder} ({len(parts)} tp pieces)"


def _pretrained(path):
    try:
        config = read_config(path)
        return config, read_state(path, config), f"the GPT-2 folder {path}"
    except (OSError, ValueError, KeyError, json.JSONDecodeError) as e:
        raise CheckpointError(f"--resume {path}: {e}") from None
