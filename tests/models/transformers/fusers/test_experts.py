# SPDX-License-Identifier: Apache-2.0
"""The experts fuser: which experts modules vLLM's fused MoE serves, with what
activation and gate/up layout, read from what their gate computes; and which it
declines, with why."""

import pytest
import torch
from configs import small_config
from transformers import AutoConfig
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

from vllm.model_executor.models.transformers.fusers.base import Declined
from vllm.model_executor.models.transformers.fusers.experts import (
    ExpertsFuser,
    gate_activation,
)


def qwen3_experts(**changes) -> Qwen3MoeExperts:
    return Qwen3MoeExperts(
        small_config("qwen3_moe", num_experts=4, moe_intermediate_size=32, **changes)
    )


def gpt_oss_experts(**changes) -> GptOssExperts:
    config = AutoConfig.for_model(
        "gpt_oss", hidden_size=64, intermediate_size=32, num_local_experts=4, **changes
    )
    return GptOssExperts(config)


@pytest.mark.parametrize(
    "hidden_act, expected",
    [("silu", "silu"), ("gelu", "gelu"), ("gelu_pytorch_tanh", "gelu_tanh")],
)
def test_default_gate_reads_concatenated_gate_and_up_with_its_activation(
    hidden_act, expected
):
    experts = qwen3_experts(hidden_act=hidden_act)
    assert gate_activation(experts) == (expected, True)
    fuser = ExpertsFuser.match(None, experts)
    assert isinstance(fuser, ExpertsFuser)
    assert (fuser.activation, fuser.concatenated) == (expected, True)


def test_gpt_oss_gate_is_the_clamped_swiglu_on_interleaved_rows():
    fuser = ExpertsFuser.match(None, gpt_oss_experts())
    assert isinstance(fuser, ExpertsFuser)
    assert (fuser.activation, fuser.concatenated) == ("swigluoai", False)
    layout = fuser.layout(gpt_oss_experts())
    assert (layout.num_experts, layout.hidden_size, layout.intermediate_size) == (
        4,
        64,
        32,
    )
    assert layout.transposed and layout.has_bias and layout.kernel_interleaved


@pytest.mark.parametrize(
    "change, reason",
    [
        # vLLM's kernels clamp at 7: another limit computes something else.
        (dict(swiglu_limit=6.0), "computes no activation vLLM's fused MoE has"),
        (dict(swiglu_alpha=1.0), "computes no activation vLLM's fused MoE has"),
    ],
)
def test_gate_vllm_has_no_activation_for_is_declined(change, reason):
    found = ExpertsFuser.match(None, gpt_oss_experts(**change))
    assert isinstance(found, Declined)
    assert reason in found.reason and found.module_class == "GptOssExperts"
    assert "fusers/experts.py:" in found.location


def test_gate_with_gate_and_up_swapped_is_declined():
    experts = qwen3_experts()
    # act(up) * gate: the activation applied to the second half, not the first.
    experts._apply_gate = lambda x: experts.act_fn(x.chunk(2, -1)[1]) * x.chunk(2, -1)[0]  # noqa: E501
    found = ExpertsFuser.match(None, experts)
    assert isinstance(found, Declined)
    assert "computes no activation" in found.reason


def test_instance_whose_activation_differs_from_the_analysed_one_is_not_fused(
    vllm_runtime,
):
    fuser = ExpertsFuser.match(None, qwen3_experts())
    other = qwen3_experts(hidden_act="gelu")
    other.config._experts_implementation = "vllm"
    reason = fuser.mismatch(other, _vllm_config())
    assert reason is not None and "gelu, not silu" in reason


def test_experts_not_dispatching_to_vllm_are_not_fused(vllm_runtime):
    fuser = ExpertsFuser.match(None, qwen3_experts())
    reason = fuser.mismatch(qwen3_experts(), _vllm_config())
    assert reason is not None and "not to vLLM" in reason


def _vllm_config():
    from vllm.config import ParallelConfig, VllmConfig

    return VllmConfig(parallel_config=ParallelConfig())


def test_probe_does_not_depend_on_the_default_device():
    with torch.device("meta"):
        experts = qwen3_experts()
    assert gate_activation(experts) == ("silu", True)
