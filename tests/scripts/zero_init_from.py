"""ZeRO-3's build from --init-from CKPT (minidist/train/init_from.py initial_weights, then
minidist/zero/strategy.py wrap_unbuilt) on every rank, against building the whole model from
the checkpoint's whole arrays (minidist/train/gather.py whole_model) and then sharding it:

    mpiexec -n 2 python tests/scripts/zero_init_from.py --init-from CKPT --data TEXT
        --cache-dir DIR [--amp]

CKPT is a checkpoint of the model (any layout: ZeRO's rank shards, one process's
model.safetensors) trained on TEXT in bytes. Each rank checks that its parameter shards (and
with --amp its float32 master shards, once the optimizer holds them) are bit for bit the
whole build's; rank 0 prints `RESULT {json}` with every rank's traced peak (tracemalloc:
numpy's arrays) while reading the weights and building, the bytes still held after it (the
shards it keeps), and the whole model's float32 bytes. Any failure raises, and the abort
handler ends the whole job.
"""
import argparse
import json

from minidist import backend, comm
from minidist.nn import GPT
from minidist.train.args import train_parser
from minidist.train.cli import check_flags
from minidist.train.data_open import open_data_shared
from minidist.train.gather import model_config, whole_model
from minidist.train.init_from import initial_weights
from minidist.train.progress import Logger
from minidist.train.strategy import make_strategy
from zero_shards import assert_same_masters, assert_same_shards, traced


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--init-from", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--cache-dir", required=True)
    p.add_argument("--amp", action="store_true")
    cli = p.parse_args()
    world = comm.init()
    backend.set_device(cli.device)
    args = train_parser().parse_args(["--zero", "3", "--init-from", cli.init_from, "--data",
                                      cli.data, "--cache-dir", cli.cache_dir, "--device",
                                      cli.device] + (["--amp"] if cli.amp else []))
    check_flags(args)
    data = open_data_shared(args, world)
    config = model_config(cli.init_from)
    log = Logger(world.rank, None)
    sharded = make_strategy(args, world)

    model, build = traced(lambda: sharded.build_model(config, args.seed, args.dtype,
                                                      initial_weights(args, config, data,
                                                                      log)))

    whole = make_strategy(args, world)          # SingleProcess.build_model's steps, then wrap
    _, params, _ = whole_model(cli.init_from)   # (the float32 masters under --amp)
    reference = GPT(config, seed=args.seed, dtype=args.dtype)
    reference.load_state_dict(params)          # (wte padded as GPT's load pads it)
    reference = whole.wrap(whole.amp.cast_model(reference) if whole.amp else reference)
    assert_same_shards(sharded.engine.units, whole.engine.units)
    if cli.amp:
        assert_same_masters([sharded.build_optimizer(model, args)],
                            [whole.build_optimizer(reference, args)])
    rows = world.gather_object(build, root=0)
    if world.rank == 0:
        print("RESULT " + json.dumps({"ranks": rows, "model_bytes": 4 * model.num_parameters(),
                                      "units": len(sharded.engine.units)}), flush=True)


if __name__ == "__main__":
    main()
