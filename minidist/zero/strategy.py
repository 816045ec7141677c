"""The ZeRO strategy: ZeRO-1/2/3 (minidist/zero/zero.py, stage3.py) in the training loop.

    mpirun -n 4 python examples/train_gpt.py --zero 1          # dp = 4 (the world) by default
    mpirun -n 4 python examples/train_gpt.py --zero 3 --log-json run.jsonl --save ckpt
    mpirun -n 2 python examples/train_gpt.py --zero 1 --resume ckpt     # resharded 4 -> 2

What it changes from SingleProcess (minidist/strategy/base.py); rows by dp rank as in DDP:
    wrap                the model (the GPT, or another strategy's part of it), flattened into
                        units and sharded over the dp group: zero_engine
    build_optimizer     ShardedAdamW (minidist/zero/optim.py) or ShardedMuon (zero/muon.py)
                        over this rank's shards
    no_sync             engine.accumulating(): stage 1 accumulates the micro-batches before
                        the last in its full gradient buffers, no reduce-scatter started;
                        stages 2 and 3 reduce-scatter each micro-batch's gradients into the
                        shards as backward completes them, holding back only hybrid
                        sharding's all-reduces across the replicas
    sync_grads          engine.sync_grads(): wait for the reduce-scatters backward started
    local_grads         the pieces of the gradient shards that belong to some parameters
                        (a pipeline sums its tied wte's over two stages, and leaves one copy
                        out of the norm; tensor parallelism counts replicated ones once)
    reduce_sum_sq       the local sum of squares of the gradient shards, summed over dp
    after_step          engine.after_step(): all-gather the updated shards (stages 1, 2; with
                        --overlap-param-gather in the background, waited for by the next
                        forward's block hooks) or drop the stale gathered copies (stage 3)
    save_plan / load    sharded checkpoints, any world size / stage (minidist/zero/checkpoint.py)
    whole_state / load_whole_state   the shards gathered into (cut from) whole arrays by
                        name, in one process's format: a pipeline's checkpoints
    save_pretrained     GPT-2 format, the parameters gathered to rank 0
    finish              the memory table (the ZeRO paper's arithmetic vs the ledger, each
                        rank) and the bytes sent per step
    takes_part_in_sampling   stage 3: every rank (each block's forward is a collective)
    build_model         SingleProcess's; stage 3 (builds_by_unit) the model on placeholders,
                        each unit's numbers drawn and sharded in turn (wrap_unbuilt: no rank
                        holds the whole model; under --tp, --pp, --cp this rank's part)
Hybrid sharding (--zero-shard K, `shard_groups`): the engine shards over each group of K
neighbouring ranks and averages the gradient shards across the groups (the replicas); the
rows, the loss and the memory table stay over the whole dp group, the clip's sum over the
shard group; the first group writes the checkpoints (README.md, "Hybrid sharding"). Under
--cp the group is dp x cp, so a shard group is made of neighbouring cp ranks first; under
--tp TensorParallel writes its parts from the first shard group (writes_checkpoint).
Tests: tests/test_zero.py, tests/test_zero_checkpoint.py, tests/test_zero_hooks.py.
"""
import functools
import math

from minidist.comm import trace
from minidist.strategy import memory
from minidist.strategy.base import (SingleProcess, all_reduce_number, any_rank_of, dp_rows,
                                    matrix_views, optimizer_settings)
from minidist.zero.checkpoint import (gather_whole, load_sharded, load_whole, optimizer_type,
                                      shard_plan)
from minidist.zero.muon import ShardedMuon
from minidist.zero.optim import ShardedAdamW
from minidist.zero.flat import gpt_units
from minidist.zero.engine import zero_engine

RING_OPS = "ZeRO's reduce-scatters and all-gathers"   # --comm hier splits all-reduces alone


def ranks(n):
    """'1 rank', '4 ranks' (a pipeline can leave ZeRO one rank: --pp 2 --zero 1 on 2)."""
    return f"{n} rank" + ("" if n == 1 else "s")


def shard_groups(group, shard_size=None):
    """(the group ZeRO shards over, the replicas group or None). Hybrid sharding (FSDP's
    HYBRID_SHARD, MiCS; `shard_size` K < group.size): group rank r shards with its K
    neighbours [K (r // K), K (r // K) + K), and r, r + K, r + 2K, ... hold the same
    shards; on one node per K ranks the gathers and reduce-scatters stay inside a node.
    Collective over `group` (MPI_Comm_split) when hybrid."""
    if shard_size is None or shard_size == group.size:
        return group, None
    r, k = group.rank, shard_size
    shards = group.split(r // k, key=r % k, name=f"{group.name}-shard")
    replicas = group.split(r % k, key=r // k, name=f"{group.name}-replicas")
    return shards, replicas


def zero_shard_problem(args, dp):
    """Why --zero-shard cannot run in this layout, or None. ZeRO's group is dp x ep x cp
    (`dp`: training's --dp; under --ep the dense parameters are replicated over the ep
    ranks too, under --cp over the cp ranks; under --pp each stage's): K divides it."""
    k = args.zero_shard
    sizes = [("dp", dp)] + [(a, getattr(args, a)) for a in ("ep", "cp") if getattr(args, a) > 1]
    n = math.prod(size for _, size in sizes)
    if k < 1 or n % k:
        divisors = ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)
        group = f"dp {dp}" if len(sizes) == 1 else (
            " x ".join(a for a, _ in sizes) + " = " + " x ".join(str(s) for _, s in sizes)
            + f" = {n}")
        return (f"--zero-shard {k}: the ranks each replica is sharded over must divide "
                f"{group}: one of {divisors} (typically the ranks of one node)")
    return None


def sharded_optimizer(engine, args, amp=None, views=None):
    """The optimizer --optimizer names over `engine`'s shards (minidist/zero/optim.py);
    `views`: Muon's (strategy/base.py matrix_views)."""
    if args.optimizer == "muon":
        return ShardedMuon(engine, **optimizer_settings(args), amp=amp, **(views or {}))
    return ShardedAdamW(engine, **optimizer_settings(args), amp=amp)


class ZeroDataParallel(SingleProcess):
    """One-process training with the model state sharded over the dp group."""
    reports_memory = True               # finish() prints the memory table: measure every step

    def __init__(self, group, stage, prefetch=True, amp=None, ckpt_activations=False,
                 shard_size=None, overlap_gather=False, training=True):
        super().__init__(amp, ckpt_activations)
        self.training = training        # False (--eval-only): the engines make no gradients
        self.group, self.stage, self.prefetch = group, stage, prefetch
        self.rank, self.world_size = group.rank, group.size
        # the state is sharded over shard_group; hybrid sharding (--zero-shard K < the
        # group): over K neighbouring ranks, each such group a replica of the others
        self.shard_group, self.replicas = shard_groups(group, shard_size)
        # --overlap-param-gather: the shard group's ranks again, with a communicator and a
        # thread of their own for after_step's all-gathers, so that the step's next blocking
        # collective on the group (the loss's mean) does not wait for them
        # (stages 1, 2: stage 3 gathers before each block anyway)
        self.gather_group = None if not overlap_gather or stage == 3 else \
            self.shard_group.split(0, name=f"{self.shard_group.name}-gathers")
        self.engine = self.opt = self.model = None
        self.activations = 0            # the largest activation bytes measured (the table)
        self._mark = None               # bytes sent when the current step began
        self._steps, self._gathered = 0, None   # steps begun; the gathers' bytes before them
        self.step_bytes = None          # the fewest bytes this rank sent in one step

    def builds_by_unit(self):
        """Stage 3: build_model (SingleProcess's; or --tp's, --pp's: this rank's part) makes
        the model on placeholders (GPT's materialize=False: each module's arrays freed as it
        is made) and hands it to wrap_unbuilt: a rank holds its shards and one unit, never
        its whole part (DeepSpeed's zero.Init; tests/test_zero_build.py). Stages 1, 2: no
        (every rank holds the whole parameters anyway)."""
        return self.stage == 3

    def wrap_unbuilt(self, model, seed, dtype, weights=None):
        """Stage 3's build of `model` made on placeholders (materialize=False: the GPT, or
        this rank's part of it, a TensorParallelGPT or pipeline stage): cast for --amp
        without float32 copies, then sharded with each unit's numbers drawn in turn as the
        model holds them (its initial_state: gpt_init's or `weights`', wte padded, a tp
        shard cut as its init_parameters cuts it), broadcast and cut to this rank's shard.
        The same numbers as building it whole: each parameter's draw has its own seed."""
        if self.amp:
            self.amp.cast_model(model, placeholders=True)
        return self.wrap(model, functools.partial(model.initial_state, seed=seed, dtype=dtype,
                                                  weights=weights))

    def wrap(self, model, initial=None):
        """Shard `model` (the whole model, or this rank's part built by another strategy;
        `initial`: wrap_unbuilt's, for a model on placeholders)."""
        self.model, self.n_params = model, model.num_parameters()
        shards = self.shard_group
        units = gpt_units(model, shards.size, shards.rank, apart=model.tied_copies())
        self.engine = zero_engine(model, shards, self.stage, units, self.prefetch,
                                  self.replicas, self.gather_group, initial, self.training)
        return model

    def build_optimizer(self, model, args, tp=None):
        """AdamW over this rank's shards, or --optimizer muon's Muon (ShardedMuon: each unit's
        update gathered over the shard group, and over `tp` for a split matrix)."""
        self.opt = sharded_optimizer(self.engine, args, self.amp, matrix_views(model, tp))
        return self.opt

    def takes_part_in_sampling(self):
        return self.stage == 3 or self.rank == 0

    def notes(self, training=True):
        pad = sum(u.flat.padding for u in self.engine.units)
        return super().notes(training) + [
            f"ZeRO stage {self.stage} over {self.over()} ({self.group.algo_text(RING_OPS)}): "
            f"{len(self.engine.units)} flat units, {pad} padding elements in all; this rank "
            f"owns {sum(u.flat.shard_size for u in self.engine.units):,} of "
            f"{sum(u.flat.padded for u in self.engine.units):,} elements of each flat state"]

    # ---- one step (minidist/train/step.py) ---------------------------------------------------
    def local_rows(self, *arrays):
        return dp_rows(arrays, self.rank, self.world_size)

    def no_sync(self):
        """The engine's accumulating(): stage 1's hooks start no reduce-scatter, the
        micro-batches adding up in its full gradient buffers until the last one's backward
        starts each unit's; stages 2 and 3 reduce-scatter every micro-batch's gradients as
        backward completes them (keeping a full gradient for later is what they exist to
        avoid), holding back only hybrid sharding's all-reduce across the replicas."""
        return self.engine.accumulating()

    def over(self):
        """'4 ranks', or under hybrid sharding '2 ranks, replicated x 2'."""
        if self.replicas is None:
            return ranks(self.world_size)
        return f"{ranks(self.shard_group.size)}, replicated x {self.replicas.size}"

    def _bytes_sent(self):
        """Bytes this rank has sent in ZeRO's collectives: (in its shard group, across the
        replicas: hybrid sharding's only traffic between groups). Not --overlap-param-gather's
        all-gathers: `_gather_bytes`."""
        return (trace.bytes_sent(self.shard_group.name),
                0 if self.replicas is None else trace.bytes_sent(self.replicas.name))

    def _gather_bytes(self):
        """Bytes this rank has sent on the gather group (--overlap-param-gather): only
        after_step's all-gathers, the same every step, each landing during the next step."""
        return 0 if self.gather_group is None else trace.bytes_sent(self.gather_group.name)

    def start_step(self):
        self._mark = self._bytes_sent()
        self._steps += 1
        if self._gathered is None:      # finish() divides the gathers since by the steps
            self._gathered = self._gather_bytes()

    def sync_grads(self, model):
        with trace.compute("wait for gradients"):
            self.engine.sync_grads()

    def end_step(self, activation_bytes):
        """Bytes sent this step (the reduce-scatters and the optimizer's all-gathers: the
        fewest over the run, as the first step also broadcasts) and the activation peak.
        With --overlap-param-gather a step's all-gathers land during the next one, on the
        gather group: finish() adds their mean per step, counted apart (a window from one
        step's start to another's would hold one step's gathers more than its
        reduce-scatters: 1.80 x printed for ZeRO-1's 1.50 x until 2026-11-29)."""
        sent = tuple(now - then for now, then in zip(self._bytes_sent(), self._mark))
        self.step_bytes = sent if self.step_bytes is None else min(self.step_bytes, sent,
                                                                   key=sum)
        self.activations = max(self.activations, activation_bytes)

    def local_grads(self, params):
        """The pieces of this rank's gradient shards that belong to `params` (the engine's
        grad_pieces): what the optimizer steps these parameters with after sync_grads."""
        return self.engine.grad_pieces(params)

    def reduce_sum_sq(self, local):
        """The global sum of squares: the ranks of a shard group hold different shards, so
        sum them (replicas hold the same ones: not over them)."""
        return all_reduce_number(self.shard_group, local, "sum",
                                 self.engine.units[0].param_shard)

    def after_step(self):
        self.engine.after_step()

    def global_mean(self, value):
        return all_reduce_number(self.group, value, "avg", self.engine.units[0].param_shard)

    def any_rank(self, flag):
        return any_rank_of(self.group, flag)

    # ---- checkpoints ------------------------------------------------------------------------
    def job_group(self):
        return self.group

    def save_plan(self, model, optimizer, step, rng_states, extra):
        """This rank's shards of a sharded checkpoint of the shard group's shards; under
        hybrid sharding the first shard group writes it (the others hold the same shards)
        and every rank of the dp group commits it (learns how that went)."""
        return shard_plan(model, optimizer, self.shard_group, step, rng_states, extra,
                          writes=self.writes_checkpoint())

    def writes_checkpoint(self):
        """Whether this rank writes its shards into a checkpoint: in the first shard group
        (all of them without hybrid sharding)."""
        return self.replicas is None or self.replicas.rank == 0

    def load(self, directory, model, optimizer):
        """Each shard group reads its shards (any checkpoint, any layout); under hybrid
        sharding every rank of the dp group agrees before any shard changes. `optimizer`
        None: the parameters' shards alone, into the engine (no m, v or master read)."""
        return load_sharded(directory, model, optimizer, self.shard_group, world=self.group,
                            engine=self.engine)

    def whole_state(self, model, optimizer):
        """(params, optimizer state_dict) in one process's format, gathered to dp rank 0
        ((None, None) elsewhere). Collective over the dp group."""
        return gather_whole(optimizer, root=0)

    def load_whole_state(self, model, optimizer, params, opt_sd):
        """This rank's shards cut from whole arrays by name (`optimizer` None: the
        parameters' alone). Collective over the dp group."""
        load_whole(params, opt_sd, optimizer, engine=self.engine)

    def optimizer_type(self, optimizer):
        return optimizer_type(optimizer)

    def zero_strategy(self):
        """This one: its engine holds the whole model it wrapped (TensorParallel's sharded
        checkpoints of each tp part, also under --cp)."""
        return self

    def save_pretrained(self, model, directory, dtype="float32"):
        """GPT-2's format (minidist/nn/pretrained.py), the full parameters gathered to rank 0
        one unit at a time. Collective."""
        from minidist.nn.pretrained import save_state_pretrained
        state = self.engine.full_state_dict()
        if self.rank == 0:
            save_state_pretrained(model.config, state, directory, dtype=dtype)
        self.group.barrier()

    # ---- the end of a run: memory and communication -----------------------------------------
    def memory_rows(self, optimizer):
        """Every rank's ledger row (measured now, between steps) with `optimizer`'s state,
        gathered to rank 0 (None elsewhere), each with its rank and the transient peak
        (stage 2 buckets, stage 3 gather buffers)."""
        self.engine.free()
        row = memory.ledger(self.model.parameters(), optimizer, self.activations)
        row.update(rank=self.rank, transient=self.engine.transient_peak)
        return self.group.gather_object(row, root=0)

    def predicted_states(self, experts=None):
        """The ZeRO paper's model-state bytes of this rank: the dense parameters at this
        stage over the group, plus `experts` (memory.ExpertStates) at stage 1 over theirs."""
        amp = self.amp is not None
        itemsize = 2 if amp else self.engine.units[0].flat.dtype.itemsize
        grad = self.engine.units[0].flat.grad_dtype.itemsize     # 4: --grad-dtype float32
        n_experts = experts.params if experts else 0
        dense = memory.zero_model_states(self.n_params - n_experts, self.shard_group.size,
                                         self.stage, amp=amp, itemsize=itemsize,
                                         grad_bytes=grad)
        if not n_experts:
            return dense
        mine = memory.zero_model_states(n_experts, experts.ranks, 1, amp=amp,
                                        itemsize=itemsize, grad_bytes=grad)
        return {k: dense[k] + mine[k] for k in dense}

    def summary(self):
        within, across = self.step_bytes
        sent = within + across
        psi = sum(u.flat.padded * u.flat.dtype.itemsize for u in self.engine.units)
        hybrid = "" if self.replicas is None else (
            f", {across / 2**20:.2f} MiB of it across the shard groups ({across / psi:.2f} x; "
            f"2(R-1)/(RK) = {2 * (self.replicas.size - 1) / self.world_size:.2f} x)")
        n = self.world_size
        if n == 1:                     # (was "0.00 MiB ... (0.00 x; DDP sends ... 0.00 x)")
            return (f"ZeRO-{self.stage} over 1 rank: nothing sent, the one rank owns every "
                    f"shard ({psi / 2**20:.2f} MiB of parameters)")
        # the paper's stage 3 re-gathers every block in backward; minidist's gathers no unit
        # still in its buffer (minidist/zero/README.md): the root once a step, the last two
        # blocks once at the turn to backward, and under --grad-accum the first two blocks
        # once at the next micro-batch's forward (a pipeline's order decides its own)
        paper = (f"; the paper's ZeRO-3 3(N-1)/N = {3 * (n - 1) / n:.2f} x per micro-batch, "
                 "less each gather of a unit still in its buffer: the root's after the "
                 "step's first, the last two blocks' at the turn to backward, the first two "
                 "blocks' at the next micro-batch's forward"
                 if self.stage == 3 else "")
        return (f"ZeRO-{self.stage} over {self.over()} ({self.group.algo_text(RING_OPS)}): "
                f"{sent / 2**20:.2f} MiB sent per rank per step for {psi / 2**20:.2f} MiB "
                f"of parameters ({sent / psi:.2f} x{hybrid}{paper}; DDP sends "
                f"2(N-1)/N = {2 * (n - 1) / n:.2f} x"
                + (f", Muon's update all-gather and reduce-scatter "
                   f"{self.opt.update_bytes() / psi:.2f} x more"
                   if isinstance(self.opt, ShardedMuon) else "") + ")")

    def finish(self, args, log, experts=None):
        """The traffic summary and the memory table. `experts` (under --ep, a
        memory.ExpertStates): this rank's experts are ZeRO-1 at any stage
        (minidist/ep/optim.py), so they are predicted apart, and measured with the optimizer
        of dense and experts."""
        rows = self.memory_rows(experts.optimizer if experts else self.opt)   # gathers landed
        if self.gather_group is not None and self.step_bytes is not None:
            within, across = self.step_bytes
            gathers = (self._gather_bytes() - self._gathered) / self._steps
            self.step_bytes = (within + gathers, across)
        if self.step_bytes is not None:
            log.print0(self.summary())
        if self.rank == 0:
            log.print0(memory.zero_table(
                rows, self.predicted_states(experts), self.stage, self.n_params, experts,
                None if self.replicas is None else self.shard_group.size))
        if args.trace:
            trace.write_chrome_trace(args.trace, self.group)
            log.print0(f"trace of every collective written to {args.trace} "
                       "(open it in https://ui.perfetto.dev or chrome://tracing)"
                       + trace.kept_note())
