"""GPT-2 with tensor parallelism (and optional sequence parallelism) over a `tp` group.

A block split over 2 ranks (README: Tensor parallelism draws it with sequence parallelism):

    x (B,T,C) -> ln_1 -> f -> c_attn cols [q|k|v of my heads] -> attention (nh/tp heads)
              -> c_proj rows -> g -> + b -> dropout -> + x
              -> ln_2 -> f -> c_fc cols (4C/tp) -> gelu -> c_proj rows -> g -> + b -> ... -> + x

f = identity forward / all-reduce backward, g = all-reduce forward / identity backward
(minidist/tp/region.py): 2 all-reduces of B*T*C per block forward, 2 backward. Under sequence
parallelism f's all-gather and the column matmul are one op keeping only the input's shard
(minidist/tp/gathered.py), for c_attn, c_fc and the head.
The embedding is split by vocabulary (g after the lookup) and the tied output layer uses the
same shard (f before it), feeding a vocabulary-parallel cross-entropy.

The modules are GPT's own (minidist/nn/gpt.py, its blocks minidist/nn/block.py), built by
GPT.__init__ with the parallel layers as the factory (TensorParallelLayers): Block,
CausalSelfAttention and MLP are GPT's classes, GPT's run_blocks and generate run unchanged, so
the parallel model runs the same code.
Parameter names are GPT-2's: each rank's shard keeps the full name, and `Split` (on
`p.tp_split`) glues the shards back into the full tensor. Initialisation cuts each rank's shard
out of `gpt_init`'s full arrays (one parameter at a time), so a TP run starts from the
single-process model's numbers.
Tests: tests/test_tensor_parallel.py (exactness against one process, memory 1/tp, bytes).
"""
import numpy as np

from minidist import backend
from minidist.nn.config import ffn_size, gpt_init
from minidist.nn.gpt import GPT, check_token_ids
from minidist.nn.layers import DenseLayers, Dropout
from minidist.autograd import is_grad_enabled, ops
from minidist.autograd.dropout_keys import DropoutSite
from minidist.nn.moe import MoE
from minidist.tp.region import SEQ_AXIS, TensorParallelRegion, gather_from_tp
from minidist.tp.layers import (ColumnParallelLinear, RowParallelLinear,
                                         SequenceParallelLayerNorm,
                                         SequenceParallelRMSNorm,
                                         VocabParallelEmbedding, vocab_parallel_cross_entropy)


def check_tp_sizes(config, tp, names=("n_head", "n_embd", "tp")):
    """Problems (a list of sentences) with splitting `config` over `tp` ranks; [] if none.
    `names`: what the sentences call the head count, the width and tp (the command line
    passes its flags). The vocabulary needs no check: it is padded to a multiple of tp."""
    head, embd, ranks = names
    problems = []
    kv = config.n_kv_head or config.n_head                           # (a GPTConfig or flags)
    ffn = ffn_size(config.n_embd, config.arch, config.ffn_hidden)
    if config.n_head % tp:
        problems.append(f"{head} {config.n_head} is not divisible by {ranks} {tp} (each rank "
                        f"computes {head} / {ranks} whole attention heads)")
    elif kv % tp:
        problems.append(f"--n-kv-head {kv} is not divisible by {ranks} {tp} (each rank holds "
                        f"whole k and v heads for its q heads)")
    if ffn % tp:
        problems.append(f"the MLP's width {ffn} (--ffn-hidden) is not divisible by {ranks} "
                        f"{tp}")
    if config.n_embd % tp:
        problems.append(f"{embd} {config.n_embd} is not divisible by {ranks} {tp}")
    return problems


class TensorParallelLayers(DenseLayers):
    """GPT's layers split over a TensorParallelRegion: c_attn and c_fc column-parallel (this
    rank's heads' q, k, v; 4C/tp units), the c_proj layers row-parallel, layer norms that
    run on sequence shards under sequence parallelism, the vocabulary-split embedding."""

    def __init__(self, config, region, dtype="float32"):
        super().__init__(config, dtype)
        self.region = region
        self.heads = config.n_head // region.size        # forward: F.causal_self_attention
        self.kv_heads = config.kv_heads // region.size

    def column(self, n_in, n_out, blocks=1):
        return ColumnParallelLinear(n_in, n_out, self.region, self.config.bias, self.dtype,
                                    blocks=blocks)

    def row(self, n_in, n_out):
        return RowParallelLinear(n_in, n_out, self.region, self.config.bias, self.dtype)

    def norm(self):
        c = self.config
        if c.llama:
            return SequenceParallelRMSNorm(c.n_embd, self.region, self.dtype, c.norm_eps)
        return SequenceParallelLayerNorm(c.n_embd, self.region, c.bias, self.dtype, c.norm_eps)

    def token_embedding(self):
        return VocabParallelEmbedding(self.config.vocab_size, self.config.n_embd, self.region,
                                      self.dtype)


class TensorParallelGPT(GPT):
    """This rank's part of GPT over `group` (a ProcessGroup, every rank of it builds one):
    GPT built with TensorParallelLayers. `forward(idx, targets)` returns (this rank's logit
    shard (B, T, V/tp), the loss); with no targets (sampling) the full logits (B, T, V),
    gathered."""

    def __init__(self, config, group, seed=0, dtype="float32", sequence_parallel=False,
                 weights=None, materialize=True):
        """`materialize` False: GPT's (placeholders; ZeRO-3 gives each unit initial_state's
        shards later: minidist/tp/strategy.py build_model)."""
        problems = check_tp_sizes(config, group.size)
        if problems:
            raise ValueError("tensor parallelism: " + "; ".join(problems))
        self.group = group
        self.region = TensorParallelRegion(group, sequence_parallel)
        super().__init__(config, seed, dtype, TensorParallelLayers(config, self.region, dtype),
                         weights, materialize)
        self.mark_replicated()
        for m in self.moe_layers():         # under SP an MoE layer routes over the whole
            m.region = self.region          # sequence (minidist/nn/moe_split.py)

    def mark_replicated(self):
        """tp_split None on the parameters no split layer made: layer norms, wpe, row biases
        (replicated on every rank)."""
        for p in self.parameters():
            p.tp_split = getattr(p, "tp_split", None)

    def init_parameters(self, seed, dtype, weights=None):
        """This rank's shard of each of gpt_init's full arrays, one parameter at a time."""
        self.mark_replicated()
        for name, _ in self.named_parameters():
            self.load_full_state_dict(gpt_init(self.config, seed, names={name}, dtype=dtype,
                                               weights=weights))

    def initial_state(self, names, seed, dtype, weights=None):
        """This rank's shards of gpt_init's full arrays for `names`, as init_parameters
        loads them: what ZeRO-3 gives a model built with materialize=False, a unit at a
        time (one full array held at a time)."""
        params, out = dict(self.named_parameters()), {}
        for name in names:
            out.update(self.local_state(gpt_init(self.config, seed, names={name}, dtype=dtype,
                                                 weights=weights), params))
        return out

    def set_dropout_keys(self, keys):
        """GPT's dropout sites; where a tensor is split, each rank keeps its slice of the
        row's numbers (minidist/autograd/dropout_keys.py DropoutSite): the attention weights
        by head, the residual stream by position when it is sequence-parallel. The experts'
        dropout is on whole rows (MoE's, as GPT's). A pipeline stage has only its part."""
        super().set_dropout_keys(keys)
        t, r, region = self.region.size, self.region.rank, self.region
        experts = {name for name, m in self.named_modules() if isinstance(m, MoE)}
        for name, m in self.named_modules():
            if not isinstance(m, Dropout) or name.rpartition(".")[0] in experts:
                continue
            if name.endswith(".attn_dropout"):                  # (B, nh/tp, T, T)
                m.rng = DropoutSite(keys, name, axis=1, parts=t, index=r)
            else:                                               # (B, T/tp, C) when split
                m.rng = DropoutSite(keys, name, axis=SEQ_AXIS, parts=t, index=r,
                                    active=lambda: region.sharded, seq_axis=SEQ_AXIS)

    # ---- forward: embed and head differ from GPT's; run_blocks is GPT's --------------------
    def embed(self, idx, pos=None):
        """idx (B, T) -> (B, T, C), or this rank's (B, T/tp, C) under sequence parallelism;
        pos (T,): positions (context parallelism: the cp rank's T = Tl of them, of which
        sequence parallelism keeps this tp rank's run, as the reduce-scatter keeps its rows)."""
        idx = self._check_idx(idx)
        self.block_hooks.before_root()                     # ZeRO-3: gather wte, wpe
        T = idx.shape[1]
        # sequence parallelism for training forwards only (it saves the memory of a graph);
        # evaluation and sampling (no_grad, any length) take the f/g path: same numbers
        self.region.begin(T, shard=is_grad_enabled())
        pos = backend.xp_of(idx).arange(T) if pos is None else \
            backend.to_device(pos, backend.xp_of(idx))    # (T,)
        if self.region.sharded:
            n = T // self.region.size
            pos = pos[self.region.rank * n:(self.region.rank + 1) * n]   # my positions
        tok = self.transformer.wte(idx)                    # partial lookups, summed by g
        if self.config.llama:                              # rotary positions, in attention
            return self.transformer.drop(tok)
        wpe = self.region.shared(self.transformer.wpe.weight)
        return self.transformer.drop(tok + ops.embedding(wpe, pos))

    def head(self, x, targets=None):
        """ln_f, then f (or the sequence all-gather, inside gathered_linear) and the tied,
        vocabulary-split output layer: logits (B, T, V/tp) and the vocabulary-parallel loss."""
        self.block_hooks.before_root()                     # ZeRO-3: gather ln_f, wte
        x, wte = self.transformer.ln_f(x), self.transformer.wte
        if self.region.sharded:                            # region.linear: keeps the shard
            logits = self.region.linear(x, wte.weight.T)   # (B, T, V/tp)
        else:
            x = self.region.enter(x)                       # (B, T, C) on every rank
            B, T, C = x.shape
            logits = (x.reshape(B * T, C) @ wte.weight.T).reshape(B, T, -1)  # (B, T, V/tp)
        if targets is None:                                # sampling: the whole row
            full = gather_from_tp(logits, self.group)      # (B, T, V padded)
            return full[:, :, :self.config.vocab_size], None
        check_token_ids(targets, self.config.vocab_size, "targets", ignore=-1)
        targets = backend.to_device(targets, backend.xp_of(logits.data))
        return logits, vocab_parallel_cross_entropy(logits, targets, self.group, wte.start,
                                                    self.config.vocab_size)

    # ---- the full model, gathered or cut ---------------------------------------------------
    def full_state_dict(self, local=None):
        """{name: full host array} of the whole model, in model order, on every rank of the
        group (collective: every rank must call it). `local`: this rank's arrays by name if
        not the parameters' own (ZeRO-3 holds only shards: it gathers them first), in its
        order, names this rank does not hold passed through whole (expert parallelism's
        other experts); {} on every rank of the group: nothing to do, returns {}."""
        local = {n: p.data for n, p in self.named_parameters()} if local is None else local
        if not local:
            return {}
        out, params = {}, dict(self.named_parameters())
        missing = [n for n in params if n not in local]
        if missing:
            raise KeyError(f"full_state_dict: no array for {missing[:6]}")
        for name in local:
            p, mine = params.get(name), backend.to_host(local[name])
            if p is None or p.tp_split is None:      # whole here (or another ep rank's expert)
                out[name] = mine.copy()
                continue
            buf = np.empty((self.group.size,) + mine.shape, mine.dtype)
            self.group.all_gather(buf, np.ascontiguousarray(mine))
            out[name] = p.tp_split.unshard(list(buf))
        return out

    def load_full_state_dict(self, state):
        """Load this rank's shards of full arrays (all of them or some, by name)."""
        self.load_state_dict(self.local_state(state), strict=False)

    def local_state(self, state, params=None):
        """{name: this rank's shard (host)} of full arrays `state` (all or some, by name);
        `params`: dict(self.named_parameters()), if the caller has it."""
        params = dict(self.named_parameters()) if params is None else params
        local = {}
        for name, full in state.items():
            split = getattr(params[name], "tp_split", None)
            full = np.asarray(backend.to_host(full))
            local[name] = full if split is None else split.shard(full, self.group.size,
                                                                 self.group.rank)
        return local

    def save_pretrained(self, directory, dtype="float32"):
        """The FULL model in GPT-2's format, written by rank 0 of the group (collective)."""
        from minidist.nn.pretrained import save_state_pretrained
        full = self.full_state_dict()
        if self.group.rank == 0:
            save_state_pretrained(self.config, full, directory, dtype=dtype)
        self.group.barrier()

    def parameter_counts(self):
        """(parameters this rank holds, parameters of the whole model) for the log."""
        from minidist.nn.config import gpt_param_specs
        full = sum(int(np.prod(shape)) for shape, _ in gpt_param_specs(self.config).values())
        return self.num_parameters(), full

