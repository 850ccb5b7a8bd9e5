# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The fusions found in real HF architectures, built on `meta` from their configs."""

import pytest
import torch
from configs import small_config
from torch import nn
from transformers import AutoModel

import vllm.model_executor.models.transformers  # noqa: F401 - registers "vllm" attention
from vllm.model_executor.models.transformers.plan import get_fusers
from vllm.model_executor.models.transformers.fusers import AttentionFuser

# The rotary function's fusion is found per class; the plan pairs it with the model's
# rotary embedding (fusers/test_rotary.py).
ATTENTION = ["QKVFuser", "RotaryFuser", "AttentionFuser"]
PACKED_ATTENTION = ["PackedQKVFuser", "RotaryFuser", "AttentionFuser"]
GLU, NORM = ["GLUFuser"], ["RMSNormFuser"]
# The decoder layer itself: its residual add into the norm after the attention.
ADD_NORM = {"": ["AddRMSNormFuser"]}

EXPECTED = {
    "llama": {
        **ADD_NORM,
        "self_attn": ATTENTION,
        "mlp": GLU,
        "input_layernorm": NORM,
        "post_attention_layernorm": NORM,
    },
    "qwen3": {
        **ADD_NORM,
        "self_attn": ATTENTION,
        "self_attn.q_norm": NORM,
        "self_attn.k_norm": NORM,
        "mlp": GLU,
        "input_layernorm": NORM,
        "post_attention_layernorm": NORM,
    },
    "gemma3_text": {
        **ADD_NORM,
        "self_attn": ATTENTION,
        "self_attn.q_norm": NORM,
        "self_attn.k_norm": NORM,
        "mlp": GLU,
        "input_layernorm": NORM,
        "post_attention_layernorm": NORM,
        "pre_feedforward_layernorm": NORM,
        "post_feedforward_layernorm": NORM,
    },
    # Phi-3's MLP packs gate and up in one linear: no GLUFuser pattern.
    "phi3": {
        "self_attn": PACKED_ATTENTION,
        "input_layernorm": NORM,
        "post_attention_layernorm": NORM,
    },
    # Multi-query c_attn packs q, k, v; LayerNorms and a plain MLP stay as they are.
    "gpt_bigcode": {"attn": ["PackedQKVFuser", "AttentionFuser"]},
    "olmo2": {
        "self_attn": ATTENTION,
        "self_attn.q_norm": NORM,
        "self_attn.k_norm": NORM,
        "mlp": GLU,
        "post_attention_layernorm": NORM,
        "post_feedforward_layernorm": NORM,
    },
    "granite": {
        "self_attn": ATTENTION,
        "mlp": GLU,
        "input_layernorm": NORM,
        "post_attention_layernorm": NORM,
    },
}


def first_layer(model_type: str) -> nn.Module:
    config = small_config(model_type, num_hidden_layers=1, pad_token_id=0)
    config._attn_implementation = "vllm"
    with torch.device("meta"):
        model = AutoModel.from_config(config)
    return next(m for m in model.modules() if isinstance(m, nn.ModuleList))[0]


@pytest.mark.parametrize("model_type", list(EXPECTED))
def test_expected_fusions_per_decoder_layer(model_type):
    layer = first_layer(model_type)
    found = {
        name: [type(f).__name__ for f in fusers]
        for name, module in layer.named_modules()
        if (fusers := get_fusers(module))
    }
    assert found == EXPECTED[model_type]


@pytest.mark.parametrize("model_type", list(EXPECTED))
def test_each_fusion_applies_and_says_so(model_type, vllm_config):
    layer = first_layer(model_type)
    lines = []
    for name, module in list(layer.named_modules()):
        parent, _, child = name.rpartition(".")
        for fuser in get_fusers(module):
            if isinstance(fuser, AttentionFuser) or not fuser.validate(
                module, vllm_config
            ):
                continue
            fused = fuser.fuse(module, name, vllm_config)
            if name:
                setattr(layer.get_submodule(parent), child, fused)
            lines.append(fuser.info(name, fused))
    expected = sum(len(f) for f in EXPECTED[model_type].values()) - sum(
        "AttentionFuser" in f for f in EXPECTED[model_type].values()
    )
    assert len(lines) == expected
    assert all(line.startswith("Fused: ") for line in lines)
    if model_type == "llama":
        assert lines[:2] == [
            "Fused: residual + hidden_states -> post_attention_layernorm (: "
            "LlamaDecoderLayer) -> vLLM's fused add-and-norm",
            "Fused: q_proj + k_proj + v_proj (self_attn: LlamaAttention) -> qkv_proj "
            "(QKVParallelLinear); o_proj -> RowParallelLinear",
        ]
