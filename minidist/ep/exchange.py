"""Expert parallelism's dispatch and combine: tokens to their experts' ranks and back.

The ep group's N ranks hold E/N experts each, rank r experts r E/N .. (r+1) E/N - 1. The MoE
layer (minidist/nn/moe.py) routes this rank's tokens and sorts the (M, C) expert inputs by
expert; `ExpertExchange.run` then does, on every rank of the ep group:

    1. counts:   all_to_all of the per-expert row counts (N x E/N int64s), so each rank learns
                 how many rows every rank sends to each of its experts
    2. dispatch: all_to_all_v of the rows (AllToAll), rank j's block to rank j
    3. regroup:  what arrived is ordered by source rank, then expert: reorder it by expert,
                 then source rank (= global token order: rank i holds rows before rank i+1's)
    4. compute:  run_experts on the rows of each local expert
    5. undo 3, then combine: all_to_all_v of the outputs back to the ranks that sent the rows
                 (AllToAll with the counts swapped); the MoE layer weights them by the router
                 probabilities and adds them up per token

Backward runs through the same steps in reverse: AllToAll's backward is the all-to-all the
other way round, the reorders are index gathers. Every rank of the ep group must call `run`
together (once per MoE layer, in the same order; backward likewise).
Tests: tests/test_expert_parallel.py, tests/test_ep_exact.py (tests/scripts/ep_check.py).
"""
import numpy as np

from minidist.autograd import Function, is_grad_enabled
from minidist.backend import xp_of


class AllToAll(Function):
    """Rows to ranks. Forward: send_rows[j] rows of x (R, C) to rank j; returns the rows from
    every rank, recv_rows[i] from rank i, in rank order. Backward: the same all-to-all the
    other way (send_rows and recv_rows swapped): each row's gradient goes back to the rank
    that sent the row."""

    @staticmethod
    def forward(ctx, x, group, send_rows, recv_rows):                   # (sum send_rows, C)
        ctx.group, ctx.send_rows, ctx.recv_rows = group, send_rows, recv_rows
        return _exchange(x, group, send_rows, recv_rows)               # (sum recv_rows, C)

    @staticmethod
    def backward(ctx, grad):                                            # (sum recv_rows, C)
        g = _exchange(grad, ctx.group, ctx.recv_rows, ctx.send_rows)    # (sum send_rows, C)
        return g, None, None, None


def _exchange(x, group, send_rows, recv_rows):
    xp = xp_of(x)
    C = x.shape[1]
    out = xp.empty((int(sum(recv_rows)), C), dtype=x.dtype)
    group.all_to_all_v(out, xp.ascontiguousarray(x), [int(n) * C for n in send_rows],
                       [int(n) * C for n in recv_rows])
    return out


def regroup_order(recv):
    """recv (N sources, El local experts) row counts, rows arriving by source then expert ->
    the permutation that orders them by expert, then source."""
    start = np.concatenate([[0], np.cumsum(recv.reshape(-1))])[:-1].reshape(recv.shape)
    return np.concatenate([np.arange(start[s, e], start[s, e] + recv[s, e])
                           for e in range(recv.shape[1]) for s in range(recv.shape[0])]
                          + [np.zeros(0, dtype=np.int64)]).astype(np.int64)


class ExpertExchange:
    """The all-to-alls of one MoE layer over the ep `group` (E experts in all). `totals`
    adds up, per whether a backward follows (False for a forward without a graph, e.g.
    evaluation or the first forward of a block under --ckpt-activations, whose recompute
    inside backward runs the exchange again, with a graph), [runs, rows sent to other ranks,
    rows received from other ranks]: sums, not a list of every run, which grew by a tuple a
    layer and micro-batch for the whole run (tests/scripts/soak.py: 2 blocks a step)."""

    def __init__(self, group, n_experts):
        self.group, self.n_experts = group, n_experts
        self.per_rank = n_experts // group.size
        self.totals = {False: [0, 0, 0], True: [0, 0, 0]}

    def experts_of(self, rank):
        """The experts rank `rank` of the ep group holds."""
        return list(range(rank * self.per_rank, (rank + 1) * self.per_rank))

    def run(self, xin, counts, run_experts):
        """xin (M, C) Tensor, rows sorted by expert, counts (E,) rows per expert ->
        run_experts' outputs for those rows (M, C), computed on the experts' ranks."""
        N, El = self.group.size, self.per_rank
        send = np.ascontiguousarray(counts, dtype=np.int64)            # (N * El,) by rank
        recv = np.empty_like(send)
        self.group.all_to_all(recv, send)                               # 1. counts
        send, recv = send.reshape(N, El), recv.reshape(N, El)           # (dest / source, El)
        x_recv = AllToAll.apply(xin, self.group, send.sum(1), recv.sum(1))      # 2. dispatch
        order = regroup_order(recv)
        xp = xp_of(x_recv.data)
        x_local = x_recv[xp.asarray(order)]                             # 3. by expert
        y_local = run_experts(x_local, recv.sum(0))                     # 4. (R, C)
        y_recv = y_local[xp.asarray(np.argsort(order))]                 # 5. by source again
        r, total = self.group.rank, self.totals[is_grad_enabled() and xin.requires_grad]
        total[0] += 1
        total[1] += int(send.sum() - send[r].sum())
        total[2] += int(recv.sum() - recv[r].sum())
        return AllToAll.apply(y_recv, self.group, recv.sum(1), send.sum(1))     # (M, C)

    def bytes_sent(self, C, itemsize):
        """exchange_bytes summed over every run so far (rows of C values of `itemsize`
        bytes): the counts once a run, the rows' bytes by their sums."""
        N, El = self.group.size, self.per_rank      # (one run's counts: exchange_bytes(0, 0))
        return sum(exchange_bytes(sent, received, N, El, C, itemsize, backward)
                   + (runs - 1) * exchange_bytes(0, 0, N, El, C, itemsize, backward)
                   for backward, (runs, sent, received) in self.totals.items())


def exchange_bytes(sent_rows, received_rows, N, El, C, itemsize, backward=True):
    """Bytes one rank sends on the ep group for one MoE layer's forward and backward: the
    counts (its N-1 other chunks of El int64s), then rows of C values: the dispatch and the
    combine's backward send the rows that go to other ranks, the combine and the dispatch's
    backward the rows that came from them. backward=False: the forward's alone (one run of
    `history` without a graph)."""
    return (N - 1) * El * 8 + (1 + backward) * (sent_rows + received_rows) * C * itemsize


def attach_experts(model, group):
    """Expert parallelism on `model` (a GPT or TensorParallelGPT with MoE blocks): every MoE
    layer keeps only this rank's experts and sends its tokens over `group`. Marks the kept
    experts' parameters `expert_parallel` (data parallelism leaves them to the ep strategy)
    and returns them."""
    kept = []
    for m in model.moe_layers():
        m.exchange = ExpertExchange(group, m.n_experts)
        kept += m.keep_experts(m.exchange.experts_of(group.rank))
    for p in kept:
        p.expert_parallel = True
    return kept
