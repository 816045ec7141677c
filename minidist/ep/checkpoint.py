"""Checkpoints under expert parallelism, in one process's format (minidist/strategy/
checkpoint.py), so a run saved on any --ep (with DDP or ZeRO-k, with or without --tp and
--amp) resumes on any other, or on one process (examples/sample.py reads it as any other).

    whole_state        the data-parallel strategy's whole state of the dense parameters
                       (DDP: this rank's arrays; ZeRO: its shards and their AdamW moments
                       gathered over dp x ep to rank 0: minidist/zero/checkpoint.py
                       gather_whole), plus every expert and its optimizer state, gathered
                       over the ep group that holds dense rank 0 (mpi4py's object gather):
                       the whole model as one process holds it, on dense rank 0
    load_whole_state   the inverse: each rank keeps its own experts (and their AdamW state),
                       and hands the rest to the data-parallel strategy (ZeRO: its shards
                       cut from the whole arrays by name)
With --tp, TensorParallel (minidist/tp/strategy.py) calls these as its inner's and gathers
(shards) the tensor-parallel pieces around them, as for a pipeline's stages.
Tests: tests/scripts/ep_check.py (the +ckpt runs: resume bit-identical, one process
continues to 1e-10), tests/test_ep_exact.py.
"""
from minidist import backend
from minidist.ep.optim import DenseAndExperts
from minidist.nn.config import gpt_param_specs
from minidist.zero.checkpoint import gather_whole, load_whole


def expert_names(model):
    return [n for n, p in model.named_parameters() if p.expert_parallel]


def whole_state(strategy, model, optimizer):
    """(params, optimizer state_dict) of the whole model (every expert) as host arrays by
    name, in model order, on rank 0 of the dense group; (None, None) elsewhere. Collective
    over the dense group (ZeRO) and the ep group of dense rank 0."""
    zero = isinstance(optimizer, DenseAndExperts)
    params, sd = strategy.inner.whole_state(model, optimizer.dense if zero else optimizer)
    if zero:                       # the experts' shards gathered over edp to its rank 0
        experts = gather_whole(optimizer.experts, root=0)
    if strategy.edp.rank != 0:          # another replica's ep group (dp x cp: expert_groups)
        return None, None
    names = set(expert_names(model))
    if zero:
        mine = (experts[0], {n: s for n, s in experts[1]["state"].items() if n in names})
    else:
        mine = ({n: backend.to_host(p.data).copy() for n, p in model.named_parameters()
                 if n in names}, {n: s for n, s in sd["state"].items() if n in names})
    parts = strategy.group.gather_object(mine, root=0)
    if strategy.group.rank != 0:
        return None, None
    for expert_params, expert_state in parts:
        params.update(expert_params)
        sd["state"].update(expert_state)
    return {n: params[n] for n in gpt_param_specs(model.config) if n in params}, sd


def load_whole_state(strategy, model, optimizer, params, opt_sd):
    """This rank's part of whole arrays by name (`params`, `opt_sd` as checkpoint.load returns
    them; under --tp already cut to this rank's tp shards): its experts here, the rest to the
    data-parallel strategy. Collective over the dense group (ZeRO's all-gather). `optimizer`
    None: the parameters alone (ZeRO: into the dense and the experts' engines)."""
    here = [n for n, _ in model.named_parameters()]
    missing = [n for n in here if n not in params]
    if missing:
        raise KeyError(f"parameters missing: {missing[:6]}")
    experts = set(expert_names(model))
    state = {n: s for n, s in opt_sd["state"].items()
             if n in here or n not in params}             # (amp: the loss scaler kept)
    if strategy.expert_engine is None:         # DDP: no experts' engine
        strategy.inner.load_whole_state(model, optimizer, {n: params[n] for n in here},
                                        {"groups": opt_sd["groups"], "state": state})
        return
    dense = {n: s for n, s in state.items() if n not in experts}
    mine = (None, None) if optimizer is None else (optimizer.dense, optimizer.experts)
    strategy.inner.load_whole_state(model, mine[0], params,
                                    {"groups": opt_sd["groups"], "state": dense})
    # the experts always hold matrices (decay, AdamW's first group); biases (no decay, the
    # second) only with config.bias: the saved groups' hyperparameters in that order
    groups = opt_sd["groups"][:0 if mine[1] is None else len(mine[1].param_groups)]
    load_whole(params, {"groups": groups, "state": {n: s for n, s in state.items() if n in
                                                     experts or n not in params}},  # (scaler)
               mine[1], engine=strategy.expert_engine)   # this rank's shards; all-gather
