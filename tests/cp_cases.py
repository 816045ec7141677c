"""Shared by the context-parallel tests (tests/test_context_parallel.py, test_cp_exact.py,
test_cp_ulysses.py): the flags' check, the exactness check of a cp_check.py run, and
examples/train_gpt.py's tiny model, its losses and its sample."""
from minidist.train.args import train_parser
from tests.mpirun import within


def _flags(*extra):
    return train_parser().parse_args(["--block-size", "16", "--batch-size", "4", *extra])


def _check_exact(rows, runs):
    """Every run present, equal to one process (NaN fails: each difference compared alone),
    the cp bytes = the formula."""
    assert [r["run"] for r in rows] == runs
    for r in rows:
        assert within(r, 1e-10), r
        assert r["bytes_sent"] == r["theory_sent"]
        assert r.get("tp_sent") == r.get("tp_theory_sent"), r       # cp x tp: the tp group


TINY = ["--n-layer", "2", "--n-head", "2", "--n-embd", "16", "--block-size", "16",
        "--batch-size", "4", "--lr", "1e-2", "--eval-iters", "2", "--log-every", "1",
        "--steps", "3", "--eval-every", "0", "--dtype", "float64", "--sample", "20"]


def _losses(path):
    import json
    return [r.get("loss", r.get("val_loss")) for r in map(json.loads, open(path))]


def _sample(stdout):
    assert stdout.count("---- sample ----") == 1, stdout            # printed by rank 0 alone
    return stdout.split("---- sample ----\n")[1].split("\n----------------")[0]
