"""The whole model out of any checkpoint, in one process: what examples/sample.py generates
from. Every strategy's checkpoint is read back by parameter name into whole arrays:

    one process, DDP, TP, PP, CP     model.safetensors, the whole model already (TP and PP
                                     gather on save: minidist/tp/strategy.py, pp/checkpoint.py)
    ZeRO-1/2/3 (and CP over ZeRO)    rank shards, cut back into whole arrays by name
                                     (minidist/strategy/readers.py read_whole)
    TP with ZeRO                     one ZeRO folder per tp rank (tp<r>-of-<n>/), the tp
                                     pieces glued by the Split each part records
                                     (minidist/strategy/readers.py PartsReader)
    a GPT-2 folder                   config.json + model.safetensors (minidist/nn/pretrained.py)

Under --amp the float32 master weights are taken where the checkpoint holds them (the 16-bit
parameters are their rounded copies). An MoE model's router biases are the meta's
(`router_bias`). Every file is verified as --resume verifies it.
Tests: tests/test_sample.py.
"""
import json
import os

from minidist.nn import GPTConfig
from minidist.nn.pretrained import read_config, read_state
from minidist.strategy import checkpoint, checkpoint_dirs
from minidist.strategy.checkpoint import CheckpointError


def model_config(path):
    """The GPTConfig of the checkpoint or GPT-2 folder `path`, read before any array is."""
    path = _existing(path)
    if os.path.isfile(os.path.join(path, "config.json")):
        try:
            return read_config(path)
        except (OSError, ValueError, KeyError, json.JSONDecodeError) as e:
            raise CheckpointError(f"--resume {path}: {e}") from None
    where = checkpoint.record_folder(checkpoint_dirs.resolve(path))
    try:
        return _config(checkpoint.read_record(where), where)
    except (OSError, KeyError, json.JSONDecodeError):
        raise CheckpointError(f"--resume {path}: no readable state.json in {where}, so not a "
                              "minidist checkpoint (nor a GPT-2 folder: no config.json)") from None


def run_flags(path):
    """The flags of the run that wrote the checkpoint `path` (its state.json's "extra"), {}
    for a GPT-2 folder or a checkpoint that recorded none: where sample.py looks for the
    tokenizer of a model not in bytes (--init-from's folder, --data's)."""
    path = _existing(path)
    if os.path.isfile(os.path.join(path, "config.json")):
        return {}
    folder = checkpoint.record_folder(checkpoint_dirs.resolve(path))
    try:
        return checkpoint.read_record(folder).get("extra") or {}
    except (OSError, json.JSONDecodeError):
        return {}


def whole_model(path):
    """(GPTConfig, {name: whole host array}, what it is) of the checkpoint or GPT-2 folder
    `path` (a --save directory: its newest checkpoint)."""
    path = _existing(path)
    if os.path.isfile(os.path.join(path, "config.json")):
        return _pretrained(path)
    folder = checkpoint_dirs.resolve(path)
    params, opt_state, meta = checkpoint.load(folder, keys=("master",))   # not the moments
    what = f"step {meta['step']} of {folder}"
    return _config(meta, folder), _masters(params, opt_state["state"]), what


def router_bias(path):
    """The MoE routers' biases the checkpoint `path` holds ({block: [E floats]}, in its meta's
    "rng": minidist/nn/moe_bias.py), for RouterBias.load_state_dict; {} for a GPT-2 folder,
    a dense model or a checkpoint from before them (their biases are 0). Read from the record
    whole_model verified."""
    path = _existing(path)
    if os.path.isfile(os.path.join(path, "config.json")):
        return {}
    folder = checkpoint.record_folder(checkpoint_dirs.resolve(path))
    return checkpoint.read_record(folder).get("rng", {}).get("moe_bias", {})


def _existing(path):
    """`path` if it is a folder; the folder a --save directory's `latest` or `best` file
    names when given that file; else a CheckpointError."""
    path = os.fspath(path)
    if checkpoint_dirs.is_pointer(path):
        return checkpoint_dirs.resolve(path)
    if not os.path.isdir(path):
        what = "is a file, not a folder" if os.path.exists(path) else "no such directory"
        raise CheckpointError(f"--resume {path}: {what} (give a --save directory, one "
                              "checkpoint folder in it, or a GPT-2 folder)")
    return path


def _config(meta, folder):
    try:
        return GPTConfig(**meta["config"])
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{folder}: its model config does not read ({e})") from None


def _masters(params, state):
    """The float32 master weights (--amp) where the optimizer state holds them."""
    return {n: state.get(n, {}).get("master", a) for n, a in params.items()}


def _pretrained(path):
    try:
        config = read_config(path)
        kind = "Llama" if config.llama else "GPT-2"
        return config, read_state(path, config), f"the {kind} folder {path}"
    except (OSError, ValueError, KeyError, json.JSONDecodeError) as e:
        raise CheckpointError(f"--resume {path}: {e}") from None
