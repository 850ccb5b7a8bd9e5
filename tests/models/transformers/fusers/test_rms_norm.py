# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""RMSNormFuser: any module computing an RMSNorm -> vLLM's RMSNorm / GemmaRMSNorm."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

from vllm.model_executor.layers.layernorm import GemmaRMSNorm, RMSNorm
from vllm.model_executor.models.transformers.fuser import get_fuser
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
        (Weightless(), "it has no weight"),
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
        "weightless",
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
