"""FlatAdamW: AdamW over one flat buffer per parameter group, one update call per group.

AdamW (adamw.py) runs `adamw_update`, ~11 array operations, once per parameter: the default
4-layer GPT has 52 parameters, so ~570 small operations a step (on a GPU as many kernel
launches). Here each parameter group (AdamW's default split: decayed matrices in one, biases,
LayerNorm and embedding weights in the other, so decay needs no mask) is one contiguous
buffer, as a ZeRO FlatUnit is (minidist/zero/flat.py):

    flat param    every Parameter's .data becomes a view into its group's buffer
    flat m, v     each parameter's state entries (state[name]["exp_avg"], ...) are views into
                  them, so state_dict, checkpoints and the memory ledger read as AdamW's do
    flat grad     step() copies each .grad into its slot (one copy per parameter), then runs
                  adamw_update once over the whole group: ~11 operations per group, or on CuPy
                  with the kernels on, one fused kernel launch per group (adamw.py). Made by
                  the first step that gathers: a run that never does holds none

With MINIDIST_CUDA_NEW_KERNELS=1 on cupy (proven on the CPU only) the copies go too: one
multi_adamw launch per group reads each .grad where it lies (optim/multi_tensor.py), and no
flat gradient is ever allocated.

The cost: a flat gradient buffer per group, and for the xp update a scratch buffer (4 + 4
bytes per float32 parameter, in the ledger's "grads" once allocated; the fused kernel needs
no scratch, the multi path neither).
DDP's gradients are already views into flat buckets, ZeRO's optimizer already updates flat
shards (minidist/zero/optim.py); this is the single-process (and DDP) counterpart.

Exactness: the same elementwise formula on the same elements, so bitwise AdamW's. A group
falls back to AdamW's per-parameter update (on the views) for a step where a parameter has no
gradient (AdamW skips it and its step count) or the step counts differ (state loaded from such
a run). A parameter whose .data was rebound (Module.load_state_dict gives it a new array) is
copied back into the buffer before the step, and .data points at its view again.
Tests: tests/test_flat_adamw.py.
"""
from minidist.backend import xp_of
from minidist.optim import multi_tensor
from minidist.optim.adamw import AdamW, adamw_update, fused_adamw_ok


class FlatGroup:
    """One parameter group's flat param, grad, m and v buffers and each parameter's views."""

    def __init__(self, names, params):
        kinds = {(p.data.dtype, type(p.data)) for p in params}
        if len(kinds) != 1:
            raise ValueError(f"FlatAdamW: a group mixes array types {sorted(map(str, kinds))}"
                             f" (parameters {names[:4]}...); use AdamW")
        self.names, self.params = list(names), list(params)
        xp, dtype = xp_of(params[0].data), params[0].data.dtype
        size = sum(p.data.size for p in params)
        self.param = xp.empty(size, dtype)
        self.exp_avg, self.exp_avg_sq = xp.zeros(size, dtype), xp.zeros(size, dtype)
        self.grad = self.grad_views = None    # the first gather_grads makes them (the
        #                                       multi path never gathers)
        self.scratch = None           # the xp update's temporary; the fused kernel needs none
        self.slots, offset = [], 0                # (start, end, shape) per parameter
        for p in params:
            self.slots.append((offset, offset + p.data.size, p.data.shape))
            offset += p.data.size
        self.param_views = [self.view(self.param, i) for i in range(len(params))]
        self.attach()

    def view(self, buffer, i):
        """Parameter i's slot of a flat buffer, in the parameter's shape."""
        a, b, shape = self.slots[i]
        return buffer[a:b].reshape(shape)

    def attach(self):
        """Every parameter's .data is its view of the flat buffer (copied in if rebound)."""
        for p, view in zip(self.params, self.param_views):
            if p.data is not view:
                view[...] = p.data
                p.data = view

    def gather_grads(self):
        """Each parameter's .grad copied into its slot of the flat gradient, which the first
        call allocates."""
        if self.grad is None:
            self.grad = xp_of(self.param).empty_like(self.param)
            self.grad_views = [self.view(self.grad, i) for i in range(len(self.params))]
        for p, view in zip(self.params, self.grad_views):
            view[...] = p.grad


class FlatAdamW(AdamW):
    """AdamW, one flat buffer per parameter group. Same arguments, same results."""

    def __init__(self, params, lr=None, betas=None, eps=None, weight_decay=None):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self.flats = [FlatGroup(g["names"], g["params"]) for g in self.param_groups]
        self._point_state_at_flats()

    def _point_state_at_flats(self):
        """state[name]'s m and v become views of the flat m and v (values kept; zeros and
        step 0 for a parameter without state)."""
        for flat in self.flats:
            for i, name in enumerate(flat.names):
                s = self.state.setdefault(name, {"step": 0})
                for key, buffer in (("exp_avg", flat.exp_avg), ("exp_avg_sq", flat.exp_avg_sq)):
                    view = flat.view(buffer, i)
                    if key in s:
                        view[...] = s[key]
                    else:
                        view.fill(0)
                    s[key] = view

    def step(self):
        """Update every group: one adamw_update over its flat buffer, or per parameter on the
        views when a gradient is missing or the step counts differ."""
        self.check_has_gradients()
        for group, flat in zip(self.param_groups, self.flats):
            flat.attach()
            states = [self.state[n] for n in flat.names]
            steps = {s["step"] for s in states}
            if len(steps) != 1 or any(p.grad is None for p in flat.params):
                self._step_each(group, flat)
                continue
            for s in states:
                s["step"] += 1
            if self._multi_step(group, flat, states):
                continue
            flat.gather_grads()
            beta1, beta2 = group["betas"]
            fused = fused_adamw_ok(flat.param, flat.grad, flat.exp_avg, flat.exp_avg_sq)
            if flat.scratch is None and not fused:
                flat.scratch = xp_of(flat.param).empty_like(flat.param)
            adamw_update(flat.param, flat.grad, flat.exp_avg, flat.exp_avg_sq, steps.pop() + 1,
                         group["lr"], beta1, beta2, group["eps"], group["weight_decay"],
                         scratch=flat.scratch)

    def _multi_step(self, group, flat, states):
        """On cupy with MINIDIST_CUDA_NEW_KERNELS=1: one multi_adamw launch over the views,
        reading each .grad where it is (no copy into the flat gradient). False otherwise."""
        grads = [p.grad for p in flat.params]
        if not multi_tensor.adamw_ok(flat.param_views, grads):
            return False
        multi_tensor.run(multi_tensor.group_adamw_launch(xp_of(flat.param), flat.param_views,
                                                         grads, states, group))
        return True

    def _step_each(self, group, flat):
        """AdamW's per-parameter update, on the views (parameters without .grad skipped)."""
        for name, p in zip(flat.names, flat.params):
            if p.grad is not None:
                self.state[name]["step"] += 1
                self.update(p.data, p.grad, self.state[name], group, name)

    def load_state_dict(self, sd):
        super().load_state_dict(sd)
        for flat in self.flats:
            flat.attach()
        self._point_state_at_flats()

    def ledger_arrays(self):
        """The flat gradient and scratch buffers, counted with the gradients."""
        return {"grads": [b for f in self.flats for b in (f.grad, f.scratch) if b is not None]}
