"""The layers GPT is made of: Linear, Embedding, LayerNorm (RMSNorm in a Llama-style
block), Dropout.

Each holds its Parameters and calls one op; the math lives in minidist/autograd.
`Linear.weight` is `(in_features, out_features)` and computes `x @ W + b`: GPT-2's layout
(its Conv1D), so GPT-2 checkpoints load without transposes.

Layers are created with placeholder values (zeros, ones for LayerNorm's gain) unless given an
`rng`; GPT fills its parameters from `gpt_init` instead (minidist/nn/gpt.py), so one function
decides the initial numbers of every parallel layout. `DenseLayers` is how GPT makes them
(tensor parallelism's TensorParallelLayers, minidist/tp/model.py, makes split ones instead).
Tests: tests/test_nn.py.
"""
from minidist import backend
from minidist.autograd import fused as F
from minidist.autograd import ops
from minidist.autograd.fusions import residual_layer_norm
from minidist.autograd.llama_ops import residual_rms_norm, rms_norm
from minidist.nn.module import Module, Parameter


def _param(shape, dtype, fill=0.0, rng=None, std=0.02, decay=True):
    """A Parameter on the current device: N(0, std) from the host `rng`, or `fill`."""
    xp = backend.get_xp()
    if rng is not None:
        host = rng.standard_normal(shape) * std
        return Parameter(backend.to_device(host.astype(dtype)), decay=decay)
    return Parameter(xp.full(shape, fill, dtype=dtype), decay=decay)


class Linear(Module):
    """y = x @ W + b with W of shape (in_features, out_features)."""

    def __init__(self, in_features, out_features, bias=True, dtype="float32", rng=None):
        super().__init__()
        self.weight = _param((in_features, out_features), dtype, rng=rng)
        self.bias = _param((out_features,), dtype, decay=False) if bias else None

    def forward(self, x):                                        # (..., in)
        return F.linear(x, self.weight, self.bias)               # (..., out): one GEMM

    def matmul(self, x):
        """x @ W without the bias: the MLP adds c_fc's in the GELU's pass (bias_gelu)."""
        return F.linear(x, self.weight)                          # (..., out)


class Embedding(Module):
    """Row lookup: idx (...) of ints -> (..., embedding_dim)."""

    def __init__(self, num_embeddings, embedding_dim, dtype="float32", rng=None):
        super().__init__()
        self.weight = _param((num_embeddings, embedding_dim), dtype, rng=rng, decay=False)

    def forward(self, idx):
        return ops.embedding(self.weight, idx)


class LayerNorm(Module):
    """Normalise the last axis to zero mean and unit variance, then scale and shift.
    `bias=False` drops the shift (GPTConfig.bias)."""

    def __init__(self, ndim, bias=True, eps=1e-5, dtype="float32"):
        super().__init__()
        self.weight = _param((ndim,), dtype, fill=1.0, decay=False)
        self.bias = _param((ndim,), dtype, decay=False) if bias else None
        self.eps = eps

    def gain_and_shift(self):
        """(weight, bias) as the op takes them (tensor parallelism's sequence-parallel norms
        pass them through its region: minidist/tp/layers.py)."""
        return self.weight, self.bias

    def forward(self, x):
        w, b = self.gain_and_shift()
        return F.layer_norm(x, w, b, eps=self.eps)

    def add_norm(self, x, r):
        """(x + r, this norm of it) in one op: the block's residual add and ln_2."""
        w, b = self.gain_and_shift()
        return residual_layer_norm(x, r, w, b, eps=self.eps)


class RMSNorm(LayerNorm):
    """Scale the last axis to unit root mean square, then by a gain (Llama's norm): no mean
    subtracted, no bias."""

    def __init__(self, ndim, eps=1e-5, dtype="float32"):
        super().__init__(ndim, bias=False, eps=eps, dtype=dtype)

    def forward(self, x):
        return rms_norm(x, self.gain_and_shift()[0], eps=self.eps)

    def add_norm(self, x, r):
        """(x + r, this norm of it): the block's residual add and ln_2."""
        return residual_rms_norm(x, r, self.gain_and_shift()[0], eps=self.eps)


class Dropout(Module):
    """Zero each element with probability p in training and scale the rest by 1/(1-p).

    Its random numbers come from `self.rng` (anything with random(shape, dtype): a numpy
    Generator, or the DropoutSite GPT gives each layer, keyed by the layer's name, the step
    and the rows' places in the global batch: minidist/autograd/dropout_keys.py).
    """

    def __init__(self, p=0.0, rng=None):
        super().__init__()
        self.p = p
        self.rng = rng

    def forward(self, x):
        if not self.training or self.p == 0.0:
            return x
        return ops.dropout(x, self.p, self.rng, training=True)


class DenseLayers:
    """How GPT's layers are made: whole, on one process. Tensor parallelism passes its own
    factory (minidist/tp/model.py TensorParallelLayers), whose linears, layer norms and token
    embedding are split over a tp group; the modules around them and their forward stay GPT's."""

    def __init__(self, config, dtype="float32"):
        self.config, self.dtype = config, dtype
        self.heads = config.n_head                 # attention heads this rank computes
        self.kv_heads = config.kv_heads            # and the k and v heads they share

    def column(self, n_in, n_out, blocks=1):
        """c_attn (blocks: q|k|v's widths) and c_fc ([gate|up]: 2 for SwiGLU): tensor
        parallelism splits their outputs, each block alike."""
        return Linear(n_in, n_out, bias=self.config.bias, dtype=self.dtype)

    def row(self, n_in, n_out):
        """The c_proj layers: tensor parallelism splits their inputs."""
        return Linear(n_in, n_out, bias=self.config.bias, dtype=self.dtype)

    def norm(self):
        c = self.config
        if c.llama:
            return RMSNorm(c.n_embd, eps=c.norm_eps, dtype=self.dtype)
        return LayerNorm(c.n_embd, bias=c.bias, eps=c.norm_eps, dtype=self.dtype)

    def token_embedding(self):
        """wte, with the vocabulary padded to config.padded_vocab_size (zero rows)."""
        return Embedding(self.config.padded_vocab_size, self.config.n_embd, dtype=self.dtype)
