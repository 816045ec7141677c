"""The ZeRO strategy: ZeRO-1/2/3 (minidist/zero/zero.py) plugged into the training loop.

    mpirun -n 4 python examples/train_gpt.py --zero 1          # dp = 4 (the world) by default
    mpirun -n 4 python examples/train_gpt.py --zero 3 --log-json run.jsonl --save ckpt
    mpirun -n 2 python examples/train_gpt.py --zero 1 --resume ckpt     # resharded 4 -> 2

What it changes from DataParallel (minidist/ddp/strategy.py), whose batch split it keeps:
    build_model / wrap  the model (built by SingleProcess, or by another strategy: `wrap`),
                        flattened into units and sharded over the dp group: zero_engine
    build_optimizer     ShardedAdamW over this rank's shards (minidist/zero/optim.py)
    forward_backward    the model itself (stage 2/3 hooks and gathers are inside it); stage 1
                        accumulates micro-batches in its full gradient buffers, stages 2 and 3
                        reduce-scatter each micro-batch's gradients into the shards
    sync_grads          engine.sync_grads(): the reduce-scatters
    sum_sq_across_ranks the local sum of squares of the gradient shards, summed over dp
    save / load         sharded checkpoints, any world size / stage (minidist/zero/checkpoint.py)
    save_pretrained     GPT-2 format, the parameters gathered to rank 0
    finish              the memory table (the ZeRO paper's arithmetic vs the ledger, each
                        rank) and the bytes sent per step
    takes_part_in_sampling   stage 3: every rank (each block's forward is a collective)
Tests: tests/test_zero.py.
"""
import time
import types

from minidist.backend import xp_of
from minidist.comm import trace
from minidist.zero.zero import zero_engine
from minidist.zero.optim import ShardedAdamW
from minidist.train import memory
from minidist.ddp.strategy import DataParallel, traced
from minidist.zero.checkpoint import load_sharded, save_sharded
from minidist.train.strategy import SingleProcess


def make_zero(args, world):
    """--zero k over dp = world ranks (sizes already checked by make_strategy)."""
    from minidist.comm import DeviceMesh
    if args.trace:
        trace.enable()
    mesh = DeviceMesh(dp=world, tp=1, pp=1, algo=args.comm)   # installs the abort handler
    return ZeroDataParallel(mesh.dp, args.zero)


class ZeroDataParallel(DataParallel):

    def __init__(self, group, stage, prefetch=True):
        super().__init__(group)
        self.stage, self.prefetch = stage, prefetch
        self.engine = self.opt = self.model = None
        self.activations = 0            # the largest activation bytes measured (the table)
        self._mark = None               # bytes sent when the current step began
        self.step_bytes = []            # bytes this rank sent, per step

    def build_model(self, config, seed, dtype):
        return self.wrap(SingleProcess.build_model(self, config, seed, dtype))

    def wrap(self, model):
        """Shard `model` (the whole model, or this rank's part built by another strategy)."""
        self.model, self.n_params = model, model.num_parameters()
        self.engine = zero_engine(model, self.group, self.stage, prefetch=self.prefetch)
        return model

    def build_optimizer(self, model, args):
        self.opt = ShardedAdamW(self.engine, lr=args.lr, betas=(0.9, 0.95),
                                weight_decay=args.weight_decay, amp=self.amp)
        return self.opt

    def takes_part_in_sampling(self):
        return self.stage == 3 or self.rank == 0

    def notes(self):
        pad = sum(u.padding for u in self.engine.units)
        return super().notes() + [
            f"ZeRO stage {self.stage} over {self.world_size} ranks ({self.group.algo}): "
            f"{len(self.engine.units)} flat units, {pad} padding elements in all; this rank "
            f"owns {sum(u.shard_size for u in self.engine.units):,} of "
            f"{sum(u.padded for u in self.engine.units):,} elements of each flat state"]

    # ---- one step -----------------------------------------------------------------------------
    def forward_backward(self, model, x, y, n_accum=1, measure=False):
        if len(x) % n_accum:
            raise ValueError(f"{len(x)} rows do not split into {n_accum} equal micro-batches")
        self._step_begins()
        start, rows, total, act = time.perf_counter(), len(x) // n_accum, 0.0, 0
        for i in range(n_accum):
            with traced("forward"):
                _, loss = model(x[i * rows:(i + 1) * rows], y[i * rows:(i + 1) * rows])
            act = max(act, memory.activation_bytes(loss, model.parameters()))
            total += float(loss.item())
            with traced("backward"):
                self.backward(loss, n_accum)
        self.activations = max(self.activations, act)
        self.stats.append({"compute_s": time.perf_counter() - start})
        return total / n_accum, act if measure else 0

    def _step_begins(self):
        sent = trace.bytes_sent(self.group.name)
        if self._mark is not None:
            self.step_bytes.append(sent - self._mark)
        self._mark = sent

    def sync_grads(self, model):
        start = time.perf_counter()
        with traced("wait for gradients"):
            self.engine.sync_grads()
        self.stats[-1].update(exposed_s=time.perf_counter() - start)

    def sum_sq_across_ranks(self, local):
        """The global sum of squares: every rank holds different shards, so sum them."""
        return self._all_reduce(local, "sum")

    def global_mean(self, value):
        return self._all_reduce(value, "avg")

    def _all_reduce(self, value, op):
        buf = xp_of(self.engine.units[0].param_shard).asarray([value], dtype="float64")
        self.group.all_reduce(buf, op=op)
        return float(buf[0])

    # ---- checkpoints ------------------------------------------------------------------------
    def save(self, directory, model, optimizer, step, rng_states, extra):
        save_sharded(directory, model, optimizer, self.group, step, rng_states, extra)

    def load(self, directory, model, optimizer):
        return load_sharded(directory, model, optimizer, self.group)

    def save_pretrained(self, model, directory, dtype="float32"):
        """GPT-2's format (minidist/nn/pretrained.py), the full parameters gathered to rank 0
        one unit at a time. Collective."""
        from minidist.nn.pretrained import save_pretrained
        state = self.engine.full_state_dict()
        if self.rank == 0:
            whole = types.SimpleNamespace(config=model.config, state_dict=lambda: state)
            save_pretrained(whole, directory, dtype=dtype)
        self.group.barrier()

    # ---- the end of a run: memory and communication -----------------------------------------
    def memory_rows(self):
        """Every rank's ledger row (measured now, between steps), gathered to rank 0 (None
        elsewhere), each with its rank and the transient peak (stage 2 buckets, stage 3
        gather buffers)."""
        self.engine.free()
        row = memory.ledger(self.model.parameters(), self.opt, self.activations)
        row.update(rank=self.rank, transient=self.engine.transient_peak)
        return self.group.comm.gather(row, root=0)

    def summary(self):
        sent = self.step_bytes + [trace.bytes_sent(self.group.name) - self._mark]
        psi = sum(u.padded for u in self.engine.units) * self.engine.units[0].dtype.itemsize
        return (f"ZeRO-{self.stage} over {self.world_size} ranks ({self.group.algo}): "
                f"{min(sent) / 2**20:.2f} MiB sent per rank per step for {psi / 2**20:.2f} MiB "
                f"of parameters ({min(sent) / psi:.2f} x; DDP sends "
                f"2(N-1)/N = {2 * (self.world_size - 1) / self.world_size:.2f} x)")

    def finish(self, args, log):
        rows = self.memory_rows()
        if self._mark is not None:
            log.print0(self.summary())
        if self.rank == 0:
            predicted = memory.zero_model_states(
                self.n_params, self.world_size, self.stage, amp=self.amp is not None,
                itemsize=self.engine.units[0].dtype.itemsize if self.amp is None else 2)
            log.print0(memory.zero_table(rows, predicted, self.stage, self.n_params))
        if args.trace:
            trace.write_chrome_trace(args.trace, self.group)
            log.print0(f"trace of every collective written to {args.trace}")
