"""GPTStage on a real pipeline group, one stage per rank: what each stage holds, gathered to
rank 0 for tests/test_pipeline.py and tests/test_pp_zero.py (they built the stages in one
process around a stand-in group of `rank` and `size` before review 38).

    mpiexec -n 2 python tests/scripts/pp_stages_check.py --n-layer 4
    mpiexec -n 3 python tests/scripts/pp_stages_check.py --n-layer 3

Rank 0 prints `STAGES {json}`: per stage its parameter names in order, whether each holds
GPT(config, seed 3)'s numbers bit for bit, its tied copies, and ZeRO's units of it for each
data-parallel rank r of 4 (gpt_units, the tied wte apart): names, layout, shard bounds, and
whether each unit has a module.
"""
import argparse
import json

import numpy as np

from minidist import backend, comm
from minidist.nn import GPT, GPTConfig
from minidist.pp.schedule import split_layers
from minidist.pp.stage import GPTStage
from minidist.zero.flat import gpt_units

DP = 4


def describe(stage):
    """What this rank's stage holds (host data only, for all_gather_object)."""
    units = [[{"names": u.names, "layout": u.layout(), "lo": u.lo, "hi": u.hi,
               "module": u.module is not None}
              for u in gpt_units(stage, DP, r, apart=stage.tied_copies())] for r in range(DP)]
    return {"names": [n for n, _ in stage.named_parameters()],
            "values": {n: backend.to_host(p.data) for n, p in stage.named_parameters()},
            "tied_copies": len(stage.tied_copies()), "units": units}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="where the stages live (tests/mpirun.py passes pytest's --device)")
    args = p.parse_args()
    world = comm.init("ring")
    backend.set_device(args.device)
    config = GPTConfig(n_layer=args.n_layer, n_head=2, n_embd=16, block_size=8, vocab_size=30)
    layers = split_layers(args.n_layer, world.size)[world.rank]
    stages = world.all_gather_object(describe(GPTStage(config, world, layers, seed=3)))
    if world.rank == 0:
        full = {n: backend.to_host(q.data) for n, q in GPT(config, seed=3).named_parameters()}
        for s in stages:
            s["gpt_numbers"] = all(np.array_equal(v, full[n]) for n, v in s["values"].items())
            del s["values"]
        print("STAGES " + json.dumps({"full": list(full), "stages": stages}), flush=True)


if __name__ == "__main__":
    main()
