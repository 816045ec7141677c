"""zero_engine: the ZeRO stage class for a model (minidist/zero/zero.py: stages 1 and 2;
minidist/zero/stage3.py: stage 3)."""
from minidist.zero.flat import gpt_units
from minidist.zero.stage3 import ZeroStage3
from minidist.zero.stage2 import ZeroStage2
from minidist.zero.zero import ZeroStage1


def zero_engine(model, group, stage, units=None, prefetch=True, replicas=None,
                gather_group=None, initial=None, training=True):
    """Shard `model` over `group` (its dp ProcessGroup) at ZeRO `stage` 1, 2 or 3. `units`
    (FlatUnits) defaults to gpt_units(model): the root and one unit per block. Stage 3 sets
    itself as the model's block hooks (GPT.set_block_hooks): the model calls its gathers.
    `replicas` (hybrid sharding, --zero-shard): the group of ranks holding the same shards
    in the other shard groups; sync_grads averages the gradient shards over it too.
    `gather_group` (stages 1, 2; --overlap-param-gather): a group of `group`'s ranks with
    its own communicator and thread, on which after_step's all-gathers run in the
    background, each unit waited for by the next forward's block hook (on `group` itself
    the step's next blocking collective, the loss's mean, would wait for them all).
    `initial` (stage 3, a model built with materialize=False): initial(names=...) gives
    those parameters' numbers, drawn and sharded a unit at a time (ZeroStage3). `training`
    False (--eval-only: nothing runs backward or steps): no gradient buffer is made, nor
    stage 3's float32 master shards under --amp."""
    if stage == 3 and not hasattr(model, "set_block_hooks"):   # (was an AttributeError)
        raise TypeError(f"zero_engine: stage 3 gathers each block's parameters from the "
                        f"model's forward, which calls the engine's block hooks: "
                        f"{type(model).__name__} has no set_block_hooks (minidist/nn/gpt.py "
                        "shows one: before_root, before_block, after_block); stages 1 and 2 "
                        "take any model")
    units = units if units is not None else gpt_units(model, group.size, group.rank)
    if stage == 3:
        return ZeroStage3(model, group, units, prefetch, replicas, initial, training)
    return {1: ZeroStage1, 2: ZeroStage2}[stage](model, group, units, replicas,
                                                 gather_group, training)
