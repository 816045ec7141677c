"""Tensor and sequence parallelism: shard layouts and refusals in-process, then 2 and 4 ranks
under mpiexec against one process in float64 (tests/scripts/tp_check.py batches many checks
into one mpiexec start), and train_gpt.py end to end. Each distributed test's docstring gives
the command to run it by hand.
"""
import json
import os
import sys

import numpy as np
import pytest

from minidist.autograd import fused as F
from minidist.backend import to_host as H
from minidist.nn import GPT, GPTConfig
from minidist.strategy.split import Split
from minidist.tp.model import check_tp_sizes
from minidist.train.args import train_parser
from minidist.train.strategy import check_layout
from minidist.train.cli import UsageError
from mpirun import tagged_json, within


# ---- in-process: layouts and refusals -----------------------------------------------------

def test_split_round_trip_with_blocks_and_padding(xp):
    full = xp.arange(6 * 12).reshape(6, 12).astype(float)
    qkv = Split(axis=1, size=12, blocks=3)                      # q|k|v, 4 columns each
    shards = [qkv.shard(full, 2, r) for r in range(2)]
    assert shards[0].shape == (6, 6)
    assert (shards[1][:, :2] == full[:, 2:4]).all() and (shards[1][:, 2:4] == full[:, 6:8]).all()
    assert (qkv.unshard(shards) == full).all()
    vocab = Split(axis=0, size=6)                               # 6 rows over 4 ranks: 2 each
    shards = [vocab.shard(full, 4, r) for r in range(4)]
    assert vocab.padding(4) == 2 and all(s.shape == (2, 12) for s in shards)
    assert (shards[3] == 0).all() and (vocab.unshard(shards) == full).all()


def test_column_split_of_c_attn_gives_each_rank_whole_heads(xp):
    """Attention on a rank's (B, T, 3C/tp) slice of qkv (its heads' q, k and v) is exactly
    that rank's heads' columns of the full attention output."""
    B, T, C, nh, tp = 2, 5, 12, 4, 2
    qkv = xp.asarray(np.random.default_rng(0).standard_normal((B, T, 3 * C)))
    y = F.causal_self_attention(qkv, nh).data                   # (B, T, C)
    split = Split(axis=2, size=3 * C, blocks=3)
    for r in range(tp):
        local = F.causal_self_attention(split.shard(qkv, tp, r), nh // tp).data
        assert xp.allclose(local, y[:, :, r * C // tp:(r + 1) * C // tp], atol=1e-14)


def test_tp_sizes_are_checked_vocab_is_padded():
    ok = GPTConfig(n_layer=1, n_head=4, n_embd=16, vocab_size=257)
    assert check_tp_sizes(ok, 4) == []                          # 257 rows: padded, not refused
    bad = check_tp_sizes(GPTConfig(n_layer=1, n_head=3, n_embd=15), 2)
    assert "n_head 3 is not divisible by tp 2" in bad[0] and "n_embd 15" in bad[1]


def _parse(*flags):
    return train_parser().parse_args(list(flags))


@pytest.mark.parametrize("flags, message", [
    (["--tp", "2"], "--tp 2 = 2 ranks per replica (the processes are dp x 2), but this job "
     "has 1 MPI process"),
    (["--tp", "2", "--dp", "3"], "--dp 3 x --tp 2 = 6 ranks, but this job has 4"),
    (["--tp", "4", "--n-head", "6", "--n-embd", "24"], "--n-head 6 is not divisible by --tp 4"),
    (["--tp", "2", "--sequence-parallel", "--block-size", "9"], "multiple of 2"),
])
def test_make_strategy_refuses_bad_tp_sizes(flags, message):
    size = 4 if "--dp" in flags or "--n-head" in flags or "--sequence-parallel" in flags else 1
    with pytest.raises(UsageError, match="tensor parallelism") as e:
        check_layout(_parse(*flags), size)
    assert message in str(e.value)


def test_one_rank_tp_model_is_the_gpt(device):
    """tp = 1 (a one-rank group): the same loss, gradients and samples as GPT."""
    from mpi4py import MPI
    from minidist.comm import ProcessGroup
    from minidist.tp.model import TensorParallelGPT
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=8, block_size=8, vocab_size=20, dropout=0.1)
    ref, tp = GPT(cfg, seed=3, dtype="float64"), TensorParallelGPT(
        cfg, ProcessGroup(MPI.COMM_SELF, name="tp1"), seed=3, dtype="float64",
        sequence_parallel=True)
    x = np.random.default_rng(0).integers(0, 20, (2, 8))
    a, b = ref(x, np.roll(x, -1, 1))[1], tp(x, np.roll(x, -1, 1))[1]
    a.backward()
    b.backward()
    assert float(a.data) == float(b.data)
    grads = dict(ref.named_parameters())
    assert all(np.array_equal(H(p.grad), H(grads[n].grad)) for n, p in tp.named_parameters())
    assert (ref.generate(x[:, :2], 5, seed=1) == tp.generate(x[:, :2], 5, seed=1)).all()


def test_a_tp_model_refuses_a_target_outside_the_vocabulary(device):
    """TensorParallelGPT's own head checks its targets on the host as GPT's does: CuPy would
    wrap a bad id around in the vocabulary-parallel loss; here one clear ValueError."""
    from mpi4py import MPI
    from minidist.comm import ProcessGroup
    from minidist.tp.model import TensorParallelGPT
    cfg = GPTConfig(n_layer=1, n_head=2, n_embd=8, block_size=8, vocab_size=20)
    tp = TensorParallelGPT(cfg, ProcessGroup(MPI.COMM_SELF, name="tp1 ids"), seed=3)
    x = np.random.default_rng(0).integers(0, 20, (2, 8))
    y = x.copy()
    y[1, 4] = 20
    with pytest.raises(ValueError, match=r"^targets: token id 20 is outside the vocabulary "
                                         r"of 20 tokens"):
        tp(x, y)
    x[0, 0] = 25
    with pytest.raises(ValueError, match=r"^idx: token id 25 is outside the vocabulary"):
        tp(x, np.roll(x, -1, 1))


# ---- under mpiexec -----------------------------------------------------------------------

def _assert_exact(results, runs, tol=1e-10):
    assert [r["run"] for r in results] == runs, results
    for r in results:
        assert within(r, tol), r
        print(f"{r['run']:12s} tp {r['tp']} dp {r['dp']}: |loss diff| {r['loss_diff']:.1e}, "
              f"|norm diff| {r['norm_diff']:.1e}, |param diff| {r['param_diff']:.1e}")


@pytest.mark.mpi
def test_two_ranks_gradchecks_exactness_memory_traffic_refusals(mpi):
    """2 ranks, one job: distributed gradchecks of every conjugate Function, gathered_linear
    and parallel layer; tp 2, tp 2 + sequence parallel, and + activation checkpointing, each
    equal to one process (float64, dropout 0.1, clipped every step) to 1e-10; save_pretrained
    and --save files equal the reference's and load back both ways; split layers 1/2 of the
    bytes; the activation ledger under sequence parallelism (2L + 1) B*T*C (1 - 1/tp) x 8
    bytes below the naive gather-then-Linear pair's (c_attn's, c_fc's and the head's inputs
    kept as shards, not whole), B*T*C (1 - 1/tp) with recompute, gradients bitwise the
    same; tp traffic per block and per model =
    theory (the re-gathers included); bad sizes refused before any mesh:

        mpiexec -n 2 python tests/scripts/tp_check.py
    """
    out = mpi(2, "tests/scripts/tp_check.py", timeout=180)
    _assert_exact(tagged_json(out, "RESULT"), ["tp2", "tp2+sp", "tp2+sp+ckpt"])
    files = tagged_json(out, "RESULT")[0]
    assert all(files[k] <= 1e-10 for k in ("pretrained_diff", "ckpt_diff", "adam_diff",
                                           "reload_diff", "adam_reload_diff")), files
    checks = tagged_json(out, "GRADCHECK")
    issued = checks.pop()                   # backward's re-gather and reduce-scatter: async
    assert issued["issued"] == [["all_gather", False], ["all_gather", True],
                                ["reduce_scatter", True]]
    assert len(checks) == 16 and all(c["max_abs_diff"] < 1e-6 for c in checks)
    assert [c["op"] for c in checks if "gathered_linear" in c["op"]] == \
        ["gathered_linear: input", "gathered_linear: weight", "gathered_linear: bias"]
    rows = tagged_json(out, "ACTIVATIONS")        # the re-gather's saving, measured = formula
    assert [r["ckpt"] for r in rows] == [False, True], rows
    for row in rows:
        per_layer = 0 if row["ckpt"] else 2 * row["layers"]      # c_attn, c_fc; + the head
        whole_less_shard = row["btc_bytes"] * (row["tp"] - 1) // row["tp"]
        assert row["drop"] == (per_layer + 1) * whole_less_shard == row["formula"] > 0, row
    memory = {r["params"]: r for r in tagged_json(out, "MEMORY")}
    assert memory["blocks"]["ratio"] == 0.5 and memory["wte"]["ratio"] == 0.5
    traffic = tagged_json(out, "TRAFFIC")
    assert len(traffic) == 4 and all(t["bytes_sent"] == t["theory_sent"] for t in traffic)
    block = [t for t in traffic if t["what"] == "block"]
    assert block[0]["calls_bytes"] == {"all_reduce": [4, 4 * block[0]["btc_bytes"]]}
    sp = block[1]          # SP: the same bytes, plus replicated grads' sums, plus backward's
    # re-gather of c_attn's and c_fc's input shards (2 all-gathers of B*T*C, (tp-1)/tp sent)
    assert sp["regather_bytes"] == 2 * block[0]["btc_bytes"]
    assert sp["bytes_sent"] == block[0]["bytes_sent"] + sp["shared_param_bytes"] + \
        sp["regather_bytes"] // 2
    assert len(tagged_json(out, "REFUSALS")) == 6


@pytest.mark.mpi
def test_four_ranks_tp4_and_tp2_x_dp2_ddp_or_zero_equal_one_process(mpi):
    """tp 4 (vocabulary 30 padded to 32), tp 2 x dp 2 (DDP over the mesh's dp group, rows by
    dp rank), tp 2 x dp 2 + sequence parallel + grad-accum 2, tp 4 + sequence parallel, and
    tp 2 x ZeRO-1, -2 (+ sequence parallel, grad-accum 2), -3 (and + sequence parallel +
    activation checkpointing) over dp 2; dropout 0.1 in every
    run (keyed masks: one process's); clipped every step (under ZeRO the replicated
    parameters' pieces of the gradient shards count once):

        mpiexec -n 4 python tests/scripts/tp_check.py
    """
    out = mpi(4, "tests/scripts/tp_check.py", timeout=180)
    _assert_exact(tagged_json(out, "RESULT"), ["tp4", "tp2xdp2", "tp2xdp2+sp", "tp4+sp",
                                         "tp2xdp2+zero1", "tp2xdp2+zero2+sp", "tp2xdp2+zero3",
                                         "tp2xdp2+zero3+sp+ckpt"])


TINY = ["--n-layer", "2", "--n-head", "2", "--n-embd", "16", "--block-size", "16",
        "--batch-size", "8", "--lr", "1e-2", "--eval-iters", "2", "--log-every", "1",
        "--steps", "4", "--eval-every", "0", "--dtype", "float64", "--sample", "20"]


def _losses(path):
    return [r.get("loss", r.get("val_loss")) for r in map(json.loads, open(path))]


def _sample(stdout):
    assert stdout.count("---- sample ----") == 1, stdout            # printed by rank 0 alone
    return stdout.split("---- sample ----\n")[1].split("\n----------------")[0]


def _python(device, *args):
    """python ARGS --device DEVICE, one process (what an mpiexec run is compared with)."""
    import subprocess
    from mpirun import ROOT, device_flags, mpi_env
    return subprocess.run([sys.executable, *map(str, args), *device_flags(device)], cwd=ROOT,
                          env=mpi_env(), text=True, capture_output=True,
                          check=True, timeout=600).stdout


@pytest.mark.mpi
def test_train_gpt_tp2_matches_one_process_and_its_checkpoint_loads_on_one(corpus, tmp_path, mpi):
    """train_gpt.py --tp 2 logs the single-process run's losses and val loss (float64) and
    samples its text (both tp ranks run the sampler); its --save checkpoint (the full model,
    gathered) loads on one process with the same val loss and sample:

        python examples/train_gpt.py --data CORPUS --dtype float64 ... --log-json one.jsonl
        mpiexec -n 2 python examples/train_gpt.py --tp 2 ... --save ck
        python examples/train_gpt.py ... --resume ck
    """
    common = [*TINY, "--data", corpus, "--cache-dir", tmp_path / "cache"]
    one, tp, back = tmp_path / "one.jsonl", tmp_path / "tp.jsonl", tmp_path / "back.jsonl"
    ref = _python(mpi.device, "examples/train_gpt.py", *common, "--log-json", one)
    out = mpi(2, "examples/train_gpt.py", *common, "--tp", "2", "--log-json", tp,
              "--save", tmp_path / "ck", timeout=120).stdout
    assert "tensor parallel: tp 2 x dp 1" in out and "MiB sent per rank per step" in out
    assert np.allclose(_losses(tp), _losses(one), rtol=0, atol=1e-10)
    assert _sample(out) == _sample(ref)
    loaded = _python(mpi.device, "examples/train_gpt.py", *common, "--resume", tmp_path / "ck",
                     "--log-json", back)
    assert abs(_losses(back)[-1] - _losses(one)[-1]) <= 1e-10
    assert _sample(loaded) == _sample(ref)


@pytest.mark.mpi
def test_a_tp_zero_checkpoint_is_checked_whole_before_any_layout_reads_it(corpus, tmp_path,
                                                                          mpi):
    """A TP x ZeRO checkpoint is one folder per tp rank (tp<r>-of-<T>/, each ZeRO's sharded
    files and a manifest recording how its parameters were cut). Read in another layout, its
    parts are checked against each other first: a part missing or one too many (another tp's
    part 1, whose cut records no tp), parts of another save, or
    parts saved before they recorded their cut (resumable with the same --tp only) are one
    CheckpointError naming the folder, before any array is read. A corrupt shard of one tp
    rank's part stops every rank with one error line.

        mpiexec -n 2 python examples/train_gpt.py --tp 2 --zero 1 --steps 3 --save ck, then
        its tp1-of-2 folder damaged and ck read in another layout
    """
    import shutil
    from minidist.strategy.checkpoint import CheckpointError, load, verify
    from minidist.strategy.checkpoint_dirs import resolve
    common = [*TINY, "--sample", "0", "--data", corpus, "--cache-dir", tmp_path / "cache"]
    for name, steps in (("ck", "3"), ("other", "2")):
        out = mpi(2, "examples/train_gpt.py", *common, "--tp", "2", "--zero", "1", "--steps",
                  steps, "--save", tmp_path / name, timeout=120)
    # its memory table's rows are tp rank 0's data-parallel group: said so
    assert "ZeRO's memory table below is tp rank 0's" in out.stdout, out.stdout
    folder = resolve(str(tmp_path / "ck"))
    manifest = verify(folder)
    assert manifest["tp"]["size"] == 2 and manifest["step"] == 3
    assert [os.path.basename(p) for p in manifest["parts"]] == ["tp0-of-2", "tp1-of-2"]
    assert manifest["tp"]["splits"]["transformer.h.0.attn.c_attn.weight"] == {
        "axis": 1, "size": 3 * 16, "blocks": 3}
    params, _, meta = load(folder)
    assert params["transformer.h.0.mlp.c_fc.weight"].shape == (16, 64) and meta["step"] == 3

    def broken(edit):
        copy = tmp_path / f"broken{len(os.listdir(tmp_path))}"
        shutil.copytree(folder, copy)
        edit(str(copy))
        with pytest.raises(CheckpointError) as e:
            load(str(copy))
        return str(e.value)

    assert "not the 2 of tp 2" in broken(lambda c: shutil.rmtree(os.path.join(c, "tp1-of-2")))

    def swapped(c):                    # walk 37: named the two parts it said were missing
        for a, b in (("tp0-of-2", "x"), ("tp1-of-2", "tp0-of-2"), ("x", "tp1-of-2")):
            os.rename(os.path.join(c, a), os.path.join(c, b))
    assert "tp0-of-2 holds tp rank 1 of 2's part; tp1-of-2 holds tp rank 0 of 2's part " \
        "(renamed or moved?)" in broken(swapped)

    def other_save(c):
        shutil.rmtree(os.path.join(c, "tp1-of-2"))
        shutil.copytree(os.path.join(resolve(str(tmp_path / "other")), "tp1-of-2"),
                        os.path.join(c, "tp1-of-2"))
    assert "disagree on the step" in broken(other_save)

    def third_part(c):                 # a tp-3 run's part 1 beside the two: the cut records
        from minidist.strategy.readers import sha256_file    # no tp, so only the count shows
        shutil.copytree(os.path.join(c, "tp1-of-2"), os.path.join(c, "tp1-of-3"))
        path = os.path.join(c, "tp1-of-3", "manifest.json")
        m = json.load(open(path))
        m["tp"]["size"] = 3
        json.dump(m, open(path, "w"))
        open(os.path.join(c, "tp1-of-3", "manifest.sha256"), "w").write(sha256_file(path))
    assert "not the 2 of tp 2" in broken(third_part)

    def saved_before(c):               # a part's manifest without "tp", its digest made anew
        from minidist.strategy.readers import sha256_file
        path = os.path.join(c, "tp0-of-2", "manifest.json")
        m = json.load(open(path))
        del m["tp"]
        json.dump(m, open(path, "w"))
        open(os.path.join(c, "tp0-of-2", "manifest.sha256"), "w").write(sha256_file(path))
    assert "resume it with the same --tp and --zero" in broken(saved_before)
    # a model flag typed against the checkpoint's model is named before any work (a resumed
    # run takes its model from the checkpoint)
    out = mpi(2, "examples/train_gpt.py", *common, "--tp", "2", "--n-embd", "32", "--resume",
              folder, timeout=120, check=False)
    assert out.returncode == 2 and "--n-embd 32: --resume " in out.stderr and \
        "holds a model with n_embd 16; leave --n-embd out" in out.stderr, out.stderr
    # resumed in its own layout, each tp rank reads its own part's shards: a corrupt byte in
    # tp rank 1's is found there alone, and every rank stops with its message (the verdict
    # is agreed over every rank, not only tp rank 1's ZeRO group: rank 0 said "resumed" and
    # the job died later naming no checkpoint, exit 1)
    def corrupt(c):
        shard = os.path.join(c, "tp1-of-2", "shard-00000-of-00001.safetensors")
        data = bytearray(open(shard, "rb").read())
        data[-8] ^= 0xFF
        open(shard, "wb").write(bytes(data))
    copy = tmp_path / "corrupt"
    shutil.copytree(folder, copy)
    corrupt(str(copy))
    out = mpi(2, "examples/train_gpt.py", *common, "--tp", "2", "--zero", "1", "--steps", "5",
              "--resume", copy, timeout=120, check=False)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.count("error: ") == 1 and "resumed" not in out.stdout, out.stderr
    assert "tp1-of-2/shard-00000-of-00001.safetensors does not match the checksum" \
        in out.stderr, out.stderr


@pytest.mark.mpi
def test_bad_tp_sizes_are_refused_on_every_rank(mpi):
    """No collective is reached, so nothing hangs; one `error:` line (rank 0's), exit 2, no
    traceback:

        mpiexec -n 2 python examples/train_gpt.py --tp 2 --n-head 3 --n-embd 15
    """
    out = mpi(2, "examples/train_gpt.py", "--tp", "2", "--n-head", "3", "--n-embd", "15",
              timeout=60, check=False)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.count("--n-head 3 is not divisible by --tp 2") == 1
    assert out.stderr.startswith("error: tensor parallelism: ")


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.parametrize("zero", ["0", "3"])
def test_train_gpt_tp2_dp2_sequence_parallel_resumes_bit_identically(corpus, tmp_path, zero, mpi):
    """tp 2 x dp 2 (DDP, or ZeRO-3: one sharded checkpoint per tp rank) with sequence
    parallelism, stopped and resumed from its checkpoint, logs the uninterrupted run's losses
    (which are the single-process run's):

        mpiexec -n 4 python examples/train_gpt.py --tp 2 --zero 3 --sequence-parallel ...
    """
    common = [*TINY, "--data", corpus, "--cache-dir", tmp_path / "cache", "--tp", "2",
              "--sequence-parallel", "--zero", zero]
    straight, resumed = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    out = mpi(4, "examples/train_gpt.py", *common, "--log-json", straight, timeout=120)
    assert _sample(out.stdout)
    mpi(4, "examples/train_gpt.py", *common, "--save", tmp_path / "ck", "--stop-at", "2",
        "--sample", "0", timeout=120)
    mpi(4, "examples/train_gpt.py", *common, "--resume", tmp_path / "ck", "--log-json",
        resumed, "--sample", "0", timeout=120)
    assert _losses(resumed) == _losses(straight)[2:]


@pytest.mark.mpi
@pytest.mark.slow
def test_resume_memory_benchmark_runs(mpi):
    """python examples/bench_resume_memory.py --n-layer 4 --n-embd 64 --n-head 4: a row per
    scenario and layout (each rank's peak anonymous memory, fresh and resumed), then the
    summary."""
    import subprocess
    from mpirun import ROOT, mpi_env
    out = subprocess.run([sys.executable, "examples/bench_resume_memory.py", "--n-layer", "4",
                          "--n-embd", "64", "--n-head", "4"], cwd=ROOT, env=mpi_env(),
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert [(r.get("scenario"), r.get("to")) for r in rows[:-1]] == [
        ("tp", "--tp 4 --zero 1"), ("tp", "--tp 2 --zero 1"), ("tp", "--tp 2"),
        ("tp", "--zero 3"), ("tp", "--pp 4"), ("tp", "--pp 2 --tp 2"), ("tp", "--pp 2 --dp 2"),
        ("ep", "--ep 4"), ("ep", "--ep 4 --zero 1"), ("ep", "--ep 2 --zero 1")]
    assert all(r["fresh_peak_anon_mb"] > 0 and r["resumed_peak_anon_mb"] > 0 for r in rows[:-1])
    assert set(rows[-1]["by_layout"]) == {f"{r['from']} -> {r['to']}" for r in rows[:-1]}
