"""The optimizer base: parameter groups, per-parameter state, zero_grad, state_dict.

An optimizer takes
  - a list of Parameters,
  - a list of (name, Parameter) pairs (`model.named_parameters()`): state is then saved by
    name, so a checkpoint is readable and survives reordering, or
  - a list of groups, dicts {"params": [...], "lr": ..., ...} overriding the defaults.
Subclasses implement `update(p, grad, state, group, name)` on raw arrays, and may finish a
group's updates in `end_group(group)` (Muon's deferred ones); the math itself is a
plain function on arrays (`adamw_update`, `sgd_update`) that ZeRO applies to flat shards.
Tests: tests/test_optim.py.
"""
import re

import numpy as np

from minidist import backend
from minidist.backend import xp_of
from minidist.optim.clip import clip_grad_norm


class Optimizer:
    defaults = {}
    # True: one group given without its own weight_decay splits into a decayed group and an
    # undecayed one (biases, norms' gains: wants_decay), as AdamW's; a new optimizer sets it
    split_decay = False

    def __init__(self, params, **overrides):
        self.defaults = {**self.defaults, **overrides}
        self.param_groups = []
        for group in self._default_groups(_as_groups(params)):
            self.param_groups.append({**self.defaults, **group})
        self.state = {}                          # parameter name -> {state arrays, "step"}
        self._buffers = {}                       # scratch(): (role, shape, dtype) -> array
        names = [n for g in self.param_groups for n in g["names"]]
        if len(set(names)) != len(names):
            raise ValueError("a parameter appears twice in the optimizer's groups")

    def _default_groups(self, groups):
        return decay_groups(groups) if self.split_decay else groups

    # ---- the step --------------------------------------------------------------------------
    def step(self):
        """Update every parameter that has a gradient, in place."""
        self.check_has_gradients()
        for group in self.param_groups:
            self.step_group(group)

    def check_has_gradients(self):
        """A step where no parameter has a gradient would change nothing, silently: a
        RuntimeError saying where the gradients went (first-use walk 29: a plain AdamW
        beside a ZeRO-3 engine, whose gradients live in its shards, trained nothing)."""
        params = [p for group in self.param_groups for p in group["params"]]
        if params and all(p.grad is None for p in params):
            raise RuntimeError(
                f"{type(self).__name__}.step: no parameter has a gradient (.grad is None on "
                f"all {len(params)}): run loss.backward() before step(); under ZeRO "
                "(minidist.zero.engine.zero_engine) the gradients are the engine's shards: "
                "step with ShardedAdamW(engine, ...), not an optimizer of the model's "
                "parameters")

    def step_group(self, group):
        """One group's update, one parameter at a time (AdamW may do a group in one go), then
        end_group."""
        for name, p in zip(group["names"], group["params"]):
            if p.grad is None:
                continue
            state = self.state.setdefault(name, {"step": 0})
            state["step"] += 1
            self.update(p.data, p.grad, state, group, name)
        self.end_group(group)

    def update(self, p, grad, state, group, name=None):
        """One parameter's update in place; `name` its name (Muon looks up its tp split)."""
        raise NotImplementedError

    def end_group(self, group):
        """After a group's updates, what they left to do: nothing here; Muon's tp-split
        matrices, whose updates land at their block's end (minidist/optim/muon.py). Whoever
        calls update() for a group calls this after its last one."""

    def scratch(self, p, role="update"):
        """A reusable temporary like `p` (its shape, dtype and device), one per role: a step
        allocates nothing after the first."""
        key = (role, p.shape, p.dtype.str, type(p).__module__)
        if key not in self._buffers:
            self._buffers[key] = xp_of(p).empty_like(p)
        return self._buffers[key]

    def clip_grad_norm(self, max_norm, sum_sq_across_ranks=None):
        """`clip_grad_norm` over this optimizer's gradients; returns the norm before clipping.
        The loop calls this method so that an optimizer whose gradients are not plain float
        arrays (mixed precision: scaled float16, minidist/train/amp.py) can unscale first."""
        return clip_grad_norm(self.params, max_norm, sum_sq_across_ranks)

    def zero_grad(self):
        """Drop gradients (None, not zeros: no memory held, and the first += is a copy)."""
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None

    def set_lr(self, lr):
        for group in self.param_groups:
            group["lr"] = lr

    def hyperparameters(self):
        """Each group's settings (lr, betas, weight decay, ...; not its parameters): what a
        checkpoint's "groups" hold."""
        return [{k: v for k, v in g.items() if k not in ("params", "names")}
                for g in self.param_groups]

    def set_hyperparameters(self, groups):
        """Each group's settings from `groups` (hyperparameters()'s form). A resumed run puts
        back its flags' after the load, which set the checkpoint's (train/resume.py)."""
        for group, settings in zip(self.param_groups, groups):
            group.update(settings)

    @property
    def params(self):
        return [p for g in self.param_groups for p in g["params"]]

    # ---- state -----------------------------------------------------------------------------
    def state_arrays(self):
        """Every array the optimizer holds (for the memory ledger)."""
        for state in self.state.values():
            yield from (v for v in state.values() if hasattr(v, "nbytes"))

    def state_dict(self):
        """{"groups": hyperparameters per group (no params), "state": {name: {key: host
        array or int}}}: JSON for the groups, arrays for the state."""
        groups = self.hyperparameters()
        state = {n: {k: (backend.to_host(v).copy() if hasattr(v, "shape") else v)
                     for k, v in s.items()} for n, s in self.state.items()}
        return {"groups": groups, "state": state}

    def load_state_dict(self, sd):
        if len(sd["groups"]) != len(self.param_groups):
            raise ValueError(f"optimizer state has {len(sd['groups'])} groups, this "
                             f"optimizer {len(self.param_groups)}")
        params = {n: p for g in self.param_groups for n, p in zip(g["names"], g["params"])}
        unknown = [n for n in sd["state"] if n not in params]
        if unknown:
            unnamed = [n for n in (unknown + list(params)) if re.fullmatch(r"param\d+", n)]
            raise ValueError(f"optimizer state for unknown parameters {unknown[:6]}" + (
                "; one side was built from parameters() without names (param0, param1, "
                "...): build the optimizer from model.named_parameters(), as the strategies "
                "and their checkpoints do" if unnamed else ""))
        self.set_hyperparameters(sd["groups"])
        self.state = {}
        for name, s in sd["state"].items():
            p = params[name].data
            self.state[name] = {k: (_like(v, p, name, k) if hasattr(v, "shape") else int(v))
                                for k, v in s.items()}


def _like(value, p, name, key):
    if tuple(value.shape) != tuple(p.shape):
        raise ValueError(f"optimizer state {name}.{key} has shape {tuple(value.shape)}, "
                         f"the parameter {tuple(p.shape)}")
    return backend.xp_of(p).array(backend.to_device(value, backend.xp_of(p)), dtype=p.dtype)


def _as_groups(params):
    """Normalise the three accepted forms to [{"params": [...], "names": [...], ...}]."""
    params = list(params)
    if not params:
        raise ValueError("optimizer got an empty parameter list")
    if not isinstance(params[0], dict):
        params = [{"params": params}]
    groups, count = [], 0
    for g in params:
        g = dict(g)
        items = list(g["params"])
        names = []
        for item in items:
            names.append(item[0] if isinstance(item, tuple) else f"param{count}")
            count += 1
        g["params"] = [item[1] if isinstance(item, tuple) else item for item in items]
        g["names"] = names
        groups.append(g)
    return groups


def decay_groups(groups):
    """One group given without its own weight_decay -> [the parameters that want decay,
    those that do not (weight_decay 0.0)], empty ones left out; other groups as given."""
    if len(groups) != 1 or "weight_decay" in groups[0]:
        return groups
    g = groups[0]
    pairs = list(zip(g["names"], g["params"]))
    split = [{**g, "names": [n for n, p in pairs if wants_decay(p) == want],
              "params": [p for n, p in pairs if wants_decay(p) == want]}
             for want in (True, False)]
    split[1]["weight_decay"] = 0.0
    return [s for s in split if s["params"]]


def wants_decay(p):
    """Default weight-decay rule: a Parameter's own `decay` flag (False on biases, LayerNorm
    and embedding weights), else decay matrices (ndim >= 2) only."""
    return bool(getattr(p, "decay", np.ndim(p.data) >= 2))
