"""The GPT's description: GPTConfig (sizes, attention kind, vocabulary padding), the name and
shape of every parameter in GPT-2's naming, and the initial values.

`gpt_init(config, seed)` gives the FULL model's initial parameters on the host, by GPT-2 name,
in model order. Each parameter draws from its own stream, `rng([seed, crc32(name)])`, so a
pipeline stage can initialise only its blocks (`names=`) and tensor parallelism can cut shards
out of the full arrays: every layout starts from the same numbers. The model itself:
minidist/nn/gpt.py (its blocks: minidist/nn/block.py). Tests: tests/test_gpt.py.
"""
import functools
import math
import zlib
from dataclasses import asdict, dataclass, fields, replace

import numpy as np

from minidist import backend

ARCHS = ("gpt2", "llama")
# attention.py's (B, nh, T, T) P kept for backward, or computed again there (selective
# recompute); flash.py's tiles
ATTENTIONS = ("auto", "materialized", "tiled", "recompute")
TILED_FROM_T = 256    # "auto": tiled from this length on, where it is faster on the CPU too


def uses_tiled(attention, T):
    """Whether --attention `attention` computes a length-T sequence in tiles (no (T, T)
    matrix): the attention layers' choice, and Ulysses' on its whole-length heads."""
    return T >= TILED_FROM_T if attention == "auto" else attention == "tiled"


@dataclass
class GPTConfig:
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    block_size: int = 1024
    vocab_size: int = 50257
    dropout: float = 0.0
    bias: bool = True         # biases in Linear and LayerNorm layers, as in GPT-2
    attention: str = "auto"           # "tiled": O(T) memory (minidist/autograd/flash.py); "auto":
                                      # tiled for T >= TILED_FROM_T
    attention_block: int = 64         # the tiled attention's tile size
    vocab_multiple: int = 1           # wte's rows padded to a multiple of this (GPUs: 64)
    # Mixture of Experts (minidist/nn/moe.py); 0 experts: the dense GPT-2, unchanged
    moe_experts: int = 0              # E expert MLPs per MoE block, behind a learned router
    moe_top_k: int = 1                # experts each token goes to
    moe_capacity_factor: float = 1.25  # per sequence and expert: ceil(f k T / E) tokens; 0: all
    moe_aux_loss_coef: float = 0.01   # Switch/GShard load-balancing loss, times this
    moe_z_loss_coef: float = 0.0      # router z-loss (ST-MoE), times this
    moe_every: int = 1                # every n-th block is MoE (blocks n-1, 2n-1, ...)
    moe_shared: int = 0               # shared experts: an MLP S x F wide every token runs,
                                      # beside the routed ones (DeepSeekMoE; 0: none)
    # the block's kind: "gpt2" (LayerNorm, GELU MLP, learned positions) or "llama" (RMSNorm,
    # SwiGLU MLP, rotary positions: no wpe; minidist/autograd/llama_ops.py)
    arch: str = "gpt2"
    n_kv_head: int = 0                # k and v heads (grouped-query attention); 0: n_head
    rope_theta: float = 10000.0       # RoPE's base ("llama")
    ffn_hidden: int = 0               # the MLP's hidden width; 0: 4C, or Llama's 8C/3 rounded
                                      # up to a multiple of 64 for SwiGLU
    norm_eps: float = 1e-5            # LayerNorm's / RMSNorm's epsilon (GPT-2, Llama 2: 1e-5)

    def __post_init__(self):
        for name in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size",
                     "vocab_multiple"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"GPTConfig.{name} must be >= 1, not {getattr(self, name)}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head "
                             f"({self.n_head})")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), not {self.dropout}")
        if self.attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {ATTENTIONS}, not {self.attention!r}")
        if int(self.attention_block) < 1:
            raise ValueError(f"attention_block must be >= 1, not {self.attention_block}")
        _check_moe(self)
        _check_arch(self)

    @property
    def llama(self):
        """RMSNorm, SwiGLU and rotary positions (arch "llama") instead of GPT-2's."""
        return self.arch == "llama"

    @property
    def kv_heads(self):
        """The k and v heads: n_kv_head, or n_head (0: plain multi-head attention)."""
        return self.n_kv_head or self.n_head

    @property
    def qkv_widths(self):
        """c_attn's output blocks q | k | v: n_head and twice kv_heads heads of C / n_head."""
        hs = self.n_embd // self.n_head
        return (self.n_head * hs, self.kv_heads * hs, self.kv_heads * hs)

    @property
    def ffn_size(self):
        """The MLP's hidden width F: ffn_hidden, else 4C (GELU) or, for SwiGLU (two input
        matrices, gate and up), Llama's 2/3 of 4C rounded up to a multiple of 64, which
        keeps the MLP's parameter count about GPT-2's."""
        return ffn_size(self.n_embd, self.arch, self.ffn_hidden)

    @property
    def padded_vocab_size(self):
        """vocab_size rounded up to a multiple of vocab_multiple: the rows of wte, so the
        head's matmul runs on aligned tiles (50257 -> 50304). The padding rows are zero, their
        logits -inf (never predicted, never sampled), so their gradient is zero and they stay
        zero; state_dict() leaves them out and load_state_dict() adds them back."""
        m = self.vocab_multiple
        return -(-self.vocab_size // m) * m

    def is_moe(self, i):
        """Whether block i's MLP is a Mixture of Experts (every moe_every-th block)."""
        return self.moe_experts > 0 and (i + 1) % self.moe_every == 0

    def to_dict(self):
        """The fields; without the moe_* ones for a dense model, moe_shared at 0 and those of
        ARCH_DEFAULTS at their defaults (older checkpoints unchanged)."""
        d = asdict(self)
        return {k: v for k, v in d.items()
                if not (k.startswith("moe_") and not self.moe_experts)
                and not (k == "moe_shared" and v == 0)
                and not (k in ARCH_DEFAULTS and v == ARCH_DEFAULTS[k])}

    def shared_expert(self):
        """The config of a MoE block's shared experts, as one MLP moe_shared x F wide (F the
        experts' width, ffn_size), or None without them."""
        if not (self.moe_experts and self.moe_shared):
            return None
        return replace(self, ffn_hidden=self.moe_shared * self.ffn_size)


# the block's fields and their defaults (GPT-2's): a checkpoint leaves out those at these
ARCH_DEFAULTS = {"arch": "gpt2", "n_kv_head": 0, "rope_theta": 10000.0, "ffn_hidden": 0,
                 "norm_eps": 1e-5}


def _check_arch(c):
    if c.arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, not {c.arch!r}")
    if c.n_kv_head < 0 or c.ffn_hidden < 0:
        raise ValueError("n_kv_head and ffn_hidden must be >= 0 (0: the default)")
    if c.n_head % c.kv_heads:
        raise ValueError(f"n_head ({c.n_head}) must be a multiple of n_kv_head "
                         f"({c.n_kv_head}): each kv head serves n_head / n_kv_head q heads")
    if not c.llama and (c.n_kv_head or c.rope_theta != ARCH_DEFAULTS["rope_theta"]):
        raise ValueError("n_kv_head and rope_theta are Llama's block's (arch 'llama'); GPT-2's "
                         "has multi-head attention and learned positions")
    if c.llama and (c.n_embd // c.n_head) % 2:
        raise ValueError(f"rotary positions turn pairs of columns: the head size n_embd / "
                         f"n_head ({c.n_embd // c.n_head}) must be even")
    if not c.rope_theta > 0 or c.rope_theta == float("inf"):
        raise ValueError(f"rope_theta must be a finite number > 0, not {c.rope_theta}")
    if not 0 < c.norm_eps < 1:
        raise ValueError(f"norm_eps must be in (0, 1), not {c.norm_eps}")


def _check_moe(c):
    if c.moe_experts < 0 or (c.moe_experts and c.moe_experts < 2):
        raise ValueError(f"moe_experts must be 0 (dense) or >= 2, not {c.moe_experts}")
    if not c.moe_experts:
        return
    if not 1 <= c.moe_top_k <= c.moe_experts:
        raise ValueError(f"moe_top_k must be in 1..moe_experts ({c.moe_experts}), "
                         f"not {c.moe_top_k}")
    if c.moe_capacity_factor < 0 or c.moe_aux_loss_coef < 0 or c.moe_z_loss_coef < 0:
        raise ValueError("moe_capacity_factor, moe_aux_loss_coef and moe_z_loss_coef must be "
                         ">= 0")
    if not 1 <= c.moe_every <= c.n_layer:
        raise ValueError(f"moe_every must be in 1..n_layer ({c.n_layer}), not {c.moe_every}")
    if c.moe_shared < 0:
        raise ValueError(f"moe_shared must be >= 0 (shared experts), not {c.moe_shared}")


def ffn_size(n_embd, arch="gpt2", ffn_hidden=0):
    """The MLP's hidden width (GPTConfig.ffn_size) of these fields: ffn_hidden, else 4C, or
    for Llama's SwiGLU 8C/3 rounded up to a multiple of 64."""
    if ffn_hidden:
        return ffn_hidden
    return -(-8 * n_embd // (3 * 64)) * 64 if arch == "llama" else 4 * n_embd


def attention_weights(config):
    """The matmul weights of one block's attention, c_attn and c_proj: 4 C^2 in GPT-2, less
    under grouped-query attention (c_attn's k and v nkv heads wide)."""
    C = config.n_embd
    return C * (config.n_head + 2 * config.kv_heads) * (C // config.n_head) + C * C


def mlp_weights(config):
    """The matmul weights of one MLP (an expert's too), c_fc and c_proj: 2 C F (GPT-2: 8 C^2),
    3 C F for SwiGLU (c_fc holds the gate and up projections)."""
    return config.n_embd * config.ffn_size * (3 if config.llama else 2)


# ---- initialisation ------------------------------------------------------------------------

def gpt_param_specs(config):
    """name -> (shape, init) for every parameter, in model order. init is a std (normal),
    "zeros" or "ones". Residual projections get std 0.02 / sqrt(2 L) (GPT-2's scaling: the
    residual stream sums 2 L of them). arch "llama": no wpe (rotary positions), norms
    without bias, c_fc's output [gate | up] (2F columns); n_kv_head: c_attn's output
    q | k | v of nh, nkv, nkv heads."""
    C, V, T, L = config.n_embd, config.vocab_size, config.block_size, config.n_layer
    std, proj_std = 0.02, 0.02 / math.sqrt(2 * L)
    specs = {"transformer.wte.weight": ((V, C), std)}
    if not config.llama:
        specs["transformer.wpe.weight"] = ((T, C), std)
    qkv = (config.n_head + 2 * config.kv_heads) * (C // config.n_head)
    F, fc = config.ffn_size, config.ffn_size * (2 if config.llama else 1)

    def linear(name, n_in, n_out, w_std):
        specs[name + ".weight"] = ((n_in, n_out), w_std)
        if config.bias:
            specs[name + ".bias"] = ((n_out,), "zeros")

    def norm(name):
        specs[name + ".weight"] = ((C,), "ones")
        if config.bias and not config.llama:              # RMSNorm has no bias
            specs[name + ".bias"] = ((C,), "zeros")

    for i in range(L):
        h = f"transformer.h.{i}."
        norm(h + "ln_1")
        linear(h + "attn.c_attn", C, qkv, std)
        linear(h + "attn.c_proj", C, C, proj_std)
        norm(h + "ln_2")
        if config.is_moe(i):        # the router, then E expert MLPs (minidist/nn/moe.py)
            specs[h + "mlp.router.weight"] = ((C, config.moe_experts), std)
            for e in range(config.moe_experts):
                linear(h + f"mlp.experts.{e}.c_fc", C, fc, std)
                linear(h + f"mlp.experts.{e}.c_proj", F, C, proj_std)
            if config.moe_shared:   # the shared experts, one MLP S x F wide
                S = config.moe_shared
                linear(h + "mlp.shared_expert.c_fc", C, S * fc, std)
                linear(h + "mlp.shared_expert.c_proj", S * F, C, proj_std)
            continue
        linear(h + "mlp.c_fc", C, fc, std)
        linear(h + "mlp.c_proj", F, C, proj_std)
    norm("transformer.ln_f")
    return specs


def packed_widths(config, name, shape):
    """The widths of the matrices a block's weight `name` (its whole `shape`, (in, out))
    packs side by side on its last axis, the layers' `blocks` (block.py): c_attn's q | k | v
    (config.qkv_widths), a SwiGLU c_fc's [gate | up] (the MLP's, an expert's, the shared
    experts'); (out,) for any other weight. Muon orthogonalises each on its own, as the
    separate matrices they are (minidist/optim/muon.py)."""
    if name.endswith("attn.c_attn.weight"):
        return config.qkv_widths
    if config.llama and name.endswith("c_fc.weight"):
        return (shape[-1] // 2,) * 2
    return (shape[-1],)


def block_param_specs(config, moe):
    """gpt_param_specs of one block, named as block 0's: a dense one or (`moe`) a Mixture of
    Experts one; the shapes are the model's (the init stds a one-block model's). Every block
    of a model is one of the two, so a planner pricing thousands of layouts counts one block
    of each kind instead of walking every name of the model."""
    return dict(_block_specs(config_key(config), bool(moe)))


def config_key(config):
    """`config`'s field values, in order: a key a cache can hold (GPTConfig is mutable, so
    unhashable), back to a GPTConfig by config_of_key. The planner prices thousands of
    layouts of one model and asks the same things of it for each."""
    return tuple(getattr(config, f.name) for f in fields(config))


def config_of_key(key):
    """The GPTConfig of config_key's `key`."""
    return GPTConfig(**dict(zip((f.name for f in fields(GPTConfig)), key)))


@functools.lru_cache(maxsize=256)
def _block_specs(key, moe):
    """block_param_specs of the config of `key` (config_key; the planner asks the same two
    blocks once per layout it prices, ~130,000 times in one search)."""
    config = config_of_key(key)
    one = replace(config, n_layer=1, moe_every=1, moe_experts=config.moe_experts * moe)
    return tuple((name, spec) for name, spec in gpt_param_specs(one).items()
                 if name.startswith("transformer.h.0."))


def gpt_init(config, seed, names=None, dtype="float32", weights=None):
    """The initial parameters as host numpy arrays: name -> array, in model order.

    Normal draws are made in float64 from `backend.rng([seed, crc32(name)])` and then cast,
    so float32 and float64 runs start from the same numbers (to float32 precision).
    `names` restricts the result to those parameters (a pipeline stage's own).
    `weights`: the parameters to start from instead (--init-from's), read(name) giving one
    whole host array: GivenWeights over GPT-2's published ones (minidist/nn/pretrained.py
    pretrained_weights, memory-mapped), or a minidist checkpoint's, read as asked for
    (minidist/train/gather.py CheckpointWeights). Only `names`' are read, one at a time, so
    a layout holding part of the model (ZeRO-3's unit, a pipeline stage) reads that part;
    each layout cuts its part out of these as out of the draws, so every layout starts from
    the same numbers again.
    """
    out = {}
    for name, (shape, init) in gpt_param_specs(config).items():
        if names is not None and name not in names:
            continue
        if weights is not None:
            a = np.asarray(weights.read(name))
            if a.shape != shape:
                raise ValueError(f"initial weights: {name} has shape {a.shape}, the model "
                                 f"{shape}")
        elif init == "zeros":
            a = np.zeros(shape)
        elif init == "ones":
            a = np.ones(shape)
        else:
            a = backend.rng([seed, zlib.crc32(name.encode())]).standard_normal(shape) * init
        out[name] = a.astype(dtype)
    return out


class GivenWeights:
    """Initial parameters held in a dict ({name: host array}: a GPT-2 folder's, memory-
    mapped), read by name as gpt_init reads a checkpoint's (minidist/train/gather.py
    CheckpointWeights, which makes each array only when read)."""

    def __init__(self, state):
        self.state = state

    def read(self, name):
        """The parameter `name`'s whole host array."""
        return self.state[name]


def padded_wte(state, rows):
    """`state` ({name: array}), its wte given zero rows up to `rows` (a new dict) where it
    has fewer: config.padded_vocab_size's padding, which no draw and no GPT-2 file holds."""
    wte = "transformer.wte.weight"
    if wte not in state or state[wte].shape[0] >= rows:
        return state
    value = backend.to_host(state[wte])
    pad = np.zeros((rows - value.shape[0],) + value.shape[1:], dtype=value.dtype)
    return {**state, wte: np.concatenate([value, pad])}


def model_init(config, seed, names, dtype="float32", weights=None):
    """gpt_init's numbers for `names`, as GPT's parameters hold them (wte's vocabulary
    padded to config.padded_vocab_size): what ZeRO-3 draws a unit at a time for a model
    built with materialize=False (minidist/zero/strategy.py wrap_unbuilt)."""
    return padded_wte(gpt_init(config, seed, names=names, dtype=dtype, weights=weights),
                      config.padded_vocab_size)
