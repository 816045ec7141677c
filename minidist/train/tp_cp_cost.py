"""The step-time model's tensor- and context-parallel communication (minidist/train/cost.py
step_time adds them to a stage's micro-batch): TP's all-reduces (SP: reduce-scatters,
all-gathers and backward's re-gathers), CP's ring of key/value blocks and what of it hides
behind the blocks' attention, Ulysses' all-to-alls, the vocabulary-parallel loss's two
all-reduces, and how many of them block (each waits `Cluster.sync_s` for the ranks); and
`exposed`, the communication left over after hiding behind compute, which every term uses.
The formulas: cost.py's module docstring, minidist/train/PLAN.md.
Tests: tests/test_plan_cp.py (worked by hand).
"""
from minidist.cp.ulysses import kv_heads_sent
from minidist.train.comm_cost import collective_time, p2p_time, span


def exposed(comm, window, overlap, units=1, last=None):
    """Communication left over after hiding behind `window` seconds of compute: at most
    overlap x window hides, and never the last of `units` pieces (it starts after compute;
    `last`: its seconds where known, else an equal share)."""
    if comm == 0:
        return 0.0
    return max(comm - overlap * window, comm / max(1, units) if last is None else last)


def ring_block_times(config, layout, b, seq, rate):
    """(forward, backward) seconds of one ring block's attention on a rank: a 1/cp share of
    the layer's 4 b (s/cp) s h / tp attention FLOPs (cost.py's _stage_compute), backward twice that
    and its q k^T again, + half (the ring's backward recomputes each block's scores from the
    saved log-sum-exp, whatever --attention says). What a hop in flight can hide behind."""
    if layout.cp == 1:
        return 0.0, 0.0
    f = 4 * b * (seq / layout.cp) * seq * config.n_embd / layout.tp / layout.cp / rate
    return f, 2.5 * f


def tp_cp_comm(cluster, layout, layers, act, stage, comm, moe=0, block=(0.0, 0.0),
               heads=None):
    """(forward, backward) seconds of TP's all-reduces (RS + AG with SP) and CP's exchanges
    (cp_comm: the ring's key and value blocks, which hide behind `block`, one ring block's
    attention seconds forward and backward, or Ulysses' all-to-alls) for one micro-batch
    on a stage; act = b (s/cp) h e bytes. A MoE block without shared experts (`moe` of the
    layers) has one TP all-reduce each way, its attention's: no split MLP (its shared
    experts are one, split as a dense block's). heads: cp_comm's (grouped-query attention).
    With SP backward also re-gathers each column layer's input shard (tp/gathered.py)."""
    f = b = 0.0
    if layout.tp > 1:
        if layout.sp:
            one = sum(collective_time(cluster, op, act, layout, "tp")
                      for op in ("reduce_scatter", "all_gather"))
        else:
            one = collective_time(cluster, "all_reduce", act, layout, "tp", comm)
        per = 2 * layers - moe                               # also the column layers
        redo = per if layout.recompute == "full" else 0
        last = stage == layout.pp - 1
        f = (per + (stage == 0)) * one                       # + the vocab-parallel embedding
        b = (per + redo + last) * one                        # + the head's input
        if layout.sp:                                        # + the column layers' re-gathers
            b += (per + last) * collective_time(cluster, "all_gather", act, layout, "tp")
    c_f, c_b = cp_comm(cluster, layout, layers, act, *block, heads=heads)
    return f + c_f, b + c_b


def kv_bytes(S, layout, heads):
    """The bytes of one rank's K (or V) as context parallelism sends them, S those of its
    (b, s/cp, h/tp) q: heads = (n_head, kv heads) of the model (None: as many kv heads as q
    heads). The ring's blocks carry the kv heads, S kv/n_head; Ulysses' all-to-all carries
    cp/ulysses.py kv_heads_sent of this tp rank's heads (N windows of the kv/tp heads
    each rank's q heads read; lcm(kv/tp, N) where one divides the other)."""
    if heads is None:
        return S
    n_head, kv = heads
    if layout.cp_attention == "ulysses":
        local = n_head // layout.tp
        return S * kv_heads_sent(local, max(1, kv // layout.tp), layout.cp) / local
    return S * kv / n_head


def cp_comm(cluster, layout, layers, act, block_f=0.0, block_b=0.0, heads=None):
    """(forward, backward) seconds of context parallelism's exchanges for one micro-batch on
    `layers` layers, act = b (s/cp) h e; S = act / tp, one tp rank's heads; Skv = kv_bytes
    (S under multi-head attention: `heads` None), its K's, smaller under grouped-query
    attention (k and v travel unrepeated). The ring
    (cp/ring.py ring_bytes): blocks of K and V, 2Skv, one send/recv a hop, N - 1 hops forward,
    N - 1 (k, v) + N (dk, dv) backward, N - 1 more under full recompute. Each hop is posted
    before the block in hand is attended to (cp/ring.py), so up to cluster.overlap of that
    block's attention compute (block_f, block_b seconds: one block forward, backward) hides
    it: forward, hop k behind block k (the last block is computed after the last hop);
    backward, the hops behind the n blocks' backward (and the recompute's forward blocks),
    never the last (the accumulators' way home comes after the compute).
    Ulysses (cp/ulysses.py ulysses_bytes): forward an all-to-all of qkv (S + 2Skv a rank) and
    one of y (S), backward the two reversed, full recompute the forward's again; priced as
    EP's, the pairwise all-to-all on the links the cp group spans, blocking: nothing
    overlaps them."""
    if layout.cp == 1:
        return 0.0, 0.0
    S, n, redo = act / layout.tp, layout.cp, layout.recompute == "full"
    kv = kv_bytes(S, layout, heads)
    if layout.cp_attention == "ulysses":
        one = sum(collective_time(cluster, "all_to_all", nbytes, layout, "cp")
                  for nbytes in (S + 2 * kv, S))            # qkv, y
        return layers * one, layers * (1 + redo) * one
    k, m = span(layout, "cp", cluster.gpus_per_node)
    hop = p2p_time(2 * kv, cluster.intra if m == 1 else cluster.inter)      # K and V
    hops_b = 2 * n - 1 + redo * (n - 1)                       # per layer
    forward = (n - 1) * max(hop - cluster.overlap * block_f, 0.0)
    window_b = n * block_b + redo * (n - 1) * block_f
    return (layers * forward,
            layers * exposed(hops_b * hop, window_b, cluster.overlap, hops_b))


def blocking_counts(layout, layers, stage, moe=0):
    """(forward, backward) counts of blocking TP/CP collectives of one micro-batch on a stage:
    TP's all-reduces (SP: a reduce-scatter and an all-gather each, and backward's re-gather
    per column layer; one fewer each way in a MoE block), the vocabulary-parallel loss's two
    (max, sums: tp/layers.py) on the last stage, CP's ring hops or Ulysses' all-to-alls."""
    f = b = 0
    first, last = stage == 0, stage == layout.pp - 1
    if layout.tp > 1:
        per = 2 * layers - moe
        each, redo = (2 if layout.sp else 1), (per if layout.recompute == "full" else 0)
        f = (per + first) * each + 2 * last
        b = (per + redo + last) * each + (per + last if layout.sp else 0)
    if layout.cp > 1 and layout.cp_attention == "ulysses":   # 2 all-to-alls each way
        redo = layout.recompute == "full"
        f += layers * 2
        b += layers * 2 * (1 + redo)
    elif layout.cp > 1:
        redo = layout.cp - 1 if layout.recompute == "full" else 0
        f += layers * (layout.cp - 1)
        b += layers * (2 * layout.cp - 1 + redo)
    return f, b


def loss_comm(cluster, layout, tokens, stage):
    """Seconds of the vocabulary-parallel loss's all-reduces (float32 max of `tokens` numbers,
    then 2 x `tokens` sums) on the last stage under TP, forward only."""
    if layout.tp == 1 or stage != layout.pp - 1:
        return 0.0
    return sum(collective_time(cluster, "all_reduce", 4 * n * tokens, layout, "tp")
               for n in (1, 2))
