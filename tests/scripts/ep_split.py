"""ep_check.py's runs on a sequence split over ranks (minidist/nn/moe_split.py): sequence
parallelism, context parallelism (zig-zag, naive), both, with the MoE layers' routing and
losses over the whole sequence.

SPLIT names the runs (ep_check.py adds them to its RUNS); in each, ep_check.py holds the calls
and bytes the sequence exchange made on the tp and cp groups, measured (split_counted), equal to
what split_calls says (split_traffic):

    mpiexec -n 4 python tests/scripts/ep_check.py --runs ep1xcp2,ep1xcp2+naive,...
    mpiexec -n 8 python tests/scripts/ep_check.py --runs ep2xcp2xtp2+sp,...
"""
from minidist.comm import trace
from mpi4py import MPI  # (after minidist.comm, as in ep_check.py)
from minidist.nn.moe_split import split_calls
from minidist.pp.schedule import block_stages


# a sequence split over ranks (minidist/nn/moe_split.py): sequence parallelism, context
# parallelism (zig-zag, naive), both; routing and losses over the whole sequence
SPLIT = {"ep1xtp2+sp": ["--tp", "2", "--sequence-parallel"],
         "ep1xtp2+sp+drop": ["--tp", "2", "--sequence-parallel", "--dropout", "0.1"],
         "ep1xcp2": ["--cp", "2"], "ep1xcp2+naive": ["--cp", "2", "--cp-split", "naive"],
         "ep1xcp2+drop+recompute": ["--cp", "2", "--dropout", "0.1", "--ckpt-activations"],
         "ep2xcp2": ["--cp", "2"],
         "ep2xcp2+naive+drop": ["--cp", "2", "--cp-split", "naive", "--dropout", "0.1"],
         "ep2xcp2+zero1": ["--cp", "2", "--zero", "1"],
         "ep1xtp2+sp+zero3": ["--tp", "2", "--sequence-parallel", "--zero", "3"],
         "ep1xcp2+zero3+accum": ["--cp", "2", "--zero", "3", "--grad-accum", "2"],
         "ep2xcp2+amp": ["--cp", "2", "--amp", "--dtype", "float32"],
         "ep2xtp2+sp": ["--tp", "2", "--sequence-parallel"],
         "ep1xcp2xtp2+sp": ["--cp", "2", "--tp", "2", "--sequence-parallel"],
         "ep1xcp2xpp2": ["--cp", "2", "--pp", "2", "--micro-batches", "2"],
         "ep2xcp2xtp2+sp": ["--cp", "2", "--tp", "2", "--sequence-parallel"],       # 8 ranks
         "ep2xcp2xtp2+sp+zero3+drop": ["--cp", "2", "--tp", "2", "--sequence-parallel",
                                       "--zero", "3", "--dropout", "0.1"],
         "ep2xcp2xdp2+zero2": ["--cp", "2", "--dp", "2", "--zero", "2"]}
# --ep's experts' partial gradients summed over tp once a step under SP, on the arrays each
# of its syncs leaves (DDP's .grad over edp, ZeRO-1's shards over edp; 8 ranks: edp 2)
SP = ["--tp", "2", "--sequence-parallel"]
AMP = ["--amp", "--dtype", "float32"]          # float16 loss scaling (numpy: emulated)
SPLIT.update({"ep2xtp2+sp+zero1": [*SP, "--zero", "1"],
              "ep2xtp2+sp+zero3+accum": [*SP, "--zero", "3", "--grad-accum", "2"],
              "ep2xtp2+sp+amp": [*SP, *AMP], "ep2xtp2+sp+zero1+amp": [*SP, "--zero", "1", *AMP],
              "ep2xtp2xdp2+sp": [*SP, "--dp", "2"],                               # 8 ranks
              "ep2xtp2xdp2+sp+zero2": [*SP, "--dp", "2", "--zero", "2"],
              "ep2xtp2xdp2+sp+zero1+zs2+amp": [*SP, "--dp", "2", "--zero", "1",
                                               "--zero-shard", "2", *AMP]})


def split_traffic(args, config, strategy):
    """(calls, bytes) one rank makes and sends, summed over a run, on the tp and cp groups for
    the MoE layers' sequence exchange (minidist/nn/moe_split.py split_calls; the ring's bytes:
    minidist/comm/ring.py ring_bytes), every forward counted (a recompute's too)."""
    from minidist.comm.ring import ring_bytes
    mesh, pp = strategy.mesh, args.pp
    B, m = forward_rows(args, strategy)
    tp = args.tp if args.sequence_parallel else 1
    n = config.block_size // args.cp // tp
    stage = strategy.stage.link.stage if pp > 1 else 0
    moe = sum(config.is_moe(i) for i, s in enumerate(block_stages(config.n_layer, pp))
              if s == stage)
    forwards = args.steps * m * moe * (2 if args.ckpt_activations else 1)
    rank = {"tp": mesh.tp_rank, "cp": mesh.cp_rank}
    out = {}
    for group, op, count, size in split_calls(B, n, config.moe_top_k, config.moe_experts, tp,
                                              args.cp, 8):
        calls, sent = out.get((group, op), (0, 0))
        g = args.tp if group == "tp" else args.cp
        out[(group, op)] = (calls + forwards, sent + forwards * ring_bytes(op, count, size,
                                                                          rank[group], g))
    return out


def forward_rows(args, strategy):
    """(rows of one forward, forwards per step and MoE layer): micro-batches of the global
    batch over mesh dp (= dp x ep), --grad-accum and a pipeline's --micro-batches."""
    m = args.grad_accum * (args.micro_batches if args.pp > 1 else 1)
    return args.batch_size // strategy.mesh.shape["dp"] // m, m


def split_counted(before, events, args, strategy):
    """The same, measured: on the cp group (which otherwise carries only the ring's
    sends) the counters' all-gathers and all-reduces since `before`; on the tp group the
    traced all-gathers of expert ids (uint8) and all-reduces of the B E + 1 sums (float64)."""
    from minidist.comm.ring import ring_bytes
    out = {}
    after = trace.counters("cp")
    for op in ("all_gather", "all_reduce"):
        zero = {"calls": 0, "bytes_sent": 0}
        a, b = after.get(op, zero), before.get(op, zero)
        if a["calls"] > b["calls"]:
            out[("cp", op)] = (a["calls"] - b["calls"], a["bytes_sent"] - b["bytes_sent"])
    B = forward_rows(args, strategy)[0]
    for e in events:
        ids = e["op"] == "all_gather" and e["dtype"] == "uint8"
        sums = e["op"] == "all_reduce" and e["bytes"] == (B * args.moe_experts + 1) * 8
        if e["group"] == "tp" and (ids or sums):
            calls, sent = out.get(("tp", e["op"]), (0, 0))
            itemsize = 1 if ids else 8
            out[("tp", e["op"])] = (calls + 1, sent + ring_bytes(
                e["op"], e["bytes"] // itemsize, itemsize, MPI.COMM_WORLD.rank % args.tp,
                args.tp))
    return out
