"""ZeRO-3's build (minidist/zero/strategy.py wrap_unbuilt): the model made on placeholders and
each unit's numbers drawn and sharded in turn, against building the whole model and then
sharding it (what stages 1 and 2, and ZeRO-3 until 2026-11-30, do), on every rank:

    mpiexec -n 4 python tests/scripts/zero_build.py [--amp]

Each rank checks that its parameter shards (and, with --amp, its float32 master shards, once
the optimizer holds them) are bit for bit the whole build's; rank 0 prints `RESULT {json}`
with every rank's traced peak (tracemalloc: numpy's arrays) during each build, and the whole
model's float32 bytes. Any failure raises, and the abort handler ends the whole job.
"""
import argparse
import json

from minidist import backend, comm
from minidist.nn import GPT, GPTConfig
from minidist.train.amp import MixedPrecision
from minidist.train.args import train_parser
from minidist.zero.strategy import ZeroDataParallel
from zero_shards import assert_same_masters, assert_same_shards, traced

# (wte padded from 509 rows to 512: the build pads each draw as GPT's load does)
CONFIG = GPTConfig(n_layer=8, n_head=4, n_embd=128, block_size=32, vocab_size=509,
                   vocab_multiple=8)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--amp", action="store_true")
    cli = p.parse_args()
    world = comm.init()
    backend.set_device(cli.device)
    args = train_parser().parse_args(["--zero", "3"])

    def policy():
        return MixedPrecision(dtype="float16") if cli.amp else None
    sharded = ZeroDataParallel(world, 3, amp=policy())
    model, build = traced(lambda: sharded.build_model(CONFIG, 7, "float32"))
    whole = ZeroDataParallel(world, 3, amp=policy())

    def build_whole():                          # SingleProcess.build_model's steps, then wrap
        m = GPT(CONFIG, seed=7, dtype="float32")
        return whole.wrap(whole.amp.cast_model(m) if whole.amp else m)
    reference, whole_build = traced(build_whole)
    assert_same_shards(sharded.engine.units, whole.engine.units)
    if cli.amp:
        assert_same_masters([sharded.build_optimizer(model, args)],
                            [whole.build_optimizer(reference, args)])
        assert not sharded.amp.masters and not whole.amp.masters
    rows = world.gather_object({"peak": build["peak"], "whole_peak": whole_build["peak"]},
                               root=0)
    if world.rank == 0:
        print("RESULT " + json.dumps({"ranks": rows, "model_bytes": 4 * model.num_parameters(),
                                      "units": len(sharded.engine.units)}), flush=True)


if __name__ == "__main__":
    main()
