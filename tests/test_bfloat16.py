"""bfloat16 end to end on the generic (xp) path, tested on the CPU through numpy + ml_dtypes
(the same dtype CuPy uses): every fused op forward and backward against float32, row sums
that add up in float32, --amp's bfloat16 policy (no loss scaling, 2+2+12 bytes per
parameter), a few training steps ending near float32, checkpoints ("BF16" safetensors), and
collectives (uint16 views on the wire, sums right) on 3 ranks, and bf16 --amp training on
4 ranks through TP, ZeRO-3 and the pipeline (MINIDIST_AMP_DTYPE=bfloat16 asks for it on numpy).

    python -m pytest -q tests/test_bfloat16.py              (CPU)
    python -m pytest -q tests/test_bfloat16.py --device cuda (the same on CuPy)
"""
import json
import tracemalloc

import numpy as np
import pytest

from minidist import backend
from minidist.autograd import Tensor, fused as F
from minidist.autograd.indexing import embedding
from minidist.nn import GPT, GPTConfig
from minidist.nn.safetensors import SafetensorsFile, load_file, read_header, save_file
from minidist.optim import AdamW
from minidist.train.amp import MixedPrecision
from minidist.train.args import train_parser
from minidist.train.loop import train
from minidist.strategy.memory import ledger
from mpirun import mpi_env, run_mpi

pytestmark = pytest.mark.bfloat16      # on a GPU whose CuPy has no bfloat16: skipped (conftest)
ml_dtypes = pytest.importorskip("ml_dtypes", reason="bfloat16 on numpy needs ml_dtypes")
BF16 = np.dtype(ml_dtypes.bfloat16)
CFG = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=48, dropout=0.0)

OPS = {   # name -> (fn, input shapes)
    "linear": (F.linear, [(3, 5, 8), (8, 6), (6,)]),
    "layer_norm": (F.layer_norm, [(3, 5, 37), (37,), (37,)]),
    "gelu": (F.gelu, [(3, 7, 33)]),
    "softmax": (F.softmax, [(4, 9)]),
    "log_softmax": (F.log_softmax, [(4, 9)]),
    "cross_entropy": (lambda z: F.cross_entropy(z, np.array([[3, -1, 0], [7, 1, 2]])),
                      [(2, 3, 11)]),
    "attention": (F.causal_attention, [(2, 3, 7, 5)] * 3),
    "self_attention": (lambda x: F.causal_self_attention(x, 3), [(2, 9, 27)]),
}


def _grads(xp, fn, shapes, dtype):
    r = np.random.default_rng(1)
    inputs = [Tensor(xp.asarray(r.standard_normal(s).astype(np.float32).astype(dtype)),
                     requires_grad=True) for s in shapes]
    out = fn(*inputs)
    w = xp.asarray(np.random.default_rng(5).standard_normal(out.shape).astype(out.dtype))
    (out * Tensor(w)).sum().backward()
    return out, inputs


@pytest.mark.parametrize("name", OPS)
def test_every_op_runs_in_bfloat16_and_matches_float32(name, device):
    """Outputs and gradients stay bfloat16 (the loss float32) and agree with float32 to
    bfloat16's precision (8 bits: ~0.4% per rounding, a few roundings deep)."""
    xp = backend.get_xp()
    fn, shapes = OPS[name]
    out16, in16 = _grads(xp, fn, shapes, BF16)
    out32, in32 = _grads(xp, fn, shapes, np.float32)
    assert out16.dtype == (np.float32 if name == "cross_entropy" else BF16), out16.dtype
    for i, (a, b) in enumerate(zip([out16.data] + [t.grad for t in in16],
                                   [out32.data] + [t.grad for t in in32])):
        assert a.dtype in (BF16, np.float32), f"{name} #{i}: {a.dtype}"
        a, b = backend.to_host(a).astype(np.float64), backend.to_host(b).astype(np.float64)
        np.testing.assert_allclose(a, b, rtol=5e-2, atol=5e-2 * max(np.abs(b).max(), 1e-3),
                                   err_msg=f"{name}: output/grad #{i}")


def test_row_sums_add_up_in_float32(device):
    """numpy's own bfloat16 sum keeps a bfloat16 total (1000 ones -> 256); the bias and
    embedding gradients add their rows in float32 and round once: exactly 1000."""
    xp = backend.get_xp()
    x = Tensor(xp.ones((1000, 4), BF16))
    w, b = Tensor(xp.ones((4, 3), BF16), requires_grad=True), Tensor(
        xp.zeros(3, BF16), requires_grad=True)
    F.linear(x, w, b).sum().backward()
    assert b.grad.dtype == BF16 and (backend.to_host(b.grad) == 1000).all()
    table = Tensor(xp.zeros((5, 2), BF16), requires_grad=True)
    embedding(table, np.zeros(1000, np.int64)).sum().backward()
    g = backend.to_host(table.grad)
    assert g.dtype == BF16 and (g[0] == 1000).all() and not g[1:].any()


def test_an_advanced_index_gradient_adds_bfloat16_in_float32(device):
    """GetItem's backward adds repeated picks through indexing._add_at, which takes bfloat16
    in float32 and rounds once: numpy's add.at would make 1000 ones 256, and CuPy 14's
    cupyx.scatter_add raises TypeError on bfloat16 (the scatter-add of MoE's combine and of
    TP's embedding on cupy goes the same way)."""
    xp = backend.get_xp()
    table = Tensor(xp.zeros((5, 2), BF16), requires_grad=True)
    table[np.zeros(1000, np.int64)].sum().backward()
    g = backend.to_host(table.grad)
    assert g.dtype == BF16 and (g[0] == 1000).all() and not g[1:].any()


@pytest.mark.parametrize("dtype", [BF16, np.dtype(np.float16)], ids=["bfloat16", "float16"])
def test_scatter_add_rows_adds_16_bit_rows_in_float32(dtype, xp):
    """scatter_add_rows (TP's vocabulary-split embedding backward, MoE's combine, MoE's
    IndexAddRows) summed each run of equal ids with numpy's add.reduceat in the rows' dtype:
    1000 ones made 256 in bfloat16 (float16 came out right). Now 16-bit runs add in float32,
    rounded once."""
    from minidist.autograd.indexing import scatter_add_rows
    out = xp.zeros((3, 2), dtype)
    got = scatter_add_rows(out, xp.asarray([1] * 1000 + [2]), xp.ones((1001, 2), dtype))
    assert got.dtype == dtype and backend.to_host(got)[:, 0].tolist() == [0, 1000, 1]


def test_tiled_attention_adds_g_dot_y_in_float32(xp):
    """The tiled (flash) backward's D = rowsum(g * y) summed 64 bfloat16 products in
    bfloat16 (numpy keeps a bfloat16 total): dq and dk were 0.92% off float64 here. Now it
    adds in float32 and rounds once: 0.58% (ring attention's backward the same way)."""
    from minidist.autograd.flash import tiled_attention
    r = np.random.default_rng(0)
    q, k, v, g = (r.standard_normal((2, 2, 256, 64)) for _ in range(4))

    def grads(dtype):
        ts = [Tensor(xp.asarray(a.astype(dtype)), requires_grad=True) for a in (q, k, v)]
        tiled_attention(*ts).backward(xp.asarray(g.astype(dtype)))
        return [backend.to_host(t.grad).astype(np.float64) for t in ts]

    err = [np.linalg.norm(a - b) / np.linalg.norm(b)
           for a, b in zip(grads(BF16), grads(np.float64))]
    assert max(err[:2]) < 0.007 and err[2] < 0.006, err


def test_amp_bfloat16_policy_has_no_loss_scaling_and_16_bytes_per_param(device):
    amp = MixedPrecision(dtype="bfloat16")
    model = amp.cast_model(GPT(CFG, seed=0))
    assert amp.dtype == BF16 and all(p.dtype == BF16 for p in model.parameters())
    assert amp.scaler.scale == 1.0 and amp.scaler.growth_interval is None
    assert "bfloat16 compute" in amp.describe() and "fixed loss scale 1" in amp.describe()
    opt = amp.optimizer(model.named_parameters(), lambda named: AdamW(named, lr=1e-2))
    x = np.random.default_rng(0).integers(0, CFG.vocab_size, (2, CFG.block_size))
    amp.backward(model(x, x)[1])
    assert np.isfinite(opt.clip_grad_norm(1.0)) and opt.step()
    for p, m in zip(model.parameters(), opt.master):
        assert m.dtype == np.float32
        host, master = backend.to_host(p.data), backend.to_host(m.data)
        np.testing.assert_array_equal(host.view(np.uint16), master.astype(BF16).view(np.uint16))
    n = model.num_parameters()
    row = ledger(model.parameters(), opt)
    assert (row["params"], row["grads"], row["optimizer"]) == (2 * n, 2 * n, 12 * n)


def test_amp_refuses_an_unknown_16_bit_dtype():
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        MixedPrecision(dtype="float8").cast_model(GPT(CFG, seed=0))


def _train(corpus, amp_dtype, steps=25):
    """Losses of `steps` AdamW steps on the corpus bytes, same batches for every run."""
    data = np.frombuffer(open(corpus, "rb").read(), np.uint8).astype(np.int64) % 48
    r = np.random.default_rng(0)
    model = GPT(CFG, seed=0)
    amp = MixedPrecision(dtype=amp_dtype) if amp_dtype else None
    make = lambda named: AdamW(named, lr=1e-2)                        # noqa: E731
    if amp:
        amp.cast_model(model)
        opt = amp.optimizer(model.named_parameters(), make)
    else:
        opt = make(model.named_parameters())
    losses = []
    for _ in range(steps):
        i = r.integers(0, len(data) - CFG.block_size - 1, 8)[:, None] + np.arange(CFG.block_size)
        _, loss = model(data[i], data[i + 1])
        amp.backward(loss) if amp else loss.backward()
        opt.clip_grad_norm(1.0)
        opt.step()
        opt.zero_grad()
        losses.append(float(backend.to_host(loss.data)))
    return losses


def test_bfloat16_amp_trains_near_float32(corpus, device):
    """25 steps of bfloat16 --amp on numpy: it learns, and its last losses are within 3% of
    float32's (bfloat16 keeps 8 bits; the float32 master weights keep the updates)."""
    l32, l16 = _train(corpus, None), _train(corpus, "bfloat16")
    assert np.mean(l32[-5:]) < 0.7 * l32[0]
    assert abs(np.mean(l16[-5:]) / np.mean(l32[-5:]) - 1) < 0.03, (l16[-5:], l32[-5:])


def test_a_python_float_keeps_a_bfloat16_tensor_bfloat16():
    """numpy keeps float16 against a Python float (NEP 50), but promotes ml_dtypes' bfloat16
    to float32: `x * 0.01` left bfloat16 silently, and a checkpointed MoE block (its output
    and its router loss, `aux_loss * coef`, joined into one array) crashed on "mixed dtypes
    bfloat16 and float32". Now the float becomes a bfloat16 scalar (ops._weak), both sides,
    forward and backward; float16 as before."""
    x = Tensor(np.linspace(-1, 1, 6).astype(BF16), requires_grad=True)
    outs = [x * 0.01, 0.5 * x, x + 0.25, 1.0 - x, x / 3.0, 2.0 / (x + 2.0)]
    assert [o.dtype for o in outs] == [BF16] * len(outs)
    sum(o.sum() for o in outs).backward()
    assert x.grad.dtype == BF16
    h = Tensor(np.ones(3, np.float16))
    assert (h * 0.01).dtype == np.float16 and (x.astype("float32") * 0.01).dtype == np.float32


def test_where_and_masked_fill_keep_bfloat16_where_cupy_gives_float32(xp):
    """CuPy's where has no bfloat16 loop: its '?ff->f' loop returns float32
    (cupy/_sorting/search.py, v14), so MoE's expert dropout (ops.where) under bfloat16 --amp
    met the bfloat16 gate as float32 and raised "mixed float dtypes". Where and MaskedFill
    now pick through indexing.select, which casts where's result to the dtype asked for:
    shown on numpy with inputs numpy's where promotes to float32 (bfloat16 with float32);
    then Where and MaskedFill keep bfloat16, forward and backward, on --device (on a GPU
    with CuPy's own where)."""
    from minidist.autograd import ops
    from minidist.autograd.indexing import select
    cond = np.array([True, False, True])
    a, b = np.array([1, 2, 3], BF16), np.array([7, 8, 9], np.float32)
    assert np.where(cond, a, b).dtype == np.float32                # promoted, as on CuPy
    got = select(cond, a, b, BF16)
    assert got.dtype == BF16 and got.astype(np.float32).tolist() == [1, 8, 3]
    # Where hands select its inputs' float dtype: numpy's where makes (float16, int16)
    # float32 too, and the Function's result stays float16 only through that dtype
    half, ints = Tensor(np.array([1, 2, 3], np.float16)), np.array([7, 8, 9], np.int16)
    assert np.where(cond, half.data, ints).dtype == np.float32
    assert ops.where(cond, half, ints).dtype == np.float16
    x = Tensor(xp.asarray(np.linspace(-1, 1, 6).astype(BF16)), requires_grad=True)
    keep = xp.asarray(np.array([True, False] * 3))
    dropped, filled = ops.where(keep, x * 2.0, 0.0), ops.masked_fill(x, keep, 0.5)
    assert (dropped.dtype, filled.dtype) == (BF16, BF16)
    ((dropped * x).sum() + filled.sum()).backward()        # the gate's multiply: no raise
    assert x.grad.dtype == BF16
    h = backend.to_host(x.data).astype(np.float32)
    assert backend.to_host(dropped.data).astype(np.float32).tolist() == [-2, 0, 2 * h[2], 0,
                                                                       2 * h[4], 0]
    assert backend.to_host(filled.data).astype(np.float32).tolist() == [0.5, h[1], 0.5, h[3],
                                                                      0.5, h[5]]


def test_a_checkpointed_moe_block_runs_under_bfloat16_amp(xp):
    """Found by the composition sweep with --amp-dtype bfloat16 (one process was enough):
    python examples/train_gpt.py --moe-experts 4 --ckpt-activations --amp --amp-dtype bfloat16
    crashed in the first forward. Now its loss and gradients are finite and bfloat16."""
    config = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=48,
                       dropout=0.0, moe_experts=4, moe_top_k=2)
    model = MixedPrecision(dtype="bfloat16").cast_model(GPT(config, seed=0))
    model.set_checkpointing(True)
    r = np.random.default_rng(0)
    x, y = (xp.asarray(r.integers(0, 48, (4, 16))) for _ in range(2))
    _, loss = model(x, y)
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert np.isfinite(float(backend.to_host(loss.data))) and len(grads) > 10
    assert {g.dtype for g in grads} == {BF16}


def test_safetensors_writes_bf16_and_reads_it_back_exactly(tmp_path):
    a = np.random.default_rng(0).standard_normal((3, 5)).astype(BF16)
    save_file({"w": a, "b": np.ones(2, np.float32)}, tmp_path / "m.safetensors")
    header, _, _ = read_header(tmp_path / "m.safetensors")
    assert header["w"]["dtype"] == "BF16" and header["b"]["dtype"] == "F32"
    back = load_file(tmp_path / "m.safetensors")[0]["w"]
    assert back.dtype == np.float32 and (back.astype(BF16).view(np.uint16) ==
                                         a.view(np.uint16)).all()
    assert json.loads(json.dumps(header))["w"]["shape"] == [3, 5]


def test_a_safetensors_file_widens_a_bfloat16_tensor_only_when_asked(tmp_path):
    """SafetensorsFile (what a checkpoint's readers open: --init-from reads a parameter at a
    time) makes no array on opening, and tensor(name) widens that one alone, to load_file's
    numbers, tensor(name, lo, hi) those rows alone (a ZeRO shard's piece of one parameter):
    a bfloat16 --amp checkpoint's 16-bit parameters, beside the float32 masters read
    instead, were all widened on opening (a whole model's float32 bytes held)."""
    rng = np.random.default_rng(0)
    tensors = {n: rng.standard_normal((256, 64)).astype(BF16) for n in ("a", "b", "c")}
    save_file(tensors, tmp_path / "m.safetensors")
    tracemalloc.start()
    f = SafetensorsFile(tmp_path / "m.safetensors")
    opened = tracemalloc.get_traced_memory()[0]
    rows = f.tensor("c", 10, 20)
    ten = tracemalloc.get_traced_memory()[0] - opened
    b = f.tensor("b")
    one = tracemalloc.get_traced_memory()[0] - opened - ten
    tracemalloc.stop()
    assert f.names == ["a", "b", "c"] and opened < 256 * 64 and one < 1.5 * 256 * 64 * 4
    assert ten < 1.5 * 10 * 64 * 4
    whole = load_file(tmp_path / "m.safetensors")[0]
    assert b.dtype == np.float32 and np.array_equal(b, whole["b"])
    assert rows.shape == (10, 64) and np.array_equal(rows, whole["c"][10:20])


def test_bfloat16_checkpoint_resume_is_bit_identical(corpus, tmp_path, monkeypatch, device):
    """--amp in bfloat16 (MINIDIST_AMP_DTYPE): model.safetensors holds "BF16"; stopping at
    step 3 and resuming gives the same losses as training straight through."""
    monkeypatch.setenv("MINIDIST_AMP_DTYPE", "bfloat16")
    common = TINY[:-3] + ["--steps", "6", "--amp", "--device", device, "--data", corpus,
                          "--cache-dir", str(tmp_path / "cache")]

    def losses(*flags):
        log = tmp_path / f"log{len(list(tmp_path.glob('log*')))}.jsonl"
        train(train_parser().parse_args(common + ["--log-json", str(log), *flags]))
        return [r["loss"] for r in map(json.loads, open(log)) if "loss" in r]

    straight = losses()
    losses("--save", str(tmp_path / "ck"), "--stop-at", "3")
    header, _, _ = read_header(tmp_path / "ck" / "step-00000003" / "model.safetensors")
    assert {v["dtype"] for v in header.values()} == {"BF16"}
    assert losses("--resume", str(tmp_path / "ck")) == straight[3:]


@pytest.mark.mpi
def test_bfloat16_collectives_on_3_ranks(device):
    """mpiexec -n 3 python tests/scripts/comm_bf16_check.py ring,naive,mpi"""
    out = run_mpi(3, "tests/scripts/comm_bf16_check.py", "ring,naive,mpi", timeout=180,
                  env=mpi_env(MINIDIST_DEVICE=device))
    assert out.stdout.count("comm_bf16_check OK") == 3


TINY = ["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size", "32",
        "--batch-size", "8", "--eval-iters", "2", "--sample", "0", "--eval-every", "0",
        "--steps", "8", "--amp"]


@pytest.mark.mpi
@pytest.mark.parametrize("flags", [
    ["--tp", "2"],                          # the first GPU run crashed here, in mpi4py
    pytest.param(["--zero", "3"], marks=pytest.mark.slow),
    pytest.param(["--dp", "2", "--pp", "2"], marks=pytest.mark.slow)])
def test_bfloat16_amp_through_the_strategies_on_4_ranks(flags, device, corpus, tmp_path):
    """mpiexec -n 4 python examples/train_gpt.py --amp --amp-dtype bfloat16 --tp 2 ...
    bfloat16 activations, gradients and collectives through TP, ZeRO-3 and the pipeline:
    every loss finite, the last below the first."""
    log = tmp_path / "log.jsonl"
    out = run_mpi(4, "examples/train_gpt.py", *TINY, "--amp-dtype", "bfloat16", *flags,
                  "--device", device, "--data", corpus, "--cache-dir", tmp_path,
                  "--log-json", log, timeout=300)
    assert "mixed precision: bfloat16 compute" in out.stdout
    losses = [r["loss"] for r in map(json.loads, open(log)) if "loss" in r]
    assert len(losses) == 8 and np.isfinite(losses).all() and losses[-1] < losses[0]
