"""One rank skips the rest of a step after its forward (an exception caught, then `continue`),
in the own loop of minidist/ddp/README.md: with MINIDIST_DEBUG=1 the next sync_grads raises
CollectiveMismatch on every rank, naming who ran how many forwards (first-use walk 37: its
gradients were averaged with the others' of another step, the replicas drifted apart, and
nothing said so).

    MINIDIST_DEBUG=1 mpiexec -n 2 python tests/scripts/ddp_skip.py [--device cuda]
    MINIDIST_DEBUG=1 mpiexec -n 2 python tests/scripts/ddp_skip.py --skip backward \
        --mode bucketed

--skip backward: rank 1 swallows only its backward and goes on (first-use walk 43: its zero
gradients were averaged in, in debug mode too); the check counts the gradients backward
completed as well. Overlapped, rank 0's backward starts its buckets' all-reduces before that
check, so debug mode's collective check names the two calls instead.

Run by tests/test_ddp_exact.py::test_a_rank_that_skips_a_step_is_named_in_debug_mode.
"""
import argparse

import numpy as np

from minidist import backend, comm
from minidist.comm import ProcessGroup
from minidist.ddp.ddp import DistributedDataParallel
from minidist.nn import GPT, GPTConfig
from minidist.optim import AdamW

parser = argparse.ArgumentParser()
parser.add_argument("--device", default="cpu")
parser.add_argument("--mode", choices=("naive", "bucketed", "overlapped"), default="overlapped")
parser.add_argument("--skip", choices=("step", "backward"), default="step",
                    help="what rank 1 skips at step 1: the rest of the step, or its backward")
args = parser.parse_args()
comm.init("ring")
backend.set_device(args.device)
group = ProcessGroup.world("ring")
xp = backend.get_xp()
model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=32), seed=0)
ddp = DistributedDataParallel(model, group, mode=args.mode)
opt = AdamW(model.named_parameters(), lr=1e-3)
x = xp.asarray(np.arange(16).reshape(2, 8) % 32)
for step in range(3):
    _, loss = ddp(x, x)
    try:
        if group.rank == 1 and step == 1:
            raise ValueError("a bad batch")
        loss.backward()
    except ValueError:
        if args.skip == "step":
            continue                # the rest of this step skipped, on rank 1 only
        # --skip backward: the backward alone swallowed; rank 1 averages zeros in
    ddp.sync_grads()
    opt.step()
    ddp.zero_grad()
print(f"rank {group.rank} finished: the skipped step was NOT caught", flush=True)
