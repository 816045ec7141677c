"""The planners' command lines (examples/plan_memory.py, examples/plan.py): --json, every bad
number as one `error:` line (PLANNER_BAD), a planner piped into head, the printed command
carrying what the plan was priced with, part of one node planned and whole nodes suggested.

    python -m pytest -q tests/test_planner_cli.py
"""
import json
from dataclasses import asdict
import subprocess
import sys

import pytest

from minidist.nn import GPTConfig
from minidist.train.args import train_parser
from minidist.train.planner import Layout

from tests.plan_cases import plan_cli, plan_error


def test_cli_json():
    out = subprocess.run([sys.executable, "examples/plan_memory.py", "--params", "7e9",
                          "--gpus", "8", "--gpu-mem", "80", "--seq", "4096", "--json"],
                         capture_output=True, text=True, timeout=60, check=True)
    result = json.loads(out.stdout)
    assert result["recommendation"] == "ZeRO-1 (amp, selective recompute)"
    assert {"params", "grads", "optimizer", "activations", "total", "fits"} <= set(
        result["rows"][0])
    # walk 38: at 4096 tokens training tiles the attention; the table prices the scores kept,
    # and says so (plan.py prices tiled attention and cp)
    assert "train_gpt.py tiles attention from 256 tokens" in result["note"]
    assert "examples/plan.py prices both" in result["note"]
    bad = subprocess.run([sys.executable, "examples/plan_memory.py", "--params", "1e9",
                          "--moe-experts", "8", "--moe-top-k", "9"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.startswith("error: model flags: moe_top_k")
    assert len(bad.stderr.strip().splitlines()) == 1


# (planner, flags, the one error line); each was a traceback, or a plan of nothing
PLANNER_BAD = [
    ("plan_memory", ["--params", "7e9", "--gpus", "0"], "--gpus 0: must be a positive number"),
    ("plan_memory", ["--params", "-5"], "--params -5.0: must be a positive number"),
    ("plan_memory", ["--params", "7e9", "--gpu-mem", "-1"], "--gpu-mem -1.0: must be a positive"),
    ("plan_memory", ["--params", "7e9", "--headroom", "1"], "--headroom 1.0: the fraction"),
    ("plan", ["--params", "7e9", "--gpus", "8", "--efficiency", "0"], "--efficiency 0.0: must"),
    ("plan", ["--params", "7e9", "--schedule", "interleaved", "--chunks", "0"],
     "--chunks/--pp-virtual 0:"),
    # train_gpt.py's names of three flags: the error named the other one
    ("plan", ["--params", "7e9", "--schedule", "interleaved", "--pp-virtual", "0"],
     "--chunks/--pp-virtual 0: must be a positive number"),
    ("plan", ["--params", "7e9", "--batch-size", "0"],
     "--global-batch/--batch-size 0: must be a positive number"),
    ("plan", ["--params", "nan"], "--params nan: must be a positive number"),
    # a search that ran for hours (the layers of --params 1e30's shape: 1.7e8)
    ("plan", ["--params", "1e30"], "--params 1e+30: at most 1e+17 (100,000T"),
    ("plan_memory", ["--n-layer", "20000"], "--n-layer 20000: at most 10,000"),
    ("plan", ["--params", "7e9", "--moe-experts", "1000000"], "--moe-experts 1000000: at most"),
    ("plan", ["--params", "7e9", "--seq", "0"], "--seq/--block-size 0: must be a positive"),
    ("plan", ["--params", "7e9", "--seq", "7"], "--seq 7: must be even"),
    # found by a first-use walk: the shape was dropped silently, a bad number was a usage block
    ("plan", ["--params", "7e9", "--n-layer", "6"], "--n-layer 6: --params 7e+09 assumes its "
     "own shape; give --params or the shape, not both"),
    ("plan_memory", ["--params", "7e9", "--n-embd", "512", "--n-head", "8"], "--n-head 8 "
     "--n-embd 512: --params 7e+09 assumes"),
    ("plan", ["--params", "abc"], "argument --params: invalid float value: 'abc' (plan.py "
     "--help lists the flags)"),
    # a part of a node was planned as if it were full (8 + 4 priced as 8 + 8)
    ("plan", ["--params", "7e9", "--gpus", "12"], "--gpus 12 --gpus-per-node 8: 12 GPUs fill 1 "
     "node of 8 and part of another, which the step-time model cannot price (it takes every "
     "node as full); give --gpus 8 or 16, or --gpus-per-node 6 (2 full nodes)"),
    ("plan", ["--params", "7e9", "--gpus", "13", "--gpus-per-node", "8"], "--gpus 13 "
     "--gpus-per-node 8: 13 GPUs fill 1 node of 8 and part of another, which the step-time "
     "model cannot price (it takes every node as full); give --gpus 8 or 16\n"),
    ("plan_memory", ["--params", "7e9", "--gpus-per-node", "0"], "--gpus-per-node 0: must be "
     "a positive number"),
    # first-use walk 18: an efficiency of 2 priced MFU 1.86; --moe-* without --moe-experts
    # planned a dense model silently (training refuses them)
    ("plan", ["--params", "7e9", "--gpus", "64", "--efficiency", "2"], "--efficiency 2.0: the "
     "fraction of peak the compute reaches, at most 1 (0.45 for 45%)"),
    ("plan", ["--params", "7e9", "--moe-top-k", "2"], "--moe-top-k 2: only used with "
     "--moe-experts (add --moe-experts E, 2 or more, or leave --moe-top-k out)"),
    ("plan_memory", ["--params", "7e9", "--moe-every", "2"], "--moe-every 2: only used with "
     "--moe-experts"),
    # --measure runs train_gpt.py's default model: --n-layer 2 was measured as 4 layers
    ("plan_memory", ["--measure", "--n-layer", "2"], "--n-layer 2: --measure trains "
     "train_gpt.py's default model (only --arch, --n-kv-head, --optimizer and --data change "
     "what it runs); leave --n-layer out, or drop --measure to plan with it"),
    # Muon's iterations without Muon would price nothing (training refuses them too)
    ("plan", ["--params", "7e9", "--muon-ns-steps", "3"], "--muon-ns-steps 3: sets Muon's "
     "Newton-Schulz iterations, which this plan does not price (add --optimizer muon, or "
     "leave --muon-ns-steps out)"),
    ("plan", ["--params", "7e9", "--optimizer", "muon", "--muon-ns-steps", "0"],
     "--muon-ns-steps 0: must be a positive number"),
    ("plan_memory", ["--params", "7e9", "--data", "x.txt"], "--data x.txt: only read by "
     "--measure"),
]


@pytest.mark.parametrize("script", ["plan", "plan_memory"])
def test_a_planner_piped_into_head_ends_quietly(script):
    """    python examples/plan.py --params 7e9 --gpus 64 | head -1
    was a BrokenPipeError traceback once head had its line; now no traceback (status 141,
    as a shell tool killed by SIGPIPE, where the table did not fit the pipe's buffer)."""
    more = " --top 200" if script == "plan" else ""                # a table past 64 KiB
    out = subprocess.run(["bash", "-c", "set -o pipefail; " + sys.executable +
                          f" examples/{script}.py --params 7e9 --gpus 64{more} | head -c 10"],
                         capture_output=True, text=True, timeout=120)
    assert out.stdout == "model: 7.0" and out.stderr == "", out.stderr
    if more:                     # (past the pipe's buffer the planner is sure to meet EPIPE)
        assert out.returncode == 141, out.returncode      # pipefail: the planner's status


def test_the_printed_command_carries_what_the_plan_was_priced_with():
    """The capacity factor and the losses' weights of a MoE plan, and --comm hier, were
    priced (or trained) but left out of the "run it" command (first-use walk 18)."""
    from minidist.train.search import train_flags
    config = GPTConfig(n_layer=2, n_head=4, n_embd=64, moe_experts=4, moe_top_k=2,
                       moe_capacity_factor=0.5, moe_z_loss_coef=0.001)
    row = {**asdict(Layout(dp=4, ep=2)), "micro_batches": 1, "micro_batch": 1,
           "schedule": "1f1b", "comm": "hier"}
    flags = train_flags(config, row)
    args = train_parser().parse_args(flags)
    assert (args.moe_capacity_factor, args.moe_z_loss_coef, args.comm) == (0.5, 0.001, "hier")
    assert "--moe-aux-loss-coef" not in flags                    # the default: left out


@pytest.mark.parametrize("script,flags,says", PLANNER_BAD,
                         ids=[f"{s} {' '.join(f)}" for s, f, _ in PLANNER_BAD])
def test_planner_bad_numbers_are_one_line(script, flags, says):
    """    python examples/plan_memory.py --params 7e9 --gpus 0"""
    out = subprocess.run([sys.executable, f"examples/{script}.py", *flags],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stdout == "" and "Traceback" not in out.stderr
    assert out.stderr.startswith("error: " + says) and out.stderr.count("\n") == 1, out.stderr


def test_planners_plan_part_of_one_node_and_suggest_whole_nodes(capsys):
    """    python examples/plan.py --gpus 36 --gpus-per-node 12
    suggested --gpus 32, which fills 2 nodes of 12 and part of a third (refused); now the
    whole-node counts that have a layout, 24 or 48. A job on part of one node (4 GPUs of
    8, or --gpus-per-node above --gpus) is planned: every group is inside that node."""
    says = plan_error(["--gpus", "36", "--gpus-per-node", "12"], capsys)
    assert says.endswith("try --gpus 24 or 48"), says
    for argv in (["--gpus", "4"], ["--gpus", "4", "--gpus-per-node", "16"]):
        plan_cli().main(argv + ["--top", "1", "--json"])
        assert json.loads(capsys.readouterr().out)["best"]
