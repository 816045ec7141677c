"""The Mixture-of-Experts layer on one process (minidist/nn/moe.py): float64 gradchecks of the
layer and its ops, routing and capacity dropping in closed form, the losses, the parameter
names, and that the dense model is untouched when no experts are asked for."""
import numpy as np
import pytest

from minidist.autograd import Tensor, no_grad
from minidist.autograd.gradcheck import gradcheck
from minidist.nn import GPT, GPTConfig
from minidist.nn.block import MLP
from minidist.nn.moe import IndexAddRows, MoE, capacity, load_balancing_loss, route, \
    router_z_loss


def moe_config(**kw):
    base = dict(n_layer=2, n_head=2, n_embd=8, block_size=8, vocab_size=16, moe_experts=4,
                moe_top_k=2, moe_capacity_factor=1.0, moe_z_loss_coef=0.01)
    return GPTConfig(**{**base, **kw})


def test_route_top1_capacity_closed_form():
    # 2 sequences of T=4 tokens, E=2; every token prefers expert 0 -> cap tokens kept each
    probs = np.tile([[0.9, 0.1]], (8, 1))
    r = route(probs, k=1, cap=3, T=4)
    assert r.counts.tolist() == [6, 0]                       # 3 per sequence
    assert r.token.tolist() == [0, 1, 2, 4, 5, 6]            # the first 3 of each sequence
    assert r.dropped == 2 and r.chosen.tolist() == [[4, 0], [4, 0]]


def test_route_slot_major_priority():
    # top-2 of 2 experts with cap 2 on T=2: slot-0 choices first, so expert 1 takes token 1's
    # slot-0 choice and token 0's slot-1 choice; expert 0 token 0 (slot 0) and token 1 (slot 1)
    probs = np.array([[0.7, 0.3], [0.2, 0.8]])
    r = route(probs, k=2, cap=2, T=2)
    assert list(zip(r.expert, r.token, r.slot)) == [(0, 0, 0), (0, 1, 1), (1, 0, 1), (1, 1, 0)]
    r = route(probs, k=2, cap=1, T=2)                        # slot-1 choices dropped
    assert list(zip(r.expert, r.token, r.slot)) == [(0, 0, 0), (1, 1, 0)] and r.dropped == 2


def test_capacity_formula():
    assert capacity(T=8, E=4, k=2, factor=1.0) == 4
    assert capacity(T=8, E=4, k=1, factor=1.25) == 3         # ceil(2.5)
    assert capacity(T=8, E=4, k=1, factor=0) == 8            # no dropping


def test_route_is_per_sequence():
    """Routing rows 0..1 and 2..3 separately gives the same assignments as all four together:
    what makes data- and expert-parallel runs drop exactly the tokens one process drops."""
    probs = np.random.default_rng(0).dirichlet(np.ones(4), size=4 * 5)       # B=4, T=5
    whole = route(probs, 2, 2, 5)
    a, b = route(probs[:10], 2, 2, 5), route(probs[10:], 2, 2, 5)
    pairs = set(zip(whole.token.tolist(), whole.expert.tolist()))
    split = set(zip(a.token.tolist(), a.expert.tolist())) | \
        set(zip((b.token + 10).tolist(), b.expert.tolist()))
    assert pairs == split and (whole.chosen == np.concatenate([a.chosen, b.chosen])).all()


def test_gradcheck_index_add_rows():
    rows = Tensor(np.random.default_rng(1).standard_normal((5, 3)), requires_grad=True)
    idx = np.array([2, 0, 2, 3, 0])
    gradcheck(lambda r: IndexAddRows.apply(r, idx, 4), [rows], name="index_add_rows")


def test_gradcheck_losses():
    rng = np.random.default_rng(2)
    logits = Tensor(rng.standard_normal((6, 3)), requires_grad=True)
    chosen = np.array([[2, 1, 0], [1, 1, 1]])
    from minidist.autograd import fused as F
    gradcheck(lambda z: load_balancing_loss(F.softmax(z, axis=-1), chosen, 3, 1), [logits],
              name="load_balancing_loss")
    gradcheck(router_z_loss, [logits], name="router_z_loss")


def test_aux_loss_is_one_when_balanced():
    probs = Tensor(np.full((4, 2), 0.5))
    assert load_balancing_loss(probs, np.array([[1, 1], [1, 1]]), T=2, k=1).item() == 1.0


@pytest.mark.parametrize("k,factor,shared", [(1, 1.0, 0), (2, 1.0, 0), (2, 0.0, 0),
                                             (2, 1.0, 2)])
def test_gradcheck_moe_layer(k, factor, shared):
    """The whole layer (router, top-k, dropping, experts, combine, aux and z losses; with
    `shared` experts, --moe-shared, their MLP too) in float64 against central differences,
    for x and every parameter."""
    config = moe_config(moe_top_k=k, moe_capacity_factor=factor, moe_shared=shared,
                        ffn_hidden=8)        # (the 4C = 32 default: 4x the differences)
    layer = MoE(config, MLP, dtype="float64",
                shared_expert=MLP(config.shared_expert(), dtype="float64") if shared else None)
    rng = np.random.default_rng(3)
    names = [n for n, _ in layer.named_parameters()]
    values = [Tensor(rng.standard_normal(p.shape) * 0.5, requires_grad=True)
              for _, p in layer.named_parameters()]
    x = Tensor(rng.standard_normal((2, 5, 8)), requires_grad=True)

    def fn(x, *params):
        for name, p in zip(names, params):     # the layer computes with the checked tensors
            owner = layer
            for part in name.split(".")[:-1]:
                owner = getattr(owner, part)
            setattr(owner, name.split(".")[-1], p)
        y = layer(x)
        return [y, layer.aux_loss, layer.z_loss]

    gradcheck(fn, [x] + values, name=f"moe(k={k}, f={factor}, shared={shared})")


def test_parameter_names_and_dense_unchanged():
    names = [n for n, _ in GPT(moe_config(moe_every=2), seed=0).named_parameters()]
    assert "transformer.h.0.mlp.c_fc.weight" in names                # block 0 stays dense
    assert "transformer.h.1.mlp.router.weight" in names
    assert "transformer.h.1.mlp.experts.3.c_fc.weight" in names
    dense = GPTConfig(n_layer=2, n_head=2, n_embd=8, block_size=8, vocab_size=16)
    assert not any(k.startswith("moe") for k in dense.to_dict())     # checkpoints as before
    assert "moe_experts" in moe_config().to_dict()


def test_model_loss_includes_router_losses():
    config = moe_config()
    model = GPT(config, seed=0, dtype="float64")
    x = np.random.default_rng(4).integers(0, 16, (3, 8))
    _, loss = model(x, x)
    x2 = model.run_blocks(model.embed(x))
    _, ce = model.head(x2, x)
    extra = sum(0.01 * m.aux_loss.item() + 0.01 * m.z_loss.item() for m in model.moe_layers())
    assert abs(loss.item() - ce.item() - extra) < 1e-12
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(g is not None for g in grads.values())                 # every expert too


def test_an_evaluations_loss_is_the_cross_entropy_alone():
    """First-use walk 26: an MoE model's val loss (and --eval-only's perplexity) held the
    router losses, +0.02 nats for 2 MoE blocks at the default weights, so it was not the
    language model's loss and not comparable with a dense model's. In eval mode the loss is
    the cross-entropy alone (as Megatron-LM and DeepSpeed report it); training's keeps
    them (minidist/train/loop.py evaluate runs the model in eval mode)."""
    config = moe_config()
    model = GPT(config, seed=0, dtype="float64")
    x = np.random.default_rng(4).integers(0, 16, (3, 8))
    model.eval()
    with no_grad():
        _, loss = model(x, x)
        _, ce = model.head(model.run_blocks(model.embed(x)), x)
        router = sum(0.01 * m.aux_loss.item() + 0.01 * m.z_loss.item()
                     for m in model.moe_layers())
    assert loss.item() == ce.item() and router > 0.01
    model.train()
    _, trained = model(x, x)
    assert abs(trained.item() - ce.item() - router) < 1e-12


def test_config_refuses_bad_moe():
    with pytest.raises(ValueError, match="moe_top_k"):
        moe_config(moe_top_k=5)
    with pytest.raises(ValueError, match="moe_experts"):
        moe_config(moe_experts=1)


def test_expert_without_tokens_gets_a_zero_gradient():
    """Every expert runs, on 0 rows too: its gradient is zeros, not missing (so DDP, ZeRO and
    the ep strategy see the same parameters every step)."""
    layer = MoE(moe_config(moe_top_k=1, moe_capacity_factor=0.0), MLP, dtype="float64")
    w = np.zeros(layer.router.weight.shape)
    w[:, 0] = 5.0                                        # every token prefers expert 0
    layer.router.weight.data = w
    x = Tensor(np.abs(np.random.default_rng(5).standard_normal((2, 4, 8))), requires_grad=True)
    (layer(x) * Tensor(np.ones((2, 4, 8)))).sum().backward()
    assert layer.routing.counts.tolist() == [8, 0, 0, 0]
    idle = layer.experts.__dict__["3"]
    assert idle.c_fc.weight.grad is not None and not idle.c_fc.weight.grad.any()
    assert layer.experts.__dict__["0"].c_proj.bias.grad.any()     # (weights start at 0)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_checkpointing_an_moe_model_changes_no_number(dropout):
    """--ckpt-activations on an MoE GPT (top-2, dropping, z-loss, dropout): the same loss and
    gradients as without, bit for bit; the router losses counted once (the loss = the
    cross-entropy + each MoE block's router loss of the forward), though the recompute runs
    the routers again."""
    config = moe_config(dropout=dropout)
    x = np.random.default_rng(6).integers(0, 16, (4, 8))
    out = []
    for ckpt in (False, True):
        model = GPT(config, seed=1, dtype="float64").set_checkpointing(ckpt)
        _, loss = model(x, x)
        extra = sum(m.router_loss().item() for m in model.moe_layers())
        loss.backward()
        out.append((loss.item(), extra, {n: p.grad for n, p in model.named_parameters()}))
    (loss, extra, grads), (loss_c, extra_c, grads_c) = out
    assert loss == loss_c and extra == extra_c and extra > 0
    with no_grad():
        ce = model.head(model.run_blocks(model.embed(x)), x)[1].item()
    if not dropout:                                  # (with dropout the no_grad run draws anew)
        assert abs(loss_c - ce - extra_c) < 1e-12
    for name in grads:
        np.testing.assert_array_equal(grads[name], grads_c[name], err_msg=name)


def test_gradcheck_moe_layer_with_dropout():
    """The layer with its experts' dropout (expert_dropout: the same masks at every call, the
    keys' step unchanged outside a training step) against central differences."""
    layer = GPT(moe_config(dropout=0.3), seed=0, dtype="float64").transformer.h[0].mlp
    rng = np.random.default_rng(8)
    x = Tensor(rng.standard_normal((2, 5, 8)), requires_grad=True)
    w = Tensor(rng.standard_normal((8, 4)), requires_grad=True)

    def fn(x, w):
        layer.router.weight = w
        return [layer(x)]

    out = fn(x, w)[0].data
    assert (out == 0).any() and not (out == 0).all()          # some outputs dropped
    gradcheck(fn, [x, w], name="moe with dropout")


def test_expert_dropout_depends_on_the_token_not_the_rank():
    """A batch cut in two halves, each keyed by its rows' numbers in the whole batch (as
    --ep ranks are, minidist/autograd/dropout_keys.py): each half's output is its rows of
    the whole batch's, dropout included (to 1e-13, not bit for bit: an expert's matmul over
    another number of rows may round otherwise in the BLAS, as OpenBLAS 0.3.31's does; a
    mask of other bits would differ by the dropped values themselves)."""
    config = moe_config(dropout=0.2, moe_capacity_factor=0.0)
    model = GPT(config, seed=0, dtype="float64")
    layer, keys = model.transformer.h[0].mlp, model.dropout_keys
    x = np.random.default_rng(9).standard_normal((4, 8, 8))
    whole = layer(Tensor(x)).data                                     # (4, 8, 8)
    for half in range(2):
        with keys.rows_of([2 * half, 2 * half + 1]):
            part = layer(Tensor(x[2 * half:2 * half + 2])).data
        np.testing.assert_allclose(part, whole[2 * half:2 * half + 2], rtol=0, atol=1e-13)
    layer.eval()
    assert not np.array_equal(layer(Tensor(x)).data, whole)           # dropout did act


def test_balance_from_sums_is_the_aux_loss():
    """The load-balancing loss from each sequence's summed probabilities (what a rank holding
    part of a sequence gets from every part's sums, minidist/nn/moe_split.py) is the one
    from the probabilities: one sequence of 2 tokens, half the assignments on each expert."""
    from minidist.nn.moe import balance_from_sums
    probs = Tensor(np.array([[0.75, 0.25], [0.25, 0.75]]))
    chosen = np.array([[1, 1]])
    psum = Tensor(np.array([[1.0, 1.0]]))
    assert balance_from_sums(psum, chosen, T=2, k=1).item() == 1.0
    assert load_balancing_loss(probs, chosen, T=2, k=1).item() == 1.0


@pytest.mark.mpi
@pytest.mark.cpu_only("the script's arrays are numpy")
def test_gradcheck_sequence_sum(mpi):
    """SequenceSum (the all-reduced statistics of an MoE layer on a split sequence) by
    central differences across 2 ranks, with the gradient sequence parallelism (x 1) and
    context parallelism (x cp) need.

        mpiexec -n 2 python tests/scripts/moe_split_check.py
    """
    from mpirun import tagged_json
    out = mpi(2, "tests/scripts/moe_split_check.py", timeout=120)
    rows = tagged_json(out, "GRADCHECK")
    assert len(rows) == 4 and all(r["max_abs_diff"] < 1e-6 for r in rows), rows
