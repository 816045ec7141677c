"""The planners under each strategy's own terms, worked by hand: Mixture of Experts and
expert parallelism (moe_cost.py), context parallelism's ring and Ulysses (tp_cp_cost.py),
hybrid sharding, Muon; and the layouts the search proposes for them are ones training
accepts."""
import json
from dataclasses import replace
import subprocess
import sys

import pytest

from minidist.nn import GPT, GPTConfig
from minidist.train.activations import layer_activation_bytes
from minidist.train.args import train_parser
from minidist.train.cluster import Cluster
from minidist.train.comm_cost import Link, collective_time, span
from minidist.train.cost import step_time
from minidist.train.planner import Layout, bill, plan, stage_params

from tests.plan_cases import (MOE_TOY, PROPOSAL_MODELS, TOY, UNIT, plan_cli, plan_error,
                              training_refusal)

# ---- Mixture of Experts and expert parallelism (minidist/train/moe_cost.py) ------------------

# block 1 is MoE: 2 experts, top-2, capacity ceil(0.5 x 2 x 2 / 2) = 1 token per expert and
# sequence, so a sequence of 2 tokens keeps min(k s, E cap) = min(4, 2) = 2 of its 4 rows


def test_all_to_all_time_worked_by_hand():
    """Pairwise exchange, 4 ranks, 1200 B per rank: 3 steps of alpha + 300 B / 100 B/s = 12 s.
    EP groups are neighbours after tp: dp 4 = ep 2 x edp 2, tp 2, 4 GPUs per node: the ep
    group (ranks 0, 2) is one node, the edp group (ranks 0, 4) two."""
    from minidist.train.comm_cost import all_to_all_time
    assert all_to_all_time(1200, 4, Link(1.0, 100.0)) == pytest.approx(12.0)
    assert all_to_all_time(1200, 1, Link(1.0, 100.0)) == 0.0
    layout = Layout(dp=4, tp=2, ep=2)
    assert span(layout, "ep", 4) == (2, 1) and span(layout, "edp", 4) == (1, 2)
    two_nodes = Cluster("2x4", 4, 1, 1, 1, Link(1.0, 100.0), Link(10.0, 10.0))
    assert collective_time(two_nodes, "all_to_all", 200, layout, "ep") == pytest.approx(2.0)
    assert collective_time(two_nodes, "all_reduce", 200, layout, "edp") == pytest.approx(40.0)


def test_moe_compute_worked_by_hand():
    """MOE_TOY, b = 1, s = 2, 1 FLOP/s. Block 0 dense: 832. Block 1: attention 8 b s h^2 + 4 b
    s^2 h = 256 + 64, the router 2 b s h E = 32, the experts 16 h^2 x 2 kept rows = 512: 864.
    Output layer 128. Forward 1824, step 3 x = 5472 s. MFU's model FLOPs count the k s = 4
    rows (capacity ignored): experts 1024, forward 2336, 7008 (> the step's FLOPs: capacity
    dropped half the rows). TP2: attention halves, the router and experts stay whole: 416 +
    (160 + 544) + 64 = 1184, x 3 = 3552; all-reduces of 32 B (32 s each): forward 2 (dense
    block) + 1 (MoE block: attention only) + the embedding's, backward 2 + 1 + the head's."""
    t = step_time(MOE_TOY, Layout(amp=False), UNIT, seq=2, global_batch=1)
    assert t["compute"] == pytest.approx(5472) and t["step"] == pytest.approx(5472)
    assert t["mfu"] == pytest.approx(7008 / 5472)
    tp = step_time(MOE_TOY, Layout(tp=2, amp=False), UNIT, seq=2, global_batch=1)
    assert tp["compute"] == pytest.approx(3552) and tp["tp_cp"] == pytest.approx(8 * 32)
    with pytest.raises(ValueError):         # 2 experts do not split over ep 4
        step_time(MOE_TOY, Layout(dp=4, ep=4, amp=False), UNIT, seq=2, global_batch=4)


def test_moe_on_a_split_sequence_worked_by_hand():
    """MOE_TOY, b = 1, s = 2, 1 FLOP/s, 1 B/s, no latency (minidist/train/moe_cost.py
    split_times). TP2 + SP: the MoE block's router and experts run on s/2 tokens: (160 + 16
    + 256) + 416 + 64 = 912, x 3 = 2736 s. Its routing's exchange over tp: the ids, 1 B x k
    2 x s 2 = 4 B all-gathered (1/2 of it sent: 2 s), the sums (b E + 1) x 4 B = 12 B
    all-reduced (12 s): 14 s forward, 2 calls; backward the gradients all-reduced over tp:
    the router's 8 values (32 s) and both experts' 148 (c_fc 64 + 16, c_proj 64 + 4: 592 s
    each): 1216 s, 9 calls. CP2 (s = 1 token a rank): the ring (forward 1 hop, backward 3,
    of K and V: 2 x 16 B: 32 s each, in both blocks: 256 s) + the ids over cp (k 2 x 2
    tokens = 4 B: 2 s) and the sums (12 s): 270 s of the step's tp_cp."""
    from minidist.train.moe_cost import split_times
    sp = Layout(tp=2, sp=True, amp=False)
    assert split_times(MOE_TOY, UNIT, sp, b=1, s=2, e=4, stage=0) == (14, 1216, 2, 9)
    assert split_times(MOE_TOY, UNIT, Layout(tp=2, amp=False), 1, 2, 4, 0) == (0, 0, 0, 0)
    assert step_time(MOE_TOY, sp, UNIT, seq=2, global_batch=1)["compute"] == pytest.approx(2736)
    cp = step_time(MOE_TOY, Layout(cp=2, amp=False), UNIT, seq=2, global_batch=1)
    assert cp["tp_cp"] == pytest.approx(256 + 14)


def test_ep2_dp2_communication_worked_by_hand():
    """MOE_TOY on dp 4 = ep 2 x edp 2, b = 1 per rank, 1 B/s, sync 10 s, 1 s per parameter.
    All-to-alls: 2 kept rows x h 4 x 4 B = 32 B, over 2 ranks 1 step of 16 B: 16 s; the
    counts 8 E = 16 B: 8 s; forward counts + dispatch + combine = 40, backward 32: 72 s, 5
    syncs: 50 s. Parameters: dense 244 (block 0) + 104 (block 1's attention, norms, router)
    + 48 (wte, wpe, ln_f) = 396, all-reduced over the 4 ranks: 2 x 3/4 x 396 x 4 B = 2376 s;
    each expert 148 (c_fc 64 + 16, c_proj 64 + 4), this rank's one all-reduced tensor by
    tensor over its 2 replicas (n B each): 592 s, + clipping's 8 B over ep: 600 s.
    Optimizer: 396 + 148 = 544 s. ZeRO-1: the experts' one unit (148) over edp 2, a
    reduce-scatter of 1/2 x 592 B and an all-gather as much: 592 s (no clipping sum of its
    own); optimizer ceil(396 / 4) + ceil(148 / 2) = 99 + 74 = 173 s. ep = dp = 2: no edp
    sum, only the clipping's 8 s; the dense all-reduce over 2 ranks, 1584 s. Full recompute
    runs the forward's 3 all-to-alls again in backward: 72 + 40 = 112 s, 8 syncs: 80 s; the
    blocks' forward once more: 5472 + 832 + 864 = 7168 s of compute."""
    unit = replace(UNIT, sync_s=10.0, opt_s_per_param=1.0)
    assert stage_params(MOE_TOY, ep=2) == [396 + 148]
    t = step_time(MOE_TOY, Layout(dp=4, ep=2, amp=False), unit, seq=2, global_batch=4)
    assert t["ep_all_to_all"] == pytest.approx(72) and t["sync"] == pytest.approx(50)
    assert t["dp_exposed"] == pytest.approx(2376) and t["expert_grads"] == pytest.approx(600)
    assert t["optimizer"] == pytest.approx(544)
    assert t["step"] == pytest.approx(5472 + 72 + 50 + 2376 + 600 + 544)
    z1 = step_time(MOE_TOY, Layout(dp=4, ep=2, zero=1, amp=False), unit, seq=2, global_batch=4)
    assert z1["optimizer"] == pytest.approx(173) and z1["dp_comm"] == pytest.approx(2376)
    assert z1["expert_grads"] == pytest.approx(592)
    ep2 = step_time(MOE_TOY, Layout(dp=2, ep=2, amp=False), unit, seq=2, global_batch=2)
    assert ep2["expert_grads"] == pytest.approx(8) and ep2["dp_exposed"] == pytest.approx(1584)
    redo = step_time(MOE_TOY, Layout(dp=4, ep=2, amp=False, recompute="full"), unit, seq=2,
                     global_batch=4)
    assert redo["ep_all_to_all"] == pytest.approx(112) and redo["sync"] == pytest.approx(80)
    assert redo["compute"] == pytest.approx(7168)


def test_plan_cli_with_experts():
    """python examples/plan.py ... --moe-experts 4 --moe-top-k 2 --layout dp=4,ep=2 --json: the
    row carries ep and the all-to-all time; the search tries ep; a bad ep is one error line,
    exit 2; the MoE flags' names and defaults are train_gpt.py's."""
    model = ["--preset", "here", "--n-layer", "2", "--n-head", "2", "--n-embd", "64", "--seq",
             "32", "--vocab-size", "64", "--global-batch", "8", "--gpus", "4", "--fp32",
             "--moe-experts", "4", "--moe-top-k", "2", "--json"]
    run = [sys.executable, "examples/plan.py", *model]
    one = json.loads(subprocess.run(run + ["--layout", "dp=4,ep=2"], capture_output=True,
                                    text=True, timeout=60, check=True).stdout)["rows"][0]
    assert one["ep"] == 2 and one["ep_all_to_all"] > 0 and one["layout"].startswith("EP2")
    rows = json.loads(subprocess.run(run + ["--top", "100"], capture_output=True, text=True,
                                     timeout=60, check=True).stdout)["rows"]
    assert {r["ep"] for r in rows} == {1, 2, 4} and any(r["cp"] > 1 for r in rows)
    assert all(r["sp"] == (r["tp"] > 1) for r in rows)     # MoE on split sequences: built
    bad = subprocess.run(run + ["--layout", "dp=4,ep=3"], capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and bad.stderr.startswith("error: --layout: ep=3")
    assert len(bad.stderr.strip().splitlines()) == 1
    cli = plan_cli()
    ours, train = vars(cli.parse([])), vars(train_parser().parse_args([]))
    for flag in ("moe_experts", "moe_top_k", "moe_capacity_factor", "moe_every"):
        assert ours[flag] == train[flag]


def test_busiest_rank_load_worked_by_hand():
    """E = 2, top-1, capacity factor 2, s = 2: capacity ceil(2 x 1 x 2 / 2) = 2 tokens per
    expert, balanced 1 x 2 = 2 rows per sequence, full E x 2 = 4. ep 2, b = 1, load 1.5:
    the busiest rank runs 3 rows (load 3: capped at 4), 16 h^2 = 256 FLOPs each, x 3 for the
    step: + 768 (+ 1536) s over load 1; each of the 4 all-to-alls of rows (dispatch and
    combine, forward and backward) moves 3 x 16 B, half of it to the other rank: 24 s, not 16.
    Load 0.5 without ep (half the tokens dropped): 1 row, - 768 s."""
    from minidist.train.moe_cost import expert_rows
    cfg = replace(TOY, moe_experts=2, moe_top_k=1, moe_capacity_factor=2.0, moe_every=2)
    assert [expert_rows(cfg, 2, load=x) for x in (1, 1.5, 3)] == [2, 3, 4]
    ep2 = Layout(dp=2, ep=2, amp=False)
    base = step_time(cfg, ep2, UNIT, seq=2, global_batch=2)
    busy = step_time(cfg, ep2, UNIT, seq=2, global_batch=2, moe_load=1.5)
    full = step_time(cfg, ep2, UNIT, seq=2, global_batch=2, moe_load=3.0)
    assert busy["compute"] - base["compute"] == pytest.approx(768)
    assert full["compute"] - base["compute"] == pytest.approx(1536)
    assert busy["ep_all_to_all"] - base["ep_all_to_all"] == pytest.approx(4 * (24 - 16))
    dp2 = Layout(dp=2, amp=False)
    assert step_time(cfg, dp2, UNIT, seq=2, global_batch=2)["compute"] - step_time(
        cfg, dp2, UNIT, seq=2, global_batch=2, moe_load=0.5)["compute"] == pytest.approx(768)


def test_zero_under_ep_shards_the_experts_optimizer_over_their_replicas():
    """MOE_TOY on dp 4 = ep 2 x edp 2, ZeRO-3, float32: the 396 dense parameters sharded over
    the 4 ranks (ceil(396 / 4) = 99 each: 4 + 4 + 8 B), this rank's expert (148) ZeRO-1 over
    its 2 replicas, as minidist/ep/optim.py keeps it: params 4 (99 + 148), grads the same,
    optimizer 8 (99 + ceil(148 / 2) = 74)."""
    row = bill(MOE_TOY, Layout(dp=4, ep=2, zero=3, amp=False), seq=2)
    assert (row["params"], row["grads"], row["optimizer"]) == (4 * 247, 4 * 247, 8 * 173)
    ddp = bill(MOE_TOY, Layout(dp=4, ep=2, amp=False), seq=2)
    assert ddp["params"] == 4 * 544


# models the proposal tests plan for: T 20 (sequence parallelism over 8 does not split it,
# nor over cp 2 x tp 4), a 1e9 shape at T 2048, a Mixture of Experts (with SP and cp too)
@pytest.mark.parametrize("schedule", ["1f1b", "interleaved", "gpipe", "zb-h1"])
def test_every_layout_the_search_proposes_is_one_training_accepts(schedule):
    """Each row of the layout search (examples/plan.py), as train_gpt's flags (train_flags),
    passes train_gpt's checks (check_layout: every refusal, before any communication), for
    a few model sizes and sequence lengths on 8 GPUs; cp with tp proposes sequence
    parallelism, which training runs (minidist/cp/README.md)."""
    from minidist.train.cluster import H100_IB
    from minidist.train.search import search
    v = 2 if schedule == "interleaved" else 1
    seen, refused = set(), []
    for config in PROPOSAL_MODELS:
        for row in search(config, H100_IB, 8, config.block_size, 32, schedule, v=v):
            refused.append(training_refusal(config, row, 8, v))
            seen.add((row["cp"] > 1, row["sp"]))
            if config.moe_experts:
                seen.add(("moe", row["cp"] > 1, row["sp"], row["ep"] > 1))
    assert not any(refused), [r for r in refused if r][:5]
    assert (True, True) in seen                       # cp x tp x sp among the proposals
    assert ("moe", True, True, True) in seen          # MoE: ep x cp x tp x sp too


def test_every_layout_the_memory_planner_proposes_is_one_training_accepts():
    """The same for examples/plan_memory.py's candidates (planner.plan), one micro-batch
    per stage: sequence parallelism only where the sequence splits over tp (with experts
    too)."""
    refused, sp = [], set()
    for config in PROPOSAL_MODELS:
        for gpus in (8, 16):
            for row in plan(config, gpus)["rows"]:
                row = {**row, "micro_batch": 1, "micro_batches": row["pp"],
                       "schedule": "1f1b"}
                refused.append(training_refusal(config, row, gpus))
                sp.add(row["sp"])
    assert not any(refused), [r for r in refused if r][:5]
    assert sp == {True, False}


def test_plan_memory_table_keeps_large_values_apart():
    """python examples/plan_memory.py --params 1e12 --gpus 8: the header says 1T (not
    1e+03B) and every row still reads as a layout, five numbers and yes/no."""
    out = subprocess.run([sys.executable, "examples/plan_memory.py", "--params", "1e12",
                          "--gpus", "8"], capture_output=True, text=True, timeout=60,
                         check=True).stdout.splitlines()
    assert out[0].startswith("model: 1T parameters (")
    assert out[1].split()[-6:] == ["params", "grads", "optim", "activ", "total", "fits"]
    end = next(i for i, line in enumerate(out) if line.startswith("recommendation:"))
    rows = out[2:end]
    assert rows and len(out) == end + 2 and out[-1].startswith(      # (--seq 2048: tiled)
        "note: activations are priced with the attention's (T, T) scores kept")
    assert float(rows[0].split()[-2]) > 1e4           # a total that once ran into its neighbour
    for line in rows:
        *numbers, fits = line[48:].split()
        assert len(numbers) == 5 and all(float(n) >= 0 for n in numbers), line
        assert fits in ("yes", "no"), line


# ---- context parallelism's attention: the ring or Ulysses' all-to-alls ------------------------

CP_MODEL = GPTConfig(n_layer=2, n_head=8, n_embd=16, block_size=16, vocab_size=32)


@pytest.mark.parametrize("attention", ["ring", "ulysses"])
def test_cp_bytes_the_model_prices_are_the_training_codes(attention):
    """At 1 B/s and no latency a second is a byte: what tp_cp_cost.cp_comm prices one rank sending
    per layer and micro-batch is minidist/cp/ring.py ring_bytes or minidist/cp/ulysses.py
    ulysses_bytes of S = b (s/N) (h/tp) e (the formulas tests/scripts/cp_check.py and
    ulysses_check.py measure training against), at N = 2 and 4, tp 1 and 2, with and
    without full recompute; and a whole step's tp_cp and syncs (Ulysses: 2 blocking
    all-to-alls each way per layer, 2 more under recompute) add up from them."""
    from minidist.cp.ring import ring_bytes
    from minidist.cp.ulysses import ulysses_bytes
    from minidist.train.tp_cp_cost import cp_comm
    formula = ulysses_bytes if attention == "ulysses" else ring_bytes
    b, s, h, e = 1, 16, 16, 4
    for n in (2, 4):
        for tp in (1, 2):
            for recompute in ("none", "full"):
                layout = Layout(cp=n, tp=tp, sp=tp > 1, amp=False, recompute=recompute,
                                cp_attention=attention)
                act = b * s // n * h * e
                S = act // tp
                assert S % n == 0                            # ulysses_bytes exact
                f, bwd = cp_comm(UNIT, layout, 1, act)
                assert f + bwd == pytest.approx(formula(S, n, recompute == "full")), layout
    unit = replace(UNIT, sync_s=10.0)
    for recompute in ("none", "full"):
        layout = Layout(cp=4, amp=False, recompute=recompute, cp_attention=attention)
        t = step_time(CP_MODEL, layout, unit, seq=s, global_batch=b)
        S = b * s // 4 * h * e
        assert t["tp_cp"] == pytest.approx(2 * formula(S, 4, recompute == "full"))
        if attention == "ulysses":
            assert t["sync"] == pytest.approx(2 * (2 + 2 + 2 * (recompute == "full")) * 10)


def test_ulysses_compute_is_the_rings():
    """The attention's FLOPs per rank are the same either way (all T queries of H/N heads,
    or T/N queries of all H): only the communication differs, where both attentions tile.
    Ulysses around a materialised attention keeps its scores, where the ring's backward
    computes each block's q k^T again whatever --attention says: 2 b (s/N) s h FLOPs per
    layer more, L 2 x 2 x 1 x 4 x 16 x 16 = 4096 here (UNIT: 1 FLOP a second)."""
    for tiled in (True, False):
        ring = step_time(CP_MODEL, Layout(cp=4, amp=False, tiled=tiled), UNIT, seq=16,
                         global_batch=1)
        ulysses = step_time(CP_MODEL, Layout(cp=4, amp=False, cp_attention="ulysses",
                                             tiled=tiled), UNIT, seq=16, global_batch=1)
        assert ring["compute"] - ulysses["compute"] == (0 if tiled else 4096)
        assert ulysses["tp_cp"] < ring["tp_cp"]


def test_ulysses_memory_term():
    """Ulysses holds its attention's output in the heads layout, (B, T, C/N), beside the
    tokens-layout copy c_proj keeps: sbh e / (N t) more per layer than the ring (none under
    full recompute); the bill of the default model (4 layers, C 128, B 16, T 256, float32)
    at cp 2 is 4 MiB = 4.2 MB more: what training's ledger measured (75.7 against 71.5 MB
    per rank, minidist/cp/README.md). Untiled, its a/N heads keep their (s, s) scores."""
    s, b, h, a = 2048, 2, 1024, 8
    for n, t, sp in ((2, 1, False), (4, 1, False), (2, 2, True), (4, 2, False)):
        ring = layer_activation_bytes(s, b, h, a, t, sp, tiled=True, cp=n)
        ulysses = layer_activation_bytes(s, b, h, a, t, sp, tiled=True, cp=n, ulysses=True)
        assert ulysses - ring == s / n * b * h * 2 / t
    assert layer_activation_bytes(s, b, h, a, cp=2, recompute="full", ulysses=True) == \
        layer_activation_bytes(s, b, h, a, cp=2, recompute="full")
    assert layer_activation_bytes(s, b, h, a, cp=2, ulysses=True, dropout=False) == \
        s / 2 * b * h * 2 * (4 + 12 + 1) + a / 2 * s * s * b * 2
    default = GPTConfig(n_layer=4, n_head=4, n_embd=128, block_size=256)
    ring = bill(default, Layout(cp=2, amp=False, tiled=True), 256, 16, dropout=False)
    ulysses = bill(default, Layout(cp=2, amp=False, tiled=True, cp_attention="ulysses"), 256,
                   16, dropout=False)
    assert ulysses["activations"] - ring["activations"] == 4 * 16 * 128 * 128 * 4
    assert (ulysses["activations"] - ring["activations"]) / 1e6 == pytest.approx(
        75.746 - 71.544, abs=0.01)


def test_search_proposes_ulysses_rows_that_training_accepts():
    """The search tries Ulysses beside the ring for every cp > 1 whose heads (n_head / tp)
    divide by cp, and never where they do not (8 heads: not tp 2 x cp 8; 2 heads: not cp 4
    or 8); each Ulysses row's train_flags say --cp-attention ulysses (the ring's say
    nothing: training's default), pass train_gpt's check_layout and plan.py's
    layout_problems."""
    from minidist.train.cluster import H100_IB
    from minidist.train.search import layout_problems, search, train_flags
    for config, gpus in ((GPTConfig(n_layer=4, n_head=8, n_embd=256, block_size=64), 16),
                         (GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=64), 8)):
        rows = search(config, H100_IB, gpus, config.block_size, 32)
        ulysses = [r for r in rows if r["cp_attention"] == "ulysses"]
        assert ulysses and all(r["cp"] > 1 for r in ulysses)
        tried = {(r["tp"], r["cp"]) for r in ulysses}
        assert tried == {(r["tp"], r["cp"]) for r in rows
                         if r["cp"] > 1 and config.n_head // r["tp"] % r["cp"] == 0}
        assert all(config.n_head // tp % cp == 0 for tp, cp in tried)
        assert any(config.n_head // r["tp"] % r["cp"] for r in rows)   # the ring's alone
        for row in rows:
            flags = train_flags(config, row)
            assert ("--cp-attention" in flags) == (row["cp_attention"] == "ulysses")
        for row in ulysses:
            assert train_flags(config, row)[-2:] == ["--cp-attention", "ulysses"]
            assert training_refusal(config, row, gpus) is None
            layout = Layout(**{k: row[k] for k in Layout.__dataclass_fields__})
            assert layout_problems(config, layout, gpus, 32, row["micro_batches"]) == []


def test_layout_problems_names_ulysses_heads_that_do_not_divide():
    """A hand layout with Ulysses where the heads do not divide is training's cp_problems
    refusal, named by its key (cpattn); Ulysses without cp is train_gpt's idle-flag
    refusal; an attention that is neither is the key's range."""
    from minidist.train.search import layout_problems
    config = GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=64)
    bad = Layout(dp=1, tp=2, cp=4, sp=True, cp_attention="ulysses")
    says = layout_problems(config, bad, 8, 8)
    assert len(says) == 1 and says[0].startswith("cpattn=ulysses: --cp-attention ulysses "
                                                 "gives each of the --cp 4 ranks whole heads")
    assert layout_problems(config, replace(bad, tp=1, dp=2, sp=False), 8, 8) == []
    alone = layout_problems(config, Layout(dp=8, cp_attention="ulysses"), 8, 8)
    assert len(alone) == 1 and "--cp-attention ulysses" in alone[0]
    assert layout_problems(config, Layout(dp=4, cp=2, cp_attention="star"), 8, 8) == [
        "cpattn=star: the CP attention is ring or ulysses"]


ULYSSES_BAD = [
    (["--gpus", "8", "--layout", "dp=2,cp=4,cpattn=star"], "--layout: cpattn=star: cpattn is "
     "ring or ulysses"),
    (["--gpus", "8", "--layout", "tp=2,cp=4,cpattn=ulysses"], "--layout: cpattn=ulysses: "
     "--cp-attention ulysses gives each of the --cp 4 ranks whole heads"),
    (["--gpus", "8", "--layout", "dp=8,cpattn=ulysses"], "--layout: examples/train_gpt.py "
     "refuses it: --cp-attention ulysses"),
    (["--gpus", "8", "--layout", "dp=2,cp=4,cpattn=ring,cpattn=ulysses"],
     "--layout: cpattn is given twice"),
]


@pytest.mark.parametrize("argv,says", ULYSSES_BAD, ids=[" ".join(a) for a, _ in ULYSSES_BAD])
def test_plan_layout_cpattn_refusals_are_one_line(argv, says, capsys):
    """    python examples/plan.py --gpus 8 --layout tp=2,cp=4,cpattn=ulysses
    (4 heads / tp 2 = 2 do not divide by cp 4): one error line naming the key, exit 2."""
    assert plan_error(argv, capsys).startswith("error: " + says)


def test_plan_layout_takes_cpattn_and_names_are_unique(capsys):
    """    python examples/plan.py --gpus 8 --layout dp=2,cp=4,cpattn=ulysses --json
    prices Ulysses (more memory; at --seq 4096 on NVLink the ring's hops hide behind its
    blocks' attention, Ulysses' all-to-alls do not) and its command runs it; Layout.name
    tells the two apart where cp > 1 (CP4u) and says nothing with cp 1."""
    def one(layout):
        plan_cli().main(["--gpus", "8", "--seq", "4096", "--json", "--layout", layout])
        return json.loads(capsys.readouterr().out)
    ring, ulysses = one("dp=2,cp=4"), one("dp=2,cp=4,cpattn=ulysses")
    assert ulysses["rows"][0]["cp_attention"] == "ulysses"
    assert ulysses["command"].endswith("--cp-attention ulysses")
    assert "--cp-attention" not in ring["command"]
    r, u = ring["rows"][0], ulysses["rows"][0]
    assert r["tp_cp"] < u["tp_cp"] and u["mem"]["activations"] > r["mem"]["activations"]
    assert (r["layout"], u["layout"]) == ("CP4 x DDP x2 (amp, tiled)",
                                          "CP4u x DDP x2 (amp, tiled)")
    assert Layout(tp=2, cp=4, sp=True, zero=3, cp_attention="ulysses").name() == \
        "TP2+SP x CP4u x ZeRO-3 (amp)"


def test_ring_hops_hide_behind_their_blocks_attention_worked_by_hand():
    """At 1 B/s, no latency, overlap 1: cp 2, S = 8 B (act 8, tp 1): a hop (K and V) is 16 s.
    Forward, the one hop behind block 0's 10 s: 6 s exposed; backward 3 hops (48 s) behind 2
    blocks of 20 s: 8 s, but never under the last hop: 16 s. Overlap 0: 16 and 48, the bytes
    (ring_bytes(8, 2) = 64). Ulysses' all-to-alls hide behind nothing: the same either way.
    And one ring block's seconds are 1/cp of the layer's attention FLOPs (ring_block_times)."""
    from minidist.train.tp_cp_cost import cp_comm, ring_block_times
    ring = Layout(cp=2, amp=False)
    on = replace(UNIT, overlap=1.0)
    assert cp_comm(on, ring, 1, 8, 10.0, 20.0) == (6.0, 16.0)
    assert cp_comm(on, ring, 1, 8, 10.0, 1.0) == (6.0, 46.0)       # 48 - 2 x 1
    assert cp_comm(UNIT, ring, 1, 8, 10.0, 20.0) == (16.0, 48.0)
    assert cp_comm(on, ring, 3, 8, 100.0, 100.0) == (0.0, 48.0)    # 3 layers: 3 last hops
    uly = Layout(cp=2, amp=False, cp_attention="ulysses")
    assert cp_comm(on, uly, 1, 8, 10.0, 20.0) == cp_comm(UNIT, uly, 1, 8)
    f, bwd = ring_block_times(TOY, Layout(cp=2, amp=False, tiled=True), b=1, seq=4, rate=1.0)
    assert f == 4 * 1 * 2 * 4 * TOY.n_embd / 2 and bwd == 2.5 * f


# ---- hybrid sharding (--zero-shard): ZeRO inside each node, replicas across -----------------

def test_hybrid_sharding_step_and_memory_worked_by_hand():
    """TOY (536 parameters, float32: 2144 B of gradients), dp 4 on 2 nodes of 2 ranks, the
    node's link 10 B/s, between nodes 1 B/s, no compute to hide behind (overlap 0).
    Plain ZeRO-1: its reduce-scatter and all-gather span both nodes, 3/4 x 2144 / 1 each:
    3216 s. ZeRO-1/2 (sharded over each node's 2): 1/2 x 2144 / 10 each in the node (214.4),
    then the 268-parameter shard's all-reduce between the 2 replicas, 2 x 1/2 x 1072 / 1 =
    1072: 1286.4 s, none of it hidden. Each rank then holds 1/2 of the optimizer state, not
    1/4. ZeRO-2/2 with overlap 1: the all-reduces start under backward (3584 s of it here),
    all but the last of L + 1 = 3 units hidden: 1072 / 3; ZeRO-1/2 the same (its
    reduce-scatter, one 1 MiB bucket's worth, is the last piece and stays in view)."""
    nodes = replace(UNIT, gpus_per_node=2, intra=Link(0.0, 10.0))
    plain = step_time(TOY, Layout(dp=4, zero=1, amp=False), nodes, seq=2, global_batch=4)
    hybrid1 = Layout(dp=4, zero=1, amp=False, zero_shard=2)
    hybrid = step_time(TOY, hybrid1, nodes, seq=2, global_batch=4)
    assert plain["dp_comm"] == pytest.approx(3216) == plain["dp_exposed"]
    assert hybrid["dp_comm"] == pytest.approx(1286.4) == hybrid["dp_exposed"]
    assert bill(TOY, hybrid1, 2)["optimizer"] == 8 * 268
    assert bill(TOY, Layout(dp=4, zero=1, amp=False), 2)["optimizer"] == 8 * 134
    assert hybrid1.name() == "ZeRO-1/2 (fp32)" and hybrid1.zero_ranks == 2
    stage2 = step_time(TOY, replace(hybrid1, zero=2), replace(nodes, overlap=1.0), seq=2,
                       global_batch=4)
    assert stage2["compute"] == pytest.approx(5376)          # backward: 3584 s of it
    assert stage2["dp_exposed"] == pytest.approx(107.2 + 1072 / 3)   # + the all-gather
    stage1 = step_time(TOY, hybrid1, replace(nodes, overlap=1.0), seq=2, global_batch=4)
    assert stage1["dp_exposed"] == pytest.approx(2 * 107.2 + 1072 / 3)   # + reduce-scatter
    # under cp ZeRO's group is dp x cp, cp ranks neighbours: dp 2 x cp 4 sharded over 4 on
    # nodes of 4 holds each shard group in a node (ranks 0-3), each replica group across
    cp = Layout(dp=2, cp=4, zero=3, zero_shard=4)
    assert span(cp, "shard", 4) == (4, 1) and span(cp, "replicas", 4) == (1, 2)


def test_overlapped_parameter_gather_worked_by_hand(capsys):
    """--overlap-param-gather (Layout.overlap_gather): TOY, dp 4 on 2 nodes of 2 (as above),
    ZeRO-1, overlap 1: the reduce-scatter (1608 s across the nodes, one 1 MiB bucket: none
    of it hidden) as before, the all-gather (1608 s) behind the next forward's 1792 s, all
    but one of L + 1 = 3 units: 536 s left in view; with overlap 0 nothing changes. plan.py
    --layout takes it as `ogather` (its command adds the flag) and refuses it at ZeRO-3."""
    nodes = replace(UNIT, gpus_per_node=2, intra=Link(0.0, 10.0), overlap=1.0)
    plain = Layout(dp=4, zero=1, amp=False)
    before = step_time(TOY, plain, nodes, seq=2, global_batch=4)
    after = step_time(TOY, replace(plain, overlap_gather=True), nodes, seq=2, global_batch=4)
    assert before["compute"] == pytest.approx(5376)            # forward 1792 s of it
    assert before["dp_comm"] == after["dp_comm"] == pytest.approx(3216)
    assert before["dp_exposed"] == pytest.approx(3216)
    assert after["dp_exposed"] == pytest.approx(1608 + 536)
    quiet = replace(nodes, overlap=0.0)
    assert step_time(TOY, replace(plain, overlap_gather=True), quiet, seq=2,
                     global_batch=4)["dp_exposed"] == pytest.approx(3216)
    assert replace(plain, overlap_gather=True).name() == "ZeRO-1 (fp32, gathers overlapped)"
    plan_cli().main(["--gpus", "8", "--layout", "dp=8,zero=1,ogather", "--top", "1"])
    assert "--zero 1 --attention tiled --overlap-param-gather" in capsys.readouterr().out
    says = plan_error(["--gpus", "8", "--layout", "dp=8,zero=3,ogather"], capsys)
    assert says.startswith("error: --layout: ogather: the overlapped parameter gather needs")


def test_search_proposes_hybrid_sharding_across_nodes_that_training_accepts():
    """On 16 GPUs (2 nodes of 8) the search also prices ZeRO-1/2/3 sharded over each node's
    share of its dp x cp ranks (8 / tp of them: the group's ranks are tp apart; not under tp
    8, where that is 1; with pp 2 a stage is one node, nothing to split), never on one node;
    each such row is a layout train_gpt.py runs (--zero-shard) and plan.py --layout takes."""
    from minidist.train.cluster import H100_IB
    from minidist.train.search import layout_problems, search, train_flags
    config = PROPOSAL_MODELS[1]
    rows = search(config, H100_IB, 16, config.block_size, 32)
    hybrid = [r for r in rows if r["zero_shard"]]
    assert {r["zero"] for r in hybrid} == {1, 2, 3}
    assert all(r["zero_shard"] * r["tp"] == 8 < r["dp"] * r["cp"] * r["tp"] for r in hybrid)
    assert {r["cp"] for r in hybrid} == {1, 2, 4, 8} and {r["tp"] for r in hybrid} == {1, 2, 4}
    assert {r["pp"] for r in hybrid} == {1} and all(r["ep"] == 1 for r in hybrid)
    for row in hybrid:
        assert training_refusal(config, row, 16) is None
        assert "--zero-shard" in train_flags(config, row)
        layout = Layout(**{k: row[k] for k in Layout.__dataclass_fields__})
        assert layout_problems(config, layout, 16, 32, row["micro_batches"]) == []
    assert not any(r["zero_shard"] for r in search(config, H100_IB, 8, config.block_size, 32))


def test_search_proposes_hybrid_sharding_beside_expert_parallelism():
    """A Mixture of Experts on 16 GPUs: hybrid sharding with ep 2 and 4 too (the dense shards
    over a node's 8 / tp ranks of dp x ep, the experts ZeRO-1 over their replicas as
    without it), each row a layout training accepts; its dense optimizer state is the
    node's share (1/8), the experts' the same as plain ZeRO's."""
    from minidist.train.cluster import H100_IB
    from minidist.train.search import search
    config = PROPOSAL_MODELS[2]
    rows = search(config, H100_IB, 16, config.block_size, 32, recomputes=("none",))
    hybrid = [r for r in rows if r["zero_shard"] and r["ep"] > 1]
    assert {r["ep"] for r in hybrid} == {2, 4} and {r["zero"] for r in hybrid} == {1, 2, 3}
    for row in hybrid:
        assert training_refusal(config, row, 16) is None
    from minidist.train.moe_cost import expert_units
    from minidist.train.planner import STATE_BYTES, stage_params
    plain = Layout(dp=16, ep=4, zero=1)
    states = {k: bill(config, replace(plain, zero_shard=k), 64)["optimizer"] for k in (0, 8)}
    dense = stage_params(config, 1, 1, 4)[0] - sum(expert_units(config, plain, 0))
    moments = STATE_BYTES[True][2]                   # --amp: masters, m, v per parameter
    assert states[8] - states[0] == pytest.approx(moments * dense * (1 / 8 - 1 / 16),
                                                  rel=1e-3)


def test_plan_layout_takes_shard(capsys):
    """    python examples/plan.py --gpus 16 --layout dp=16,zero=3,shard=8"""
    plan_cli().main(["--gpus", "16", "--layout", "dp=16,zero=3,shard=8"])
    out = capsys.readouterr().out
    assert "ZeRO-3/8 (amp, tiled)" in out and "--zero 3" in out and "--zero-shard 8" in out


# ---- --optimizer muon: its state, its Newton-Schulz and its gathers, worked by hand -----------

def test_muon_state_bytes_worked_by_hand():
    """TOY's blocks hold 4 matrices each, c_attn 4 x 12 (48), c_proj 4 x 4 (16), c_fc 4 x 16
    (64) and c_proj 16 x 4 (64): 192, 384 of its 536 parameters. Muon keeps M alone for
    them: 4 B less each where the optimizer is per parameter. One process, float32: AdamW's
    8 x 536 = 4288 B, Muon's 4288 - 4 x 384 = 2752 (M 4 x 384 + m, v 8 x 152); --amp
    (masters 4, m 4, v 4): 12 x 536 - 4 x 384 = 4896. TP2: 300 parameters a rank (2 x 134
    in the blocks: the split matrices and c_attn's bias halved; wte's half 16, wpe 8, ln_f
    8), 192 of them Muon's halves: 8 x 300 - 4 x 192 = 1632. ZeRO-1 over 2: the flat v
    spans the matrices too, AdamW's 8 x 268 = 2144. MOE_TOY under ep 2 (no ZeRO): block 1
    keeps its attention (64), router 4 x 2 (8) and this rank's one expert (128) by Muon: 192
    + 200 = 392 of 544: 8 x 544 - 4 x 392 = 2784; with ZeRO-1 AdamW's again."""
    from minidist.train.planner import stage_muon_params
    assert stage_muon_params(TOY) == [384] and stage_muon_params(TOY, tp=2) == [192]
    assert stage_params(TOY, tp=2) == [300]
    expect = [(Layout(amp=False), 4288, 2752), (Layout(amp=True), 6432, 4896),
              (Layout(tp=2, amp=False), 2400, 1632),
              (Layout(dp=2, zero=1, amp=False), 2144, 2144)]
    for layout, adamw, muon in expect:
        assert bill(TOY, layout, 2)["optimizer"] == adamw
        assert bill(TOY, replace(layout, muon=True), 2)["optimizer"] == muon, layout
    assert stage_muon_params(MOE_TOY, ep=2) == [392]
    ep2 = Layout(dp=4, ep=2, amp=False, muon=True)
    assert bill(MOE_TOY, ep2, 2)["optimizer"] == 8 * 544 - 4 * 392 == 2784
    assert bill(MOE_TOY, replace(ep2, zero=1), 2)["optimizer"] == \
        bill(MOE_TOY, replace(ep2, zero=1, muon=False), 2)["optimizer"]
    assert replace(ep2, zero=1).name() == "EP2 x ZeRO-1 x4 (fp32)"    # the plan says Muon


def test_muon_step_worked_by_hand():
    """TOY at 1 FLOP/s and 1 B/s, sync 10 s. Newton-Schulz, 5 steps of 4 A^2 B + 2 A^3 on
    the wide orientation (A <= B): a 4 x 4 matrix 5 x (256 + 128) = 1920, so c_attn (4, 12),
    which packs q, k and v, 3 x 1920 = 5760 (as one 4 x 12 matrix it would be 5 x (768 +
    128) = 4480), c_proj 1920, c_fc and the MLP's c_proj (4, 16) 5 x (1024 + 128) = 5760
    each: 19200 a block, 38400 for both.
    One process (and DDP x2: every rank all of them): 38400 s more, nothing sent. At the
    float32 rate: with a 16-bit peak of 4 FLOP/s --amp's step computes 4 x faster, its NS
    (on the float32 masters) does not.
    TP2: each split matrix's NS on one tp rank (muon.tp_owners, the costliest first to the
    least busy, ties in block order): c_attn to the first, c_fc to the other, the MLP's
    c_proj to the first (a tie), c_proj to the other: 11520 s against 7680, each block
    waits for the 11520 (the second block turns the order: the other rank's 11520), 23040
    for both; each split matrix's update all-gathered first (4 B a value; over 2 ranks 1/2
    of it received): c_attn 192 B -> 96 s, c_proj 64 -> 32, c_fc and c_proj 256 -> 128
    each, + 10 s of sync each: 424 s a block, and the owners' steps reduce-scattered after
    (the same bytes and syncs) 424 s more: 848 s a block.
    ZeRO-1 over 2: each block's unit (244 values: ln_1 0-8, c_attn 8-56 and its bias 56-68,
    c_proj 68-84 and 84-88, ln_2 88-96, c_fc 96-160 and 160-176, c_proj 176-240 and its
    bias) is all-gathered (976 B, 488 s) and its steps reduce-scattered (488 s); each matrix
    is one rank's, the costliest first to the least busy (muon.balance; ties in unit order,
    ranks from the unit's `first`): c_attn to the first rank, c_fc to the other, the MLP's
    c_proj to the first (a tie), c_proj to the other: 11520 s against 7680; each unit waits
    for the 11520; both: 23040 s of NS and 1952 s of collectives.
    ZeRO-1 over dp 2 x TP2: the same dp owners, and each dp rank shares the split matrices
    it owns with its tp peer (ShardedMuon's tp_owners, as TP2's): the first dp rank's c_attn
    and MLP c_proj one per tp rank, 5760 s, each gathered and reduce-scattered over tp,
    2 x (96 + 10) + 2 x (128 + 10) = 488 s: 6248 s; the other's c_fc and c_proj, 5760 s (the
    busiest tp rank) + 2 x (128 + 10) + 2 x (32 + 10) = 360 s: 6120 s. Each unit waits for
    the first's (5760, 488) and gathers and reduce-scatters itself (134 values on a tp rank,
    536 B), 268 s each: (5760, 1024) a unit, (11520, 2048) for both (when each tp rank ran
    its dp rank's whole NS and gathered only: 23040 s of NS, 1560 s of collectives).
    PP2: a block a stage, 19200 s."""
    from minidist.optim.muon import ns_flops, packed_flops
    assert [ns_flops(s) for s in ((4, 12), (4, 4), (4, 16), (16, 4))] == \
        [4480, 1920, 5760, 5760]
    assert ns_flops((4, 16), steps=3) == 3 * 1152
    assert packed_flops((4, 12), (4, 4, 4)) == 5760 and packed_flops((4, 12)) == 4480
    unit = replace(UNIT, sync_s=10.0)

    def both(layout, global_batch=1, micro_batches=1, cluster=unit):
        muon = step_time(TOY, replace(layout, muon=True), cluster, 2, global_batch,
                         micro_batches)
        adamw = step_time(TOY, layout, cluster, 2, global_batch, micro_batches)
        assert muon["optimizer"] - adamw["optimizer"] == pytest.approx(muon["muon_ns"])
        assert muon["step"] - adamw["step"] == pytest.approx(muon["muon_ns"] +
                                                             muon["muon_comm"])
        return muon["muon_ns"], muon["muon_comm"]
    assert both(Layout(amp=False)) == (38400, 0)
    assert both(Layout(dp=2, amp=False), 2) == (38400, 0)
    fast16 = replace(unit, peak_tflops=4e-12, peak_tflops_fp32=1e-12)
    assert both(Layout(amp=True), cluster=fast16) == (38400, 0)
    assert both(Layout(tp=2, amp=False)) == (2 * 11520, pytest.approx(2 * 2 * 424))
    assert both(Layout(dp=2, zero=1, amp=False), 2) == (23040, 1952)
    assert both(Layout(dp=2, tp=2, zero=1, amp=False), 2) == \
        (2 * 5760, pytest.approx(2 * (488 + 2 * 268)))
    assert both(Layout(pp=2, amp=False), 2, 2) == (19200, 0)


def test_muon_with_experts_worked_by_hand():
    """MOE_TOY (block 1 a MoE block: router 4 x 2, NS 5 x (4 x 4 x 4 + 2 x 8) = 400; two
    experts, c_fc and c_proj 5760 each), 1 FLOP/s, 1 B/s. DDP x4: block 0 19200, block 1
    5760 + 1920 + 400 + 2 x 11520 = 31120. EP2: this rank's one expert, 19600. EP2 x ZeRO-1
    over 4 (each matrix one rank's, muon.balance): block 0's unit, its four matrices on four
    ranks: 5760, gathered and reduce-scattered 2 x 3/4 x 976 B = 1464 s; block 1's dense
    unit (attention, norms, router: 104 values) c_attn, c_proj, router on three ranks:
    5760, 2 x 3/4 x 416 = 624 s; its experts' unit (one expert, 148, over edp 2: c_fc and
    c_proj a rank each) 5760, 2 x 1/2 x 592 = 592 s."""
    def muon(layout):
        t = step_time(MOE_TOY, layout, UNIT, seq=2, global_batch=4)
        return t["muon_ns"], t["muon_comm"]
    assert muon(Layout(dp=4, amp=False, muon=True)) == (19200 + 31120, 0)
    assert muon(Layout(dp=4, ep=2, amp=False, muon=True)) == (19200 + 19600, 0)
    assert muon(Layout(dp=4, ep=2, zero=1, amp=False, muon=True)) == \
        (5760 + 5760 + 5760, 1464 + 624 + 592)


@pytest.mark.parametrize("config", [
    GPTConfig(n_layer=2, n_head=4, n_embd=32, block_size=16, vocab_size=64),
    GPTConfig(n_layer=2, n_head=4, n_embd=32, block_size=16, vocab_size=64, moe_experts=4,
              moe_top_k=2, moe_shared=1, moe_every=2),
    GPTConfig(n_layer=2, n_head=4, n_embd=32, block_size=16, vocab_size=64, arch="llama",
              n_kv_head=2, bias=False)], ids=["gpt2", "moe", "llama"])
def test_muon_ns_per_zero_rank_is_the_sharded_optimizers(config):
    """The ranks' NS work under ZeRO is ShardedMuon's: for a real model's block units
    (zero/flat.py gpt_units) over n ranks, each Muon matrix is one rank's (zero/muon.py
    unit_owners, which ShardedMuon runs by); the planner prices per unit the most any rank
    runs, after a gather of the unit's padded flat U and before a reduce-scatter of the
    steps (4 B a value each). The packed matrices (c_attn's q, k, v; SwiGLU's gate, up) are
    the model's (strategy/base.py matrix_views), the planner's from the config alone."""
    from minidist.optim.muon import packed_flops
    from minidist.strategy.base import matrix_views
    from minidist.train.muon_cost import muon_times
    from minidist.zero.flat import gpt_units
    from minidist.zero.muon import unit_owners
    model = GPT(config, seed=0)
    packed = matrix_views(model)["packed"]
    assert {n.split(".", 3)[3] for n in packed} == (
        {"attn.c_attn.weight", "mlp.c_fc.weight"} if config.llama else
        {"attn.c_attn.weight"})
    for n in (2, 3, 5):
        want_ns = want_bytes = 0
        for k, f in enumerate(gpt_units(model, n, 0)):
            owners = unit_owners(f, n, k, packed=packed)
            if not owners:
                continue                                    # the root: nothing gathered
            want_ns += max(sum(packed_flops(f.shapes[i], packed.get(f.names[i]))
                               for i, o in owners.items() if o == r) for r in range(n))
            want_bytes += 2 * 4 * f.padded
        layout = Layout(dp=n, zero=1, amp=False, muon=True)
        got = muon_times(config, layout, UNIT, 1.0, lambda op, nbytes: nbytes)
        assert got == [(want_ns, want_bytes)], n


def test_a_muon_plans_command_is_one_training_accepts(capsys):
    """    python examples/plan.py --gpus 8 --optimizer muon --muon-ns-steps 3
    prices Muon and its `run it:` command trains with it (--optimizer muon, --muon-ns-steps
    3: what was priced), a command train_gpt.py's checks accept (check_layout); so does
    every row of a Muon search (the default 5 iterations left out of the command), and a
    hand layout. plan_memory.py --optimizer muon: a row per candidate with Muon's state."""
    from minidist.train.cluster import H100_IB
    from minidist.train.search import search, train_flags
    from minidist.train.strategy import check_layout
    plan_cli().main(["--gpus", "8", "--optimizer", "muon", "--muon-ns-steps", "3", "--json",
                      "--top", "1"])
    result = json.loads(capsys.readouterr().out)
    assert result["optimizer"] == "muon" and result["rows"][0]["muon_ns_steps"] == 3
    assert result["rows"][0]["muon"] and result["rows"][0]["muon_ns"] > 0
    run = result["command"].split()
    args = train_parser().parse_args(run[9:])                 # (after --device, --comm nccl)
    assert (args.optimizer, args.muon_ns_steps) == ("muon", 3)
    check_layout(args, 8)                                     # training accepts it
    plan_cli().main(["--gpus", "8", "--optimizer", "muon", "--layout", "dp=4,tp=2,zero=1",
                      "--top", "1"])
    out = capsys.readouterr().out
    assert "Muon (5 Newton-Schulz steps)" in out and out.rstrip().endswith("--optimizer muon")
    for config in PROPOSAL_MODELS[::2]:
        rows = search(config, H100_IB, 8, config.block_size, 32, muon=True)
        assert all(r["muon"] for r in rows)
        assert not [r for r in rows if training_refusal(config, r, 8)]
        flags = train_flags(config, rows[0])
        assert flags[-2:] == ["--optimizer", "muon"] and "--muon-ns-steps" not in flags
    # plan_memory.py: the same candidates, Muon's state (the DDP rows 4 B less a matrix
    # parameter, ZeRO's the same), its rows' commands what training runs
    memory = {muon: plan(PROPOSAL_MODELS[1], 8, muon=muon) for muon in (False, True)}
    assert memory[True]["optimizer"] == "muon"
    for adamw, muon in zip(memory[False]["rows"], memory[True]["rows"]):
        assert muon["muon"] and muon["layout"] == adamw["layout"]
        assert (muon["optimizer"] < adamw["optimizer"]) == (not muon["zero"])
        row = {**muon, "micro_batch": 1, "micro_batches": muon["pp"], "schedule": "1f1b"}
        assert training_refusal(PROPOSAL_MODELS[1], row, 8) is None


def test_the_planners_optimizer_flags_are_training_s():
    """--optimizer's choices and default, and plan.py's --muon-ns-steps default, are
    train_gpt.py's; plan_memory.py --measure trains with --optimizer (it changes what it
    measures), where every other planning flag is refused."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("plan_memory", "examples/plan_memory.py")
    memory = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(memory)

    def choices(parser):
        return {a.dest: a.choices for a in parser._actions}["optimizer"]
    train = train_parser()
    assert tuple(choices(memory.parser())) == tuple(choices(train)) == ("adamw", "muon")
    cli = plan_cli()
    for name in ("optimizer", "muon_ns_steps"):
        assert getattr(cli.parse([]), name) == train.get_default(name)
    assert memory.parser().get_default("optimizer") == train.get_default("optimizer")
    for choice in choices(train):
        assert cli.parse(["--optimizer", choice]).optimizer == choice
    p = memory.parser()
    assert memory.measure_problem(p.parse_args(["--measure", "--optimizer", "muon"]), p) is None
