"""Sampling from a model: `generate` appends n tokens to a prompt, one `model.next_token` at a
time; `sample` draws one token per row of logits.

`model.next_token(ctx, temperature, top_k, rng, cache)` runs the model on the context ctx
(B, T) and returns the next token of each row: GPT's (minidist/nn/gpt.py) runs its blocks
(with `model.sampling_cache()`'s KVCache, on the tokens it has not seen: minidist/nn/
kv_cache.py) and head on the last position and calls `sample`; a pipeline stage's
(minidist/pp/stage.py) runs the forward through every stage, samples on the last and
broadcasts the tokens, so every stage of a pipeline calls `generate` together. Draws come
from `backend.rng(seed)` on the host in float64: the same seed gives the same tokens on every
device and under every parallel layout.
Tests: tests/test_gpt.py (determinism, greedy, vocabulary padding), tests/test_sample.py.
"""
import numpy as np

from minidist import backend
from minidist.autograd import no_grad


def generate(model, idx, n, temperature=1.0, top_k=None, seed=0, stop=None):
    """Append `n` sampled tokens to idx (B, T); returns a host numpy array (B, T + n), or
    fewer tokens where `stop` (a function, asked before each token; None: never) said True.

    Deterministic: draws come from `backend.rng(seed)`. temperature 0 means greedy. Runs the
    model in eval mode (no dropout) and restores its previous mode.
    """
    rng, was_training = backend.rng(seed), model.training
    idx = np.array(backend.to_host(idx), dtype=np.int64)
    cache = model.sampling_cache()           # k and v kept: each token runs alone (or None)
    model.eval()
    try:
        with no_grad():
            for _ in range(n):
                if stop is not None and stop():
                    break
                ctx = idx[:, -model.config.block_size:]               # (B, <=block_size)
                nxt = model.next_token(ctx, temperature, top_k, rng, cache)   # (B,)
                idx = np.concatenate([idx, nxt[:, None]], axis=1)     # (B, T + 1)
    finally:
        model.train(was_training)
    return idx


def sample(logits, temperature, top_k, rng):
    """One token per row of logits (B, V), on the host in float64 for reproducibility."""
    logits = logits.astype(np.float64)
    if temperature == 0:
        return logits.argmax(axis=-1)
    logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = np.sort(logits, axis=-1)[:, -top_k][:, None]            # (B, 1)
        logits = np.where(logits < kth, -np.inf, logits)
    probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    u = rng.random((probs.shape[0], 1))                              # (B, 1)
    return np.minimum((probs.cumsum(axis=-1) < u).sum(axis=-1), probs.shape[-1] - 1)
