"""Activation bytes per rank, for the memory planner (minidist/train/planner.py bill).

Activations follow Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
Transformer Models", section 4). Per layer, per micro-batch of b sequences of s tokens,
hidden size h, a heads, t = tp, with 16-bit activations and dropout, in bytes:
    sbh (34 + 5as/h)                   no parallelism
    sbh (10 + 24/t + 5as/(ht))         TP: only the 24 sbh inside the split matmuls shrink
    sbh/t (34 + 5as/h)                 TP + sequence parallelism (SP)
    selective recompute (minidist's --attention recompute) drops the 5as/h term (attention
    scores recomputed); full recompute (--ckpt-activations) keeps only the layer input,
    2sbh (/t with SP).
    The SP line's /t on the QKV and fc inputs (and the head's) holds because the column
    layers keep only their input's shard and all-gather it again in backward (Korthikanti
    4.2.2; minidist/tp/gathered.py; measured by tests/scripts/tp_probes.py). Keeping the
    gathered copies instead would add 2sbh e (1 - 1/t) per layer here (as minidist's graph
    did until it used gathered_linear); so the bill needs no term for them.
The 34 and 5 are 16e + 2 and 2e + 1 for e = 2 bytes per value and 1-byte dropout masks;
here e is 4 in float32, and without dropout the masks (and the dropped copy of the scores)
go: 16e and e. Embedding and output layer: the dropout mask, the inputs of the final layer
norm and of the output projection (2e sbh), and float32 logits for the cross-entropy
(4sbv/t). A pipeline stage holds several micro-batches at its peak, as many as its schedule
runs before the first backward frees one (held_layers: GPipe all m, 1F1B's stage 0 pp and its
last stage one, interleaving's warmup of chunks). Not counted: a recompute's transient (one
layer's activations during its backward), ZeRO-3's gathered layer, communication buckets,
workspace, fragmentation (see --headroom). The as^2 term is attention's materialised scores;
tiled attention (FlashAttention's algorithm, minidist/autograd/flash.py) and context
parallelism's ring attention keep a log-sum-exp row instead (4as bytes), and cp divides s by
the cp size.
Ulysses' attention (cp_attention "ulysses", minidist/cp/ulysses.py) also keeps its output in
the heads layout, sbh e/(cp t) more per layer (layer_activation_bytes), and runs the model's
own attention on a/cp heads of all s tokens (untiled: their (s, s) scores).

`minidist_activation_bytes` is the same bill for minidist's own graph, which keeps the layer
norms' normalised inputs in float32 and fewer other tensors than Megatron's kernels: 14e + 8
bytes per sbh per layer, not 16e (the same in float32); the tests check it against the ledger.
Tests: tests/test_planner.py.
"""
from minidist.pp.schedule import (block_stages, chunk_layers, peak_in_flight,
                                  waiting_for_weights)


def layer_activation_bytes(s, b, h, a, t=1, sp=False, recompute="none", e=2, dropout=True,
                           tiled=False, cp=1, ulysses=False, mlp=8, kv=1.0):
    """Korthikanti et al.'s bytes per transformer layer per micro-batch (module docstring).
    mlp: the values the MLP keeps per token, in units of h: GELU's input and fc2's, 4 + 4;
    a Llama-style block's (mlp_saved) SwiGLU input [gate | up] and fc2's, 3F / h.
    tiled: the (s, s) scores are never kept, only a float32 log-sum-exp per query row
    (4as bytes per sequence; dropout's numbers are recomputed per tile, no mask is kept);
    cp: this rank holds s / cp of the tokens (its
    queries and, tiled by the ring, no scores). ulysses (with cp > 1): its attention's
    output in the heads layout, sbh e / (cp t) more (below); its attention is the model's
    own on a/cp heads of all s tokens: untiled, their (s, s) scores.
    kv: the k and v heads over the q heads (grouped-query attention, n_kv_head / n_head).
    Only the cp ring keeps k and v as their kv heads (it repeats a block to nh heads only to
    attend to it: minidist/cp/ring.py), h + 2 h kv for Q, K, V; the plain, tiled and Ulysses
    attentions save q, k, v after repeat_kv, 3 h whatever kv (measured: the same ledger at
    n_kv_head 1 and 4, tests/test_plan_vs_runs.py)."""
    d, k = int(bool(dropout)), (t if sp else 1)
    s_all, s = s, s / cp
    ulysses = ulysses and cp > 1
    if recompute == "full":
        return s * b * h * e / k
    unsplit = s * b * h * (4 * e + 2 * d)    # 2 layer-norm inputs, QKV and fc inputs, masks
    qkv = 1 + 2 * kv if cp > 1 and not ulysses else 3      # the ring: k, v as kv heads
    split = s * b * h * (1 + qkv + mlp) * e  # Q, K, V, proj input, GELU input, fc2 input
    if ulysses and not tiled:                # a/cp heads' scores over the whole sequence
        core = 0 if recompute == "selective" else \
            a / cp * s_all * s_all * b * (e + d * (1 + e))
    elif tiled or cp > 1:
        core = 4 * a * s * b                 # the log-sum-exp rows, instead of T^2 scores
    else:
        core = 0 if recompute == "selective" else a * s * s * b * (e + d * (1 + e))
    # Ulysses (minidist/cp/ulysses.py ulysses_attention) keeps what the ring keeps in another
    # layout: the attention saves the exchanged q, k, v (B, s, 3h/(cp t)) where the ring's
    # saves the local (B, s/cp, 3h/t), the same bytes, and c_proj saves its input (B, s/cp,
    # h/t) either way. One more: the attention's own output in the heads layout (B, s,
    # h/(cp t)), which its backward reads, beside the tokens-layout copy c_proj keeps: 1 sbh
    # e/(cp t). Its log-sum-exp rows, (B, a/cp, s) float32, are the ring's (B, a, s/cp).
    # Measured: 75.7 against 71.5 MB per rank at cp 2 (minidist/cp/README.md; the default
    # model's 4 layers x S, S = 16 x 128 x 128 x 4 B = 1 MiB: 4.2 MB).
    exchanged = s * b * h * e if ulysses else 0
    return unsplit / k + split / t + core / t + exchanged / t


def mlp_saved(config):
    """What one MLP keeps per token for backward, in units of h: the activation's input and
    fc2's (GELU: F + F = 8h; SwiGLU: 2F + F, its c_fc holding gate and up)."""
    return (3 if config.llama else 2) * config.ffn_size / config.n_embd


def head_activation_bytes(s, b, h, v, t=1, sp=False, e=2, dropout=True):
    """Embedding dropout mask, final layer norm and output projection inputs, float32
    logits for the cross-entropy: 4sbh/t (1 + v/h) at e = 2 with SP (Korthikanti 4.3)."""
    k = t if sp else 1
    return s * b * h * (int(bool(dropout)) + 2 * e) / k + 4 * s * b * v / t


def held_layers(n_layer, pp, stage, schedule="1f1b", m=None, v=1):
    """(how many micro-batches' activations `stage` holds of each of its blocks at its peak,
    {block index: count}; how many of the head's) under `schedule` with m micro-batches and
    v chunks per stage (pp/schedule.py peak_in_flight: GPipe m, 1F1B min(m, p - s), ZB-H1
    min(m, p), interleaved Megatron's warmup + 1 chunk-micro-batches; m None: as many as
    fill the pipeline, p v; pp 1: one, gradient accumulation). Without interleaving the
    stage's blocks are block_stages', each held peak times, the head on the last
    stage as often. ZB-H1's are 1F1B's whole ones: those past their B, waiting for their W
    (schedule.waiting_for_weights), hold less (weight_work_bytes; priced whole until
    2026-11-29, 9% over the ledger's at pp 2, m 8). Interleaved, the peak is reached
    at the end of the warmup: the chunks of the first `peak` forwards (the k-th forward's
    chunk (k mod p v) // p), each with its blocks (chunk_layers); the head is the last
    stage's last chunk's."""
    m = pp * v if m is None else m
    if pp == 1:                       # no pipeline: each micro-batch's backward follows it
        return dict.fromkeys(range(n_layer), 1), 1
    peak = peak_in_flight(whole_of(schedule), pp, stage, m, v)
    last = stage == pp - 1
    if v == 1:
        return {i: peak for i, s in enumerate(block_stages(n_layer, pp)) if s == stage}, \
            peak if last else 0
    chunks = chunk_layers(n_layer, pp, v, stage)
    held, head = {}, 0
    for k in range(peak):
        c = (k % (pp * v)) // pp
        for i in chunks[c]:
            held[i] = held.get(i, 0) + 1
        head += last and c == v - 1
    return held, head


def whole_of(schedule):
    """The schedule whose count of whole micro-batches (forward done, backward not begun) a
    stage's peak has: ZB-H1's is 1F1B's (waiting_for_weights counts the rest)."""
    return "1f1b" if schedule == "zb-h1" else schedule


def weight_work_bytes(config, layout, s, b):
    """What one micro-batch past its B and waiting for its W (ZB-H1) keeps of one of its
    blocks on one rank: what the weights' gradients read, each weight matmul's input and its
    output's gradient (minidist/autograd/tensor.py WeightGradQueue), e bytes a value. Per
    token: the QKV, projection, fc and fc2 inputs, h + h + h + F (the column layers' under SP
    a shard, as they keep it), and the gradients of their outputs, h + 2 h_kv + h + F' + h
    (F' = 2F for SwiGLU's gate and up); an MoE block's k experts and shared ones each, and
    its router (h in, E out). Layer norms and biases compute theirs in B (fused.py,
    fusions.py weight_grads_in_b). GPT-2's 16 h of the 34 h + 5 a s a whole block holds:
    measured 1.16 MiB of 1.16 at pp 2, 2 blocks and the head (tests/test_planner.py)."""
    e, t, h = (2 if layout.amp else 4), layout.tp, config.n_embd
    k = t if layout.sp else 1
    f, hkv = config.ffn_size, config.kv_heads * config.n_embd // config.n_head
    up = 2 * f if config.llama else f
    attention = h / k + h / t + (h + 2 * hkv) / t + h
    mlp = h / k + f / t + up / t + h
    out = []
    for i in range(config.n_layer):
        n = config.moe_top_k + config.moe_shared if config.is_moe(i) else 1
        router = h + config.moe_experts if config.is_moe(i) else 0
        out.append((attention + n * mlp + router) * s * b * e / layout.cp)
    return out


def head_weight_work_bytes(config, layout, s, b):
    """weight_work_bytes of the head: its input and its logits' gradient (v / t a token)."""
    e = 2 if layout.amp else 4
    return (config.n_embd / (layout.tp if layout.sp else 1) + config.vocab_size / layout.tp) \
        * s * b * e / layout.cp


def stage_activations(config, layout, stage, s, b, dropout, schedule="1f1b", m=None, v=1):
    """Korthikanti's bill for one rank of `stage` (of `layout`, planner.Layout) at its peak
    under the pipeline `schedule` with m micro-batches and v chunks (held_layers), and
    under ZB-H1 what its micro-batches waiting for their W keep (weight_work_bytes)."""
    e = 2 if layout.amp else 4
    held, head = held_layers(config.n_layer, layout.pp, stage, schedule, m, v)
    waiting = waiting_for_weights(schedule, layout.pp, stage,      # (pp 1: min(m, 1) - 1 = 0)
                                  layout.pp * v if m is None else m)
    if waiting:
        work = weight_work_bytes(config, layout, s, b)
        last = stage == layout.pp - 1
        waiting *= sum(work[i] for i in held) \
            + (head_weight_work_bytes(config, layout, s, b) if last else 0)
    per_layer = layer_activation_bytes(s, b, config.n_embd, config.n_head, layout.tp,
                                       layout.sp, layout.recompute, e, dropout,
                                       layout.tiled, layout.cp,
                                       layout.cp_attention == "ulysses", mlp_saved(config),
                                       config.kv_heads / config.n_head)
    out = sum(held.values()) * per_layer
    moe = sum(n for i, n in held.items() if config.is_moe(i))
    if moe and layout.recompute != "full":
        out += moe_block_extra(config, layout, s, b, e, moe)
    out += head * head_activation_bytes(s / layout.cp, b, config.n_embd, config.vocab_size,
                                        layout.tp, layout.sp, e, dropout)
    return out + waiting + stage_outputs(layout.pp, stage, schedule, m, v, head) * s * b \
        * config.n_embd * e / (layout.tp if layout.sp else 1) / layout.cp


def moe_block_extra(config, layout, s, b, e, blocks=1):
    """Bytes `blocks` MoE blocks keep beyond dense ones, for b sequences of s tokens (this
    rank's s / cp of them): the k experts each token visits (the MLP's input and saved values
    k - 1 times more; capacity ignored), the router's probabilities (sbE e) and the shared
    experts' MLPs, split as tp splits them (the experts are not: an upper bound)."""
    h, mlp = config.n_embd, mlp_saved(config)
    extra = (config.moe_top_k - 1) * (1 + mlp) * s * b * h * e / layout.tp \
        + s * b * config.moe_experts * e / (layout.tp if layout.sp else 1) \
        + config.moe_shared * mlp * s * b * h * e / layout.tp
    return blocks * extra / layout.cp                 # this rank's tokens


def stage_outputs(pp, stage, schedule, m, v, head):
    """How many (chunk-)micro-batch outputs `stage` keeps at its peak besides what its
    layers saved: a pipeline stage holds each in-flight forward's output until that
    micro-batch's backward starts from it (minidist/pp/microbatches.py `live`; a graph holds
    no op's output, and Korthikanti's per-layer count has none); the ones ending at the head
    (`head` of them) are the loss. An (s, b, h) tensor each: the 7% the interleaved runs held
    over the bill (one block per chunk: an output per block), 2-3% at two blocks a stage."""
    if pp == 1:
        return 0
    return peak_in_flight(whole_of(schedule), pp, stage, pp * v if m is None else m, v) - head


def minidist_activation_bytes(config, s, b, amp=False, ckpt=False, dropout=None,
                              selective=False, tiled=False):
    """What minidist's own single-process graph holds after forward (the ledger's measure):
    the values its ops saved for backward, counted buffer by buffer (a graph holds no op's
    output: minidist/autograd/tensor.py Node). Per block, e-byte inputs of the QKV, attention
    projection, fc and fc2 matmuls (1 + 1 + 1 + 4 sbh), Q, K, V (3 sbh) and the GELU's input
    (4 sbh): 14 sbh e; two layer norms' float32 xhat and rstd (and, in amp, their float32
    weight); the attention probabilities (e bytes) and their 1-byte dropout mask; the two
    residual dropouts' 1-byte masks. Then the int64 token and position ids and the embedding
    dropout's mask; the final layer norm, the head's input and float32 softmax
    probabilities, int64 targets, a 1-byte mask, the loss. Checkpointing keeps each block's
    (B, T, C) input instead of its insides. A Llama-style block keeps its SwiGLU's [gate |
    up] (2F) and fc2's input (F) for the MLP's 8 sbh (mlp_saved), its q, k and v with k and
    v repeated to nh heads (the attention's input, 3 sbh, as GPT-2's), and RoPE's cos and
    sin tables (s hs values, float32 under amp); it has no position ids. `selective`
    (--attention recompute): no probabilities or attention mask kept (the backward computes
    them again, minidist/autograd/attention.py Redo). `tiled` (minidist/autograd/flash.py):
    each row's float32 log-sum-exp instead of the probabilities (its tiles' dropout is drawn
    again from the keys in backward, nothing kept)."""
    e, h, a, V, L = (2 if amp else 4), config.n_embd, config.n_head, config.vocab_size, \
        config.n_layer
    d = int(config.dropout > 0) if dropout is None else int(bool(dropout))
    sbh, sb = s * b * h, s * b
    ln = sbh * 4 + sb * 4 + (h * 4 if amp else 0)    # xhat, rstd (float32), amp: weight
    if ckpt:
        per_layer = sbh * e
    else:
        core = 0 if selective else a * s * b * 4 if tiled else \
            a * s * s * b * (e + d)                              # P and its dropout mask
        per_layer = (6 + mlp_saved(config)) * sbh * e + 2 * ln + core + d * 2 * sbh
        per_layer += s * (h // a) * (4 if amp else e) if config.llama else 0   # RoPE tables
    embed = 8 * sb + (0 if config.llama else 8 * s) + d * sbh
    head = sbh * e + ln + sb * V * 4 + 8 * sb + sb + 4
    return L * per_layer + embed + head
