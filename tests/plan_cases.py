"""The small models and the toy cluster the planners' tests work cases by hand on
(tests/test_planner.py, test_planner_cli.py, test_plan_time.py, test_plan_calibration.py,
test_plan_search.py, test_plan_strategies.py, test_plan_moe.py, test_plan_cp.py,
test_plan_muon.py, test_plan_cli.py, test_plan_check.py, test_plan_search_check.py), and
examples/plan.py run in-process."""
import importlib.util
from dataclasses import replace

import pytest

from minidist.nn import GPTConfig
from minidist.train.args import train_parser
from minidist.train.cli import UsageError
from minidist.train.cluster import Cluster
from minidist.train.comm_cost import Link
from minidist.train.memory_check import rank_bill
from minidist.train.planner import config_for_params
from minidist.train.search import train_flags
from minidist.train.strategy import check_layout

CFG = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=256)
TOY = GPTConfig(n_layer=2, n_head=1, n_embd=4, block_size=2, vocab_size=8)
UNIT = Cluster("toy", gpus_per_node=8, mem_gib=1, peak_tflops=1e-12, efficiency=1.0,
               intra=Link(0.0, 1.0), inter=Link(0.0, 1.0), overlap=0.0)   # 1 FLOP/s, 1 B/s
# block 1 is MoE: 2 experts, top-2, capacity ceil(0.5 x 2 x 2 / 2) = 1 token per expert and
# sequence, so a sequence of 2 tokens keeps min(k s, E cap) = min(4, 2) = 2 of its 4 rows
MOE_TOY = replace(TOY, moe_experts=2, moe_top_k=2, moe_capacity_factor=0.5, moe_every=2)
TOY4 = replace(TOY, n_layer=4)
# models the layout searches are run on (their rows must be ones training accepts)
PROPOSAL_MODELS = [
    GPTConfig(n_layer=4, n_head=8, n_embd=256, block_size=20, vocab_size=50257),
    config_for_params(1e9, seq=2048),
    GPTConfig(n_layer=4, n_head=8, n_embd=256, block_size=64, vocab_size=256, moe_experts=4,
              moe_top_k=2)]
# the models the planners' bills are held to the memory check's on (test_plan_check.py,
# test_plan_search_check.py): dense, MoE in every block, Llama GQA with MoE every 2nd block
DENSE = GPTConfig(n_layer=4, n_head=4, n_embd=64, block_size=64, vocab_size=256)
MOE = GPTConfig(n_layer=4, n_head=4, n_embd=64, block_size=64, vocab_size=256,
                moe_experts=4, moe_top_k=2)
LLAMA_MOE = GPTConfig(n_layer=4, n_head=4, n_embd=64, block_size=64, vocab_size=256,
                      arch="llama", n_kv_head=2, bias=False, moe_experts=4, moe_top_k=2,
                      moe_every=2)


def largest_check_bill(config, flags, gpus):
    """The memory check's bill (memory_check.rank_bill) of train_gpt.py `flags` on `gpus`
    GPUs, its largest rank's (host_is_device False: no checkpoint's copy to bill)."""
    args = train_parser().parse_args([str(f) for f in flags])
    return max((rank_bill(config, args, gpus, r, False) for r in range(gpus)),
               key=lambda b: b["total"])


def training_refusal(config, row, gpus, v=1):
    """train_gpt's refusal of a planner's row (its error line), or None if it runs."""
    try:
        check_layout(train_parser().parse_args(train_flags(config, row, v)), gpus)
    except UsageError as e:
        return f"{row['layout']}: {e}"
    return None


def plan_cli():
    """examples/plan.py as a module (its main(argv) runs in this process)."""
    spec = importlib.util.spec_from_file_location("plan_cli", "examples/plan.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def plan_error(argv, capsys):
    """plan.py's error line for argv (after checking it is one line, exit 2, no output)."""
    with pytest.raises(SystemExit) as e:
        plan_cli().main(argv)
    out = capsys.readouterr()
    assert e.value.code == 2 and out.out == "" and out.err.count("\n") == 1, out
    return out.err.strip()
