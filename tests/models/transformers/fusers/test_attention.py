# SPDX-License-Identifier: Apache-2.0
"""AttentionFuser on real HF architectures built on `meta`, and on small modules."""

import pytest
import torch
from torch import nn
from transformers import AutoConfig, AutoModel
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from vllm.model_executor.models.transformers.fuser import get_fuser
from vllm.model_executor.models.transformers.fusers import AttentionFuser
from vllm.model_executor.models.transformers.fusers.base import DECLINED


def meta_model(model_type: str, **overrides) -> nn.Module:
    config = AutoConfig.for_model(model_type, **{"num_hidden_layers": 3, **overrides})
    with torch.device("meta"):
        return AutoModel.from_config(config)


def attention_modules(model: nn.Module) -> dict[str, tuple[nn.Module, AttentionFuser]]:
    return {
        name: (module, fuser)
        for name, module in model.named_modules()
        if (fuser := get_fuser(module, AttentionFuser)) is not None
    }


@pytest.mark.parametrize(
    ("model_type", "attention_name"),
    [
        ("llama", "self_attn"),
        ("gemma3_text", "self_attn"),
        ("deepseek_v3", "self_attn"),
    ],
)
def test_exactly_the_decoder_attention_modules_match(model_type, attention_name):
    model = meta_model(model_type)
    expected = {f"layers.{i}.{attention_name}" for i in range(3)}
    assert set(attention_modules(model)) == expected


def test_layer_index_is_the_modules_own():
    # LongCat Flash has two attention sublayers per decoder layer, numbered 2i and
    # 2i + 1: the enclosing layer's position is not the KV-cache index.
    model = meta_model("longcat_flash", num_hidden_layers=6)  # 3 decoder layers
    indices = {
        name: fuser.layer_index(module)
        for name, (module, fuser) in attention_modules(model).items()
    }
    expected = {
        f"layers.{i}.self_attn.{j}": 2 * i + j for i in range(3) for j in range(2)
    }
    assert indices == expected


def test_scale_is_the_declared_one_for_gemma():
    model = meta_model("gemma3_text", head_dim=64, query_pre_attn_scalar=100)
    for module, fuser in attention_modules(model).values():
        assert fuser.scale(module, default=64**-0.5) == pytest.approx(100**-0.5)


def test_scale_is_the_declared_one_for_deepseek_yarn():
    rope = {
        "rope_type": "yarn",
        "factor": 40.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
        "rope_theta": 10000.0,
    }
    model = meta_model("deepseek_v3", rope_parameters=rope)
    head_size = model.config.qk_nope_head_dim + model.config.qk_rope_head_dim
    for module, fuser in attention_modules(model).values():
        scale = fuser.scale(module, default=head_size**-0.5)
        assert scale == pytest.approx(module.scaling)
        assert scale > head_size**-0.5 * 1.5  # the yarn mscale is applied


def test_scale_is_the_argument_not_the_attribute():
    # OPT scales the query itself, then passes scaling=1.0 to the interface.
    model = meta_model("opt")
    for module, fuser in attention_modules(model).values():
        assert module.scaling != 1.0
        assert fuser.scale(module, default=module.head_dim**-0.5) == 1.0


def test_no_scaling_argument_means_the_default():
    class NoScaling(nn.Module):
        def forward(self, q, k, v):
            interface = ALL_ATTENTION_FUNCTIONS.get_interface("sdpa", None)
            return interface(self, q, k, v, None)

    fuser = AttentionFuser.match(None, NoScaling())
    assert fuser.scale(NoScaling(), default=0.25) == 0.25


def test_unresolvable_scale_is_a_clear_error():
    class ComputedScale(nn.Module):
        def forward(self, q, k, v):
            interface = ALL_ATTENTION_FUNCTIONS["sdpa"]
            return interface(self, q, k, v, None, scaling=self.head_dim**-0.5)

    module = ComputedScale()
    fuser = AttentionFuser.match(None, module)
    with pytest.raises(
        ValueError,
        match=r"ComputedScale passes scaling=self.head_dim \*\* \(-0.5\).*cannot resolve",
    ):
        fuser.scale(module, default=1.0)


def test_two_interface_calls_are_declined_with_a_reason():
    class TwoCalls(nn.Module):
        def forward(self, q, k, v):
            interface = ALL_ATTENTION_FUNCTIONS.get_interface("sdpa", None)
            first, _ = interface(self, q, k, v, None)
            return interface(self, first, k, v, None)

    assert AttentionFuser.match(None, TwoCalls()) is None
    assert DECLINED[-1].module_class == "TwoCalls"
    assert "calls it 2 times" in DECLINED[-1].reason


def test_module_without_interface_does_not_match():
    model = meta_model("bloom")
    assert attention_modules(model) == {}


def test_only_a_config_patched_to_vllm_is_validated():
    model = meta_model("llama")
    module, fuser = attention_modules(model)["layers.0.self_attn"]
    assert not fuser.validate(module, vllm_config=None)
    module.config._attn_implementation = "vllm"
    assert fuser.validate(module, vllm_config=None)


def test_layer_index_must_be_declared():
    model = meta_model("llama")
    module, fuser = attention_modules(model)["layers.0.self_attn"]
    del module.layer_idx
    with pytest.raises(
        ValueError, match="LlamaAttention .* declares no integer `layer_idx`"
    ):
        fuser.layer_index(module)
