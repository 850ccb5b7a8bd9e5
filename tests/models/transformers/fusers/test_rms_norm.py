# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""RMSNormFuser: any module computing an RMSNorm -> vLLM's RMSNorm / GemmaRMSNorm."""

import pytest
import torch
import torch.nn.functional as F
from configs import small_config
from torch import nn
from transformers import AutoModel, CpmAntConfig
from transformers.models.cpmant.modeling_cpmant import CpmAntLayerNorm
from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
    DeepseekV4UnweightedRMSNorm,
)
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
from transformers.models.gemma3n.modeling_gemma3n import Gemma3nRMSNorm
from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.nanochat.modeling_nanochat import NanoChatRMSNorm
from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

from vllm.model_executor.layers.layernorm import GemmaRMSNorm, RMSNorm
from vllm.model_executor.models.transformers.plan import FusionPlan, get_fuser
from vllm.model_executor.models.transformers.fusers import RMSNormFuser

HIDDEN = 16


class Scale(nn.Module):
    """An RMSNorm by another name, eps written into forward, weight applied last."""

    def __init__(self, hidden_size: int = HIDDEN):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * (x.pow(2).mean(dim=-1, keepdim=True) + 1e-5).rsqrt()
        return x.to(dtype) * self.weight


class Functional(nn.Module):
    def __init__(self, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(HIDDEN))
        self.eps = eps

    def forward(self, x):
        return F.rms_norm(x, (HIDDEN,), self.weight, self.eps)


class StopsBeforeNorm(Scale):
    def forward(self, x):
        if x.isnan().any():
            raise ValueError("NaN")
        return super().forward(x)


class StopsBeforeOutput(Scale):
    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
        if x.isnan().any():
            raise ValueError("NaN")
        return x.to(dtype) * self.weight


class Weightless(nn.Module):
    def forward(self, x):
        y = x.float()
        return (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)


class WeightlessOverTokens(nn.Module):
    def forward(self, x):
        y = x.float()
        return (y * torch.rsqrt(y.pow(2).mean(1, keepdim=True) + 1e-6)).to(x.dtype)


class WeightlessNoUpcast(nn.Module):
    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class WeightlessReturnsFloat32(nn.Module):
    def forward(self, x):
        y = x.float()
        return y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6)


class RootRoundedToInputDtype(nn.Module):
    """Normalised in float32, but with the inverse root rounded to the input dtype."""

    def forward(self, x):
        y = x.float()
        root = torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype)
        return (y * root.float()).to(x.dtype)


class EpsOfTheDtype(nn.Module):
    """eps from the input's dtype: the trace sees bfloat16's, a float32 run another."""

    def forward(self, x):
        y = x.float()
        eps = torch.finfo(x.dtype).eps
        return (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class EpsOfTheConfig(nn.Module):
    """eps read through another object, which may differ per instance unseen."""

    def __init__(self, eps: float = 1e-6):
        super().__init__()
        self.config = type("Config", (), {"rms_norm_eps": eps})()

    def forward(self, x):
        y = x.float()
        eps = self.config.rms_norm_eps
        return (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class UnusedWeight(Scale):
    def forward(self, x):
        y = x.float()
        return (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)


class MeanOverTokens(Scale):
    def forward(self, x):
        y = x.float()
        return (y * torch.rsqrt(y.pow(2).mean(1, keepdim=True) + 1e-6)).to(
            x.dtype
        ) * self.weight


class NoUpcast(Scale):
    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


class OffsetInInputDtype(Scale):
    """Gemma's `1 + w`, but added in the input dtype: rounds where vLLM does not."""

    def forward(self, x):
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6)
        return y.type_as(x) * (1.0 + self.weight)


class RoundedBeforeFloatWeight(Scale):
    def forward(self, x):
        y = x.float()
        y = (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)
        return (y * self.weight.float()).to(x.dtype)


class NamedScale(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(HIDDEN))

    def forward(self, x):
        y = x.float()
        return (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6)).to(
            x.dtype
        ) * self.scale


class ReturnsFloat32(Scale):
    def forward(self, x):
        y = x.float()
        return self.weight * (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6))


class DefaultEps(Functional):
    def forward(self, x):
        return torch.rms_norm(x, (HIDDEN,), self.weight)


def tokens(dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(2, 5, HIDDEN, generator=torch.Generator().manual_seed(1)).to(
        dtype
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize(
    ("module", "vllm_class", "weight_dtype"),
    [
        (LlamaRMSNorm(HIDDEN, eps=1e-5), RMSNorm, None),
        (Olmo2RMSNorm(HIDDEN, eps=1e-5), RMSNorm, torch.float32),
        (Gemma3RMSNorm(HIDDEN, eps=1e-5), GemmaRMSNorm, None),
        (Scale(), RMSNorm, None),
        (Functional(), RMSNorm, None),
    ],
    ids=[
        "llama",
        "olmo2-weight-in-float32",
        "gemma3-one-plus-weight",
        "renamed-literal-eps",
        "F.rms_norm",
    ],
)
def test_rms_norms_become_vllm_norms_computing_the_same(
    module, vllm_class, weight_dtype, dtype, equivalent
):
    if dtype != torch.float32 and isinstance(module, Functional):
        pytest.skip("torch.rms_norm computes in the input dtype, vLLM in float32")
    fused, (fuser,) = equivalent(module, tokens(dtype), dtype=dtype)
    assert type(fused) is vllm_class
    weight_dtype = torch.promote_types(dtype, weight_dtype) if weight_dtype else dtype
    assert fused.weight.dtype == weight_dtype
    assert fused.variance_epsilon == pytest.approx(
        1e-5 if not isinstance(module, Functional) else 1e-6
    )
    assert fuser.info("model.norm", fused).startswith(
        f"Fused: model.norm -> {vllm_class.__name__}"
    )


def test_each_instance_keeps_its_own_eps(fuse):
    fuser = get_fuser(LlamaRMSNorm(HIDDEN, eps=1e-5), RMSNormFuser)
    assert fuser.eps_attribute == "variance_epsilon"
    assert fuse(LlamaRMSNorm(HIDDEN, eps=3e-4))[0].variance_epsilon == pytest.approx(
        3e-4
    )


def test_nothing_is_matched_when_tracing_stops_before_the_norm(declined):
    assert get_fuser(StopsBeforeNorm(), RMSNormFuser) is None
    assert declined(RMSNormFuser) == []


@pytest.mark.parametrize(
    ("module", "reason"),
    [
        (StopsBeforeOutput(), "tracing stopped before the output"),
        (MeanOverTokens(), "the mean is over dim=1"),
        (NoUpcast(), "it normalises in the input dtype"),
        (OffsetInInputDtype(), "(1 + weight) is not applied in float32"),
        (RoundedBeforeFloatWeight(), "applied in torch.float32 to a value rounded to"),
        (NamedScale(), "its scale is named 'scale'"),
        (ReturnsFloat32(), "it returns torch.float32"),
        (DefaultEps(), "rms_norm takes its dtype's eps"),
    ],
    ids=[
        "trace-stops-before-output",
        "mean-over-tokens",
        "no-upcast",
        "offset-in-input-dtype",
        "rounded-before-float32-weight",
        "scale-named-otherwise",
        "returns-float32",
        "default-eps",
    ],
)
def test_variants_vllm_computes_differently_are_declined(module, reason, declined):
    assert get_fuser(module, RMSNormFuser) is None
    assert any(reason in r for r in declined(RMSNormFuser)), declined(RMSNormFuser)


WEIGHTLESS = {
    "gemma3n-with-scale-false": lambda: Gemma3nRMSNorm(HIDDEN, 3e-5, with_scale=False),
    "gemma4-with-scale-false": lambda: Gemma4RMSNorm(HIDDEN, 3e-5, with_scale=False),
    "nanochat": lambda: NanoChatRMSNorm(eps=3e-5),
    "literal-eps": Weightless,
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("build", list(WEIGHTLESS.values()), ids=list(WEIGHTLESS))
def test_weightless_norms_become_vllm_norms_without_weight(build, dtype, equivalent):
    fused, (fuser,) = equivalent(build(), tokens(dtype), dtype=dtype)
    assert type(fused) is RMSNorm and not fused.has_weight
    assert list(fused.parameters()) == []
    eps = 1e-6 if build is Weightless else 3e-5
    assert fused.variance_epsilon == pytest.approx(eps)
    assert fuser.info("norm", fused) == f"Fused: norm -> RMSNorm (eps={eps}, no weight)"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("norm_class", [Gemma3nRMSNorm, Gemma4RMSNorm])
def test_gemma3n_norms_with_scale_take_their_weight_in_float32(
    norm_class, dtype, equivalent
):
    fused, (fuser,) = equivalent(norm_class(HIDDEN, 3e-5), tokens(dtype), dtype=dtype)
    assert type(fused) is RMSNorm and fuser.weight_cast_to_float32
    assert fused.weight.dtype == torch.float32  # `weight.float()`, even in float64


def test_weightless_torch_rms_norm_is_vllms_weightless_norm(equivalent):
    fused, (fuser,) = equivalent(
        nn.RMSNorm(HIDDEN, eps=3e-5, elementwise_affine=False), tokens(torch.float32)
    )
    assert type(fused) is RMSNorm and not fused.has_weight
    assert fuser.eps_attribute == "eps"


class Gemma3nNorms(nn.Module):
    """Norms of one class as a Gemma 3n layer mixes them: with and without a scale,
    of different widths and eps."""

    def __init__(self):
        super().__init__()
        self.q_norm = Gemma3nRMSNorm(8, eps=1e-6)
        self.v_norm = Gemma3nRMSNorm(8, eps=2e-6, with_scale=False)
        self.norm = Gemma3nRMSNorm(HIDDEN, eps=3e-6)
        self.router_norm = Gemma3nRMSNorm(HIDDEN, eps=4e-6, with_scale=False)


def test_each_instance_is_fused_as_what_it_computes(vllm_config):
    model = Gemma3nNorms()
    plan = FusionPlan(model, vllm_config)
    assert plan.declined == []
    fused = {}
    for name, norm in model.named_children():
        (fuser,) = plan[norm]
        fused[name] = fuser.fuse(norm, name, vllm_config)
    assert {n: (m.has_weight, m.variance_epsilon) for n, m in fused.items()} == {
        "q_norm": (True, 1e-6),
        "v_norm": (False, 2e-6),
        "norm": (True, 3e-6),
        "router_norm": (False, 4e-6),
    }
    assert [fused[n].weight.shape[0] for n in ("q_norm", "norm")] == [8, HIDDEN]


def test_a_weightless_verdict_is_not_taken_by_an_instance_with_a_weight(vllm_config):
    fuser = get_fuser(Gemma3nRMSNorm(HIDDEN, with_scale=False), RMSNormFuser)
    assert not fuser.has_weight
    reason = fuser.mismatch(Gemma3nRMSNorm(HIDDEN), vllm_config)
    assert reason == "this instance has parameters; the traced one applied no weight"


@pytest.mark.parametrize(
    ("module", "reason"),
    [
        (WeightlessOverTokens(), "the mean is over dim=1"),
        (WeightlessNoUpcast(), "it normalises in the input dtype"),
        (WeightlessReturnsFloat32(), "it returns torch.float32"),
        (DeepseekV4UnweightedRMSNorm(), "it normalises in the input dtype"),
        (
            CpmAntLayerNorm(CpmAntConfig(hidden_size=HIDDEN)),
            "it scales its input uncast, in the input dtype, by a float32 root",
        ),
        (RootRoundedToInputDtype(), "rounds an intermediate value (to) to"),
        (EpsOfTheDtype(), "eps=0.0078125 is neither an attribute of it nor written"),
        (EpsOfTheConfig(), "eps=1e-06 is neither an attribute of it nor written"),
        (UnusedWeight(), "it has a parameter that it never applies"),
    ],
    ids=[
        "mean-over-tokens",
        "no-upcast",
        "returns-float32",
        "deepseek-v4-root-in-input-dtype",
        "cpmant-input-promoted-at-the-multiply",
        "root-rounded",
        "eps-of-the-dtype",
        "eps-of-a-config",
        "unused-weight",
    ],
)
def test_near_misses_in_the_normalisation_are_declined(module, reason, declined):
    assert get_fuser(module, RMSNormFuser) is None
    assert any(reason in r for r in declined(RMSNormFuser)), declined(RMSNormFuser)


@pytest.mark.parametrize(
    ("model_type", "norm_class", "kinds"),
    [
        ("gemma3n_text", Gemma3nRMSNorm, {True, False}),  # v_norm has no scale
        ("nanochat", NanoChatRMSNorm, {False}),
    ],
)
def test_every_norm_of_a_real_model_is_fused(
    model_type, norm_class, kinds, vllm_config
):
    config = small_config(model_type, head_dim=32, num_kv_shared_layers=0)
    config._attn_implementation = "vllm"
    with torch.device("meta"):
        model = AutoModel.from_config(config)
    plan = FusionPlan(model, vllm_config)
    norms = [m for m in model.modules() if type(m) is norm_class]
    assert norms and all(
        [type(f) for f in plan[m]] == [RMSNormFuser] for m in norms
    ), plan.declined
    assert all(plan[m][0].has_weight == bool(list(m.parameters())) for m in norms)
    assert {plan[m][0].has_weight for m in norms} == kinds


class UnitOffsetNorm(nn.Module):
    """One class, two kernels: instances with `unit_offset` scale by `1 + weight`."""

    def __init__(self, unit_offset: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(HIDDEN))
        self.unit_offset = unit_offset
        self.variance_epsilon = 1e-6

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        scale = 1.0 + self.weight.float() if self.unit_offset else self.weight.float()
        return (x * scale).to(dtype)


@pytest.mark.parametrize("first", [False, True])
def test_instances_that_differ_by_a_flag_each_get_their_own_kernel(first, equivalent):
    # The trace follows the flag of the instance it runs on; the other instances
    # must not inherit that branch's verdict.
    x = torch.randn(2, 3, HIDDEN)
    kernels = {}
    for unit_offset in (first, not first):
        fused, _ = equivalent(UnitOffsetNorm(unit_offset), x)
        kernels[unit_offset] = type(fused)
    assert kernels == {True: GemmaRMSNorm, False: RMSNorm}
