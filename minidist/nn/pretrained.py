"""GPT-2 interop: a directory Hugging Face's `GPT2LMHeadModel.from_pretrained(dir)` loads as is,
and the reverse, including the real GPT-2 checkpoints (gpt2, gpt2-medium, ...) a user downloaded.

    dir/config.json         GPT2Config fields: n_layer, n_head, n_embd, n_positions, vocab_size,
                            activation_function "gelu_new" (the tanh GELU), tie_word_embeddings
    dir/model.safetensors   our state dict as is: same names ("transformer.h.0.attn.c_attn
                            .weight"), same (in, out) layout as GPT-2's Conv1D, no lm_head.weight
                            (tied to transformer.wte.weight, as HF writes it), metadata
                            {"format": "pt"} (HF refuses files without it)

Reading accepts names with or without the "transformer." prefix (the original GPT-2 upload has
none), skips the causal-mask buffers `h.N.attn.bias` / `h.N.attn.masked_bias` that old files
carry, and checks lm_head.weight, if present, equals wte. A model with `bias=False` is written
with zero biases (HF's GPT-2 always has them; the function is the same) and "minidist_bias":
false in config.json, which we read back.
Tests: tests/test_pretrained.py.
"""
import json
import os

import numpy as np

from minidist import backend
from minidist.nn.config import GivenWeights
from minidist.nn.pretrained_llama import from_hf_llama, hf_llama_config, llama_config, \
    to_hf_llama
from minidist.nn.safetensors import load_file, save_file

_PREFIX = "transformer."


def special_token_id(config, eot_id=None):
    """config.json's bos/eos id: the tokenizer's <|endoftext|> id where the export has a
    tokenizer (`eot_id`), else GPT-2's 50256 for a model of GPT-2's vocabulary, else None
    (first-use walk 38: a Llama folder said null beside a BPE that has <|endoftext|>)."""
    if eot_id is not None:
        return int(eot_id)
    return 50256 if config.vocab_size == 50257 else None


def hf_config(config, dtype="float32", eot=None):
    """GPT2Config's fields (config.json) for a GPTConfig whose weights are stored in
    `dtype` (its torch_dtype: walk 38 found bfloat16 weights said float32); `eot`: the
    bos/eos id (special_token_id)."""
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": config.vocab_size, "n_positions": config.block_size,
        "n_ctx": config.block_size, "n_embd": config.n_embd, "n_layer": config.n_layer,
        "n_head": config.n_head,
        "n_inner": None if config.ffn_size == 4 * config.n_embd else config.ffn_size,
        "activation_function": "gelu_new",
        "resid_pdrop": config.dropout, "embd_pdrop": config.dropout,
        "attn_pdrop": config.dropout, "layer_norm_epsilon": config.norm_eps,
        "initializer_range": 0.02, "scale_attn_weights": True, "use_cache": True,
        "tie_word_embeddings": True, "torch_dtype": str(np.dtype(dtype)),
        "bos_token_id": eot, "eos_token_id": eot,
        "minidist_bias": config.bias,
    }


def save_pretrained(model, directory, dtype="float32"):
    """Write config.json and model.safetensors (parameters cast to `dtype`) into `directory`."""
    save_state_pretrained(model.config, model.state_dict(), directory, dtype)


def save_state_pretrained(config, params, directory, dtype="float32", eot_id=None):
    """save_pretrained of plain data: a GPTConfig and {name: array} of the whole model (as a
    sharded strategy gathers it); `eot_id`: the tokenizer's <|endoftext|> id, config.json's
    bos/eos (special_token_id)."""
    from minidist.nn.config import gpt_param_specs
    from minidist.nn.config import GPTConfig
    lost = unwritten_fields(config)
    if lost:
        raise ValueError(f"save_pretrained: {lost}; the folder would hold another model")
    state = {n: backend.to_host(a).astype(dtype) for n, a in params.items()}
    if config.llama:              # Hugging Face's Llama: its names, (out, in) layout
        state = to_hf_llama(config, state)
    elif not config.bias:         # HF's GPT-2 always has biases: zeros compute the same
        full = gpt_param_specs(GPTConfig(**{**config.to_dict(), "bias": True}))
        state = {n: state[n] if n in state else np.zeros(shape, dtype)
                 for n, (shape, _) in full.items()}
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".model.safetensors.tmp{os.getpid()}")
    save_file(state, tmp, metadata={"format": "pt"})
    os.replace(tmp, os.path.join(directory, "model.safetensors"))
    eot = special_token_id(config, eot_id)
    fields = (hf_llama_config(config, dtype, eot) if config.llama
              else hf_config(config, dtype, eot))
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(fields, f, indent=2)


# how a run computes, not which model it is: a folder need not keep them
RUN_FIELDS = ("dropout", "attention", "attention_block", "vocab_multiple")


def unwritten_fields(config):
    """What config.json cannot say of `config`, as one sentence, or "": the fields that
    read back (read_config's way) from the fields hf_config / hf_llama_config write differ
    from the model's, RUN_FIELDS aside. A round trip, not a list of fields: a field added to
    GPTConfig that the writers do not carry is found (first-use walk 39: a model of a new
    activation was exported as GELU's GPT-2, and --init-from it built another model)."""
    fields = hf_llama_config(config) if config.llama else hf_config(config)
    back = (llama_config if config.llama else _gpt2_config)(fields, "config.json")
    ours, read = _meaning(config), _meaning(back)
    lost = [f"{k} {ours[k]!r}" for k in ours if read.get(k) != ours[k]
            and not (k.startswith("moe_") and k != "moe_experts")]     # the experts say it
    if not lost:
        return ""
    kind = "Llama's" if config.llama else "GPT-2's"
    return f"{kind} config.json cannot hold the model's {', '.join(lost)}"


def _meaning(config):
    """config's fields that decide what the weights compute (kv heads and the MLP's width
    resolved: 0 and the default width are one model)."""
    from dataclasses import asdict
    d = {k: v for k, v in asdict(config).items() if k not in RUN_FIELDS
         and not (k.startswith("moe_") and not config.moe_experts)}   # a dense model's
    d.update(n_kv_head=config.kv_heads, ffn_hidden=config.ffn_size)
    return d


INDEX = "model.safetensors.index.json"      # a sharded folder's map: tensor name -> file


def is_gpt2_folder(path):
    """Whether `path` is a folder holding config.json and model.safetensors, or a sharded
    folder's index and its files (what save_pretrained writes, and a Hugging Face GPT-2 or
    Llama download: Hugging Face shards models over 5 GB)."""
    has = lambda f: os.path.isfile(os.path.join(path, f))      # noqa: E731
    return has("config.json") and (has("model.safetensors") or has(INDEX))


def load_tensors(directory):
    """({name: array, memory-mapped}, the file it names in errors) of model.safetensors, or
    of every shard a sharded folder's index lists."""
    path = os.path.join(directory, "model.safetensors")
    if os.path.isfile(path):
        return load_file(path)[0], path
    index = os.path.join(directory, INDEX)
    if not os.path.isfile(index):
        bins = [f for f in os.listdir(directory) if f.endswith((".bin", ".pt", ".pth"))]
        hint = (f" (found {bins}: PyTorch pickles are not read; re-save the model with "
                "safe_serialization=True)" if bins else "")
        raise FileNotFoundError(f"from_pretrained: no model.safetensors (or {INDEX}) in "
                                f"{directory!r}{hint}")
    with open(index) as f:
        files = sorted(set(json.load(f)["weight_map"].values()))
    raw = {}
    for name in files:
        shard = os.path.join(directory, name)
        if not os.path.isfile(shard):
            raise FileNotFoundError(f"from_pretrained: {index} lists {name}, which is not "
                                    f"in {directory!r}")
        raw.update(load_file(shard)[0])
    return raw, index


def read_config(directory):
    """A GPTConfig from a GPT-2 (or Llama: minidist/nn/pretrained_llama.py) config.json."""
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"from_pretrained: no config.json in {directory!r}")
    with open(path) as f:
        hf = json.load(f)
    if hf.get("model_type") == "llama":
        try:
            return llama_config(hf, path)
        except KeyError as e:
            raise ValueError(f"from_pretrained: {path} has no {e.args[0]!r}, which a Llama's "
                             "config.json holds") from None
    if hf.get("model_type", "gpt2") != "gpt2":
        raise ValueError(f"from_pretrained: {path} is a {hf['model_type']!r} model, not "
                         "gpt2 or llama")
    if hf.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
        raise ValueError(f"from_pretrained: activation {hf['activation_function']!r} is not "
                         "GPT-2's tanh GELU")
    return _gpt2_config(hf, path)


def _gpt2_config(hf, path):
    """A GPTConfig from GPT2Config's fields `hf` (config.json at `path`)."""
    from minidist.nn.config import GPTConfig
    try:
        return GPTConfig(n_layer=hf["n_layer"], n_head=hf["n_head"], n_embd=hf["n_embd"],
                         block_size=hf.get("n_positions", hf.get("n_ctx", 1024)),
                         vocab_size=hf["vocab_size"],
                         dropout=float(hf.get("resid_pdrop", 0.0)),
                         bias=bool(hf.get("minidist_bias", True)),
                         ffn_hidden=int(hf.get("n_inner") or 0),
                         norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)))
    except KeyError as e:
        raise ValueError(f"from_pretrained: {path} has no {e.args[0]!r}, which a GPT-2's "
                         "config.json holds") from None


def read_state(directory, config):
    """Our state dict (host arrays, our names) from dir/model.safetensors, checked against
    `config`; errors name the offending tensors."""
    from minidist.nn.config import gpt_param_specs
    raw, path = load_tensors(directory)
    if config.llama:
        state, head = _llama_state(raw, config, path), raw.get("lm_head.weight")
        with open(os.path.join(directory, "config.json")) as f:
            tied = json.load(f).get("tie_word_embeddings", False)    # LlamaConfig's default
        if head is None and not tied:
            raise ValueError(f"from_pretrained: {directory}/config.json says "
                             "tie_word_embeddings false (or leaves it out: Llama's default) "
                             "and the folder has no lm_head.weight: Hugging Face would make "
                             "a new, untrained head; minidist ties the head to embed_tokens "
                             "(set tie_word_embeddings true if that is what it holds)")
        return _checked(state, head, gpt_param_specs(config), path, "model.embed_tokens")
    state = {}
    for name, a in raw.items():
        if name.endswith((".attn.bias", ".attn.masked_bias")) and a.ndim == 4:
            continue                                # old files' causal-mask buffers
        state[name if name.startswith((_PREFIX, "lm_head.")) else _PREFIX + name] = a
    head = state.pop("lm_head.weight", None)
    specs = gpt_param_specs(config)
    if not config.bias:                             # the zero biases save_pretrained added
        for name in [n for n in state if n.endswith(".bias") and n not in specs]:
            if np.any(state.pop(name)):
                raise ValueError(f"from_pretrained: {name} is not zero but config.json says "
                                 "minidist_bias: false")
    return _checked(state, head, specs, path, _PREFIX + "wte")


def _checked(state, head, specs, path, wte):
    """`state` if it holds exactly `specs`' names and shapes and `head` (lm_head.weight, or
    None) equals the embedding (named `wte` in the file); else ValueError naming them."""
    missing = [n for n in specs if n not in state]
    unexpected = [n for n in state if n not in specs]
    if missing or unexpected:
        raise ValueError(f"from_pretrained: {path} does not match the config: missing "
                         f"{missing[:6]}, unexpected {unexpected[:6]}")
    for name, (shape, _) in specs.items():
        if tuple(state[name].shape) != shape:
            raise ValueError(f"from_pretrained: {name} has shape {tuple(state[name].shape)} "
                             f"in {path}, config.json implies {shape}")
    if head is not None and not np.array_equal(head, state[_PREFIX + "wte.weight"]):
        raise ValueError(f"from_pretrained: {path} has an lm_head.weight different from "
                         f"{wte}.weight (an untied head); minidist's GPT ties them")
    return state


def _llama_state(raw, config, path):
    """Our names of a Llama folder's tensors; ValueError names one that is missing."""
    try:
        state = from_hf_llama(config, raw)
    except KeyError as e:
        raise ValueError(f"from_pretrained: {path} has no {e.args[0]} (a Llama of "
                         f"{config.n_layer} layers)") from None
    except ValueError as e:                       # a k_proj not nkv heads wide, ...
        raise ValueError(f"from_pretrained: {path}: its tensors do not fit config.json "
                         f"({e})") from None
    known = {"lm_head.weight"} | {k for k in raw if k.startswith("model.")}
    extra = sorted(set(raw) - known)
    if extra:
        raise ValueError(f"from_pretrained: {path} holds tensors of no Llama: {extra[:6]}")
    return state


def pretrained_weights(directory, config):
    """A GPT-2 folder's parameters (memory-mapped host arrays, GivenWeights: read by name) for
    a model of `config` to start from (gpt_init's `weights`, --init-from): the sizes must be the
    folder's (RoPE's base and the norms' epsilon, which no parameter holds, may differ: a
    new run's to set); a shorter block_size keeps the first rows of wpe (the positions it
    uses), as nanoGPT's crop_block_size does. ValueError names what differs."""
    saved = read_config(directory)
    differ = [f"{k} {getattr(config, k)} (the folder's: {getattr(saved, k)})"
              for k in ("n_layer", "n_head", "n_embd", "vocab_size", "bias", "arch",
                        "kv_heads", "ffn_size")
              if getattr(config, k) != getattr(saved, k)]
    if config.block_size > saved.block_size and not saved.llama:     # (RoPE: any length)
        differ.append(f"block_size {config.block_size} (the folder's wpe has "
                      f"{saved.block_size} positions)")
    if config.moe_experts:
        differ.append(f"moe_experts {config.moe_experts} (the folder's model is dense)")
    if differ:
        raise ValueError(f"{directory}: the model does not fit: " + ", ".join(differ))
    state = read_state(directory, saved)
    if not saved.llama:                             # rotary positions: no table to crop
        state[_PREFIX + "wpe.weight"] = state[_PREFIX + "wpe.weight"][:config.block_size]
    return GivenWeights(state)


def load_pretrained(cls, directory, dtype="float32", dropout=None, vocab_multiple=1):
    """`cls` (GPT) built from a GPT-2 directory, parameters cast to `dtype`, on the device;
    `vocab_multiple` pads wte's rows (GPTConfig.padded_vocab_size: zero rows added here,
    stripped again by save_pretrained, which writes model.state_dict())."""
    config = read_config(directory)
    config.vocab_multiple = vocab_multiple
    if dropout is not None:
        config.dropout = dropout
    state = read_state(directory, config)
    model = cls(config, seed=0, dtype=dtype)
    model.load_state_dict(state)
    return model
