"""Shared by the checkpoint tests (tests/test_checkpoint.py, tests/test_checkpoint_dirs.py): a
tiny model's config, and a model and its AdamW trained a few steps."""
import numpy as np

from minidist.nn import GPT, GPTConfig
from minidist.optim import AdamW


TINY = GPTConfig(n_layer=1, n_head=2, n_embd=8, block_size=8, vocab_size=16)


def _trained(seed=0, steps=2):
    model = GPT(TINY, seed=seed)
    opt = AdamW(model.named_parameters(), lr=1e-2)
    x = np.random.default_rng(seed).integers(0, 16, (2, 8))
    for _ in range(steps):
        model(x, x)[1].backward()
        opt.step()
        opt.zero_grad()
    return model, opt
