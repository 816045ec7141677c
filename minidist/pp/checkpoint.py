"""Checkpoints of a pipeline: the stages' parts gathered into the whole model, written in the
one-process format (minidist/train/checkpoint.py), and read back by every stage.

    save   each stage's parameters and optimizer state as whole arrays (gathered over tp when
           the stage is tensor-parallel), sent to stage 0 of the first replica, merged in
           model order (the tied wte, on the first and last stage and equal, kept once) and
           written by world rank 0; each stage's dropout generator is kept too, so --resume
           continues every stage's own stream
    load   every rank reads the whole checkpoint and keeps its own parameters and optimizer
           state (its tp shard of them), so a checkpoint from any pp x tp x dp layout resumes
           on any other, or on one process
Tests: tests/test_pipeline.py (resume with dropout), tests/scripts/pp_check.py (--files).
"""
import copy

from minidist import backend
from minidist.train import checkpoint


def _stage_state(strategy, optimizer):
    """This stage's parameters and optimizer state as whole host arrays (collective over tp
    when the stage is tensor-parallel)."""
    if strategy.tp is not None:
        return (strategy.stage.full_state_dict(),
                strategy.tp._gather_optimizer(optimizer.state_dict()))
    return ({n: backend.to_host(a).copy() for n, a in strategy.stage.state_dict().items()},
            optimizer.state_dict())


def merge_stages(parts):
    """The stages' (params, optimizer state_dict, ...) in stage order -> the whole model's,
    in model order. The tied wte is on the first and last stage, equal: kept once."""
    params, state = {}, {}
    for p, sd, *_ in parts:
        for name, a in p.items():
            params.setdefault(name, a)
        for name, s in sd["state"].items():
            state.setdefault(name, s)
    return params, {"groups": parts[0][1]["groups"], "state": state}


def save(strategy, directory, model, optimizer, step, rng_states, extra):
    params, opt_sd = _stage_state(strategy, optimizer)
    mesh, pp = strategy.mesh, strategy.group
    if mesh.dp_rank == 0 and mesh.tp_rank == 0:
        mine = (params, opt_sd, model.dropout_rng.bit_generator.state)
        parts = pp.comm.gather(mine, root=0)                # in stage order
        if pp.rank == 0:            # each stage's own dropout stream, for --resume
            rng_states = {**rng_states, "dropout_by_stage": [p[2] for p in parts]}
            params, opt_sd = merge_stages(parts)
            checkpoint.save_checkpoint(
                directory, _with(model, state_dict=lambda: params),
                _with(optimizer, state_dict=lambda: opt_sd), step, rng_states, extra)
    mesh.world.barrier()            # nobody reads it half-written


def load(strategy, directory, model, optimizer):
    """Every rank reads the whole checkpoint and keeps its stage's (and tp shard's) part;
    returns the state.json dict with "rng"/"dropout" this stage's own generator."""
    mine, tp = {n for n, _ in model.named_parameters()}, strategy.tp

    def load_params(state, strict=True):
        state = {n: a for n, a in state.items() if n in mine}
        if strict and set(state) != mine:
            raise KeyError(f"parameters missing: {sorted(mine - set(state))[:6]}")
        (model.load_full_state_dict if tp is not None else model.load_state_dict)(state)

    def load_opt(sd):
        sd = {"groups": sd["groups"],
              "state": {n: s for n, s in sd["state"].items() if n in mine}}
        optimizer.load_state_dict(tp._shard_optimizer(sd) if tp is not None else sd)
    state = checkpoint.load_checkpoint(directory, _with(model, load_state_dict=load_params),
                                       _with(optimizer, load_state_dict=load_opt))
    by_stage = state["rng"].get("dropout_by_stage")
    if by_stage and len(by_stage) == strategy.group.size:   # the loop restores "dropout"
        state["rng"]["dropout"] = by_stage[strategy.group.rank]
    return state


def _with(obj, **methods):
    """A shallow copy of `obj` with some methods replaced (same class, same name)."""
    view = copy.copy(obj)
    view.__dict__.update(methods)
    return view
