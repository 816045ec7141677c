"""Checkpoints of a pipeline: the stages' parts gathered into the whole model and written in
the one-process format (minidist/strategy/checkpoint.py: plain dicts), read back by every stage.

    save_plan  each stage's parameters and optimizer state as whole arrays (under ZeRO gathered
           over dp first: the data-parallel strategy's whole_state; under --ep the stage's
           experts too, from every ep rank: minidist/ep/checkpoint.py; then over tp when the
           stage is tensor-parallel: minidist/tp/state.py), sent to stage 0 of the first
           replica (and cp rank 0: under --cp every cp rank holds the same parameters),
           merged in model order (the tied wte, on the first and last stage and equal, kept
           once) and planned for world rank 0 to write (minidist/strategy/saving.py:
           written, then committed by every rank together); the dropout keys' step (every
           stage's, minidist/autograd/dropout_keys.py) is in the meta's "rng"
    load   every rank reads only its own parameters of the checkpoint and their optimizer
           state (its tp shard of them; under ZeRO its dp shards, under --ep its own experts:
           inner's load_whole_state), so a checkpoint from any pp x tp x dp (x ZeRO, x ep)
           layout resumes on any other, or on one process
Tests: tests/test_pipeline.py, tests/test_pipeline_train.py (train_gpt's resume),
tests/test_pp_zero.py (resume with dropout),
tests/scripts/pp_check.py (--files), tests/test_ep_pp_checkpoint.py (ep x pp),
tests/test_cp_pp.py (cp x pp: tests/scripts/cp_pp_check.py --files, train_gpt's resume).
"""
from minidist.tp.state import TpPiece, gather_optimizer_state
from minidist.strategy import checkpoint, saving


def stage_state(strategy, optimizer):
    """This stage's parameters and optimizer state as whole host arrays, as one process holds
    them: inner's whole_state (ZeRO: gathered over dp to dp rank 0; None elsewhere), then
    gathered over tp when the stage is tensor-parallel (collective over tp)."""
    stage = strategy.stage
    params, sd = strategy.inner.whole_state(stage, optimizer)
    if strategy.mesh.shape["tp"] > 1 and params is not None:
        return (stage.full_state_dict(params),
                gather_optimizer_state(stage, strategy.mesh.tp, sd))
    return params, sd


def merge_stages(parts):
    """The stages' (params, optimizer state_dict) in stage order -> the whole model's,
    in model order. The tied wte is on the first and last stage, equal: kept once."""
    params, state = {}, {}
    for p, sd in parts:
        for name, a in p.items():
            params.setdefault(name, a)
        for name, s in sd["state"].items():
            state.setdefault(name, s)
    return params, {"groups": parts[0][1]["groups"], "state": state}


def save_plan(strategy, model, optimizer, step, rng_states, extra):
    """Collective over the world: the whole model and optimizer gathered to world rank 0,
    whose plan writes them (a saving.SavePlan; nothing elsewhere)."""
    params, opt_sd = stage_state(strategy, optimizer)
    mesh, pp = strategy.mesh, strategy.group
    if mesh.dp_rank == 0 and mesh.tp_rank == 0 and mesh.cp_rank == 0:   # one pipeline
        parts = pp.gather_object((params, opt_sd), root=0)    # in stage order
        if pp.rank == 0:
            params, opt_sd = merge_stages(parts)
            meta = checkpoint.make_meta(model.config, checkpoint.model_dtype(model),
                                        optimizer, step, rng_states, extra)
            meta["optimizer"] = strategy.inner.optimizer_type(optimizer)   # ZeRO: AdamW
            return checkpoint.plain_plan(params, opt_sd, meta)
    return saving.SavePlan()


def load(strategy, directory, model, optimizer):
    """Every rank reads its stage's part of the checkpoint: only its parameters (`only`), each
    array cut to its tp shard as it is read (TpPiece); returns the checkpoint's meta (its
    "rng"/"dropout", the keys' step, is every stage's). `optimizer` None: the parameters
    alone (no optimizer array read)."""
    piece = TpPiece(model, strategy.mesh.tp) if strategy.mesh.shape["tp"] > 1 else None
    mine = {n for n, _ in model.named_parameters()}
    params, opt_sd, meta = checkpoint.load(directory, keep=piece, only=mine,
                                           keys=checkpoint.optimizer_keys(optimizer))
    folder = meta["folder"]
    checkpoint.check_fits(folder, meta, model.config, checkpoint.model_dtype(model),
                          strategy.inner.optimizer_type(optimizer))
    with checkpoint.does_not_fit(folder):
        if set(params) != mine:
            raise KeyError(f"parameters missing: {sorted(mine - set(params))[:6]}")
        strategy.inner.load_whole_state(model, optimizer, params, opt_sd)
    return meta
