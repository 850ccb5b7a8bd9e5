# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""linears: Transformers' `Conv1D` (GPT-2's linear, weight stored `[in, out]`) is a
linear like `nn.Linear`: swapped for vLLM's linears wherever `nn.Linear` is, its
weight transposed as it loads."""

import pytest
import torch
from torch import nn
from transformers import GPT2LMHeadModel
from transformers.models.gpt2.modeling_gpt2 import GPT2MLP
from transformers.pytorch_utils import Conv1D

from configs import small_config

from vllm.model_executor.layers.linear import (
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from vllm.model_executor.models.transformers import linears
from vllm.model_executor.models.transformers.utils import replace_linear_class
from vllm.model_executor.models.utils import AutoWeightsLoader

HIDDEN, INNER = 32, 48


def gpt2_config(**overrides):
    # GPT-2 names its sizes n_embd, n_layer, n_head, n_inner, n_positions.
    return small_config("gpt2", n_inner=256, **overrides)


def test_conv1d_is_a_linear_with_its_features_transposed():
    conv, linear = Conv1D(INNER, HIDDEN), nn.Linear(HIDDEN, INNER)
    for layer in (conv, linear):
        assert linears.is_linear(layer)
        assert (linears.in_features(layer), linears.out_features(layer)) == (
            HIDDEN,
            INNER,
        )
    assert linears.stores_transposed(conv) and not linears.stores_transposed(linear)
    assert not linears.is_linear(nn.LayerNorm(HIDDEN))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gpt2_mlp_on_vllm_linears_equals_the_original(dtype, vllm_config):
    """The MLP has no gate to fuse: its Conv1Ds are swapped as `nn.Linear`s are, by
    the style a tensor-parallel plan would give them, and load transposed."""
    config = gpt2_config(hidden_size=HIDDEN)
    mlp = GPT2MLP(INNER, config).to(dtype).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in mlp.parameters():
            param.copy_(torch.randn(param.shape, generator=generator, dtype=dtype))
    weights = [(f"m.{k}", v.clone()) for k, v in mlp.state_dict().items()]
    x = torch.randn(2, 5, HIDDEN, generator=generator, dtype=dtype)
    with torch.no_grad():
        expected = mlp(x)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        for name, style in (("c_fc", "colwise"), ("c_proj", "rowwise")):
            layer = replace_linear_class(getattr(mlp, name), style, prefix=f"m.{name}")
            setattr(mlp, name, layer)
    finally:
        torch.set_default_dtype(default)
    parent = nn.Module()
    parent.m = mlp
    AutoWeightsLoader(parent).load_weights(weights)
    for layer in (mlp.c_fc, mlp.c_proj):
        layer.quant_method.process_weights_after_loading(layer)
    with torch.no_grad():
        actual = mlp(x)
    tolerance = 1e-10 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(actual, expected, atol=tolerance, rtol=tolerance)


def test_a_layer_without_a_plain_weight_cannot_load_a_conv1d():
    with pytest.raises(ValueError, match=r"m\.c_fc \(Conv1D\) stores its weight"):
        linears.load_as_stored(nn.Module(), Conv1D(INNER, HIDDEN), "m.c_fc")


def test_gpt2_is_built_on_vllm_linears_with_c_attn_packed(build_backend):
    model = build_backend(gpt2_config())
    assert not any(isinstance(m, Conv1D) for m in model.modules())
    block = model.model.h[0]
    assert isinstance(block.attn.c_attn, QKVParallelLinear)
    assert isinstance(block.attn.c_proj, RowParallelLinear)
    # GPT-2 has no tensor-parallel plan: its MLP is replicated, which is correct.
    assert isinstance(block.mlp.c_fc, ReplicatedLinear)
    assert isinstance(block.mlp.c_proj, ReplicatedLinear)
    assert model.packed_modules_mapping == {"c_attn": ["c_attn"]}
    # What the fusion report shows (`report gpt2`).
    assert {
        (linear.module, linear.layer_class, linear.style)
        for linear in model.report.linears
        if linear.module.startswith("model.h.0.")
    } == {
        ("model.h.0.attn.c_attn", "QKVParallelLinear", "colwise"),
        ("model.h.0.attn.c_proj", "RowParallelLinear", "rowwise"),
        ("model.h.0.mlp.c_fc", "ReplicatedLinear", "replicate"),
        ("model.h.0.mlp.c_proj", "ReplicatedLinear", "replicate"),
    }


def test_gpt2_checkpoint_loads_every_tensor_transposed_where_stored_so(build_backend):
    config = gpt2_config()
    model = build_backend(config)
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for param in hf.parameters():
            if param.ndim == 1:
                param.normal_()
    # Older checkpoints hold GPT-2's causal-mask buffer `attn.bias`, which the model
    # ignores ("attn.bias" in `_keys_to_ignore_on_load_unexpected`, a pattern that
    # also finds `c_attn.bias`: that one must still load).
    legacy = {"transformer.h.0.attn.bias": torch.ones(1, 1, 8, 8)}
    loaded = model.load_weights([*hf.state_dict().items(), *legacy.items()])
    assert loaded == {name for name, _ in model.named_parameters()}
    for name in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"):
        ours = model.model.h[1].get_submodule(name)
        theirs = hf.transformer.h[1].get_submodule(name)
        torch.testing.assert_close(ours.weight.data, theirs.weight.data.t())
        torch.testing.assert_close(ours.bias.data, theirs.bias.data)
