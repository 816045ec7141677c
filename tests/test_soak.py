"""Long runs: what a step leaves behind does not pile up (tests/scripts/soak.py watches a run's
live objects, the items its containers hold, numpy arrays, file descriptors and threads
every few steps), and the records that grew with the run, --ep's exchange counts and
--trace's events, stay bounded.

    mpiexec -n 2 python tests/scripts/soak.py --every 100 --warmup 200 -- --steps 650 \\
        --n-layer 2 --n-embd 32 --n-head 2 --block-size 32 --batch-size 4 --sample 0 \\
        --eval-iters 2 --data FILE --ddp bucketed --save DIR --save-every 70 --async-save
"""
import numpy as np
import pytest

from mpirun import tagged_json

TINY = ["--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--block-size", "32",
        "--batch-size", "4", "--sample", "0", "--eval-iters", "2", "--log-every", "1000"]


def test_the_trace_keeps_the_last_events_of_a_long_run():
    """--trace kept every collective of the run in a list and gathered them all to rank 0 at
    the end: the soak measured 3.4 MB more RSS per 1000 steps (the tiny model, DDP on 2
    ranks), without end. It keeps the last trace.MAX_EVENTS now and says how many fell out."""
    from minidist.comm import trace
    trace.clear_events()
    try:
        for seq in range(trace.MAX_EVENTS + 7):
            trace.record(dict(seq=seq, op="all_reduce", algo="ring", group="dp", dtype="f4",
                              bytes=4, issued=0.0, start=0.0, end=0.0))
        kept = trace.events()
        assert len(kept) == trace.MAX_EVENTS and trace.left_out() == 7
        assert kept[0]["seq"] == 7 and kept[-1]["seq"] == trace.MAX_EVENTS + 6   # the newest
        assert "left out 7 earlier ones" in trace.kept_note()
        trace.clear_events()
        assert trace.left_out() == 0 and trace.kept_note() == ""
    finally:
        trace.clear_events()


def test_an_expert_exchange_keeps_sums_not_a_record_of_every_run():
    """ExpertExchange (--ep) appended a tuple (rows sent, rows received, backward) per MoE
    layer and micro-batch to a list for the whole run, read only by ep_check.py's byte
    count: 2 interpreter blocks a step of the soak's tiny model, RSS 190 kB per 1000 steps
    on 4 ranks, without end. It keeps three sums per kind of run now: 30 steps of a model
    with 2 MoE layers, under --ep over one rank, leave its attributes as they were after 3;
    the sums still give the formula's bytes (one run without a graph, evaluation's, too)."""
    from mpi4py import MPI

    from minidist.autograd import no_grad
    from minidist.comm import ProcessGroup
    from minidist.ep.exchange import attach_experts, exchange_bytes
    from minidist.nn import GPT, GPTConfig

    config = GPTConfig(n_layer=2, n_head=2, n_embd=8, block_size=8, vocab_size=16,
                       moe_experts=2)
    model = GPT(config, seed=0, dtype="float64")
    group = ProcessGroup(MPI.COMM_SELF, name="ep")
    try:
        attach_experts(model, group)
        x = np.random.default_rng(0).integers(0, 16, (2, 8))

        def sizes():
            return [(k, len(v) if hasattr(v, "__len__") else v)
                    for m in model.moe_layers() for k, v in sorted(vars(m.exchange).items())
                    if k != "totals"]
        for step in range(30):
            model(x, x)[1].backward()
            if step == 2:
                after_3 = sizes()
        with no_grad():
            model(x, x)
        assert sizes() == after_3
        for m in model.moe_layers():
            assert m.exchange.totals == {True: [30, 0, 0], False: [1, 0, 0]}   # (one rank)
            assert m.exchange.bytes_sent(8, 8) == 0 == exchange_bytes(0, 0, 1, 2, 8, 8)
    finally:
        group.destroy()


def test_an_moe_layer_keeps_no_graph_of_a_z_loss_the_loss_leaves_out():
    """With --moe-z-loss-coef 0 (the default) the z-loss is not in the loss, but each MoE layer
    built its graph and kept it in `z_loss` until its next forward: the soak counted 20 Nodes
    and 16 Contexts alive between steps (--moe-experts 4, one process), with the (N, E) arrays
    they saved (tokens x experts a layer: some MB a layer at GPT-2 sizes). Now the value is
    computed without a graph; with a coefficient the graph is there and backward reaches the
    router through it."""
    from minidist.nn import GPT, GPTConfig
    x = np.random.default_rng(0).integers(0, 16, (2, 8))
    for coef in (0.0, 0.01):
        config = GPTConfig(n_layer=2, n_head=2, n_embd=8, block_size=8, vocab_size=16,
                           moe_experts=2, moe_z_loss_coef=coef)
        model = GPT(config, seed=0, dtype="float64")
        model(x, x)[1].backward()
        for m in model.moe_layers():
            assert (m.z_loss.grad_fn is None) == (coef == 0.0), coef
            assert np.isfinite(m.z_loss.item()) and m.z_loss.item() > 0


SOAKS = [
    (1, ["--eval-every", "100", "--grad-accum", "2"]),
    (2, ["--zero", "1", "--overlap-param-gather", "--eval-every", "100"]),
    (2, ["--ddp", "bucketed", "--save-every", "70", "--async-save", "--keep", "2"]),
    (2, ["--moe-experts", "4", "--ep", "2"]),
    (4, ["--tp", "2", "--dp", "2", "--sequence-parallel"]),
]


@pytest.mark.slow
@pytest.mark.parametrize("nprocs,flags", SOAKS, ids=["1-process", "zero1-overlap",
                                                     "ddp-async-save", "moe-ep2",
                                                     "tp2xdp2-sp"])
def test_a_long_run_ends_with_the_objects_fds_and_threads_it_had_after_warm_up(
        mpi, corpus, tmp_path, nprocs, flags):
    """650 steps of a tiny model, sampled every 100 after a gc.collect(): from step 200 to
    600 (the last step's evaluation and save come after) every rank holds the same numbers
    of file descriptors and threads, the same live objects, items in its lists, dicts, sets
    and deques, and numpy arrays, but for those of work in flight (--overlap-param-gather's
    gathers are queued behind the step's end: a few dozen objects either way, never a drift
    of one a step; a save on its thread holds its host copies: --save-every 70 keeps the
    samples off them; measured 0 for the others). RSS and step time are left to the soak's
    own runs (minidist/train/README.md#soak-a-long-run): noise here.

        mpiexec -n 2 python tests/scripts/soak.py --every 100 --warmup 200 -- --steps 650 \
            --n-layer 2 --n-embd 32 --n-head 2 --block-size 32 --batch-size 4 --sample 0 \
            --eval-iters 2 --data FILE --zero 1 --overlap-param-gather --eval-every 100
    """
    save = ["--save", tmp_path / "ckpt"] if "--save-every" in flags else []
    out = mpi(nprocs, "tests/scripts/soak.py", "--every", 100, "--warmup", 200, "--",
              "--steps", 650, *TINY, "--data", corpus, "--log-json", tmp_path / "log.jsonl",
              *save, *flags, timeout=600)
    verdicts = tagged_json(out, "SOAK")
    assert sorted(v["rank"] for v in verdicts) == list(range(nprocs)), out.stdout
    for v in verdicts:
        first, last = v["first"], v["last"]
        assert v["samples"] == 5 and (first["step"], last["step"]) == (200, 600), v
        assert (first["fds"], first["threads"]) == (last["fds"], last["threads"]), v
        assert abs(v["objects_change"]) <= 40 and abs(v["arrays_change"]) <= 4, v
        assert abs(v["items_change"]) <= 40, v       # (--ep's list grew by 808 here)
        assert abs(v["per_1000_steps"]["objects"]) < 100, v      # < 0.1 object a step
        assert abs(v["per_1000_steps"]["items"]) < 100, v
