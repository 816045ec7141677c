"""Dropout masks keyed by where a number sits, not by who draws it or in what order.

The masks of one dropout site (a Dropout module, named by its place in the whole GPT, e.g.
"transformer.h.3.attn.resid_dropout"), at one training step, in one row of that step's
GLOBAL batch, are the float32 numbers

    rng([seed, DROPOUT_STREAM, crc32(site name), step, global row]).random(row shape)

(ops.dropout keeps an element where its number is >= p). No generator is shared and nothing
advances between draws, so every layout draws one process's masks:

    data parallelism   rank r's rows are rows r*B/dp .. of the global batch: their own keys
                       (a shared generator gave every dp rank the same masks on its rows)
    --grad-accum       micro-batch i's rows keep their global numbers
    pipelines          a stage keys its blocks by their global names and each micro-batch
                       by its rows (a generator per stage drew other masks than one process)
    expert parallelism a token's experts' masks are its row's (minidist/nn/moe.py)
    tensor parallelism a rank keeps its heads (attention weights) or positions (sequence
                       parallelism) of the row's numbers (DropoutSite's axis)
    --ckpt-activations the recompute draws the same keys (recompute.py restores step, rows)

`DropoutKeys` holds the seed, the step the masks are for, and the global rows of the
micro-batch in flight; train_step (minidist/train/step.py) advances the step once per
optimizer step and sets the rows around each micro-batch (the pipeline narrows them per
micro-batch: minidist/pp/microbatches.py). A forward outside train_step, in training mode,
draws new masks each call, as a generator would (GPT.forward advances the step there).
The state in checkpoints is the step alone.
Tests: tests/test_dropout_keys.py; every strategy's exactness with --dropout.
"""
import contextlib
import zlib

import numpy as np

from minidist import backend

DROPOUT_STREAM = 0x0D50  # the dropout streams, apart from the parameters' (nn/config.py)


class DropoutKeys:
    """The run's dropout key: `seed`, `step` (the optimizer step the masks are for, advanced
    by `next_step`), `rows` (the global batch rows of the micro-batch in flight; None: a
    forward outside a step, whose rows are 0 .. B-1)."""

    def __init__(self, seed):
        self.seed, self.step, self.rows = int(seed), 0, None

    def next_step(self):
        """New masks from here on (once per optimizer step, or per forward outside one)."""
        self.step += 1

    @contextlib.contextmanager
    def rows_of(self, rows):
        """Draw for these global rows (ints, one per row of the batch in flight) inside."""
        before, self.rows = self.rows, np.asarray(rows, dtype=np.int64)
        try:
            yield
        finally:
            self.rows = before

    def rows_in_flight(self, n):
        """The global numbers of the n rows in flight: `rows`, or 0 .. n-1 outside a step."""
        return np.arange(n) if self.rows is None else self.rows

    def snapshot(self):
        """(step, rows): what a recompute restores to draw its forward's masks again."""
        return self.step, self.rows

    def restore(self, snapshot):
        self.step, self.rows = snapshot

    def state_dict(self):
        """What a checkpoint keeps: the step (the seed is the run's)."""
        return {"step": self.step}

    def load_state_dict(self, state):
        self.step = int(state["step"])

    def row_draws(self, name, n_rows, row_shape, dtype):
        """(n_rows,) + row_shape numbers: row i's from its key (site `name`, this step, the
        global row rows[i]), on the host."""
        rows = self.rows_in_flight(n_rows)
        if len(rows) != n_rows:
            raise ValueError(f"dropout {name}: {n_rows} rows drawn, but the batch in flight "
                             f"has {len(rows)} (DropoutKeys.rows_of)")
        site = zlib.crc32(name.encode())
        out = np.empty((n_rows,) + tuple(row_shape), dtype=dtype)
        for i, row in enumerate(rows):
            key = [self.seed, DROPOUT_STREAM, site, self.step, int(row)]
            out[i] = backend.rng(key).random(tuple(row_shape), dtype=dtype)
        return out


class DropoutSite:
    """What one Dropout module draws from (`random(shape, dtype)`, as ops.dropout asks): the
    keys' numbers for the site `name`. Under tensor parallelism a rank holds a slice of the
    tensor along `axis` (`parts` slices, this rank's `index`): it draws the whole row and
    keeps its slice; `active()` False (no sequence split in this forward): no slice."""

    def __init__(self, keys, name, axis=None, parts=1, index=0, active=None):
        self.keys, self.name = keys, name
        self.axis, self.parts, self.index, self.active = axis, parts, index, active

    def random(self, shape, dtype="float64"):
        sliced = self.axis is not None and self.parts > 1 and (
            self.active is None or self.active())
        row = list(shape[1:])
        if sliced:
            row[self.axis - 1] *= self.parts
        draws = self.keys.row_draws(self.name, shape[0], row, dtype)
        if not sliced:
            return draws
        n = shape[self.axis]
        keep = (slice(None),) * self.axis + (slice(self.index * n, (self.index + 1) * n),)
        return draws[keep]
