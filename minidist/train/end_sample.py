"""The end of a training run (or an --eval-only one): `--sample N` tokens of text from the
model, which every rank of a model split over ranks computes together, and stops together
at a signal. Called by minidist/train/loop.py. Tests: tests/test_preemption.py (a signal
during the sample), tests/test_sample.py.
"""
import itertools
import unicodedata

import numpy as np

from minidist.train.data import DataError


def sample_text(model, data, n, seed, temperature=0.8, top_k=40, stop=None):
    """`n` tokens sampled after `start_ids`, as text (the start included); fewer where
    `stop`, asked before each token, says so (GPT.generate)."""
    out = model.generate(start_ids(data.tokenizer), n, temperature=temperature, top_k=top_k,
                         seed=seed, stop=stop)
    return data.tokenizer.decode(out[0])


def start_ids(tokenizer):
    """The (1, t) ids a sample with no prompt starts from: a newline, or token 0 of a
    character vocabulary without one (examples/sample.py without --prompt starts here too)."""
    try:
        return tokenizer.encode("\n")[None, :]
    except DataError:
        return np.zeros((1, 1), dtype=np.int64)


# bidirectional embeddings, overrides and isolates: they reorder what follows on the screen
BIDI_CONTROLS = frozenset("\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")


def printable(text):
    """`text` with what a terminal would act on shown as escapes instead: control characters
    but newline and tab (escape sequences), bidirectional controls, lone surrogates. An
    untrained model's sample is random bytes. Other characters Python calls unprintable
    are text: the zero-width joiners of emoji sequences and Indic and Persian scripts
    (first-use walk 33: a prompt's 👩‍💻 came back as 👩\\u200d💻), no-break and ideographic
    spaces."""
    return "".join(repr(c)[1:-1] if _acts_on_terminal(c) else c for c in text)


def _acts_on_terminal(c):
    category = unicodedata.category(c)
    return (category == "Cc" and c not in "\n\t") or category == "Cs" or c in BIDI_CONTROLS


SAMPLE_AGREE = 16     # tokens between the sample's agreements on a signal


def sample_at_end(args, strategy, log, model, data, signals):
    """The end's sample: (its text, whether a signal cut it, whether that was Ctrl-C; first-
    use walk 37: a SIGTERM cut it without a word). Collective: every rank
    calls it. Every SAMPLE_AGREE tokens all ranks agree whether a signal came (one
    1-element all-reduce, strategy.any_rank, as at a step boundary): the ranks that sample
    ask it from generate's `stop` before those tokens, the others ask it as often, so a
    model split over ranks (TP, PP, EP, ZeRO-3: the same tokens through their collectives)
    stops at the same token on each, and nobody waits in a collective another has left."""
    takes = strategy.takes_part_in_sampling()                 # tp: every rank of a replica
    asked = itertools.count()

    def stop():                  # before each token: the agreement, every SAMPLE_AGREE-th
        return next(asked) % SAMPLE_AGREE == 0 and strategy.any_rank(signals.is_set())
    text = ""
    if takes:
        log.print0(f"sampling {args.sample} tokens (--sample N; Ctrl-C stops it) ...")
        text = sample_text(model, data, args.sample, args.seed, stop=stop)
        log.print0("---- sample ----\n" + printable(text) + "\n----------------")
    else:                        # the same agreements, at the same tokens
        for _ in range(args.sample):
            if stop():
                break
    return text, strategy.any_rank(signals.is_set()), strategy.any_rank(signals.interrupted())
