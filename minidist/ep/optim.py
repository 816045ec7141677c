"""--ep with --zero k: ZeRO's sharded AdamW over the dense parameters and an AdamW over this
rank's experts, stepped as one optimizer with one global gradient norm (and, under --amp,
one loss-scale verdict).

The experts stay out of ZeRO's flat shards over the dense group (minidist/zero/flat.py: their
values differ from ep rank to ep rank, so a reduce-scatter over the dense group would mix
them); each rank keeps its experts whole and updates them with the same AdamW math. Clipping:
ZeRO's optimizer asks the strategy for the global sum of squares (its shards summed over
dp x ep, plus every expert's squares once, summed over ep: ExpertParallel.reduce_sum_sq); the
experts are scaled by the factor of that same norm.

Mixed precision (--amp): the experts' optimizer is a MasterWeightOptimizer (float32 masters
of the 16-bit experts, minidist/train/amp.py), built before ZeRO's (which empties the cast's
masters: it keeps shards only). ZeRO's clip takes the verdict on the global norm (the experts'
unscaled squares included, so an inf or nan in any expert's gradient on any rank is in every
rank's norm); the experts take the same factor (LossScaler.verdict) and step only if ZeRO's
step did (the scaler is updated once, by ZeRO's step).
Tests: tests/scripts/ep_check.py (runs ep2xdp2+zero1/2/3, ep2xtp2+zero*),
tests/test_expert_parallel.py (--amp with --zero against one process).
"""
from minidist.optim import AdamW
from minidist.optim.clip import clip_grad_norm


def experts_optimizer(experts, args, amp=None):
    """AdamW over `experts` ((name, Parameter) pairs), as one process's optimizer holds them:
    with `amp` (MixedPrecision, its cast_model run) over their float32 masters."""
    def adamw(named_params):
        return AdamW(named_params, lr=args.lr, betas=(0.9, 0.95),
                     weight_decay=args.weight_decay)
    return amp.optimizer(experts, adamw) if amp is not None else adamw(experts)


class DenseAndExperts:
    """`dense` (ShardedAdamW over ZeRO's shards) and `experts` (experts_optimizer's), used by
    the step as one optimizer: set_lr, clip_grad_norm, step, zero_grad."""

    def __init__(self, dense, experts, amp=None):
        self.dense, self.experts, self.amp = dense, experts, amp
        self._total = None              # the global sum of squares of this step's clip
        self._factor = None             # --amp: the experts' 1/S x clip factor

    def set_lr(self, lr):
        self.dense.set_lr(lr)
        self.experts.set_lr(lr)

    def zero_grad(self):
        self.dense.zero_grad()
        self.experts.zero_grad()

    def clip_grad_norm(self, max_norm, sum_sq_across_ranks=None):
        """The dense shards' clip (their sum of squares -> the strategy's global one), then the
        experts scaled by the same norm (--amp: given the same factor). Returns the norm."""
        def global_sum_sq(local):
            self._total = sum_sq_across_ranks(local)
            return self._total
        norm = self.dense.clip_grad_norm(max_norm, global_sum_sq)
        if self.amp is None:
            clip_grad_norm(self.experts.params, max_norm, lambda _: self._total)
        else:
            self._factor = self.amp.scaler.verdict(norm, max_norm)[1]
        return norm

    def step(self):
        """ZeRO's step, then the experts'. Returns False when --amp skipped the step (inf/nan
        in the global norm: every rank skips alike)."""
        if self.amp is not None and self._factor is None:
            raise RuntimeError("DenseAndExperts: clip_grad_norm (the loss-scale verdict) "
                               "must come before step under --amp")
        if not self.dense.step():
            self._factor = None
            return False
        if self.amp is None:
            self.experts.step()
        else:
            self.experts.update_masters(self._factor)
        self._factor = None
        return True

    def state_arrays(self):
        yield from self.dense.state_arrays()
        yield from self.experts.state_arrays()

    def ledger_arrays(self):
        return self.dense.ledger_arrays()
