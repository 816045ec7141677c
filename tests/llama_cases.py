"""Shared by the Llama tests (tests/test_llama.py, test_llama_hf.py): the small Llama config,
and examples/train_gpt.py run for one step with flags."""
import os
import subprocess
import sys

from minidist.nn.config import GPTConfig
from mpirun import ROOT, mpi_env


TRAIN = os.path.join(ROOT, "examples", "train_gpt.py")


def llama(**kw):
    return GPTConfig(**{**dict(n_layer=2, n_head=4, n_embd=32, block_size=16, vocab_size=40,
                               arch="llama", bias=False, n_kv_head=2), **kw})


def _train(*flags, timeout=120):
    return subprocess.run([sys.executable, TRAIN, "--steps", "1", "--sample", "0", *flags],
                          cwd=ROOT, env=mpi_env(), capture_output=True, text=True,
                          timeout=timeout)
