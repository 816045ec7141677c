"""Layers and the GPT-2 model.

    from minidist.nn import GPT, GPTConfig, gpt_init, Module, Parameter, Linear, ...

Tests: tests/test_nn.py, tests/test_gpt.py, tests/test_pretrained.py.
"""
from minidist.nn.module import Module, ModuleDict, ModuleList, Parameter
from minidist.nn.layers import Dropout, Embedding, LayerNorm, Linear
from minidist.nn.config import GPTConfig, gpt_init, gpt_param_specs
from minidist.nn.block import Block
from minidist.nn.gpt import GPT

__all__ = ["Module", "ModuleDict", "ModuleList", "Parameter", "Dropout", "Embedding",
           "LayerNorm", "Linear", "GPT", "Block", "GPTConfig", "gpt_init", "gpt_param_specs"]
