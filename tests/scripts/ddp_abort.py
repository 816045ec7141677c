"""An exception on one rank of a DDP job ends the whole job (no rank left waiting forever).

    mpiexec -n 2 python tests/scripts/ddp_abort.py [--device cuda]

The setup is an entry point's (comm.init installs the abort handler), the strategy is built as
examples/train_gpt.py builds it (make_strategy). Rank 1 then raises before its backward; rank 0
goes on into sync_grads, where it would wait for rank 1's gradients forever without the handler.
Run by tests/test_ddp_exact.py::test_exception_on_one_rank_aborts_the_job.
"""
import sys

import numpy as np

from minidist import backend, comm
from minidist.nn import GPTConfig
from minidist.train.args import train_parser
from minidist.comm import ProcessGroup  # noqa: E402
from minidist.train.strategy import make_strategy

args = train_parser().parse_args(["--batch-size", "4", *sys.argv[1:]])   # --device from the test
comm.init(args.comm)   # MPI_Init, the abort-on-exception hooks, the watchdog
backend.set_device(args.device)
strategy = make_strategy(args, ProcessGroup.world(args.comm))
model = strategy.build_model(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8,
                                       vocab_size=32), 0, "float32")
x = np.zeros((4, 8), dtype=np.int64)
if strategy.rank == 1:
    raise RuntimeError("deliberate failure on rank 1")
strategy.start_step()
_, loss = model(*strategy.local_rows(x, x))
strategy.backward(loss)
strategy.sync_grads(model)
print("rank 0 finished: the job was NOT aborted", flush=True)
