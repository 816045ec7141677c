"""examples/sample.py: text from a checkpoint of any strategy, gathered into the whole model in
one process (minidist/train/gather.py). Its bad input (an imported GPT-2's BPE vocabulary
included) is a table in tests/test_cli_examples.py.

    python examples/train_gpt.py --steps 3 --save ck ...
    mpiexec -n 2 python examples/train_gpt.py --tp 2 --zero 1 --steps 3 --save ck_tpz ...
    python examples/sample.py --resume ck_tpz --prompt "def " --temperature 0
"""
import json
import pickle
import subprocess
import sys

import numpy as np
import pytest

from minidist.nn import GPT, GPTConfig
from minidist.strategy.split import Split
from minidist.train.gather import whole_model
from mpirun import ROOT, device_flags, mpi_env, mpiexec, run_job, run_mpi

TINY = ["--n-layer", "2", "--n-head", "2", "--n-embd", "16", "--block-size", "16",
        "--batch-size", "4", "--eval-iters", "1", "--eval-every", "0", "--sample", "0",
        "--steps", "3", "--dtype", "float64", "--seed", "5"]
# (ranks, flags): each strategy whose checkpoint stores the model differently
STRATEGIES = [
    (2, ["--zero", "3"]),                       # rank shards of flat buffers
    (2, ["--tp", "2", "--zero", "1"]),          # one ZeRO folder per tp rank
    (2, ["--pp", "2"]),                         # stages gathered on save
    (4, ["--cp", "2", "--tp", "2", "--zero", "3"]),     # a ZeRO folder per tp rank, over dp x cp
]


def _sample(device, *flags, check=True):
    out = subprocess.run([sys.executable, "examples/sample.py", *map(str, flags),
                          *device_flags(device)], cwd=ROOT, env=mpi_env(), text=True,
                         capture_output=True, timeout=120)
    if check:
        assert out.returncode == 0, out.stderr
    return out


def _train(launch, corpus, tmp_path, save, *flags):
    cmd = [*launch, sys.executable, "examples/train_gpt.py", *TINY, "--data", corpus,
           "--cache-dir", str(tmp_path / "cache"), "--save", str(save), *flags]
    run_job(cmd, timeout=180)       # a timeout kills the job's process group


@pytest.mark.parametrize("bias", [True, False])
def test_a_tp_part_records_the_tensor_parallel_models_own_splits(bias):
    """What a TP x ZeRO part's manifest records of each split parameter (Split.to_dict) reads
    back as the Split TensorParallelGPT's layers cut with: any layout glues the pieces by it
    (minidist/strategy/readers.py PartsReader)."""
    from mpi4py import MPI
    from minidist.comm import ProcessGroup
    from minidist.tp.model import TensorParallelGPT
    config = GPTConfig(n_layer=2, n_head=2, n_embd=8, block_size=8, vocab_size=11, bias=bias)
    model = TensorParallelGPT(config, ProcessGroup(MPI.COMM_SELF, name="tp"), seed=0)
    theirs = {n: repr(p.tp_split) for n, p in model.named_parameters() if p.tp_split}
    recorded = json.loads(json.dumps({n: p.tp_split.to_dict()
                                      for n, p in model.named_parameters() if p.tp_split}))
    assert {n: repr(Split.from_dict(d)) for n, d in recorded.items()} == theirs
    assert len(theirs) == 2 * (6 if bias else 4) + 1          # + wte, split by vocabulary


@pytest.mark.mpi
def test_every_strategy_gathers_to_the_one_process_model(corpus, tmp_path, mpi):
    """Float64, same seed and batches: each strategy's checkpoint, gathered, holds the
    one-process run's parameters (to 1e-10), and sample.py writes the same greedy text.

        mpiexec -n 2 python examples/train_gpt.py --tp 2 --zero 1 --save S --dtype float64
        python examples/sample.py --resume S --prompt "def " --tokens 24 --temperature 0
    """
    device = mpi.device
    _train([], corpus, tmp_path, tmp_path / "one", *device_flags(device))
    _, ref, _ = whole_model(tmp_path / "one")
    greedy = ["--prompt", "def ", "--tokens", "24", "--temperature", "0"]
    text = _sample(device, "--resume", tmp_path / "one", *greedy).stdout
    assert text.startswith("def ") and len(text) > 4
    for ranks, flags in STRATEGIES:
        save = tmp_path / "_".join(f.strip("-") for f in flags)
        _train([mpiexec(), "-n", str(ranks)], corpus, tmp_path, save, *flags,
               *device_flags(device))
        config, got, what = whole_model(save)
        assert set(got) == set(ref) and config.n_layer == 2, what
        worst = float(np.max([np.abs(got[n] - ref[n]).max() for n in ref]))   # NaN: fails
        assert worst <= 1e-10, (flags, worst)
        assert _sample(device, "--resume", save, *greedy).stdout == text, flags


@pytest.mark.mpi
def test_a_sharded_checkpoints_weights_are_read_without_its_moments(corpus, tmp_path):
    """whole_model (--init-from, sample.py, export_gpt2.py) of a ZeRO checkpoint assembles
    the parameters (and --amp's masters) whole, never AdamW's moments, which it drops: its
    traced peak is the weights' bytes, not 3 x them (74.1 MiB for 24.7 before; 2 layers of
    512 on 2 ranks): every rank of an --init-from reads them, so ZeRO-3's build a unit at
    a time had three times the whole model's bytes beside it.

        mpiexec -n 2 python examples/train_gpt.py --zero 2 --n-embd 128 --save ck ...
    """
    import tracemalloc
    ck = tmp_path / "ck"
    _train([mpiexec(), "-n", "2"], corpus, tmp_path, ck, "--zero", "2", "--n-embd", "128")
    tracemalloc.start()
    try:
        _, whole, _ = whole_model(ck)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    weights = sum(a.nbytes for a in whole.values())
    assert peak < 1.5 * weights, (peak, weights)


@pytest.mark.mpi
def test_an_amp_checkpoint_gathers_its_float32_masters(corpus, tmp_path):
    """--amp saves 16-bit parameters and the optimizer's float32 masters they were rounded
    from: whole_model takes the masters (the 16-bit copies lose the low bits of every
    weight). Mutation testing: whole_model returning the 16-bit parameters passed every
    test.

        python examples/train_gpt.py --amp --steps 3 --save ck ...
    """
    from minidist.strategy import checkpoint, checkpoint_dirs
    ck = tmp_path / "ck"
    flags = [f for f in TINY if f not in ("--dtype", "float64")]
    run_job([sys.executable, "examples/train_gpt.py", *flags, "--amp", "--data", corpus,
             "--cache-dir", str(tmp_path / "cache"), "--save", str(ck)], timeout=180)
    _, whole, _ = whole_model(ck)
    params, opt_state, _ = checkpoint.load(checkpoint_dirs.resolve(str(ck)))
    masters = {n: s["master"] for n, s in opt_state["state"].items() if "master" in s}
    assert set(masters) == set(params) == set(whole)
    for name, master in masters.items():
        assert whole[name].dtype == np.float32 and params[name].dtype == np.float16, name
        assert np.array_equal(whole[name], master), name
    assert any(not np.array_equal(whole[n], params[n].astype(np.float32)) for n in params)


def test_a_gpt2_folder_with_byte_vocabulary_samples(tmp_path, device):
    """A GPT-2 folder (config.json + model.safetensors) with minidist's byte vocabulary loads
    and samples; one with GPT-2's BPE is refused (tests/test_cli_examples.py, SAMPLE_BAD)."""
    GPT(GPTConfig(n_layer=1, n_head=1, n_embd=4, block_size=8, vocab_size=256)).save_pretrained(
        tmp_path / "bytes")
    out = _sample(device, "--resume", tmp_path / "bytes", "--prompt", "ab", "--tokens", "5")
    assert out.stdout.startswith("ab") and "the GPT-2 folder" in out.stderr
    assert "note: the prompt" not in out.stderr
    # a prompt past the context is cut to its last block_size tokens: said (walk 38)
    out = _sample(device, "--resume", tmp_path / "bytes", "--prompt", "x" * 12, "--tokens", "1")
    assert "note: the prompt's 12 tokens are more than the model's 8: it reads the last 8" \
        in out.stderr, out.stderr


def test_prompt_help_names_its_newline_default():
    """python examples/sample.py --help: the --prompt default (a newline) is named, not
    printed raw as `(default: )` followed by a line break."""
    out = subprocess.run([sys.executable, "examples/sample.py", "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60, check=True).stdout
    prompt = " ".join(out.split("--prompt PROMPT", 2)[2].split("--tokens")[0].split())
    assert prompt == ("the text to continue (default: a newline; the first token of a "
                      "character vocabulary without one, as train_gpt.py's sample)"), prompt


def test_no_prompt_starts_a_vocabulary_without_a_newline_as_training_does(tmp_path, device):
    """python examples/sample.py --resume CK, CK trained on nanoGPT character files with no
    newline in them: the default prompt was "\\n", refused as `error: --prompt '\\n': the
    text has characters outside the vocabulary` though no --prompt was typed, while the
    training run's own sample starts from token 0 there (end_sample.start_ids; first-use
    walk, session 35). A prompt typed is still held to the vocabulary."""
    folder = tmp_path / "chars"
    GPT(GPTConfig(n_layer=1, n_head=1, n_embd=4, block_size=8, vocab_size=3)).save_pretrained(
        folder)
    with open(folder / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": 3, "itos": {0: "a", 1: "b", 2: "c"},
                     "stoi": {"a": 0, "b": 1, "c": 2}}, f)
    out = _sample(device, "--resume", folder, "--tokens", "5")
    assert len(out.stdout) == 7 and set(out.stdout[:6]) <= set("abc"), out.stdout
    out = _sample(device, "--resume", folder, "--prompt", "\n", check=False)
    assert out.returncode == 2 and "outside the vocabulary" in out.stderr, out.stderr


@pytest.mark.mpi
@pytest.mark.parametrize("script,flags", [
    ("sample.py", ["--resume", "{tmp}/none"]),
    ("export_gpt2.py", ["--resume", "{tmp}/none", "--out", "{tmp}/out"]),
    ("train_tokenizer.py", ["--data", "{tmp}/none.txt", "--out", "{tmp}/tok"]),
    ("plan.py", ["--params", "1e9", "--gpus", "8"]),
    ("plan_memory.py", ["--params", "1e9", "--gpus", "8"])])
def test_a_one_process_script_under_mpirun_is_one_error_line(tmp_path, script, flags):
    """mpirun -n 2 python examples/sample.py ...: every rank printed the whole sample (and
    train_tokenizer.py's ranks wrote one folder, the second refused it and exit 2; the
    planners printed their table twice); a script that trains nothing runs on one process,
    so it is one error line, exit 2 (cli.check_one_process, before any file is read)."""
    flags = [f.format(tmp=tmp_path) for f in flags]
    out = run_mpi(2, f"examples/{script}", *flags, timeout=60, check=False)  # (no --device)
    assert out.returncode == 2 and out.stdout == "", (out.stdout, out.stderr)
    assert out.stderr == (f"error: {script} runs on one process, not 2: run `python "
                          f"examples/{script} ...` without mpirun\n"), out.stderr
