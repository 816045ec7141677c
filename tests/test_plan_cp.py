"""The planners under context parallelism's attention, the ring or Ulysses' all-to-alls
(tp_cp_cost.py), worked by hand: the bytes they price are the training code's, Ulysses'
compute and memory terms, its heads that must divide, the ring's hops hidden behind their
blocks; and the Ulysses layouts the search proposes are ones training accepts."""
import json
from dataclasses import replace

import pytest

from minidist.nn import GPTConfig
from minidist.train.activations import layer_activation_bytes
from minidist.train.cost import step_time
from minidist.train.planner import Layout, bill

from tests.plan_cases import TOY, UNIT, plan_cli, plan_error, training_refusal


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


@pytest.mark.parametrize("attention", ["ring", "ulysses"])
def test_cp_bytes_under_grouped_query_attention_are_the_kv_heads(attention):
    """Grouped-query attention: k and v cross the cp group as the kv heads (the ring's
    blocks: kv of them; Ulysses: cp/ulysses.py kv_heads_sent, here lcm(kv/tp, N), of the
    n_head/tp), so what cp_comm prices (1 B/s: a second is a byte) is ring_bytes of
    K's own bytes S kv/n_head, or ulysses_bytes with kv = S lcm(kv/tp, N) / (n_head/tp);
    8 heads, kv 1, 2, 8, at N = 2 and 4, tp 1 and 2, with and without full recompute. A
    whole step's tp_cp of a Llama with 2 kv heads is its layers' worth of that."""
    from math import lcm
    from minidist.cp.ring import ring_bytes
    from minidist.cp.ulysses import ulysses_bytes
    from minidist.train.tp_cp_cost import cp_comm
    b, s, h, e, nh = 1, 16, 16, 4, 8
    for kv in (1, 2, 8):
        for n in (2, 4):
            for tp in (1, 2):
                for recompute in ("none", "full"):
                    layout = Layout(cp=n, tp=tp, sp=tp > 1, amp=False, recompute=recompute,
                                    cp_attention=attention)
                    S = b * s // n * h * e // tp
                    redo = recompute == "full"
                    if attention == "ring":
                        want = ring_bytes(S * kv // nh, n, redo)
                    else:
                        local = nh // tp
                        want = ulysses_bytes(S, n, redo, S * lcm(max(1, kv // tp), n) // local)
                    f, bwd = cp_comm(UNIT, layout, 1, S * tp, heads=(nh, kv))
                    assert f + bwd == pytest.approx(want), (layout, kv)
                    if kv == nh:                                     # multi-head: as before
                        assert f + bwd == pytest.approx(sum(cp_comm(UNIT, layout, 1, S * tp)))
    gqa = replace(CP_MODEL, arch="llama", n_kv_head=2, bias=False)
    layout = Layout(cp=4, amp=False, cp_attention=attention)
    S = b * s // 4 * h * e
    t = step_time(gqa, layout, UNIT, seq=s, global_batch=b)
    want = ring_bytes(S // 4, 4) if attention == "ring" else ulysses_bytes(S, 4, kv=S // 2)
    assert t["tp_cp"] == pytest.approx(2 * want)
    assert t["tp_cp"] < step_time(replace(gqa, n_kv_head=0), layout, UNIT, seq=s,
                                  global_batch=b)["tp_cp"]


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
