"""The layout search's memory (examples/plan.py: minidist/train/search.py evaluate) is the
start-up's memory check's bill (minidist/train/memory_check.py rank_bill, on GPUs) of the run
each row proposes (search.train_flags), every part and the total: until 2026-11-30 the
search priced planner.bill alone (no logits, no step buffers, Korthikanti's activations
where the check bills minidist's graph), so it could call fitting a layout whose run the
check refused. Both are now run_bill.step_bill; these tests hold them to each other on every
row of small searches (each schedule, dense, MoE and Llama MoE models, cp, ep, ZeRO-3), and
plan.py's printed GiB to it.

    python -m pytest -q tests/test_plan_search_check.py
"""
import json
from dataclasses import replace

import pytest

from minidist.train.cluster import H100_IB
from minidist.train.planner import GiB, Layout
from minidist.train.run_bill import step_bill
from minidist.train.search import evaluate, search, train_flags

from tests.plan_cases import DENSE, LLAMA_MOE, MOE, largest_check_bill, plan_cli

PARTS = ("params", "grads", "optimizer", "activations", "logits", "buffers", "evaluation",
         "total")
SMALL = replace(H100_IB, gpus_per_node=2, mem_gib=0.004)     # 4.1 MiB: some rows do not fit


def _check(config, row, gpus, v):
    """The memory check's bill of the run train_flags makes of `row` (its largest rank's)."""
    return largest_check_bill(config, train_flags(config, row, v), gpus)


@pytest.mark.parametrize("config, schedule", [
    (DENSE, "1f1b"), (DENSE, "interleaved"), (DENSE, "gpipe"), (DENSE, "zb-h1"),
    (MOE, "1f1b"), (MOE, "interleaved"), (LLAMA_MOE, "interleaved"), (LLAMA_MOE, "zb-h1")])
def test_every_row_of_the_search_is_the_checks_bill_of_its_run(config, schedule):
    """Every row of an 8-GPU search (nodes of 2, 4.1 MiB a GPU: rows that fit and rows that
    do not; interleaved with 2 chunks a stage) has the check's bill of its run, every part
    and the total, and fits exactly when that total is within the 0.9 the search keeps."""
    v = 2 if schedule == "interleaved" else 1
    rows = search(config, SMALL, 8, config.block_size, 16, schedule, v=v)
    seen = set()
    for row in rows:
        check = _check(config, row, 8, v)
        assert {k: row["mem"][k] for k in PARTS} == {k: check[k] for k in PARTS}, \
            row["layout"]
        assert row["fits"] == (check["total"] <= 0.9 * SMALL.mem_gib * GiB), row["layout"]
        seen.add((row["fits"], row["pp"] > 1, row["cp"] > 1, row["ep"] > 1, row["zero"]))
    assert {s[0] for s in seen} == {True, False}                 # both kinds of row
    assert any(s[1] for s in seen) and any(s[2] for s in seen) and 3 in {s[4] for s in seen}
    assert any(s[3] for s in seen) == bool(config.moe_experts)


def test_a_row_at_another_sequence_length_is_billed_at_that_length():
    """evaluate's `seq` (plan.py --seq) prices the model at that many tokens, whatever the
    config's block_size says: its bill is step_bill of the model at `seq`."""
    layout = Layout(dp=2, zero=1, amp=True)
    row = evaluate(DENSE, layout, H100_IB, 128, 8, 2)
    want = step_bill(replace(DENSE, block_size=128), layout, 2, "1f1b", 2)
    assert row["mem"] == want
    assert row["mem"]["total"] > evaluate(DENSE, layout, H100_IB, 64, 8, 2)["mem"]["total"]


def test_plan_py_prints_the_checks_bill(capsys):
    """python examples/plan.py --n-layer 4 --n-head 4 --n-embd 64 --seq 64 --vocab-size 256
    --global-batch 16 --gpus 8 --gpus-per-node 2 --gpu-mem 0.004 --json: every row's memory
    is the check's bill of the run train_flags makes of it (its `command`, for the best)."""
    plan_cli().main(["--n-layer", "4", "--n-head", "4", "--n-embd", "64", "--seq", "64",
                     "--vocab-size", "256", "--global-batch", "16", "--gpus", "8",
                     "--gpus-per-node", "2", "--gpu-mem", "0.004", "--json", "--top", "500"])
    result = json.loads(capsys.readouterr().out)
    assert result["best"] and any(not r["fits"] for r in result["rows"])
    for row in result["rows"]:
        assert row["mem"]["total"] == _check(DENSE, row, 8, 1)["total"], row["layout"]
