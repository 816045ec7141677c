"""Optimizers, the learning-rate schedule and gradient clipping.

    from minidist.optim import AdamW, SGD, adamw_update, sgd_update, clip_grad_norm, WarmupCosine

Tests: tests/test_optim.py.
"""
from minidist.optim.optimizer import Optimizer, wants_decay
from minidist.optim.adamw import AdamW, adamw_update
from minidist.optim.sgd import SGD, sgd_update
from minidist.optim.schedule import WarmupCosine, warmup_cosine
from minidist.optim.clip import clip_grad_norm, local_sum_sq

__all__ = ["Optimizer", "wants_decay", "AdamW", "adamw_update", "SGD", "sgd_update",
           "WarmupCosine", "warmup_cosine", "clip_grad_norm", "local_sum_sq"]
