"""safetensors reader/writer against the format's definition, and GPT-2 interop: our directory
has what Hugging Face's GPT2LMHeadModel.from_pretrained reads, and the original GPT-2 upload's
naming (no "transformer." prefix, causal-mask buffers, lm_head) loads back.

No PyTorch or transformers here (the project has none): the files are checked byte by byte
against the format, and config.json field by field against GPT2Config's names."""
import json
import os
import struct

import numpy as np
import pytest

from minidist.nn import GPT, GPTConfig
from minidist.nn.safetensors import SafetensorsError, load_file, save_file

TINY = GPTConfig(n_layer=2, n_head=2, n_embd=8, block_size=6, vocab_size=11)


def test_safetensors_layout_round_trip_and_alignment(tmp_path):
    tensors = {"a": np.arange(3, dtype=np.float32), "b": np.ones((2, 2), np.float64),
               "c": np.array([1, 2], np.int64), "e": np.zeros((0, 3), np.float16)}
    path = tmp_path / "t.safetensors"
    save_file(tensors, path, metadata={"format": "pt"})
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    assert n % 8 == 0 and header["__metadata__"] == {"format": "pt"}
    assert header["a"] == {"dtype": "F32", "shape": [3], "data_offsets": [0, 12]}
    assert header["b"]["dtype"] == "F64" and header["c"]["dtype"] == "I64"
    assert np.frombuffer(raw[8 + n:8 + n + 12], "<f4").tolist() == [0, 1, 2]
    back, meta = load_file(path)
    assert meta == {"format": "pt"}
    for k, v in tensors.items():
        assert back[k].dtype == v.dtype and np.array_equal(back[k], v), k


def test_safetensors_reads_bfloat16(tmp_path):
    x = np.array([1.5, -2.0, 3.25], np.float32)
    bf16 = (x.view(np.uint32) >> 16).astype("<u2")
    blob = json.dumps({"x": {"dtype": "BF16", "shape": [3],
                             "data_offsets": [0, 6]}}).encode()
    (tmp_path / "b.safetensors").write_bytes(struct.pack("<Q", len(blob)) + blob
                                             + bf16.tobytes())
    np.testing.assert_array_equal(load_file(tmp_path / "b.safetensors")[0]["x"], x)


def test_safetensors_rejects_truncated_and_garbage(tmp_path):
    path = tmp_path / "t.safetensors"
    save_file({"a": np.arange(10, dtype=np.float32)}, path)
    path.write_bytes(path.read_bytes()[:-4])
    with pytest.raises(SafetensorsError, match="truncated"):
        load_file(path)
    path.write_bytes(b"\xff" * 64)
    with pytest.raises(SafetensorsError, match="header"):
        load_file(path)


def test_save_pretrained_writes_what_gpt2lmheadmodel_reads(tmp_path):
    model = GPT(TINY, seed=1)
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "gpt2" and config["architectures"] == ["GPT2LMHeadModel"]
    assert (config["n_layer"], config["n_head"], config["n_embd"], config["n_positions"],
            config["vocab_size"]) == (2, 2, 8, 6, 11)
    assert config["activation_function"] == "gelu_new" and config["tie_word_embeddings"]
    assert config["layer_norm_epsilon"] == 1e-5
    tensors, meta = load_file(tmp_path / "model.safetensors")
    assert meta["format"] == "pt"                      # HF refuses a file without it
    assert "lm_head.weight" not in tensors           # tied: HF re-ties it to wte
    assert set(tensors) == {n for n, _ in model.named_parameters()}
    assert tensors["transformer.h.0.attn.c_attn.weight"].shape == (8, 24)   # Conv1D (in, out)
    assert all(t.dtype == np.float32 for t in tensors.values())
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".")]     # no temp left over


def test_from_pretrained_round_trip_same_logits(tmp_path):
    model = GPT(TINY, seed=2)
    model.save_pretrained(tmp_path)
    back = GPT.from_pretrained(tmp_path)
    x = np.array([[1, 2, 3, 4]])
    np.testing.assert_array_equal(model(x)[0].data, back(x)[0].data)
    assert back.config == TINY


def test_from_pretrained_reads_the_original_gpt2_naming(tmp_path):
    """The gpt2 upload: names without "transformer.", 4-D attn.bias mask buffers, lm_head."""
    model = GPT(TINY, seed=3)
    model.save_pretrained(tmp_path)
    tensors, _ = load_file(tmp_path / "model.safetensors")
    old = {n[len("transformer."):]: np.array(t) for n, t in tensors.items()}
    for i in range(TINY.n_layer):
        old[f"h.{i}.attn.bias"] = np.tril(np.ones((1, 1, 6, 6), np.float32))
        old[f"h.{i}.attn.masked_bias"] = np.full((1, 1, 1, 1), -1e4, np.float32)
    old["lm_head.weight"] = old["wte.weight"]
    save_file(old, tmp_path / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((tmp_path / "config.json").read_text())
    del cfg["minidist_bias"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    back = GPT.from_pretrained(tmp_path)
    x = np.array([[5, 1, 0]])
    np.testing.assert_array_equal(model(x)[0].data, back(x)[0].data)


def test_no_bias_model_round_trips_through_zero_biases(tmp_path):
    config = GPTConfig(**{**TINY.to_dict(), "bias": False})
    model = GPT(config, seed=4)
    model.save_pretrained(tmp_path)
    assert "transformer.h.0.mlp.c_fc.bias" in load_file(tmp_path / "model.safetensors")[0]
    back = GPT.from_pretrained(tmp_path)
    assert back.config == config
    x = np.array([[1, 2]])
    np.testing.assert_array_equal(model(x)[0].data, back(x)[0].data)


def test_from_pretrained_errors_name_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        GPT.from_pretrained(tmp_path)
    GPT(TINY).save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "n_embd": 12, "n_head": 2}))
    with pytest.raises(ValueError, match=r"transformer.wte.weight has shape \(11, 8\)"):
        GPT.from_pretrained(tmp_path)
    os.remove(tmp_path / "model.safetensors")
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="PyTorch pickles are not read"):
        GPT.from_pretrained(tmp_path)


def test_padded_vocabulary_is_stripped_on_export_and_added_on_import(tmp_path):
    padded = GPT(GPTConfig(**{**TINY.to_dict(), "vocab_multiple": 64}), seed=2)
    assert padded.transformer.wte.weight.shape == (64, 8)
    padded.save_pretrained(tmp_path)
    back, meta = load_file(tmp_path / "model.safetensors")
    assert back["transformer.wte.weight"].shape == (11, 8)
    assert json.load(open(tmp_path / "config.json"))["vocab_size"] == 11
    plain = GPT.from_pretrained(tmp_path, dtype="float64")
    again = GPT.from_pretrained(tmp_path, dtype="float64", vocab_multiple=64)
    assert again.transformer.wte.weight.shape == (64, 8)
    assert np.array_equal(again.state_dict()["transformer.wte.weight"],
                          padded.state_dict()["transformer.wte.weight"])
    x = np.arange(12).reshape(2, 6) % 11
    logits = [m(x)[0].data for m in (padded, plain, again)]
    assert np.array_equal(logits[1], logits[2])                # float64: padding changes none
    np.testing.assert_allclose(logits[0], logits[1], rtol=1e-5, atol=1e-6)   # float32 model


# every GPTConfig field set off its default, one at a time: (field, value), the llama ones
# on a Llama; a field added to GPTConfig without a row here fails the first test
OFF_DEFAULT = {"n_layer": 3, "n_head": 2, "n_embd": 32, "block_size": 16, "vocab_size": 40,
               "dropout": 0.1, "bias": False, "attention": "tiled", "attention_block": 8,
               "vocab_multiple": 64, "moe_experts": 2, "moe_top_k": 2,
               "moe_capacity_factor": 2.0, "moe_aux_loss_coef": 0.5, "moe_z_loss_coef": 0.1,
               "moe_every": 2, "moe_shared": 1, "arch": "llama", "n_kv_head": 2,
               "rope_theta": 500.0, "ffn_hidden": 48, "norm_eps": 1e-6}
LLAMA_ONLY = ("n_kv_head", "rope_theta")
# a field of yours that Hugging Face's config.json cannot say (a new activation, say) goes here
# too: save_pretrained must refuse a model with it off its default, naming it (walk 40)
UNWRITTEN = ()


def test_a_config_json_keeps_every_field_or_the_export_says_which_it_cannot(tmp_path):
    """First-use walk 39: a model of a field the writers did not carry (a new activation)
    was exported as GELU's GPT-2 without a word. unwritten_fields reads the written
    config.json back: each field either survives the round trip, is a run's choice
    (RUN_FIELDS), or is named, and save_pretrained refuses to write that folder."""
    from dataclasses import fields, replace
    from minidist.nn.pretrained import RUN_FIELDS, read_config, unwritten_fields
    assert {f.name for f in fields(GPTConfig)} == set(OFF_DEFAULT)
    base = GPTConfig(n_layer=2, n_head=4, n_embd=32, block_size=16, vocab_size=40)
    for name, value in OFF_DEFAULT.items():
        extra = ({"arch": "llama", "bias": False} if name in LLAMA_ONLY else
                 {"moe_experts": 4} if name.startswith("moe_") and name != "moe_experts"
                 else {})
        config = replace(base, **{name: value, **extra})
        lost = unwritten_fields(config)
        if name.startswith("moe_"):
            assert lost == "GPT-2's config.json cannot hold the model's moe_experts " + \
                str(config.moe_experts), (name, lost)
        elif name == "arch":                   # a Llama of GPT-2's biases: not Llama's
            assert lost == "Llama's config.json cannot hold the model's bias True", lost
        elif name in UNWRITTEN:
            assert lost == f"GPT-2's config.json cannot hold the model's {name} {value!r}", lost
        else:
            assert lost == "", (name, lost)
    llama = replace(base, arch="llama", bias=False, n_kv_head=2, rope_theta=500.0,
                    ffn_hidden=48, norm_eps=1e-6)
    for i, config in enumerate((llama, replace(base, bias=False, ffn_hidden=48,
                                                norm_eps=1e-6))):
        assert unwritten_fields(config) == ""
        GPT(config, seed=0).save_pretrained(str(tmp_path / str(i)))
        back = read_config(str(tmp_path / str(i)))
        assert {k: v for k, v in back.to_dict().items() if k not in RUN_FIELDS} == \
            {k: v for k, v in config.to_dict().items() if k not in RUN_FIELDS}
    with pytest.raises(ValueError, match="cannot hold the model's bias True; the folder "
                       "would hold another model"):
        GPT(replace(base, arch="llama"), seed=0).save_pretrained(str(tmp_path / "bias"))
    assert not (tmp_path / "bias").exists()
