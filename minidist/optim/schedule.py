"""Learning-rate schedules: linear warmup, then cosine decay to a floor (the default), or
warmup-stable-decay (--lr-schedule wsd).

cosine
    step < warmup:           lr * (step + 1) / warmup
    warmup <= step < total:  min_lr + (lr - min_lr) * (1 + cos(pi * progress)) / 2,
                             progress = (step - warmup) / (total - warmup)
    step >= total:           min_lr
warmup-stable-decay (MiniCPM, Hu et al. 2024; the 1-sqrt cooldown of Hagele et al. 2024)
    step < warmup:           lr * (step + 1) / warmup
    step < total - decay:    lr                                   the stable phase
    step < total:            min_lr + (lr - min_lr) * (1 - sqrt(progress)),
                             progress = (step - (total - decay) + 1) / decay
    step >= total:           min_lr
Cosine's rate at every step depends on the run's length; WSD's does only in the last `decay`
steps, so a run saved before its decay began can be extended (--resume with a larger --steps)
into exactly the run that longer --steps would have trained from the start
(tests/test_train_resume.py). Both are pure functions of the step: a resumed run needs nothing but
the step.
Tests: tests/test_optim.py.
"""
import math


def warmup_cosine(step, lr, warmup, total, min_lr=0.0):
    """The learning rate for optimizer step `step` (0-based)."""
    if step < warmup:
        return lr * (step + 1) / warmup
    if step >= total:
        return min_lr
    progress = (step - warmup) / max(1, total - warmup)
    return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


class WarmupCosine:
    """`schedule(step)` -> lr; the parameters of `warmup_cosine` held together."""

    def __init__(self, lr, warmup, total, min_lr=0.0):
        self.lr, self.warmup, self.total, self.min_lr = lr, warmup, total, min_lr

    def __call__(self, step):
        return warmup_cosine(step, self.lr, self.warmup, self.total, self.min_lr)


def warmup_stable_decay(step, lr, warmup, total, decay, min_lr=0.0):
    """The learning rate for optimizer step `step` (0-based): warmup, lr until the last
    `decay` steps of `total`, then down to min_lr along 1 - sqrt, reached at step total - 1."""
    if step < warmup:
        return lr * (step + 1) / warmup
    if step >= total:
        return min_lr
    start = total - decay
    if step < start:
        return lr
    progress = (step - start + 1) / decay
    return min_lr + (lr - min_lr) * (1.0 - math.sqrt(progress))


class WarmupStableDecay:
    """`schedule(step)` -> lr; the parameters of `warmup_stable_decay` held together."""

    def __init__(self, lr, warmup, total, decay, min_lr=0.0):
        self.lr, self.warmup, self.total, self.decay = lr, warmup, total, decay
        self.min_lr = min_lr

    def __call__(self, step):
        return warmup_stable_decay(step, self.lr, self.warmup, self.total, self.decay,
                                   self.min_lr)
