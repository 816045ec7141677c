"""Dropout masks keyed by (step, site, the row's number in the global batch)
(minidist/autograd/dropout_keys.py): the same masks whoever draws them. In-process: the
counter-based generator (Philox4x32-10 against Random123's known answers, its numbers'
spread), the keys' rules, a batch cut into rows or micro-batches, blocks and tensor
parallelism's slices, recompute, and
--grad-accum in train_step; under mpiexec: every layout against one process
(tests/scripts/dropout_check.py).
"""
import json
import subprocess
import sys

import numpy as np
import pytest

from minidist.autograd.dropout_keys import DropoutKeys, DropoutSite
from minidist.autograd.philox import philox4x32, to_unit_float32
from minidist.nn import GPT, GPTConfig
from minidist.strategy.base import SingleProcess
from minidist.train.step import train_step
from minidist.train.args import train_parser
from mpirun import ROOT, tagged_json, within

CONFIG = GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=8, vocab_size=30, dropout=0.2)


def _batch(rows=4, seed=0):
    x = np.random.default_rng(seed).integers(0, CONFIG.vocab_size, (rows, CONFIG.block_size))
    return x, np.roll(x, -1, axis=1)


# Random123's tests/kat_vectors, the three "philox4x32 10" lines: counter, key, result
KNOWN_ANSWERS = [
    ((0, 0, 0, 0), (0, 0), (0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8)),
    ((0xffffffff,) * 4, (0xffffffff,) * 2, (0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd)),
    ((0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344), (0xa4093822, 0x299f31d0),
     (0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1)),
]


@pytest.mark.parametrize("counter,key,expected", KNOWN_ANSWERS)
def test_philox_gives_random123s_known_answers(counter, key, expected):
    assert tuple(int(w) for w in philox4x32(counter, key)) == expected
    many = philox4x32((np.array([counter[0]] * 3), counter[1], counter[2], counter[3]), key)
    assert all((w == e).all() for w, e in zip(many, expected))      # arrays: elementwise


def test_philox_numbers_are_uniform_and_unrelated_across_keys():
    """2**18 numbers of one counter run: mean, variance and 64-bin histogram of U[0, 1)
    (chi-square far below its 99.9% point, 112 for 63 degrees), no lag-1 correlation, none
    with the next key's numbers."""
    blocks = np.arange(1 << 16, dtype=np.uint64)
    u = np.stack([to_unit_float32(w) for w in philox4x32((blocks, 0, 3, 7), (1, 2))], -1)
    u = u.ravel().astype(np.float64)
    assert u.min() >= 0 and u.max() < 1
    assert abs(u.mean() - 0.5) < 0.003 and abs(u.var() - 1 / 12) < 0.002
    counts = np.histogram(u, bins=64, range=(0, 1))[0]
    expected = u.size / 64
    assert ((counts - expected) ** 2 / expected).sum() < 112
    assert abs(np.corrcoef(u[:-1], u[1:])[0, 1]) < 0.01
    v = np.stack([to_unit_float32(w) for w in philox4x32((blocks, 0, 3, 7), (1, 3))], -1)
    assert abs(np.corrcoef(u, v.ravel())[0, 1]) < 0.01


def test_whole_blocks_and_single_numbers_give_the_same_numbers():
    """DropoutKeys.numbers computes a run of whole Philox blocks 4 numbers a call, and any
    other columns a number a call: the same numbers either way, and each is its element's
    of the whole row."""
    keys = DropoutKeys(3)
    whole = keys.numbers("s", np.arange(2)[:, None], np.array([0, 40]), np.arange(40))
    odd = keys.numbers("s", np.arange(2)[:, None], np.array([0, 40]), np.arange(3, 27))
    np.testing.assert_array_equal(odd, whole[..., 3:27])
    flat = keys.numbers("s", np.arange(2)[:, None], np.array([0]), np.arange(80))
    np.testing.assert_array_equal(flat.reshape(2, 2, 40), whole)
    assert whole.dtype == np.float32 and whole.shape == (2, 2, 40)


def test_a_block_of_a_tensor_is_its_part_of_the_whole():
    """DropoutSite.block (a tile of the attention weights, as flash.py asks) = the same
    slice of DropoutSite.random's whole tensor, on a tensor-parallel slice too."""
    keys = DropoutKeys(4)
    for site in (DropoutSite(keys, "a"), DropoutSite(keys, "a", axis=1, parts=2, index=1)):
        whole = site.random((3, 2, 8, 8))                         # (B, nh, T, T)
        tile = site.block((3, 2, 8, 8), [np.arange(2), np.arange(4, 8), np.arange(2, 6)])
        np.testing.assert_array_equal(tile, whole[:, :, 4:8, 2:6])


def test_a_row_draws_by_its_key_alone():
    """Rows 2, 3 drawn alone are rows 2, 3 of the whole batch's numbers; another step or
    another site draws other numbers; the same key draws the same numbers again."""
    keys = DropoutKeys(5)
    site = DropoutSite(keys, "transformer.h.0.attn.resid_dropout")
    whole = site.random((4, 3, 5), dtype="float32")
    with keys.rows_of([2, 3]):
        np.testing.assert_array_equal(site.random((2, 3, 5), dtype="float32"), whole[2:])
    np.testing.assert_array_equal(site.random((4, 3, 5), dtype="float32"), whole)
    other = DropoutSite(keys, "transformer.h.1.attn.resid_dropout")
    assert not np.array_equal(other.random((4, 3, 5), dtype="float32"), whole)
    keys.next_step()
    assert not np.array_equal(site.random((4, 3, 5), dtype="float32"), whole)
    assert DropoutKeys(6).step == 0 and not np.array_equal(
        DropoutSite(DropoutKeys(6), site.name).random((4, 3, 5), dtype="float32"), whole)


def test_a_tensor_parallel_slice_is_its_part_of_the_whole_row():
    """Heads (axis 1) and sequence positions (axis 1 of (B, T, C)) cut into `parts`: each
    rank's numbers are its slice of the whole tensor's; inactive: no slice."""
    keys = DropoutKeys(1)
    whole = DropoutSite(keys, "a").random((2, 4, 6, 6), dtype="float32")    # (B, nh, T, T)
    for r in range(2):
        part = DropoutSite(keys, "a", axis=1, parts=2, index=r).random((2, 2, 6, 6),
                                                                       dtype="float32")
        np.testing.assert_array_equal(part, whole[:, 2 * r:2 * r + 2])
    whole = DropoutSite(keys, "b").random((3, 8, 5), dtype="float32")       # (B, T, C)
    for r in range(4):
        part = DropoutSite(keys, "b", axis=1, parts=4, index=r).random((3, 2, 5),
                                                                       dtype="float32")
        np.testing.assert_array_equal(part, whole[:, 2 * r:2 * r + 2])
    off = DropoutSite(keys, "b", axis=1, parts=4, index=1, active=lambda: False)
    np.testing.assert_array_equal(off.random((3, 8, 5), dtype="float32"), whole)


@pytest.mark.parametrize("split", ["zigzag", "naive"])
def test_a_sequence_parallel_slice_of_a_cp_part_is_its_part_of_the_whole_row(split):
    """cp x tp with sequence parallelism: tp rank t of cp rank c holds (B, Tl/tp, C), the
    t-th run of cp rank c's Tl positions; DropoutSite slices by tp, then maps the slice to
    global positions (the keys' positions_of): the whole row's numbers at those places."""
    from minidist.cp.ring import positions
    keys, T, cp, tp = DropoutKeys(9), 16, 2, 2
    whole = DropoutSite(keys, "b").random((3, T, 5), dtype="float32")       # (B, T, C)
    seen = []
    for c in range(cp):
        pos = positions(T, cp, c, split)                                    # (Tl,)
        n = len(pos) // tp
        for t in range(tp):
            site = DropoutSite(keys, "b", axis=1, parts=tp, index=t, active=lambda: True,
                               seq_axis=1)
            with keys.positions_of(pos, T):
                part = site.random((3, n, 5), dtype="float32")
            mine = pos[t * n:(t + 1) * n]
            assert np.array_equal(part, whole[:, mine]), (c, t)
            seen += list(mine)
    assert sorted(seen) == list(range(T))                  # every place once


def test_rows_that_do_not_match_the_batch_in_flight_are_an_error():
    keys = DropoutKeys(0)
    with keys.rows_of([0, 1, 2]), pytest.raises(ValueError, match="dropout h.0.x: 2 rows"):
        DropoutSite(keys, "h.0.x").random((2, 4))


def test_a_model_cut_into_rows_computes_the_whole_batchs_rows():
    """GPT with dropout on rows 0-1 and 2-3 (keyed as a data-parallel rank's rows are) gives
    rows 0-1 and 2-3 of the whole batch's logits: dropout acted, and identically."""
    model = GPT(CONFIG, seed=0, dtype="float64")
    x, _ = _batch()
    keys = model.dropout_keys
    with keys.rows_of(range(4)):
        whole = model(x)[0].data
    for half in (0, 1):
        with keys.rows_of([2 * half, 2 * half + 1]):
            np.testing.assert_array_equal(model(x[2 * half:2 * half + 2])[0].data,
                                          whole[2 * half:2 * half + 2])
    model.eval()
    assert not np.allclose(model(x)[0].data, whole)


def test_a_forward_outside_train_step_draws_new_masks_each_call():
    """As a generator would: the step advances per training forward, not in eval."""
    model = GPT(CONFIG, seed=0, dtype="float64")
    x, _ = _batch()
    a, b = model(x)[0].data, model(x)[0].data
    assert model.dropout_keys.step == 2 and not np.allclose(a, b)
    model.eval()
    model(x)
    assert model.dropout_keys.step == 2


def test_grad_accum_draws_one_process_masks():
    """train_step with --grad-accum 2 and 4 (micro-batches of the global batch) = one batch:
    the same losses, norms and parameters in float64 (dropout 0.2 every step)."""
    def run(accum):
        args = train_parser().parse_args(["--grad-accum", str(accum), "--lr", "1e-2"])
        strategy = SingleProcess()
        model = strategy.build_model(CONFIG, 3, "float64")
        opt = strategy.build_optimizer(model, args)
        out = [train_step(strategy, model, opt, *_batch(8, seed=s), args)[:2]
               for s in range(3)]
        return [float(v) for pair in out for v in pair], model
    (ref, m1), (two, m2), (four, m4) = run(1), run(2), run(4)
    assert len(two) == len(four) == len(ref) == 6
    assert all(abs(a - b) < 1e-10 for a, b in zip(ref + ref, two + four)), (ref, two, four)
    for (name, p), q, r in zip(m1.named_parameters(), m2.parameters(), m4.parameters()):
        assert np.abs(q.data - p.data).max() < 1e-10 and np.abs(r.data - p.data).max() < 1e-10
    assert m1.dropout_keys.step == 3


@pytest.mark.mpi
@pytest.mark.cpu_only("dropout_check.py's reference runs on numpy")
def test_every_layout_with_dropout_equals_one_process(mpi):
    """--dropout 0.1, float64, 3 steps on 4 ranks: DDP (also with grad-accum), ZeRO-3, ZeRO-2
    with grad-accum and recompute, pp 2 x dp 2 (1F1B, GPipe with recompute, ZB-H1 with
    ZeRO-1, interleaved, tiled attention; ZB-H1 and interleaved with selective recompute),
    tp 2 x dp 2 (also sequence parallel with grad-accum), tp 2 x pp 2 (sequence parallel,
    also with selective recompute; recompute with grad-accum), cp 4, cp 2 x dp 2
    (ZeRO-3, grad-accum, recompute), cp 2 x tp 2 (naive split; sequence parallel, naive and
    zig-zag with recompute), cp 2 x pp 2 (1F1B; GPipe with
    recompute): losses, norms and every parameter equal one process's (grad-accum 1, no
    recompute) to 1e-10, every parameter compared.

        mpiexec -n 4 python tests/scripts/dropout_check.py
    """
    out = mpi(4, "tests/scripts/dropout_check.py", timeout=300)
    rows = tagged_json(out)
    assert [r["run"] for r in rows] == [
        "dp4", "dp4+accum2", "dp4+zero3", "dp4+zero2+accum2+recompute", "pp2xdp2",
        "pp2xdp2+gpipe+recompute", "pp2xdp2+zbh1+zero1", "pp2xdp2+v2", "pp2xdp2+tiled",
        "pp2xdp2+zbh1+selective", "pp2xdp2+v2+selective", "tp2xdp2", "tp2xdp2+sp+accum2",
        "tp2xpp2+sp", "tp2xpp2+sp+selective", "tp2xpp2+recompute+accum2", "cp4",
        "cp2xdp2+zero3+accum2+recompute", "cp2xtp2+naive", "cp2xtp2+sp+naive",
        "cp2xtp2+sp+recompute", "cp2xpp2",
        "cp2xpp2+gpipe+recompute"]
    for r in rows:
        assert within(r, 1e-10), r
        assert r["compared"] == r["ref_params"], r


def test_bench_dropout_runs_and_counts_the_numbers():
    """examples/bench_dropout.py at a tiny size: three ways, each over every site's numbers
    (embedding + 3 per layer: 2 (B, T, C) and one (B, nh, T, T))."""
    out = subprocess.run([sys.executable, "examples/bench_dropout.py", "--batch", "2",
                          "--block-size", "8", "--n-embd", "8", "--n-head", "2", "--n-layer",
                          "2", "--repeats", "1"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, check=True)
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert [r["way"] for r in rows] == ["pcg64", "keyed", "keyed_causal"]
    assert all(r["numbers"] == 2 * 8 * 8 * (1 + 2 * 2) + 2 * 2 * 2 * 8 * 8 for r in rows)


def test_bench_dropout_causal_way_counts_only_the_numbers_it_draws():
    """keyed_causal computes the attention weights' numbers up to each band's last query
    only: at block 32, bands of 16 rows, 16 x 16 + 16 x 32 = 768 of each head's 1024; its
    ns per number divides by those (it divided by all of them, reading 1.4x fast)."""
    out = subprocess.run([sys.executable, "examples/bench_dropout.py", "--batch", "1",
                          "--block-size", "32", "--n-embd", "8", "--n-head", "2", "--n-layer",
                          "1", "--repeats", "1"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, check=True)
    rows = {r["way"]: r for r in map(json.loads, out.stdout.splitlines())}
    residual = 3 * 32 * 8                            # the embedding's and 2 per block
    assert all(r["numbers"] == residual + 2 * 1024 for r in rows.values())
    assert rows["keyed"]["numbers_drawn"] == residual + 2 * 1024
    assert rows["keyed_causal"]["numbers_drawn"] == residual + 2 * 768
    r = rows["keyed_causal"]
    assert r["ns_per_number"] == pytest.approx(r["ms"] * 1e6 / r["numbers_drawn"], rel=0.02,
                                               abs=0.01)


def test_bench_dropout_ratios_share_one_baseline_measurement():
    """examples/bench_dropout.py times pcg64 once: its own ratio is exactly 1 and every
    ratio is that row's time per number over pcg64's; 0 repeats is one `error:` line."""
    out = subprocess.run([sys.executable, "examples/bench_dropout.py", "--batch", "2",
                          "--block-size", "8", "--n-embd", "8", "--n-head", "2", "--n-layer",
                          "1", "--repeats", "2"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, check=True)
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    base = rows[0]
    assert base["way"] == "pcg64" and base["ratio_to_pcg64"] == 1.0
    for r in rows:
        ratio = r["ns_per_number"] / base["ns_per_number"]
        assert abs(r["ratio_to_pcg64"] - ratio) <= 0.005 + 1e-3 * ratio, (r, base)
    bad = subprocess.run([sys.executable, "examples/bench_dropout.py", "--repeats", "0"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr == ("error: --repeats 0: must be at least 1 (bench_dropout.py --help "
                          "lists the flags)\n"), bad.stderr      # one line, no usage block
