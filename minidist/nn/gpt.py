"""GPT-2: the model around the blocks (tied embedding, learned positions, final norm, loss).

The blocks (attention -> MLP -> Block, and the dimensions B, T, C, nh, hs, V, L named once)
are in minidist/nn/block.py; read that first, then this. Sampling: minidist/nn/sampling.py.

Contracts other layers build on:
  - `gpt_init(config, seed)` (minidist/nn/config.py, with GPTConfig) gives the FULL model's
    initial parameters on the host, by GPT-2 name, in model order. Each parameter draws from
    its own stream, `rng([seed, crc32(name)])`, so a pipeline stage can initialise only its
    blocks (`names=`) and tensor parallelism can cut shards out of the full arrays: every
    layout starts from the same numbers.
    `GPT(config, seed, dtype)` is built from it and moved to the current device.
  - `forward` is three separate pieces, `embed` -> `run_blocks` -> `head`, so a pipeline
    stage can run only its own.
  - Block hooks (`set_block_hooks`): run_blocks calls `before_block(i)` and `after_block(i, y)`
    around block i, embed and head call `before_root()`. By default they do nothing
    (`BlockHooks`); ZeRO-3 (minidist/zero/stage3.py) gathers the sharded parameters there.
  - The token embedding is one Parameter used twice (lookup and output head); both gradient
    contributions accumulate into its `.grad`.
Save/load in GPT-2's Hugging Face format: minidist/nn/pretrained.py.
Tests: tests/test_gpt.py.
"""
import numpy as np

from minidist import backend
from minidist.autograd import Tensor, is_grad_enabled
from minidist.autograd.dropout_keys import DropoutKeys, DropoutSite
from minidist.autograd.fusions import padded_cross_entropy
from minidist.autograd.recompute import checkpoint
from minidist.nn.block import Block, CausalSelfAttention
from minidist.nn.config import attention_weights, gpt_init, mlp_weights, model_init, padded_wte
from minidist.nn.kv_cache import KVCache
from minidist.nn.layers import DenseLayers, Dropout, Embedding
from minidist.nn.module import Module, ModuleDict, ModuleList, release_parameters
from minidist.nn.moe import MoE, moe_layers
from minidist.nn.moe_bias import RouterBias
from minidist.nn.sampling import generate, sample


class BlockHooks:
    """What GPT's forward calls around its blocks; these do nothing. ZeRO-3's engine
    (ZeroStage3, minidist/zero/stage3.py) has the same three methods and gathers there."""

    def before_root(self):
        """Before embed and head: the parameters outside the blocks are needed."""

    def before_block(self, i):
        """Before block i (counted from 0 in transformer.h) runs."""

    def after_block(self, i, y):
        """Block i's output y -> what the next block gets (y itself here)."""
        return y


class GPT(Module):
    context = None      # context parallelism's RingContext (minidist/cp/context.py), or None

    def __init__(self, config, seed=0, dtype="float32", layers=None, weights=None,
                 materialize=True):
        """`layers`: how the layers are made (DenseLayers, the default; tensor parallelism's
        split ones: minidist/tp/model.py). `weights`: {name: host array} to start from
        instead of `seed`'s draws (gpt_init; --init-from); the dropout keys still follow
        `seed`. `materialize` False: every parameter is left a placeholder (nn/module.py),
        each module's arrays freed as soon as it is made, and no numbers drawn: whoever
        builds the model so gives each parameter gpt_init's numbers later (ZeRO-3 does, a
        unit at a time: minidist/zero/strategy.py wrap_unbuilt), and no rank ever holds the
        whole model."""
        super().__init__()
        self.config = config
        self.materialized = materialize
        self.transformer = self.build_transformer(layers or DenseLayers(config, dtype))
        if materialize:
            self.init_parameters(seed, dtype, weights)
        self.set_dropout_keys(DropoutKeys(seed))
        self.set_router_bias(RouterBias(config))
        self.checkpointing = False
        self.block_hooks = BlockHooks()

    def build_transformer(self, layers):
        """The modules, GPT-2's names (a pipeline stage builds only its part)."""
        config, dtype, made = self.config, layers.dtype, self.made
        return ModuleDict(
            **{name: made(m) for name, m in embeddings(config, layers).items()},
            h=ModuleList([made(Block(config, dtype, i, layers))
                          for i in range(config.n_layer)]),
            ln_f=made(layers.norm()))

    def made(self, module):
        """A module build_transformer just made: as it is, or without its arrays where the
        model is not materialized (the next one is made after these are freed)."""
        return module if self.materialized else release_parameters(module)

    def init_parameters(self, seed, dtype, weights=None):
        """gpt_init's numbers for every parameter this model holds, a block (or a root
        parameter) at a time: each replaces its zeros as it is drawn, so the whole model's
        numbers are never held twice (a dict of them all made the build's peak 2.2 x the
        model's bytes). Not a parameter at a time: each load walks the whole model, and
        12 blocks of 64 experts took 20 s to build so (0.1 s whole)."""
        parts = {}
        for name, _ in self.named_parameters():
            part = name.split(".")[:3] if name.startswith("transformer.h.") else [name]
            parts.setdefault(".".join(part), set()).add(name)
        for names in parts.values():
            state = gpt_init(self.config, seed, names=names, dtype=dtype, weights=weights)
            if set(state) != names:     # (strict=False below: it would keep its zeros)
                raise KeyError(f"init_parameters: gpt_init has no numbers for "
                               f"{sorted(names - set(state))[:8]}")
            self.load_state_dict(state, strict=False)

    def initial_state(self, names, seed, dtype, weights=None):
        """gpt_init's numbers for `names` as this model holds them (wte padded): what ZeRO-3
        gives a model built with materialize=False, a unit at a time (zero/strategy.py)."""
        return model_init(self.config, seed, names, dtype, weights)

    def set_block_hooks(self, hooks):
        """`hooks` (before_root(), before_block(i), after_block(i, y) -> y, as BlockHooks)
        are called by embed, head and run_blocks from now on; None: no hooks."""
        self.block_hooks = BlockHooks() if hooks is None else hooks
        return self

    def tied_copies(self):
        """Parameters of which another rank holds a copy whose gradient is summed with this
        one's (ZeRO cuts each into a unit of its own: minidist/zero/flat.py gpt_units). The
        whole model: none (wte's two uses are one Parameter). A pipeline stage: its wte."""
        return []

    def set_context(self, context):
        """Context parallelism (minidist/cp/context.py): from now on forward hands the whole
        sequence to `context`, and every attention layer uses its ring; None: off."""
        self.context = context
        for m in self.attention_layers():
            m.context = context
        return self

    def attention_layers(self):
        """The attention layers (block.py's CausalSelfAttention), in block order."""
        return [m for _, m in self.named_modules() if isinstance(m, CausalSelfAttention)]

    def set_checkpointing(self, on=True):
        """Activation checkpointing (--ckpt-activations): each block keeps only its input and
        is recomputed inside backward (minidist/autograd/recompute.py). Same numbers."""
        self.checkpointing = bool(on)
        return self

    def set_dropout_keys(self, keys):
        """Every Dropout layer draws from `keys` (minidist/autograd/dropout_keys.py), as the
        site of its name: masks keyed by (step, site, global row), the same in every layout.
        Axis 1 of the (B, T, C) sites is the sequence (context parallelism gives a rank
        scattered positions there); the attention weights' (B, nh, T, T) find theirs by
        global position (flash.py). Tensor parallelism slices some (minidist/tp/model.py)."""
        self.dropout_keys = keys
        for name, m in self.named_modules():
            if isinstance(m, Dropout):
                seq = None if name.endswith(".attn_dropout") else 1    # (B, T, C)
                m.rng = DropoutSite(keys, name, seq_axis=seq)

    def set_router_bias(self, bias):
        """Each MoE layer routes by its block's row of `bias`, a RouterBias of every MoE block
        (minidist/nn/moe_bias.py: auxiliary-loss-free balancing; zeros until updated)."""
        self.router_bias = bias
        for block, m in moe_layers(self).items():
            m.bias = bias.row(block)
        return self

    # ---- the vocabulary padding stays inside the model --------------------------------------
    def state_dict(self):
        """Module's, wte without its padding rows (a view): what GPT-2 and checkpoints hold."""
        state = super().state_dict()
        if WTE in state:
            state[WTE] = state[WTE][:self.config.vocab_size]
        return state

    def load_state_dict(self, state, strict=True):
        """Module's; a wte of vocab_size rows gets the padding rows added, zero."""
        rows = dict(self.named_parameters())[WTE].shape[0] if WTE in state else 0
        return super().load_state_dict(padded_wte(state, rows), strict)

    # ---- forward, in three pieces a pipeline stage can call separately ---------------------
    def forward(self, idx, targets=None):
        """idx (B, T) ints -> logits (B, T, V), and the mean cross-entropy against targets
        (B, T) (-1 = ignore) or None. Under context parallelism (--cp) the context runs
        embed, run_blocks and head on this rank's tokens only."""
        if self.training and self.dropout_keys.rows is None:
            self.dropout_keys.next_step()     # outside train_step: new masks every forward
        if self.context is not None:
            return self.context.forward(self, idx, targets)        # minidist/cp/context.py
        router_losses = []                                         # MoE blocks': one each
        x = self.embed(idx)                                        # (B, T, C)
        x = self.run_blocks(x, router_losses)                      # (B, T, C)
        logits, loss = self.head(x, targets)                       # (B, T, V), loss
        if loss is not None and router_losses:
            loss = loss + moe_loss(router_losses)
        return logits, loss

    def moe_layers(self):
        """The Mixture-of-Experts MLPs (minidist/nn/moe.py), in block order."""
        return [m for _, m in self.named_modules() if isinstance(m, MoE)]

    def embed(self, idx, pos=None):
        """Token plus position embedding: idx (B, T) -> (B, T, C); pos (T,): the tokens'
        positions (default 0..T-1; context parallelism passes this rank's)."""
        idx = self._check_idx(idx)
        self.block_hooks.before_root()                             # ZeRO-3: gather wte, wpe
        T = idx.shape[1]
        xp = backend.xp_of(idx)
        pos = xp.arange(T) if pos is None else backend.to_device(pos, xp)   # (T,)
        tok = self.transformer.wte(idx)                            # (B, T, C)
        if self.config.llama:                          # rotary positions, in each attention
            return self.transformer.drop(tok)
        return self.transformer.drop(tok + self.transformer.wpe(pos))  # (B, T, C)

    def run_blocks(self, x, router_losses=None):
        """x (B, T, C) through every block -> (B, T, C), the block hooks around each;
        router_losses: a list that gets each MoE block's router loss (run_block)."""
        recompute = self.checkpointing and is_grad_enabled()
        hooks = self.block_hooks
        for i, block in enumerate(self.transformer.h):
            hooks.before_block(i)                                  # ZeRO-3: gather block i
            x = self.run_block(block, x, recompute, router_losses)     # (B, T, C)
            x = hooks.after_block(i, x)            # ZeRO-3: re-gather block i in backward
        return x

    def run_block(self, block, x, recompute, router_losses=None):
        """block(x) (B, T, C), kept for backward or, with `recompute`, run again inside it
        (--ckpt-activations), with the dropout keys and the cp ring's layouts (self.context,
        None without --cp) as they were now. An MoE block's router loss (MoE.router_loss) is
        appended to `router_losses` (a list, or None: dropped): under recompute it comes out
        of the checkpoint beside the block's output, so its gradient enters the recompute's
        backward and it is counted once, however often the block runs. In evaluation (not
        self.training) it is not: a val loss is the language model's cross-entropy alone, as
        Megatron-LM and DeepSpeed report it, comparable with a dense model's."""
        moe = isinstance(block.mlp, MoE)
        keys, context = self.dropout_keys, self.context
        if not recompute:
            y = block(x)                                           # (B, T, C)
            loss = block.mlp.router_loss() if moe else None
        elif moe:
            y, loss = checkpoint(block.with_router_loss, x, block.parameters(), keys, context)
        else:
            y, loss = checkpoint(block, x, block.parameters(), keys, context), None
        if loss is not None and router_losses is not None and self.training:
            router_losses.append(loss)         # (an evaluation's loss: the model's alone)
        return y

    def head(self, x, targets=None):
        """Final LayerNorm and the tied output projection: (B, T, C) -> logits (B, T, V),
        and the loss if targets are given."""
        self.block_hooks.before_root()                             # ZeRO-3: gather ln_f, wte
        x = self.transformer.ln_f(x)                               # (B, T, C)
        B, T, C = x.shape
        w_t = self.transformer.wte.weight.T                        # (C, V), wte reused
        logits = (x.reshape(B * T, C) @ w_t).reshape(B, T, -1)     # (B, T, V padded)
        V = self.config.vocab_size                     # vocab_multiple: columns V.. padding
        loss = None
        if targets is not None:                        # over the first V columns only
            check_token_ids(targets, V, "targets", ignore=-1)
            targets = backend.to_device(targets, backend.xp_of(logits.data))
            loss = padded_cross_entropy(logits, targets, V, ignore_index=-1)
        return (logits[:, :, :V] if logits.shape[-1] > V else logits), loss   # (B, T, V)

    def _check_idx(self, idx):
        idx = idx.data if isinstance(idx, Tensor) else idx
        xp = backend.xp_of(self.transformer.wte.weight.data)
        host = None if backend.is_cupy(idx) else np.asarray(idx)
        idx = backend.to_device(idx if host is None else host, xp)
        if idx.ndim != 2 or idx.dtype.kind not in "iu":
            raise ValueError(f"GPT expects idx of integer dtype and shape (B, T), got "
                             f"{idx.dtype} {tuple(idx.shape)}")
        if idx.shape[1] > self.config.block_size:
            raise ValueError(f"sequence length {idx.shape[1]} exceeds block_size "
                             f"{self.config.block_size}")
        if host is not None:                           # the range on the host copy only
            check_token_ids(host, self.config.vocab_size, "idx")
        return idx

    def flops_per_token(self, T=None):
        """Model FLOPs per trained token (forward + backward) at sequence length T:

            6 * N  +  12 * L * T * C
        N counts the weights that take part in matmuls: each block's c_attn, c_proj, c_fc,
        c_proj (12 C^2 per layer in GPT-2; a Llama-style block's c_attn is narrower under
        grouped-query attention and its SwiGLU c_fc twice F wide) and the tied output head
        (V C); embeddings lookups, biases and norms are not matmuls. Each such weight costs
        2 FLOPs per token forward and 4 backward. Attention's QK^T and AV are 2 * 2 T C per
        token per layer forward, times 3 for forward + backward, counted over the full T x T
        (the causal mask saves nothing in our implementation) -- the PaLM / nanoGPT
        convention. A Mixture-of-Experts block counts its router (C E), the k experts a
        token visits (each an MLP's c_fc and c_proj) in place of the MLP's, and its shared
        experts (moe_shared MLPs' worth)."""
        c = self.config
        T = c.block_size if T is None else T
        C, mlp = c.n_embd, mlp_weights(c)
        n_matmul = c.n_layer * (attention_weights(c) + mlp) + c.vocab_size * C
        n_moe = sum(c.is_moe(i) for i in range(c.n_layer))
        n_matmul += n_moe * (C * c.moe_experts + (c.moe_top_k - 1 + c.moe_shared) * mlp)
        return 6 * n_matmul + 12 * c.n_layer * T * C

    # ---- sampling (minidist/nn/sampling.py) ----------------------------------------------
    def generate(self, idx, n, temperature=1.0, top_k=None, seed=0, stop=None):
        """Append `n` sampled tokens to idx (B, T); returns a host numpy array (B, T + n).
        Deterministic (`seed`), temperature 0 greedy, in eval mode; `stop` cuts it short:
        sampling.generate."""
        return generate(self, idx, n, temperature, top_k, seed, stop)

    def sampling_cache(self):
        """A KVCache for generate (minidist/nn/kv_cache.py): each attention layer keeps its
        tokens' k and v, so each token runs the model on itself alone. None for a Mixture of
        Experts, whose capacity counts the tokens it runs on (one token would drop none)."""
        if self.config.moe_experts:
            return None
        return KVCache(len(self.attention_layers()), self.config.block_size)

    def next_token(self, ctx, temperature, top_k, rng, cache=None):
        """One sampled token per row of ctx (B, T), as a host int64 array (B,): generate's
        step. The pipeline stage overrides this (forward through every stage, sample on the
        last)."""
        return sample(self.last_logits(ctx, cache), temperature, top_k, rng)

    def last_logits(self, ctx, cache=None):
        """The logits (B, V) after the last token of each row of ctx (B, T), on the host; with
        `cache` (sampling_cache's) only the tokens it has not seen run, at their positions."""
        if cache is None:
            x = self.run_blocks(self.embed(ctx))                       # (B, T, C)
        else:
            new, start = cache.new_tokens(ctx)                         # (B, t), t <= T
            self.set_cache(cache)
            try:
                x = self.run_blocks(self.embed(new, np.arange(start, start + new.shape[1])))
            finally:
                self.set_cache(None)
        logits, _ = self.head(x[:, -1:, :])                            # (B, 1, V)
        return backend.to_host(logits.data)[:, -1, :]

    def set_cache(self, cache):
        """Give each attention layer its LayerCache of `cache` (a KVCache), in model order;
        None: none (every forward runs the whole sequence)."""
        for i, m in enumerate(self.attention_layers()):
            m.cache = None if cache is None else cache.layers[i]
        return self

    # ---- GPT-2 checkpoints (minidist/nn/pretrained.py) --------------------------------------
    def save_pretrained(self, directory, dtype="float32"):
        from minidist.nn.pretrained import save_pretrained
        save_pretrained(self, directory, dtype=dtype)

    @classmethod
    def from_pretrained(cls, directory, dtype="float32", dropout=None, vocab_multiple=1):
        from minidist.nn.pretrained import load_pretrained
        return load_pretrained(cls, directory, dtype=dtype, dropout=dropout,
                               vocab_multiple=vocab_multiple)


WTE = "transformer.wte.weight"


def embeddings(config, layers):
    """The modules before the blocks, by GPT-2's names: wte (the token embedding, tied to
    the head), wpe (learned positions; none in a Llama-style model, whose attention turns q
    and k by position), drop."""
    parts = {"wte": layers.token_embedding()}
    if not config.llama:
        parts["wpe"] = Embedding(config.block_size, config.n_embd, dtype=layers.dtype)
    parts["drop"] = Dropout(config.dropout)
    return parts


def check_token_ids(ids, vocab_size, what, ignore=None):
    """Raise ValueError, naming the id and the vocabulary size, if the host array `ids`
    holds a token id outside 0..vocab_size-1 (`ignore`: one more id allowed, the loss's
    ignore_index). numpy raises IndexError on such an id, but CuPy's integer indexing wraps
    it around silently, and the cross-entropy kernels read past the logits; an id in the
    padding rows (vocab_multiple) would be taken silently on both. A device array is not
    checked: reading it would make the CPU wait for the GPU (the batch arrives as numpy)."""
    if backend.is_cupy(ids):
        return
    ids = np.asarray(ids)
    if ids.dtype.kind not in "iu":
        return                               # not ids: the callers refuse these themselves
    bad = ids >= vocab_size
    bad |= (ids < 0) if ignore is None else (ids < 0) & (ids != ignore)
    if bad.any():
        also = "" if ignore is None else f", or {ignore}: ignored"
        raise ValueError(f"{what}: token id {ids[bad].flat[0]} is outside the vocabulary of "
                         f"{vocab_size} tokens (ids 0..{vocab_size - 1}{also}); the data and "
                         f"the model disagree on the vocabulary")


def moe_loss(router_losses):
    """The MoE blocks' router losses (MoE.router_loss: aux_loss_coef x load balancing +
    z_loss_coef x z-loss), summed in block order."""
    total = 0.0
    for loss in router_losses:
        total = total + loss
    return total

