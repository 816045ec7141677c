"""Checkpoints: round trip of model and optimizer, atomic replacement, and clear errors for a
missing, corrupt or mismatched checkpoint."""
import json
import os

import numpy as np
import pytest

from minidist.nn import GPT, GPTConfig
from minidist.optim import AdamW
from minidist.train.checkpoint import CheckpointError, load_checkpoint, save_checkpoint

TINY = GPTConfig(n_layer=1, n_head=2, n_embd=8, block_size=8, vocab_size=16)


def _trained(seed=0, steps=2):
    model = GPT(TINY, seed=seed)
    opt = AdamW(model.named_parameters(), lr=1e-2)
    x = np.random.default_rng(seed).integers(0, 16, (2, 8))
    for _ in range(steps):
        model(x, x)[1].backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def test_round_trip_restores_parameters_optimizer_and_state(tmp_path):
    model, opt = _trained()
    rng = {"dropout": model.dropout_rng.bit_generator.state}
    save_checkpoint(tmp_path / "ck", model, opt, step=2, rng_states=rng, extra={"lr": 0.01})
    files = sorted(os.listdir(tmp_path / "ck"))
    assert files == ["manifest.json", "model.safetensors", "optimizer.safetensors",
                     "state.json"]
    fresh = GPT(TINY, seed=9)
    fresh_opt = AdamW(fresh.named_parameters(), lr=1e-2)
    state = load_checkpoint(tmp_path / "ck", fresh, fresh_opt)
    assert state["step"] == 2 and state["extra"] == {"lr": 0.01} and state["rng"] == rng
    for (n, a), (_, b) in zip(model.named_parameters(), fresh.named_parameters()):
        np.testing.assert_array_equal(a.data, b.data, err_msg=n)
    for name, s in opt.state.items():
        assert fresh_opt.state[name]["step"] == s["step"]
        np.testing.assert_array_equal(fresh_opt.state[name]["exp_avg_sq"], s["exp_avg_sq"])
    assert [g["weight_decay"] for g in fresh_opt.param_groups] == [0.1, 0.0]


def test_save_replaces_an_old_checkpoint_atomically(tmp_path):
    model, opt = _trained()
    save_checkpoint(tmp_path / "ck", model, opt, step=1)
    save_checkpoint(tmp_path / "ck", model, opt, step=2)
    assert json.loads((tmp_path / "ck" / "manifest.json").read_text())["step"] == 2
    assert os.listdir(tmp_path) == ["ck"]                  # no temp or old dirs left behind
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="not a minidist checkpoint"):
        save_checkpoint(tmp_path / "notes", model, opt, step=1)


def test_missing_and_incomplete_checkpoints(tmp_path):
    model, opt = _trained()
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        load_checkpoint(tmp_path / "nope", model, opt)
    save_checkpoint(tmp_path / "ck", model, opt, step=1)
    os.remove(tmp_path / "ck" / "manifest.json")             # as if the writer died
    with pytest.raises(CheckpointError, match="no manifest.json"):
        load_checkpoint(tmp_path / "ck", model, opt)


def test_corrupt_file_is_caught_by_checksum(tmp_path):
    model, opt = _trained()
    save_checkpoint(tmp_path / "ck", model, opt, step=1)
    path = tmp_path / "ck" / "model.safetensors"
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0xFF                                          # one flipped byte in a weight
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="model.safetensors does not match the checksum"):
        load_checkpoint(tmp_path / "ck", model, opt)


def test_config_mismatch_names_the_fields(tmp_path):
    model, opt = _trained()
    save_checkpoint(tmp_path / "ck", model, opt, step=1)
    other = GPT(GPTConfig(**{**TINY.to_dict(), "n_embd": 16}))
    with pytest.raises(CheckpointError, match="n_embd: 8 in the checkpoint, 16 here"):
        load_checkpoint(tmp_path / "ck", other, AdamW(other.named_parameters()))
    f64 = GPT(TINY, dtype="float64")
    with pytest.raises(CheckpointError, match="dtype: 'float32' in the checkpoint"):
        load_checkpoint(tmp_path / "ck", f64)
