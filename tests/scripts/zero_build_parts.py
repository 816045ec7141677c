"""ZeRO-3's build of this rank's part under --tp, --pp, --cp and --ep (minidist/tp/strategy.py,
minidist/pp/strategy.py build_model, minidist/cp/strategy.py, minidist/ep/strategy.py
wrap_unbuilt: the TensorParallelGPT, pipeline stage or GPT made on placeholders, each unit's
numbers drawn as this rank holds them and sharded over ZeRO's group in turn; under --ep
this rank's experts only, 4 per MoE block in all), against building the part whole and
then sharding it (what they did until 2026-11-30), on every rank:

    mpiexec -n 4 python tests/scripts/zero_build_parts.py --tp 2 [--amp] [--weights]
    mpiexec -n 4 python tests/scripts/zero_build_parts.py --pp 2 [--tp 2] [--amp]
    mpiexec -n 4 python tests/scripts/zero_build_parts.py --cp 2 [--tp 2] [--pp 2] [--amp]
    mpiexec -n 4 python tests/scripts/zero_build_parts.py --ep 2 [--tp 2] [--amp]

Each rank checks that its parameter shards (and, with --amp, its float32 master shards, once
the optimizer holds them; --ep: the experts' ZeRO-1 shards too) are bit for bit the whole
build's; `--weights`: both builds start from given weights (minidist/nn/config.py
GivenWeights, as --init-from's) instead of the seed's draws. Rank 0 prints `RESULT {json}`
with every rank's traced peak (tracemalloc: numpy's arrays) during each build, the bytes
still held after it (the shards it keeps), and its part's float32 bytes. Any failure
raises, and the abort handler ends the job.
"""
import argparse
import json
from dataclasses import replace

from minidist import backend, comm
from minidist.nn import GPT, GPTConfig
from minidist.nn.config import GivenWeights, gpt_init
from minidist.ep.optim import DenseAndExperts
from minidist.ep.strategy import ExpertParallel
from minidist.pp.schedule import chunk_layers
from minidist.pp.stage import GPTStage, TensorParallelGPTStage
from minidist.pp.strategy import PipelineParallel
from minidist.tp.model import TensorParallelGPT
from minidist.tp.strategy import TensorParallel
from minidist.train.args import train_parser
from minidist.train.strategy import make_strategy
from minidist.zero.strategy import ZeroDataParallel
from zero_shards import assert_same_masters, assert_same_shards, traced

# (wte padded from 509 rows: to a multiple of 8 by GPT, of tp by the split)
CONFIG = GPTConfig(n_layer=8, n_head=4, n_embd=128, block_size=32, vocab_size=509,
                   vocab_multiple=8)


def inside(strategy, kind):
    """The strategy of class `kind` in `strategy` (itself, its inner, ...), or None."""
    while not isinstance(strategy, kind):
        strategy = getattr(strategy, "inner", None)
        if strategy is None:
            return None
    return strategy


def build_whole(strategy, config, seed, weights):
    """This rank's part built whole (materialized, cast for --amp), then wrapped by the
    strategy inside (ZeRO, or CP's ring, EP's experts, then ZeRO): the strategies'
    build_model before 2026-11-30. Returns the part."""
    inner = strategy.inner
    if isinstance(strategy, PipelineParallel):
        pp = strategy.group
        layers = chunk_layers(config.n_layer, pp.size, strategy.virtual, pp.rank)
        if strategy.mesh.shape["tp"] > 1:
            part = TensorParallelGPTStage(config, strategy.mesh.tp, pp, layers, seed,
                                          weights=weights)
        else:
            part = GPTStage(config, pp, layers, seed, weights=weights)
    elif isinstance(strategy, TensorParallel):
        part = TensorParallelGPT(config, strategy.group, seed, weights=weights)
    else:                                       # --cp, --ep: the outermost holds the GPT
        part, inner = GPT(config, seed=seed, weights=weights), strategy
    inner.wrap(inner.amp.cast_model(part) if inner.amp else part)
    return part


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--tp", default="1")
    p.add_argument("--pp", default="1")
    p.add_argument("--cp", default="1")
    p.add_argument("--ep", default="1")
    p.add_argument("--amp", action="store_true")
    p.add_argument("--weights", action="store_true")
    cli = p.parse_args()
    world = comm.init()
    backend.set_device(cli.device)
    args = train_parser().parse_args(["--zero", "3", "--tp", cli.tp, "--pp", cli.pp, "--cp",
                                      cli.cp, "--ep", cli.ep, "--moe-experts",
                                      "4" if cli.ep != "1" else "0", "--batch-size", "8",
                                      "--device", cli.device]
                                     + (["--amp"] if cli.amp else []))
    config = replace(CONFIG, moe_experts=4) if cli.ep != "1" else CONFIG
    weights = GivenWeights(gpt_init(config, 99)) if cli.weights else None
    tiny = replace(config, n_layer=2, n_embd=32)   # built first, untraced: the modules the
    make_strategy(args, world).build_model(tiny, 7, "float32")  # first build imports are not
    sharded = make_strategy(args, world)                       # either build's bytes
    model, mine = traced(lambda: sharded.build_model(config, 7, "float32", weights))
    whole = make_strategy(args, world)
    reference, whole_build = traced(lambda: build_whole(whole, config, 7, weights))
    units, ref_units = (inside(s, ZeroDataParallel).engine.units for s in (sharded, whole))
    if cli.ep != "1":                           # + the experts' ZeRO-1 over edp
        units, ref_units = (units + inside(s, ExpertParallel).expert_engine.units
                            for s, units in ((sharded, units), (whole, ref_units)))
    assert_same_shards(units, ref_units)
    if cli.amp:
        opt, ref_opt = sharded.build_optimizer(model, args), whole.build_optimizer(reference,
                                                                                   args)
        if isinstance(opt, DenseAndExperts):
            opt, ref_opt = [opt.dense, opt.experts], [ref_opt.dense, ref_opt.experts]
        else:
            opt, ref_opt = [opt], [ref_opt]
        assert_same_masters(opt, ref_opt)
        assert not sharded.amp.masters and not whole.amp.masters
    rows = world.gather_object({"build": mine, "whole": whole_build,
                                "part_bytes": 4 * model.num_parameters(),
                                "units": len(units)}, root=0)
    if world.rank == 0:
        print("RESULT " + json.dumps({"ranks": rows}), flush=True)


if __name__ == "__main__":
    main()
