"""Learning-rate schedule: linear warmup, then cosine decay to a floor.

    step < warmup:           lr * (step + 1) / warmup
    warmup <= step < total:  min_lr + (lr - min_lr) * (1 + cos(pi * progress)) / 2,
                             progress = (step - warmup) / (total - warmup)
    step >= total:           min_lr
A pure function of the step, so a resumed run needs nothing but the step.
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
