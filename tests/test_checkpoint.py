"""Checkpoints (minidist/strategy/checkpoint.py): plain dicts in and out, a round trip that
restores parameters, optimizer and state, a load of only the named parameters, and a clear
CheckpointError for a missing, corrupt, edited or mismatched one (the manifest itself
included; a ZeRO checkpoint through the same check). The folders: tests/test_checkpoint_dirs.py."""
import json
import math
import os
import re
from types import SimpleNamespace

import numpy as np
import pytest

from minidist.nn import GPT, GPTConfig
from minidist.optim import AdamW
from minidist.strategy import checkpoint
from minidist.strategy.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from tests.checkpoint_cases import TINY, _trained


def _edit_json(path, change):
    obj = json.loads(path.read_text())
    change(obj)
    path.write_text(json.dumps(obj, indent=1))


def _cut_in_half(path):
    """Truncate the file at `path` to half its size, as a full disk or a copy cut short does."""
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def test_round_trip_restores_parameters_optimizer_and_state(tmp_path):
    model, opt = _trained()
    rng = {"dropout": model.dropout_keys.state_dict()}
    folder = save_checkpoint(tmp_path / "ck", model, opt, step=2, rng_states=rng,
                             extra={"lr": 0.01})
    assert sorted(os.listdir(tmp_path / "ck")) == ["latest", "step-00000002"]
    assert sorted(os.listdir(folder)) == ["manifest.json", "manifest.sha256",
                                          "model.safetensors", "optimizer.safetensors",
                                          "state.json"]
    fresh = GPT(TINY, seed=9)
    fresh_opt = AdamW(fresh.named_parameters(), lr=1e-2)
    for where in (tmp_path / "ck", folder):          # the --save directory, or the folder
        state = load_checkpoint(where, fresh, fresh_opt)
        assert state["step"] == 2 and state["extra"] == {"lr": 0.01} and state["rng"] == rng
    for (n, a), (_, b) in zip(model.named_parameters(), fresh.named_parameters()):
        np.testing.assert_array_equal(a.data, b.data, err_msg=n)
    for name, s in opt.state.items():
        assert fresh_opt.state[name]["step"] == s["step"]
        np.testing.assert_array_equal(fresh_opt.state[name]["exp_avg_sq"], s["exp_avg_sq"])
    assert [g["weight_decay"] for g in fresh_opt.param_groups] == [0.1, 0.0]


def test_plain_dicts_in_and_out(tmp_path):
    model, opt = _trained()
    params = {n: a.copy() for n, a in model.state_dict().items()}
    meta = checkpoint.make_meta(TINY, "float32", opt, 7, {"r": 1}, {"seed": 3})
    checkpoint.save(tmp_path / "ck", params, opt.state_dict(), meta)
    got, opt_state, got_meta = checkpoint.load(tmp_path / "ck")
    assert set(got) == set(params) and all(np.array_equal(got[n], params[n]) for n in params)
    assert [g["weight_decay"] for g in opt_state["groups"]] == [0.1, 0.0]
    assert {k: got_meta[k] for k in meta} == {**meta, "config": TINY.to_dict()}


def test_missing_and_incomplete_checkpoints(tmp_path):
    model, opt = _trained()
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        load_checkpoint(tmp_path / "nope", model, opt)
    folder = save_checkpoint(tmp_path / "ck", model, opt, step=1)
    os.remove(os.path.join(folder, "manifest.json"))          # as if the writer died
    with pytest.raises(CheckpointError, match="no manifest.json"):
        load_checkpoint(tmp_path / "ck", model, opt)
    (tmp_path / "tpz" / "step-00000001" / "tp0-of-2").mkdir(parents=True)
    with pytest.raises(CheckpointError, match="tp0-of-2: no manifest.json"):
        load_checkpoint(tmp_path / "tpz", model, opt)     # one process, a TP+ZeRO part missing


def test_corrupt_file_is_caught_by_checksum(tmp_path):
    model, opt = _trained()
    folder = save_checkpoint(tmp_path / "ck", model, opt, step=1)
    path = os.path.join(folder, "model.safetensors")
    raw = bytearray(open(path, "rb").read())
    raw[-3] ^= 0xFF                                          # one flipped byte in a weight
    open(path, "wb").write(bytes(raw))
    with pytest.raises(CheckpointError, match="model.safetensors does not match the checksum"):
        load_checkpoint(tmp_path / "ck", model, opt)


@pytest.mark.parametrize("edit", ["step", "weight_decay", "manifest", "cut model.safetensors",
                                  "cut optimizer.safetensors", "cut state.json",
                                  "cut manifest.json", "cut manifest.sha256"])
def test_truncated_or_edited_files_fail(tmp_path, edit):
    """Hand edits of state.json (the step, a weight decay) or of the manifest, and any file of
    the checkpoint cut to half its size, are caught like a flipped byte, naming the file:
    the arrays and state.json by their checksums, the manifest by manifest.sha256 (a cut
    manifest.sha256 no longer matches the manifest it guards)."""
    model, opt = _trained()
    folder = tmp_path / os.path.basename(save_checkpoint(tmp_path, model, opt, step=5))
    if edit == "step":
        _edit_json(folder / "state.json", lambda s: s.update(step=7))
    elif edit == "weight_decay":
        _edit_json(folder / "state.json",
                   lambda s: s["optimizer"]["groups"][0].update(weight_decay=0.5))
    elif edit == "manifest":
        _edit_json(folder / "manifest.json", lambda m: m.update(step=7))
    else:
        _cut_in_half(folder / edit.split()[1])
    named = {"step": "state.json", "weight_decay": "state.json"}.get(edit, edit.split()[-1])
    want = (f"{folder}/manifest.json does not match manifest.sha256"
            if named in ("manifest", "manifest.json", "manifest.sha256") else
            f"{folder}/{named} does not match the checksum in manifest.json")
    with pytest.raises(CheckpointError, match=re.escape(want)):
        load_checkpoint(tmp_path, model, opt)


def _zero_one_rank(stage=3):
    """ZeRO over a 1-rank group in this process (no mpiexec): the sharded format."""
    from mpi4py import MPI
    from minidist.comm import ProcessGroup
    from minidist.zero.strategy import ZeroDataParallel
    strategy = ZeroDataParallel(ProcessGroup(MPI.COMM_WORLD, "ring", name="z"), stage)
    model = strategy.build_model(TINY, 0, "float32")
    opt = strategy.build_optimizer(model, SimpleNamespace(lr=1e-2, weight_decay=0.1,
                                                          beta1=0.9, beta2=0.95,
                                                          optimizer="adamw"))
    return strategy, model, opt


@pytest.mark.parametrize("edit", ["offset", "step", "cut shard"])
def test_zero_checkpoint_goes_through_the_same_verification(tmp_path, edit):
    """ZeRO's sharded checkpoint: an edited manifest "offset" or state.json "step", or a
    shard cut to half its size, fails on load, with ZeRO's own loader and with
    checkpoint.load (whole arrays)."""
    strategy, model, opt = _zero_one_rank()
    strategy.save(str(tmp_path), model, opt, 1, {}, {})
    params, _, meta = checkpoint.load(tmp_path)
    assert meta["step"] == 1 and set(params) == set(dict(model.named_parameters()))
    assert strategy.load(str(tmp_path), model, opt)["step"] == 1
    folder = tmp_path / "step-00000001"
    if edit == "offset":
        _edit_json(folder / "manifest.json",
                   lambda m: m["zero"]["units"][0]["params"][1].update(offset=1))
    elif edit == "step":
        _edit_json(folder / "state.json", lambda s: s.update(step=7))
    else:
        _cut_in_half(folder / "shard-00000-of-00001.safetensors")
    want = {"offset": "manifest.json does not match manifest.sha256",
            "step": "state.json does not match the checksum",
            "cut shard": "shard-00000-of-00001.safetensors does not match the checksum"}[edit]
    for load in (lambda: checkpoint.load(tmp_path),
                 lambda: strategy.load(str(tmp_path), model, opt)):
        with pytest.raises(CheckpointError, match=re.escape(f"{folder}/{want}")):
            load()


def _rehashed(folder):
    """Make `folder`'s checksums agree with its files again (state.json's in manifest.json,
    manifest.json's in manifest.sha256): an edit that hides itself."""
    from minidist.strategy.readers import sha256_file
    state = folder / "state.json"
    _edit_json(folder / "manifest.json", lambda m: m["files"]["state.json"].update(
        bytes=state.stat().st_size, sha256=sha256_file(str(state))))
    (folder / "manifest.sha256").write_text(sha256_file(str(folder / "manifest.json")))


def test_rehashed_edits_are_refused_by_what_they_break(tmp_path):
    """First-use walk 37: edits whose checksums were made anew. An offset moved onto its
    neighbour's elements resumed with wrong weights; a state.json that is not JSON was a
    line naming no file. Both are now refused, naming the file."""
    strategy, model, opt = _zero_one_rank()
    strategy.save(str(tmp_path), model, opt, 1, {}, {})
    folder = tmp_path / "step-00000001"
    first = json.load(open(folder / "manifest.json"))["zero"]["units"][0]["params"][0]
    _edit_json(folder / "manifest.json", lambda m: m["zero"]["units"][0]["params"][1].update(
        offset=first["offset"] + 1))
    _rehashed(folder)
    with pytest.raises(CheckpointError, match=r"corrupt checkpoint: .*manifest.json: .* "
                                              r"overlaps .* \(edited\?\)"):
        checkpoint.load(tmp_path)
    strategy.save(str(tmp_path / "one"), model, opt, 1, {}, {})     # one element over
    folder = tmp_path / "one" / "step-00000001"
    _edit_json(folder / "manifest.json", lambda m: m["zero"]["units"][0]["params"][1].update(
        offset=first["offset"] + math.prod(first["shape"]) - 1))
    _rehashed(folder)
    with pytest.raises(CheckpointError, match=r"overlaps .* \(edited\?\)"):
        checkpoint.load(tmp_path / "one")
    strategy.save(str(tmp_path / "b"), model, opt, 1, {}, {})
    folder = tmp_path / "b" / "step-00000001"
    (folder / "state.json").write_text("{")
    _rehashed(folder)
    with pytest.raises(CheckpointError, match=r"corrupt checkpoint: .*state.json is not JSON"):
        checkpoint.load(tmp_path / "b")


def test_config_mismatch_names_the_fields(tmp_path):
    model, opt = _trained()
    save_checkpoint(tmp_path / "ck", model, opt, step=1)
    other = GPT(GPTConfig(**{**TINY.to_dict(), "n_embd": 16}))
    with pytest.raises(CheckpointError, match="n_embd: 8 in the checkpoint, 16 here"):
        load_checkpoint(tmp_path / "ck", other, AdamW(other.named_parameters()))
    f64 = GPT(TINY, dtype="float64")
    with pytest.raises(CheckpointError, match="dtype: 'float32' in the checkpoint"):
        load_checkpoint(tmp_path / "ck", f64)
    # dense vs Mixture of Experts, both ways: moe_experts alone (not a parameter-name list
    # from a MoE checkpoint, not six moe_* lines from a dense one)
    moe = GPT(GPTConfig(**{**TINY.to_dict(), "moe_experts": 2}))
    with pytest.raises(CheckpointError, match=r"\): moe_experts: 0 in the checkpoint, 2 here \("):
        load_checkpoint(tmp_path / "ck", moe)
    save_checkpoint(tmp_path / "moe", moe, AdamW(moe.named_parameters()), step=1)
    dense = GPT(TINY)
    with pytest.raises(CheckpointError, match=r"\): moe_experts: 2 in the checkpoint, 0 here \("):
        load_checkpoint(tmp_path / "moe", dense)
    # two Mixtures of Experts compare their moe_* fields: top-k routing holds the same
    # parameters, but the checkpoint's weights were trained to route to one expert
    top2 = GPT(GPTConfig(**{**TINY.to_dict(), "moe_experts": 2, "moe_top_k": 2}))
    with pytest.raises(CheckpointError, match=r"\): moe_top_k: 1 in the checkpoint, 2 here \("):
        load_checkpoint(tmp_path / "moe", top2)
    # another optimizer alone: said so, without the model flags' hint (first-use walk 39)
    from minidist.optim import SGD
    with pytest.raises(CheckpointError, match=r"\): optimizer: AdamW in the checkpoint, SGD "
                       r"here \(--amp must match\); one optimizer's state is not another's: "
                       r"load it into AdamW, or start the new optimizer from the model "
                       r"alone \(train_gpt.py --init-from\)$"):
        load_checkpoint(tmp_path / "ck", model, SGD(model.named_parameters()))


@pytest.mark.parametrize("fmt", ["plain", "zero"])
def test_load_only_reads_the_named_parameters_and_keeps_the_scaler(tmp_path, fmt):
    """checkpoint.load(only=names), as a pipeline stage or an expert-parallel rank reads:
    just those parameters, their optimizer arrays and scalars; an optimizer entry that is no
    parameter (the loss scaler's) kept; everything equal to the same names of a whole read.
    The plain format and ZeRO's shards (read by name, the others never assembled)."""
    if fmt == "plain":
        model, opt = _trained()
        sd = opt.state_dict()
        sd["state"]["loss_scaler"] = {"scale": 1024.0, "good_steps": 3}
        checkpoint.save(tmp_path, dict(model.state_dict()), sd,
                        checkpoint.make_meta(TINY, "float32", opt, 2, {}, {}))
    else:
        strategy, model, opt = _zero_one_rank()
        x = np.random.default_rng(0).integers(0, 16, (2, 8))
        strategy.forward_backward(model, x, x, 1.0, False)       # one step: AdamW's moments
        strategy.sync_grads(model)
        opt.step()
        strategy.save(str(tmp_path), model, opt, 1, {}, {})
    names = [n for n, _ in model.named_parameters()]
    only = {names[0], names[-1]}
    whole, whole_sd, _ = checkpoint.load(tmp_path)
    got, got_sd, _ = checkpoint.load(tmp_path, only=only)
    assert set(got) == only and set(whole) == set(names)
    for n in only:
        np.testing.assert_array_equal(got[n], whole[n])
    kept = {n for n in whole_sd["state"] if n in only or n not in names}
    assert set(got_sd["state"]) == kept
    for n in kept:
        assert got_sd["state"][n].keys() == whole_sd["state"][n].keys()
        for k, v in whole_sd["state"][n].items():
            np.testing.assert_array_equal(got_sd["state"][n][k], v)
    assert all("exp_avg" in got_sd["state"][n] for n in only)
    assert len(whole_sd["state"]) > len(kept)              # the others' were there to drop
    if fmt == "plain":
        assert got_sd["state"]["loss_scaler"] == {"scale": 1024.0, "good_steps": 3}
