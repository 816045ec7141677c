"""The memory planner's rows (examples/plan_memory.py: minidist/train/run_bill.py plan) are the
start-up's memory check's bill (minidist/train/memory_check.py rank_bill) for the same run
on GPUs, byte for byte: every refusal of the check points at plan_memory.py, which until
2026-11-30 priced no step buffers, no logits and Korthikanti's activations where the check
bills minidist's graph (ZeRO-3 --amp planned at 198.7 MiB a GPU where the check billed
302.4: 4 layers of 512, T 128, V 4096, 8 sequences a rank). Equal, not a bound: both are
run_bill.step_bill of the same layout (the check adds only a run's own terms: --dtype
float64, --eval-only, a checkpoint's copy, none of them in these runs).

    python -m pytest -q tests/test_plan_check.py
"""
import importlib.util
import json
from dataclasses import replace
import subprocess
import sys

import pytest

from minidist.nn import GPTConfig
from minidist.train.args import train_parser
from minidist.train.memory_check import plan_command, run_layout
from minidist.train.plan_args import config_from_args
from minidist.train.planner import Layout
from minidist.train.run_bill import plan, step_bill
from minidist.train.search import train_flags

from tests.plan_cases import DENSE, LLAMA_MOE, MOE, largest_check_bill


@pytest.mark.parametrize("config, micro", [(DENSE, 2), (MOE, 3), (replace(DENSE, dropout=0.1), 2),
                                           (replace(MOE, dropout=0.1), 3)])
def test_every_row_of_the_plan_is_the_checks_bill_of_its_run(config, micro):
    """Each of plan()'s rows on 8 GPUs (nodes of 2, so TP2 and TP2 x PP2, PP4 rows come
    too): DDP and ZeRO-1/2/3 in float32 and --amp, without, with selective and with full
    recompute, TP x ZeRO-1, TP x PP, and for the MoE model EP: the check's bill of the
    training run train_flags makes of the row, every part and the total; with dropout too
    (plan_memory.py --dropout: the review of 2026-11-30 found 13 and 23 rows above the
    check's, masks the check's floor does not bill)."""
    seen = set()
    dropout = ["--dropout", config.dropout] if config.dropout else []
    for row in plan(config, 8, micro_batch=micro, gpus_per_node=2)["rows"]:
        run = {**row, "micro_batch": micro, "micro_batches": row["pp"], "schedule": "1f1b"}
        check = largest_check_bill(config, train_flags(config, run) + dropout, 8)
        for key in ("params", "grads", "optimizer", "activations", "logits", "buffers",
                    "evaluation", "total"):
            assert row[key] == check[key], (row["layout"], key)
        seen.add((row["zero"], row["tp"] > 1, row["pp"] > 1, row["ep"] > 1, row["amp"],
                  row["recompute"]))
    assert {(z, False, False, False, True, "full") for z in range(4)} <= seen
    assert (0, False, False, False, False, "none") in seen and (1, True, False, False, True,
                                                                 "none") in seen
    assert any(s[2] for s in seen) and any(s[3] for s in seen) == bool(config.moe_experts)


@pytest.mark.parametrize("flags, ranks", [
    (["--cp", 2, "--amp"], 2), (["--cp", 2, "--cp-attention", "ulysses", "--zero", 1], 4),
    (["--pp", 2, "--micro-batches", 4, "--ckpt-activations"], 2),
    (["--tp", 2, "--sequence-parallel", "--zero", 3, "--amp"], 4)])
def test_a_layout_the_table_has_no_row_for_is_billed_by_the_same_step_bill(flags, ranks):
    """Context parallelism (plan_memory.py proposes none: examples/plan.py prices it) and
    mixes the table leaves out: step_bill of the run's layout is the check's bill, on every
    stage."""
    args = train_parser().parse_args([str(f) for f in ["--batch-size", 8, *flags]])
    layout, micro, m = run_layout(args, ranks)
    want = step_bill(DENSE, layout, micro, args.schedule, m, args.pp_virtual)
    check = largest_check_bill(DENSE, ["--batch-size", 8, *flags], ranks)
    assert {k: check[k] for k in want if k != "stage"} == \
        {k: v for k, v in want.items() if k != "stage"}


def test_the_table_prints_the_logits_and_buffers_it_totals():
    """python examples/plan_memory.py --n-layer 4 --n-head 4 --n-embd 512 --seq 128
    --vocab-size 4096 --micro-batch 8 --gpus 2 --gpu-mem 0.29 --json: each row's total is
    its parts (the evaluation's forward where it holds more than the
    step: the ckpt rows), ZeRO-3 (amp)'s the check's 302.4 MiB,
    which does not fit in 0.29 x 0.9 GiB (it was planned at 198.7 and fitting)."""
    out = subprocess.run([sys.executable, "examples/plan_memory.py", "--n-layer", "4",
                          "--n-head", "4", "--n-embd", "512", "--seq", "128", "--vocab-size",
                          "4096", "--micro-batch", "8", "--gpus", "2", "--gpu-mem", "0.29",
                          "--json"], capture_output=True, text=True, timeout=60, check=True)
    rows = {r["layout"]: r for r in json.loads(out.stdout)["rows"]}
    for row in rows.values():
        step = max(row["activations"] + row["logits"], row["evaluation"])
        assert row["total"] == step + sum(row[k] for k in ("params", "grads", "optimizer",
                                                           "buffers"))
    zero3 = rows["ZeRO-3 (amp)"]
    assert f"{zero3['total'] / 2 ** 20:.1f}" == "302.4" and not zero3["fits"]
    config = GPTConfig(n_layer=4, n_head=4, n_embd=512, block_size=128, vocab_size=4096)
    flags = ["--n-layer", 4, "--n-embd", 512, "--block-size", 128, "--batch-size", 16,
             "--zero", 3, "--amp", "--attention", "materialized"]
    assert zero3["total"] == largest_check_bill(config, flags, 2)["total"]
    assert Layout(dp=2, zero=3).name() == "ZeRO-3 (amp)"


def _plan_memory():
    """examples/plan_memory.py as a module (its parser and main run in this process)."""
    spec = importlib.util.spec_from_file_location("plan_memory", "examples/plan_memory.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_plan_memory_dropout_rows_are_the_checks_bill_of_a_dropout_run(capsys):
    """python examples/plan_memory.py --n-layer 4 --n-head 4 --n-embd 64 --seq 64
    --vocab-size 256 --micro-batch 2 --gpus 8 --gpus-per-node 2 --dropout --json: the rows of
    plan() for the model with dropout, which the test above holds to the check's bill of its
    run with --dropout (it counted masks the check's floor does not: TP2+SP (amp)'s
    activations 970,752 bytes where the check bills 737,280, review of 2026-11-30)."""
    argv = ["--n-layer", "4", "--n-head", "4", "--n-embd", "64", "--seq", "64",
            "--vocab-size", "256", "--micro-batch", "2", "--gpus", "8", "--gpus-per-node", "2",
            "--dropout", "--json"]
    _plan_memory().main(argv)
    rows = json.loads(capsys.readouterr().out)["rows"]
    want = plan(replace(DENSE, dropout=0.1), 8, micro_batch=2, gpus_per_node=2)["rows"]
    assert rows == want and len(rows) > 10


@pytest.mark.parametrize("config, flags, ranks, micro", [
    (DENSE, ["--cp", 2], 2, 4), (DENSE, ["--zero", 1, "--cp", 2], 4, 2),
    (DENSE, ["--cp", 4], 4, 2), (DENSE, ["--cp", 4, "--grad-accum", 8], 4, 1),
    (DENSE, [], 2, 4),
    (LLAMA_MOE, ["--moe-experts", 4, "--moe-top-k", 2, "--moe-every", 2, "--arch", "llama",
                 "--n-kv-head", 2, "--optimizer", "muon"], 1, 8)])
def test_the_refusals_plan_memory_command_prices_the_runs_model_and_tokens(config, flags,
                                                                           ranks, micro):
    """memory_check.plan_command, the command every refusal names: the run's model (a Llama
    block, grouped-query heads, experts: it named a dense GPT-2 of the same width) and as
    many tokens a rank as the run holds: under --cp micro / cp whole sequences (rounded
    up), where it passed the run's micro-batch, cp x the tokens (--cp 2, --batch-size 8 on 2
    ranks: --micro-batch 8 for a rank holding 8 half sequences); its DDP row is then the
    check's bill of a DDP run of as many tokens a rank."""
    args = train_parser().parse_args([str(f) for f in ["--batch-size", 8, *flags]])
    command = plan_command(args, config, ranks, 2 ** 30).split()
    assert command[:2] == ["python", "examples/plan_memory.py"]
    module = _plan_memory()
    parsed = module.parser().parse_args(command[2:])
    assert config_from_args(parsed) == config and parsed.micro_batch == micro
    assert parsed.optimizer == args.optimizer
    if args.cp > 1 and args.grad_accum == 1:
        row = plan(config, ranks, micro_batch=micro)["rows"][0]
        assert row["layout"] == "DDP (fp32)" and row["total"] == largest_check_bill(
            config, ["--batch-size", micro * ranks], ranks)["total"]
