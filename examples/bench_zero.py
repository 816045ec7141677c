"""Memory and communication of DDP and ZeRO-1/2/3, measured, beside the ZeRO paper's numbers.

    mpirun -n 4 python examples/bench_zero.py                     # the README's tables
    mpirun -n 4 python examples/bench_zero.py --n-layer 12 --amp

For each stage (0 = DDP) it builds the model from the model flags (random token batches: no
data files), takes --steps steps through the loop's own train_step and prints, on rank 0, one
JSON line per stage on stdout and two markdown tables of the same figures on stderr:
  - model-state bytes per rank: predicted (memory.zero_model_states, the ZeRO paper's
    arithmetic) vs measured (memory.ledger from the live arrays, as --log-json reports it; the
    largest over ranks), the activations the graph held, and the transient buffers' peak
    (stage 2: gradient buckets in flight; stage 3: those and the gather buffers);
  - bytes each rank sent in the last step (the trace counters: reduce-scatter, all-gather,
    all-reduce) vs the paper's 2 Psi (N-1)/N for DDP and stages 1 and 2, 3 Psi (N-1)/N for
    stage 3, Psi = the parameters' bytes.
Each JSON line: {"stage" (0: DDP), "ranks", "params", "precision", "batch_size",
"block_size", "predicted_mib" and "measured_mib" ({"params", "grads", "optimizer",
"model_states"}), "activations_mib", "transient_mib", "psi_mib", "sent_mib", "sent_x_psi",
"sent_vs_ddp" (null without stage 0 in --stages), "paper_x_psi", "paper_vs_ddp"}; MiB are
2**20 bytes, per rank. Every flag is checked before MPI starts: a bad one is one `error:` line
from rank 0, exit status 2 (--batch-size must split evenly over the ranks).
"""
import json
import sys

import numpy as np

from minidist import backend
from minidist.launcher import world_size_from_env
from minidist import comm as minidist_comm
from minidist.comm import ALGOS, ProcessGroup, env_problems, trace
from mpi4py import MPI   # after minidist.comm: MPI starts in comm.init(), not on import
from minidist.nn import GPTConfig
from minidist.strategy import memory
from minidist.train.amp import MixedPrecision
from minidist.train.args import add_model_args, arch_fields, train_parser
from minidist.train.loop import moe_fields
from minidist.ddp.strategy import DataParallel
from minidist.train.step import train_step
from minidist.zero.strategy import ZeroDataParallel
from minidist.train.args import check_at_least, example_parser

OPS = ("reduce_scatter", "all_gather", "all_reduce")


def model_config(cli):
    """The GPTConfig of the model flags (a ValueError where they do not make a model)."""
    return GPTConfig(n_layer=cli.n_layer, n_head=cli.n_head, n_embd=cli.n_embd,
                     block_size=cli.block_size, vocab_size=cli.vocab_size,
                     dropout=cli.dropout, attention=cli.attention,
                     attention_block=cli.attention_block, **arch_fields(cli),
                     **moe_fields(cli))


def run_stage(cli, stage, comm):
    """--steps steps at `stage`; (ledger row with the largest value over ranks of each
    kind, bytes this rank sent in the last step, parameter count)."""
    config = model_config(cli)
    group = ProcessGroup(comm, cli.comm, name=f"bench-zero{stage}")
    amp = MixedPrecision() if cli.amp else None
    strategy = (DataParallel(group, amp=amp) if stage == 0
                else ZeroDataParallel(group, stage, amp=amp))
    # (--log-json: train_step measures each step; the bench writes no log)
    args = train_parser().parse_args(["--lr", "1e-3", "--log-json", "measure"])
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


def stage_rows(cli, results, n_ranks):
    """One row per stage of the tables' figures, unrounded: MiB per rank predicted
    (memory.zero_model_states) and measured, and the bytes sent against Psi, DDP's and the
    paper's."""
    mib, n = 2.0 ** 20, next(iter(results.values()))[2]
    itemsize = 2 if cli.amp else np.dtype(cli.dtype).itemsize
    psi, ring = n * itemsize, (n_ranks - 1) / n_ranks
    ddp = results[0][1] if 0 in results else None
    rows = []
    for stage, (mem, sent, _) in results.items():
        pred = memory.zero_model_states(n, n_ranks, stage, cli.amp, itemsize)
        kinds = ("params", "grads", "optimizer")
        paper = (3 if stage == 3 else 2) * ring
        rows.append({
            "stage": stage, "ranks": n_ranks, "params": n,
            "precision": "mixed precision" if cli.amp else cli.dtype,
            "batch_size": cli.batch_size, "block_size": cli.block_size,
            "predicted_mib": {**{k: pred[k] / mib for k in kinds},
                              "model_states": pred["total"] / mib},
            "measured_mib": {**{k: mem[k] / mib for k in kinds},
                             "model_states": sum(mem[k] for k in kinds) / mib},
            "activations_mib": mem["activations"] / mib,
            "transient_mib": mem["transient"] / mib, "psi_mib": psi / mib,
            "sent_mib": sent / mib, "sent_x_psi": sent / psi,
            "sent_vs_ddp": sent / ddp if ddp else None,
            "paper_x_psi": paper, "paper_vs_ddp": paper / (2 * ring)})
    return rows


def tables(rows):
    """The two markdown tables of stage_rows' figures, on stderr (stdout: the JSON lines)."""
    first = rows[0]
    lines = [f"\n{first['params']:,} parameters, {first['ranks']} ranks, {first['precision']}"
             f", batch {first['batch_size']} x {first['block_size']}; MiB per rank, predicted "
             "/ measured\n",
             "| stage | params | grads | optimizer | model states | activations | transient |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        cells = [f"{r['predicted_mib'][k]:.3f} / {r['measured_mib'][k]:.3f}"
                 for k in ("params", "grads", "optimizer", "model_states")]
        lines.append(f"| {r['stage'] or 'DDP'} | " + " | ".join(cells) +
                     f" | {r['activations_mib']:.2f} | {r['transient_mib']:.2f} |")
    lines += [f"\nbytes each rank sent in one step (Psi = {first['psi_mib']:.2f} MiB of "
              "parameters)\n",
              "| stage | MiB sent | x Psi | vs DDP | the paper: x Psi | the paper: vs DDP |",
              "|---|---|---|---|---|---|"]
    for r in rows:
        vs_ddp = "" if r["sent_vs_ddp"] is None else f"{r['sent_vs_ddp']:.2f}"
        lines.append(f"| {r['stage'] or 'DDP'} | {r['sent_mib']:.2f} | {r['sent_x_psi']:.2f} | "
                     f"{vs_ddp} | {r['paper_x_psi']:.2f} | {r['paper_vs_ddp']:.2f} |")
    print("\n".join(lines), file=sys.stderr, flush=True)


# (flag, lowest allowed value, what it is)
AT_LEAST = (("--steps", 1, "steps per stage"), ("--batch-size", 1, "the global batch"),
            ("--n-layer", 1, "transformer blocks"), ("--n-head", 1, "attention heads"),
            ("--n-embd", 1, "the embedding width"), ("--block-size", 1, "the context length"),
            ("--vocab-size", 1, "token ids"))


def check_flags(p, cli):
    """Every flag and the model they make, before MPI starts and alike on every rank
    (p.error: one `error:` line from rank 0, exit status 2). Returns the stages."""
    check_at_least(p, cli, AT_LEAST)
    stages = cli.stages.split(",")
    if any(s not in ("0", "1", "2", "3") for s in stages):
        p.error(f"--stages {cli.stages}: a comma list of 0 (DDP), 1, 2 and 3")
    ranks = world_size_from_env()
    if ranks < 2:      # its bytes per rank over DDP's: nothing on one rank
        p.error("it compares ranks' memory and bytes: run it under mpirun -n 2 or more")
    if cli.batch_size % ranks:
        p.error(f"--batch-size {cli.batch_size}: does not split over {ranks} ranks; give a "
                f"multiple of {ranks}")
    problems = env_problems(cli.comm)       # MINIDIST_COMM_WAIT=..., read by comm.init
    if problems:
        p.error("; ".join(problems))
    try:
        model_config(cli)
    except ValueError as e:             # --dropout 1.5, n_embd not a multiple of n_head, ...
        p.error(f"model flags: {e}")
    return [int(s) for s in stages]


def main():
    p = add_model_args(example_parser(__doc__))
    p.add_argument("--vocab-size", type=int, default=256, help="the random tokens' vocabulary")
    p.add_argument("--steps", type=int, default=2,
                   help="steps per stage; the bytes sent are the last one's")
    p.add_argument("--stages", default="0,1,2,3", help="ZeRO stages to measure (0: DDP)")
    p.add_argument("--amp", action="store_true", help="16-bit compute, float32 master")
    p.add_argument("--comm", default="ring", choices=ALGOS,
                   help="collective algorithm (nccl: --device cuda)")
    cli = p.parse_args()
    stages = check_flags(p, cli)
    backend.setup(threads=None, device=cli.device)   # threads: cores on this node // ranks
    minidist_comm.init(cli.comm)          # MPI_Init, abort hooks, watchdog
    comm = MPI.COMM_WORLD
    results = {s: run_stage(cli, s, comm) for s in stages}
    if comm.rank == 0:
        rows = stage_rows(cli, results, comm.size)
        for row in rows:
            print(json.dumps(row), flush=True)
        tables(rows)


if __name__ == "__main__":
    main()
