"""--ep with --zero k: the experts' optimizer state sharded over their replicas too, and one
optimizer over both ZeRO engines, with one global gradient norm (and, under --amp, one
loss-scale verdict).

The experts cannot join ZeRO's flat shards over the dense group D = dp x ep (minidist/zero/
flat.py leaves them out: their values differ from ep rank to ep rank, so a reduce-scatter
over D would mix them). But each expert is replicated over its edp group (its dp replicas),
and that is where ZeRO applies to it: `expert_engine` lays each MoE block's local experts end
to end in a FlatUnit over edp and shards them with ZeRO-1 (minidist/zero/zero.py
ZeroStage1): each edp rank keeps 1/dp of the experts' AdamW moments (and float32 masters
under --amp); their gradients are reduce-scattered over edp instead of all-reduced (then
divided by ep: ExpertParallel.sync_grads), and the updated shards all-gathered after the
step: the same bytes as the all-reduce. The experts' gradients and parameters stay whole
(stage 1 semantics) at every --zero k.

    rank holds          dense parameters (D = dp x ep)       this rank's E/ep experts
    parameters          ZeRO-k (k = 3: 1/|D|)                whole
    gradients           ZeRO-k (k >= 2: 1/|D|)               whole, reduce-scattered over edp
    optimizer state     1/|D|                                1/dp (its edp shard)

Clipping: each rank's sum of squares is its dense shards' plus its expert shards'; one sum
over D counts every element once (D = ep x edp, and the edp shards of one ep rank's experts
are disjoint): ExpertParallel.reduce_sum_sq. Both optimizers are scaled by that norm.
Mixed precision (--amp): ZeRO's clip over the dense shards takes the verdict on the global
norm (an inf or nan anywhere is in every rank's sum); the experts take the same factor
(LossScaler.verdict) and step only if ZeRO's step did (the scaler is updated once).
Tests: tests/scripts/ep_check.py (runs ep2xdp2+zero1/2/3, ep2xtp2+zero*, +amp, +ckpt),
tests/test_ep_exact.py.
"""
from minidist.optim.clip import clip_grad_norm
from minidist.tp.state import unscaled_sum_sq
from minidist.zero.flat import FlatUnit
from minidist.zero.engine import zero_engine
from minidist.zero.strategy import sharded_optimizer


def expert_engine(model, edp, training=True):
    """ZeRO-1 over `edp` (the replicas of this rank's experts) of this rank's experts: one
    flat unit per MoE block (`training` False, --eval-only: no gradient buffers). Collective
    over edp (it broadcasts rank 0's values)."""
    units = [FlatUnit(f"{block}.experts", named, edp.size, edp.rank)
             for block, named in expert_blocks(model).items()]
    return zero_engine(model, edp, 1, units, training=training)


def expert_blocks(model):
    """{MoE block's name: [(name, Parameter) of this rank's experts in it]}, in model order."""
    blocks = {}
    for n, p in model.named_parameters():
        if p.expert_parallel:
            blocks.setdefault(n.split(".mlp.experts.")[0], []).append((n, p))
    return blocks


def experts_optimizer(engine, args, amp=None, views=None):
    """AdamW (or --optimizer muon's Muon) over the experts' shards (its float32 masters
    under --amp), as ZeRO's: on cupy with MINIDIST_CUDA_NEW_KERNELS=1 AdamW's two
    multi-tensor launches too (tests/test_zero_multi_cpu.py)."""
    return sharded_optimizer(engine, args, amp, views)


class DenseAndExperts:
    """`dense` (ShardedAdamW or ShardedMuon over ZeRO's shards over dp x ep) and `experts`
    (the same kind over expert_engine's shards over edp), used by the step as one optimizer:
    set_lr, clip_grad_norm, step, zero_grad."""

    def __init__(self, dense, experts, amp=None):
        self.dense, self.experts, self.amp = dense, experts, amp
        self._total = None              # the global sum of squares of this step's clip
        self._factor = None             # --amp: the experts' 1/S x clip factor

    def set_lr(self, lr):
        self.dense.set_lr(lr)
        self.experts.set_lr(lr)

    def hyperparameters(self):
        """(the dense optimizer's, the experts')"""
        return self.dense.hyperparameters(), self.experts.hyperparameters()

    def set_hyperparameters(self, groups):
        dense, experts = groups
        self.dense.set_hyperparameters(dense)
        self.experts.set_hyperparameters(experts)

    def zero_grad(self):
        self.dense.zero_grad()
        self.experts.zero_grad()

    def clip_grad_norm(self, max_norm, sum_sq_across_ranks=None):
        """The dense shards' clip (their sum of squares, the expert shards' added, -> the
        strategy's global one), then the expert shards scaled by the same norm (--amp: given
        the same factor). This rank's sum holds every array it steps with, as the strategies'
        reduce_sum_sq take it (under --tp, TensorParallel subtracts the replicated ones,
        experts included, to count them once over tp). Returns the norm."""
        shards = [u.grad_shard for u in self.experts.engine.units]

        def global_sum_sq(local):
            experts = unscaled_sum_sq(shards, self.amp)
            self._total = sum_sq_across_ranks(local + experts)
            return self._total
        norm = self.dense.clip_grad_norm(max_norm, global_sum_sq)
        if self.amp is None:
            clip_grad_norm(shards, max_norm, lambda _: self._total)
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
        self.experts.update_shards(self._factor)
        self._factor = None
        return True

    def state_arrays(self):
        yield from self.dense.state_arrays()
        yield from self.experts.state_arrays()

    def ledger_arrays(self):
        """Both engines' parameter and gradient buffers (the memory ledger)."""
        dense, experts = self.dense.ledger_arrays(), self.experts.ledger_arrays()
        return {k: list(dense.get(k, [])) + list(experts.get(k, []))
                for k in ("params", "grads")}
