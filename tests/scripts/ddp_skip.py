"""One rank skips the rest of a step after its forward (an exception caught, then `continue`),
in the own loop of minidist/ddp/README.md: with MINIDIST_DEBUG=1 the next sync_grads raises
CollectiveMismatch on every rank, naming who ran how many forwards (first-use walk 37: its
gradients were averaged with the others' of another step, the replicas drifted apart, and
nothing said so).

    MINIDIST_DEBUG=1 mpiexec -n 2 python tests/scripts/ddp_skip.py [--device cuda]

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
args = parser.parse_args()
comm.init("ring")
backend.set_device(args.device)
group = ProcessGroup.world("ring")
xp = backend.get_xp()
model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=32), seed=0)
ddp = DistributedDataParallel(model, group, mode="overlapped")
opt = AdamW(model.named_parameters(), lr=1e-3)
x = xp.asarray(np.arange(16).reshape(2, 8) % 32)
for step in range(3):
    _, loss = ddp(x, x)
    try:
        if group.rank == 1 and step == 1:
            raise ValueError("a bad batch")
    except ValueError:
        continue                    # the rest of this step skipped, on rank 1 only
    loss.backward()
    ddp.sync_grads()
    opt.step()
    ddp.zero_grad()
print(f"rank {group.rank} finished: the skipped step was NOT caught", flush=True)
