"""Context parallelism's (ring attention's) exactness runs under mpiexec
(tests/scripts/cp_check.py), also with --ckpt-activations and composed with tp, sp, dp and
ZeRO: the same losses and gradients as one process, the bytes the formula says, the memory
the ledger predicts, a resume; and examples/train_gpt.py under --cp against one process.
"""
import math

import numpy as np
import pytest

from mpirun import ROOT, tagged_json
from tests.cp_cases import TINY, _check_exact, _losses, _sample


def _check_recompute_is_bitwise(rows):
    """A "+ckpt" run ends where the same run without recompute ends, to the last bit."""
    by_name = {r["run"]: r for r in rows}
    pairs = [(r, by_name[r["run"].removesuffix("+ckpt")]) for r in rows
             if r["run"].endswith("+ckpt")]
    assert pairs
    for ckpt, plain in pairs:
        assert ckpt["losses"] == plain["losses"], (ckpt, plain)
        assert ckpt["param_diff"] == plain["param_diff"], (ckpt, plain)


def _check_memory(row, n):
    """Activations per cp rank = 1/n of one process's, without and with recompute, and
    recompute keeps less."""
    assert abs(row["ratio"] - 1 / n) < 1e-3 and abs(row["ratio_ckpt"] - 1 / n) < 1e-3
    assert row["per_rank_ckpt"] < row["per_rank"] / 2


CP2_RUNS = ["cp2", "cp2+naive", "cp2+ckpt", "cp2+naive+ckpt"]
KV_RUNS = ["cp2+kv0", "cp2+kv1", "cp2+naive+kv2+ckpt"]


@pytest.fixture(scope="module")
def cp2_out(mpi):
    """One 2-rank cp_check.py job for the two tests below (each reads its own runs' rows):
    every 2-rank job also runs the ring's gradcheck and the memory rows, so two jobs ran
    them twice.

        mpiexec -n 2 python tests/scripts/cp_check.py --runs cp2,cp2+naive,...,cp2+kv0,...
    """
    return mpi(2, "tests/scripts/cp_check.py", "--runs", ",".join(CP2_RUNS + KV_RUNS),
               timeout=240)


def _rows(out, runs):
    """The RESULT rows of `runs`, in the job's order."""
    return [r for r in tagged_json(out, "RESULT") if r["run"] in runs]


@pytest.mark.mpi
def test_cp2_is_exact_and_sends_the_formula(cp2_out):
    """cp 2, zig-zag and naive, also with --ckpt-activations (the ring forward recomputed
    inside backward), against one process without recompute in float64 (and bit-identical
    to the same run without it); bytes; activations; RingSelfAttention's backward against
    central differences across the 2 ranks (zig-zag, naive, zig-zag with dropout; the script
    asserts each element).

        mpiexec -n 2 python tests/scripts/cp_check.py --runs cp2,cp2+naive,cp2+ckpt,...
    """
    out = cp2_out
    rows = _rows(out, CP2_RUNS)
    _check_exact(rows, CP2_RUNS)
    _check_recompute_is_bitwise(rows)
    _check_memory(tagged_json(out, "MEMORY")[0], 2)
    checked = tagged_json(out, "GRADCHECK")[0]
    assert sorted(checked) == ["naive p=0.0", "zigzag p=0.0", "zigzag p=0.25"], checked
    assert max(checked.values()) < 1e-6, checked


@pytest.mark.mpi
def test_the_ring_sends_k_and_v_as_the_kv_heads(cp2_out):
    """Grouped-query attention (Llama's block, 4 q heads): the ring's k/v blocks and their
    accumulators travel as the K kv heads and are repeated to 4 only where attended to, so
    --n-kv-head 1 sends (6N - 4)(S - S/4) per layer less than --n-kv-head 0 (S = B Tl C 8
    bytes: k's under multi-head attention), each = ring_bytes of k's own bytes; every run
    one process's numbers (float64, 3 steps; kv 2 also naive with recompute):

        mpiexec -n 2 python tests/scripts/cp_check.py --runs cp2+kv0,cp2+kv1,...
    """
    from minidist.cp.ring import ring_bytes
    rows = _rows(cp2_out, KV_RUNS)
    _check_exact(rows, KV_RUNS)
    by = {r["run"]: r for r in rows}
    n, layers, S = 2, 2, 4 * 8 * 16 * 8                    # B 4, Tl 16/2, C 16, float64
    assert by["cp2+kv0"]["bytes_sent"] == layers * ring_bytes(S, n)
    assert by["cp2+kv0"]["bytes_sent"] - by["cp2+kv1"]["bytes_sent"] == \
        layers * (6 * n - 4) * (S - S // 4)
    assert by["cp2+naive+kv2+ckpt"]["bytes_sent"] == layers * ring_bytes(S // 2, n, True)


def _check_reloads(rows, runs, ranks):
    """The --resume-runs rows: the checkpoint holds one process's parameters and Adam
    moments (1e-10), loads bitwise into the same layout, ZeRO-1 and tp 2 without cp, and
    the resumed step logs the run's own next loss (asserted in the script)."""
    reloads = [r["reload"] for r in rows if r["run"] in runs]
    assert len(reloads) == len(runs)
    for r in reloads:
        assert r["param_diff"] < 1e-10 and r["adam_diff"] < 1e-10, r
        assert [r["same"], r["zero1"], r[f"tp2xdp{ranks // 2}+zero3"]] == ["bitwise"] * 3
        assert math.isfinite(r["next_loss"])


def test_cp4_and_compositions_are_exact(mpi):
    """cp 4, cp 2 x dp 2 (DDP, ZeRO-1/2/3, grad-accum; ZeRO-3 and ZeRO-2 + grad-accum with
    hybrid sharding, each dp replica's cp ranks one sharded replica), cp 2 x tp 2, both
    splits, and with ZeRO-1/2/3 over dp x cp (cp x tp x ZeRO-3 and cp x tp x SP x ZeRO-2
    hybrid too: --zero-shard 1, each cp rank a replica) (the ZeRO-3 runs' sharded
    checkpoints saved and loaded back); and
    with --ckpt-activations ("+ckpt") cp 4, cp 2 x dp 2 (DDP, ZeRO-1/2, ZeRO-3 with
    grad-accum), cp 2 x tp 2 (both splits; ZeRO-3), each bit-identical to the same run
    without it; cp 2 x tp 2 with --sequence-parallel ("+sp": SP_RUNS). Llama's block with
    K kv heads ("+kv<K>": k and v travel as K heads): cp 4 and cp 2 x dp 2 x ZeRO-3 with 1,
    cp 2 x tp 2 x SP with 2 (one per tp rank), also recomputed. Bytes on the cp and tp
    groups = their formulas; the activation ledger of cp x tp without and with SP.

        mpiexec -n 4 python tests/scripts/cp_check.py --runs cp4,cp4+naive,cp2xdp2,... \
            --resume-runs cp2xtp2+zero3,cp2xtp2+sp+zero3,cp2xtp2+zero3+shard1
    """
    runs = ["cp4", "cp4+naive", "cp2xdp2", "cp2xdp2+naive+accum", "cp2xdp2+zero1",
            "cp2xdp2+zero2", "cp2xdp2+zero3", "cp2xdp2+zero3+accum", "cp2xdp2+zero3+shard2",
            "cp2xdp2+zero2+shard2+accum", "cp2xtp2", "cp2xtp2+naive",
            "cp2xtp2+zero1", "cp2xtp2+zero2+naive", "cp2xtp2+zero3",
            "cp4+ckpt", "cp2xdp2+ckpt", "cp2xdp2+zero1+ckpt", "cp2xdp2+zero2+ckpt",
            "cp2xdp2+zero3+accum+ckpt", "cp2xtp2+ckpt", "cp2xtp2+naive+ckpt",
            "cp2xtp2+zero3+ckpt", "cp2xtp2+zero3+shard1", "cp2xtp2+sp+zero2+shard1",
            "cp4+kv1", "cp2xdp2+zero3+kv1", "cp2xtp2+sp+kv2", "cp2xtp2+sp+kv2+ckpt", *SP_RUNS]
    resumed = ["cp2xtp2+zero3", "cp2xtp2+sp+zero3", "cp2xtp2+zero3+shard1"]
    out = mpi(4, "tests/scripts/cp_check.py", "--runs", ",".join(runs), "--resume-runs",
              ",".join(resumed), timeout=240)
    rows = tagged_json(out, "RESULT")
    _check_exact(rows, runs)
    _check_reloads(rows, resumed, 4)
    assert tagged_json(out, "MESH")[0]["cp_group_of_0"] == [0, 1]
    _check_recompute_is_bitwise(rows)
    _check_memory(tagged_json(out, "MEMORY")[0], 4)
    _check_sp_memory(tagged_json(out, "MEMORY_SP")[0], 2)


# cp 2 x tp 2 with sequence parallelism: both splits, DDP and ZeRO-1/2/3 over dp x cp, and
# with --ckpt-activations (bitwise its twin without)
SP_RUNS = ["cp2xtp2+sp", "cp2xtp2+sp+naive", "cp2xtp2+sp+zero1", "cp2xtp2+sp+zero2+naive",
           "cp2xtp2+sp+zero3", "cp2xtp2+sp+ckpt", "cp2xtp2+sp+zero3+ckpt"]


def _check_sp_memory(row, tp):
    """The activation ledger of a cp x tp rank: sequence parallelism keeps less, without
    and with recompute; every (B, Tl, C) buffer the graph keeps without it is, with it, a
    (B, Tl/tp, C) one (the residual stream split by tp again)."""
    for plain, sp in (("cp2xtp2", "cp2xtp2+sp"), ("cp2xtp2+ckpt", "cp2xtp2+sp+ckpt")):
        a, b = row[plain], row[sp]
        assert b["per_rank"] < a["per_rank"] and a["split"] == 0, row
        assert a["whole"] == tp * b["split"] and b["whole"] == 0 < b["split"], row


@pytest.mark.slow
def test_cp2_tp2_dp2_zero_on_8_ranks_is_exact_and_resumes(mpi):
    """cp 2 x tp 2 x dp 2 with ZeRO-1, ZeRO-2 and ZeRO-3 (+ grad-accum 2) over the 4 dp x cp
    ranks of each tp part, and with --sequence-parallel (DDP; ZeRO-3 + grad-accum 2), = one
    process; the ZeRO-3 runs' checkpoints load back bitwise (same layout, ZeRO-1, tp 2 x
    dp 4 without cp) and resume:

        mpiexec -n 8 python tests/scripts/cp_check.py --runs cp2xtp2xdp2+zero1,\
cp2xtp2xdp2+zero2,cp2xtp2xdp2+zero3+accum,cp2xtp2xdp2+sp,cp2xtp2xdp2+sp+zero3+accum \
            --resume-runs cp2xtp2xdp2+zero3+accum,cp2xtp2xdp2+sp+zero3+accum
    """
    runs = ["cp2xtp2xdp2+zero1", "cp2xtp2xdp2+zero2", "cp2xtp2xdp2+zero3+accum",
            "cp2xtp2xdp2+sp", "cp2xtp2xdp2+sp+zero3+accum"]
    resumed = ["cp2xtp2xdp2+zero3+accum", "cp2xtp2xdp2+sp+zero3+accum"]
    out = mpi(8, "tests/scripts/cp_check.py", "--runs", ",".join(runs), "--resume-runs",
              ",".join(resumed), timeout=300)
    rows = tagged_json(out, "RESULT")
    _check_exact(rows, runs)
    _check_reloads(rows, resumed, 8)


@pytest.mark.mpi
def test_train_gpt_cp2_matches_one_process_and_resumes_on_one(corpus, tmp_path, mpi):
    """train_gpt.py --cp 2 logs one process's losses, val loss and sample (float64); its
    checkpoint (DDP's: the replicated model, from rank 0) resumes on one process:

        python examples/train_gpt.py --data CORPUS --dtype float64 ... --log-json one.jsonl
        mpiexec -n 2 python examples/train_gpt.py --cp 2 ... --save ck
    """
    import subprocess
    import sys
    from mpirun import device_flags, mpi_env
    common = [*TINY, "--data", corpus, "--cache-dir", tmp_path / "cache"]
    one, cp = tmp_path / "one.jsonl", tmp_path / "cp.jsonl"
    ref = subprocess.run([sys.executable, "examples/train_gpt.py", *map(str, common),
                          "--log-json", str(one), *device_flags(mpi.device)], cwd=ROOT,
                         env=mpi_env(), text=True, capture_output=True,
                         check=True, timeout=600).stdout
    out = mpi(2, "examples/train_gpt.py", *common, "--cp", "2", "--log-json", cp,
              "--save", tmp_path / "ck", timeout=120).stdout
    assert "context parallel: cp 2" in out and "MiB sent per rank per step on the cp" in out
    assert np.allclose(_losses(cp), _losses(one), rtol=0, atol=1e-10)
    assert _sample(out) == _sample(ref)
    back = tmp_path / "back.jsonl"
    subprocess.run([sys.executable, "examples/train_gpt.py", *map(str, common), "--resume",
                    str(tmp_path / "ck"), "--log-json", str(back), *device_flags(mpi.device)],
                   cwd=ROOT, env=mpi_env(), text=True, capture_output=True,
                   check=True, timeout=600)
    assert abs(_losses(back)[-1] - _losses(one)[-1]) <= 1e-10


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.parametrize("sp", [[], ["--sequence-parallel"]])
def test_train_gpt_cp2_tp2_zero3_matches_one_process_and_resumes(corpus, tmp_path, mpi, sp):
    """train_gpt.py --cp 2 --tp 2 --zero 3 (also with --sequence-parallel) logs one
    process's losses (float64); stopped at step 2 and resumed from its checkpoint (one ZeRO
    folder per tp rank, sharded over the dp x cp ranks) it logs the uninterrupted run's, bit
    for bit, also resumed as cp 2 x tp 2 with ZeRO-1 (another stage: ZeRO reshards):

        mpiexec -n 4 python examples/train_gpt.py --cp 2 --tp 2 --zero 3 ... --stop-at 2 --save ck
        mpiexec -n 4 python examples/train_gpt.py --cp 2 --tp 2 --zero 3 ... --resume ck
    """
    import subprocess
    import sys
    from mpirun import device_flags, mpi_env
    common = [*TINY, "--sample", "0", "--data", corpus, "--cache-dir", tmp_path / "cache"]
    layout = ["--cp", "2", "--tp", "2", "--zero", "3", *sp]
    one, straight = tmp_path / "one.jsonl", tmp_path / "straight.jsonl"
    subprocess.run([sys.executable, "examples/train_gpt.py", *map(str, common), "--log-json",
                    str(one), *device_flags(mpi.device)], cwd=ROOT, env=mpi_env(), text=True,
                   capture_output=True, check=True, timeout=600)
    out = mpi(4, "examples/train_gpt.py", *common, *layout, "--log-json", straight,
              timeout=120).stdout
    assert "context parallel: cp 2 x dp 1 x tp 2" in out and "ZeRO stage 3 over 2 ranks" in out
    assert f"sequence parallel {'on' if sp else 'off'}" in out
    assert np.allclose(_losses(straight), _losses(one), rtol=0, atol=1e-10)
    mpi(4, "examples/train_gpt.py", *common, *layout, "--save", tmp_path / "ck", "--stop-at",
        "2", timeout=120)
    for stage in ("3", "1"):
        back = tmp_path / f"back{stage}.jsonl"
        mpi(4, "examples/train_gpt.py", *common, *layout, "--zero", stage, "--resume",
            tmp_path / "ck", "--log-json", back, timeout=120)
        assert _losses(back) == _losses(straight)[2:], stage
