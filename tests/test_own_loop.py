"""Each strategy used from your own training loop: the recipes that minidist/ddp/README.md,
minidist/zero/README.md and minidist/tp/README.md show are the core lines of
examples/own_loop_ddp.py, own_loop_zero.py and own_loop_tp.py, and those scripts train a tiny
GPT (float64, dropout; DDP and ZeRO with two micro-batches a step, ZeRO saved and resumed)
to one process's parameters, so a recipe cannot drift from code that works.

A script marks its recipe with `# --- the recipe (<chapter>) ---` and
`# --- end of the recipe ---`; the lines between them, dedented, must be a ```python block of
that chapter, word for word (first-use walk 29: only the DDP chapter showed a loop, and users
got the order of calls wrong silently).
Run: python -m pytest -q tests/test_own_loop.py
"""
import re
import textwrap

import pytest

from mpirun import ROOT

# script -> the number of runs it compares with one process at 2 ranks (DDP: 3 modes, ZeRO:
# 3 stages, TP: sequence parallelism off and on)
SCRIPTS = {"examples/own_loop_ddp.py": 3, "examples/own_loop_zero.py": 3,
           "examples/own_loop_tp.py": 2}
RECIPE = re.compile(r"^( *)# --- the recipe \(([\w/.]+)\) ---\n(.*?)"
                    r"^\1# --- end of the recipe ---", re.M | re.S)


def recipes(script):
    """(chapter, snippet) for each recipe the script marks."""
    text = open(f"{ROOT}/{script}").read()
    return [(chapter, textwrap.dedent(body)) for _, chapter, body in RECIPE.findall(text)]


@pytest.mark.parametrize("script", SCRIPTS)
def test_each_chapter_shows_its_scripts_recipe_word_for_word(script):
    """The recipe between the markers is a ```python block of the chapter it names."""
    found = recipes(script)
    assert len(found) == 1, f"{script}: {len(found)} marked recipes, expected 1"
    chapter, snippet = found[0]
    doc = open(f"{ROOT}/{chapter}").read()
    assert f"```python\n{snippet}```\n" in doc, (
        f"{chapter} does not show {script}'s recipe word for word; the script's lines:\n"
        f"{snippet}")


@pytest.mark.mpi
@pytest.mark.parametrize("script, ranks", [(s, 2) for s in SCRIPTS]
                         + [("examples/own_loop_tp.py", 4)])
def test_own_loop_trains_one_process_numbers(script, ranks, mpi):
    """mpiexec -n 2 python examples/own_loop_ddp.py (own_loop_zero.py, own_loop_tp.py), and
    mpiexec -n 4 python examples/own_loop_tp.py --tp 2 (the recipe's DDP across the tp groups,
    a no-op on 2 ranks): every run's parameters within 1e-10 of one process's (the script
    exits 1 otherwise)."""
    out = mpi(ranks, script, *(["--tp", "2"] if ranks == 4 else []), timeout=180).stdout
    diffs = [float(line.rsplit("= ", 1)[1]) for line in out.splitlines()
             if "max |parameter - one process| = " in line]
    assert len(diffs) == SCRIPTS[script] and all(d <= 1e-10 for d in diffs), out


@pytest.mark.parametrize("flags, says", [(["--dropout", "2"], "--dropout 2.0: a probability"),
                                         (["--steps", "0"], "--steps 0: give at least 1"),
                                         (["--tol", "nan"], "--tol nan: give a difference")])
def test_a_bad_check_flag_is_one_line(flags, says):
    """python examples/own_loop_tp.py --dropout 2: the GPT's ValueError, a traceback and
    MPI_Abort; --steps 0 compared nothing and passed (first-use walk, session 35)."""
    import subprocess
    import sys
    from mpirun import mpi_env
    out = subprocess.run([sys.executable, "examples/own_loop_tp.py", *flags], cwd=ROOT,
                         env=mpi_env(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stderr.startswith(f"error: {says}"), out.stderr
    assert out.stderr.count("\n") == 1 and out.stdout == ""
