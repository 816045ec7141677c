"""ZeRO-1, 2 and 3 as the data parallelism across pipeline replicas (--pp with --zero): the
layout is accepted; pp 2 x dp 2 on 4 ranks against one process in float64 with every
schedule (1F1B, GPipe, interleaved 1F1B, ZB-H1), --grad-accum and --ckpt-activations,
clipping every step; checkpoints that one process loads and a fresh run reloads bitwise;
train_gpt end to end with a resume that repeats the straight run. Slow: dp 2 x tp 2 x pp 2.

The exactness runs are tests/scripts/pp_check.py's (run names ending in z1, z2, z3); each
test's docstring gives the command to run it by hand. How it works: minidist/pp/README.md
("ZeRO across pipelines").
"""

import pytest

from minidist.nn import GPT, GPTConfig
from minidist.strategy import checkpoint
from minidist.strategy.base import SingleProcess
from minidist.train.amp import MixedPrecision
from minidist.train.args import train_parser
from minidist.train.strategy import check_layout
from minidist.zero.flat import gpt_units
from mpirun import logged_losses, tagged_json, within

TOL = 1e-10
RUNS_4 = ["pp2-dp2-m4-1f1b-z1", "pp2-dp2-m4-1f1b-z2", "pp2-dp2-m4-1f1b-z3",
          "pp2-dp2-m4-v2-1f1b-z1", "pp2-dp2-m4-v2-1f1b-ckpt-z3", "pp2-dp2-m4-zbh1-z2",
          "pp2-dp2-m4-zbh1-z3", "pp2-dp2-m2-ga2-1f1b-z2", "pp2-dp2-m2-gpipe-ckpt-z3",
          "pp4-m8-1f1b-z2", "pp4-m8-zbh1-z3", "pp2-dp2-m4-1f1b-z3-zs1",
          "pp2-dp2-m4-zbh1-z3-zs1", "pp2-dp2-m2-ga2-1f1b-z2-zs1"]
FILES_4 = ["pp2-dp2-m4-1f1b-z1", "pp2-dp2-m2-ga2-1f1b-z2", "pp2-dp2-m4-v2-1f1b-ckpt-z3",
           "pp2-dp2-m4-zbh1-z3", "pp2-dp2-m2-ga2-1f1b-z2-zs1"]
RUNS_8 = ["dp2-tp2-pp2-m2-1f1b-z1", "dp2-tp2-pp2-m4-zbh1-sp-z2", "dp2-tp2-pp2-m2-v2-1f1b-z3"]


@pytest.mark.parametrize("zero", ["1", "2", "3"])
@pytest.mark.parametrize("schedule", [["--schedule", "1f1b"], ["--schedule", "gpipe"],
                                      ["--schedule", "zb-h1"], ["--pp-virtual", "2"]])
def test_zero_with_every_schedule_is_accepted(zero, schedule):
    args = train_parser().parse_args(["--pp", "2", "--zero", zero, "--micro-batches", "4",
                                      "--batch-size", "16", *schedule])
    assert check_layout(args, 4) == (2, 4)          # (dp, micro-batches): no UsageError


@pytest.mark.mpi
def test_tied_wte_is_a_unit_of_its_own_cut_alike_on_first_and_last_stage(mpi):
    """ZeRO's units of a first, a middle and a last stage (each built on its rank of a real
    pp group of 3): wte alone in its own unit, with the same layout and the same shard bounds
    on every dp rank, so the two stages' shards hold the same elements; the whole model
    keeps wte in its root unit, and a middle stage has blocks only.

        mpiexec -n 3 python tests/scripts/pp_stages_check.py --n-layer 3"""
    config = GPTConfig(n_layer=3, n_head=2, n_embd=16, block_size=8, vocab_size=30)
    out = mpi(3, "tests/scripts/pp_stages_check.py", "--n-layer", "3", timeout=120)
    stages = tagged_json(out, "STAGES")[0]["stages"]
    assert [st["tied_copies"] for st in stages] == [1, 0, 1]
    for r in range(4):                                  # dp rank r of 4
        first, middle, last = (st["units"][r] for st in stages)
        wte = [next(u for u in units if u["names"] == ["transformer.wte.weight"])
               for units in (first, last)]
        assert wte[0]["layout"] == wte[1]["layout"]
        assert (wte[0]["lo"], wte[0]["hi"]) == (wte[1]["lo"], wte[1]["hi"]) == \
            (r * 120, (r + 1) * 120)
        assert first[0]["names"] == ["transformer.wpe.weight"]
        assert last[0]["names"] == ["transformer.ln_f.weight", "transformer.ln_f.bias"]
        assert all(u["module"] for u in middle)
    whole = GPT(config)
    assert whole.tied_copies() == []
    assert "transformer.wte.weight" in gpt_units(whole, 4, 0, apart=[])[0].names


def _assert_exact(results, runs, files):
    assert [r["run"] for r in results] == runs
    for r in results:
        assert within(r, TOL), r
        assert min(r["norms"]) > 0.05, r            # every step clipped (--grad-clip 0.05)
        if r["run"] in files:                       # one process loads it: the reference's
            assert r["ckpt_diff"] <= TOL and r["adam_diff"] <= TOL, r
        print(f"{r['run']:28s}: |loss diff| {r['loss_diff']:.1e}, |norm diff| "
              f"{r['norm_diff']:.1e}, |param diff| {r['param_diff']:.1e}"
              + (f", checkpoint {r['ckpt_diff']:.1e}" if r["run"] in files else ""))


@pytest.mark.mpi
def test_pp2_x_dp2_zero_equals_one_process(mpi):
    """ZeRO-1/2/3 across 2 pipelines of 2 stages, 8 layers (4 blocks per stage: ZeRO-3's
    two gather buffers are reused, so backward re-gathers evicted blocks): 1F1B with each
    stage, interleaved (v 2) with ZeRO-1 and ZeRO-3 (+ checkpointing), ZB-H1 with ZeRO-2 and
    ZeRO-3 (the deferred W fires the reduce-scatter hooks), --grad-accum 2, GPipe; and one
    pipeline of 4 stages (middle stages: blocks only) with ZeRO-2 and ZeRO-3 over one rank;
    hybrid sharding (--zero-shard 1: each rank its own shard group, the gradients all-reduced
    across the 2 replicas of each stage) with ZeRO-3 (1F1B, ZB-H1) and ZeRO-2 (grad-accum,
    its checkpoint); hybrid, the all-reduces across the replicas start in the last
    micro-batch's backward (its W under ZB-H1), not in sync_grads.
    Losses, clipped grad norms and parameters equal to one process to 1e-10; the schedules
    of one size bitwise equal; the checkpoints of four runs load into one process (its
    parameters and Adam state) and back into the pipelines bitwise:

        mpiexec -n 4 python tests/scripts/pp_check.py --n-layer 8 \
            --runs pp2-dp2-m4-1f1b-z1,... --files pp2-dp2-m4-1f1b-z1,...
    """
    out = mpi(4, "tests/scripts/pp_check.py", "--n-layer", "8", "--runs", ",".join(RUNS_4),
              "--files", ",".join(FILES_4), timeout=180)
    results = tagged_json(out)
    _assert_exact(results, RUNS_4, FILES_4)
    for r in results:     # hybrid: the last micro-batch's W / backward starts the all-reduces
        assert (r["in_backward"] > 0) == ("zs1" in r["run"]), r


@pytest.mark.mpi
@pytest.mark.slow
def test_dp2_tp2_pp2_zero_equals_one_process(mpi):
    """dp 2 x tp 2 x pp 2 on 8 ranks with ZeRO-1 (1F1B), ZeRO-2 (ZB-H1, sequence parallel)
    and ZeRO-3 (interleaved); the ZeRO-1 and ZeRO-3 checkpoints load into one process:

        mpiexec -n 8 python tests/scripts/pp_check.py --runs dp2-tp2-pp2-m2-1f1b-z1,\
dp2-tp2-pp2-m4-zbh1-sp-z2,dp2-tp2-pp2-m2-v2-1f1b-z3 \
            --files dp2-tp2-pp2-m2-1f1b-z1,dp2-tp2-pp2-m2-v2-1f1b-z3
    """
    files = [RUNS_8[0], RUNS_8[2]]
    out = mpi(8, "tests/scripts/pp_check.py", "--runs", ",".join(RUNS_8), "--files",
              ",".join(files), timeout=300)
    _assert_exact(tagged_json(out), RUNS_8, files)


TINY = ["--n-layer", "2", "--n-head", "2", "--n-embd", "16", "--block-size", "16",
        "--batch-size", "8", "--lr", "1e-2", "--eval-iters", "2", "--log-every", "1",
        "--pp", "2", "--dp", "2", "--micro-batches", "2"]


@pytest.mark.mpi
@pytest.mark.parametrize("zero, extra", [("3", ["--dropout", "0.1"]), ("2", ["--amp"])])
def test_train_gpt_pp2_dp2_zero_end_to_end_with_resume(corpus, tmp_path, mpi, zero, extra):
    """train_gpt --pp 2 --dp 2 --zero 3 (with dropout) and --zero 2 --amp (float32 master
    shards, the loss scaler): evaluation and a sample (under ZeRO-3 through every replica:
    each block's gather is a collective over dp), ZeRO's memory table and bytes per step
    (ZeRO-2: M reduce-scatters and one all-gather per step); a checkpoint at step 3
    from which a resume repeats the straight run's losses exactly, and which one process
    loads:

        mpiexec -n 4 python examples/train_gpt.py --pp 2 --dp 2 --zero 3 --micro-batches 2 \
            --dropout 0.1 --save ck --stop-at 3 ...;  ... --resume ck
    """
    common = [*TINY, "--zero", zero, *extra, "--data", corpus, "--cache-dir",
              tmp_path / "cache", "--steps", "6", "--eval-every", "3"]
    straight, resumed = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    out = mpi(4, "examples/train_gpt.py", *common, "--log-json", straight, "--sample", "20",
              timeout=120)
    assert "---- sample" in out.stdout and f"memory per rank, ZeRO stage {zero}" in out.stdout
    assert "ZeRO's memory table below is pipeline stage 0's" in out.stdout
    if zero == "2":     # a reduce-scatter per micro-batch: (M + 1)(N - 1)/N = 3/2 of Psi
        assert "(1.50 x; DDP sends" in out.stdout, out.stdout
    mpi(4, "examples/train_gpt.py", *common, "--save", tmp_path / "ck", "--stop-at", "3",
        "--sample", "0", timeout=120)
    mpi(4, "examples/train_gpt.py", *common, "--resume", tmp_path / "ck", "--log-json",
        resumed, "--sample", "0", timeout=120)
    assert logged_losses(resumed)[:3] == logged_losses(straight)[3:6]
    meta = checkpoint.load(tmp_path / "ck")[2]           # plain dicts: (params, opt, meta)
    amp = "--amp" in extra               # one process's optimizer's name, not ShardedAdamW
    assert meta["optimizer"] == ("MasterWeightOptimizer" if amp else "AdamW")
    one = SingleProcess(MixedPrecision() if amp else None)
    model = one.build_model(GPTConfig(**meta["config"]), 0, "float32")
    opt = one.build_optimizer(model, train_parser().parse_args(["--lr", "1e-2"]))
    assert checkpoint.load_checkpoint(tmp_path / "ck", model, opt)["step"] == 3
    adam = opt.state_dict()["state"]                   # (amp: the loss scaler's entry too)
    assert all(s["step"] == 3 for n, s in adam.items() if n != "loss_scaler"), adam.keys()
