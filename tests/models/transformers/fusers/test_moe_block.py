# SPDX-License-Identifier: Apache-2.0
"""The MoE block fuser: a block whose router's ids and weights go only to its
experts hands vLLM's router's choice straight to vLLM's fused MoE; the same numbers
reach the same kernel as through Transformers' experts interface. Blocks that read
the choice elsewhere, call their experts otherwise, or whose router or experts are
not on vLLM's are left on the interface, with why."""

import copy
import dataclasses

import pytest
import torch
from configs import small_config
from conftest import _fuse, randomize
from transformers import AutoConfig
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from vllm.config import VllmConfig, set_current_vllm_config
from vllm.forward_context import set_forward_context
from vllm.model_executor.models.transformers.experts_layer import (
    VLLM_EXPERTS,
    VllmExperts,
)
from vllm.model_executor.models.transformers.plan import get_fuser, get_fusers
from vllm.model_executor.models.transformers.fusers import (
    ExpertsFuser,
    MoEBlockFuser,
    RouterFuser,
)

HIDDEN = 64


def config(model_type: str, **changes):
    return AutoConfig.for_model(
        model_type, hidden_size=HIDDEN, moe_intermediate_size=32, **changes
    )


def qwen3_config():
    return config("qwen3_moe", num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)


def qwen3() -> Qwen3MoeSparseMoeBlock:
    return Qwen3MoeSparseMoeBlock(qwen3_config())


BLOCKS = {
    "qwen3": qwen3,
    "mixtral": lambda: MixtralSparseMoeBlock(
        AutoConfig.for_model(
            "mixtral", hidden_size=HIDDEN, intermediate_size=32, num_local_experts=8
        )
    ),
    # A shared expert behind a sigmoid gate, computed in the block's own code.
    "qwen2-shared-expert": lambda: Qwen2MoeSparseMoeBlock(
        config("qwen2_moe", num_experts=8, num_experts_per_tok=2,
               shared_expert_intermediate_size=32)
    ),
    # Grouped sigmoid top-k with a correction bias and routed scaling; the router
    # is handed the 3-D hidden states, the experts their 2-D view.
    "deepseek-v3": lambda: DeepseekV3MoE(
        config("deepseek_v3", n_routed_experts=16, num_experts_per_tok=4, n_group=4,
               topk_group=2, routed_scaling_factor=2.5, n_shared_experts=1)
    ),
}


def fused(
    block: torch.nn.Module, dtype: torch.dtype, whole_block: bool
) -> tuple[torch.nn.Module, VllmConfig]:
    """`block` with its router and experts fused (their weights loaded), and the
    block itself too where `whole_block`; in a vLLM config of its own (each fused
    MoE registers its layer name)."""
    vllm_config = VllmConfig()
    with set_current_vllm_config(vllm_config):
        block.gate, applied = _fuse(block.gate, vllm_config, dtype)
        assert [type(f) for f in applied] == [RouterFuser]
        block.experts, applied = _fuse(block.experts, vllm_config, dtype)
        assert [type(f) for f in applied] == [ExpertsFuser]
        if whole_block:
            fuser = get_fuser(block, MoEBlockFuser)
            assert isinstance(fuser, MoEBlockFuser)
            assert fuser.mismatch(block, vllm_config) is None
            block = fuser.fuse(block, "block", vllm_config)
    return block, vllm_config


def run(block: torch.nn.Module, vllm_config: VllmConfig, x: torch.Tensor):
    with torch.no_grad(), set_forward_context(None, vllm_config):
        return block(x)


def randomized(block: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    block = randomize(block, dtype)
    block.experts.config._experts_implementation = VLLM_EXPERTS
    return block


@pytest.mark.parametrize("name", BLOCKS)
def test_block_hands_the_routers_choice_straight_to_vllms_fused_moe(
    name, vllm_runtime, monkeypatch
):
    reference = randomized(BLOCKS[name](), torch.float32)
    through_interface, interface_config = fused(
        copy.deepcopy(reference), torch.float32, whole_block=False
    )
    block, block_config = fused(copy.deepcopy(reference), torch.float32, True)
    x = torch.randn(2, 7, HIDDEN, generator=torch.Generator().manual_seed(1))
    expected = run(through_interface, interface_config, x)

    def through_the_interface(*args):
        raise AssertionError("the experts were reached through the interface")

    monkeypatch.setattr(VllmExperts, "forward", through_the_interface)
    actual = run(block, block_config, x)
    # The same numbers into the same kernel: bit for bit what the interface gives.
    assert torch.equal(actual, expected)
    torch.testing.assert_close(actual, reference(x), atol=1e-5, rtol=1e-4)


def test_in_bfloat16_the_experts_weigh_with_the_routers_rounded_weights(
    vllm_runtime,
):
    """Qwen3's router hands its weights back rounded to bfloat16: handed straight
    to the fused MoE they are rounded the same way."""
    reference = randomized(qwen3(), torch.bfloat16)
    through_interface, interface_config = fused(
        copy.deepcopy(reference), torch.bfloat16, whole_block=False
    )
    block, block_config = fused(copy.deepcopy(reference), torch.bfloat16, True)
    x = torch.randn(3, 5, HIDDEN, generator=torch.Generator().manual_seed(1)).to(
        torch.bfloat16
    )
    assert torch.equal(
        run(block, block_config, x), run(through_interface, interface_config, x)
    )


def test_the_rewritten_forward_calls_the_vllm_layers(vllm_runtime):
    block, _ = fused(randomized(qwen3(), torch.float32), torch.float32, True)
    code = block.forward.__func__.__code__
    assert {"vllm_router", "choice", "vllm_experts", "run"} <= set(code.co_names)


class ReadsTheWeights(Qwen3MoeSparseMoeBlock):
    def forward(self, hidden_states):
        hidden_states = hidden_states.view(-1, hidden_states.shape[-1])
        _, weights, ids = self.gate(hidden_states)
        return self.experts(hidden_states, ids, weights), weights


class ReadsTheLogits(Qwen3MoeSparseMoeBlock):
    def forward(self, hidden_states):
        hidden_states = hidden_states.view(-1, hidden_states.shape[-1])
        logits, weights, ids = self.gate(hidden_states)
        return self.experts(hidden_states, ids, weights), logits


class ChangesTheIds(Qwen3MoeSparseMoeBlock):
    def forward(self, hidden_states):
        hidden_states = hidden_states.view(-1, hidden_states.shape[-1])
        _, weights, ids = self.gate(hidden_states)
        kept = ids.clamp(max=3)
        return self.experts(hidden_states, kept, weights)


class CallsTheExpertsTwice(Qwen3MoeSparseMoeBlock):
    def forward(self, hidden_states):
        hidden_states = hidden_states.view(-1, hidden_states.shape[-1])
        _, weights, ids = self.gate(hidden_states)
        half = self.experts(hidden_states, ids, weights)
        return half + self.experts(hidden_states, ids, weights)


class PassesByKeyword(Qwen3MoeSparseMoeBlock):
    def forward(self, hidden_states):
        hidden_states = hidden_states.view(-1, hidden_states.shape[-1])
        _, weights, ids = self.gate(hidden_states)
        return self.experts(hidden_states, top_k_index=ids, top_k_weights=weights)


class KeepsTheLogits(Qwen3MoeSparseMoeBlock):
    def forward(self, hidden_states):
        hidden_states = hidden_states.view(-1, hidden_states.shape[-1])
        self.last_logits, weights, ids = self.gate(hidden_states)
        return self.experts(hidden_states, ids, weights)


NEAR_MISSES = {
    KeepsTheLogits: "it unpacks the router's outputs into more than names",
    ReadsTheWeights: "`weights`, handed to self.experts, is bound or read elsewhere",
    ReadsTheLogits: "it reads another output of self.gate",
    ChangesTheIds: "are not unpacked from one `self.<router>(x)` statement",
    CallsTheExpertsTwice: "it calls its experts 2 times",
    PassesByKeyword: "does not call its experts as `self.experts(x, ids, weights)`",
}


@pytest.mark.parametrize("cls", NEAR_MISSES, ids=lambda cls: cls.__name__)
def test_block_reading_the_choice_otherwise_is_declined_with_why(cls, declined):
    block = cls(qwen3_config())
    assert get_fuser(block, MoEBlockFuser) is None
    (reason,) = declined(MoEBlockFuser)
    assert NEAR_MISSES[cls] in reason


def test_gpt_oss_block_returning_its_router_scores_is_declined(declined):
    block = GptOssMLP(
        AutoConfig.for_model(
            "gpt_oss", hidden_size=HIDDEN, intermediate_size=32, num_local_experts=4
        )
    )
    assert get_fuser(block, MoEBlockFuser) is None
    (reason,) = declined(MoEBlockFuser)
    assert "`router_scores`, handed to self.experts, is bound or read" in reason


def test_block_without_experts_is_not_a_moe_block():
    assert not any(
        isinstance(f, MoEBlockFuser)
        for f in get_fusers(qwen3().gate)
    )


def test_routing_that_does_not_fit_the_call_is_refused():
    fuser = get_fuser(qwen3(), MoEBlockFuser)
    routing = get_fuser(qwen3().gate, RouterFuser).routing
    layout = ExpertsFuser(activation="silu").layout(qwen3().experts)
    assert fuser.unfit(routing, layout) is None
    swapped = dataclasses.replace(routing, outputs=("logits", "ids", "weights"))
    assert "the router's weights and ids, not its ids and weights" in fuser.unfit(
        swapped, layout
    )
    fewer = dataclasses.replace(routing, outputs=("weights", "ids"))
    assert "returns 2 outputs, its block unpacks 3" in fuser.unfit(fewer, layout)
    other_k = dataclasses.replace(layout, top_k=3)
    assert "chooses 2 experts per token, self.experts is built for 3" in fuser.unfit(
        routing, other_k
    )


def test_every_qwen3_moe_block_of_a_model_takes_it(build_backend):
    model = build_backend(small_config("qwen3_moe", num_hidden_layers=3))
    plan = model.plan
    taken = sorted(
        plan.name(m) for m in plan if any(isinstance(f, MoEBlockFuser) for f in plan[m])
    )
    assert taken == [f"model.layers.{i}.mlp" for i in range(3)]
    assert model.report.fusions["moe_block"] == 3


def test_block_whose_router_stays_transformers_keeps_the_interface(
    build_backend, monkeypatch
):
    monkeypatch.setattr(
        RouterFuser, "mismatch", lambda self, module, vllm_config: "a test's reason"
    )
    model = build_backend(small_config("qwen3_moe", num_hidden_layers=2))
    assert not any(
        isinstance(f, MoEBlockFuser) for m in model.plan for f in model.plan[m]
    )
    reasons = {d.reason for d in model.plan.declined if d.fuser == "MoEBlockFuser"}
    assert reasons == {
        "model.layers.0.mlp.gate (Qwen3MoeTopKRouter) is not fused by RouterFuser: "
        "RouterFuser: a test's reason"
    }
