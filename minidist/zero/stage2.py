"""ZeRO stage 2: stage 1 (minidist/zero/zero.py) with the gradients sharded too. When a
unit's last gradient is complete (grad hook), its gradients are copied into a transient
flat buffer and dropped, and its reduce-scatter starts (async) while backward goes on with
earlier blocks; when it is done, grad_shard += buffer[lo:hi] and the buffer goes. At most
`max_inflight` + 1 buffers are alive (the newest starts before the oldest is waited for):
the unit is the bucket, and no full gradient outlives its unit's backward. Hybrid sharding
(--zero-shard): each shard is averaged across the replicas as the step's last micro-batch
completes it. Stage 3 (minidist/zero/stage3.py) builds on this class.
Tests: tests/test_zero.py, tests/scripts/zero_check.py.
"""
import functools

from minidist.backend import xp_of
from minidist.zero.zero import ZeroStage1


class ZeroStage2(ZeroStage1):
    """+ gradients sharded: each unit reduce-scattered as soon as backward completes it."""
    stage = 2
    max_inflight = 2                 # reduce-scatters running before we wait for the oldest

    def _init_grads(self):
        for u in self.units if self.training else []:     # (--eval-only: none)
            u.grad_shard = xp_of(u.param_shard).zeros(u.flat.shard_size, u.flat.grad_dtype)
        self._inflight = []          # (unit, flat buffer, Work, last), oldest first; last:
                                     # issued in a step's last micro-batch (not deferring)
        self._across = {}            # hybrid: id(unit) -> its all-reduce across the replicas
        self._deferring = False      # inside accumulating() (stage 1's): not the last
        self._hooks = [p.register_grad_hook(functools.partial(self._grad_ready, u))
                       for u in self.units for p in u.flat.params]

    def zero_grad(self):
        self.grads_used = False
        for u in self.units:
            u.grad_shard.fill(0)
            for p in u.flat.params:
                p.grad = None

    def _grad_ready(self, u, p):
        """Autograd hook: p's gradient for this backward is complete. A backward after an
        optimizer step with no zero_grad since is refused: its gradients would be added to
        the shards the step read. Stage 1 and DDP take .grad = None from model.zero_grad()
        (PyTorch's habit) as zeros; here .grad is None already and only the engine's (the
        optimizer's) zero_grad empties the shards: the step after the first took both
        steps' gradients, silently."""
        if self.grads_used:
            raise RuntimeError(f"ZeRO-{self.stage}: a backward after the optimizer's step "
                               "without zero_grad(): the gradient shards still hold that "
                               "step's gradients and this backward would add to them (call "
                               "opt.zero_grad() or engine.zero_grad() after each step; "
                               "model.zero_grad() does not empty the shards)")
        self.unsynced = True
        u.ready += 1
        if u.ready == len(u.flat.params):
            self._reduce_scatter(u)

    def _reduce_scatter(self, u):
        """Copy u's gradients into a padded flat buffer, drop them, start the reduce-scatter:
        this rank receives buffer[lo:hi] averaged over the group."""
        f = u.flat
        buf = f.flatten([p.grad for p in f.params], dtype=f.grad_dtype)
        for p in f.params:
            p.grad = None
        u.ready = 0
        work = self.group.reduce_scatter(buf[f.lo:f.hi], buf, op="avg", async_op=True)
        self._inflight.append((u, buf, work, not self._deferring))
        self._note_transient()
        while len(self._inflight) > self.max_inflight:
            self._finish_oldest()

    def _finish_oldest(self):
        u, buf, work, last = self._inflight.pop(0)
        work.wait()
        if id(u) in self._across:
            raise RuntimeError(f"{u.flat.name}: reduce-scattered again after its all-reduce "
                               "across the replicas started (hybrid sharding: run the micro-"
                               "batches before a step's last under the strategy's no_sync())")
        u.grad_shard += buf[u.flat.lo:u.flat.hi]      # += : micro-batches accumulate
        if self.replicas is not None and last:
            self._start_across(u)                     # the last micro-batch: overlap it

    def _start_across(self, u):
        """Hybrid sharding: u's gradient shard averaged across the replicas, in the
        background (backward goes on with the blocks below)."""
        self._across[id(u)] = self._average_over_replicas(u)

    # accumulating() is stage 1's: here the micro-batches before the last still reduce-
    # scatter (a full gradient kept for later is what stage 2 exists to avoid), their shards
    # only adding up; the last one's start each unit's all-reduce across the replicas as
    # soon as the unit's shard is complete (_finish_oldest).

    def sync_grads(self):
        """Wait for every reduce-scatter backward started (and start any a hook did not)."""
        self.wait_params()           # (gather_group: a unit no forward used)
        for u in self.units:
            if any(p.grad is not None for p in u.flat.params):
                self._reduce_scatter(u)
        while self._inflight:
            self._finish_oldest()
        if self.replicas is not None:     # units backward did not finish: theirs start now
            for u in self.units:
                if id(u) not in self._across:
                    self._start_across(u)
            for work in self._across.values():
                work.wait()
            self._across = {}
        self.unsynced = False

    def _transient_bytes(self):
        return sum(buf.nbytes for _, buf, *_ in self._inflight)

    def _note_transient(self):
        self.transient_peak = max(self.transient_peak, self._transient_bytes())

    def held(self):
        return {"params": [u.full for u in self.units],
                "grads": [u.grad_shard for u in self.units]}
