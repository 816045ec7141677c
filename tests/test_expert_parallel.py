"""Expert parallelism (minidist/ep/): the regrouping of what arrives, the byte formula, the
refusals, and under mpiexec the exactness runs (tests/scripts/ep_check.py) and train_gpt.py
with --ep against one process."""
import json
import re
import subprocess
import sys

import numpy as np
import pytest

from minidist.ep.exchange import exchange_bytes, regroup_order
from minidist.ep.strategy import ep_problems, moe_problems
from minidist.train.cli import UsageError
from minidist.train.strategy import check_layout
from minidist.train.args import train_parser
from mpirun import ROOT, device_flags, mpi_env, tagged_json


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


def check_rows(rows, runs):
    assert [r["run"] for r in rows] == runs
    for r in rows:
        if "+amp" in r["run"]:                   # float16: one process's to its rounding
            check_amp_row(r)
            continue
        assert all(r[k] < 1e-10 for k in ("loss_diff", "norm_diff", "param_diff")), r
        assert r["compared"] == r["ref_params"], r        # every parameter compared somewhere
        if r["run"].endswith("+ckpt"):           # saved after step 2, resumed: bit-identical
            assert r["resume_diff"] == 0 and r["one_process_diff"] < 1e-10, r
        if r["run"].startswith("ep1"):                           # no ep group: no bytes
            assert r["bytes_sent"] == r["theory_sent"] == 0, r
        elif "naive" not in r["run"]:
            assert r["bytes_sent"] == r["theory_sent"] > 0, r
        assert r["ref_dropped"] > 0, "the runs must drop tokens for the drop check to count"


def check_amp_row(r):
    """A --amp run (float16 loss scaling) of ep_check.py: one process's losses to float16's
    rounding; the inf put in one expert's gradient on one rank skipped that step everywhere
    (checked on every rank by the script) as in one process; a resume bit-identical."""
    assert r["loss_rel_diff"] < 2e-3 and r["skipped"] == r["ref_skipped"] == 1, r
    assert r["scale"] == r["ref_scale"] and not np.isfinite(r["norm_at_poison"]), r
    if r["run"].endswith("+ckpt"):
        assert r["resume_diff"] == 0 and r["one_process_diff"] < 1e-2, r


@pytest.mark.mpi
@pytest.mark.cpu_only("ep_check.py's reference runs on numpy")
def test_ep2_is_exact(mpi):
    """ep 2 (top-2 and top-1 with grad-accum, comm ring/naive/mpi, every 2nd block MoE, DDP
    overlapped/bucketed/naive; ZeRO-3, ZeRO-2 with grad-accum over the dense parameters;
    --ckpt-activations, also with ZeRO-3 and grad-accum), and MoE without ep under tp 2,
    ZeRO-1, ZeRO-3 and DDP with --ckpt-activations, against one process (no recompute) in
    float64; the same tokens dropped; bytes = formula (the recompute's all-to-alls counted).
    --dropout 0.1 under ep 2 (also with --ckpt-activations and ZeRO-3, and with grad-accum 2)
    and under tp 2: one process's masks (ep2+drop+ckpt: also after a resume, the keys' step
    restored as train_gpt's is). +ckpt runs also save after step 2 of 4: the resumed run is
    bit-identical, and one process loading the checkpoint follows to 1e-10. +amp runs: ZeRO
    with float16 --amp against one process's --amp (check_amp_row).

        mpiexec -n 2 python tests/scripts/ep_check.py --runs ep2,...,ep1xtp2
    """
    runs = ["ep2+ckpt", "ep2+top1+accum", "ep2+naive", "ep2+mpi+every2", "ep2+bucketed",
            "ep2+ddpnaive+accum", "ep1xtp2+ckpt", "ep1xdp2+zero1", "ep1xdp2+zero3",
            "ep2+zero3+ckpt", "ep2+zero2+accum+ckpt", "ep2+zero1+amp+ckpt", "ep2+zero3+amp",
            "ep2+recompute", "ep2+recompute+zero3+accum", "ep1xdp2+recompute",
            "ep2+drop+ckpt", "ep1xtp2+drop", "ep2+drop+recompute+zero3", "ep2+drop+accum"]
    out = mpi(2, "tests/scripts/ep_check.py", "--runs", ",".join(runs), timeout=300)
    check_rows(tagged_json(out, "RESULT"), runs)


@pytest.mark.mpi
@pytest.mark.cpu_only("ep_check.py's reference runs on numpy")
def test_moe_in_pipeline_stages_is_exact(mpi):
    """MoE blocks in pipeline stages (pp 2: 1F1B, GPipe, ZB-H1, interleaved 1F1B, with
    --ckpt-activations and grad-accum, every 2nd block MoE): every stage's router losses
    enter the loss and the backward as on one process, float64 to 1e-10.

        mpiexec -n 2 python tests/scripts/ep_check.py --runs ep1xpp2,ep1xpp2+gpipe,...
    """
    runs = ["ep1xpp2", "ep1xpp2+gpipe", "ep1xpp2+zbh1", "ep1xpp2+v2",
            "ep1xpp2+recompute+accum", "ep1xpp2+every2"]
    out = mpi(2, "tests/scripts/ep_check.py", "--runs", ",".join(runs), timeout=180)
    check_rows(tagged_json(out, "RESULT"), runs)


@pytest.mark.mpi
@pytest.mark.cpu_only("ep_check.py's reference runs on numpy")
def test_ep4_and_compositions_are_exact(mpi):
    """ep 4, ep 2 x dp 2 (DDP, ZeRO-1/2/3 over the dense parameters, DDP with
    --ckpt-activations; --dropout 0.1), ep 2 x tp 2 (DDP, ZeRO-1/2/3; --dropout 0.1), MoE in
    pp 2 x dp 2 (ZeRO-1) and pp 2 x tp 2, and ep 2 x pp 2 (1F1B; GPipe with
    --ckpt-activations; ZB-H1; ZeRO-1/3 over the dense parameters; interleaved with ZeRO-2;
    ZeRO-1 with --amp; --dropout 0.1 with --ckpt-activations), and hybrid sharding of the
    dense parameters (--zero-shard 2: ep 2 x dp 2 at ZeRO-1, 2 (--grad-accum 2), 3 and
    ZeRO-1 --amp; ep 4 at ZeRO-2, two shard groups of different experts) against one process
    in float64; +ckpt runs save, resume bit-identically and load on one process (ep x pp:
    every stage's experts gathered); +amp runs with float16 --amp (test_ep2_is_exact).

        mpiexec -n 4 python tests/scripts/ep_check.py --runs ep4,ep2xdp2,ep2xtp2,...
    """
    runs = ["ep4", "ep2xdp2", "ep2xtp2+ckpt", "ep2xdp2+zero1+ckpt", "ep2xdp2+zero2",
            "ep2xdp2+zero3+ckpt", "ep2xtp2+zero1", "ep2xtp2+zero2+ckpt", "ep2xtp2+zero3+ckpt",
            "ep2xdp2+zero2+amp+ckpt", "ep2xtp2+zero1+amp+ckpt", "ep2xdp2+recompute",
            "ep2xdp2+drop", "ep2xtp2+drop", "ep1xpp2xdp2+zero1", "ep1xpp2xtp2", "ep2xpp2+ckpt",
            "ep2xpp2+gpipe+recompute", "ep2xpp2+zbh1+ckpt", "ep2xpp2+zero1+ckpt",
            "ep2xpp2+v2+zero2+ckpt", "ep2xpp2+zero3+ckpt", "ep2xpp2+zero1+amp+ckpt",
            "ep2xpp2+drop+recompute", "ep2xdp2+zero1+zs2", "ep4+zero2+zs2",
            "ep2xdp2+zero2+zs2+accum", "ep2xdp2+zero3+zs2+ckpt", "ep2xdp2+zero1+zs2+amp"]
    out = mpi(4, "tests/scripts/ep_check.py", "--runs", ",".join(runs), timeout=420)
    rows = tagged_json(out, "RESULT")
    check_rows(rows, runs)
    assert rows[0]["experts_here"] == ["0"] and rows[1]["experts_here"] == ["0", "1"]
    for r in rows:                  # ZeRO: the experts' AdamW state halved over edp 2
        if r["run"].startswith("ep2xdp2+zero") and "+amp" not in r["run"]:
            assert 2 * r["expert_opt_state"] == r["expert_params"], r


def check_split_rows(rows, runs):
    """check_rows, and the sequence exchange (minidist/nn/moe_split.py) measured on the
    groups that split the sequence: tp under --sequence-parallel, cp under --cp (the script
    asserts its calls and bytes equal split_calls')."""
    check_rows(rows, runs)
    for r in rows:
        if "+amp" in r["run"]:                   # float16: check_amp_row (no byte ledger)
            continue
        groups = {k.split()[0] for k, v in r["split_sent"].items() if v > 0}
        want = {"tp"} if "+sp" in r["run"] else set()
        assert groups == want | ({"cp"} if "cp2" in r["run"] else set()), r


@pytest.mark.mpi
@pytest.mark.cpu_only("ep_check.py's reference runs on numpy")
def test_moe_on_split_sequences_is_exact(mpi):
    """MoE with each sequence split over ranks, on 4 ranks: sequence parallelism (tp 2 x
    dp 2, with --dropout 0.1, with ZeRO-3; ep 2 x tp 2), context parallelism (cp 2 x dp 2
    zig-zag and naive, with --dropout 0.1 and --ckpt-activations, ZeRO-3 with grad-accum 2;
    ep 2 x cp 2, naive with dropout, ZeRO-1 saved and resumed, float16 --amp (to its
    rounding, check_amp_row); cp 2 x pp 2), and cp 2 x tp 2 x SP, against one process in float64
    (1e-10: losses with the aux and z losses, grad norms, every parameter); the same
    (token, expert) assignments dropped at capacity factor 1 (some are), the exchange's bytes
    as split_calls counts them.

        mpiexec -n 4 python tests/scripts/ep_check.py --runs ep1xcp2,ep1xcp2+naive,...
    """
    runs = ["ep1xcp2", "ep1xcp2+naive", "ep1xcp2+drop+recompute", "ep1xtp2+sp+drop",
            "ep1xtp2+sp+zero3", "ep1xcp2+zero3+accum", "ep2xcp2", "ep2xcp2+naive+drop",
            "ep2xcp2+zero1+ckpt", "ep2xcp2+amp", "ep2xtp2+sp", "ep1xcp2xtp2+sp", "ep1xcp2xpp2"]
    out = mpi(4, "tests/scripts/ep_check.py", "--runs", ",".join(runs), timeout=300)
    check_split_rows(tagged_json(out, "RESULT"), runs)


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.cpu_only("ep_check.py's reference runs on numpy")
def test_moe_on_split_sequences_8_ranks_is_exact(mpi):
    """ep 2 x cp 2 x tp 2 with SP (DDP; ZeRO-3 with --dropout 0.1) and ep 2 x cp 2 x dp 2
    (ZeRO-2, saved and resumed) on 8 ranks, against one process in float64.

        mpiexec -n 8 python tests/scripts/ep_check.py --runs ep2xcp2xtp2+sp,...
    """
    runs = ["ep2xcp2xtp2+sp", "ep2xcp2xtp2+sp+zero3+drop", "ep2xcp2xdp2+zero2+ckpt"]
    out = mpi(8, "tests/scripts/ep_check.py", "--runs", ",".join(runs), timeout=300)
    check_split_rows(tagged_json(out, "RESULT"), runs)


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.cpu_only("ep_check.py's reference runs on numpy")
def test_ep2_x_pp2_x_tp2_is_exact(mpi):
    """ep 2 x pp 2 x tp 2 on 8 ranks (DDP, ZeRO-3), ep 2 x pp 2 x dp 2 (ZeRO-1: the experts'
    AdamW state halved over edp 2) and ep 2 x tp 2 x dp 2 with hybrid ZeRO-1 (--zero-shard 2)
    against one process in float64; their checkpoints (the experts of every stage, tp's
    pieces and ZeRO's shards gathered) resume bit-identically and load on one process.

        mpiexec -n 8 python tests/scripts/ep_check.py --runs ep2xpp2xtp2+ckpt,...
    """
    runs = ["ep2xpp2xtp2+ckpt", "ep2xpp2xtp2+zero3+ckpt", "ep2xpp2xdp2+zero1+ckpt",
            "ep2xtp2xdp2+zero1+zs2+ckpt"]
    out = mpi(8, "tests/scripts/ep_check.py", "--runs", ",".join(runs), timeout=300)
    rows = tagged_json(out, "RESULT")
    check_rows(rows, runs)
    assert 2 * rows[2]["expert_opt_state"] == rows[2]["expert_params"], rows[2]


TINY = ["--n-layer", "2", "--n-head", "2", "--n-embd", "16", "--block-size", "16",
        "--batch-size", "4", "--lr", "1e-2", "--eval-iters", "2", "--log-every", "1",
        "--steps", "3", "--eval-every", "0", "--dtype", "float64", "--sample", "20",
        "--moe-experts", "4", "--moe-top-k", "2"]


def _sample(stdout):
    assert stdout.count("---- sample ----") == 1, stdout            # printed by rank 0 alone
    return stdout.split("---- sample ----\n")[1].split("\n----------------")[0]


def _rows(path):
    return [json.loads(line) for line in open(path)]


@pytest.mark.mpi
def test_train_gpt_ep2_matches_one_process(corpus, tmp_path, mpi):
    """train_gpt.py --ep 2 logs one process's losses, val loss, sample (float64) and the
    tokens per expert (summed over both ranks' rows); the checkpoint of --ep 2 --zero 1 after
    step 2 (ZeRO's shards and the experts gathered into one process's format) finishes the
    run on one process and on --ep 2 --zero 3, whose memory table counts the experts:

        python examples/train_gpt.py --data CORPUS --moe-experts 4 ... --log-json one.jsonl
        mpiexec -n 2 python examples/train_gpt.py --ep 2 --moe-experts 4 ...
        mpiexec -n 2 python examples/train_gpt.py --ep 2 --zero 1 ... --stop-at 2 --save ck
        python examples/train_gpt.py ... --resume ck  (and mpiexec -n 2 ... --ep 2 --zero 3)
    """
    common = [*TINY, "--data", corpus, "--cache-dir", tmp_path / "cache"]
    one, ep = tmp_path / "one.jsonl", tmp_path / "ep.jsonl"
    ref = subprocess.run([sys.executable, "examples/train_gpt.py", *map(str, common),
                          "--log-json", str(one), *device_flags(mpi.device)], cwd=ROOT,
                         env=mpi_env(), text=True, capture_output=True, check=True).stdout
    out = mpi(2, "examples/train_gpt.py", *common, "--ep", "2", "--log-json", ep,
              timeout=120).stdout
    # a checkpoint of --ep 2 --zero 1 after step 2 (the dense shards and the experts gathered)
    # finishes on one process exactly, and on --ep 2 --zero 3
    mpi(2, "examples/train_gpt.py", *common, "--ep", "2", "--zero", "1", "--stop-at", "2",
        "--save", tmp_path / "ck", timeout=120)
    back = tmp_path / "back.jsonl"
    subprocess.run([sys.executable, "examples/train_gpt.py", *map(str, common), "--resume",
                    str(tmp_path / "ck"), "--log-json", str(back), *device_flags(mpi.device)],
                   cwd=ROOT, env=mpi_env(), text=True, capture_output=True, check=True)
    again = tmp_path / "again.jsonl"                        # ... and on --ep 2 --zero 3
    table = mpi(2, "examples/train_gpt.py", *common, "--ep", "2", "--zero", "3", "--resume",
                tmp_path / "ck", "--log-json", again, timeout=120).stdout
    # ZeRO's memory table predicts the experts apart (ZeRO-1 over edp at any stage) and
    # measures their optimizer state too: measured = predicted up to the flat units' padding
    assert "of them this rank's experts: optimizer state split over 1" in table
    assert float(re.search(r"within ([\d.]+)% of predicted", table).group(1)) < 1.0
    last = [r["loss"] for r in _rows(one) if "loss" in r][-1]
    for log in (back, again):
        assert abs([r["loss"] for r in _rows(log) if "loss" in r][-1] - last) < 1e-10
    assert "expert parallel: ep 2" in out and "on the ep group (all-to-all)" in out
    a, b = _rows(one), _rows(ep)
    losses = [(r.get("loss", r.get("val_loss")), s.get("loss", s.get("val_loss")))
              for r, s in zip(a, b)]
    assert max(abs(x - y) for x, y in losses) < 1e-10
    assert _sample(out) == _sample(ref)
    tokens = np.array(a[0]["moe_tokens"])                    # (blocks, E), one process
    assert tokens.shape == (2, 4)
    routed = 4 * 16 * 2                                      # B T k per block
    assert (tokens.sum(axis=1) + np.array(a[0]["moe_dropped"]) == routed).all()
    assert_same_load_stats(a, b)


def assert_same_load_stats(a, b):
    """The load-balance statistics of two --log-json logs, step by step: the counts equal,
    the aux losses to 1e-10."""
    a, b = [r for r in a if "moe_tokens" in r], [r for r in b if "moe_tokens" in r]
    assert len(a) == len(b) == 3
    for r, s in zip(a, b):
        assert r["moe_tokens"] == s["moe_tokens"] and r["moe_dropped"] == s["moe_dropped"]
        assert np.allclose(r["moe_aux"], s["moe_aux"], rtol=0, atol=1e-10)


@pytest.mark.mpi
def test_load_stats_cover_the_global_batch(corpus, tmp_path, mpi):
    """--log-json's moe_tokens, moe_dropped and moe_aux under plain dp 2, tp 2, cp 2 and tp 2
    with sequence parallelism (no --ep) are one process's for the same global batch: summed
    over the ranks that hold different rows (dp) or different tokens of them (cp, SP),
    counted once for the ranks that hold the same tokens (tp):

        python examples/train_gpt.py --data CORPUS --moe-experts 4 ... --log-json one.jsonl
        mpiexec -n 2 python examples/train_gpt.py --moe-experts 4 ... (and --tp 2, --cp 2,
            --tp 2 --sequence-parallel)
    """
    common = [*TINY, "--data", corpus, "--cache-dir", tmp_path / "cache"]
    one = tmp_path / "one.jsonl"
    subprocess.run([sys.executable, "examples/train_gpt.py", *map(str, common),
                    "--log-json", str(one), *device_flags(mpi.device)], cwd=ROOT,
                   env=mpi_env(), text=True, capture_output=True, check=True)
    for flags in ([], ["--tp", "2"], ["--cp", "2"], ["--tp", "2", "--sequence-parallel"]):
        log = tmp_path / f"{'_'.join(flags) or 'dp'}.jsonl"
        mpi(2, "examples/train_gpt.py", *common, *flags, "--log-json", log, timeout=120)
        assert_same_load_stats(_rows(one), _rows(log))


@pytest.mark.mpi
def test_train_gpt_pp2_logs_one_process(corpus, tmp_path, mpi):
    """train_gpt.py --pp 2 with MoE blocks logs one process's losses, val losses (the router
    losses of both stages summed) and load statistics, with only the second stage holding an
    MoE block (--moe-every 2), at one micro-batch and at the default 4 (first-use walk 35:
    the counts were the last micro-batch's, a quarter of the batch's); --grad-accum 2 too:

        python examples/train_gpt.py --data CORPUS --moe-experts 4 --moe-every 2 ...
        mpiexec -n 2 python examples/train_gpt.py ... --pp 2 --micro-batches 1
    """
    common = [*TINY, "--data", corpus, "--cache-dir", tmp_path / "cache", "--moe-every", "2",
              "--moe-z-loss-coef", "0.01"]
    one, pp = tmp_path / "one.jsonl", tmp_path / "pp.jsonl"
    subprocess.run([sys.executable, "examples/train_gpt.py", *map(str, common), "--log-json",
                    str(one), *device_flags(mpi.device)], cwd=ROOT, env=mpi_env(), text=True,
                   capture_output=True, check=True)
    for flags in (["--pp", "2", "--micro-batches", "1"], ["--pp", "2"], ["--grad-accum", "2"]):
        mpi(2 if "--pp" in flags else 1, "examples/train_gpt.py", *common, *flags,
            "--log-json", pp, timeout=120)
        a, b = _rows(one), _rows(pp)
        assert len(a) == len(b) and "val_loss" in a[-1]
        for r, s in zip(a, b):
            key = "loss" if "loss" in r else "val_loss"
            assert abs(r[key] - s[key]) < 1e-10, (flags, r, s)
        assert_same_load_stats(a, b)
        assert len(a[0]["moe_tokens"]) == 1                  # block 1 alone is MoE


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


@pytest.mark.mpi
def test_amp_ep2_follows_one_process(corpus, tmp_path, mpi):
    """--amp (float16 on numpy) with --ep 2, and with --ep 2 --zero 2, against one process
    with --amp: the clipping norm counts the experts unscaled, as the mixed-precision
    optimizer does (to 1e-3: float16).

        python examples/train_gpt.py --amp --moe-experts 4 ... --log-json one.jsonl
        mpiexec -n 2 python examples/train_gpt.py --amp --ep 2 --moe-experts 4 ...
        mpiexec -n 2 python examples/train_gpt.py --amp --ep 2 --zero 2 --moe-experts 4 ...
    """
    flags = [a for a in TINY if a not in ("--dtype", "float64")]
    common = [*flags, "--amp", "--grad-clip", "0.05", "--data", corpus, "--cache-dir",
              tmp_path / "cache"]
    one, ep = tmp_path / "one.jsonl", tmp_path / "ep.jsonl"
    subprocess.run([sys.executable, "examples/train_gpt.py", *map(str, common), "--log-json",
                    str(one), *device_flags(mpi.device)], cwd=ROOT, env=mpi_env(),
                   text=True, capture_output=True, check=True)
    mpi(2, "examples/train_gpt.py", *common, "--ep", "2", "--log-json", ep, timeout=120)
    zero = tmp_path / "zero.jsonl"
    mpi(2, "examples/train_gpt.py", *common, "--ep", "2", "--zero", "2", "--log-json", zero,
        timeout=120)
    a = [r["loss"] for r in _rows(one) if "loss" in r]
    for log in (ep, zero):
        b = [r["loss"] for r in _rows(log) if "loss" in r]
        assert len(a) == len(b) == 3 and np.allclose(a, b, rtol=1e-3, atol=0)


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
    """AllToAll's backward (the exchange the other way, send and receive counts swapped)
    against central differences, float64, on a one-rank group, where the rows come back
    in place (review 38: no gradient check; the ep runs check it against one process)."""
    from mpi4py import MPI
    from minidist.autograd import Tensor
    from minidist.autograd.gradcheck import gradcheck
    from minidist.comm import ProcessGroup
    from minidist.ep.exchange import AllToAll
    group = ProcessGroup(MPI.COMM_SELF, "ring", name="one-rank ep")
    x = Tensor(np.random.default_rng(6).standard_normal((5, 3)), requires_grad=True)
    gradcheck(lambda t: AllToAll.apply(t, group, [5], [5]), [x], name="AllToAll")
    assert np.array_equal(AllToAll.apply(x, group, [5], [5]).data, x.data)
