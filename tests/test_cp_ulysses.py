"""Ulysses attention (--cp-attention ulysses, minidist/cp/ulysses.py): its exchange's
gradient in one process and across ranks, its bytes against the ring's, its refusals, and its
exactness runs under mpiexec (tests/scripts/cp_check.py, examples/train_gpt.py), in pipeline
stages and with experts too.
"""
import numpy as np
import pytest

from minidist.autograd import Tensor
from minidist.cp.ring import ring_bytes
from minidist.cp.strategy import cp_problems
from minidist.cp.ulysses import ulysses_bytes
from minidist.train.args import train_parser
from minidist.train.cli import UsageError
from mpirun import ROOT, tagged_json
from tests.cp_cases import TINY, _check_exact, _flags, _losses, _sample


# ---- Ulysses attention (--cp-attention ulysses, minidist/cp/ulysses.py) ----------------------

def test_ulysses_exchange_gradcheck_on_one_rank():
    """On one rank the all-to-all keeps everything: HeadsForTokens and TokensForHeads are the
    reorder alone (a zig-zag order), and their backward passes a float64 gradcheck. Across
    ranks (heads and tokens exchanged): ulysses_check.py's exchange_gradcheck, run by
    test_ulysses_cp2_is_exact_and_sends_the_formula (and on 4 ranks)."""
    from mpi4py import MPI
    from minidist.autograd.gradcheck import gradcheck
    from minidist.comm import ProcessGroup
    from minidist.cp.ulysses import HeadsForTokens, TokensForHeads
    group = ProcessGroup(MPI.COMM_SELF, "ring", name="one-rank cp")
    order = np.array([0, 1, 6, 7, 2, 3, 4, 5])                     # a zig-zag rank order
    x = Tensor(np.random.default_rng(4).standard_normal((2, 8, 6)), requires_grad=True)
    gradcheck(lambda t: HeadsForTokens.apply(t, group, order, 3), [x], name="HeadsForTokens")
    gradcheck(lambda t: TokensForHeads.apply(t, group, order, 1), [x], name="TokensForHeads")
    assert np.array_equal(HeadsForTokens.apply(x, group, order, 3).data[:, order], x.data)


def test_ulysses_bytes_formula_against_the_ring():
    """8S(N-1)/N per layer and micro-batch (12S(N-1)/N with recompute) against the ring's
    (6N-4)S: half the ring's at N = 2, and Ulysses' falls with N where the ring's grows.
    Grouped-query: 4(S + kv)(N-1)/N, kv the bytes of k as sent, kv_heads_sent of the nh
    heads: lcm(K, N) where N divides K or K divides N, fewer where neither does."""
    from minidist.cp.ulysses import kv_heads_sent, ulysses_bytes
    assert ulysses_bytes(12, 2) == 48 and ulysses_bytes(12, 4) == 72
    assert ulysses_bytes(12, 4, recompute=True) == 108
    assert ulysses_bytes(12, 2, kv=4) == 32 and ulysses_bytes(12, 2, True, kv=4) == 48
    assert [kv_heads_sent(8, k, 2) for k in (1, 2, 4, 8, 0)] == [2, 2, 4, 8, 8]
    assert [kv_heads_sent(8, k, 4) for k in (1, 2, 4, 8)] == [4, 4, 4, 8]
    assert kv_heads_sent(12, 2, 3) == 6          # 12 q heads, 3 ranks: 4 each, 2 kv heads
    # K and N coprime: lcm(K, N) = K N sent each rank all K heads; the windows send 2 each
    assert [kv_heads_sent(h, k, n) for h, k, n in ((6, 3, 2), (12, 3, 4), (12, 6, 4),
                                                    (40, 8, 5))] == [4, 8, 8, 15]
    assert ulysses_bytes(12, 2) * 2 == ring_bytes(12, 2)
    S0 = 4096                                                    # one sequence's B T C bytes
    ring = [ring_bytes(S0 // n, n) for n in (2, 4, 8)]
    ulysses = [ulysses_bytes(S0 // n, n) for n in (2, 4, 8)]
    assert ring == sorted(ring) and ulysses == sorted(ulysses, reverse=True)


def test_kv_windows_give_each_rank_every_kv_head_its_q_heads_read():
    """Every (nh, K, N) with K and N dividing nh up to 48 heads: each cp rank's window of c
    kv heads lies in 0 .. K-1 and holds the kv head floor(q / (nh / K)) of each of its nh / N
    q heads (repeat_kv's order); N c is at most lcm(K, N) (what repeating k and v to lcm
    heads sent) and equals it where N divides K or K divides N."""
    from math import lcm
    from minidist.cp.ulysses import kv_windows
    for nh in range(1, 49):
        for k in (k for k in range(1, nh + 1) if nh % k == 0):
            for n in (n for n in range(1, nh + 1) if nh % n == 0):
                starts, c = kv_windows(nh, k, n)
                per, g = nh // n, nh // k
                assert n * c <= lcm(k, n) and (n * c == lcm(k, n) or (k % n and n % k))
                for j, s in enumerate(starts):
                    assert 0 <= s and s + c <= k
                    assert all(s <= (j * per + i) // g < s + c for i in range(per))


def test_pick_kv_gradcheck():
    """PickKV (Ulysses' kv windows, minidist/cp/ulysses.py): q as it is, then the k and v
    heads picked, repeats allowed (a kv head two ranks' windows share, or two q heads read),
    = numpy's take; its backward (each pick's gradient added into its head) = central
    differences, float64."""
    from minidist.autograd.gradcheck import gradcheck
    from minidist.cp.ulysses import PickKV, pick_kv
    x = np.random.default_rng(2).standard_normal((2, 3, (4 + 2 * 3) * 2))
    heads = [1, 0, 1, 2, 2]
    q, k, v = np.split(x, [8, 14], axis=-1)
    pick = [np.take(a.reshape(2, 3, 3, 2), heads, axis=2).reshape(2, 3, 10) for a in (k, v)]
    got = pick_kv(Tensor(x), 4, 3, heads).data
    assert np.array_equal(got, np.concatenate([q] + pick, axis=-1))
    gradcheck(lambda t: PickKV.apply(t, 4, 3, heads), [Tensor(x, requires_grad=True)],
              name="PickKV")
    assert pick_kv(x, 4, 3, [0, 1, 2]) is x                       # every head in order


def test_the_chapters_cp_bytes_are_the_formulas_for_the_main_jobs_model():
    """minidist/cp/README.md's MiB per rank per step for train_gpt.py's default model (4
    layers, C 128, B 16, 4 heads, float32): the ring at --cp 4 --block-size 1024 (160, with
    recompute 208), the ring and Ulysses at --block-size 256 (32 / 16 at cp 2, 40 / 12 at
    cp 4), one kv head (the ring's 10.00, Ulysses' 12.00 at cp 2 and at cp 4), and the table
    in units of the whole sequence's S0; ring_bytes and ulysses_bytes are what every
    exactness run holds the ledger to. The runs printed these on 2026-11-29."""
    from minidist.cp.ulysses import kv_heads_sent
    a = train_parser().parse_args([])
    text = " ".join(open(f"{ROOT}/minidist/cp/README.md").read().split())

    def per_step(T, n, kv_head=0, ulysses=False, recompute=False):
        S = a.batch_size * T // n * a.n_embd * 4                # this rank's (B, T/N, C)
        if ulysses:
            kv = S * kv_heads_sent(a.n_head, kv_head, n) // a.n_head
            return a.n_layer * ulysses_bytes(S, n, recompute, kv) / 2**20
        return a.n_layer * ring_bytes(S * (kv_head or a.n_head) // a.n_head, n,
                                      recompute) / 2**20

    S = a.batch_size * 1024 // 4 * a.n_embd * 4 / 2**20
    ring, ring_ckpt = per_step(1024, 4), per_step(1024, 4, recompute=True)
    u = {(n, k): per_step(256, n, k, True) for n in (2, 4) for k in (0, 1)}
    for said in [
            f"S = {S:g} MiB, {ring / S / a.n_layer:g} S x {a.n_layer} layers = {ring:g} MiB",
            f"{ring_ckpt:g} MiB sent per rank per step on the cp group instead of {ring:g} "
            f"MiB (+ 2S(N-1) x {a.n_layer} layers = {ring_ckpt - ring:g} MiB",
            f"ring attention): {per_step(256, 4):.2f} MiB sent per rank per step",
            f"ulysses attention): {u[4, 0]:.2f} MiB sent per rank per step",
            f"at `--cp 2` {per_step(256, 2):.2f} against {u[2, 0]:.2f} MiB",
            f"{per_step(256, 4):.2f} MiB per rank per step with `--n-kv-head 0`",
            f"{per_step(256, 4, 1):.2f} MiB with `--n-kv-head 1` now",
            f"`--cp 2`: {u[2, 0]:.2f} MiB with `--n-kv-head 0`, {u[2, 1]:.2f} MiB with 1",
            f"`--cp 4`: {u[4, 0]:.2f} MiB either way" if u[4, 0] == u[4, 1] else "(differ)",
            "| ring, (6N-4)/N S0 | " + " | ".join(
                f"{ring_bytes(1, n) / n:g} S0" for n in (2, 4, 8)) + " |",
            "| Ulysses, 8(N-1)/N² S0 | " + " | ".join(
                f"{ulysses_bytes(n, n) / n / n:g} S0" for n in (2, 4, 8)) + " |"]:
        assert said in text, said


@pytest.mark.parametrize("extra,words", [
    (["--cp", "4", "--n-head", "2", "--n-embd", "16"],
     "--cp-attention ulysses gives each of the --cp 4 ranks whole heads: --n-head 2 = 2 "
     "heads do not divide by --cp 4"),
    (["--cp", "4", "--tp", "2", "--n-head", "4"],
     "--n-head 4 / --tp 2 = 2 heads do not divide by --cp 4")])
def test_ulysses_refuses_heads_that_do_not_divide(extra, words):
    args = _flags("--cp-attention", "ulysses", *extra)
    problems = cp_problems(args)
    assert len(problems) == 1 and words in problems[0], problems
    args.cp_attention = "ring"
    assert cp_problems(args) == []                               # the ring takes any heads


def test_cp_attention_without_cp_is_refused():
    from minidist.train.idle_flags import check_idle_flags
    with pytest.raises(UsageError, match=r"^--cp-attention ulysses: sets how context "
                       r"parallelism computes attention, which this run does not use \(add "
                       r"--cp 2 or more"):
        check_idle_flags(_flags("--cp-attention", "ulysses"))
    check_idle_flags(_flags("--cp-attention", "ring"))           # the default: no complaint


def _check_ulysses_rows(out, runs):
    """The RING row (Ulysses' attention = the ring's on the same input, also with 1 and 2 kv
    heads: grouped-query), the GRADCHECK row (both exchanges' backward = central differences
    across the ranks, zig-zag and naive, and HeadsForTokens' with k and v narrower than q;
    the script asserts each element) and every run exact, its cp bytes = ulysses_bytes, its
    summary naming the attention."""
    ring = tagged_json(out, "RING")[0]
    assert max(ring.values()) < 1e-12 and "zigzag p=0.2 kv=1" in ring, ring
    checked = tagged_json(out, "GRADCHECK")[0]
    assert sorted(checked) == sorted(f"{f} {s}" for f in ("HeadsForTokens", "TokensForHeads",
                                                          "HeadsForTokens q|k|v")
                                     for s in ("zigzag", "naive"))
    assert max(checked.values()) < 1e-6, checked
    rows = [r for r in tagged_json(out, "RESULT") if r["run"] in runs]
    _check_exact(rows, runs)
    assert all("ulysses attention" in r["summary"] for r in rows)
    return rows


U2_RUNS = ["u2", "u2+naive", "u2+drop", "u2+ckpt", "u2+naive+drop+ckpt", "u2+tiled+drop",
           "u2+accum"]
U2_KV_RUNS = ["u2+kv0", "u2+kv1", "u2+kv2+naive+drop+ckpt", "u2+kv1+redo+drop", "u2+h6",
              "u2+h6+kv3", "u2+h6+kv3+naive+drop+ckpt"]


@pytest.fixture(scope="module")
def u2_out(mpi):
    """One 2-rank ulysses_check.py job for the two tests below (each checks its own runs'
    rows): every job also runs the RING and GRADCHECK checks, so two jobs ran them twice.

        mpiexec -n 2 python tests/scripts/ulysses_check.py --runs u2,u2+naive,...,u2+kv0,...
    """
    return mpi(2, "tests/scripts/ulysses_check.py", "--runs", ",".join(U2_RUNS + U2_KV_RUNS),
               timeout=300)


@pytest.mark.mpi
def test_ulysses_cp2_is_exact_and_sends_the_formula(u2_out):
    """--cp 2 --cp-attention ulysses, float64, 3 steps against one process: zig-zag and
    naive, dropout 0.1, --ckpt-activations (the all-to-alls redone inside backward), tiled
    local attention, grad-accum; cp bytes = 8S(N-1)/N per layer (12S(N-1)/N with recompute);
    HeadsForTokens' and TokensForHeads' gradients = central differences across the 2 ranks:

        mpiexec -n 2 python tests/scripts/ulysses_check.py --runs u2,u2+naive,u2+drop,...
    """
    rows = _check_ulysses_rows(u2_out, U2_RUNS)
    by = {r["run"]: r for r in rows}
    assert by["u2+ckpt"]["losses"] == by["u2"]["losses"]              # recompute: bitwise
    assert by["u2+ckpt"]["bytes_sent"] == 1.5 * by["u2"]["bytes_sent"]
    assert by["u2+drop"]["losses"] != by["u2"]["losses"]              # dropout acted


@pytest.mark.mpi
def test_ulysses_sends_k_and_v_as_the_kv_heads_it_needs(u2_out):
    """Grouped-query attention (Llama's block, 4 q heads): k and v cross the all-to-all as
    kv_heads_sent heads (each rank the window of kv heads its q heads read, kv_windows) and
    are picked for each rank's q heads after it, so --n-kv-head 1 (2 heads at cp 2) sends
    less than --n-kv-head 0 by exactly 4 (S - S 2/4) (N-1)/N per layer (the qkv exchange,
    forward and backward), S = B Tl C 8 bytes; with 6 q heads (24 wide) and 3 kv heads,
    coprime with cp 2, 4 heads where lcm(3, 2) = 6 sent as many as multi-head attention
    (49,152 bytes a step, measured before this change; now 40,960). Each run one process's
    numbers (float64, 3 steps; kv 2 also naive, dropout and recompute; kv 1 with dropout
    and --attention recompute as the local attention; kv 3 also naive, dropout, recompute):

        mpiexec -n 2 python tests/scripts/ulysses_check.py --runs u2+kv0,u2+kv1,...
    """
    by = {r["run"]: r for r in _check_ulysses_rows(u2_out, U2_KV_RUNS)}
    n, layers, S = 2, 2, 4 * 8 * 16 * 8                    # B 4, Tl 16/2, C 16, float64
    assert by["u2+kv0"]["bytes_sent"] == layers * ulysses_bytes(S, n)
    assert by["u2+kv0"]["bytes_sent"] - by["u2+kv1"]["bytes_sent"] == \
        layers * 4 * (S - S * 2 // 4) * (n - 1) // n
    S = 4 * 8 * 24 * 8                                     # C 24
    assert by["u2+h6"]["bytes_sent"] == layers * ulysses_bytes(S, n) == 49152
    assert by["u2+h6+kv3"]["bytes_sent"] == layers * ulysses_bytes(S, n, kv=S * 4 // 6)


@pytest.mark.mpi
def test_ulysses_cp4_and_compositions_are_exact(mpi):
    """On 4 ranks: cp 4 (naive with dropout; tiled with recompute), cp 2 x dp 2 (DDP, ZeRO-1,
    ZeRO-2 with dropout, ZeRO-3 with grad-accum and recompute), cp 2 x tp 2 (naive with
    dropout; --sequence-parallel, also naive with dropout, and with dropout and recompute;
    ZeRO-3, its sharded checkpoint loaded back into the same layout, ZeRO-1 and tp 2 x dp 2
    without cp, and the next step's loss the same bit for bit); Llama's block with 1 kv head
    at cp 4 (lcm(1, 4) = 4 heads sent: the bytes of 0) and with 2 under tp 2 x SP (one a tp
    rank) with dropout; 12 q heads (48 wide) with 3 kv heads at cp 4, coprime: 2 kv heads
    a rank (kv_windows), where lcm(3, 4) = 12 sent multi-head attention's bytes:

        mpiexec -n 4 python tests/scripts/ulysses_check.py --runs u4,u4+naive+drop,... \
            --resume-runs u2xtp2+zero3
    """
    runs = ["u4", "u4+naive+drop", "u4+tiled+ckpt", "u2xdp2", "u2xdp2+zero1",
            "u2xdp2+zero2+drop", "u2xdp2+zero3+accum+ckpt", "u2xtp2+naive+drop", "u2xtp2+sp",
            "u2xtp2+sp+naive+drop", "u2xtp2+sp+drop+ckpt", "u4+kv1", "u2xtp2+sp+kv2+drop",
            "u4+h12+kv3+drop", "u2xtp2+zero3"]
    out = mpi(4, "tests/scripts/ulysses_check.py", "--runs", ",".join(runs), "--resume-runs",
              "u2xtp2+zero3", timeout=240)
    rows = _check_ulysses_rows(out, runs)
    by = {r["run"]: r for r in rows}
    assert by["u4+kv1"]["bytes_sent"] == by["u4"]["bytes_sent"]     # 4 heads sent either way
    S = 4 * 4 * 48 * 8                                     # B 4, Tl 16/4, C 48, float64
    assert by["u4+h12+kv3+drop"]["bytes_sent"] == 2 * ulysses_bytes(S, 4, kv=S * 8 // 12)
    reload = rows[-1]["reload"]
    assert reload["param_diff"] < 1e-10 and reload["adam_diff"] < 1e-10
    assert [reload["same"], reload["zero1"], reload["tp2xdp2+zero3"]] == ["bitwise"] * 3


@pytest.mark.mpi
def test_train_gpt_ulysses_matches_one_process_and_resumes_with_the_ring(corpus, tmp_path,
                                                                        mpi):
    """train_gpt.py --cp 2 --cp-attention ulysses logs one process's losses, val loss and
    sample (float64) and says which attention ran; stopped at step 2, its checkpoint (nothing
    of the attention in it) resumes under the ring, and on one process, to the same losses:

        python examples/train_gpt.py --data CORPUS --dtype float64 ... --log-json one.jsonl
        mpiexec -n 2 python examples/train_gpt.py --cp 2 --cp-attention ulysses ... \
            --stop-at 2 --save ck
        mpiexec -n 2 python examples/train_gpt.py --cp 2 ... --resume ck
    """
    import subprocess
    import sys
    from mpirun import device_flags, mpi_env
    common = [*TINY, "--data", corpus, "--cache-dir", tmp_path / "cache"]
    one, cp = tmp_path / "one.jsonl", tmp_path / "cp.jsonl"

    def single(*flags):
        return subprocess.run([sys.executable, "examples/train_gpt.py", *map(str, common),
                               *map(str, flags), *device_flags(mpi.device)], cwd=ROOT,
                              env=mpi_env(), text=True, capture_output=True,
                              check=True, timeout=600).stdout
    ref = single("--log-json", one)
    ulysses = ["--cp", "2", "--cp-attention", "ulysses"]
    out = mpi(2, "examples/train_gpt.py", *common, *ulysses, "--log-json", cp,
              timeout=120).stdout
    assert "context parallel over 2 ranks (zigzag, ulysses attention)" in out
    assert "Ulysses attention: an all-to-all per layer to 1 of the 2 heads over" in out
    assert np.allclose(_losses(cp), _losses(one), rtol=0, atol=1e-10)
    assert _sample(out) == _sample(ref)
    mpi(2, "examples/train_gpt.py", *common, *ulysses, "--save", tmp_path / "ck", "--stop-at",
        "2", timeout=120)
    ring, alone = tmp_path / "ring.jsonl", tmp_path / "alone.jsonl"
    mpi(2, "examples/train_gpt.py", *common, "--cp", "2", "--resume", tmp_path / "ck",
        "--log-json", ring, timeout=120)
    single("--resume", tmp_path / "ck", "--log-json", alone)
    for back in (ring, alone):
        assert len(_losses(back)) == 2                          # step 2 and the val loss
        assert np.allclose(_losses(back), _losses(one)[2:], rtol=0, atol=1e-10)


@pytest.mark.mpi
@pytest.mark.parametrize("model,layout_flags", [
    (["--dropout", "0.1"], ["--cp", "2", "--pp", "2", "--schedule", "gpipe",
                            "--ckpt-activations"]),
    (["--dropout", "0.1"], ["--cp", "2", "--pp", "2", "--schedule", "zb-h1"]),
    (["--moe-experts", "4"], ["--cp", "2", "--ep", "2"])], ids=["pp-gpipe-ckpt", "pp-zbh1",
                                                              "moe-ep"])
def test_train_gpt_ulysses_in_pipeline_stages_and_with_experts(corpus, tmp_path, mpi, model,
                                                                layout_flags):
    """Ulysses needs nothing of its own inside pipeline stages (each micro-batch runs in the
    context's part, the all-to-alls in its blocks) or with MoE layers (they route over the
    whole sequence by the context's positions, as under the ring): 4 ranks, float64, one
    process's losses (the same `model` flags: dropout 0.1, or 4 experts):

        mpiexec -n 4 python examples/train_gpt.py --cp 2 --pp 2 --cp-attention ulysses ...
    """
    import subprocess
    import sys
    from mpirun import device_flags, mpi_env
    common = [*TINY, "--sample", "0", "--data", corpus, "--cache-dir", tmp_path / "cache",
              *model]
    one, mine = tmp_path / "one.jsonl", tmp_path / "mine.jsonl"
    subprocess.run([sys.executable, "examples/train_gpt.py", *map(str, common),
                    "--log-json", str(one), *device_flags(mpi.device)], cwd=ROOT,
                   env=mpi_env(), text=True, capture_output=True, check=True, timeout=600)
    out = mpi(4, "examples/train_gpt.py", *common, *layout_flags, "--cp-attention", "ulysses",
              "--log-json", mine, timeout=120).stdout
    assert "ulysses attention" in out
    assert np.allclose(_losses(mine), _losses(one), rtol=0, atol=1e-10)


@pytest.mark.mpi
def test_ulysses_heads_not_dividing_is_one_error_line(mpi):
    """mpiexec -n 2 python examples/train_gpt.py --cp 2 --cp-attention ulysses --n-head 3
    --n-embd 48"""
    out = mpi(2, "examples/train_gpt.py", "--cp", "2", "--cp-attention", "ulysses",
              "--n-head", "3", "--n-embd", "48", timeout=60, check=False)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.startswith("error: context parallelism: ")
    assert out.stderr.count("heads do not divide by --cp 2") == 1


def test_cp_attention_flag_offers_what_the_context_runs():
    """--cp-attention's choices (minidist/train/args.py keeps them literal: it is imported
    before numpy is) are RingContext's ATTENTIONS, which the planner's search also tries."""
    from minidist.cp.context import ATTENTIONS
    from minidist.train.search import CP_ATTENTIONS
    assert ATTENTIONS == CP_ATTENTIONS
    assert "--cp-attention {" + ",".join(ATTENTIONS) + "}" in train_parser().format_help()
