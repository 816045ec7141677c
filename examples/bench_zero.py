"""Memory and communication of DDP and ZeRO-1/2/3, measured, beside the ZeRO paper's numbers.

    mpirun -n 4 python examples/bench_zero.py                     # the README's tables
    mpirun -n 4 python examples/bench_zero.py --n-layer 12 --amp

For each stage (0 = DDP) it builds the model from the model flags (random token batches: no
data files), takes --steps steps through the loop's own train_step and prints, on rank 0, two
markdown tables:
  - model-state bytes per rank: predicted (memory.zero_model_states, the ZeRO paper's
    arithmetic) vs measured (memory.ledger from the live arrays, as --log-json reports it; the
    largest over ranks), the activations the graph held, and the transient buffers' peak
    (stage 2: gradient buckets in flight; stage 3: those and the gather buffers);
  - bytes each rank sent in the last step (the trace counters: reduce-scatter, all-gather,
    all-reduce) vs the paper's 2 Psi (N-1)/N for DDP and stages 1 and 2, 3 Psi (N-1)/N for
    stage 3, Psi = the parameters' bytes.
"""
from types import SimpleNamespace

import numpy as np

from minidist import backend
from minidist.launcher import world_size_from_env
from minidist import comm as minidist_comm
from minidist.comm import ProcessGroup, trace
from mpi4py import MPI   # after minidist.comm: MPI starts in comm.init(), not on import
from minidist.nn import GPTConfig
from minidist.strategy import memory
from minidist.train.amp import MixedPrecision
from minidist.train.args import add_model_args, arch_fields
from minidist.train.loop import moe_fields
from minidist.ddp.strategy import DataParallel
from minidist.train.step import train_step
from minidist.zero.strategy import ZeroDataParallel
from minidist.train.args import example_parser

OPS = ("reduce_scatter", "all_gather", "all_reduce")


def run_stage(cli, stage, comm):
    """--steps steps at `stage`; (ledger row with the largest value over ranks of each
    kind, bytes this rank sent in the last step, parameter count)."""
    config = GPTConfig(n_layer=cli.n_layer, n_head=cli.n_head, n_embd=cli.n_embd,
                       block_size=cli.block_size, vocab_size=cli.vocab_size,
                       dropout=cli.dropout, attention=cli.attention,
                       attention_block=cli.attention_block, **arch_fields(cli),
                       **moe_fields(cli))
    group = ProcessGroup(comm, cli.comm, name=f"bench-zero{stage}")
    amp = MixedPrecision() if cli.amp else None
    strategy = (DataParallel(group, amp=amp) if stage == 0
                else ZeroDataParallel(group, stage, amp=amp))
    args = SimpleNamespace(lr=1e-3, weight_decay=0.1, grad_clip=1.0, grad_accum=1,
                           optimizer="adamw", log_json="yes")   # makes train_step measure
    model = strategy.build_model(config, cli.seed, "float32" if cli.amp else cli.dtype)
    opt = strategy.build_optimizer(model, args)
    rng = np.random.default_rng(cli.seed)
    for step in range(cli.steps):
        x = rng.integers(0, cli.vocab_size, size=(cli.batch_size, cli.block_size))
        before = sum(trace.bytes_sent(group.name, op) for op in OPS)
        _, _, mem = train_step(strategy, model, opt, x, np.roll(x, -1, axis=1), args)
        sent = sum(trace.bytes_sent(group.name, op) for op in OPS) - before
    mem["transient"] = getattr(getattr(strategy, "engine", None), "transient_peak", 0)
    mem = {k: comm.allreduce(v, op=MPI.MAX) for k, v in mem.items()}
    n = model.num_parameters()
    group.destroy()
    return mem, comm.allreduce(sent, op=MPI.MAX), n


def tables(cli, results, n_ranks):
    mib, n = 2.0 ** 20, results[0][2]
    itemsize = 2 if cli.amp else np.dtype(cli.dtype).itemsize
    psi, ring = n * itemsize, (n_ranks - 1) / n_ranks
    print(f"\n{n:,} parameters, {n_ranks} ranks, {'mixed precision' if cli.amp else cli.dtype}"
          f", batch {cli.batch_size} x {cli.block_size}; MiB per rank, predicted / measured\n")
    print("| stage | params | grads | optimizer | model states | activations | transient |")
    print("|---|---|---|---|---|---|---|")
    for stage, (mem, _, _) in results.items():
        pred = memory.zero_model_states(n, n_ranks, stage, cli.amp, itemsize)
        cells = [f"{pred[k] / mib:.3f} / {mem[k] / mib:.3f}"
                 for k in ("params", "grads", "optimizer")]
        states = sum(mem[k] for k in ("params", "grads", "optimizer"))
        cells.append(f"{pred['total'] / mib:.3f} / {states / mib:.3f}")
        print(f"| {stage or 'DDP'} | " + " | ".join(cells) +
              f" | {mem['activations'] / mib:.2f} | {mem['transient'] / mib:.2f} |")
    print(f"\nbytes each rank sent in one step (Psi = {psi / mib:.2f} MiB of parameters)\n")
    print("| stage | MiB sent | x Psi | vs DDP | the paper: x Psi | the paper: vs DDP |")
    print("|---|---|---|---|---|---|")
    ddp = results[0][1]
    for stage, (_, sent, _) in results.items():
        paper = (3 if stage == 3 else 2) * ring
        print(f"| {stage or 'DDP'} | {sent / mib:.2f} | {sent / psi:.2f} | {sent / ddp:.2f} | "
              f"{paper:.2f} | {paper / (2 * ring):.2f} |")


def main():
    p = add_model_args(example_parser(__doc__))
    p.add_argument("--vocab-size", type=int, default=256, help="the random tokens' vocabulary")
    p.add_argument("--steps", type=int, default=2,
                   help="steps per stage; the bytes sent are the last one's")
    p.add_argument("--stages", default="0,1,2,3", help="ZeRO stages to measure (0: DDP)")
    p.add_argument("--amp", action="store_true", help="16-bit compute, float32 master")
    p.add_argument("--comm", default="ring",
                   help="collective algorithm: ring, naive, mpi, hier or nccl")
    cli = p.parse_args()
    stages = cli.stages.split(",")
    if not stages or any(s not in ("0", "1", "2", "3") for s in stages):
        p.error(f"--stages {cli.stages}: a comma list of 0 (DDP), 1, 2 and 3")
    if world_size_from_env() < 2:      # its bytes per rank over DDP's: nothing on one rank
        p.error("it compares ranks' memory and bytes: run it under mpirun -n 2 or more")
    backend.setup(threads=None, device=cli.device)   # threads: cores on this node // ranks
    minidist_comm.init(cli.comm)          # MPI_Init, abort hooks, watchdog
    comm = MPI.COMM_WORLD
    results = {s: run_stage(cli, s, comm) for s in map(int, stages)}
    if comm.rank == 0:
        tables(cli, results, comm.size)


if __name__ == "__main__":
    main()
