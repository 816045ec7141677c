"""Dropout masks keyed by where a number sits, not by who draws it or in what order.

The numbers of one dropout site (a Dropout module, named by its place in the whole GPT, e.g.
"transformer.h.3.attn.resid_dropout"), at one training step, in one row of that step's
GLOBAL batch, are Philox4x32-10's (minidist/autograd/philox.py), a counter-based generator:

    element i of the row (its flat index in the row's whole, unsliced shape) is word i % 4 of
    philox4x32(counter = (i // 4 low 32 bits, i // 4 high 32 bits, global row, step),
               key = (seed, crc32(site name)))          as a float32 in [0, 1) (top 24 bits)

(ops.dropout keeps an element where its number is >= p). Each number is a pure function of
its place, so a rank computes exactly the numbers of the elements it holds, on its own device,
and they are one process's numbers:

    data parallelism   rank r's rows are rows r*B/dp .. of the global batch: their own keys
                       (a shared generator gave every dp rank the same masks on its rows)
    --grad-accum       micro-batch i's rows keep their global numbers
    pipelines          a stage keys its blocks by their global names and each micro-batch
                       by its rows (a generator per stage drew other masks than one process)
    expert parallelism a token's experts' masks are its row's (minidist/nn/moe.py)
    tensor parallelism a rank computes its heads (attention weights) or positions (sequence
                       parallelism) of the row, nothing else (DropoutSite's axis)
    tiled attention    a tile computes its (query, key) block's numbers (flash.py)
    --ckpt-activations the recompute draws the same keys (recompute.py restores step, rows)

`DropoutKeys` holds the seed, the step the masks are for, and the global rows of the
micro-batch in flight; train_step (minidist/train/step.py) advances the step once per
optimizer step and sets the rows around each micro-batch (the pipeline narrows them per
micro-batch: minidist/pp/microbatches.py). A forward outside train_step, in training mode,
draws new masks each call, as a generator would (GPT.forward advances the step there).
The state in checkpoints is the step alone. On a GPU the counters are built and hashed on
the device (the same xp lines): no mask crosses the host link.

The step on the device (cupy with MINIDIST_CUDA_NEW_KERNELS=1, where the Philox and flash
kernels draw): a captured CUDA graph (examples/bench_step.py --cuda-graph) replays every
launch with the arguments it was captured with, so the kernels read the step through a
pointer. `count` is how many next_step calls the host has made (restore leaves it alone:
it is the live step, `step` the one drawn for, a snapshot's while a recompute redraws);
`counter` holds the count on the device, made from `count` at a kernel's first draw
(`device_step`), and next_step advances both, the device one by a device op, which a
capture records. A kernel draws for step counter[0] - (count - step). The rule: in stream
order the counter equals `count` as the host saw it at each launch, eager or captured; a
replay advances the counter alone, so after replays the host's count and step are behind
by the replays less one (the capture ran nothing) until `settle()` reads the counter back
(one host read; state_dict does, so a checkpoint holds the true step). The rows, bases and
columns the kernels read are uploaded once per distinct content and kept (`on_device`):
the same each step, they are found there, and a step uploads nothing, which a capture
could not hold. On the CPU none of this runs: the numbers, and the numpy path, are as
before, unless `run` is set (tests/test_dropout_device_step.py sets the CPU harness that
runs the kernels, tests/cuda_cpu.py, and so takes the device path on numpy).
Tests: tests/test_dropout_keys.py; every strategy's exactness with --dropout; the step on the
device: tests/test_dropout_device_step.py, tests/test_cuda_philox_cpu.py.
"""
import contextlib
import zlib

import numpy as np

from minidist import backend
from minidist.autograd import cuda_kernels_new as _ckn
from minidist.autograd.cuda_kernels import launch
from minidist.autograd.philox import MASK32, philox4x32, to_unit_float32

HOST_CHUNK = 1 << 14    # counters hashed at a time on the host (cache-sized; a GPU takes all)
MAX_UPLOADS = 1024      # on_device's kept arrays: cleared past this (a run needs a few dozen)


class DropoutKeys:
    """The run's dropout key: `seed`, `step` (the optimizer step the masks are for, advanced
    by `next_step`), `rows` (the global batch rows of the micro-batch in flight; None: a
    forward outside a step, whose rows are 0 .. B-1); `run`: see kernel_run."""

    def __init__(self, seed, run=None):
        self.seed, self.step, self.rows = int(seed), 0, None
        self.positions = None       # context parallelism: (this rank's positions, whole T)
        self.count = 0              # next_step calls (the live step; restore leaves it)
        self.counter = None         # the count on the device, once a kernel draws
        self.run = run              # what runs the Philox kernel for any xp (kernel_run)
        self._uploads = {}          # on_device's: (module, shape, bytes) -> device array

    def kernel_run(self, xp):
        """What executes the Philox kernel's plan for arrays of xp, or None: the xp code
        (philox_numbers). `run` where set (the CPU harness, on numpy: the device path
        taken on the CPU), else cuda_kernels.launch where the new kernels are on
        (cuda_kernels_new.new_on: cupy, MINIDIST_CUDA_NEW_KERNELS=1)."""
        if self.run is not None:
            return self.run
        return launch if _ckn.new_on(xp) else None

    @property
    def uploads_kept(self):
        """How many arrays on_device keeps (after a step's first draws: no more)."""
        return len(self._uploads)

    def next_step(self):
        """New masks from here on (once per optimizer step, or per forward outside one); the
        device counter advances too (a device op: a captured graph's replays run it)."""
        self.step += 1
        self.count += 1
        if self.counter is not None:
            self.counter += 1

    def device_step(self, xp):
        """(counter, lag) for a kernel: it draws for step counter[0] - lag, i.e. `step`.
        counter: (1,) int64 on xp holding the count (made here from it on first use: call
        it outside a capture, as the warm-up's eager steps do); lag: count - step (0 but
        while a snapshot older than the last next_step is redrawn)."""
        if self.counter is None or backend.xp_of(self.counter) is not xp:
            self.counter = xp.asarray(np.array([self.count], dtype=np.int64))
        return self.counter, self.count - self.step

    def settle(self):
        """Catch the host's count and step up with the device counter (one host read; none
        without a counter): a replayed graph advanced the counter alone."""
        if self.counter is None:
            return
        now = int(backend.host_read(self.counter, "dropout step (settle)")[0])
        self.step += now - self.count
        self.count = now

    def on_device(self, a, xp):
        """Host ints `a` as an int64 array on xp, uploaded once per distinct content and
        kept (MAX_UPLOADS): a step's rows, bases and columns are the same every step, so
        after the first they are found here and the step uploads nothing."""
        a = np.ascontiguousarray(a, dtype=np.int64)
        key = (xp.__name__, a.shape, a.tobytes())
        if key not in self._uploads:
            if len(self._uploads) >= MAX_UPLOADS:
                self._uploads.clear()
            self._uploads[key] = xp.asarray(a)
        return self._uploads[key]

    @contextlib.contextmanager
    def rows_of(self, rows):
        """Draw for these global rows (ints, one per row of the batch in flight) inside."""
        before, self.rows = self.rows, np.asarray(rows, dtype=np.int64)
        try:
            yield
        finally:
            self.rows = before

    @contextlib.contextmanager
    def positions_of(self, positions, T):
        """Inside, a (B, Tl, C) site's positions are `positions` (Tl host ints) of a
        sequence of T (context parallelism's scattered pieces, minidist/cp/context.py)."""
        before, self.positions = self.positions, (np.asarray(positions, dtype=np.int64), T)
        try:
            yield
        finally:
            self.positions = before

    def rows_in_flight(self, n):
        """The global numbers of the n rows in flight: `rows`, or 0 .. n-1 outside a step."""
        return np.arange(n) if self.rows is None else self.rows

    def snapshot(self):
        """(step, rows, positions): what a recompute restores to draw its forward's masks
        again."""
        return self.step, self.rows, self.positions

    def restore(self, snapshot):
        self.step, self.rows, self.positions = snapshot

    @contextlib.contextmanager
    def as_of(self, snapshot):
        """Inside, the keys are as `snapshot` says (a backward redrawing its forward's
        numbers: flash.py's AttnDropout); then as they were."""
        now = self.snapshot()
        self.restore(snapshot)
        try:
            yield
        finally:
            self.restore(now)

    def state_dict(self):
        """What a checkpoint keeps: the step, settled first, and the seed the masks are
        drawn from (the model's: load_state_dict checks it)."""
        self.settle()
        return {"step": self.step, "seed": self.seed}

    def load_state_dict(self, state, seed_may_change=False):
        """The step a checkpoint's masks were at. Its seed (checkpoints before 2026-11-28
        have none) must be this model's unless `seed_may_change` (train_gpt.py's --resume
        with another --seed, which its resumed line notes): a model built with another seed
        drew other masks, silently (first-use walk 29's own-loop resume, 3e-2 off)."""
        saved = state.get("seed")
        if saved is not None and int(saved) != self.seed and not seed_may_change:
            raise ValueError(f"dropout keys: the checkpoint's masks are drawn from seed "
                             f"{int(saved)}, this model's from seed {self.seed}: build the "
                             f"model with seed={int(saved)}, as the run that saved it was")
        self.step = self.count = int(state["step"])
        if self.counter is not None:
            self.counter.fill(self.count)       # a device op: no upload

    def numbers(self, name, rows, base, cols, xp=np):
        """Site `name`'s float32 numbers in [0, 1) at this step: out[..., j] is the number
        at flat index base[...] + cols[j] of global row rows[...]. rows, base: host integer
        arrays broadcast together to S; cols: 1-D host ints; out: S + (len(cols),), on xp.

        When cols is a run of whole Philox blocks (4 aligned numbers, and base a multiple
        of 4) each call yields 4 numbers; otherwise each number picks its word of its own
        call (the same numbers, 4x the work)."""
        rows, base, cols = (np.asarray(a, dtype=np.int64) for a in (rows, base, cols))
        S, L = np.broadcast_shapes(rows.shape, base.shape), len(cols)
        whole = (L and L % 4 == 0 and cols[0] % 4 == 0 and not (base % 4).any()
                 and np.array_equal(cols, cols[0] + np.arange(L)))
        up = self.on_device if self.kernel_run(xp) else backend.to_device  # kept: kernels
        firsts = up(cols[::4] if whole else cols, xp)
        shape = S + (len(firsts),)                                        # L, or L/4
        flat = xp.broadcast_to(up(base, xp)[..., None] + firsts, shape).ravel()
        row = xp.broadcast_to(up(rows, xp)[..., None], shape).ravel()
        u = self.philox_numbers(name, flat >> 2, row, xp)                   # (n, 4)
        if whole:
            return u.reshape(S + (L,))
        return u[xp.arange(flat.size), flat & 3].reshape(S + (L,))   # each its own word

    def philox_key(self, name):
        """Site `name`'s Philox key: (the seed folded to 32 bits, crc32 of the name)."""
        seed = int(self.seed) % 2 ** 64
        return (seed ^ (seed >> 32)) & MASK32, zlib.crc32(name.encode())

    def philox_numbers(self, name, blocks, rows, xp):
        """(n, 4) float32: Philox's four words for counters (blocks[i] low and high halves,
        rows[i], step) under this site's key, as numbers in [0, 1); hashed HOST_CHUNK
        counters at a time on the host (the arrays stay in cache), all at once on a
        device (one kernel, cuda_source_philox.py, where kernel_run gives one: the step
        read on the device, kernel_numbers)."""
        run = self.kernel_run(xp)                # cupy, MINIDIST_CUDA_NEW_KERNELS=1
        if run is not None:
            return self.kernel_numbers(name, blocks, rows, xp, run)          # one launch
        key = self.philox_key(name)
        n = blocks.size
        out = xp.empty((n, 4), dtype=xp.float32)
        chunk = HOST_CHUNK if xp is np else max(n, 1)
        for lo in range(0, n, chunk):
            b = blocks[lo:lo + chunk].astype(xp.uint64)
            counter = (b & xp.uint64(MASK32), b >> xp.uint64(32), rows[lo:lo + chunk],
                       self.step)
            for j, w in enumerate(philox4x32(counter, key, xp)):
                out[lo:lo + chunk, j] = to_unit_float32(w, xp)
        return out

    def kernel_numbers(self, name, blocks, rows, xp, run):
        """philox_numbers by the Philox kernel (cuda_source_philox.py), the step read on the
        device (device_step); `run` executes the plan (the GPU's launch, or the CPU harness
        on numpy in tests/test_cuda_philox_cpu.py)."""
        return _ckn.philox_uniforms(xp, run, blocks, rows, self.device_step(xp),
                                    self.philox_key(name))


class DropoutSite:
    """What one Dropout module draws from: the keys' numbers for the site `name`, computed
    for the elements this rank holds. Under tensor parallelism a rank holds a slice of the
    tensor along `axis` (`parts` slices, this rank's `index`): its elements' places in the
    whole row are offset along that axis; `active()` False (no sequence split in this
    forward): no slice. `seq_axis`: the sequence's axis, where context parallelism's
    positions (the keys' `positions`, while set) say which places of the row a rank holds."""

    def __init__(self, keys, name, axis=None, parts=1, index=0, active=None, seq_axis=None):
        self.keys, self.name = keys, name
        self.axis, self.parts, self.index, self.active = axis, parts, index, active
        self.seq_axis = seq_axis

    def random(self, shape, dtype="float32", xp=np):
        """The numbers of a whole local tensor of `shape` (rows first), on xp."""
        return self.block(shape, [np.arange(n) for n in shape[1:]], xp).astype(dtype,
                                                                             copy=False)

    def block(self, shape, coords, xp=np):
        """The numbers of a sub-block of a local tensor of `shape` (B, ...): every row, and
        along each further axis d the local indices coords[d - 1] (1-D host ints); float32
        (B,) + (len(c) for c in coords)."""
        row, coords = list(shape[1:]), [np.asarray(c, dtype=np.int64) for c in coords]
        if self.sliced():
            row[self.axis - 1] *= self.parts                        # the whole row's shape
            coords[self.axis - 1] = coords[self.axis - 1] + self.index * shape[self.axis]
        if self.seq_axis is not None and self.keys.positions is not None:
            positions, T = self.keys.positions                      # scattered: cp
            row[self.seq_axis - 1] = T
            coords[self.seq_axis - 1] = positions[coords[self.seq_axis - 1]]
        strides = np.cumprod([1] + row[:0:-1])[::-1]                # C order, elements
        lead = coords[:-1]                                          # the last axis: cols
        base = np.zeros((), dtype=np.int64)                         # (len(c) for c in lead)
        for d, c in enumerate(lead):
            base = base + (c * strides[d]).reshape((-1,) + (1,) * (len(lead) - d - 1))
        rows = self.rows(shape[0]).reshape((-1,) + (1,) * len(lead))
        return self.keys.numbers(self.name, rows, base[None], coords[-1], xp)

    def sliced(self):
        """This rank holds a slice of the tensor along `axis` (in this forward)."""
        return (self.axis is not None and self.parts > 1
                and (self.active is None or self.active()))

    def start(self, shape, axis):
        """Where this rank's part of a local tensor of `shape` starts along `axis` in the
        whole row (tensor parallelism's heads or positions; 0 when not sliced there)."""
        return self.index * shape[axis] if self.axis == axis and self.sliced() else 0

    def at(self, n, batch_rows, base, cols, xp=np):
        """Numbers at flat places of the whole row (no slicing: MoE's experts, nn/moe.py)
        for a batch of n rows: batch_rows (each entry's row in it), base, cols as
        DropoutKeys.numbers."""
        rows = self.rows(n)[np.asarray(batch_rows)]
        return self.keys.numbers(self.name, rows, base, cols, xp)

    def rows(self, n):
        """The global numbers of the n rows in flight (checked against the keys' rows)."""
        rows = self.keys.rows_in_flight(n)
        if len(rows) != n:
            raise ValueError(f"dropout {self.name}: {n} rows drawn, but the batch in flight "
                             f"has {len(rows)} (DropoutKeys.rows_of)")
        return rows


def uniforms(rng, shape, xp):
    """Dropout's float32 numbers for a tensor of `shape` on xp: a DropoutSite computes them
    there; a numpy Generator (a Dropout built with rng=...) draws rng.random(shape) on the
    host, moved."""
    if isinstance(rng, DropoutSite):
        return rng.random(shape, "float32", xp)
    return backend.to_device(rng.random(shape, dtype="float32"), xp)
