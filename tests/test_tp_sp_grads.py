"""Sequence parallelism's replicated gradients summed over tp once a step, in one all-reduce
(Megatron-LM's coalesced layer-norm all-reduce), counted by the trace's events; their
exactness against one process is tested where each composition is (tests/scripts/tp_check.py,
pp_check.py, fp32_grads_check.py, cp_check.py, ep_split.py).
"""
import numpy as np
import pytest

from minidist.nn import GPTConfig
from minidist.train.call_cost import sp_sum
from minidist.train.planner import Layout

from mpirun import tagged_json

RUNS = ["tp2xdp2+sp", "tp2xdp2+sp+accum2", "tp2xdp2+zero1+sp", "tp2xdp2+zero3+sp+accum2",
        "tp2xdp2+sp+amp", "tp2xdp2+sp+bf16+fp32grads", "tp2xdp2+sp+llama", "tp2xcp2+sp",
        "pp2xtp2+sp", "ep2xtp2+sp", "ep2xtp2+zero1+sp", "ep2xtp2+zero3+sp+accum2",
        "ep2xtp2+sp+amp"]


@pytest.mark.mpi
def test_sequence_parallel_sums_the_replicated_gradients_once_a_step(mpi):
    """The model alone (f in backward) makes one tp all-reduce per replicated parameter and
    micro-batch: GPT-2's 6 L + 3 = 15 at L = 2, Llama's 2 L + 1 = 5. Through the strategies
    (DDP, grad-accum 2, ZeRO-1, ZeRO-3 + grad-accum 2, float16 --amp, bfloat16 with float32
    gradients, Llama blocks, cp 2, a 2-stage pipeline) each rank makes exactly one per step
    besides the clip's and the cross-entropy's, in the gradients' dtype, of the same bytes
    (under ZeRO each dp rank its shards' pieces, together the same bytes). Under --ep (ep 2 x
    tp 2, 4 experts: DDP, ZeRO-1, ZeRO-3 + grad-accum 2, float16 --amp) this rank's 2 experts'
    16 tensors join that call after their sync over edp (ZeRO: the pieces of the experts'
    own shards): until 2026-11-29 they were all-reduced by f in backward, 16 calls a
    micro-batch (34048 B) besides the one sum of the dense ones (1792 B); now one call of
    35840 B, the same bytes. The step-time
model prices that call and its bytes (minidist/train/call_cost.py sp_sum; until 2026-11-29 the
dense replicated gradients were not priced at all):

        mpiexec -n 4 python tests/scripts/tp_sp_grads.py
    """
    out = mpi(4, "tests/scripts/tp_sp_grads.py", timeout=300)
    before = {r["arch"]: r for r in tagged_json(out, "BEFORE")}
    assert before["gpt2"]["calls"] == 6 * 2 + 3 and before["llama"]["calls"] == 2 * 2 + 1
    rows = {r["run"]: r["ranks"] for r in tagged_json(out, "RESULT")}
    assert sorted(rows) == sorted(RUNS)
    for name, ranks in rows.items():
        assert len(ranks) == 4
        for r in ranks:
            assert [s["sums"] for s in r["steps"]] == [1, 1], (name, r)
        if name.startswith("ep2"):     # 15 dense + 2 experts x 4 tensors x 2 blocks
            half = "+amp" in name
            assert all(r["params"] == 15 + 16 and r["experts"] == 16 for r in ranks), ranks
            assert all(r["whole_bytes"] == (35840 // (2 if half else 1)) ==
                       r["expert_bytes"] + 1792 // (2 if half else 1) for r in ranks), ranks
            continue
        if "pp2" in name:              # each stage its own parameters: 1 block (+ wpe, ln_f)
            assert sorted(r["params"] for r in ranks) == [7, 7, 8, 8], (name, ranks)
            continue
        arch = "llama" if "llama" in name else "gpt2"
        half = any(f in name for f in ("+amp", "bf16")) and "fp32grads" not in name
        want = before[arch]["bytes"] // (2 if half else 1)           # float32 in `before`
        assert all(r["whole_bytes"] == want for r in ranks), (name, want, ranks)
        assert all(r["params"] == before[arch]["calls"] for r in ranks), (name, ranks)
    cfg = GPTConfig(n_layer=2, n_head=4, n_embd=16, block_size=8, vocab_size=30)
    for name, layout, g in (("tp2xdp2+sp", Layout(tp=2, dp=2, sp=True, amp=False), 4),
                            ("tp2xdp2+sp+amp", Layout(tp=2, dp=2, sp=True), 2),
                            ("tp2xcp2+sp", Layout(tp=2, cp=2, sp=True, amp=False), 4)):
        assert all(sp_sum(cfg, layout, 0, g) == (r["steps"][0]["bytes"], 1)
                   for r in rows[name]), (name, rows[name])
    for r in rows["pp2xtp2+sp"]:                  # stage 0 holds 7 of them, stage 1 8
        pp = Layout(tp=2, pp=2, sp=True, amp=False)
        assert sp_sum(cfg, pp, r["params"] - 7, 4) == (r["steps"][0]["bytes"], 1), r
    moe = GPTConfig(n_layer=2, n_head=4, n_embd=16, block_size=8, vocab_size=30,
                    moe_experts=4)                 # --ep 2: this rank's 2 experts too
    for name, amp, g in (("ep2xtp2+sp", False, 4), ("ep2xtp2+sp+amp", True, 2)):
        layout = Layout(tp=2, dp=2, ep=2, sp=True, amp=amp)
        assert all(sp_sum(moe, layout, 0, g) == (r["steps"][0]["bytes"], 1)
                   for r in rows[name]), (name, rows[name])
    dtypes = {r["steps"][0]["dtype"] for r in rows["tp2xdp2+sp+bf16+fp32grads"]}
    assert dtypes == {"float32"} and {r["steps"][0]["dtype"] for r in
                                       rows["tp2xdp2+sp+amp"]} == {"float16"}


@pytest.mark.mpi
def test_an_overflow_in_one_ranks_partial_gradient_skips_the_step_everywhere(mpi):
    """float16 --amp, tp 2 x dp 2 + SP (--ddp naive), an inf put into a layer norm's partial
    gradient on one rank at step 1 of 3: only the coalesced sum over tp (then DDP's mean)
    carries it to the others, and every rank skips that step (loss scale 4096 -> 2048 on each,
    its norm NaN everywhere), the collectives matched; the replicated parameters stay
    bit-equal over tp; and numpy raises no RuntimeWarning (the clip's inf - inf on each rank,
    until 2026-11-29):

        mpiexec -n 4 python tests/scripts/tp_sp_grads.py --runs tp2xdp2+sp
    """
    out = mpi(4, "tests/scripts/tp_sp_grads.py", "--runs", "tp2xdp2+sp", timeout=300)
    ranks = tagged_json(out, "POISON")[0]
    assert len(ranks) == 4
    for r in ranks:
        assert r["skipped"] == 1 and r["scale"] == 2048.0, r
        assert np.isnan(r["norms"][1]) and np.isfinite([r["norms"][0], r["norms"][2]]).all(), r
        assert r["norms"][::2] == ranks[0]["norms"][::2], (r, ranks[0])    # the same bits
        assert r["tp_equal"] and r["warnings"] == [], r


@pytest.mark.mpi
@pytest.mark.cpu_only("tracemalloc sees host arrays only: the gradients live on the GPU there")
def test_the_sum_holds_a_piece_at_a_time_not_a_copy_of_every_gradient(mpi):
    """Without --ep every MoE expert is replicated over tp, so the replicated gradients are
    most of the model (8 experts, C 128, 4 layers: 16.9 MB a rank). The sum copies them in
    pieces of at most SUM_PIECE_BYTES (4 MiB): sync_grads holds at most about 1.5 pieces
    (the piece and the ring's scratch), 6.4 MB measured; until 2026-11-29 one flat copy of
    them all, 25.8 MB (1.5 x the gradients) above the step's gradients. The step-time model
counts those pieces' all-reduces and bytes (minidist/train/call_cost.py sp_sum: 5):

        mpiexec -n 4 python tests/scripts/tp_sp_grads.py --runs tp2xdp2+sp
    """
    from minidist.tp.state import SUM_PIECE_BYTES
    out = mpi(4, "tests/scripts/tp_sp_grads.py", "--runs", "tp2xdp2+sp", timeout=300)
    ranks = tagged_json(out, "MEMORY")[0]
    assert len(ranks) == 4
    for r in ranks:
        assert r["replicated"] > 4 * SUM_PIECE_BYTES, r
        assert r["extra"] < 2 * SUM_PIECE_BYTES, r
        assert r["calls"] >= -(-r["replicated"] // SUM_PIECE_BYTES), r
    moe = GPTConfig(n_layer=4, n_head=4, n_embd=128, block_size=8, vocab_size=30,
                    moe_experts=8)
    layout = Layout(tp=2, dp=2, sp=True, amp=False)
    assert all(sp_sum(moe, layout, 0, 4) == (r["replicated"], r["calls"]) == (ranks[0][
        "replicated"], 5) for r in ranks), ranks
