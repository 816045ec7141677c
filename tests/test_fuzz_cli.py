"""A seeded fuzz of examples/train_gpt.py's command line (tests/scripts/fuzz_cli.py): tiny runs
with a few flags drawn from the parser's own table, each a usual value, an edge or a wrong
one, on 1, 2 or 4 ranks; each must train (exit 0) or refuse in exactly one `error:` line,
exit 2, no traceback, printed once, and end. A short campaign runs by default (a refusal
takes ~0.2 s, a run ~1 s), a longer one is marked slow; the README's Reliability table cites
a larger one.
"""
import json
import sys

import pytest

from tests.mpirun import run_job


def _campaign(tmp_path, trials, seed):
    out = tmp_path / "trials.json"
    run = run_job([sys.executable, "tests/scripts/fuzz_cli.py", "--trials", trials, "--seed",
                   seed, "--work", tmp_path / "w", "--json", out], timeout=1800, check=False)
    records = json.loads(out.read_text())
    assert len(records) == trials, run.stdout + run.stderr
    broken = [r for r in records if r["violations"]]
    assert not broken, json.dumps(broken, indent=1)
    assert run.returncode == 0, run.stdout + run.stderr
    return records


def test_a_short_fuzz_of_the_command_line_breaks_no_rule(tmp_path):
    """python tests/scripts/fuzz_cli.py --trials 30 --seed 1: some trials train, the rest
    are one line each (the campaign's summary line counts both)."""
    records = _campaign(tmp_path, 30, 1)
    assert any(r["rc"] == 0 for r in records) and any(r["rc"] == 2 for r in records)


@pytest.mark.slow
def test_a_longer_fuzz_of_the_command_line_breaks_no_rule(tmp_path):
    """python tests/scripts/fuzz_cli.py --trials 400 --seed 4 (a few minutes)."""
    _campaign(tmp_path, 400, 4)
