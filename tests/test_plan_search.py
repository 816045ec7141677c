"""The layout search (minidist/train/search.py) and plan.py's command line: the splits and
micro-batch counts tried, gradients accumulated where the whole batch does not fit, and
examples/plan.py --json's rows, its train_gpt command that training accepts, a bad --layout."""
import json
import subprocess
import sys

from minidist.nn import GPTConfig
from minidist.train.args import train_parser
from minidist.train.planner import config_for_params

from tests.plan_cases import training_refusal


def test_plan_cli():
    """python examples/plan.py --params 7e9 --gpus 64 --json: rows fastest first, the best
    fits, its train_gpt command passes train_gpt's checks; a bad --layout is one error line
    and exit 2."""
    out = subprocess.run([sys.executable, "examples/plan.py", "--params", "7e9", "--gpus", "64",
                          "--seq", "4096", "--json", "--top", "3"],
                         capture_output=True, text=True, timeout=60, check=True)
    result = json.loads(out.stdout)
    steps = [r["step"] for r in result["rows"]]
    assert steps == sorted(steps) and result["rows"][0]["fits"]
    assert result["best"] == result["rows"][0]["layout"]
    run = result["command"].split()                     # the best row, as a train_gpt command
    assert run[:5] == ["mpirun", "-n", "64", "python", "examples/train_gpt.py"]
    # on GPUs, GPU to GPU: the bandwidth priced (walk 32's leftover: no --comm nccl)
    assert run[5:9] == ["--device", "cuda", "--comm", "nccl"]
    from minidist.train.strategy import check_layout
    check_layout(train_parser().parse_args(run[9:]), 64)          # training accepts it
    nosp = subprocess.run([sys.executable, "examples/plan.py", "--params", "7e9", "--gpus",
                           "8", "--seq", "4096", "--json", "--global-batch", "8", "--layout",
                           "tp=8,nosp"], capture_output=True, text=True, timeout=60, check=True)
    row = json.loads(nosp.stdout)["rows"][0]
    assert not row["sp"] and row["replicated"] > 0 and row["sync"] > 0
    bad = subprocess.run([sys.executable, "examples/plan.py", "--gpus", "8", "--layout",
                          "dp=4,tp=4"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.startswith("error: --layout")
    # the table's command says how to train in the vocabulary planned with
    table = subprocess.run([sys.executable, "examples/plan.py", "--params", "7e9", "--gpus",
                            "64", "--seq", "4096", "--top", "1"], capture_output=True,
                           text=True, timeout=60, check=True).stdout
    assert "run it (planned with a 50,257-token vocabulary: add --data, a folder of token " \
        "files in it, as nanoGPT or llm.c write them; without, train_gpt.py trains 256 " \
        "bytes): mpirun -n 64" in table, table


def test_search_splits_and_micro_batches():
    """8 ranks, 8 per node, 4 heads, 2 layers: tp in {1, 2, 4}, cp a power of two dividing
    the sequence, pp up to the layers, dp the rest and dividing the batch."""
    from minidist.train.search import micro_batch_counts, splits
    got = splits(GPTConfig(n_layer=2, n_head=4, n_embd=64), 8, 8, seq=64, global_batch=8)
    assert all(dp * tp * pp * cp == 8 for dp, tp, pp, cp in got)
    assert {tp for _, tp, _, _ in got} == {1, 2, 4} and max(pp for *_, pp, _ in got) == 2
    assert (8, 1, 1, 1) in got and (1, 4, 2, 1) in got and (2, 1, 1, 4) in got
    assert micro_batch_counts(1, 64) == [1, 2, 4, 8, 16, 32, 64]     # --grad-accum
    assert micro_batch_counts(1, 12) == [1, 2, 4]
    assert micro_batch_counts(4, 64) == [4, 8, 16, 32]


def test_search_accumulates_gradients_where_the_whole_batch_does_not_fit():
    """    python examples/plan.py --params 7e9 --gpus 8 --seq 4096 --global-batch 512
    proposed PP2 x ZeRO-1 x4 with full recompute, 42.3 s a step: without a pipeline the search
    tried one micro-batch of the whole per-rank batch (64 sequences), which fits nowhere.
    Now it tries --grad-accum 1, 2, 4, ... up to the first count that fits (more only costs
    time: checked for every layout here), and proposes ZeRO-1 with 64 micro-batches of one
    sequence, no recompute: 27.3 s, the command training's checks accept (32 of 2, proposed
    until 2026-11-30 at 71.9 GiB of planner.bill, are 79.3 GiB of the memory check's bill
    with their logits and buffers: over the 72 of 80 the search keeps)."""
    from minidist.train.cluster import H100_IB
    from minidist.train.search import search, train_flags
    config = config_for_params(7e9, 4096)
    rows = search(config, H100_IB, 8, 4096, 512)
    best = next(r for r in rows if r["fits"])
    assert best["layout"] == "ZeRO-1 (amp, tiled)" and best["micro_batches"] == 64, best
    assert best["step"] < 30 and training_refusal(config, best, 8) is None
    flags = train_flags(config, best)
    assert flags[flags.index("--grad-accum") + 1] == "64" and "--ckpt-activations" not in flags
    by_layout = {}
    for r in rows:
        if r["pp"] == 1:
            by_layout.setdefault(r["layout"], []).append(r)
    for name, tried in by_layout.items():
        counts = sorted(r["micro_batches"] for r in tried)
        assert counts == [2 ** i for i in range(len(counts))], (name, counts)
        assert [r["fits"] for r in sorted(tried, key=lambda r: r["micro_batches"])][:-1] == \
            [False] * (len(tried) - 1), name          # stopped at the first that fits
        steps = [r["step"] for r in sorted(tried, key=lambda r: r["micro_batches"])]
        assert steps == sorted(steps), (name, steps)   # accumulating never priced faster
