"""examples/train_gpt.py with --ep under mpiexec against one process: the same losses and
sample, the experts' load statistics over the global batch (under --pp too), and --amp."""
import json
import re
import subprocess
import sys

import numpy as np
import pytest

from mpirun import ROOT, device_flags, mpi_env
from tests.ep_cases import TINY, _rows


def _sample(stdout):
    assert stdout.count("---- sample ----") == 1, stdout            # printed by rank 0 alone
    return stdout.split("---- sample ----\n")[1].split("\n----------------")[0]


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
                         env=mpi_env(), text=True, capture_output=True,
                         check=True, timeout=600).stdout
    out = mpi(2, "examples/train_gpt.py", *common, "--ep", "2", "--log-json", ep,
              timeout=120).stdout
    # a checkpoint of --ep 2 --zero 1 after step 2 (the dense shards and the experts gathered)
    # finishes on one process exactly, and on --ep 2 --zero 3
    mpi(2, "examples/train_gpt.py", *common, "--ep", "2", "--zero", "1", "--stop-at", "2",
        "--save", tmp_path / "ck", timeout=120)
    back = tmp_path / "back.jsonl"
    subprocess.run([sys.executable, "examples/train_gpt.py", *map(str, common), "--resume",
                    str(tmp_path / "ck"), "--log-json", str(back), *device_flags(mpi.device)],
                   cwd=ROOT, env=mpi_env(), text=True, capture_output=True,
                   check=True, timeout=600)
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
    assert all(abs(x - y) < 1e-10 for x, y in losses), losses
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
                   env=mpi_env(), text=True, capture_output=True, check=True, timeout=600)
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
    one = tmp_path / "one.jsonl"
    subprocess.run([sys.executable, "examples/train_gpt.py", *map(str, common), "--log-json",
                    str(one), *device_flags(mpi.device)], cwd=ROOT, env=mpi_env(), text=True,
                   capture_output=True, check=True, timeout=600)
    for flags in (["--pp", "2", "--micro-batches", "1"], ["--pp", "2"], ["--grad-accum", "2"]):
        pp = tmp_path / f"{'_'.join(flags)}.jsonl"         # (a new run: a new log)
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
                   text=True, capture_output=True, check=True, timeout=600)
    mpi(2, "examples/train_gpt.py", *common, "--ep", "2", "--log-json", ep, timeout=120)
    zero = tmp_path / "zero.jsonl"
    mpi(2, "examples/train_gpt.py", *common, "--ep", "2", "--zero", "2", "--log-json", zero,
        timeout=120)
    a = [r["loss"] for r in _rows(one) if "loss" in r]
    for log in (ep, zero):
        b = [r["loss"] for r in _rows(log) if "loss" in r]
        assert len(a) == len(b) == 3 and np.allclose(a, b, rtol=1e-3, atol=0)


@pytest.mark.mpi
def test_the_summary_counts_the_experts_gradient_traffic_over_their_replicas(mpi):
    """ep 2 x dp 2: each expert has 2 replicas (edp), whose gradients are averaged over
    them (DDP: all-reduced tensor by tensor; ZeRO: reduce-scattered, then the shards
    all-gathered): 2(n-1)/n x the rank's expert bytes either way, which the ep summary line
    gives beside the all-to-alls (no line counted them until 2026-11-29):

        mpiexec -n 4 python examples/train_gpt.py --moe-experts 4 --ep 2 --dp 2 \\
            --steps 2 --n-layer 2 --n-embd 32 --block-size 32 --batch-size 8 --sample 0
    """
    L, C, E, ep, edp = 2, 32, 4, 2, 2
    expert = C * 4 * C + 4 * C + 4 * C * C + C               # c_fc and c_proj, with biases
    sent = 2 * (edp - 1) / edp * L * (E // ep) * expert * 4   # float32
    flags = ["--moe-experts", E, "--ep", ep, "--dp", edp, "--steps", "2", "--n-layer", L,
             "--n-embd", C, "--block-size", "32", "--batch-size", "8", "--eval-iters", "1",
             "--sample", "0"]
    for zero in ("0", "1"):
        out = mpi(4, "examples/train_gpt.py", *map(str, flags), "--zero", zero,
                  timeout=120).stdout
        assert f"; {sent / 2**20:.2f} MiB on the edp group of 2 (the experts' gradients" \
            in out, out


@pytest.mark.mpi
def test_the_experts_buckets_are_all_reduced_from_backwards_hooks(tmp_path, mpi):
    """ep 2 x dp 2, --ddp overlapped: the experts' gradients are a DDP of their own over
    their replicas (edp; minidist/ddp/sync.py), whose hooks issue each bucket's all-reduce
    inside backward: per step and rank, as many edp all-reduces as buckets (4 at
    --bucket-mb 0.04: one expert, 8C^2 + 5C float32s = 33 KB, each), every one issued
    (the trace's `issued`) before that step's backward ended; --ddp naive: one per tensor
    (16: 2 blocks x 2 experts x 4), all after backward (until 2026-11-29 that was every mode):

        mpiexec -n 4 python examples/train_gpt.py --moe-experts 4 --ep 2 --dp 2 \\
            --steps 3 --n-layer 2 --n-embd 32 ... --bucket-mb 0.04 --trace ep.json
    """
    flags = ["--moe-experts", "4", "--ep", "2", "--dp", "2", "--steps", "3", "--n-layer", "2",
             "--n-embd", "32", "--block-size", "32", "--batch-size", "8", "--eval-iters", "1",
             "--sample", "0"]
    for mode, calls, in_backward in (("overlapped", 4, 4), ("naive", 16, 0)):
        path = tmp_path / f"{mode}.json"
        size = ["--bucket-mb", "0.04"] if mode == "overlapped" else []
        out = mpi(4, "examples/train_gpt.py", *flags, *size, "--ddp", mode, "--trace", path,
                  timeout=120).stdout
        if mode == "overlapped":
            assert "(the experts' gradients over their replicas: all-reduced in 4 buckets, " \
                "started from backward's hooks)" in out, out
        events = [e for e in json.load(open(path))["traceEvents"] if e.get("ph") == "X"]
        for rank in range(4):
            mine = [e for e in events if e["pid"] == rank]
            backwards = sorted((e["ts"], e["ts"] + e["dur"]) for e in mine
                               if e["name"] == "backward")
            edp = [e for e in mine if e["args"].get("group") == "edp"
                   and e["name"] != "broadcast"]   # (the replicas made equal, at the start)
            assert len(backwards) == 3 and len(edp) == 3 * calls, (mode, rank, len(edp))
            assert {e["name"] for e in edp} == {"all_reduce"}
            issued = [e["args"].get("issued", e["ts"]) for e in edp]   # (blocking: ts)
            inside = [sum(start <= t <= end for t in issued) for start, end in backwards]
            assert inside == [in_backward] * 3, (mode, rank, inside)
