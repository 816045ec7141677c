"""Llama interop: a Llama-style model (GPTConfig arch "llama") as a folder Hugging Face's
`LlamaForCausalLM.from_pretrained(dir)` loads, and the reverse. minidist/nn/pretrained.py
calls these where a config or a config.json is Llama's; the folder's files are the same two.

    config.json             LlamaConfig's fields: hidden_size, intermediate_size,
                            num_hidden_layers, num_attention_heads, num_key_value_heads,
                            max_position_embeddings, rms_norm_eps, rope_theta, hidden_act
                            "silu", tie_word_embeddings true
    model.safetensors       Hugging Face's names and nn.Linear's (out, in) layout:

    ours (x @ W, W (in, out))                 Hugging Face's (W^T, (out, in))
    transformer.wte.weight                    model.embed_tokens.weight (no lm_head: tied)
    transformer.h.i.ln_1.weight               model.layers.i.input_layernorm.weight
    transformer.h.i.attn.c_attn.weight        self_attn.q_proj | k_proj | v_proj (its
                                              columns nh, nkv, nkv heads wide)
    transformer.h.i.attn.c_proj.weight        self_attn.o_proj.weight
    transformer.h.i.ln_2.weight               model.layers.i.post_attention_layernorm.weight
    transformer.h.i.mlp.c_fc.weight           mlp.gate_proj | up_proj (F columns each)
    transformer.h.i.mlp.c_proj.weight         mlp.down_proj.weight
    transformer.ln_f.weight                   model.norm.weight

RoPE needs no permutation: Hugging Face's Llama turns the pairs (i, i + hs/2) of each head
("rotate_half"), as minidist/autograd/llama_ops.py does; Meta's original checkpoints pair
(2i, 2i + 1), and Hugging Face's conversion script permutes q_proj and k_proj into this
order, so its folders are read as they are. Biases (attention_bias, mlp_bias), an lm_head
that differs from the embedding (minidist ties them), rope_scaling and other activations
are refused, naming the field: the model here has none of them. Tests: tests/test_llama_hf.py.
"""
from dataclasses import replace

import numpy as np

_LAYER = "model.layers.{}."
# (our name in block i, Hugging Face's names in layer i it is cut into, along our axis 1)
_BLOCK = (("ln_1.weight", ("input_layernorm.weight",)),
          ("attn.c_attn.weight", ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                  "self_attn.v_proj.weight")),
          ("attn.c_proj.weight", ("self_attn.o_proj.weight",)),
          ("ln_2.weight", ("post_attention_layernorm.weight",)),
          ("mlp.c_fc.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
          ("mlp.c_proj.weight", ("mlp.down_proj.weight",)))
_ROOT = (("transformer.wte.weight", "model.embed_tokens.weight"),
         ("transformer.ln_f.weight", "model.norm.weight"))


def hf_llama_config(config, dtype="float32", eot=None):
    """LlamaConfig's fields (config.json) for a GPTConfig of arch "llama" whose weights are
    stored in `dtype`; `eot`: the bos/eos id (pretrained.special_token_id)."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": config.vocab_size, "hidden_size": config.n_embd,
        "intermediate_size": config.ffn_size, "num_hidden_layers": config.n_layer,
        "num_attention_heads": config.n_head, "num_key_value_heads": config.kv_heads,
        "head_dim": config.n_embd // config.n_head,
        "max_position_embeddings": config.block_size, "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_theta, "rope_scaling": None, "hidden_act": "silu",
        "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0,
        "tie_word_embeddings": True, "initializer_range": 0.02, "use_cache": True,
        "torch_dtype": str(np.dtype(dtype)), "bos_token_id": eot, "eos_token_id": eot,
    }


def _widths(config):
    """Our column blocks of c_attn (q, k, v) and c_fc (gate, up)."""
    hs, F = config.n_embd // config.n_head, config.ffn_size
    return {"attn.c_attn.weight": [config.n_head * hs, config.kv_heads * hs,
                                   config.kv_heads * hs],
            "mlp.c_fc.weight": [F, F]}


def to_hf_llama(config, state):
    """{Hugging Face name: array} of our whole state dict {name: host array}."""
    out = {hf: state[ours] for ours, hf in _ROOT}
    widths = _widths(config)
    for i in range(config.n_layer):
        for ours, names in _BLOCK:
            a = state[f"transformer.h.{i}.{ours}"]
            if a.ndim == 1:                                          # a norm's gain
                out[_LAYER.format(i) + names[0]] = a
                continue
            cuts = np.cumsum(widths.get(ours, [a.shape[1]]))[:-1]
            for name, part in zip(names, np.split(a, cuts, axis=1)):
                out[_LAYER.format(i) + name] = np.ascontiguousarray(part.T)   # (out, in)
    return out


def from_hf_llama(config, raw):
    """Our state dict from a Llama folder's {name: array}; KeyError names a missing one."""
    state = {ours: raw[hf] for ours, hf in _ROOT}
    for i in range(config.n_layer):
        for ours, names in _BLOCK:
            parts = [raw[_LAYER.format(i) + n] for n in names]
            state[f"transformer.h.{i}.{ours}"] = parts[0] if parts[0].ndim == 1 else \
                np.concatenate([p.T for p in parts], axis=1)             # (in, out)
    return state


def llama_config(hf, path):
    """A GPTConfig from LlamaConfig's fields `hf` (config.json at `path`); ValueError names
    a field this model cannot follow. RoPE's base is transformers 4's top-level rope_theta
    or 5's rope_parameters {"rope_theta", "rope_type"} (first-use walk 38: a folder v5 wrote
    was read at theta 10000, its llama3 scaling unrefused)."""
    from minidist.nn.config import GPTConfig
    rope = hf.get("rope_parameters") or {}
    refused = {"hidden_act": hf.get("hidden_act", "silu") != "silu",
               "attention_bias": bool(hf.get("attention_bias")),
               "mlp_bias": bool(hf.get("mlp_bias")),
               "rope_scaling": bool(hf.get("rope_scaling")),
               "rope_parameters": rope.get("rope_type", "default") != "default"}
    C, nh = hf["hidden_size"], hf["num_attention_heads"]
    refused["head_dim"] = hf.get("head_dim", C // nh) != C // nh
    bad = [k for k, v in refused.items() if v]
    if bad:
        raise ValueError(f"from_pretrained: {path}: {bad[0]} {hf.get(bad[0])!r} is not what "
                         "minidist's Llama block computes (SiLU, no biases, plain RoPE, "
                         "head_dim = hidden_size / heads)")
    config = GPTConfig(n_layer=hf["num_hidden_layers"], n_head=nh, n_embd=C,
                       block_size=hf.get("max_position_embeddings", 2048),
                       vocab_size=hf["vocab_size"], bias=False, arch="llama",
                       n_kv_head=0 if hf.get("num_key_value_heads") in (None, nh)
                       else hf["num_key_value_heads"],
                       rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
                       ffn_hidden=hf["intermediate_size"],
                       norm_eps=float(hf.get("rms_norm_eps", 1e-6)))
    default = replace(config, ffn_hidden=0)           # 0 where it is the default width
    return default if default.ffn_size == config.ffn_size else config
