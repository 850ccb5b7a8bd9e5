# SPDX-License-Identifier: Apache-2.0
"""The router fuser: which MoE routers move into vLLM's router, with what routing
(read from their dataflow), proven to choose what Transformers chooses; and the
near misses it declines, with why."""

import copy
import dataclasses
import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
from transformers.models.ernie4_5_moe.modeling_ernie4_5_moe import (
    Ernie4_5_MoeTopKRouter,
)
from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter
from transformers.models.afmoe.modeling_afmoe import AfmoeTokenChoiceRouter
from transformers.models.hunyuan_v1_moe.modeling_hunyuan_v1_moe import HunYuanMoEV1Gate
from transformers.models.hy_v3.modeling_hy_v3 import HYV3TopKRouter
from transformers.models.minimax_m2.modeling_minimax_m2 import MiniMaxM2TopKRouter
from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from vllm.model_executor.models.transformers.plan import get_fuser
from vllm.model_executor.models.transformers.fusers import RouterFuser
from vllm.model_executor.models.transformers.routing import ROUTER_ATTR, VllmRouter

HIDDEN = 64


def config(model_type: str, **changes):
    return AutoConfig.for_model(model_type, hidden_size=HIDDEN, **changes)


def qwen3(norm_topk_prob: bool) -> nn.Module:
    return Qwen3MoeTopKRouter(
        config("qwen3_moe", num_experts=16, num_experts_per_tok=4,
               norm_topk_prob=norm_topk_prob)
    )


def deepseek_v3() -> nn.Module:
    return DeepseekV3TopkRouter(
        config("deepseek_v3", n_routed_experts=16, num_experts_per_tok=4, n_group=4,
               topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True)
    )


# Router -> what its dataflow says (Routing's fields that differ between them).
ROUTERS = {
    "qwen3-softmax": (
        lambda: qwen3(False),
        dict(scoring="softmax", top_k=4, renormalize=False, scale=1.0),
    ),
    "qwen3-softmax-renormalised": (
        lambda: qwen3(True),
        dict(scoring="softmax", top_k=4, renormalize=True),
    ),
    "mixtral-float-softmax": (
        lambda: MixtralTopKRouter(config("mixtral", num_local_experts=8)),
        dict(scoring="softmax", top_k=2, renormalize=True),
    ),
    "gpt-oss-biased-logits-softmax-after-top-k": (
        lambda: GptOssTopKRouter(config("gpt_oss", num_local_experts=8)),
        dict(scoring="softmax", top_k=4, renormalize=True, flattens=False),
    ),
    "hunyuan-child-linear": (
        lambda: HunYuanMoEV1Gate(config("hunyuan_v1_moe", num_experts=8, moe_topk=2)),
        dict(scoring="softmax", top_k=2, renormalize=True),
    ),
    "deepseek-v3-grouped-sigmoid-corrected-scaled": (
        deepseek_v3,
        dict(scoring="sigmoid", top_k=4, num_expert_group=4, topk_group=2,
             correction_bias="e_score_correction_bias", scale=2.5, renormalize=True,
             float32_logits=True),
    ),
    "glm4-moe-sigmoid-corrected-one-group": (
        lambda: Glm4MoeTopkRouter(
            config("glm4_moe", n_routed_experts=16, num_experts_per_tok=4, n_group=1,
                   topk_group=1, norm_topk_prob=False)
        ),
        dict(scoring="sigmoid", num_expert_group=None, renormalize=False,
             correction_bias="e_score_correction_bias"),
    ),
    # The block hands the correction bias in: the router's second input.
    "afmoe-sigmoid-corrected-handed-in-scaled": (
        lambda: AfmoeTokenChoiceRouter(
            config("afmoe", num_experts=16, num_experts_per_tok=4, route_scale=2.0)
        ),
        dict(scoring="sigmoid", correction_bias="expert_bias",
             correction_handed_in=True, renormalize=True, scale=2.0,
             float32_logits=False),
    ),
    "minimax-m2-sigmoid-corrected-handed-in": (
        lambda: MiniMaxM2TopKRouter(
            config("minimax_m2", num_local_experts=16, num_experts_per_tok=4)
        ),
        dict(scoring="sigmoid", correction_bias="e_score_correction_bias",
             correction_handed_in=True, renormalize=True, scale=1.0),
    ),
    "hy-v3-float32-corrected-handed-in-scaled": (
        lambda: HYV3TopKRouter(
            config("hy_v3", num_experts=16, num_experts_per_tok=4,
                   router_scaling_factor=1.5)
        ),
        dict(scoring="sigmoid", correction_handed_in=True, renormalize=True,
             scale=1.5, float32_logits=True),
    ),
    # The correction is added by a child module holding it as [1, experts]
    # (`moe_statics`); a softmax over dimension 1 (2-D inputs only), renormalised
    # with a clamp that never bites.
    "ernie-4.5-softmax-corrected-by-a-child": (
        lambda: Ernie4_5_MoeTopKRouter(
            config("ernie4_5_moe", num_experts=16, num_experts_per_tok=4)
        ),
        dict(scoring="softmax", correction_bias="moe_statics.e_score_correction_bias",
             correction_handed_in=False, renormalize=True, float32_logits=True),
    ),
}


def randomized(router: nn.Module, dtype: torch.dtype, seed: int = 0) -> nn.Module:
    """`router` in `dtype` with random weights a few units of logit apart, and a
    random correction bias (buffers included)."""
    router = router.to(dtype).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in [*router.named_parameters(), *router.named_buffers()]:
            if tensor.is_floating_point():
                std = 2.0 / HIDDEN**0.5 if tensor.ndim == 2 else 0.3
                tensor.copy_(torch.randn(tensor.shape, generator=generator) * std)
    return router


def assert_same_routing(expected, actual, roles) -> None:
    """Same logits; per token the same experts with the same weights, in any order
    (the experts sum over them). vLLM routes in float32 whatever the dtype."""
    ids, weights = roles.index("ids"), roles.index("weights")
    # The ids' type too: experts left to Transformers (Aria's) index with them in
    # `one_hot`, which takes int64 only, the type `torch.topk` gives.
    assert actual[ids].dtype == expected[ids].dtype == torch.int64
    expected_order = expected[ids].argsort(dim=-1)
    actual_order = actual[ids].argsort(dim=-1)
    torch.testing.assert_close(
        actual[ids].gather(-1, actual_order).long(),
        expected[ids].gather(-1, expected_order).long(),
    )
    torch.testing.assert_close(
        actual[weights].gather(-1, actual_order).double(),
        expected[weights].gather(-1, expected_order).double(),
        rtol=1e-5,
        atol=1e-6,
    )
    # The weights' dtype too: in bfloat16 the experts weigh with them rounded to
    # it (Qwen3, gpt-oss) or not (Mixtral, DeepSeek-V3), as Transformers' router.
    assert actual[weights].dtype == expected[weights].dtype
    # vLLM's linear on the CPU sums in another order than `F.linear`.
    logits = roles.index("logits")
    torch.testing.assert_close(
        actual[logits].double(), expected[logits].double(), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("name", ROUTERS)
def test_routing_is_read_from_the_dataflow(name):
    build, expected = ROUTERS[name]
    fuser = get_fuser(build(), RouterFuser)
    assert isinstance(fuser, RouterFuser)
    found = {field: getattr(fuser.routing, field) for field in expected}
    assert found == expected
    assert fuser.routing.outputs == ("logits", "weights", "ids")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", ROUTERS)
def test_vllm_router_chooses_what_transformers_chooses(name, dtype, fuse):
    build, _ = ROUTERS[name]
    router = randomized(build(), dtype)
    reference = copy.deepcopy(router)
    fused, applied = fuse(router, dtype)
    assert [type(f) for f in applied] == [RouterFuser]
    assert isinstance(getattr(fused, ROUTER_ATTR), VllmRouter)
    assert not [n for n, _ in fused.named_parameters() if ROUTER_ATTR not in n]
    generator = torch.Generator().manual_seed(1)
    routing = applied[0].routing
    # A correction handed in by the block, by position and by name.
    experts = getattr(fused, ROUTER_ATTR).num_experts
    bias = 0.3 * torch.randn(experts, generator=generator, dtype=dtype)
    cases = [(1, False), (7, True), (256, False)]
    for (tokens, by_name), rank in itertools.product(cases, applied[0].ranks):
        shape = (1, tokens, HIDDEN)[-rank:]
        x = torch.randn(shape, generator=generator, dtype=dtype)
        args, kwargs = (x,), {}
        if routing.correction_handed_in and by_name:
            kwargs = {routing.correction_bias: bias}
        elif routing.correction_handed_in:
            args = (x, bias)
        with torch.no_grad():
            expected, actual = reference(*args, **kwargs), fused(*args, **kwargs)
        assert_same_routing(expected, actual, routing.outputs)


def test_router_is_fused_for_the_input_ranks_it_was_proven_on(fuse):
    """gpt-oss's router takes its softmax over dimension 1: right on `[tokens,
    width]`, not on `[batch, tokens, width]` (its block flattens first), and
    AFMoE's unpacks three dimensions. Each is proven, and served, on those."""
    gpt_oss = get_fuser(
        GptOssTopKRouter(config("gpt_oss", num_local_experts=8)), RouterFuser
    )
    assert gpt_oss.ranks == (2,)
    detail = gpt_oss.report_detail(
        "mlp.router", GptOssTopKRouter(config("gpt_oss", num_local_experts=8))
    )
    assert "(on 2-D inputs; on 3-D ones on a float64 probe it chooses other" in detail
    build, _ = ROUTERS["afmoe-sigmoid-corrected-handed-in-scaled"]
    assert get_fuser(build(), RouterFuser).ranks == (3,)
    assert get_fuser(qwen3(True), RouterFuser).ranks == (2, 3)
    router = GptOssTopKRouter(config("gpt_oss", num_local_experts=8))
    fused, _ = fuse(randomized(router, torch.float32))
    with pytest.raises(ValueError, match="2 dimensions, and got 3"):
        fused(torch.randn(1, 4, HIDDEN))
    with pytest.raises(TypeError, match="takes the hidden states, and got 1 more"):
        fused(torch.randn(4, HIDDEN), torch.zeros(8))


def test_routing_features_each_change_the_choice():
    """The probe can tell the variants apart: the DeepSeek router without its
    groups, correction bias or scaling is declined as a different routing."""
    router = randomized(deepseek_v3(), torch.float64)
    fuser = get_fuser(router, RouterFuser)
    for change in (
        dict(num_expert_group=None, topk_group=None),
        dict(correction_bias=None),
        dict(scale=1.0),
        dict(renormalize=False),
    ):
        other = dataclasses.replace(
            fuser, routing=dataclasses.replace(fuser.routing, **change)
        )
        assert "chooses other experts or weights" in other.unproven(router), change


def test_instance_routing_differently_from_the_analysed_one_is_not_fused(
    vllm_config,
):
    fuser = get_fuser(qwen3(True), RouterFuser)
    assert fuser.validate(qwen3(True), vllm_config)
    reason = fuser.mismatch(qwen3(False), vllm_config)
    assert "chooses other experts or weights" in reason
    assert "renormalised" in reason


def test_router_on_meta_is_analysed_on_the_cpu():
    """As the report builds models: on `meta`, under `meta` as default device."""
    with torch.device("meta"):
        router = deepseek_v3()
        assert isinstance(get_fuser(router, RouterFuser), RouterFuser)


def test_checkpoint_names_go_to_the_vllm_router():
    fuser = get_fuser(HunYuanMoEV1Gate(config("hunyuan_v1_moe", num_experts=8)),
                      RouterFuser)
    assert fuser.renamed_weights("mlp.gate") == {
        "mlp.gate.wg.weight": "mlp.gate.vllm_router.gate.weight"
    }
    fuser = get_fuser(deepseek_v3(), RouterFuser)
    assert fuser.renamed_weights("mlp.gate") == {
        "mlp.gate.weight": "mlp.gate.vllm_router.gate.weight",
        "mlp.gate.e_score_correction_bias":
            "mlp.gate.vllm_router.e_score_correction_bias",
    }


# --- near misses ---------------------------------------------------------------


class Router(nn.Module):
    """A softmax top-k router; subclasses change one step."""

    def __init__(self, experts: int = 8, top_k: int = 2):
        super().__init__()
        self.top_k = top_k
        self.weight = nn.Parameter(torch.zeros(experts, HIDDEN))

    def scores(self, logits):
        return F.softmax(logits, dim=-1, dtype=torch.float)

    def forward(self, hidden_states):
        logits = F.linear(hidden_states, self.weight)
        weights, ids = torch.topk(self.scores(logits), self.top_k, dim=-1)
        return logits, self.after(weights, ids), ids

    def after(self, weights, ids):
        return weights / weights.sum(dim=-1, keepdim=True)


class BiasAfterTopK(Router):
    def __init__(self):
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(8))

    def after(self, weights, ids):
        return weights + self.bias[ids]


class RenormalisedByMax(Router):
    def after(self, weights, ids):
        return weights / weights.max(dim=-1, keepdim=True).values


class ScaledPerExpert(Router):
    def __init__(self):
        super().__init__()
        self.expert_scale = nn.Parameter(torch.ones(8))

    def after(self, weights, ids):
        return weights * self.expert_scale[ids]


class BiasInTheWeights(Router):
    """A bias added to the scores that also weighs, not only chooses."""

    def __init__(self):
        super().__init__()
        self.score_bias = nn.Parameter(torch.zeros(8))

    def scores(self, logits):
        return F.softmax(logits, dim=-1) + self.score_bias

    def after(self, weights, ids):
        return weights


class WeighsInFloat64(Router):
    """Hands its weights back in float64 whatever its input's dtype."""

    def after(self, weights, ids):
        return super().after(weights, ids).double()


class Tempered(Router):
    def scores(self, logits):
        return F.softmax(logits / 2, dim=-1)


class KeepsExpertZero(Router):
    """Always routes to expert 0 in the last slot, top-k or not."""

    def forward(self, hidden_states):
        logits = F.linear(hidden_states, self.weight)
        weights, ids = torch.topk(F.softmax(logits, dim=-1), self.top_k, dim=-1)
        kept = torch.cat((ids[:, :-1], torch.zeros_like(ids[:, -1:])), dim=-1)
        return logits, weights, kept


class TemperatureHandedIn(Router):
    """The caller hands in a temperature, which no vLLM router takes."""

    def forward(self, hidden_states, temperature):
        logits = F.linear(hidden_states, self.weight)
        weights, ids = torch.topk(F.softmax(logits / temperature, dim=-1), 2, dim=-1)
        return logits, weights, ids


class HandedInBiasWeighs(Router):
    """A bias handed in that also weighs the chosen experts, not only chooses."""

    def forward(self, hidden_states, bias):
        logits = F.linear(hidden_states, self.weight)
        scores = logits.sigmoid() + bias
        weights, ids = torch.topk(scores, self.top_k, dim=-1)
        return logits, weights, ids


class TwoProjections(Router):
    def __init__(self):
        super().__init__()
        self.other = nn.Parameter(torch.zeros(8, HIDDEN))

    def forward(self, hidden_states):
        logits = F.linear(hidden_states, self.weight) + F.linear(
            hidden_states, self.other
        )
        weights, ids = torch.topk(F.softmax(logits, dim=-1), self.top_k, dim=-1)
        return logits, weights, ids


class Statics(nn.Module):
    """Holds a correction as Ernie 4.5's `moe_statics` does, `[1, experts]`."""

    def __init__(self, rows: int = 1):
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(rows, 8))

    def forward(self, scores):
        return scores + self.bias.squeeze()


class ScalingStatics(Statics):
    def forward(self, scores):
        return 2 * scores + self.bias.squeeze()


class CorrectedByAChild(Router):
    """Chooses by `statics(scores)`, weighs by the scores (Ernie 4.5's routing)."""

    def __init__(self, statics: nn.Module):
        super().__init__()
        self.statics = statics

    def forward(self, hidden_states):
        logits = F.linear(hidden_states, self.weight)
        scores = F.softmax(logits, dim=-1)
        _, ids = torch.topk(self.statics(scores), self.top_k, dim=-1)
        return logits, self.after(scores.gather(-1, ids), ids), ids


@pytest.mark.parametrize(
    ("router", "reason"),
    [
        (BiasAfterTopK(), "chooses other experts or weights"),
        (RenormalisedByMax(), "chooses other experts or weights"),
        (ScaledPerExpert(), "chooses other experts or weights"),
        (BiasInTheWeights(), "chooses other experts or weights"),
        (Tempered(), "chooses other experts or weights"),
        (WeighsInFloat64(), "returns its weights in torch.float64, vLLM's router in"),
        (KeepsExpertZero(), "changes its top-k expert ids before"),
        (TwoProjections(), "from 2 projections, not one"),
        (TemperatureHandedIn(), "reads inputs other than the hidden states"),
        (HandedInBiasWeighs(), "chooses other experts or weights"),
        # A child that does more than add its tensor is no correction.
        (CorrectedByAChild(ScalingStatics()), "chooses other experts or weights"),
        (CorrectedByAChild(Statics(rows=2)), "is not one value per expert (8)"),
    ],
    ids=lambda v: (
        "-".join(type(m).__name__ for m in v.modules())
        if isinstance(v, nn.Module)
        else ""
    ),
)
def test_near_miss_router_is_declined_with_the_reason(router, reason, declined):
    assert get_fuser(router, RouterFuser) is None
    (found,) = declined(RouterFuser)
    assert reason in found


def test_module_returning_no_top_k_ids_is_not_a_router(declined):
    class Logits(Router):
        def forward(self, hidden_states):
            return F.linear(hidden_states, self.weight), hidden_states

    assert get_fuser(Logits(), RouterFuser) is None
    assert declined(RouterFuser) == []


def test_correction_added_by_a_child_is_read_through_it(fuse):
    """The near misses' child that only adds its `[1, experts]` tensor is a
    correction: fused, the tensor loaded into vLLM's router as one per expert."""
    router = randomized(CorrectedByAChild(Statics()), torch.float64)
    fuser = get_fuser(router, RouterFuser)
    assert fuser.routing.correction_bias == "statics.bias"
    assert fuser.renamed_weights("gate") == {
        "gate.weight": "gate.vllm_router.gate.weight",
        "gate.statics.bias": "gate.vllm_router.e_score_correction_bias",
    }
    reference = copy.deepcopy(router)
    fused, _ = fuse(router, torch.float64)
    x = torch.randn(32, HIDDEN, generator=torch.Generator().manual_seed(2),
                    dtype=torch.float64)
    with torch.no_grad():
        assert_same_routing(reference(x), fused(x), fuser.routing.outputs)


def test_the_plain_router_is_fused():
    """The near misses' base router itself is fused: each declines for its one
    change."""
    fuser = get_fuser(Router(), RouterFuser)
    assert isinstance(fuser, RouterFuser) and fuser.routing.renormalize


def test_experts_left_to_transformers_run_on_the_fused_routers_choice(fuse):
    # Aria's experts stay Transformers' (its config names top-k `moe_topk`, so the
    # experts fuser declines them) while its router is fused: they index with the
    # router's ids in `one_hot`, which refused the int32 ids vLLM's router gives
    # (the engine died on the first step).
    from transformers.models.aria.modeling_aria import AriaTextMoELayer

    block = AriaTextMoELayer(
        config("aria_text", moe_num_experts=8, moe_topk=2, intermediate_size=32,
               moe_num_shared_experts=1)
    ).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, tensor in block.named_parameters():
            tensor.copy_(torch.randn(tensor.shape, generator=generator) * 0.2)
    reference = copy.deepcopy(block)
    block.router, applied = fuse(block.router)
    assert [type(f) for f in applied] == [RouterFuser]
    x = torch.randn(1, 5, HIDDEN, generator=generator)
    with torch.no_grad():
        torch.testing.assert_close(block(x), reference(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ROUTERS)
def test_router_weighs_as_transformers_in_bfloat16(name, fuse):
    """In bfloat16 Transformers' routers score in float32 and hand their top-k
    weights back rounded to the input's dtype (Qwen3, gpt-oss, HunYuan, Ernie 4.5)
    or in float32 (Mixtral, DeepSeek-V3): the experts weigh with exactly those
    numbers, so vLLM's router returns the same ones, in the same dtype."""
    build, _ = ROUTERS[name]
    router = randomized(build(), torch.bfloat16)
    reference = copy.deepcopy(router)
    fused, applied = fuse(router, torch.bfloat16)
    routing, tokens = applied[0].routing, 64
    generator = torch.Generator().manual_seed(1)
    shape = (1, tokens, HIDDEN)[-applied[0].ranks[0]:]
    x = torch.randn(shape, generator=generator, dtype=torch.bfloat16)
    bias = 0.3 * torch.randn(getattr(fused, ROUTER_ATTR).num_experts,
                             generator=generator, dtype=torch.bfloat16)
    args = (x, bias) if routing.correction_handed_in else (x,)
    with torch.no_grad():
        expected, actual = reference(*args), fused(*args)
    ids, weights = routing.outputs.index("ids"), routing.outputs.index("weights")
    assert actual[weights].dtype == expected[weights].dtype
    expected_ids, actual_ids = (out[ids].reshape(tokens, -1) for out in (expected, actual))
    expected_order, actual_order = expected_ids.argsort(-1), actual_ids.argsort(-1)
    same = (
        expected_ids.gather(-1, expected_order) == actual_ids.gather(-1, actual_order)
    ).all(-1)
    # vLLM's linear may round a bfloat16 logit the other way, and so break a
    # near tie otherwise: the weights are compared where both chose alike.
    assert same.sum() >= 0.9 * tokens
    expected_weights, actual_weights = (
        out[weights].reshape(tokens, -1).gather(-1, order)[same]
        for out, order in ((expected, expected_order), (actual, actual_order))
    )
    # At most a float32 rounding apart before the weights are rounded to bfloat16
    # (at most a unit of its last place, 2**-8 relative) or kept in float32.
    rtol = 2**-8 if expected_weights.dtype == torch.bfloat16 else 1e-6
    torch.testing.assert_close(actual_weights, expected_weights, rtol=rtol, atol=0)
