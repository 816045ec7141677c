"""Expert parallelism's exactness runs under mpiexec (tests/scripts/ep_check.py) against one
process: ep 2 and ep 4, with dp, ZeRO, tp, sequence and context splits, in pipeline stages,
and ep 2 x pp 2 x tp 2."""
import numpy as np
import pytest

from mpirun import tagged_json, within


def check_rows(rows, runs):
    assert [r["run"] for r in rows] == runs
    for r in rows:
        if "+amp" in r["run"]:                   # float16: one process's to its rounding
            check_amp_row(r)
            continue
        assert within(r, 1e-10), r
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
    rounding, and its float32 masters, every one (measured 4e-6 to 1.4e-5 in the mean, <= 1.4% of
    float16's epsilon); the inf put in one expert's gradient on one rank skipped that step
    everywhere (checked on every rank by the script) as in one process; a resume
    bit-identical."""
    assert r["loss_rel_diff"] < 2e-3 and r["skipped"] == r["ref_skipped"] == 1, r
    assert r["masters_compared"] > 0 and r["master_mean_diff"] < 0.05 * 2 ** -10, r
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
    --ckpt-activations; --dropout 0.1; the experts' own DDP over edp overlapped and bucketed
    in 4 buckets with --grad-accum 2, naive, float16 --amp with float32 gradients), ep 2 x
    tp 2 (DDP, ZeRO-1/2/3; --dropout 0.1), MoE in
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
            "ep2xdp2+zero2+zs2+accum", "ep2xdp2+zero3+zs2+ckpt", "ep2xdp2+zero1+zs2+amp",
            "ep2xdp2+accum+ckpt", "ep2xdp2+bucketed+accum", "ep2xdp2+ddpnaive",
            "ep2xdp2+amp+ckpt"]
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
    rounding, check_amp_row); cp 2 x pp 2), cp 2 x tp 2 x SP, and ep 2 x tp 2 x SP with ZeRO-1,
    ZeRO-3 + grad-accum 2 and float16 --amp (DDP, ZeRO-1; the experts' partial gradients
    summed over tp once a step, after their sync), against one process in float64
    (1e-10: losses with the aux and z losses, grad norms, every parameter); the same
    (token, expert) assignments dropped at capacity factor 1 (some are), the exchange's bytes
    as split_calls counts them.

        mpiexec -n 4 python tests/scripts/ep_check.py --runs ep1xcp2,ep1xcp2+naive,...
    """
    runs = ["ep1xcp2", "ep1xcp2+naive", "ep1xcp2+drop+recompute", "ep1xtp2+sp+drop",
            "ep1xtp2+sp+zero3", "ep1xcp2+zero3+accum", "ep2xcp2", "ep2xcp2+naive+drop",
            "ep2xcp2+zero1+ckpt", "ep2xcp2+amp", "ep2xtp2+sp", "ep1xcp2xtp2+sp", "ep1xcp2xpp2",
            "ep2xtp2+sp+zero1", "ep2xtp2+sp+zero3+accum", "ep2xtp2+sp+amp",
            "ep2xtp2+sp+zero1+amp"]
    out = mpi(4, "tests/scripts/ep_check.py", "--runs", ",".join(runs), timeout=300)
    check_split_rows(tagged_json(out, "RESULT"), runs)


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.cpu_only("ep_check.py's reference runs on numpy")
def test_moe_on_split_sequences_8_ranks_is_exact(mpi):
    """ep 2 x cp 2 x tp 2 with SP (DDP; ZeRO-3 with --dropout 0.1), ep 2 x cp 2 x dp 2
    (ZeRO-2, saved and resumed), and ep 2 x tp 2 x dp 2 with SP, the experts' replicas edp 2
    (DDP; ZeRO-2; ZeRO-1 hybrid --zero-shard 2 under float16 --amp) on 8 ranks, against one
    process in float64 (--amp: to its rounding).

        mpiexec -n 8 python tests/scripts/ep_check.py --runs ep2xcp2xtp2+sp,...
    """
    runs = ["ep2xcp2xtp2+sp", "ep2xcp2xtp2+sp+zero3+drop", "ep2xcp2xdp2+zero2+ckpt",
            "ep2xtp2xdp2+sp", "ep2xtp2xdp2+sp+zero2", "ep2xtp2xdp2+sp+zero1+zs2+amp"]
    out = mpi(8, "tests/scripts/ep_check.py", "--runs", ",".join(runs), timeout=300)
    check_split_rows(tagged_json(out, "RESULT"), runs)


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.cpu_only("ep_check.py's reference runs on numpy")
def test_ep2_x_pp2_x_tp2_is_exact(mpi):
    """ep 2 x pp 2 x tp 2 on 8 ranks (DDP, ZeRO-3), ep 2 x pp 2 x dp 2 (ZeRO-1: the experts'
    AdamW state halved over edp 2; DDP: the experts' buckets over edp, silent but in the
    last micro-batch) and ep 2 x tp 2 x dp 2 with hybrid ZeRO-1 (--zero-shard 2)
    against one process in float64; their checkpoints (the experts of every stage, tp's
    pieces and ZeRO's shards gathered) resume bit-identically and load on one process.

        mpiexec -n 8 python tests/scripts/ep_check.py --runs ep2xpp2xtp2+ckpt,...
    """
    runs = ["ep2xpp2xtp2+ckpt", "ep2xpp2xtp2+zero3+ckpt", "ep2xpp2xdp2+zero1+ckpt",
            "ep2xtp2xdp2+zero1+zs2+ckpt", "ep2xpp2xdp2+ckpt"]
    out = mpi(8, "tests/scripts/ep_check.py", "--runs", ",".join(runs), timeout=300)
    rows = tagged_json(out, "RESULT")
    check_rows(rows, runs)
    assert 2 * rows[2]["expert_opt_state"] == rows[2]["expert_params"], rows[2]
