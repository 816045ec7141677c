"""Dynamic loss scaling for mixed precision (minidist/train/amp.py): the scale S the loss is
multiplied by before backward, and the verdict after it -- the global norm of the unscaled
gradients is not finite: an overflow somewhere, skip the step and halve S; else the factor
1/S x clip the step multiplies the 16-bit gradients by, and S doubles after `growth_interval`
good steps in a row. With bfloat16 (float32's exponent range) S = 1, fixed, and the check
stays. The scaler's state travels in the optimizer's checkpoint under SCALER_KEY.

On cupy with the multi-tensor kernels (MINIDIST_CUDA_NEW_KERNELS=1), MasterWeightOptimizer
and ZeRO's ShardedAdamW take the verdict on the device instead (MixedPrecision.
verdict_on_device, then decide_on_device here), so a step reads nothing back: the
scaler's fields then live in `device_state` (with AdamW's step count) until `settle()` reads
them back, once, at a step the loop reads its losses anyway.
Tests: tests/test_amp.py.
"""
import math

import numpy as np

from minidist import backend
from minidist.optim import multi_tensor
from minidist.optim.clip import clip_factor

SCALER_KEY = "loss_scaler"    # its entry in the optimizer state (checkpoints), beside params


class LossScaler:
    """Dynamic loss scale: halve it on an overflow, double it after `growth_interval` steps
    without one (`growth_interval=None`: a fixed scale, e.g. 1 for bfloat16).

    It starts at 2^12, not PyTorch's 2^16: there only activation gradients are float16, here
    the parameter gradients are too, and a bias or embedding gradient sums over every token of
    the batch, O(1-10) early in training, which times 2^16 passes float16's 65504 (the runs
    that showed it: minidist/train/README.md). The scale still grows when the gradients
    allow."""

    def __init__(self, init_scale=2.0 ** 12, growth_factor=2.0, backoff_factor=0.5,
                 growth_interval=2000, max_skips_in_a_row=50):
        self.scale = float(init_scale)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval, self.max_skips = growth_interval, max_skips_in_a_row
        self.good_steps = 0          # steps without an overflow since the last change
        self.skipped = 0             # steps skipped so far (all time)
        self.skips_in_a_row = 0
        self.used = False            # scale_loss ran since the last step (checked there)
        self.device_state = None     # multi_tensor.STATE_FIELDS on the device; see settle()

    def unscale_and_clip(self, sum_sq, max_norm, reduce_sum_sq, has_grads=True):
        """The one place --amp turns a sum of squares into a verdict, for every optimizer
        (MasterWeightOptimizer here, ZeRO's ShardedAdamW): `sum_sq`, this rank's sum of
        squares of its unscaled gradients, reduced over the ranks by the strategy's
        `reduce_sum_sq` -> (global norm, inf/nan found, the factor the 16-bit gradients are
        multiplied by in the step: 1/S, times the clip factor). Refuses gradients whose
        backward did not start from a scaled loss."""
        self.check_used(has_grads)
        sum_sq = reduce_sum_sq(sum_sq) if reduce_sum_sq is not None else sum_sq
        # The one host read of an --amp step: skipping is a Python decision (a skipped step
        # advances neither AdamW's step counts nor the scaler's, and the next step's loss
        # scale is a host number), as in PyTorch's GradScaler without a capturable optimizer.
        sum_sq = float(backend.host_read(sum_sq, "amp overflow verdict"))
        norm = math.sqrt(sum_sq) if sum_sq >= 0 else math.nan
        return (norm, *self.verdict(norm, max_norm))

    def check_used(self, has_grads=True):
        """Refuse gradients whose backward did not start from a scaled loss; reset the mark."""
        if has_grads and not self.used:
            raise RuntimeError("mixed precision: backward did not start from a scaled loss "
                               "(the strategy must call MixedPrecision.scale_loss)")
        self.used = False

    def live_scale(self):
        """The loss scale S now: a float; with a dynamic scale kept on the device, a 0-d
        float64 array there (no host read)."""
        if self.device_state is not None and self.growth_interval is not None:
            return self.device_state[0]
        return self.scale

    def multiplier(self, factor=1.0):
        """What a loss is multiplied by before backward: S x factor (live_scale)."""
        return self.live_scale() * factor

    def verdict(self, norm, max_norm):
        """(inf/nan found, the factor the 16-bit gradients are multiplied by in the step) for
        the global unscaled `norm` (a float): 1/S times the clip factor. For an optimizer
        that steps a second set of parameters by the norm unscale_and_clip measured
        (minidist/ep/optim.py)."""
        found_inf = not math.isfinite(norm)
        return found_inf, (1.0 if found_inf else clip_factor(norm, max_norm)) / self.scale

    def update(self, found_inf):
        """Record this step's verdict; returns True if the optimizer should step."""
        if found_inf:
            self.skipped += 1
            self.skips_in_a_row += 1
            self.good_steps = 0
            if self.growth_interval is not None:
                self.scale *= self.backoff_factor
            self.check_skips()
            return False
        self.skips_in_a_row = 0
        self.good_steps += 1
        if self.growth_interval is not None and self.good_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0
        return True

    def check_skips(self):
        """Raise FloatingPointError after max_skips_in_a_row skipped steps in a row."""
        if self.skips_in_a_row >= self.max_skips:
            raise FloatingPointError(
                f"{self.skips_in_a_row} steps in a row had inf/nan gradients (loss scale "
                f"now {self.scale:g}): the loss or the model has diverged, not overflowed")

    # ---- the verdict on the device (MasterWeightOptimizer's multi-tensor path) ------------
    def to_device(self, xp, step):
        """The state as a float64 array on xp's device (multi_tensor.STATE_FIELDS, with
        AdamW's step count `step`), which the verdict kernel updates in place from now on;
        the host fields are stale until settle(). Made once per stretch on the device."""
        if self.device_state is None:
            self.device_state = xp.asarray(np.array(
                [self.scale, self.good_steps, self.skipped, self.skips_in_a_row, step, 0.0]))
        return self.device_state

    def inverse(self):
        """1/S (live_scale), what 16-bit gradients are multiplied by to unscale them. S is a
        power of two, so it is exact on the host and on the device."""
        return 1.0 / self.live_scale()

    def decide_on_device(self, sum_sq, max_norm, reduce_sum_sq, half, group):
        """The verdict taken on the device, for an optimizer whose update kernels read it
        (multi_amp_adamw_dev), once the state is on the device (to_device) and `sum_sq` is
        this rank's unscaled sum of squares (MixedPrecision.verdict_on_device does both, for
        MasterWeightOptimizer and ZeRO's ShardedAdamW): the sum reduced over
        the ranks by `reduce_sum_sq` on the device, then amp_verdict (one thread) with
        `group`'s lr, betas and eps; `half` the 16-bit dtype. Returns (verdict, the norm):
        a float32 and a 0-d float64 device array."""
        xp, state = backend.xp_of(self.device_state), self.device_state
        if reduce_sum_sq is not None:
            sum_sq = reduce_sum_sq(sum_sq)
        sum_sq = xp.ascontiguousarray(xp.asarray(sum_sq, dtype=np.float64).reshape(1))
        verdict = xp.empty(multi_tensor.VERDICT_SIZE, np.float32)
        multi_tensor.run((multi_tensor.amp_verdict_launch(
            sum_sq, state, verdict, half, max_norm, self, group["lr"], *group["betas"],
            group["eps"]), None))
        return verdict, state[multi_tensor.STATE_FIELDS.index("norm")].copy()

    def settle(self):
        """Read a device stretch's state back (ONE host read): the scale and counts, then
        check_skips. Returns AdamW's step count, or None when nothing was on the device."""
        if self.device_state is None:
            return None
        state = backend.host_read(self.device_state, "amp verdicts (settle)")
        self.device_state = None
        self.scale = float(state[0])
        self.good_steps, self.skipped, self.skips_in_a_row, step = (int(x) for x in state[1:5])
        self.check_skips()
        return step

    def state_dict(self):
        if self.device_state is not None:
            raise RuntimeError("LossScaler.state_dict: the state is on the device; its "
                               "optimizer settles it first (MasterWeightOptimizer.settle)")
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped": self.skipped}

    def load_state_dict(self, sd):
        self.device_state = None
        self.scale = float(sd["scale"])
        self.good_steps, self.skipped = int(sd["good_steps"]), int(sd["skipped"])
