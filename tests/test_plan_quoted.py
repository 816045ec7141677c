"""The step-time figures README.md and minidist/train/PLAN.md quote from examples/plan.py,
against what plan.py prints now: each quoted command is run (in this process: the planner is
arithmetic) and its rows' figures, formatted as the docs quote them, must be in the docs'
sentences. A change of the model that moves a quoted figure fails here, not silently (until
2026-11-29 several had drifted: `ZeRO-3/8` quoted at 0.173 s where plan.py printed 0.161, the
search's ZeRO-1 x `--grad-accum 32` at 29.7 s where it printed 27.3, Muon's PP8 at 5.86 s
where it printed 5.48). Historical figures ("before -> after", "was") are not checked."""
import json

import pytest

from tests.plan_cases import plan_cli

# (plan.py's flags, {key: (layout as the table names it, micro-batches, figure)}, [(doc,
# sentence with {key} where the figure goes)]); figure: "step" (s, 2 decimals unless
# "step3"), "mem" (GiB, 1 decimal), "mfu" (2 decimals)
QUOTED = [
    ("--params 1.3e9 --seq 2048 --global-batch 256 --gpus 64",
     {"h": ("ZeRO-3/8 (amp, tiled)", 1, "step3"), "z": ("ZeRO-3 (amp, tiled)", 1, "step3"),
      "hm": ("ZeRO-3/8 (amp, tiled)", 1, "mem"), "zm": ("ZeRO-3 (amp, tiled)", 1, "mem")},
     [("README.md", "`ZeRO-3/8` {h} s against ZeRO-3's {z} s"),
      ("minidist/train/PLAN.md", "puts `ZeRO-3/8` first ({h} s\nagainst plain ZeRO-3's {z} s, "
       "{hm} against {zm} GiB per GPU)")]),
    ("--params 7e9 --gpus 64 --seq 32768 --global-batch 64",
     {"r4": ("CP4 x ZeRO-3/8 x16 (amp, tiled)", 4, "step"),
      "r8": ("CP8 x ZeRO-3/8 x8 (amp, tiled)", 4, "step"),
      "u8": ("CP8u x ZeRO-3/8 x8 (amp, tiled)", 4, "step"),
      "tp": ("TP4+SP x ZeRO-3/2 x16 (amp, tiled)", 4, "step")},
     [("README.md", "the ring {r8} s, Ulysses {u8} s at CP8 x ZeRO-3/8 x8"),
      ("README.md", "TP4+SP x ZeRO-3/2 x16 without cp leads, {tp} s)"),
      ("minidist/train/PLAN.md", "CP4 x ZeRO-3/8 x16 with 4\nmicro-batches at {r4} s and CP8 x "
       "ZeRO-3/8 x8 at {r8} s a step, against Ulysses' {u8} s"),
      ("minidist/train/PLAN.md", "leads the table at {tp} s")]),
    ("--params 7e9 --gpus 8 --seq 4096",
     {"z1": ("ZeRO-1 (amp, tiled)", 64, "step1"), "m": ("ZeRO-1 (amp, tiled)", 64, "mem")},
     [("README.md", "ZeRO-1 x `--grad-accum 64` at {z1} s a step"),
      ("minidist/train/PLAN.md", "`--grad-accum 64` (one sequence a micro-batch, {m} GiB),\n"
       "{z1} s")]),
    ("--params 7e9 --gpus 8 --seq 4096 --grad-dtype float32",
     {"z1": ("ZeRO-1 (amp, fp32 grads, tiled)", 64, "step1"),
      "m": ("ZeRO-1 (amp, fp32 grads, tiled)", 64, "mem")},
     [("minidist/train/PLAN.md", "`--grad-accum 64` ({m} GiB, {z1} s")]),
    ("--params 7e9 --seq 4096 --gpus 64",
     {"a": ("ZeRO-3/8 (amp, tiled)", 4, "step"), "pp": ("PP8 x ZeRO-1 x8 (amp, tiled)", 64,
                                                          "step"),
      "am": ("ZeRO-3/8 (amp, tiled)", 4, "mem")},
     [("minidist/train/PLAN.md", "`ZeRO-3/8` accumulating 4 micro-batches, {a} s"),
      ("minidist/train/PLAN.md", "still leads with `ZeRO-3/8`, at {am} GiB for 48.9"),
      ("minidist/train/PLAN.md", "0.30; {pp} s with AdamW)")]),
    ("--params 7e9 --seq 4096 --gpus 64 --optimizer muon",
     {"a": ("ZeRO-3/8 (amp, tiled)", 4, "step"), "pp": ("PP8 x ZeRO-1 x8 (amp, tiled)", 64,
                                                          "step"),
      "mfu": ("PP8 x ZeRO-1 x8 (amp, tiled)", 64, "mfu")},
     [("minidist/train/PLAN.md", "3.43 s, takes {a} s"),
      ("minidist/train/PLAN.md", "proposes `PP8 x ZeRO-1 x8` at {pp} s (MFU\n{mfu};"),
      ("minidist/train/PLAN.md", "`PP8 x ZeRO-1 x8`'s {pp} (TP's own")]),
]


def figure(row, kind):
    """A row's figure as the docs write it."""
    if kind.startswith("step"):
        return f"{row['step']:.{int(kind[4:] or 2)}f}"
    if kind == "mem":
        return f"{row['mem']['total'] / 2**30:.1f}"
    return f"{row[kind]:.2f}"


@pytest.mark.parametrize("flags,figures,sentences", QUOTED, ids=[q[0] for q in QUOTED])
def test_the_docs_quote_what_plan_py_prints(flags, figures, sentences, capsys):
    """Each quoted plan.py command's figures, from its --json rows, are the docs'."""
    plan_cli().main(flags.split() + ["--json", "--top", "100000"])
    rows = json.loads(capsys.readouterr().out)["rows"]
    values = {}
    for key, (layout, micro, kind) in figures.items():
        found = [r for r in rows if r["layout"] == layout and r["micro_batches"] == micro]
        assert len(found) == 1, (layout, micro)
        values[key] = figure(found[0], kind)
    for doc, sentence in sentences:
        text = sentence.format(**values)
        assert text in open(doc).read(), (doc, text)
