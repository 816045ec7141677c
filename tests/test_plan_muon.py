"""The planners under --optimizer muon, worked by hand: its state, its Newton-Schulz per ZeRO
rank and its gathers, with experts too; and a Muon plan's command is one training accepts,
its optimizer flags training's."""
import json
from dataclasses import replace

import pytest

from minidist.nn import GPT, GPTConfig
from minidist.train.args import train_parser
from minidist.train.cost import step_time
from minidist.train.planner import Layout, bill, stage_params
from minidist.train.run_bill import plan

from tests.plan_cases import MOE_TOY, PROPOSAL_MODELS, TOY, UNIT, plan_cli, training_refusal


# ---- --optimizer muon: its state, its Newton-Schulz and its gathers, worked by hand -----------

def test_muon_state_bytes_worked_by_hand():
    """TOY's blocks hold 4 matrices each, c_attn 4 x 12 (48), c_proj 4 x 4 (16), c_fc 4 x 16
    (64) and c_proj 16 x 4 (64): 192, 384 of its 536 parameters. Muon keeps M alone for
    them: 4 B less each where the optimizer is per parameter. One process, float32: AdamW's
    8 x 536 = 4288 B, Muon's 4288 - 4 x 384 = 2752 (M 4 x 384 + m, v 8 x 152); --amp
    (masters 4, m 4, v 4): 12 x 536 - 4 x 384 = 4896. TP2: 300 parameters a rank (2 x 134
    in the blocks: the split matrices and c_attn's bias halved; wte's half 16, wpe 8, ln_f
    8), 192 of them Muon's halves: 8 x 300 - 4 x 192 = 1632. ZeRO-1 over 2: the flat v
    spans the matrices too, AdamW's 8 x 268 = 2144. MOE_TOY under ep 2 (no ZeRO): block 1
    keeps its attention (64), router 4 x 2 (8) and this rank's one expert (128) by Muon: 192
    + 200 = 392 of 544: 8 x 544 - 4 x 392 = 2784; with ZeRO-1 AdamW's again."""
    from minidist.train.planner import stage_muon_params
    assert stage_muon_params(TOY) == [384] and stage_muon_params(TOY, tp=2) == [192]
    assert stage_params(TOY, tp=2) == [300]
    expect = [(Layout(amp=False), 4288, 2752), (Layout(amp=True), 6432, 4896),
              (Layout(tp=2, amp=False), 2400, 1632),
              (Layout(dp=2, zero=1, amp=False), 2144, 2144)]
    for layout, adamw, muon in expect:
        assert bill(TOY, layout, 2)["optimizer"] == adamw
        assert bill(TOY, replace(layout, muon=True), 2)["optimizer"] == muon, layout
    assert stage_muon_params(MOE_TOY, ep=2) == [392]
    ep2 = Layout(dp=4, ep=2, amp=False, muon=True)
    assert bill(MOE_TOY, ep2, 2)["optimizer"] == 8 * 544 - 4 * 392 == 2784
    assert bill(MOE_TOY, replace(ep2, zero=1), 2)["optimizer"] == \
        bill(MOE_TOY, replace(ep2, zero=1, muon=False), 2)["optimizer"]
    assert replace(ep2, zero=1).name() == "EP2 x ZeRO-1 x4 (fp32)"    # the plan says Muon


def test_muon_step_worked_by_hand():
    """TOY at 1 FLOP/s and 1 B/s, sync 10 s. Newton-Schulz, 5 steps of 4 A^2 B + 2 A^3 on
    the wide orientation (A <= B): a 4 x 4 matrix 5 x (256 + 128) = 1920, so c_attn (4, 12),
    which packs q, k and v, 3 x 1920 = 5760 (as one 4 x 12 matrix it would be 5 x (768 +
    128) = 4480), c_proj 1920, c_fc and the MLP's c_proj (4, 16) 5 x (1024 + 128) = 5760
    each: 19200 a block, 38400 for both.
    One process (and DDP x2: every rank all of them): 38400 s more, nothing sent. At the
    float32 rate: with a 16-bit peak of 4 FLOP/s --amp's step computes 4 x faster, its NS
    (on the float32 masters) does not.
    TP2: each split matrix's NS on one tp rank (muon.tp_owners, the costliest first to the
    least busy, ties in block order): c_attn to the first, c_fc to the other, the MLP's
    c_proj to the first (a tie), c_proj to the other: 11520 s against 7680, each block
    waits for the 11520 (the second block turns the order: the other rank's 11520), 23040
    for both; each split matrix's update all-gathered first (4 B a value; over 2 ranks 1/2
    of it received): c_attn 192 B -> 96 s, c_proj 64 -> 32, c_fc and c_proj 256 -> 128
    each, + 10 s of sync each: 424 s a block, and the owners' steps reduce-scattered after
    (the same bytes and syncs) 424 s more: 848 s a block.
    ZeRO-1 over 2: each block's unit (244 values: ln_1 0-8, c_attn 8-56 and its bias 56-68,
    c_proj 68-84 and 84-88, ln_2 88-96, c_fc 96-160 and 160-176, c_proj 176-240 and its
    bias) is all-gathered (976 B, 488 s) and its steps reduce-scattered (488 s); each matrix
    is one rank's, the costliest first to the least busy (muon.balance; ties in unit order,
    ranks from the unit's `first`): c_attn to the first rank, c_fc to the other, the MLP's
    c_proj to the first (a tie), c_proj to the other: 11520 s against 7680; each unit waits
    for the 11520; both: 23040 s of NS and 1952 s of collectives.
    ZeRO-1 over dp 2 x TP2: the same dp owners, and each dp rank shares the split matrices
    it owns with its tp peer (ShardedMuon's tp_owners, as TP2's): the first dp rank's c_attn
    and MLP c_proj one per tp rank, 5760 s, each gathered and reduce-scattered over tp,
    2 x (96 + 10) + 2 x (128 + 10) = 488 s: 6248 s; the other's c_fc and c_proj, 5760 s (the
    busiest tp rank) + 2 x (128 + 10) + 2 x (32 + 10) = 360 s: 6120 s. Each unit waits for
    the first's (5760, 488) and gathers and reduce-scatters itself (134 values on a tp rank,
    536 B), 268 s each: (5760, 1024) a unit, (11520, 2048) for both (when each tp rank ran
    its dp rank's whole NS and gathered only: 23040 s of NS, 1560 s of collectives).
    PP2: a block a stage, 19200 s."""
    from minidist.optim.muon import ns_flops, packed_flops
    assert [ns_flops(s) for s in ((4, 12), (4, 4), (4, 16), (16, 4))] == \
        [4480, 1920, 5760, 5760]
    assert ns_flops((4, 16), steps=3) == 3 * 1152
    assert packed_flops((4, 12), (4, 4, 4)) == 5760 and packed_flops((4, 12)) == 4480
    unit = replace(UNIT, sync_s=10.0)

    def both(layout, global_batch=1, micro_batches=1, cluster=unit):
        muon = step_time(TOY, replace(layout, muon=True), cluster, 2, global_batch,
                         micro_batches)
        adamw = step_time(TOY, layout, cluster, 2, global_batch, micro_batches)
        assert muon["optimizer"] - adamw["optimizer"] == pytest.approx(muon["muon_ns"])
        assert muon["step"] - adamw["step"] == pytest.approx(muon["muon_ns"] +
                                                             muon["muon_comm"])
        return muon["muon_ns"], muon["muon_comm"]
    assert both(Layout(amp=False)) == (38400, 0)
    assert both(Layout(dp=2, amp=False), 2) == (38400, 0)
    fast16 = replace(unit, peak_tflops=4e-12, peak_tflops_fp32=1e-12)
    assert both(Layout(amp=True), cluster=fast16) == (38400, 0)
    assert both(Layout(tp=2, amp=False)) == (2 * 11520, pytest.approx(2 * 2 * 424))
    assert both(Layout(dp=2, zero=1, amp=False), 2) == (23040, 1952)
    assert both(Layout(dp=2, tp=2, zero=1, amp=False), 2) == \
        (2 * 5760, pytest.approx(2 * (488 + 2 * 268)))
    assert both(Layout(pp=2, amp=False), 2, 2) == (19200, 0)


def test_muon_with_experts_worked_by_hand():
    """MOE_TOY (block 1 a MoE block: router 4 x 2, NS 5 x (4 x 4 x 4 + 2 x 8) = 400; two
    experts, c_fc and c_proj 5760 each), 1 FLOP/s, 1 B/s. DDP x4: block 0 19200, block 1
    5760 + 1920 + 400 + 2 x 11520 = 31120. EP2: this rank's one expert, 19600. EP2 x ZeRO-1
    over 4 (each matrix one rank's, muon.balance): block 0's unit, its four matrices on four
    ranks: 5760, gathered and reduce-scattered 2 x 3/4 x 976 B = 1464 s; block 1's dense
    unit (attention, norms, router: 104 values) c_attn, c_proj, router on three ranks:
    5760, 2 x 3/4 x 416 = 624 s; its experts' unit (one expert, 148, over edp 2: c_fc and
    c_proj a rank each) 5760, 2 x 1/2 x 592 = 592 s."""
    def muon(layout):
        t = step_time(MOE_TOY, layout, UNIT, seq=2, global_batch=4)
        return t["muon_ns"], t["muon_comm"]
    assert muon(Layout(dp=4, amp=False, muon=True)) == (19200 + 31120, 0)
    assert muon(Layout(dp=4, ep=2, amp=False, muon=True)) == (19200 + 19600, 0)
    assert muon(Layout(dp=4, ep=2, zero=1, amp=False, muon=True)) == \
        (5760 + 5760 + 5760, 1464 + 624 + 592)


@pytest.mark.parametrize("config", [
    GPTConfig(n_layer=2, n_head=4, n_embd=32, block_size=16, vocab_size=64),
    GPTConfig(n_layer=2, n_head=4, n_embd=32, block_size=16, vocab_size=64, moe_experts=4,
              moe_top_k=2, moe_shared=1, moe_every=2),
    GPTConfig(n_layer=2, n_head=4, n_embd=32, block_size=16, vocab_size=64, arch="llama",
              n_kv_head=2, bias=False)], ids=["gpt2", "moe", "llama"])
def test_muon_ns_per_zero_rank_is_the_sharded_optimizers(config):
    """The ranks' NS work under ZeRO is ShardedMuon's: for a real model's block units
    (zero/flat.py gpt_units) over n ranks, each Muon matrix is one rank's (zero/muon.py
    unit_owners, which ShardedMuon runs by); the planner prices per unit the most any rank
    runs, after a gather of the unit's padded flat U and before a reduce-scatter of the
    steps (4 B a value each). The packed matrices (c_attn's q, k, v; SwiGLU's gate, up) are
    the model's (strategy/base.py matrix_views), the planner's from the config alone."""
    from minidist.optim.muon import packed_flops
    from minidist.strategy.base import matrix_views
    from minidist.train.muon_cost import muon_times
    from minidist.zero.flat import gpt_units
    from minidist.zero.muon import unit_owners
    model = GPT(config, seed=0)
    packed = matrix_views(model)["packed"]
    assert {n.split(".", 3)[3] for n in packed} == (
        {"attn.c_attn.weight", "mlp.c_fc.weight"} if config.llama else
        {"attn.c_attn.weight"})
    for n in (2, 3, 5):
        want_ns = want_bytes = 0
        for k, f in enumerate(gpt_units(model, n, 0)):
            owners = unit_owners(f, n, k, packed=packed)
            if not owners:
                continue                                    # the root: nothing gathered
            want_ns += max(sum(packed_flops(f.shapes[i], packed.get(f.names[i]))
                               for i, o in owners.items() if o == r) for r in range(n))
            want_bytes += 2 * 4 * f.padded
        layout = Layout(dp=n, zero=1, amp=False, muon=True)
        got = muon_times(config, layout, UNIT, 1.0, lambda op, nbytes: nbytes)
        assert got == [(want_ns, want_bytes)], n


def test_a_muon_plans_command_is_one_training_accepts(capsys):
    """    python examples/plan.py --gpus 8 --optimizer muon --muon-ns-steps 3
    prices Muon and its `run it:` command trains with it (--optimizer muon, --muon-ns-steps
    3: what was priced), a command train_gpt.py's checks accept (check_layout); so does
    every row of a Muon search (the default 5 iterations left out of the command), and a
    hand layout. plan_memory.py --optimizer muon: a row per candidate with Muon's state."""
    from minidist.train.cluster import H100_IB
    from minidist.train.search import search, train_flags
    from minidist.train.strategy import check_layout
    plan_cli().main(["--gpus", "8", "--optimizer", "muon", "--muon-ns-steps", "3", "--json",
                      "--top", "1"])
    result = json.loads(capsys.readouterr().out)
    assert result["optimizer"] == "muon" and result["rows"][0]["muon_ns_steps"] == 3
    assert result["rows"][0]["muon"] and result["rows"][0]["muon_ns"] > 0
    run = result["command"].split()
    args = train_parser().parse_args(run[9:])                 # (after --device, --comm nccl)
    assert (args.optimizer, args.muon_ns_steps) == ("muon", 3)
    check_layout(args, 8)                                     # training accepts it
    plan_cli().main(["--gpus", "8", "--optimizer", "muon", "--layout", "dp=4,tp=2,zero=1",
                      "--top", "1"])
    out = capsys.readouterr().out
    assert "Muon (5 Newton-Schulz steps)" in out and out.rstrip().endswith("--optimizer muon")
    for config in PROPOSAL_MODELS[::2]:
        rows = search(config, H100_IB, 8, config.block_size, 32, muon=True)
        assert all(r["muon"] for r in rows)
        assert not [r for r in rows if training_refusal(config, r, 8)]
        flags = train_flags(config, rows[0])
        assert flags[-2:] == ["--optimizer", "muon"] and "--muon-ns-steps" not in flags
    # plan_memory.py: the same candidates, Muon's state (the DDP rows 4 B less a matrix
    # parameter, ZeRO's the same), its rows' commands what training runs
    memory = {muon: plan(PROPOSAL_MODELS[1], 8, muon=muon) for muon in (False, True)}
    assert memory[True]["optimizer"] == "muon"
    for adamw, muon in zip(memory[False]["rows"], memory[True]["rows"]):
        assert muon["muon"] and muon["layout"] == adamw["layout"]
        assert (muon["optimizer"] < adamw["optimizer"]) == (not muon["zero"])
        row = {**muon, "micro_batch": 1, "micro_batches": muon["pp"], "schedule": "1f1b"}
        assert training_refusal(PROPOSAL_MODELS[1], row, 8) is None


def test_the_planners_optimizer_flags_are_training_s():
    """--optimizer's choices and default, and plan.py's --muon-ns-steps default, are
    train_gpt.py's; plan_memory.py --measure trains with --optimizer (it changes what it
    measures), where every other planning flag is refused."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("plan_memory", "examples/plan_memory.py")
    memory = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(memory)

    def choices(parser):
        return {a.dest: a.choices for a in parser._actions}["optimizer"]
    train = train_parser()
    assert tuple(choices(memory.parser())) == tuple(choices(train)) == ("adamw", "muon")
    cli = plan_cli()
    for name in ("optimizer", "muon_ns_steps"):
        assert getattr(cli.parse([]), name) == train.get_default(name)
    assert memory.parser().get_default("optimizer") == train.get_default("optimizer")
    for choice in choices(train):
        assert cli.parse(["--optimizer", choice]).optimizer == choice
    p = memory.parser()
    assert memory.measure_problem(p.parse_args(["--measure", "--optimizer", "muon"]), p) is None
