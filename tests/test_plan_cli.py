"""plan.py's input: a hand --layout (refused as training refuses it), a size it cannot plan,
a GPU count with no layout; --layout takes a layout's name as the tables print it."""
import json
from dataclasses import replace

import pytest

from minidist.nn import GPTConfig
from minidist.train.planner import Layout, config_for_params, stage_params
from minidist.train.run_bill import plan

from tests.plan_cases import PROPOSAL_MODELS, plan_cli, plan_error, training_refusal

# ---- plan.py's input: a hand layout, a size it cannot plan, a GPU count with no layout -------

# (plan.py flags, the start of its error line): a run train_gpt refuses (most were priced,
# with a `run it:` command that failed), a key unknown, repeated or not a whole number (a
# traceback for micro=abc and micro=0)
LAYOUT_BAD = [
    (["--gpus", "8", "--layout", "dp=8,tp=1,pp=1,cp=1,zero=5"], "--layout: zero=5: the ZeRO"),
    (["--gpus", "6", "--layout", "dp=2,tp=3,pp=1"], "--layout: tp=3: --n-head 4 is not"),
    (["--gpus", "8", "--layout", "dp=1,pp=8"], "--layout: pp=8: --pp 8 stages for --n-layer 4"),
    (["--layout", "dp=8,micro=abc"], "--layout: micro=abc: micro takes a whole number"),
    (["--gpus", "8", "--layout", "dp=8,micro=0"], "--layout: micro=0: must be at least 1"),
    (["--gpus", "8", "--layout", "dp=-8"], "--layout: dp=-8: dp takes a whole number"),
    (["--gpus", "8", "--layout", "dp=8,speed=2"], "--layout: cannot read 'speed=2'"),
    (["--gpus", "8", "--layout", "dp=4,dp=8"], "--layout: dp is given twice"),
    (["--gpus", "8", "--seq", "12", "--layout", "dp=2,cp=4"], "--layout: cp=4: --block-size 12"),
    (["--gpus", "8", "--layout", "dp=8,ep=2"], "--layout: ep=2: ep > 1 needs a Mixture"),
    (["--gpus", "4", "--global-batch", "12", "--schedule", "interleaved", "--layout",
      "dp=2,pp=2,micro=3"], "--layout: pp=2: --pp-virtual 2: --micro-batches 3 must be"),
    (["--gpus", "8", "--layout", "dp=8,micro=3"], "--layout: dp=8 x micro=3 = 24 micro-batch"),
    (["--gpus", "16", "--layout", "dp=16,shard=8"], "--layout: shard=8: hybrid sharding needs "
     "zero=1, 2 or 3"),
    (["--gpus", "16", "--layout", "dp=16,zero=3,shard=3"], "--layout: shard=3: --zero-shard 3: "
     "the ranks each replica is sharded over must divide dp 16"),
    (["--gpus", "16", "--layout", "dp=8,tp=2,zero=1,shard=3"], "--layout: shard=3: "
     "--zero-shard 3: the ranks each replica is sharded over must divide dp 8"),
    # audit 18: both recomputes, the last silently winning; selective under the ring's tiles
    (["--gpus", "8", "--attention", "materialized", "--layout", "dp=8,ckpt,selective"],
     "--layout: ckpt and selective: give one recompute"),
    (["--gpus", "8", "--attention", "materialized", "--layout", "dp=4,cp=2,selective"],
     "--layout: selective: the ring keeps no scores to recompute"),
    (["--gpus", "8", "--layout", "dp=8,selective"], "--layout: selective: tiled attention "
     "keeps no scores to recompute"),
]


@pytest.mark.parametrize("argv,says", LAYOUT_BAD, ids=[" ".join(a) for a, _ in LAYOUT_BAD])
def test_plan_layout_refuses_what_training_refuses(argv, says, capsys):
    """    python examples/plan.py --gpus 6 --layout dp=2,tp=3,pp=1
    One error line naming the key, exit 2: the layouts train_gpt.py refuses (its own checks,
    search.layout_problems), keys that are unknown, repeated or not whole numbers."""
    assert plan_error(argv, capsys).startswith("error: " + says)


def test_every_layout_the_search_proposes_passes_the_layout_check():
    """The search (on 8 and 6 GPUs, 1F1B and interleaved, a MoE model too) proposes only
    layouts that plan.py --layout takes: layout_problems is [] for each of its rows; and a
    micro-batch count without a pipeline is train_gpt's --grad-accum, which it accepts."""
    from minidist.train.cluster import H100_IB
    from minidist.train.search import layout_problems, search, train_flags
    for config in PROPOSAL_MODELS:
        for gpus in (6, 8):
            for schedule, v in (("1f1b", 1), ("interleaved", 2)):
                for row in search(config, H100_IB, gpus, config.block_size, 48, schedule,
                                  v=v):
                    layout = Layout(**{k: row[k] for k in Layout.__dataclass_fields__})
                    assert layout_problems(config, layout, gpus, 48, row["micro_batches"],
                                           schedule, v) == [], row["layout"]
    config = PROPOSAL_MODELS[0]
    row = {**vars(Layout(dp=8)), "micro_batches": 2, "micro_batch": 2, "schedule": "1f1b"}
    flags = train_flags(config, row)
    assert flags[flags.index("--grad-accum") + 1] == "2" and "--micro-batches" not in flags
    assert training_refusal(config, row, 8) is None


def test_layout_names_are_unique_and_name_zero():
    """Every distinct layout of a search has its own name (ZeRO under dp 1 x cp 4 was
    dropped: three rows read "TP2+SP x CP4"), for a dense and a MoE model, and of the
    memory planner's candidates."""
    from minidist.train.cluster import H100_IB
    from minidist.train.search import search
    fields = list(Layout.__dataclass_fields__)
    for config, batch in ((GPTConfig(n_layer=4, n_head=4, n_embd=128, block_size=1024), 3),
                          (PROPOSAL_MODELS[2], 32)):
        for rows in (search(config, H100_IB, 8, config.block_size, batch),
                     plan(config, 8)["rows"], plan(config, 16)["rows"]):
            named = {}
            for row in rows:
                named.setdefault(row["layout"], set()).add(tuple(row[k] for k in fields))
            assert all(len(layouts) == 1 for layouts in named.values()), \
                {n: s for n, s in named.items() if len(s) > 1}
    cp4 = Layout(tp=2, cp=4, sp=True, zero=3, tiled=True)
    assert cp4.name() == "TP2+SP x CP4 x ZeRO-3 (amp, tiled)"
    assert Layout(tp=2, cp=4, sp=True, tiled=True).name() == "TP2+SP x CP4 (amp, tiled)"


def test_params_the_planner_cannot_build_is_one_line(capsys):
    """    python examples/plan.py --params 1e3
    planned a one-layer model of h 256 (14M parameters) without a word: refused, naming the
    smallest size it can plan; a size it can build prints its real count on the model line,
    within 2x of the request from half the smallest up (1.2e7 was h 512, 29M: now h 256)."""
    from minidist.train.plan_args import count_text
    least = sum(stage_params(config_for_params(1, 1024)))
    says = plan_error(["--params", "1e3"], capsys)
    assert says.startswith("error: --params 1000: the smallest model") and \
        f"has {count_text(least)} parameters" in says
    asked = float(says.split("give --params ")[1].split()[0])
    assert least / 2 <= asked <= 2 * least                  # what it says to give is planned
    for n in [asked * 1.1 ** i for i in range(0, 240, 7)]:   # up to ~1e17
        got = sum(stage_params(config_for_params(n, 1024)))
        assert n / 2 <= got <= 2 * n, n
    plan_cli().main(["--params", str(asked), "--gpus", "8", "--top", "1"])
    model = capsys.readouterr().out.splitlines()[0]
    got = sum(stage_params(config_for_params(asked, 1024)))
    assert model.startswith(f"model: {count_text(got)} parameters (L=")


def test_the_model_line_of_a_moe_plan_says_what_params_sized(capsys):
    """    python examples/plan.py --params 7e9 --moe-experts 8 --moe-top-k 2 --gpus 64
    printed "model: 39B parameters" with nothing saying that --params sizes the dense shape
    whose MLPs become the experts (found by a first-use walk); the line now gives both."""
    from minidist.train.plan_args import count_text
    plan_cli().main(["--params", "1e8", "--moe-experts", "4", "--moe-every", "2",
                      "--gpus", "8", "--top", "1"])
    model = capsys.readouterr().out.splitlines()[0]
    dense = config_for_params(1e8, 1024)
    moe = sum(stage_params(replace(dense, moe_experts=4, moe_every=2)))
    assert model.startswith(f"model: {count_text(moe)} parameters: the "
                            f"{count_text(sum(stage_params(dense)))} dense shape (L="), model
    assert "what --params sizes) with the MLP of one block in 2 made 4 experts, top-1" in model


def test_no_valid_layout_is_told_apart_from_none_fitting(capsys):
    """    python examples/plan.py --gpus 7
    printed an empty table and "best: nothing fits" (exit 0) for a 7M-parameter model: no
    split of 7 GPUs divides the batch, the heads and the layers. Now one error line naming
    the nearest counts that have a layout (checked here: the search has rows for them and
    none between); --gpus 3 plans pp 3 (4 micro-batches and up divide 512), which training
    runs; where layouts exist but none fits, the line says the least memory one needs."""
    from minidist.train.cluster import H100_IB
    from minidist.train.planner import GiB
    from minidist.train.search import micro_batch_counts, search
    config = GPTConfig(n_layer=4, n_head=4, n_embd=128, block_size=1024, vocab_size=50257)
    says = plan_error(["--gpus", "7"], capsys)
    assert says.startswith("error: --gpus 7: no layout of 7 GPUs divides --global-batch 512")
    lo, hi = (int(n) for n in says.split("try --gpus ")[1].split(" or "))
    for n in range(lo, hi + 1):
        assert bool(search(config, H100_IB, n, 1024, 512)) == (n in (lo, hi)), n
    assert micro_batch_counts(3, 512) == [4, 8, 16, 32]
    assert micro_batch_counts(3, 512, grouped=True) == []
    rows = search(config, H100_IB, 3, 1024, 512)
    assert rows and all(training_refusal(config, r, 3) is None for r in rows)
    plan_cli().main(["--params", "13e9", "--gpus", "2", "--seq", "4096", "--top", "1000",
                      "--json"])          # (7e9 fits now: ZeRO-3 accumulating 256 micro-batches)
    result = json.loads(capsys.readouterr().out)
    least = min(r["mem"]["total"] for r in result["rows"]) / GiB
    assert result["best"] is None and not any(r["fits"] for r in result["rows"])
    budget = H100_IB.mem_gib * 0.9                              # --headroom 0.1
    assert f"needs {least:.1f} GiB per GPU, over the {budget:.1f} GiB" in result["nothing_fits"]
    # --preset here: ranks share the machine's memory, so more ranks are no remedy (audit 18)
    plan_cli().main(["--preset", "here", "--params", "1e9", "--gpus", "4", "--global-batch",
                      "8", "--json"])
    says = json.loads(capsys.readouterr().out)["nothing_fits"]
    assert " GiB per rank, over the " in says and "add --gpus" not in says, says


# ---- --layout takes a name as the tables print it ----------------------------------------------

NAME_FIELDS = ("dp", "tp", "pp", "cp", "zero", "ep", "zero_shard", "recompute", "sp", "amp",
               "tiled", "overlap_gather")


@pytest.mark.parametrize("gpus,kw", [(64, {}), (16, {"moe_experts": 8, "moe_top_k": 2}),
                                     (16, {"tiled": False}), (8, {"amp": False})])
def test_every_name_the_search_prints_reads_back_as_its_layout(gpus, kw):
    """Layout.name's inverse, planner.layout_from_name: every row of a search (dense, MoE with
    ep, materialised attention with selective recompute, fp32; hybrid sharding and Ulysses
    where the GPUs span nodes) and overlapped gathers read back as the fields they name."""
    from minidist.train.cluster import H100_IB
    from minidist.train.planner import layout_from_name
    from minidist.train.search import search
    moe = {k: kw.pop(k) for k in ("moe_experts", "moe_top_k") if k in kw}
    config = GPTConfig(n_layer=4, n_head=8, n_embd=256, block_size=1024, vocab_size=50257,
                       **moe)
    rows = search(config, H100_IB, gpus, 1024, 64, **kw)
    names = {r["layout"]: r for r in rows}
    assert len(names) > 20 and any("/8" in n for n in names) == (gpus > 8), len(names)
    layouts = [Layout(**{k: r[k] for k in NAME_FIELDS}) for r in names.values()]
    layouts.append(replace(layouts[0], zero=1, overlap_gather=True))
    for layout in layouts:
        fields = layout_from_name(layout.name(), layout.gpus)
        assert not isinstance(fields, str), fields
        assert Layout(**fields) == replace(layout, cp_attention=fields.get(
            "cp_attention", layout.cp_attention)), layout.name()   # (named with cp > 1)


def test_plan_layout_takes_the_name_its_table_prints(capsys):
    """    python examples/plan.py --params 7e9 --gpus 16 --seq 4096 --layout "ZeRO-1/8 (amp,
        tiled)"
    was "cannot read 'ZeRO-1/8 (amp'": --layout took key=value items only. A name
    now prices the layout at every micro-batch count the search tries: its first row is the
    search's row of that name, the same command; amp and the attention must be the flags'."""
    base = ["--params", "7e9", "--gpus", "16", "--seq", "4096", "--json", "--top", "1000"]
    plan_cli().main(base)
    searched = json.loads(capsys.readouterr().out)
    for row in searched["rows"][:3] + searched["rows"][-2:]:
        plan_cli().main(base + ["--layout", row["layout"]])
        one = json.loads(capsys.readouterr().out)
        assert {r["layout"] for r in one["rows"]} == {row["layout"]}
        same = [r for r in searched["rows"] if r["layout"] == row["layout"]]
        assert one["rows"][0] == same[0] or not same[0]["fits"], row["layout"]
    assert searched["best"] and json.loads(
        (plan_cli().main(base + ["--layout", searched["best"]]), capsys.readouterr().out)[1]
    )["command"] == searched["command"]
    gpus8 = ["--params", "7e9", "--gpus", "8", "--seq", "4096"]
    assert plan_error(gpus8 + ["--layout", "ZeRO-1 (fp32, tiled)"], capsys) == (
        "error: --layout 'ZeRO-1 (fp32, tiled)': names a float32 layout: add --fp32")
    assert plan_error(gpus8 + ["--layout", "ZeRO-1 (amp)"], capsys) == (
        "error: --layout 'ZeRO-1 (amp)': has no 'tiled': it names materialized attention, as "
        "plan_memory.py prices it; give --attention materialized, or write the name with "
        "'tiled'")
    # first-use walk 27: a name in other letters fell to the key=value reader ("cannot read
    # 'Zero-3/8 (amp'"); and key=value without micro= priced one micro-batch only, "nothing
    # fits" where the same layout by name fitted with 4
    for text in ("zero-1 (AMP, Tiled)", "dp=8,zero=1"):
        plan_cli().main(gpus8 + ["--layout", text, "--json"])
        rows = json.loads(capsys.readouterr().out)["rows"]
        assert {r["layout"] for r in rows} == {"ZeRO-1 (amp, tiled)"}, text
        assert rows[0]["fits"] and rows[0]["micro_batches"] == 64, text
    assert plan_error(gpus8 + ["--layout", "TP2+SP x ZeRO-1 x4 (amp, tiled"], capsys) == (
        "error: --layout: 'TP2+SP x ZeRO-1 x4 (amp, tiled': its parentheses are not closed")
    assert plan_error(gpus8 + ["--layout", "TP2 x ZeRO-9 x4"], capsys).startswith(
        "error: --layout: cannot read 'ZeRO-9 x4' (a part such as TP2+SP")
    assert plan_error(gpus8 + ["--layout", "ZeRO-1 (amp, tiled, fast)"], capsys).startswith(
        "error: --layout: cannot read 'fast' in the parentheses (amp, fp32, tiled")
    assert plan_error(gpus8 + ["--layout", "TP2+SP x DDP x2 (amp, tiled)"], capsys) == (
        "error: --layout: dp x tp x pp x cp = 4, but --gpus is 8 (change the layout, or leave "
        "--layout out to search the ones train_gpt.py runs)")


def test_plan_takes_train_gpts_attention_recompute_and_pp_virtual(capsys):
    """    python examples/plan.py --params 1.3e9 --gpus 8 --seq 2048 --attention recompute
    train_gpt.py's --attention recompute (the (T, T) scores recomputed in backward) was
    "invalid choice" in plan.py, and its --pp-virtual was plan.py's --chunks. The search now
    prices only layouts that recompute, and every command it prints runs them so; a
    key=value layout recomputes the scores (selective) unless it says ckpt; a name that
    keeps the scores is refused; --pp-virtual is --chunks."""
    base = ["--params", "1.3e9", "--gpus", "8", "--seq", "2048", "--json", "--top", "1000"]
    plan_cli().main(base + ["--attention", "recompute"])
    result = json.loads(capsys.readouterr().out)
    assert {r["recompute"] for r in result["rows"]} == {"selective", "full"}
    assert "--attention recompute" in result["command"] or "--ckpt-activations" in \
        result["command"]
    for text, recompute in (("dp=8,zero=1", "selective"), ("dp=8,ckpt", "full")):
        plan_cli().main(base + ["--attention", "recompute", "--layout", text])
        assert {r["recompute"] for r in json.loads(capsys.readouterr().out)["rows"]} == {
            recompute}, text
    assert plan_error(base + ["--attention", "recompute", "--layout", "DDP (amp)"],
                       capsys) == ("error: --layout 'DDP (amp)': names attention that keeps "
                                   "its scores; give --attention materialized, or write the "
                                   "name with 'selective recompute'")
    runs = []
    for flag, v in (("--chunks", "4"), ("--pp-virtual", "4"), ("--pp-virtual", "2")):
        plan_cli().main(["--params", "7e9", "--gpus", "16", "--seq", "4096", "--json",
                          "--top", "1000", "--schedule", "interleaved", flag, v])
        runs.append(json.loads(capsys.readouterr().out))
    assert runs[0] == runs[1] and runs[1]["rows"] != runs[2]["rows"]   # the flag is read


def test_here_says_when_it_was_measured_and_a_busier_machine_now():
    """First-use walk 26: --preset here planned 0.075 s a step for a run that measured 0.56 s
    under a load of 4-7 from other jobs; the calibration was taken at load 0.02 and the plan
    did not say so. The cluster's name now gives the calibration's date and load, and the
    table a note where the load now is over half the cores above it."""
    from minidist.train.cluster import cluster_from_calibration
    plan = plan_cli()
    cal = json.load(open(plan.HERE))
    name = cluster_from_calibration(plan.HERE, 4).name
    assert name == f"here (measured {cal['date']} at load {cal['load_before']:.2f})"
    quiet = cal["load_before"] + cal["cores"] / 2
    assert plan.here_load_note("here", load=quiet) is None
    assert plan.here_load_note("h100", load=50.0) is None
    assert plan.here_load_note("here", load=6.0) == (
        f"the load average is 6.0 now, {cal['load_before']:.2f} when "
        f"examples/calibration_here.json was measured ({cal['date']}): steps run here now "
        "take longer than planned (python examples/calibrate_here.py measures again)")


def test_the_planners_take_train_gpts_names_for_the_batch_and_the_sequence(capsys):
    """First-use walk 26: a flag copied from train_gpt.py (--batch-size, --block-size) was an
    error in plan.py, whose names are --global-batch and --seq: both now take either."""
    plan = plan_cli()
    plan.main(["--params", "1e9", "--gpus", "8", "--seq", "2048", "--global-batch", "64",
               "--json"])
    ours = capsys.readouterr().out
    plan.main(["--params", "1e9", "--gpus", "8", "--block-size", "2048", "--batch-size", "64",
               "--json"])
    assert capsys.readouterr().out == ours and json.loads(ours)["global_batch"] == 64


def test_the_command_runs_the_bucket_size_the_plan_priced(capsys):
    """DDP's gradient bucket: on the h100 preset the plan prices 25 MiB (PyTorch DDP's
    default, the usual on GPUs) and its command says --bucket-mb 25 (until 2026-11-29 it
    priced 25 MiB and its command ran training's default, 1 MiB); --bucket-mb 4 prices and
    runs 4; training's own 1 prints no flag, nor does --preset here, whose default it is
    (its plans are checked against runs at 1 MiB), nor a ZeRO row (ZeRO reduce-scatters a
    unit at a time, call_cost.zero_units, and training refuses the flag under --zero). The size
    changes the calls priced (minidist/train/call_cost.py ddp_buckets, training's own cut: 1
    and 4 MiB cut 1.3B's tensors alike, 25 into fewer, so less latency), not this step: its
    last bucket, in view after backward, is the tied wte's alone (196 MiB) at any of these
    sizes (until 2026-11-29 an equal share of one all-reduce, so 25 MiB priced slower). Training
    runs each row."""
    base = ["--params", "1.3e9", "--gpus", "8", "--seq", "2048", "--global-batch", "64",
            "--json", "--layout"]
    steps = {}
    for layout, extra, mb, flag in (("dp=8", [], 25, " --bucket-mb 25"),
                                    ("dp=8", ["--bucket-mb", "4"], 4, " --bucket-mb 4"),
                                    ("dp=8", ["--bucket-mb", "1"], 1, None),
                                    ("dp=8,zero=1", [], 25, None)):
        plan_cli().main(base + [layout] + extra)
        out = json.loads(capsys.readouterr().out)
        row = out["rows"][0]
        assert row["bucket_mb"] == mb
        assert (flag in out["command"]) if flag else "--bucket-mb" not in out["command"]
        config = GPTConfig(**out["config"])
        assert training_refusal(config, row, 8) is None
        steps[layout, mb] = row["step"], row["dp_comm"], row["dp_exposed"]
    assert steps["dp=8", 25][1] < steps["dp=8", 4][1] == steps["dp=8", 1][1]
    assert steps["dp=8", 25][::2] == steps["dp=8", 4][::2] == steps["dp=8", 1][::2]
    plan_cli().main(["--preset", "here", "--n-layer", "2", "--n-embd", "64", "--seq", "64",
                     "--global-batch", "8", "--gpus", "2", "--layout", "dp=2", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["rows"][0]["bucket_mb"] == 1 and "--bucket-mb" not in out["command"]
