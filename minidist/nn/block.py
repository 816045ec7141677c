"""GPT-2's transformer block, read bottom-up: attention -> MLP -> Block (pre-LN, tanh GELU);
with GPTConfig arch "llama", Llama's: RMSNorm, rotary positions on q and k, a SwiGLU MLP,
and (n_kv_head) grouped-query attention (the ops: minidist/autograd/llama_ops.py).

Dimensions, named once (the model built from these blocks, minidist/nn/gpt.py, uses them too):
    B batch (sequences), T time (tokens per sequence, <= block_size), C n_embd,
    nh n_head, hs = C // nh head size, V vocab_size, L n_layer, nkv k and v heads (nh
    unless grouped-query), F the MLP's hidden width (4C; SwiGLU: about 8C/3).

Each layer takes a `layers` factory that makes its linear layers and norms: DenseLayers
(minidist/nn/layers.py) by default, tensor parallelism's split ones (minidist/tp/model.py)
otherwise, so one class serves both. The parameter names are GPT-2's (`attn.c_attn`,
`mlp.c_fc`, ...): GPT puts block i at `transformer.h.i`.
Tests: tests/test_gpt.py, tests/test_llama.py (the Llama-style block).
"""
from minidist.autograd import fused as F
from minidist.autograd.flash import tiled_self_attention
from minidist.autograd.fusions import bias_gelu
from minidist.autograd.llama_ops import repeat_kv, rotary, swiglu
from minidist.backend import xp_of
from minidist.nn.config import uses_tiled
from minidist.nn.layers import DenseLayers, Dropout
from minidist.nn.module import Module
from minidist.nn.moe import MoE


class CausalSelfAttention(Module):
    context = None      # context parallelism's RingContext (minidist/cp/context.py), or None
    cache = None        # sampling's LayerCache (minidist/nn/kv_cache.py), or None

    def __init__(self, config, dtype="float32", layers=None):
        super().__init__()
        layers = layers or DenseLayers(config, dtype)
        C, widths = config.n_embd, config.qkv_widths                  # q | k | v
        self.c_attn = layers.column(C, sum(widths), blocks=widths)
        self.c_proj = layers.row(C, C)
        self.attn_dropout = Dropout(config.dropout)
        self.resid_dropout = Dropout(config.dropout)
        self.n_head, self.n_kv_head = layers.heads, layers.kv_heads
        self.attention, self.attention_block = config.attention, config.attention_block
        self.rope_theta = config.rope_theta if config.llama else None    # None: no RoPE

    def uses_tiled(self, T):
        """Tiled (no (T, T) matrix) or materialised attention for a sequence of length T."""
        return uses_tiled(self.attention, T)

    def positions(self, T, xp):
        """The global positions (T,) of the T tokens in hand (RoPE's angles): 0..T-1, or this
        cp rank's (zig-zag) ones under context parallelism."""
        if self.context is not None and self.context.active:
            return xp.asarray(self.context.positions())
        return xp.arange(T)

    def forward(self, x):                                          # (B, T, C)
        qkv = self.c_attn(x)                                       # (B, T, (nh + 2 nkv) hs)
        if self.cache is not None:                                 # sampling: new tokens only
            y = self.cache.attend(qkv, self.n_head, self.n_kv_head, self.rope_theta)
            return self.resid_dropout(self.c_proj(y))              # (B, T, C)
        if self.rope_theta is not None:                            # turn q and k by position
            pos = self.positions(qkv.shape[1], xp_of(qkv.data))
            qkv = rotary(qkv, self.n_head, self.n_kv_head, pos, self.rope_theta)
        p, rng = (self.attn_dropout.p if self.training else 0.0), self.attn_dropout.rng
        if self.context is not None and self.context.active:       # --cp: ring attention;
            y = self.context.self_attention(qkv, self.n_head, p, rng,      # k, v repeated
                                            self.n_kv_head)        # after they travel
            return self.resid_dropout(self.c_proj(y))              # (B, T/cp, C)
        qkv = repeat_kv(qkv, self.n_head, self.n_kv_head)          # (B, T, 3C)
        if self.uses_tiled(qkv.shape[1]):                          # T (whole, under SP too)
            y = tiled_self_attention(qkv, self.n_head, self.attention_block, p, rng)
        else:                                                      # dropout on the weights
            y = F.causal_self_attention(qkv, self.n_head, p, rng,  # (B, T, C)
                                        recompute=self.attention == "recompute")
        return self.resid_dropout(self.c_proj(y))                  # (B, T, C)


class MLP(Module):
    """c_proj(act(c_fc(x))): GPT-2's act is GELU (c_fc C -> F); Llama's SwiGLU, whose c_fc
    (C -> 2F) holds the gate and up projections side by side, [gate | up]."""

    def __init__(self, config, dtype="float32", layers=None):
        super().__init__()
        layers = layers or DenseLayers(config, dtype)
        C, F, self.swiglu = config.n_embd, config.ffn_size, config.llama
        self.c_fc = layers.column(C, 2 * F, blocks=2) if self.swiglu else \
            layers.column(C, F)
        self.c_proj = layers.row(F, C)
        self.dropout = Dropout(config.dropout)

    def forward(self, x):                                          # (B, T, C)
        h = self.activation(self.c_fc.matmul(x), self.c_fc.bias)   # (B, T, F)
        return self.dropout(self.c_proj(h))                        # (B, T, C)

    def activation(self, h, b):
        """h = x W_fc (a fresh matmul output) and c_fc's bias b (or None) -> (..., F):
        gelu(h + b), or SwiGLU's silu(gate) * up of h + b = [gate | up]."""
        if self.swiglu:
            return swiglu(h if b is None else h + b)
        return bias_gelu(h, b)                                     # gelu(xW + b), one pass


class Block(Module):
    """Pre-LN residual block: x + attn(ln_1(x)), then x + mlp(ln_2(x)). Block `layer`'s mlp
    is a Mixture of Experts (minidist/nn/moe.py) where config.is_moe(layer)."""

    def __init__(self, config, dtype="float32", layer=0, layers=None):
        super().__init__()
        layers = layers or DenseLayers(config, dtype)
        self.ln_1 = layers.norm()
        self.attn = CausalSelfAttention(config, dtype, layers)
        self.ln_2 = layers.norm()
        # a Mixture of Experts keeps whole experts under tensor parallelism too (each tp rank
        # routes and runs the same tokens, or its own under sequence parallelism:
        # minidist/nn/moe_split.py; minidist/ep/ shards them over ranks); its shared experts
        # are one MLP of this block's layers, split by tp as a dense block's
        shared = config.shared_expert()
        self.mlp = MoE(config, MLP, dtype, shared and MLP(shared, dtype, layers)) \
            if config.is_moe(layer) else MLP(config, dtype, layers)

    def forward(self, x):                                          # (B, T, C)
        x, h = self.ln_2.add_norm(x, self.attn(self.ln_1(x)))      # x + attn(..), ln_2 of it
        return x + self.mlp(h)                                     # (B, T, C)

    def with_router_loss(self, x):
        """(forward(x), the MoE's router loss of that forward): an MoE block's two outputs
        for activation checkpointing (GPT.run_block, minidist/nn/gpt.py)."""
        return self(x), self.mlp.router_loss()
