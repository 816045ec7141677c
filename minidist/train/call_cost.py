"""How many collectives the data-parallel sync and sequence parallelism's sum over tp make a
step, so that the step-time model (minidist/train/cost.py) pays each call's latency.

The alpha-beta cost of one collective is affine in its bytes (minidist/train/comm_cost.py:
so many ring steps of alpha, plus the bytes over the bandwidth), so n calls whose pieces
add up to N bytes cost n x one call of N/n bytes, whatever the pieces' sizes (`calls_time`):
counting the calls is enough. The calls, as training issues them:

- DDP (--ddp overlapped, the default, and bucketed): the stage's gradients in buckets cut by
  training's own rule (minidist/ddp/sync.py bucket_cuts: --bucket-mb MiB, last tensor
  first), one all-reduce each (`ddp_buckets`);
- ZeRO: one collective per unit (zero_units: a block, the root; under a pipeline the
  end stages' root and tied wte copy): ZeRO-1's and -2's reduce-scatter, ZeRO-1's and -2's
  all-gather after the step, ZeRO-3's gather of each block and root unit and its
  reduce-scatter per unit in each backward, hybrid sharding's all-reduce across the
  replicas (cost.py counts these from zero_units and zero3_cost.py); the last unit of a
  backward, in view after it, priced by its own bytes (`last_unit`), as DDP's last bucket;
- sequence parallelism (minidist/tp/state.py sum_partial_grads, once a step after the dp
  sync): the stage's replicated parameters (GPT-2's layer norms, row-parallel biases, wpe,
  ln_f: 6 L + 3 tensors; a MoE router; every expert, under --ep this rank's E/ep) in model
  order, in consecutive pieces of at most 4 MiB, a larger tensor alone, one all-reduce over
  tp each (`sp_sum`; state.piece_cuts). Under ZeRO each rank sums its shard's pieces of them
  (--ep's experts: of their ZeRO-1 shards over edp, ceil per MoE block): priced as
  ceil(shard bytes / 4 MiB) calls.
Until 2026-11-29 each of these was priced as one call of all its bytes (and SP's dense
replicated gradients not at all): at 7B on 64 GPUs, 25 MiB buckets, ~534 DDP calls' latency
uncounted. Tests: tests/test_plan_vs_runs.py (the runs' traces), tests/test_tp_sp_grads.py.
"""
import math
from dataclasses import replace

from minidist.ddp.sync import bucket_cuts
from minidist.nn.config import block_param_specs, gpt_param_specs
from minidist.pp.schedule import block_stages
from minidist.tp.state import SUM_PIECE_BYTES, piece_cuts
from minidist.train.comm_cost import axis_size
from minidist.train.moe_cost import expert_units
from minidist.train.planner import local_size

_SPECS = {}                 # (config, tp, pp, ep, stage, v) -> stage_tensors' answer
_COUNTS = {}                # ddp_buckets' and sp_sum's answers


def calls_time(coll, op, nbytes, n):
    """Seconds of n calls of `op` that move nbytes together (coll(op, bytes): one call's
    seconds): n x one call of nbytes / n, exact for any pieces (module docstring)."""
    return n * coll(op, nbytes / n) if n and nbytes else 0.0


def stage_tensors(config, layout, stage, v=1):
    """((name, elements on one rank, whether tp splits it), ...) of `stage`'s parameters in
    model order (the first stage: wte, wpe, its blocks; the last: its blocks, ln_f, the tied
    head's copy of wte; pp 1: wte, wpe, the blocks, ln_f), an expert's 1/ep (ep > 1: not
    every rank holds it); split: fewer elements on a rank than the tensor's (tp >= 2).
    v chunks a stage (interleaved): its chunks' blocks (block_stages), which for an MoE
    model may hold other MoE blocks than v = 1's stages (counted so until 2026-11-30).
    Cached: the search asks for the same few stages many times."""
    key = (repr(config), layout.tp, layout.pp, layout.ep, stage, v)
    if key not in _SPECS:
        tp, pp, L = layout.tp, layout.pp, config.n_layer
        outside = gpt_param_specs(replace(config, n_layer=1, moe_experts=0))
        kinds = {moe: [(name, shape) for name, (shape, _) in
                       block_param_specs(config, moe).items()]
                 for moe in {config.is_moe(i) for i in range(L)}}
        def held(name, shape):
            whole = math.prod(shape)
            mine = whole // layout.ep if ".mlp.experts." in name else \
                local_size(name, shape, tp)
            return name, mine, ".mlp.experts." not in name and mine < whole
        out = []
        if stage == 0:
            out += [held(n, s[0]) for n, s in outside.items()
                    if n in ("transformer.wte.weight", "transformer.wpe.weight")]
        for i, where in enumerate(block_stages(L, pp, v)):
            if where == stage:
                out += [held(n, s) for n, s in kinds[config.is_moe(i)]]
        if stage == pp - 1:
            out += [held(n, s[0]) for n, s in outside.items()
                    if n.startswith("transformer.ln_f.")]
            if pp > 1:
                out.append(held("transformer.wte.weight", (config.vocab_size, config.n_embd)))
        _SPECS[key] = tuple(out)
    return _SPECS[key]


def _dense(config, layout, stage, v=1):
    """stage_tensors less --ep's experts (their own DDP/ZeRO over edp: moe_cost.py)."""
    return [t for t in stage_tensors(config, layout, stage, v)
            if layout.ep == 1 or ".mlp.experts." not in t[0]]


def ddp_buckets(config, layout, stage, g_bytes, bucket_mb, v=1):
    """Bytes of each all-reduce DDP makes a step on `stage` (its dense gradients, `g_bytes`
    each, cut by minidist/ddp/sync.py bucket_cuts at bucket_mb MiB), last bucket first; v:
    chunks a stage (stage_tensors)."""
    key = ("ddp", repr(config), layout.tp, layout.pp, layout.ep, stage, g_bytes, bucket_mb, v)
    if key not in _COUNTS:
        sizes = [n * g_bytes for _, n, _ in _dense(config, layout, stage, v)]
        _COUNTS[key] = tuple(sum(sizes[i] for i in cut) for cut in bucket_cuts(sizes,
                                                                             bucket_mb))
    return _COUNTS[key]


def sp_sum(config, layout, stage, g_bytes, v=1):
    """(bytes, all-reduces over tp) of sequence parallelism's sum of `stage`'s replicated
    gradients, once a step (module docstring; minidist/tp/state.py partial_params: the
    tensors tp does not split, --ep's experts this rank's E/ep, after their sync over edp);
    (0, 0) without SP. Under ZeRO this rank's shard of them, ceil(its bytes / 4 MiB) calls.
    v: chunks a stage (stage_tensors)."""
    if not (layout.sp and layout.tp > 1):
        return 0, 0
    key = ("sp", repr(config), layout.tp, layout.pp, layout.ep, stage, g_bytes,
           layout.zero and layout.zero_ranks, axis_size(layout, "edp"), v)
    if key not in _COUNTS:
        mine = config.moe_experts // layout.ep
        sizes, experts = [], []
        for name, n, split in stage_tensors(config, layout, stage, v):
            if split:
                continue
            if layout.ep > 1 and ".mlp.experts." in name:    # this rank's E/ep, whole
                if int(name.split(".mlp.experts.")[1].split(".")[0]) >= mine:
                    continue
                n *= layout.ep
                experts.append(n)
            sizes.append(n * g_bytes)
        total = sum(sizes)
        if layout.zero:             # the dense over ZeRO's ranks, the experts' units over edp
            dense, edp = total - sum(experts) * g_bytes, axis_size(layout, "edp")
            total = math.ceil(dense / layout.zero_ranks) + g_bytes * sum(
                math.ceil(u / edp) for u in expert_units(config, layout, stage, v))
            _COUNTS[key] = total, math.ceil(total / SUM_PIECE_BYTES)
        else:
            _COUNTS[key] = total, len(piece_cuts(sizes))
    return _COUNTS[key]


def stage_calls(config, layout, stage, g_bytes, bucket_mb, v=1):
    """((DDP's all-reduces, the last one's bytes), SP's (bytes, all-reduces)) a step on
    `stage`: ddp_buckets' count and last bucket (the first tensors', wte's: in view after
    backward) and sp_sum, looked up once (cost.py asks for every stage of every layout);
    v: chunks a stage."""
    key = ("stage", repr(config), layout.tp, layout.pp, layout.ep, stage, g_bytes, bucket_mb,
           layout.sp, layout.zero and layout.zero_ranks, v)
    if key not in _COUNTS:
        buckets = ddp_buckets(config, layout, stage, g_bytes, bucket_mb, v)
        _COUNTS[key] = ((len(buckets), buckets[-1] if buckets else 0),
                        sp_sum(config, layout, stage, g_bytes, v))
    return _COUNTS[key]


def zero_units(layout, layers, stage):
    """How many units ZeRO cuts a stage's dense parameters into (minidist/zero/flat.py
    gpt_units), each reduce-scattered on its own as backward completes it (ZeRO-1: in the
    step's last micro-batch; ZeRO-2: in each): one per block and the root; under a
    pipeline the first and last stages' root (wpe; ln_f) and their copy of the tied wte,
    a unit of its own (GPT.tied_copies), the middle stages' blocks only. ZeRO does not
    bucket: --bucket-mb is DDP's (training refuses it under --zero)."""
    if layout.pp == 1:
        return layers + 1
    return layers + 2 * ((stage == 0) + (stage == layout.pp - 1))


def last_unit(layout, stage, root, block):
    """Elements of the unit ZeRO reduce-scatters last in a backward of `stage`, in view after
    it (the rest hide behind backward): the root (pp 1: wte, wpe, ln_f, whose gradient the
    embedding's backward completes last; the first stage: its root part and wte, both
    completed by the embedding), else the stage's first block (the last stage's wte copy and
    ln_f complete first, at the head). root, block: their elements."""
    return root if layout.pp == 1 or stage == 0 else block
