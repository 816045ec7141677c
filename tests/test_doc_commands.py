"""The docs' `examples/train_gpt.py` commands get past the checks a run makes before step 0.

Every command line in a fenced code block of README.md, the chapters and examples/*.md that
runs examples/train_gpt.py (a `\\` continuation joined, a trailing `# comment` cut) and names
no file of the reader's own (`--data`, `--resume`, `--init-from`, `--tokenizer`) nor a GPU
(`--comm nccl`, `--device cuda`) is parsed by train_gpt.py's parser and put through
`check_flags` and `check_layout` with its `mpirun -n` (1 without one): what a reader pasting
it meets in its first second. README.md's `--zero 2 --amp --grad-dtype float32 --grad-accum
8` on 4 ranks (and the train chapter's) was refused there: the default --batch-size 16 does
not split into 4 ranks x 8 micro-batches (first-use walk, session 35). Placeholders (`N`,
`DIR`, `[--flag]`, `a|b`) are left out.

    python -m pytest -q tests/test_doc_commands.py
"""
import re
import shlex

import pytest

from minidist.train.args import parse_train_flags
from minidist.train.cli import check_flags
from minidist.train.strategy import check_layout
from tests.test_docs import DOCS, ROOT

FILES = ("--data", "--resume", "--init-from", "--tokenizer")
GPU = ("nccl", "cuda")


def _placeholder(word):
    return (word in ("N", "DIR", "F", "P") or word.isupper() or any(c in word for c in "$[|<`")
            or "..." in word)


def doc_commands():
    """(where, ranks, flags) of every such command in the docs."""
    found = []
    for doc in DOCS:
        for block in re.findall(r"```(?:bash)?\n(.*?)```", doc.read_text(), re.S):
            for line in re.sub(r"\\\n\s*", " ", block).splitlines():
                for part in line.split("  #")[0].split(" # ")[0].split("&&"):
                    try:
                        words = shlex.split(part)
                    except ValueError:
                        continue
                    at = [i for i, w in enumerate(words) if w.endswith("train_gpt.py")]
                    if not at or (words[at[0] + 1:] and not words[at[0] + 1].startswith("--")):
                        continue
                    flags = words[at[0] + 1:]
                    if any(f in flags for f in FILES) or any(g in flags for g in GPU) or \
                            any(_placeholder(f) for f in flags):
                        continue
                    ranks = int(words[words.index("-n") + 1]) if "-n" in words else 1
                    where = f"{doc.relative_to(ROOT)}: -n {ranks} {' '.join(flags)}"
                    found.append((where, ranks, flags))
    return found


COMMANDS = doc_commands()


def test_the_docs_show_many_commands():
    """The search finds the quick start's commands (it would pass vacuously otherwise)."""
    assert len(COMMANDS) > 80, len(COMMANDS)
    assert any("--dp 2 --tp 2 --pp 2" in where for where, _, _ in COMMANDS)


@pytest.mark.parametrize("where,ranks,flags", COMMANDS, ids=[c[0] for c in COMMANDS])
def test_every_command_the_docs_show_passes_the_checks_before_step_0(where, ranks, flags,
                                                                     tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)          # --save ckpt, --log-json x: made (and checked) here
    args = parse_train_flags(flags)
    check_flags(args)
    check_layout(args, ranks)
