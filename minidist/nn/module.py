"""`Module` and `Parameter`: a tree of layers whose leaves are named, trainable Tensors.

A Module finds its parameters and children by looking at its own attributes, in the order
they were assigned (no registration calls): a `Parameter` attribute is a parameter, a
`Module` attribute a child, and `ModuleList` holds numbered children. Names are the dotted
attribute paths, which is how GPT gets GPT-2's names (`transformer.h.0.attn.c_attn.weight`)
for free. A Parameter reachable by two paths (a tied weight) is listed once, under its first
name, and gets one gradient holding both contributions.
Tests: tests/test_nn.py.
"""
from minidist import backend
from minidist.autograd import Tensor

_PLACEHOLDERS = {}


def placeholder(shape, like):
    """A NaN array of `shape`, `like`'s dtype and device, holding one element (read-only on
    numpy; CuPy has no read-only arrays): what a parameter points at while it holds no
    numbers (ZeRO-3's parameters between gathers, minidist/zero/flat.py; a model built with
    materialize=False, minidist/nn/gpt.py). A forward reading one gives NaN, never plausible
    numbers, and a stray write raises on numpy."""
    xp = backend.xp_of(like)
    key = (xp.__name__, like.dtype.str)
    if key not in _PLACEHOLDERS:
        _PLACEHOLDERS[key] = xp.full((), float("nan"), dtype=like.dtype)
    return xp.broadcast_to(_PLACEHOLDERS[key], shape)


def release_parameters(module):
    """Every parameter of `module` points at a placeholder of its shape and dtype: its
    array is freed (where nothing else holds it). Returns `module`."""
    for p in module.parameters():
        p.data = placeholder(p.shape, p.data)
    return module


class Parameter(Tensor):
    """A leaf Tensor that requires a gradient.

    `decay` says whether AdamW's default grouping applies weight decay to it (False for biases,
    LayerNorm and embedding weights). `expert_parallel` is True for an expert's weights under
    expert parallelism (minidist/ep/exchange.py): sharded over the ep ranks, so data
    parallelism over the dense parameters (DDP, ZeRO) leaves them to the ep strategy.
    """
    expert_parallel = False

    def __init__(self, data, decay=True):
        super().__init__(data, requires_grad=True)
        self.decay = decay

    def __repr__(self):
        return f"Parameter(shape={self.shape}, dtype={self.dtype})"


class Module:

    def __init__(self):
        self.training = True

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def forward(self, *args, **kwargs):
        raise NotImplementedError

    def __repr__(self):
        """One line, for a debugger (`p self` in a layer's forward printed an address): the
        class, its own parameters' shapes, its children's names, the parameters in all."""
        own = [f"{name} {tuple(v.shape)}" for name, v in vars(self).items()
               if isinstance(v, Parameter)]
        children = [name for name, _ in self.named_children()]
        if len(children) > 6:                       # a ModuleList of many blocks
            children = children[:3] + ["...", children[-1]]
        return (f"{type(self).__name__}({', '.join(own + children)}; "
                f"{self.num_parameters():,} parameters)")

    # ---- the tree --------------------------------------------------------------------------
    def named_children(self):
        for name, value in vars(self).items():
            if isinstance(value, Module):
                yield name, value

    def children(self):
        return [m for _, m in self.named_children()]

    def named_modules(self, prefix=""):
        yield prefix, self
        for name, child in self.named_children():
            yield from child.named_modules(f"{prefix}.{name}" if prefix else name)

    def named_parameters(self, prefix=""):
        """(name, Parameter) pairs, depth first in assignment order, each Parameter once."""
        seen = set()
        for name, p in self._walk_parameters(prefix):
            if id(p) not in seen:
                seen.add(id(p))
                yield name, p

    def _walk_parameters(self, prefix):
        for name, value in vars(self).items():
            full = f"{prefix}.{name}" if prefix else name
            if isinstance(value, Parameter):
                yield full, value
            elif isinstance(value, Module):
                yield from value._walk_parameters(full)

    def parameters(self):
        return [p for _, p in self.named_parameters()]

    def num_parameters(self):
        return sum(p.size for p in self.parameters())

    # ---- modes -----------------------------------------------------------------------------
    def train(self, mode=True):
        for _, m in self.named_modules():
            m.training = mode
        return self

    def eval(self):
        return self.train(False)

    def zero_grad(self):
        for p in self.parameters():
            p.grad = None

    # ---- state -----------------------------------------------------------------------------
    def state_dict(self):
        """name -> the live array of each parameter (not a copy; `to_host` it to save)."""
        return {name: p.data for name, p in self.named_parameters()}

    def load_state_dict(self, state, strict=True):
        """Replace each parameter's array with `state[name]`, cast to the parameter's dtype and
        moved to its device. Shapes must match; with `strict`, names must match exactly.
        Returns (missing, unexpected) name lists."""
        params = dict(self.named_parameters())
        missing = [n for n in params if n not in state]
        unexpected = [n for n in state if n not in params]
        if strict and (missing or unexpected):
            raise KeyError(f"load_state_dict: missing {missing[:8]}{'...' * (len(missing) > 8)}"
                           f", unexpected {unexpected[:8]}{'...' * (len(unexpected) > 8)}")
        for name, p in params.items():
            if name not in state:
                continue
            value = state[name]
            if tuple(value.shape) != tuple(p.shape):
                raise ValueError(f"load_state_dict: {name} has shape {tuple(value.shape)} "
                                 f"in the state dict but {tuple(p.shape)} in the model")
            xp = backend.xp_of(p.data)     # a copy: never share (or keep read-only) the
            p.data = xp.array(backend.to_device(value, xp), dtype=p.dtype)  # caller's buffer
        return missing, unexpected


class ModuleList(Module):
    """Numbered children: `blocks[i]`, named `"0"`, `"1"`, ... in the parameter names, or by
    `numbers` (a pipeline stage's blocks keep the whole model's numbers: h.2, h.3)."""

    def __init__(self, modules, numbers=None):
        super().__init__()
        self._numbers = list(range(len(modules)) if numbers is None else numbers)
        for n, m in zip(self._numbers, modules):
            setattr(self, str(n), m)
        self._n = len(modules)

    def __len__(self):
        return self._n

    def __getitem__(self, i):
        return getattr(self, str(self._numbers[i]))

    def numbered(self, n):
        """The child named `n` (a block by its global number)."""
        return getattr(self, str(n))

    def __iter__(self):
        return (self[i] for i in range(self._n))


class ModuleDict(Module):
    """Named children given as keyword arguments (GPT's `transformer.wte`, `.h`, `.ln_f`)."""

    def __init__(self, **modules):
        super().__init__()
        for name, m in modules.items():
            setattr(self, name, m)
