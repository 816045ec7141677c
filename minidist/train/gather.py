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

    whole_model        every parameter at once: examples/sample.py, examples/export_gpt2.py
    CheckpointWeights  one parameter at a time, as asked for (read(name)): --init-from's
                       weights, so a rank building part of the model reads that part only
                       (ZeRO-3 a unit at a time: tests/test_zero_build.py); whole_model
                       reads through it
Tests: tests/test_sample.py, tests/test_zero_build.py.
"""
import json
import os

from minidist.nn import GPTConfig
from minidist.nn.pretrained import read_config, read_state
from minidist.strategy import checkpoint, checkpoint_dirs
from minidist.strategy.checkpoint import CheckpointError
from minidist.strategy.readers import reader_for


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
    weights = CheckpointWeights(path)
    return weights.config, {n: weights.read(n) for n in weights.names}, weights.what


class CheckpointWeights:
    """A minidist checkpoint's parameters, each read when asked for: gpt_init's `weights`
    under --init-from (minidist/nn/config.py), so a rank building part of the model (ZeRO-3
    a unit at a time, a pipeline stage) reads that part only, never the whole model.

    Opening verifies every file as --resume does (the manifest against its digest, each
    file's size and sha256, streamed) and reads the record, no array. read(name) makes that
    one parameter's whole host array: model.safetensors' memory-mapped, or cut out of ZeRO's
    rank shards by name (minidist/strategy/readers.py reader_for); the float32 master where
    the checkpoint holds one (--amp: the 16-bit parameters are its rounded copies);
    `positions`: wpe's first rows only (a shorter --block-size). `names`: the checkpoint's
    parameters, in its order; `config`, `what` (its step and folder): for the log."""

    WPE = "transformer.wpe.weight"

    def __init__(self, path, positions=None):
        self.folder = checkpoint_dirs.resolve(_existing(path))
        manifest = checkpoint.verify(self.folder)
        record = checkpoint.read_record(self.folder, manifest)
        self.config = _config(record, self.folder)
        self.what = f"step {record['step']} of {self.folder}"
        with checkpoint.does_not_fit(self.folder):
            self.reader = reader_for(self.folder, manifest, verified=True)
        self.names = list(self.reader.names)
        self.positions = positions

    def read(self, name):
        """The parameter `name`'s whole host array (its master under --amp)."""
        with checkpoint.does_not_fit(self.folder):
            a = self.reader.get(name, "master")
            a = self.reader.get(name) if a is None else a
        return a[:self.positions] if name == self.WPE and self.positions else a


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


def _pretrained(path):
    try:
        config = read_config(path)
        kind = "Llama" if config.llama else "GPT-2"
        return config, read_state(path, config), f"the {kind} folder {path}"
    except (OSError, ValueError, KeyError, json.JSONDecodeError) as e:
        raise CheckpointError(f"--resume {path}: {e}") from None
