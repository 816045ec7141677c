"""Llama-style blocks (--arch llama: RMSNorm, rotary positions, SwiGLU, no biases; --n-kv-head:
grouped-query attention): the model against a NumPy Llama written from the papers' formulas,
RoPE's relative-position property, the uneven q|k|v split tensor parallelism cuts, the flags'
one-line errors, and every parallel layout training one process's numbers (float64, 1e-10,
through the composition sweep's harness: tests/scripts/layout_sweep.py), the planner's plan
of a Llama. The ops' gradients: tests/test_gradcheck.py; Hugging Face's Llama folder:
tests/test_llama_hf.py.
"""
import os
import subprocess
import sys

import numpy as np
import pytest

from minidist.autograd import llama_ops as LL
from minidist.autograd.tensor import Tensor
from minidist.nn.config import GPTConfig, gpt_param_specs
from minidist.nn.gpt import GPT
from minidist.strategy.split import Split
from mpirun import ROOT, mpi_env
from tests.llama_cases import _train, llama


# ---- the model against a NumPy Llama ---------------------------------------------------------

def numpy_llama(config, p, idx):
    """Llama's forward, written out: x = wte[idx]; per block x += attn(rms(x)), x +=
    mlp(rms(x)); logits = rms(x) wte^T. Attention: q, k turned by RoPE (rotate-half pairs
    (i, i + hs/2), angle t theta^(-2i/hs)), k and v head j // (nh / nkv) for q head j,
    causal softmax(q k^T / sqrt(hs)) v. MLP: (silu(x Wg) * (x Wu)) Wd."""
    B, T = idx.shape
    C, nh, nkv = config.n_embd, config.n_head, config.kv_heads
    hs, F = C // nh, config.ffn_size

    def rms(x, w):
        return x / np.sqrt((x ** 2).mean(-1, keepdims=True) + 1e-5) * w

    def rope(h):                                   # (B, T, heads, hs)
        i = np.arange(hs // 2)
        a = np.arange(T)[:, None] * config.rope_theta ** (-2 * i / hs)      # (T, hs/2)
        c, s = np.cos(a)[:, None], np.sin(a)[:, None]
        x1, x2 = h[..., :hs // 2], h[..., hs // 2:]
        return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], -1)

    x = p["transformer.wte.weight"][idx]
    for layer in range(config.n_layer):
        g = lambda n: p[f"transformer.h.{layer}.{n}"]                      # noqa: E731
        h = rms(x, g("ln_1.weight")) @ g("attn.c_attn.weight")
        q = rope(h[..., :nh * hs].reshape(B, T, nh, hs))
        k = rope(h[..., nh * hs:(nh + nkv) * hs].reshape(B, T, nkv, hs))
        v = h[..., (nh + nkv) * hs:].reshape(B, T, nkv, hs)
        out = np.empty((B, T, nh, hs))
        for j in range(nh):
            kj, vj = k[:, :, j // (nh // nkv)], v[:, :, j // (nh // nkv)]
            s = q[:, :, j] @ kj.transpose(0, 2, 1) / np.sqrt(hs)            # (B, T, T)
            s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
            w = np.exp(s - s.max(-1, keepdims=True))
            out[:, :, j] = (w / w.sum(-1, keepdims=True)) @ vj
        x = x + out.reshape(B, T, C) @ g("attn.c_proj.weight")
        u = rms(x, g("ln_2.weight")) @ g("mlp.c_fc.weight")
        gate, up = u[..., :F], u[..., F:]
        x = x + (gate / (1 + np.exp(-gate)) * up) @ g("mlp.c_proj.weight")
    return rms(x, p["transformer.ln_f.weight"]) @ p["transformer.wte.weight"].T


@pytest.mark.parametrize("kv", [4, 2, 1])
def test_the_model_is_llama_written_out_in_numpy(kv):
    """Multi-head, grouped-query and multi-query attention, float64, 1e-10."""
    config = llama(n_kv_head=kv, rope_theta=500.0)
    model = GPT(config, seed=3, dtype="float64")
    params = {n: p.data for n, p in model.named_parameters()}
    assert "transformer.wpe.weight" not in params and not any(".bias" in n for n in params)
    assert params["transformer.h.0.attn.c_attn.weight"].shape == (32, (4 + 2 * kv) * 8)
    idx = np.random.default_rng(0).integers(0, 40, (2, 16))
    logits, _ = model(idx)
    np.testing.assert_allclose(logits.data, numpy_llama(config, params, idx),
                               rtol=1e-10, atol=1e-10)


def test_rotary_scores_depend_on_the_distance_only():
    """q_t . k_s after RoPE is a function of t - s: shifting every position by 7 changes no
    attention score (learned positions have no such property)."""
    qkv = np.random.default_rng(1).standard_normal((1, 6, 3 * 16))
    pos = np.array([0, 1, 2, 5, 9, 11])

    def scores(p):
        out = LL.rotary(Tensor(qkv.copy()), 1, 1, p).data          # (turned in place)
        return out[0, :, :16] @ out[0, :, 16:32].T

    np.testing.assert_allclose(scores(pos), scores(pos + 7), atol=1e-12)
    assert not np.allclose(scores(pos), scores(pos * 2))


def test_swiglu_keeps_the_mlp_about_gpt2s_size():
    """Llama's rule: F = 8C/3 rounded up to a multiple of 64 (C 768: 2048), so the three
    matrices (C x 2F, F x C) hold about the 8 C^2 of GPT-2's two."""
    config = GPTConfig(n_embd=768, n_head=12, arch="llama", bias=False)
    specs = gpt_param_specs(config)
    assert config.ffn_size == 2048
    assert specs["transformer.h.0.mlp.c_fc.weight"][0] == (768, 4096)
    assert specs["transformer.h.0.mlp.c_proj.weight"][0] == (2048, 768)
    assert GPTConfig(n_embd=768, n_head=12, arch="llama", ffn_hidden=3000).ffn_size == 3000


def test_a_gpt2_config_records_no_arch_field():
    """A GPT-2's checkpoint record is unchanged by the new fields; a Llama's names them."""
    assert not {"arch", "n_kv_head", "rope_theta", "ffn_hidden"} & set(GPTConfig().to_dict())
    d = llama().to_dict()
    assert d["arch"] == "llama" and d["n_kv_head"] == 2 and GPTConfig(**d) == llama()


@pytest.mark.parametrize("kw, match", [
    (dict(n_kv_head=3), "multiple of n_kv_head"),
    (dict(rope_theta=float("nan")), "rope_theta must be a finite number > 0"),
    (dict(arch="gpt2", bias=True), "n_kv_head and rope_theta are Llama's block's"),
    (dict(n_embd=36, n_head=4, n_kv_head=4), "must be even"),
    (dict(arch="mamba"), "arch must be one of"),
])
def test_config_refuses_what_cannot_be_built(kw, match):
    with pytest.raises(ValueError, match=match):
        llama(**kw)


def test_tp_refuses_an_mlp_width_it_does_not_divide_typed_or_not():
    """Llama's default F (C 192: 512) over tp 3 was padded with zero columns while the same
    width typed was refused; now both are named, as the MLP's width."""
    from minidist.tp.model import check_tp_sizes
    for ffn in (0, 512):
        config = llama(n_head=6, n_kv_head=0, n_embd=192, ffn_hidden=ffn)
        assert check_tp_sizes(config, 3) == ["the MLP's width 512 (--ffn-hidden) is not "
                                             "divisible by tp 3"]
    assert check_tp_sizes(llama(n_head=6, n_kv_head=0, n_embd=192), 2) == []


def test_split_cuts_q_k_v_of_unequal_widths_per_rank():
    """c_attn's q|k|v of 4, 2, 2 heads (hs 1) over tp 2: rank r keeps its 2 q heads and its
    k and v head, and the shards glue back; the manifest form round-trips."""
    full = np.arange(8.0)[None, :]                         # q0..q3 k0 k1 v0 v1
    split = Split(1, 8, (4, 2, 2))
    shards = [split.shard(full, 2, r) for r in range(2)]
    assert shards[0].tolist() == [[0, 1, 4, 6]] and shards[1].tolist() == [[2, 3, 5, 7]]
    np.testing.assert_array_equal(split.unshard(shards), full)
    again = Split.from_dict(split.to_dict())
    assert again.parts == (4, 2, 2) and split.local(2) == 4
    assert Split.from_dict(Split(1, 12, 3).to_dict()).to_dict() == {"axis": 1, "size": 12,
                                                                     "blocks": 3}



# ---- the command line ------------------------------------------------------------------------

@pytest.mark.parametrize("flags, line", [
    (["--arch", "llama", "--n-kv-head", "3"],
     "--n-kv-head 3: --n-head 4 is not a multiple of it"),
    (["--arch", "llama", "--n-embd", "12", "--n-head", "4"],
     "--arch llama: the head size --n-embd / --n-head = 3 must be even"),
    (["--arch", "llama", "--rope-theta", "0"], "--rope-theta 0.0: must be positive"),
    (["--n-kv-head", "-1"], "--n-kv-head -1: must be at least 0"),
    (["--n-kv-head", "2"], "--n-kv-head: belongs to --arch llama's block"),
    (["--rope-theta", "5e5"], "--rope-theta: belongs to --arch llama's block"),
    (["--arch", "llama", "--no-bias"], "--no-bias: --arch llama has no biases already"),
    (["--arch", "llama", "--norm-eps", "0"], "--norm-eps 0.0: must be between 0 and 1"),
])
def test_bad_arch_flags_are_one_line(flags, line):
    out = _train(*flags)
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr
    assert line in out.stderr, out.stderr


def test_a_resumed_llama_run_takes_its_block_from_the_checkpoint(tmp_path):
    """Resumed without --arch or --n-kv-head: the checkpoint's Llama, not a GPT-2 that
    fails to load; one given that differs is one line naming it."""
    ck = tmp_path / "ck"
    small = ["--n-layer", "1", "--n-embd", "32", "--block-size", "16", "--batch-size", "4",
             "--eval-iters", "1"]
    first = _train(*small, "--arch", "llama", "--n-kv-head", "2", "--save", str(ck))
    assert first.returncode == 0, first.stderr
    again = _train(*small, "--steps", "2", "--resume", str(ck))
    assert again.returncode == 0, again.stderr
    assert "arch='llama', n_kv_head=2" in again.stdout
    other = _train(*small, "--steps", "2", "--resume", str(ck), "--n-kv-head", "4")
    assert other.returncode != 0 and "Traceback" not in other.stderr
    assert "--n-kv-head 4: --resume" in other.stderr and "n_kv_head 2" in other.stderr
    typed = _train(*small, "--steps", "2", "--resume", str(ck), "--arch", "llama",
                   "--n-kv-head", "2", "--ffn-hidden", "128")     # the sizes it holds: 128 = F
    assert typed.returncode == 0, typed.stderr
    wide = _train(*small, "--steps", "2", "--resume", str(ck), "--ffn-hidden", "100")
    assert wide.returncode != 0 and "Traceback" not in wide.stderr
    assert "holds a model with ffn_hidden 128" in wide.stderr, wide.stderr   # not its 0


def test_a_kv_head_count_typed_as_the_heads_it_means_is_not_refused():
    """A resumed run compares a typed model flag with the checkpoint's as the sizes resolve
    (inputs.take_model_fields): --n-kv-head 0 means --n-head's heads, so 0 and 4 are one
    model of 4 heads either way round; 2 is another, refused."""
    from argparse import Namespace
    from minidist.train.inputs import take_model_fields
    for theirs in (0, 4):
        model = {"n_head": 4, "n_kv_head": theirs, "n_embd": 32, "arch": "llama"}
        for typed in (0, 4):
            args = Namespace(n_kv_head=typed, given=["n_kv_head"])
            assert take_model_fields(args, model, ["n_kv_head"]) is None, (theirs, typed)
            assert args.n_kv_head == theirs                     # the checkpoint's value
        args = Namespace(n_kv_head=2, given=["n_kv_head"])
        assert take_model_fields(args, model, ["n_kv_head"]) == ("n_kv_head", 2)


# ---- every layout: one process's numbers ----------------------------------------------------

LLAMA = {"--arch": "llama", "--n-kv-head": 2}


@pytest.mark.mpi
@pytest.mark.parametrize("ranks, flags", [
    (2, {"--zero": 3}),
    (2, {"--tp": 2, "--sequence-parallel": True}),
    (2, {"--pp": 2, "--schedule": "1f1b"}),
    (2, {"--cp": 2, "--cp-split": "zigzag"}),
    (2, {"--cp": 2, "--cp-attention": "ulysses"}),
    (2, {"--n-kv-head": 1, "--dp": 2, "--ddp": "bucketed", "--dropout": 0.1,
         "--ckpt-activations": True}),
    (2, {"--dp": 2, "--amp": True}),
    (4, {"--tp": 2, "--pp": 2, "--zero": 1}),
    (4, {"--moe-experts": 4, "--ep": 2, "--tp": 2, "--sequence-parallel": True}),
    (4, {"--dp": 2, "--tp": 2, "--zero": 3}),
    (4, {"--n-kv-head": 1, "--cp": 2, "--pp": 2, "--dropout": 0.1, "--ckpt-activations": True}),
], ids=["zero3", "tp2-sp", "pp2", "cp2-ring", "cp2-ulysses", "mqa-ddp-dropout-recompute",
        "dp2-amp", "tp2-pp2-zero1", "moe-ep2-tp2-sp", "dp2-tp2-zero3", "mqa-cp2-pp2-dropout"])
def test_llama_layouts_train_one_process_numbers(sweep, ranks, flags):
    """float64: each step's loss and gradient norm, the val loss and every parameter within
    1e-10 of one process (--amp: a few float16 roundings); the 4-rank ones also stopped
    after step 2 and resumed bit for bit. Rotary positions under cp: each rank's zig-zag
    positions; GQA under tp: each rank its q heads' k and v heads; under cp k and v travel as
    the kv heads (mqa-cp2-pp2-dropout: one, in pipeline stages, with dropout and recompute)."""
    ok, errs, run = sweep.check(ranks, {**LLAMA, **flags}, resume=ranks == 4)
    assert ok, (errs, run["stderr"][-2000:])


def test_the_planner_plans_a_llama_and_prints_its_flags():
    """plan.py --arch llama --n-kv-head 8: the model line names the block, the layouts keep
    tp to divisors of the kv heads, and the command it prints trains that block."""
    out = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "plan.py"),
                          "--params", "7e9", "--gpus", "16", "--arch", "llama",
                          "--n-kv-head", "8"], cwd=ROOT, env=mpi_env(), capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "Llama's block, 8 kv heads" in out.stdout
    assert "--arch llama --n-kv-head 8" in out.stdout.splitlines()[-1]
    wide = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "plan.py"),
                           "--params", "7e9", "--gpus", "16", "--arch", "llama",
                           "--ffn-hidden", "11008"], cwd=ROOT, env=mpi_env(),
                          capture_output=True, text=True, timeout=120)
    assert wide.returncode == 0 and "--ffn-hidden 11008" in wide.stdout.splitlines()[-1]
    bad = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "plan.py"),
                          "--params", "7e9", "--gpus", "16", "--arch", "llama",
                          "--n-kv-head", "5"], cwd=ROOT, env=mpi_env(), capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode != 0 and "n_head (32) must be a multiple of n_kv_head" in bad.stderr
