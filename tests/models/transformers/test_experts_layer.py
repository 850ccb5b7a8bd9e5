# SPDX-License-Identifier: Apache-2.0
"""vLLM's fused MoE for HF experts modules (`experts_layer.py`), in-process on the CPU:
the `"vllm"` experts function equals Transformers' experts; fused 3-D and per-expert
checkpoint tensors load alike; each tensor-parallel rank takes its share of the
gate/up rows and each expert-parallel rank only its experts."""

import copy
import dataclasses

import pytest
import torch
from configs import small_config
from transformers import AutoConfig
from transformers.models.aria.modeling_aria import AriaExperts
from transformers.models.gemma4.modeling_gemma4 import Gemma4TextExperts
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

from vllm.config import VllmConfig, set_current_vllm_config
from vllm.forward_context import set_forward_context
from vllm.model_executor.models.transformers.experts_layer import (
    VLLM_EXPERTS,
    VllmExperts,
    vllm_experts_forward,
)
from vllm.model_executor.models.transformers.fusers import ExpertsFuser

EXPERTS, TOP_K, INTERMEDIATE = 4, 2, 32


@pytest.fixture
def vllm_config(vllm_runtime):
    """A config of its own per test: each fused MoE registers its layer name in it."""
    config = VllmConfig()
    with set_current_vllm_config(config):
        yield config


def qwen3_experts() -> Qwen3MoeExperts:
    config = small_config(
        "qwen3_moe",
        num_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        moe_intermediate_size=INTERMEDIATE,
    )
    return Qwen3MoeExperts(config)


def gpt_oss_experts() -> GptOssExperts:
    config = AutoConfig.for_model(
        "gpt_oss",
        hidden_size=128,
        intermediate_size=INTERMEDIATE,
        num_local_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
    )
    return GptOssExperts(config)


def gemma4_experts() -> Gemma4TextExperts:
    """GELU-tanh experts whose config names its top-k `top_k_experts`."""
    config = AutoConfig.for_model(
        "gemma4_text",
        hidden_size=128,
        num_experts=EXPERTS,
        top_k_experts=TOP_K,
        moe_intermediate_size=INTERMEDIATE,
    )
    return Gemma4TextExperts(config)


def aria_experts() -> AriaExperts:
    """Experts stored transposed whose config names its top-k `moe_topk`."""
    config = AutoConfig.for_model(
        "aria_text",
        hidden_size=128,
        moe_num_experts=EXPERTS,
        moe_topk=TOP_K,
        intermediate_size=INTERMEDIATE,
    )
    return AriaExperts(config)


def randomized(experts: torch.nn.Module) -> torch.nn.Module:
    experts.config._experts_implementation = VLLM_EXPERTS
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in experts.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    return experts


def fused(
    experts: torch.nn.Module, vllm_config, prefix: str = "experts"
) -> tuple[torch.nn.Module, VllmExperts]:
    fuser = ExpertsFuser.match(None, experts)
    assert isinstance(fuser, ExpertsFuser)
    assert fuser.mismatch(experts, vllm_config) is None
    module = fuser.fuse(experts, prefix, vllm_config)
    return module, module.vllm_experts


def processed(layer: VllmExperts) -> None:
    for module in layer.modules():
        method = getattr(module, "quant_method", None)
        if hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(module)


@pytest.mark.parametrize(
    "build",
    [qwen3_experts, gpt_oss_experts, gemma4_experts, aria_experts],
    ids=["qwen3-silu", "gpt-oss-swigluoai", "gemma4-gelu-tanh", "aria-transposed"],
)
def test_vllm_experts_equal_transformers_experts(build, vllm_config):
    reference = randomized(build())
    module, layer = fused(copy.deepcopy(reference), vllm_config)
    layer.load_weights(reference.state_dict().items())
    processed(layer)
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(9, 128, generator=generator)
    ids = torch.stack(
        [torch.randperm(EXPERTS, generator=generator)[:TOP_K] for _ in range(9)]
    )
    weights = torch.rand(9, TOP_K, generator=generator)
    with set_forward_context(None, vllm_config):
        actual = vllm_experts_forward(module, hidden, ids, weights)
    expected = type(reference).forward.__wrapped__(reference, hidden, ids, weights)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-4)


def test_per_expert_tensors_load_as_the_fused_ones(vllm_config):
    reference = randomized(qwen3_experts())
    _, from_fused = fused(copy.deepcopy(reference), vllm_config)
    from_fused.load_weights(reference.state_dict().items())
    _, per_expert = fused(copy.deepcopy(reference), vllm_config, "per_expert")
    gate, up = reference.gate_up_proj.detach().chunk(2, dim=1)
    per_expert.load_weights(
        (f"{e}.{name}", tensor[e])
        for e in range(EXPERTS)
        for name, tensor in (
            ("gate_up_proj.0", gate),
            ("gate_up_proj.1", up),
            ("down_proj.0", reference.down_proj.detach()),
        )
    )
    for name, param in from_fused.named_parameters():
        torch.testing.assert_close(per_expert.get_parameter(name), param, rtol=0, atol=0)


def test_unknown_checkpoint_tensor_is_refused_with_its_name(vllm_config):
    _, layer = fused(randomized(qwen3_experts()), vllm_config)
    with pytest.raises(ValueError, match="'0.gate_proj.0' is not a part of the experts"):
        layer.load_weights([("0.gate_proj.0", torch.zeros(INTERMEDIATE, 128))])


def test_expert_parallel_rank_loads_only_its_experts(vllm_config):
    """Rank 1 of 2 holds experts 2 and 3 in its slots 0 and 1."""
    reference = randomized(qwen3_experts())
    _, layer = fused(copy.deepcopy(reference), vllm_config)
    routed = layer.moe.routed_experts
    # What vLLM's expert map says on rank 1 of 2 (EP cannot run in one process).
    routed.expert_map_manager._expert_map = torch.tensor([-1, -1, 0, 1])
    for param in routed.parameters():
        param.data.fill_(float("nan"))
    layer.load_weights(reference.state_dict().items())
    w13, w2 = routed.w13_weight.data, routed.w2_weight.data
    torch.testing.assert_close(w13[:2], reference.gate_up_proj.detach()[2:])
    torch.testing.assert_close(w2[:2], reference.down_proj.detach()[2:])
    assert w13[2:].isnan().all() and w2[2:].isnan().all()


@pytest.mark.parametrize(
    ("build", "rows"),
    [
        # HF rows: gate 0-3, up 4-7; rank 1 keeps gate 2-3 and up 6-7, and the
        # kernel reads gate then up.
        (qwen3_experts, [-1, -1, 0, 1, -1, -1, 2, 3]),
        # HF rows interleave gate and up, and so does the swigluoai kernel; rank 1
        # keeps intermediate 2-3, rows 4-7.
        (gpt_oss_experts, [-1, -1, -1, -1, 0, 1, 2, 3]),
    ],
    ids=["concatenated", "interleaved"],
)
def test_tensor_parallel_rank_takes_its_share_of_the_gate_and_up_rows(
    build, rows, vllm_config
):
    _, layer = fused(randomized(build()), vllm_config)
    layer.layout = dataclasses.replace(layer.layout, intermediate_size=4)
    config = layer.moe.routed_experts.moe_config
    config.moe_parallel_config = dataclasses.replace(
        config.moe_parallel_config, tp_rank=1, tp_size=2
    )
    assert layer.w13_rows.tolist() == rows
