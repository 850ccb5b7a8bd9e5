# SPDX-License-Identifier: Apache-2.0
"""The gated-delta-net fuser: which mixers vLLM's `QwenGatedDeltaNetAttention`
serves (Qwen3-Next's per-key-head projections, Qwen3.5's four linears), proven on a
float64 probe against the module itself, and which it declines, with why."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from configs import small_config
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

from vllm.model_executor.models.transformers.fusers.base import Declined
from vllm.model_executor.models.transformers.fusers.gated_delta_net import (
    GatedDeltaNetFuser,
)
from vllm.model_executor.models.transformers.fusers.mamba2 import Mamba2MixerFuser
from vllm.model_executor.models.transformers.mixers import GatedDeltaNetDims

LINEAR = dict(
    layer_types=["linear_attention", "full_attention"],
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=32,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
)
"""Small heads (the probe runs Transformers' module, not vLLM's kernels), keys wider
than values so that a swapped width shows."""


def qwen3_next_mixer(**changes) -> Qwen3NextGatedDeltaNet:
    config = small_config("qwen3_next", **{**LINEAR, **changes})
    return Qwen3NextGatedDeltaNet(config, layer_idx=0)


def qwen3_5_mixer(**changes) -> Qwen3_5GatedDeltaNet:
    config = small_config("qwen3_5_text", **{**LINEAR, **changes})
    return Qwen3_5GatedDeltaNet(config, layer_idx=0)


def matched(module: torch.nn.Module) -> GatedDeltaNetFuser:
    fuser = GatedDeltaNetFuser.match(None, module)
    assert isinstance(fuser, GatedDeltaNetFuser), fuser
    return fuser


def proven(module: torch.nn.Module) -> GatedDeltaNetDims | str:
    return matched(module).dims(module)


@pytest.mark.parametrize(
    ("mixer", "interleaved"), [(qwen3_next_mixer, True), (qwen3_5_mixer, False)]
)
def test_both_projection_layouts_are_proven(mixer, interleaved):
    assert proven(mixer()) == GatedDeltaNetDims(
        hidden_size=128,
        num_k_heads=2,
        num_v_heads=4,
        head_k_dim=32,
        head_v_dim=16,
        conv_kernel=4,
        eps=1e-6,
        interleaved=interleaved,
        output_gate="silu",
    )


def test_a_sigmoid_output_gate_is_found_by_the_probe():
    mixer = qwen3_next_mixer()
    mixer.norm.activation = "sigmoid"
    dims = proven(mixer)
    assert isinstance(dims, GatedDeltaNetDims) and dims.output_gate == "sigmoid"


def test_key_heads_that_split_the_keys_otherwise_are_declined_saying_where():
    # The widths alone do not say how the keys split into heads (the module's
    # `num_k_heads` does): built with 4 key heads of 16, vLLM's layer would
    # L2-normalise per 16 where the module does per 32, and the probe sees it.
    mixer = qwen3_5_mixer()
    dims = proven(mixer)
    assert isinstance(dims, GatedDeltaNetDims), dims
    wrong = dataclasses.replace(dims, num_k_heads=4, head_k_dim=16)
    found = GatedDeltaNetFuser.prove(mixer, wrong)
    assert isinstance(found, str)
    assert "on a float64 probe vLLM's QwenGatedDeltaNetAttention" in found
    assert "the prefill" in found


def test_an_output_gate_vllm_has_not_is_declined():
    mixer = qwen3_next_mixer()
    mixer.norm.activation = "gelu"
    dims = proven(mixer)
    assert isinstance(dims, str) and "differs from it by" in dims


def test_a_projection_with_a_bias_is_declined():
    mixer = qwen3_5_mixer()
    mixer.in_proj_z = torch.nn.Linear(128, mixer.value_dim, bias=True)
    dims = proven(mixer)
    assert isinstance(dims, str) and "has a bias" in dims


def test_parts_vllm_has_no_place_for_are_declined_naming_them():
    mixer = qwen3_next_mixer()
    mixer.extra_proj = torch.nn.Linear(128, 8, bias=False)
    found = GatedDeltaNetFuser.match(None, mixer)
    assert isinstance(found, Declined) and "extra_proj" in found.reason


def test_qwen3_5s_four_linears_load_as_shards_of_vllms_two():
    fuser = matched(qwen3_5_mixer())
    prefix = "model.layers.0.linear_attn"
    assert fuser.stacked_weights(prefix) == {
        f"{prefix}.in_proj_qkv.": (f"{prefix}.in_proj_qkvz.", (0, 1, 2)),
        f"{prefix}.in_proj_z.": (f"{prefix}.in_proj_qkvz.", 3),
        f"{prefix}.in_proj_b.": (f"{prefix}.in_proj_ba.", 0),
        f"{prefix}.in_proj_a.": (f"{prefix}.in_proj_ba.", 1),
    }
    assert matched(qwen3_next_mixer()).stacked_weights(prefix) == {}


def test_vllms_cpu_kernels_take_bfloat16_only():
    mixer = qwen3_next_mixer()
    fuser = matched(mixer)
    dims = fuser.dims(mixer)

    def config(dtype: torch.dtype, tp: int = 1) -> SimpleNamespace:
        return SimpleNamespace(
            model_config=SimpleNamespace(dtype=dtype),
            parallel_config=SimpleNamespace(tensor_parallel_size=tp),
        )

    assert fuser.unfit(mixer, dims, config(torch.bfloat16)) is None
    refused = fuser.unfit(mixer, dims, config(torch.float32))
    assert "bfloat16 only" in refused and "served in float32" in refused
    assert "do not divide across 4" in fuser.unfit(mixer, dims, config(torch.bfloat16, 4))


def test_a_gated_delta_net_is_no_mamba2_mixer():
    # Both hold A_log, dt_bias and a conv1d; a Mamba-2 mixer also holds D.
    assert Mamba2MixerFuser.match(None, qwen3_next_mixer()) is None
    assert GatedDeltaNetFuser.match(None, torch.nn.Linear(4, 4)) is None
