"""The layouts the planners propose are ones training accepts (the layout search's and the
memory planner's rows, as train_gpt's flags), and the planners under hybrid sharding
(--zero-shard), worked by hand. The other strategies' terms: tests/test_plan_moe.py,
tests/test_plan_cp.py, tests/test_plan_muon.py."""
from dataclasses import replace
import subprocess
import sys

import pytest

from minidist.train.comm_cost import Link, span
from minidist.train.cost import step_time
from minidist.train.planner import Layout, bill
from minidist.train.run_bill import plan

from tests.plan_cases import PROPOSAL_MODELS, TOY, UNIT, plan_cli, plan_error, training_refusal


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
    1e+03B) and every row still reads as a layout, seven numbers and yes/no."""
    out = subprocess.run([sys.executable, "examples/plan_memory.py", "--params", "1e12",
                          "--gpus", "8"], capture_output=True, text=True, timeout=60,
                         check=True).stdout.splitlines()
    assert out[0].startswith("model: 1T parameters (")
    assert out[1].split()[-8:] == ["params", "grads", "optim", "activ", "logits", "buffers",
                                   "total", "fits"]
    end = next(i for i, line in enumerate(out) if line.startswith("recommendation:"))
    rows = [line for line in out[2:end] if not line.startswith("activ: ")]   # (its note)
    assert rows and len(out) == end + 2 and out[-1].startswith(      # (--seq 2048: tiled)
        "note: activations are priced with the attention's (T, T) scores kept")
    assert float(rows[0].split()[-2]) > 1e4           # a total that once ran into its neighbour
    for line in rows:
        *numbers, fits = line[48:].split()
        assert len(numbers) == 7 and all(float(n) >= 0 for n in numbers), line
        assert fits in ("yes", "no"), line


# ---- hybrid sharding (--zero-shard): ZeRO inside each node, replicas across -----------------

def test_hybrid_sharding_step_and_memory_worked_by_hand():
    """TOY (536 parameters, float32: 2144 B of gradients), dp 4 on 2 nodes of 2 ranks, the
    node's link 10 B/s, between nodes 1 B/s, no compute to hide behind (overlap 0).
    Plain ZeRO-1: its reduce-scatter and all-gather span both nodes, 3/4 x 2144 / 1 each:
    3216 s. ZeRO-1/2 (sharded over each node's 2): 1/2 x 2144 / 10 each in the node (214.4),
    then the 268-parameter shard's all-reduce between the 2 replicas, 2 x 1/2 x 1072 / 1 =
    1072: 1286.4 s, none of it hidden. Each rank then holds 1/2 of the optimizer state, not
    1/4. ZeRO-2/2 with overlap 1: the all-reduces start under backward (3584 s of it here),
    all but the last of L + 1 = 3 units hidden: 1072 / 3; ZeRO-1/2 the same, and its
    reduce-scatter (107.2 s) likewise, one per unit from backward's hooks, the last the
    root's (wte, wpe, ln_f: 48 of the 536 parameters, call_cost.last_unit): 9.6 s left
    (107.2 / 3 until 2026-11-29; before that priced as one of DDP's 1 MiB buckets, the last
    piece, all of it in view; training refuses --bucket-mb under ZeRO)."""
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
    assert stage1["dp_exposed"] == pytest.approx(9.6 + 107.2 + 1072 / 3)   # + its RS
    # under cp ZeRO's group is dp x cp, cp ranks neighbours: dp 2 x cp 4 sharded over 4 on
    # nodes of 4 holds each shard group in a node (ranks 0-3), each replica group across
    cp = Layout(dp=2, cp=4, zero=3, zero_shard=4)
    assert span(cp, "shard", 4) == (4, 1) and span(cp, "replicas", 4) == (1, 2)


def test_overlapped_parameter_gather_worked_by_hand(capsys):
    """--overlap-param-gather (Layout.overlap_gather): TOY, dp 4 on 2 nodes of 2 (as above),
    ZeRO-1, overlap 1: the reduce-scatter (1608 s across the nodes) behind backward's 3584 s,
    one per unit, all but the last of L + 1 = 3, the root's 48 of 536 parameters: 144 s left
    (call_cost.last_unit; an equal share, 536, until 2026-11-29), as before, the all-gather
    (1608 s) behind the next forward's 1792 s, all but one of the 3 units: 536 s left in view;
    with overlap 0 nothing changes. plan.py
    --layout takes it as `ogather` (its command adds the flag) and refuses it at ZeRO-3."""
    nodes = replace(UNIT, gpus_per_node=2, intra=Link(0.0, 10.0), overlap=1.0)
    plain = Layout(dp=4, zero=1, amp=False)
    before = step_time(TOY, plain, nodes, seq=2, global_batch=4)
    after = step_time(TOY, replace(plain, overlap_gather=True), nodes, seq=2, global_batch=4)
    assert before["compute"] == pytest.approx(5376)            # forward 1792 s of it
    assert before["dp_comm"] == after["dp_comm"] == pytest.approx(3216)
    assert before["dp_exposed"] == pytest.approx(144 + 1608)
    assert after["dp_exposed"] == pytest.approx(144 + 536)
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
