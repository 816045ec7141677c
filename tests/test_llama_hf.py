"""A Llama as Hugging Face's Llama folder (minidist/nn/pretrained_llama.py): saved with
LlamaConfig's config.json and Hugging Face's tensor names and loaded back to the same logits;
folders minidist cannot compute refused; transformers 5's rope_parameters; an untied head
refused; a trained Llama exported and starting a new run; norm_eps and the MLP's width kept
with the folder; a sharded folder read.
"""
import os
import subprocess
import sys

import numpy as np
import pytest

from minidist.nn.config import GPTConfig
from minidist.nn.gpt import GPT
from mpirun import ROOT, mpi_env
from tests.llama_cases import _train, llama


def test_a_llama_saves_as_hugging_faces_llama_and_loads_back(tmp_path):
    """config.json is LlamaConfig's; the tensors are Hugging Face's names in (out, in)
    layout (q_proj is c_attn's first nh hs columns, transposed; gate_proj c_fc's first F);
    from_pretrained gives the same logits."""
    import json
    from minidist.nn.pretrained import save_state_pretrained
    from minidist.nn.safetensors import load_file
    config = llama(n_kv_head=1, rope_theta=500.0, block_size=16)
    model = GPT(config, seed=5, dtype="float64")
    model.save_pretrained(str(tmp_path), dtype="float64")
    hf = json.loads((tmp_path / "config.json").read_text())
    assert hf["model_type"] == "llama" and hf["architectures"] == ["LlamaForCausalLM"]
    assert (hf["num_key_value_heads"], hf["intermediate_size"], hf["rope_theta"],
            hf["tie_word_embeddings"]) == (1, config.ffn_size, 500.0, True)
    assert hf["torch_dtype"] == "float64"          # the stored weights' (walk 38: "float32")
    assert hf["bos_token_id"] is None               # a toy vocabulary, no tokenizer given
    save_state_pretrained(config, model.state_dict(), str(tmp_path / "t"), "float64", eot_id=60)
    told = json.loads((tmp_path / "t" / "config.json").read_text())
    assert told["bos_token_id"] == told["eos_token_id"] == 60
    raw, _ = load_file(str(tmp_path / "model.safetensors"))
    p = {n: q.data for n, q in model.named_parameters()}
    attn, fc = p["transformer.h.1.attn.c_attn.weight"], p["transformer.h.1.mlp.c_fc.weight"]
    np.testing.assert_array_equal(raw["model.layers.1.self_attn.q_proj.weight"], attn[:, :32].T)
    np.testing.assert_array_equal(raw["model.layers.1.self_attn.v_proj.weight"], attn[:, 40:].T)
    np.testing.assert_array_equal(raw["model.layers.1.mlp.up_proj.weight"],
                                  fc[:, config.ffn_size:].T)
    assert raw["model.layers.1.self_attn.k_proj.weight"].shape == (8, 32)
    assert "lm_head.weight" not in raw and len(raw) == 2 + 9 * config.n_layer
    back = GPT.from_pretrained(str(tmp_path), dtype="float64")
    assert back.config == config
    for name, q in back.named_parameters():
        np.testing.assert_array_equal(q.data, p[name])
    idx = np.random.default_rng(2).integers(0, 40, (2, 16))
    np.testing.assert_allclose(back(idx)[0].data, model(idx)[0].data, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("field, value, says", [
    ("attention_bias", True, "attention_bias True is not what"),
    ("rope_scaling", {"type": "linear", "factor": 2.0}, "rope_scaling"),
    ("hidden_act", "gelu", "hidden_act 'gelu'"),
    # transformers 5's field (walk 38: Llama 3's scaling read as plain RoPE at theta 10000)
    ("rope_parameters", {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0},
     "rope_parameters"),
])
def test_a_llama_folder_minidist_cannot_compute_is_refused(tmp_path, field, value, says):
    import json
    GPT(llama(), seed=0).save_pretrained(str(tmp_path))
    hf = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**hf, field: value}))
    with pytest.raises(ValueError, match=says):
        GPT.from_pretrained(str(tmp_path))


def test_transformers_5s_rope_parameters_give_rope_theta(tmp_path):
    """A folder transformers 5 wrote keeps RoPE's base in rope_parameters (no top-level
    rope_theta): read from there (walk 38: theta 10000 taken, the logits off by 2e-3)."""
    import json
    GPT(llama(rope_theta=100.0), seed=0).save_pretrained(str(tmp_path))
    hf = json.loads((tmp_path / "config.json").read_text())
    del hf["rope_theta"]
    hf["rope_parameters"] = {"rope_theta": 100.0, "rope_type": "default"}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    assert GPT.from_pretrained(str(tmp_path)).config.rope_theta == 100.0


def test_an_untied_llama_head_is_refused(tmp_path):
    from minidist.nn.safetensors import load_file, save_file
    GPT(llama(), seed=0).save_pretrained(str(tmp_path))
    raw, _ = load_file(str(tmp_path / "model.safetensors"))
    raw = {n: np.array(a) for n, a in raw.items()}           # off the file (memory-mapped)
    raw["lm_head.weight"] = raw["model.embed_tokens.weight"] + 1
    save_file(raw, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="lm_head.weight different from model.embed_tokens"):
        GPT.from_pretrained(str(tmp_path))


def test_a_trained_llama_exports_and_starts_a_new_run(tmp_path):
    """train --arch llama --save; export_gpt2.py writes a Llama folder; --init-from it takes
    the block (no --arch given), and refuses an --arch that differs."""
    ck, out = tmp_path / "ck", tmp_path / "hf"
    small = ["--n-layer", "1", "--n-embd", "32", "--block-size", "16", "--batch-size", "4",
             "--eval-iters", "1", "--dtype", "float64"]
    first = _train(*small, "--arch", "llama", "--n-kv-head", "2", "--steps", "3",
                   "--save", str(ck))
    assert first.returncode == 0, first.stderr
    exp = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "export_gpt2.py"),
                          "--resume", str(ck), "--out", str(out), "--dtype", "float32"],
                         cwd=ROOT, env=mpi_env(), capture_output=True, text=True, timeout=120)
    assert exp.returncode == 0, exp.stderr
    assert "; no tokenizer: the model reads bytes (id = the byte's value" in exp.stdout  # walk 38
    again = _train(*small, "--init-from", str(out))
    assert again.returncode == 0, again.stderr
    assert "arch='llama', n_kv_head=2" in again.stdout and "init: the weights of" in again.stdout
    wrong = _train(*small, "--init-from", str(out), "--arch", "gpt2")
    assert wrong.returncode != 0 and "--arch gpt2: its model has arch llama" in wrong.stderr
    longer = _train(*small[:4], "--block-size", "32", *small[6:], "--init-from", str(out))
    assert longer.returncode == 0, longer.stderr          # rotary positions: no table to outgrow
    assert "(RoPE past the 16 positions it was trained on: --rope-theta raises its base)" \
        in longer.stdout, longer.stdout
    # walk 38: a long-context fine-tune raises RoPE's base, which no parameter holds; it was
    # refused as a size ("its model has rope_theta 10000.0")
    stretched = _train(*small[:4], "--block-size", "32", *small[6:], "--init-from", str(out),
                       "--rope-theta", "40000")
    assert stretched.returncode == 0, stretched.stderr
    assert "rope_theta=40000.0" in stretched.stdout and \
        "(RoPE past the 16 positions it was trained on, theta 40000 for its 10000)" \
        in stretched.stdout, stretched.stdout


def test_norm_eps_and_the_mlps_width_travel_with_the_folder(tmp_path):
    """A Llama's rms_norm_eps (Hugging Face's default 1e-6) and a GPT-2's n_inner and
    layer_norm_epsilon are written and read back: the same model, not 1e-5 and 4C."""
    import json
    for config in (llama(norm_eps=1e-6), GPTConfig(n_layer=1, n_head=2, n_embd=16,
                                                   vocab_size=30, ffn_hidden=40, norm_eps=1e-6)):
        folder = tmp_path / config.arch
        GPT(config, seed=0).save_pretrained(str(folder))
        hf = json.loads((folder / "config.json").read_text())
        assert 1e-6 in (hf.get("rms_norm_eps"), hf.get("layer_norm_epsilon"))
        assert GPT.from_pretrained(str(folder)).config == config
    hf = json.loads((tmp_path / "llama" / "config.json").read_text())
    del hf["rms_norm_eps"]                                   # LlamaConfig's default: 1e-6
    (tmp_path / "llama" / "config.json").write_text(json.dumps(hf))
    assert GPT.from_pretrained(str(tmp_path / "llama")).config.norm_eps == 1e-6


def test_a_sharded_folder_is_read_and_an_untied_one_without_a_head_refused(tmp_path):
    """Hugging Face shards a model over 5 GB: model.safetensors.index.json maps each tensor
    to its file. tie_word_embeddings false with no lm_head (Hugging Face would make a new
    head) is refused."""
    import json
    from minidist.nn.safetensors import load_file, save_file
    model = GPT(llama(), seed=1)
    model.save_pretrained(str(tmp_path))
    raw, _ = load_file(str(tmp_path / "model.safetensors"))
    raw = {n: np.array(a) for n, a in raw.items()}
    names = sorted(raw)
    parts = {"model-00001-of-00002.safetensors": names[:7],
             "model-00002-of-00002.safetensors": names[7:]}
    for file, part in parts.items():
        save_file({n: raw[n] for n in part}, str(tmp_path / file), metadata={"format": "pt"})
    (tmp_path / "model.safetensors").unlink()
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {n: f for f, part in parts.items() for n in part}}))
    back = GPT.from_pretrained(str(tmp_path))
    for name, p in model.named_parameters():
        np.testing.assert_array_equal(dict(back.named_parameters())[name].data, p.data)
    hf = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**hf, "tie_word_embeddings": False}))
    with pytest.raises(ValueError, match="tie_word_embeddings false .* no lm_head.weight"):
        GPT.from_pretrained(str(tmp_path))
