"""The memory ledger counts live buffers: parameters, gradients, optimizer state exactly;
activations as what the graph holds between forward and backward, views and parameters
excluded."""
import numpy as np

from minidist.autograd import Tensor
from minidist.nn import GPT, GPTConfig
from minidist.optim import AdamW
from minidist.strategy.memory import activation_bytes, ledger, unique_nbytes


def test_unique_nbytes_counts_a_buffer_once():
    a = np.zeros(100, np.float32)
    assert unique_nbytes([a, a[10:], a.reshape(10, 10)]) == 400
    assert unique_nbytes([a, np.zeros(5)], exclude=[a]) == 40


def test_ledger_params_grads_optimizer():
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=8, block_size=8, vocab_size=16))
    opt = AdamW(model.named_parameters())
    n = model.num_parameters()
    x = np.zeros((2, 8), np.int64)
    _, loss = model(x, x)
    act = activation_bytes(loss, model.parameters())
    assert act > 2 * 8 * 16 * 4                              # at least the logits
    loss.backward()
    opt.step()
    row = ledger(model.parameters(), opt, act)
    assert row == {"params": 4 * n, "grads": 4 * n, "optimizer": 8 * n, "activations": act,
                   "total": 16 * n + act}


def test_activation_bytes_of_a_small_graph():
    w = Tensor(np.ones((4, 4), np.float32), requires_grad=True)
    x = Tensor(np.ones((3, 4), np.float32))
    y = (x @ w).tanh()                                       # holds x@w (48 B), tanh (48 B)
    assert activation_bytes(y, [w]) >= 96
    assert activation_bytes(y, [w]) < 96 + 48 + 64 + 48      # not the parameter, not twice
