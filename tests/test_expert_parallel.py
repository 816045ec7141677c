"""Expert parallelism (minidist/ep/) in one process: the regrouping of what arrives, the byte
formula, the planner's count, the refusals (in-process and train_gpt.py's one error line),
the all-to-all's gradient on one rank, the walkthroughs and the expert-load plot. Under
mpiexec: the exactness runs (tests/scripts/ep_check.py) in tests/test_ep_exact.py, and
train_gpt.py with --ep against one process in tests/test_ep_train.py."""
import json
import subprocess
import sys

import numpy as np
import pytest

from minidist.ep.exchange import exchange_bytes, regroup_order
from minidist.ep.strategy import ep_problems, moe_problems
from minidist.train.cli import UsageError
from minidist.train.strategy import check_layout
from minidist.train.args import train_parser
from mpirun import ROOT, mpi_env


def test_regroup_orders_by_expert_then_source():
    # 2 sources x 2 local experts; rows arrive [s0e0 s0e0 | s0e1 | s1e0 | s1e1 s1e1]
    recv = np.array([[2, 1], [1, 2]])
    assert regroup_order(recv).tolist() == [0, 1, 3, 2, 4, 5]
    assert regroup_order(np.zeros((2, 2), dtype=np.int64)).tolist() == []


def test_exchange_bytes_formula():
    # 2 ranks, 2 experts each: 2 int64 counts; 3 rows out, 5 rows in, C=4 float64, x2 (bwd)
    assert exchange_bytes(3, 5, N=2, El=2, C=4, itemsize=8) == 16 + 2 * 8 * 4 * 8


def test_planner_counts_experts_once_per_ep_rank():
    from minidist.nn import GPTConfig
    from minidist.nn.config import gpt_param_specs
    from minidist.train.planner import Layout, candidates, stage_params
    c = GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=8, vocab_size=30, moe_experts=4)
    specs = gpt_param_specs(c)
    expert = sum(int(np.prod(s)) for n, (s, _) in specs.items() if ".experts." in n)
    total = sum(int(np.prod(s)) for s, _ in specs.values())
    assert stage_params(c) == [total]
    assert stage_params(c, ep=4) == [total - expert + expert // 4]
    assert Layout(dp=8, ep=4) in candidates(c, 8)


def test_the_chapters_ep_figures_are_the_layers_sizes():
    """minidist/ep/README.md's sizes, from the model's parameter specs and the collectives'
    byte rules: the traced run's "16 expert tensors, 33,408 values, 133,632 bytes on edp"
    (--n-layer 2 --n-embd 32 --moe-experts 4 --ep 2: one rank's 2 of 4 experts in 2 blocks,
    float32), and the MoE exchange on a split sequence, "16 KiB of ids and 516 B of sums per
    MoE block forward, against the ring's 2 S = 8 MiB" (train_gpt.py's default model at
    --block-size 1024 --cp 2, E 8, k 2: moe_split.split_calls sent by the ring)."""
    from minidist.comm.ring import ring_bytes
    from minidist.nn import GPTConfig
    from minidist.nn.config import gpt_param_specs
    from minidist.nn.moe_split import split_calls
    c = GPTConfig(n_layer=2, n_head=4, n_embd=32, block_size=32, vocab_size=256,
                  moe_experts=4)
    mine = [int(np.prod(s)) for n, (s, _) in gpt_param_specs(c).items()
            if ".experts." in n and int(n.split(".experts.")[1].split(".")[0]) < 2]
    a = train_parser().parse_args([])
    B, n, C = a.batch_size, 1024 // 2, a.n_embd
    (_, _, ids, one), (_, _, sums, size) = split_calls(B, n, 2, 8, 1, 2, 4)
    text = " ".join(open(f"{ROOT}/minidist/ep/README.md").read().split())
    for said in [f"{len(mine)} expert tensors, {sum(mine):,} values, {4 * sum(mine):,} bytes "
                 "on edp per step",
                 f"each rank sends {ring_bytes('all_gather', ids, one, 0, 2) // 1024} KiB of "
                 f"ids and {ring_bytes('all_reduce', sums, size, 0, 2)} B of sums per MoE "
                 f"block forward, against the ring's 2 S = {2 * B * n * C * 4 // 2**20} MiB"]:
        assert said in text, said


def parse(*flags):
    return train_parser().parse_args(["--moe-experts", "4", *flags])


def test_refusals_name_the_flag():
    assert moe_problems(train_parser().parse_args(["--ep", "2"])) == \
        ["--ep needs a Mixture of Experts: add --moe-experts E"]
    for split in (["--cp", "2"], ["--tp", "2", "--sequence-parallel"],
                  ["--cp", "2", "--ep", "2", "--tp", "2", "--sequence-parallel"]):
        assert moe_problems(parse(*split)) == []     # routed over the whole sequence
        assert moe_problems(parse(*split, "--comm", "nccl")) == []   # ids: through MPI
    assert moe_problems(parse("--tp", "2", "--comm", "nccl")) == []
    assert ep_problems(parse("--ep", "2")) == []
    assert any("not a multiple of --ep 3" in p for p in ep_problems(parse("--ep", "3")))
    assert ep_problems(parse("--ep", "2", "--zero", "1", "--amp")) == []
    assert ep_problems(parse("--ep", "2", "--comm", "nccl")) == []   # grouped send/recv
    assert ep_problems(parse("--ep", "2", "--zero", "3")) == []
    assert ep_problems(parse("--ep", "2", "--tp", "2", "--zero", "1", "--save", "ck",
                             "--resume", "ck")) == []
    built = parse("--ep", "2", "--tp", "2", "--dropout", "0.1", "--ckpt-activations")
    assert ep_problems(built) == moe_problems(built) == []
    assert ep_problems(parse("--ep", "2", "--pp", "2", "--zero", "3", "--save", "ck",
                             "--resume", "ck")) == []           # ep x pp checkpoints: built
    assert check_layout(parse("--ep", "2"), 8) == (4, 1)          # dp = 8 / ep
    with pytest.raises(UsageError, match="expert parallelism: --dp 1 x --ep 2 = 2 ranks"):
        check_layout(parse("--ep", "2", "--dp", "1"), 3)


@pytest.mark.mpi
def test_bad_ep_is_one_error_line(mpi):
    """mpiexec -n 2 python examples/train_gpt.py --ep 2 --moe-experts 3"""
    out = mpi(2, "examples/train_gpt.py", "--ep", "2", "--moe-experts", "3", timeout=60,
              check=False)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.startswith("error: expert parallelism: ")
    assert "--moe-experts 3 is not a multiple of --ep 2" in out.stderr


def test_moe_refusal_is_one_error_line():
    """python examples/train_gpt.py --ep 2 (no --moe-experts: refused before any
    communication)"""
    out = subprocess.run([sys.executable, "examples/train_gpt.py", "--ep", "2"],
                         cwd=ROOT, env=mpi_env(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr == "error: mixture of experts: --ep needs a Mixture of Experts: add " \
        "--moe-experts E\n"


def test_plot_draws_the_expert_load(tmp_path):
    """python examples/plot.py moe.jsonl -o moe.png (a log with moe_tokens rows)"""
    pytest.importorskip("matplotlib")
    log = tmp_path / "moe.jsonl"
    with open(log, "w") as f:
        for s in range(5):
            f.write(json.dumps({"step": s, "loss": 4.0 - 0.1 * s, "tokens_per_s": 1e3,
                                "moe_tokens": [[10 + s, 12, 9, 11], [8, 8, 8, 8]],
                                "moe_dropped": [3, 0], "moe_aux": [1.01, 1.0]}) + "\n")
    png = tmp_path / "moe.png"
    done = subprocess.run([sys.executable, "examples/plot.py", str(log), "-o", str(png)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert png.read_bytes().startswith(b"\x89PNG")


def test_walkthrough_shows_routes_and_is_exact():
    """python examples/moe_walkthrough.py"""
    out = subprocess.run([sys.executable, "examples/moe_walkthrough.py"], cwd=ROOT,
                         capture_output=True, text=True, check=True, timeout=60).stdout
    assert "rank 1: sequences 2..3, experts [2, 3]" in out and "dropped" in out
    # each token names what capacity took from it (only the rank's total said so)
    lost = sum(int(line.rsplit("(", 1)[1].split()[0]) for line in out.splitlines()
               if line.endswith("choices dropped: over capacity)"))
    assert lost == sum(int(line.rsplit("dropped ", 1)[1]) for line in out.splitlines()
                       if line.startswith("  kept per expert")) > 0, out
    assert "all-to-all rows (from rank i, to rank j)" in out
    assert float(out.rsplit("one process = ", 1)[1].split()[0]) < 1e-12


@pytest.mark.parametrize("flags", [["--experts", "0"], ["--ep", "0"], ["--batch", "0"],
                                   ["--top-k", "5"], ["--top-k", "0"], ["--capacity", "-1"],
                                   ["--tokens", "0"], ["--ep", "2", "--experts", "3"]])
def test_moe_walkthrough_refuses_bad_input(flags):
    """python examples/moe_walkthrough.py --experts 0 (and the others): one `error:` line
    naming the flag, exit 2, no traceback."""
    out = subprocess.run([sys.executable, "examples/moe_walkthrough.py", *flags], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    errors = [line for line in out.stderr.splitlines() if "error:" in line]
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert len(errors) == 1 and f"error: {flags[-2]} {flags[-1]}" in errors[0], out.stderr


def test_all_to_all_gradcheck_on_one_rank():
    """AllToAll on a one-rank group, where the rows come back in place: the identity, and
    its gradient the identity's (float64 central differences). The exchange across ranks
    with uneven counts, where backward must swap them, is checked by
    tests/test_alltoall.py::test_all_to_all (tests/scripts/alltoall_check.py)."""
    from mpi4py import MPI
    from minidist.autograd import Tensor
    from minidist.autograd.gradcheck import gradcheck
    from minidist.comm import ProcessGroup
    from minidist.ep.exchange import AllToAll
    group = ProcessGroup(MPI.COMM_SELF, "ring", name="one-rank ep")
    x = Tensor(np.random.default_rng(6).standard_normal((5, 3)), requires_grad=True)
    gradcheck(lambda t: AllToAll.apply(t, group, [5], [5]), [x], name="AllToAll")
    assert np.array_equal(AllToAll.apply(x, group, [5], [5]).data, x.data)
