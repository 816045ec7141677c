"""Optimizers, the learning-rate schedules and gradient clipping.

    from minidist.optim import AdamW, FlatAdamW, SGD, adamw_update, sgd_update, clip_grad_norm
    from minidist.optim import WarmupCosine, WarmupStableDecay

Tests: tests/test_optim.py, tests/test_flat_adamw.py.
"""
from minidist.optim.optimizer import Optimizer, wants_decay
from minidist.optim.adamw import AdamW, adamw_update
from minidist.optim.flat_adamw import FlatAdamW
from minidist.optim.sgd import SGD, sgd_update
from minidist.optim.schedule import (WarmupCosine, WarmupStableDecay, warmup_cosine,
                                     warmup_stable_decay)
from minidist.optim.clip import clip_grad_norm, local_sum_sq

__all__ = ["Optimizer", "wants_decay", "AdamW", "FlatAdamW", "adamw_update", "SGD",
           "sgd_update", "WarmupCosine", "warmup_cosine", "WarmupStableDecay",
           "warmup_stable_decay", "clip_grad_norm", "local_sum_sq"]
