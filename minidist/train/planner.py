"""The memory planner: "which strategy do I need?" Per-rank bytes of parameters, gradients,
optimizer state and activations for DDP, ZeRO-1/2/3, tensor (TP) and pipeline (PP)
parallelism and their mixes, and the first layout in the decision order that fits.

Model states, per rank holding P parameters (what the memory ledger counts: the tests run a
small model under each strategy and compare, tests/test_planner.py):
                        params  grads  optimizer
    float32               4P     4P      8P        AdamW's m and v
    mixed precision       2P     2P     12P        16-bit weights and grads; float32 master,
                                                   m and v in the optimizer (train/amp.py)
    --grad-dtype float32  2P     4P     12P        the same with float32 gradients
                                                   (Layout.grad32: Megatron-LM's main_grad)
    ZeRO-1 shards the optimizer state over dp, ZeRO-2 also the gradients, ZeRO-3 also the
    parameters: ceil(P / dp) each (a flat buffer padded to a multiple of dp).
    --optimizer muon (Layout.muon; minidist/optim/muon.py): a block's matrices (takes_muon)
    keep Muon's momentum M alone, 4 bytes a parameter, not AdamW's m and v: 4 bytes less per
    matrix parameter this rank holds (its state 4 bytes in float32, 8 with --amp's master),
    where the optimizer is per parameter (no ZeRO; the experts under ep without ZeRO too).
    Under ZeRO (any stage; the experts' ZeRO-1 over edp too) the flat v spans the matrices
    as well (zero there): AdamW's bytes. Not counted, as the transients below: Muon's
    scratch U and, under ZeRO, the gathered unit (minidist/zero/muon.py ShardedMuon) and
    NS's temporaries.
    TP (Megatron's layout, minidist/tp/model.py): c_attn and c_fc split by output
    columns (weights and biases), both c_proj by input rows (biases replicated), wte by
    vocabulary rows (padded to a multiple of tp); wpe and the layer norms replicated.
    PP: the blocks in pp contiguous stages (pp/schedule.py block_stages); stage 0 also holds
    wte and wpe, the last stage ln_f and, the head being tied, its own copy of wte.
    Mixture of Experts (config.moe_experts, minidist/nn/moe.py): each MoE block holds E
    expert MLPs and a router; EP (minidist/ep/, ep of the dp ranks) keeps E/ep experts per
    rank; the experts are not split by tp; under ep with ZeRO (any stage) their optimizer
    state is sharded over their dp / ep (x cp) replicas (edp), their parameters and
    gradients whole (ZeRO-1 over edp of one flat unit per block, minidist/ep/optim.py). Their
    activations: the MLP's share of a layer's (9 sbh e of it) times k (each token visits k
    experts; capacity ignored), plus the router's probabilities, sbE e; on the rank's s/cp
    tokens, s/(cp t) under SP (the MoE block runs on the rank's sequence shard:
    minidist/nn/moe_split.py).

Activations per rank: minidist/train/activations.py (Korthikanti et al.'s, minidist's graph's).
Tests: tests/test_planner.py. The table of every layout: run_bill.py plan (what the start-up's
memory check bills, the step's logits and buffers too); CLI: examples/plan_memory.py
(tests/test_planner_cli.py).
"""
import functools
import math
import re
from dataclasses import dataclass, replace

from minidist.nn.config import (GPTConfig, attention_weights, block_param_specs,
                                config_key, config_of_key, gpt_param_specs, mlp_weights)
from minidist.optim.muon import takes_muon
from minidist.pp.schedule import block_stages
from minidist.train.activations import minidist_activation_bytes, stage_activations
from minidist.train.comm_cost import axis_size
from minidist.train.moe_cost import expert_units

GiB = 2 ** 30
STATE_BYTES = {False: (4, 4, 8), True: (2, 2, 12)}   # amp -> bytes/param: params, grads, opt
MUON_SAVES = 4         # bytes per matrix parameter Muon keeps less than AdamW: v (float32)
_COLUMN = ("attn.c_attn.weight", "attn.c_attn.bias", "mlp.c_fc.weight", "mlp.c_fc.bias",
           "shared_expert.c_fc.weight", "shared_expert.c_fc.bias")
_ROW = ("attn.c_proj.weight", "mlp.c_proj.weight", "shared_expert.c_proj.weight")


@dataclass(frozen=True)
class Layout:
    """How one training job is split: dp x tp x pp x cp ranks, ZeRO stage, precision, recompute
    ("none", "selective", "full"), sequence parallelism (with tp), tiled attention (never the
    (T, T) scores: minidist/autograd/flash.py; context parallelism's ring attention is tiled
    too). `ep` (expert parallelism, minidist/ep/) is carved out of the dp ranks (ep divides
    dp), so it is not a factor of gpus; the step-time model prices it in moe_cost.py.
    `cp_attention`: how the cp ranks attend, the ring or Ulysses' all-to-alls
    (--cp-attention; it means nothing with cp 1). `zero_shard` K (hybrid sharding,
    --zero-shard; 0: none): ZeRO shards over each group of K neighbouring dp ranks, the
    groups replicas of each other (minidist/zero/README.md). `overlap_gather` (ZeRO-1/2,
    --overlap-param-gather): the updated parameters' all-gathers behind the next forward.
    `muon` (--optimizer muon): Muon for the blocks' matrices, AdamW the rest (its state: the
    module docstring; its Newton-Schulz and gathers: minidist/train/muon_cost.py); not in the
    name: every row of one plan has the same optimizer, which the planners print once.
    `grad32` (with amp, --grad-dtype float32): float32 gradients, 4 bytes a parameter, in
    memory and in the data-parallel reductions; "fp32 grads" in the name."""
    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero: int = 0
    amp: bool = True
    recompute: str = "none"
    sp: bool = False
    cp: int = 1
    tiled: bool = False
    ep: int = 1                      # experts sharded over ep of the dp ranks (MoE only)
    cp_attention: str = "ring"       # with cp > 1: "ring" or "ulysses" (minidist/cp/ulysses.py)
    zero_shard: int = 0              # with zero > 0: ranks per sharded replica (0: dp x cp)
    overlap_gather: bool = False     # with zero 1 or 2: the all-gathers behind the forward
    muon: bool = False               # --optimizer muon: the blocks' matrices by Muon
    grad32: bool = False             # with amp: --grad-dtype float32, 4-byte gradients

    @property
    def zero_ranks(self):
        """The ranks ZeRO shards the model state over: the shard group's, else dp x cp."""
        return self.zero_shard or self.dp * self.cp

    @property
    def gpus(self):
        return self.dp * self.tp * self.pp * self.cp

    @property
    def keeps_scores(self):
        """Whether the attention keeps (T, T) scores, the ones selective recompute computes
        again: not tiled, and not under cp's ring (its blocks are tiles whatever
        --attention says)."""
        return not self.tiled and not (self.cp > 1 and self.cp_attention == "ring")

    def name(self):
        """e.g. "ZeRO-1 (amp, ckpt)", "TP8+SP x PP2 x ZeRO-1 x4 (amp)", "TP2+SP x CP4 x ZeRO-3
        (amp, tiled)" (dp 1: ZeRO shards over the 4 cp ranks), "CP8u x DDP x8 (amp, tiled)"
        (u: Ulysses' all-to-alls instead of the ring), "ZeRO-3/8 (amp)" (hybrid: sharded
        over each 8 ranks). On one GPU count no two layouts share
        a name (dp alone is all the GPUs; sp is named with tp > 1, the attention with cp > 1,
        where they exist)."""
        parts = []
        if self.tp > 1:
            parts.append(f"TP{self.tp}" + ("+SP" if self.sp else ""))
        if self.pp > 1:
            parts.append(f"PP{self.pp}")
        if self.cp > 1:
            parts.append(f"CP{self.cp}" + ("u" if self.cp_attention == "ulysses" else ""))
        if self.ep > 1:
            parts.append(f"EP{self.ep}")
        data = (f"ZeRO-{self.zero}" + (f"/{self.zero_shard}" if self.zero_shard else "")
                if self.zero else "DDP")
        if not parts:
            parts.append(data)
        elif self.dp > 1 or self.zero:   # ZeRO with dp 1 still shards (over cp, or one rank)
            parts.append(f"{data} x{self.dp}" if self.dp > 1 else data)
        extras = ["amp" if self.amp else "fp32"] + (["fp32 grads"] if self.grad32 else [])
        extras += ["tiled"] if self.tiled else []
        extras += ["gathers overlapped"] if self.overlap_gather else []
        if self.recompute != "none":
            extras.append("ckpt" if self.recompute == "full" else "selective recompute")
        return " x ".join(parts) + " (" + ", ".join(extras) + ")"


_PART = re.compile(r"(TP)(\d+)(\+SP)?|(PP)(\d+)|(CP)(\d+)(u?)|(EP)(\d+)"
                   r"|(?:ZeRO-([0-3])(?:/(\d+))?|(DDP))(?: x(\d+))?", re.IGNORECASE)
_EXTRAS = {"amp": ("amp", True), "fp32": ("amp", False), "tiled": ("tiled", True),
           "gathers overlapped": ("overlap_gather", True), "ckpt": ("recompute", "full"),
           "selective recompute": ("recompute", "selective"),
           "fp32 grads": ("grad32", True)}


def layout_from_name(text, gpus):
    """Layout.name's inverse: {field: value} of the layout a name such as "TP2+SP x PP2 x
    ZeRO-1/8 x4 (amp, tiled)" names on `gpus` ranks (amp and tiled only where it has
    parentheses), or a sentence saying what cannot be read.
    dp is the "xN" after DDP or ZeRO, else 1, or all of `gpus` in a name of data
    parallelism alone ("ZeRO-3/8 (amp)")."""
    head, paren, rest = text.strip().partition("(")
    fields, parts = {"recompute": "none"}, head.strip().split(" x ")
    for part in parts:
        m = _PART.fullmatch(part.strip())
        if m is None:
            return f"cannot read {part.strip()!r} (a part such as TP2+SP, PP2, CP4u, EP2, " \
                   "ZeRO-3/8 x4 or DDP x8)"
        g = m.groups()
        if g[0]:
            fields.update(tp=int(g[1]), sp=bool(g[2]))
        elif g[3]:
            fields["pp"] = int(g[4])
        elif g[5]:
            fields.update(cp=int(g[6]), cp_attention="ulysses" if g[7] else "ring")
        elif g[8]:
            fields["ep"] = int(g[9])
        else:
            fields.update(zero=int(g[10] or 0), zero_shard=int(g[11] or 0),
                          dp=int(g[13] or (gpus if len(parts) == 1 else 1)))
    if paren:
        if not rest.endswith(")"):
            return f"{text!r}: its parentheses are not closed"
        fields["tiled"] = False                 # unless they say it
        for word in filter(None, (w.strip() for w in rest[:-1].split(","))):
            word = word.lower()
            if word not in _EXTRAS:
                return f"cannot read {word!r} in the parentheses (" + ", ".join(_EXTRAS) + ")"
            key, value = _EXTRAS[word]
            fields[key] = value
    return fields


# ---- model states ----------------------------------------------------------------------------

def local_size(name, shape, tp=1):
    """Elements of parameter `name` on one tensor-parallel rank."""
    n = math.prod(shape)
    if tp == 1:
        return n
    if name.endswith(_COLUMN) or name.endswith(_ROW):
        return n // tp
    if name == "transformer.wte.weight":
        return math.ceil(shape[0] / tp) * shape[1]
    return n


@functools.lru_cache(maxsize=4096)
def _block_counts(key, tp, pp, ep, keep=None, v=1):
    """Per pipeline stage, the elements one rank holds of the blocks' parameters of the model
    `key` (config_key) that keep(name, shape) keeps (None: all; an expert's on E/ep ranks),
    per kind of block (dense, MoE), its blocks block_stages' under v chunks a stage; cached,
    as a search asks it for thousands of layouts."""
    config = config_of_key(key)

    def held(specs):
        return sum(local_size(name, shape, tp) if ".mlp.experts." not in name else
                   math.prod(shape) // ep for name, (shape, _) in specs.items()
                   if keep is None or keep(name, shape))
    per_block = {moe: held(block_param_specs(config, moe))
                 for moe in {config.is_moe(i) for i in range(config.n_layer)}}
    counts = [0] * pp
    for i, stage in enumerate(block_stages(config.n_layer, pp, v)):
        counts[stage] += per_block[config.is_moe(i)]
    return tuple(counts)


def stage_params(config, tp=1, pp=1, ep=1, v=1):
    """Parameters on one rank of each pipeline stage (every tp rank of a stage holds as many;
    an expert's on E/ep of the ranks). Counted per kind of block (dense, MoE: the search
    prices thousands of layouts), each block's added to its stage: under interleaving (v
    chunks a stage) the blocks of its chunks (block_stages), which for an MoE model every
    k-th block may hold other counts of MoE blocks than v = 1's stages (they were counted
    so until 2026-11-30)."""
    return list(_stage_params(config_key(config), tp, pp, ep, v))


@functools.lru_cache(maxsize=4096)
def _stage_params(key, tp, pp, ep, v):
    """stage_params of the model `key` (config_key), cached (a search bills every stage)."""
    config = config_of_key(key)
    counts = list(_block_counts(key, tp, pp, ep, None, v))
    outside = {name: spec for name, spec in
               gpt_param_specs(replace(config, n_layer=1, moe_experts=0)).items()
               if not name.startswith("transformer.h.")}
    for name, (shape, _) in outside.items():
        first = name in ("transformer.wte.weight", "transformer.wpe.weight")
        counts[0 if first else -1] += local_size(name, shape, tp)        # else ln_f
    if pp > 1:                                                   # the tied head's copy
        counts[-1] += local_size("transformer.wte.weight",
                                 (config.vocab_size, config.n_embd), tp)
    return tuple(counts)


def stage_block_params(config, tp=1, pp=1, ep=1, v=1):
    """Of stage_params, the blocks' parameters (the experts' among them), per pipeline
    stage: what ZeRO-3 gathers block by block (the rest, the root: embeddings, ln_f)."""
    return list(_block_counts(config_key(config), tp, pp, ep, None, v))


def stage_muon_params(config, tp=1, pp=1, ep=1, v=1):
    """Of stage_params, the parameters --optimizer muon updates by Muon (takes_muon: a
    block's weights of 2 or more dimensions, all of them decayed), per pipeline stage."""
    return list(_block_counts(config_key(config), tp, pp, ep, takes_muon, v))


def state_bytes(amp=True, grad32=False):
    """Bytes per parameter (params, grads, optimizer): STATE_BYTES by the precision, the
    gradients 4 bytes under --amp --grad-dtype float32 (`grad32`)."""
    p, g, o = STATE_BYTES[bool(amp)]
    return p, (4 if grad32 else g), o


def model_state_bytes(n_params, dp=1, zero=0, amp=True, grad32=False):
    """{"params", "grads", "optimizer"} bytes on a rank holding n_params (before ZeRO)."""
    p, g, o = state_bytes(amp, grad32)
    shard = math.ceil(n_params / dp)
    return {"params": p * (shard if zero >= 3 else n_params),
            "grads": g * (shard if zero >= 2 else n_params),
            "optimizer": o * (shard if zero >= 1 else n_params)}


# ---- the bill and the plan -------------------------------------------------------------------

def bill(config, layout, seq, micro_batch=1, dropout=None, formula="korthikanti",
         schedule="1f1b", micro_batches=None, v=1, at_stage=None):
    """Per-rank bytes {"params", "grads", "optimizer", "activations", "total"} of the stage
    whose total is largest (or of `at_stage`), and that "stage". dropout: None: config's.
    formula "minidist": activations of minidist's own graph (dp and ZeRO layouts; full or
    selective recompute). schedule, micro_batches (m), v: the pipeline's, which set how many
    micro-batches a stage holds at once (activations.held_layers; m None: enough to fill
    the pipeline)."""
    dropout = config.dropout > 0 if dropout is None else dropout
    if formula == "minidist" and (layout.tp > 1 or layout.pp > 1):
        raise ValueError("the minidist activation count covers dp and ZeRO layouts only")
    rows = []
    muon = stage_muon_params(config, layout.tp, layout.pp, layout.ep, v) \
        if layout.muon and not layout.zero else [0] * layout.pp     # per parameter: M alone
    for stage, n in enumerate(stage_params(config, layout.tp, layout.pp, layout.ep, v)):
        if at_stage not in (None, stage):
            continue             # (step_bill asks each stage in turn: pp^2 rows otherwise)
        units = expert_units(config, layout, stage, v)    # ep > 1: the experts, per block
        experts = sum(units)
        row = model_state_bytes(n - experts, layout.zero_ranks, layout.zero, layout.amp,
                                layout.grad32)
        p, g, o = state_bytes(layout.amp, layout.grad32)    # experts: ZeRO-1 over edp
        row["params"], row["grads"] = row["params"] + p * experts, row["grads"] + g * experts
        edp = axis_size(layout, "edp")                       # an expert's replicas
        row["optimizer"] += o * (sum(math.ceil(u / edp) for u in units)
                                 if layout.zero else experts)
        row["optimizer"] -= MUON_SAVES * muon[stage]              # Muon's matrices: no v
        row["activations"] = int(
            minidist_activation_bytes(config, seq, micro_batch, layout.amp,
                                      layout.recompute == "full", dropout,
                                      layout.recompute == "selective", layout.tiled)
            if formula == "minidist" else
            stage_activations(config, layout, stage, seq, micro_batch, dropout, schedule,
                              micro_batches, v))
        row["total"] = sum(row.values())
        row["stage"] = stage
        rows.append(row)
    return max(rows, key=lambda r: r["total"])


def _tp_sizes(config, gpus, gpus_per_node):
    """Tensor-parallel degrees to try: powers of two inside one node dividing gpus, n_head
    and n_embd."""
    t, out = 2, []
    while t <= min(gpus, gpus_per_node):
        if gpus % t == 0 and config.n_head % t == 0 and config.n_embd % t == 0 \
                and config.kv_heads % t == 0:
            out.append(t)
        t *= 2
    return out


def _sp(config, seq, t):
    """Sequence parallelism with tp t, where training runs it: seq a multiple of t."""
    return t > 1 and seq % t == 0


def candidates(config, gpus, gpus_per_node=8, seq=None, muon=False, grad32=False):
    """Layouts in the decision order, cheapest first: plain DDP in float32; then mixed
    precision and recompute (selective: the attention's scores, one q k^T more per layer;
    then full); with experts, EP over gcd(gpus, E) of the dp ranks; then (each without,
    with selective and with full recompute) ZeRO-1, ZeRO-2, ZeRO-3; TP with SP inside a
    node (ZeRO-1 over the other ranks); TP over the node x PP across nodes. SP only where
    training runs it: seq (default block_size) a multiple of tp. Every one with Muon where
    `muon` (--optimizer muon); every mixed-precision one with float32 gradients where
    `grad32` (--grad-dtype float32)."""
    seq = seq or config.block_size
    recomputes = ("none", "selective", "full")
    out = [Layout(dp=gpus, amp=False)] + [Layout(dp=gpus, recompute=r) for r in recomputes]
    ep = math.gcd(gpus, config.moe_experts) if config.moe_experts else 1
    if ep > 1:                            # MoE: the experts sharded over ep of the dp ranks
        out.append(Layout(dp=gpus, ep=ep))   # (minidist's MoE has no --ckpt-activations)
    for zero in (1, 2, 3):
        out += [Layout(dp=gpus, zero=zero, recompute=r) for r in recomputes]
    tps = _tp_sizes(config, gpus, gpus_per_node)
    for t in tps:
        out += [Layout(dp=gpus // t, tp=t, zero=int(gpus > t), sp=_sp(config, seq, t),
                       recompute=r)
                for r in recomputes]
    t = tps[-1] if tps else 1
    for p in range(2, min(gpus // t, config.n_layer) + 1):
        if (gpus // t) % p == 0:
            out += [Layout(dp=gpus // (t * p), tp=t, pp=p, zero=int(gpus > t * p),
                           sp=_sp(config, seq, t), recompute=r) for r in recomputes]
    return [replace(layout, muon=muon, grad32=grad32 and layout.amp) for layout in out]


def config_for_params(n_params, seq=2048, vocab_size=50257, **block):
    """A GPT shape of about n_params parameters at the aspect ratio of published large models
    (h / L ~ 128: GPT-3 175B is 12288 / 96, LLaMA-7B 4096 / 32), heads of 128 and h a
    multiple of 1024 from 2048 up (so 8-way tensor parallelism splits the heads evenly), of
    256 below: L w(h) + V h ~ n_params, w(h) a block's matmul weights (GPT-2's 12 h^2; with
    `block`, GPTConfig's arch, n_kv_head, ffn_hidden, that block's: fewer under grouped-query
    attention, so a Llama of 7e9 gets the layers its narrower c_attn leaves room for).
    Narrower (down to 256) where the vocabulary's
    embedding at that width leaves no room for one layer: a small n_params is then dominated
    by V h (1.2e7 at V 50257 was h 512, 29M; now h 256, 14M). Below about V x 256 the shape
    is the smallest, h 256 and one layer (plan_args.params_problem refuses a request under
    half of that)."""
    def weights(h):         # one block's (a kv count the candidate's heads do not take sizes
        kv = min(block.get("n_kv_head", 0), h // 128)       # it as theirs; the config built
        kv = kv if kv and (h // 128) % kv == 0 else 0       # from the last raises GPTConfig's
                                                            # error, naming both)
        probe = GPTConfig(n_layer=1, n_head=h // 128, n_embd=h, vocab_size=vocab_size,
                          **{**block, "n_kv_head": kv})
        return attention_weights(probe) + mlp_weights(probe)

    h = (n_params * 128 / 12) ** (1 / 3)
    step = 1024 if h >= 2048 else 256
    h = max(256, round(h / step) * step)
    while h > 256 and n_params < vocab_size * h + weights(h):
        h -= 1024 if h > 2048 else 256
    L = max(1, round((n_params - vocab_size * h) / weights(h)))
    return GPTConfig(n_layer=L, n_head=h // 128, n_embd=h, block_size=seq,
                     vocab_size=vocab_size, **block)
