# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""GLUFuser: act(gate(x)) * up(x) -> MergedColumnParallelLinear + fused act-and-mul."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig
from transformers.activations import ACT2FN
from transformers.models.bitnet.modeling_bitnet import BitNetMLP
from transformers.models.gemma3.modeling_gemma3 import Gemma3MLP
from transformers.models.llama.modeling_llama import LlamaMLP

from vllm.model_executor.layers.activation import GeluAndMul, SiluAndMul
from vllm.model_executor.layers.linear import (
    MergedColumnParallelLinear,
    RowParallelLinear,
)
from vllm.model_executor.models.transformers.plan import get_fuser
from vllm.model_executor.models.transformers.fusers import GLUFuser

HIDDEN, INTERMEDIATE = 16, 24


class MLP(nn.Module):
    """The usual gated MLP, with its activation as a function call."""

    def __init__(self, up_width: int = INTERMEDIATE):
        super().__init__()
        self.gate_proj = nn.Linear(HIDDEN, INTERMEDIATE, bias=False)
        self.up_proj = nn.Linear(HIDDEN, up_width, bias=False)
        self.down_proj = nn.Linear(INTERMEDIATE, HIDDEN, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class ActivationLookedUpInForward(MLP):
    def forward(self, x):
        return self.down_proj(ACT2FN["silu"](self.gate_proj(x)) * self.up_proj(x))


class TanhGelu(MLP):
    def forward(self, x):
        return self.down_proj(
            nn.functional.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x)
        )


class Bound(nn.Module):
    """Mixtral-style names, each step bound to a local, up times activation."""

    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(HIDDEN, INTERMEDIATE, bias=True)
        self.w3 = nn.Linear(HIDDEN, INTERMEDIATE, bias=True)
        self.w2 = nn.Linear(INTERMEDIATE, HIDDEN, bias=True)
        self.act = nn.SiLU()

    def forward(self, hidden_states):
        gate = self.w1(hidden_states)
        up = self.w3(hidden_states)
        hidden_states = up * self.act(gate)
        return self.w2(hidden_states)


class StopsAfterDown(MLP):
    def forward(self, x):
        out = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        if out.isnan().any():
            raise ValueError("NaN")
        return out


class StopsBeforeGate(MLP):
    def forward(self, x):
        if x.abs().max() > 1e4:
            x = x.clamp(-1e4, 1e4)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Relu(MLP):
    def forward(self, x):
        return self.down_proj(F.relu(self.gate_proj(x)) * self.up_proj(x))


class FormulaGelu(MLP):
    def __init__(self):
        super().__init__()
        self.act_fn = ACT2FN[
            "gelu_new"
        ]  # tanh GELU written out: no fused kernel computes it

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class GateAlsoReturned(MLP):
    def forward(self, x):
        gate = self.gate_proj(x)
        return self.down_proj(F.silu(gate) * self.up_proj(x)), gate


class NoDown(MLP):
    def forward(self, x):
        return F.silu(self.gate_proj(x)) * self.up_proj(x)


class BindingReadAgain(MLP):
    def forward(self, x):
        gate = self.gate_proj(x)
        kept = gate  # noqa: F841 - dead: only the source shows this second read
        return self.down_proj(F.silu(gate) * self.up_proj(x))


def tokens(dtype=torch.float32) -> torch.Tensor:
    return torch.randn(
        2, 5, HIDDEN, dtype=dtype, generator=torch.Generator().manual_seed(1)
    )


def llama_config(**overrides):
    return AutoConfig.for_model(
        "llama",
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_attention_heads=2,
        **overrides,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_llama_mlp_becomes_merged_column_and_silu_and_mul(equivalent, dtype):
    fused, (fuser,) = equivalent(
        LlamaMLP(llama_config(mlp_bias=True)), tokens(dtype), dtype=dtype
    )
    assert isinstance(fused.gate_up_proj, MergedColumnParallelLinear)
    assert isinstance(fused.act_fn, SiluAndMul)  # the HF activation module, replaced
    assert isinstance(fused.down_proj, RowParallelLinear)
    assert fuser.stacked_weights("mlp") == {
        "mlp.gate_proj.": ("mlp.gate_up_proj.", 0),
        "mlp.up_proj.": ("mlp.gate_up_proj.", 1),
    }
    assert fuser.packed_modules_mapping == {"gate_up_proj": ["gate_proj", "up_proj"]}


def test_gemma3_tanh_gelu_module_becomes_gelu_and_mul(equivalent):
    config = AutoConfig.for_model(
        "gemma3_text",
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        hidden_activation="gelu_pytorch_tanh",
    )
    fused, _ = equivalent(Gemma3MLP(config), tokens())
    assert isinstance(fused.act_fn, GeluAndMul) and fused.act_fn.approximate == "tanh"


@pytest.mark.parametrize(
    ("module", "activation"),
    [
        (MLP(), "silu"),
        (ActivationLookedUpInForward(), "silu"),
        (TanhGelu(), "gelu_pytorch_tanh"),
        (StopsAfterDown(), "silu"),
    ],
    ids=[
        "F.silu",
        "ACT2FN-in-forward",
        "gelu-approximate-tanh",
        "trace-stops-after-down",
    ],
)
def test_activation_called_as_a_function_is_matched(module, activation, equivalent):
    fused, (fuser,) = equivalent(module, tokens())
    assert fuser.activation == activation
    assert fuser.activation_name == "act_and_mul"
    assert isinstance(fused.gate_up_proj, MergedColumnParallelLinear)


def test_steps_bound_to_locals_are_folded_into_the_fused_call(equivalent):
    fused, (fuser,) = equivalent(Bound(), tokens())
    assert fuser.shards == {"w1": 0, "w3": 1}
    assert fuser.fused_name == "w13"
    assert isinstance(fused.act, SiluAndMul)


def test_nothing_is_matched_when_tracing_stops_before_the_gate(declined):
    assert get_fuser(StopsBeforeGate(), GLUFuser) is None
    assert declined(GLUFuser) == []


@pytest.mark.parametrize(
    ("module", "reason"),
    [
        (Relu(), "no fused act-and-mul for the activation relu"),
        (FormulaGelu(), "no fused act-and-mul for the activation act_fn"),
        (MLP(up_width=INTERMEDIATE + 8), "differ in width"),
        (GateAlsoReturned(), "used elsewhere"),
        (NoDown(), "no single direct child projects the gated product"),
        (BindingReadAgain(), "`gate` is read outside the gated product"),
    ],
    ids=[
        "relu",
        "gelu-formula",
        "widths-differ",
        "gate-returned",
        "no-down",
        "binding-read-again",
    ],
)
def test_near_misses_are_declined_with_a_reason(module, reason, declined):
    assert get_fuser(module, GLUFuser) is None
    assert any(reason in r for r in declined(GLUFuser)), declined(GLUFuser)


def test_an_activation_module_is_traced_once_per_state(monkeypatch):
    """Each instance's activation is checked, but a model holds one per layer: one
    trace per class and attributes, so checking grows with classes, not depth."""
    from vllm.model_executor.models.transformers import plan as registry
    from vllm.model_executor.models.transformers.fusers import glu

    traced = []
    trace = glu.tracing.trace
    monkeypatch.setattr(glu.tracing, "trace", lambda m: traced.append(m) or trace(m))
    registry.clear_cache()
    activations = [ACT2FN["silu"] for _ in range(4)] + [ACT2FN["gelu"] for _ in range(4)]
    assert [glu._activation_of_module(a) for a in activations] == ["silu"] * 4 + [
        "gelu"
    ] * 4
    assert len(traced) == 2
    # Other attributes are another state: Transformers' Python GELU is not vLLM's.
    assert glu._activation_of_module(ACT2FN["gelu_python"]) is None
    clipped = ACT2FN["gelu_10"]
    assert glu._activation_of_module(clipped) is None
    assert len(traced) == 4


def test_a_norm_over_the_whole_product_keeps_the_fusion_off_under_tp(
    vllm_config, monkeypatch
):
    # BitNet normalises the gated product over its whole width before `down_proj`:
    # at TP=2 each rank would normalise its half of it on its own.
    config = AutoConfig.for_model(
        "bitnet", hidden_size=32, intermediate_size=64, hidden_act="silu"
    )
    mlp = BitNetMLP(config)
    fuser = get_fuser(mlp, GLUFuser)
    assert fuser.validate(mlp, vllm_config)
    monkeypatch.setattr(vllm_config.parallel_config, "tensor_parallel_size", 2)
    assert fuser.mismatch(mlp, vllm_config) == (
        "ffn_sub_norm act on the whole intermediate width between the gated product "
        "and down_proj, of which each tensor-parallel rank holds only its share"
    )
