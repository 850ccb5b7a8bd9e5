# SPDX-License-Identifier: Apache-2.0
"""The `"vllm"` attention function on real HF attention modules, run on the CPU with
a stand-in for vLLM's layer built from what the backend reads off the module."""

import pytest
import torch
from torch import nn
from transformers import AutoConfig, AutoModel

import vllm.model_executor.models.transformers  # noqa: F401 - registers "vllm"
from vllm.model_executor.models.transformers.plan import get_fuser
from vllm.model_executor.models.transformers.fusers import AttentionFuser


class StandIn(nn.Module):
    """What vLLM's `Attention` is built with, and causal attention over the tokens
    it is handed (`[tokens, heads * head_size]`), grouped query heads per KV head."""

    def __init__(self, needs):
        super().__init__()
        self.num_heads, self.num_kv_heads = needs.num_heads, needs.num_kv_heads
        self.head_size, self.head_size_v = needs.head_size, needs.head_size_v
        self.scale = needs.scale

    def forward(self, query, key, value):
        tokens = query.shape[0]
        q = query.view(tokens, self.num_heads, self.head_size).transpose(0, 1)
        k = key.view(tokens, self.num_kv_heads, self.head_size).transpose(0, 1)
        v = value.view(tokens, self.num_kv_heads, self.head_size_v).transpose(0, 1)
        group = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        out = nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=self.scale
        )
        return out.transpose(0, 1).reshape(tokens, -1)


def _model(model_type: str, **overrides) -> nn.Module:
    config = AutoConfig.for_model(
        model_type,
        **dict(
            hidden_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=32,
            **overrides,
        ),
    )
    torch.manual_seed(0)
    return AutoModel.from_config(config, attn_implementation="eager").eval()


def _outputs(model: nn.Module, attention: nn.Module) -> tuple[torch.Tensor, ...]:
    """The model's hidden states with eager attention, then with `"vllm"` attention
    on a stand-in built from the backend's reading of `attention`."""
    ids = torch.arange(1, 8)[None]
    with torch.no_grad():
        eager = model(ids).last_hidden_state
        fuser = get_fuser(attention, AttentionFuser)
        attention.attn = StandIn(fuser.attention_needs(attention, None))
        model.config._attn_implementation = "vllm"
        return eager, model(ids).last_hidden_state


def test_heads_read_off_the_module_serve_it():
    model = _model("llama")
    eager, served = _outputs(model, model.layers[0].self_attn)
    torch.testing.assert_close(served, eager, rtol=1e-5, atol=1e-5)


def test_keys_repeated_before_the_call_are_an_error_not_a_wrong_answer():
    # JetMoE tiles its 2 key/value heads to its 4 query heads before the call, and
    # its router stops tracing first (`.tolist()`): the backend reads 2 key/value
    # heads off its attributes, and vLLM's layer would reinterpret the 4 it is
    # handed (the engine gave other tokens from the first step).
    model = _model("jetmoe", kv_channels=16, num_local_experts=4, intermediate_size=32)
    attention = model.layers[0].self_attention
    with pytest.raises(
        ValueError,
        match=r"JetMoeAttention \(layer 0\) hands the attention interface 4 query "
        r"heads of 16, 4 key heads .* built for it with 4 query heads and 2 "
        r"key/value heads",
    ):
        _outputs(model, attention)
