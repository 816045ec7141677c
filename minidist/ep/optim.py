"""--ep with --zero k: ZeRO's sharded AdamW over the dense parameters and a plain AdamW over
this rank's experts, stepped as one optimizer with one global gradient norm.

The experts stay out of ZeRO's flat shards (minidist/zero/flat.py: their values differ from
ep rank to ep rank, so a reduce-scatter over the dense group would mix them); each rank keeps
its experts whole and updates them with the same AdamW math. Clipping: ZeRO's optimizer asks
the strategy for the global sum of squares (its shards summed over dp x ep, plus every
expert's squares once, summed over ep: ExpertParallel.reduce_sum_sq); the experts are scaled
by the factor of that same norm.
Tests: tests/scripts/ep_check.py (runs ep2xdp2+zero1/2/3).
"""
from minidist.optim import AdamW
from minidist.optim.clip import clip_grad_norm


class DenseAndExperts:
    """`dense` (ShardedAdamW over ZeRO's shards) and an AdamW over `experts` ((name, Parameter)
    pairs), used by the step as one optimizer: set_lr, clip_grad_norm, step, zero_grad."""

    def __init__(self, dense, experts, args):
        self.dense = dense
        self.experts = AdamW(experts, lr=args.lr, betas=(0.9, 0.95),
                             weight_decay=args.weight_decay)
        self._total = None

    def set_lr(self, lr):
        self.dense.set_lr(lr)
        self.experts.set_lr(lr)

    def zero_grad(self):
        self.dense.zero_grad()
        self.experts.zero_grad()

    def clip_grad_norm(self, max_norm, sum_sq_across_ranks=None):
        """The dense shards' clip (their sum of squares -> the strategy's global one), then the
        experts scaled by the same norm. Returns the global norm."""
        def global_sum_sq(local):
            self._total = sum_sq_across_ranks(local)
            return self._total
        norm = self.dense.clip_grad_norm(max_norm, global_sum_sq)
        clip_grad_norm(self.experts.params, max_norm, lambda _: self._total)
        return norm

    def step(self):
        self.dense.step()
        self.experts.step()

    def state_arrays(self):
        yield from self.dense.state_arrays()
        yield from self.experts.state_arrays()

    def ledger_arrays(self):
        return self.dense.ledger_arrays()
