# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Near misses: small modules that look like a fuser's pattern but compute something
else, or the same thing written another way.

Each `NearMiss` says what must become of it: declined by its fuser with a reason (a
part of it given), refused when vLLM's attention is built for it (an argument it
cannot honour), or fused and computing the same (`declined` and `refused` None); and
those fused at one tensor-parallel rank that each instance must decline at two
(`declined_at_tp`), because a rank would compute with a share of what it names."""

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig
from transformers.activations import ACT2FN
from transformers.masking_utils import create_sliding_window_causal_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.phimoe.modeling_phimoe import PhimoeModel

HIDDEN, HEAD, HEADS, KV_HEADS = 32, 8, 4, 2
Q, KV = HEADS * HEAD, KV_HEADS * HEAD


def attend(q, k, v):
    """`[batch, tokens, heads * HEAD]` each -> causal SDPA -> the same layout."""
    q, k, v = (t.unflatten(-1, (-1, HEAD)).transpose(1, 2) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return out.transpose(1, 2).flatten(2)


# --- separate q/k/v projections ---------------------------------------------------


class Attention(nn.Module):
    def __init__(self, bias: bool = False, q_width: int = Q):
        super().__init__()
        self.head_dim = HEAD
        self.q_proj = nn.Linear(HIDDEN, q_width, bias=bias)
        self.k_proj = nn.Linear(HIDDEN, KV, bias=bias)
        self.v_proj = nn.Linear(HIDDEN, KV, bias=bias)
        self.o_proj = nn.Linear(Q, HIDDEN, bias=bias)

    def forward(self, x):
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        return self.o_proj(attend(q, k, v))


class GatedQuery(Attention):
    """The query projection also yields an output gate (Qwen3-Next)."""

    def __init__(self):
        super().__init__(q_width=2 * Q)

    def forward(self, x):
        q, gate = self.q_proj(x).chunk(2, dim=-1)
        out = attend(q, self.k_proj(x), self.v_proj(x))
        return self.o_proj(out * torch.sigmoid(gate))


class KeyValueOfAnotherInput(Attention):
    def forward(self, x, context):
        k, v = self.k_proj(context), self.v_proj(context)
        return self.o_proj(attend(self.q_proj(x), k, v))


class InputRebound(Attention):
    """The key and value read the input scaled after the query read it."""

    def forward(self, x):
        q = self.q_proj(x)
        x = x * 2
        return self.o_proj(attend(q, self.k_proj(x), self.v_proj(x)))


class InputWrittenInPlace(Attention):
    """The same, written in place: the trace sees one input for all three."""

    def forward(self, x):
        q = self.q_proj(x)
        k = self.k_proj(x)
        x.mul_(2)
        v = self.v_proj(x)
        return self.o_proj(attend(q, k, v))


class OneBias(Attention):
    def __init__(self):
        super().__init__()
        self.k_proj = nn.Linear(HIDDEN, KV, bias=True)


class ValueOfTheQuery(Attention):
    def __init__(self):
        super().__init__()
        self.k_proj = nn.Linear(HIDDEN, Q)

    def forward(self, x):
        q = self.q_proj(x)
        return self.o_proj(attend(q, self.k_proj(x), q))


class QueryProjectedTwice(Attention):
    """The query projection applied again to the attention output."""

    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(Q, Q)
        self.up = nn.Linear(HIDDEN, Q)

    def forward(self, x):
        x = self.up(x)
        narrow = x[..., :HIDDEN]
        out = attend(self.q_proj(x), self.k_proj(narrow), self.v_proj(narrow))
        return self.o_proj(self.q_proj(out))


class ClosureForward(Attention):
    """Traceable, but its forward cannot be recompiled outside its class."""

    def forward(self, x):
        return super().forward(x)


class ScaledKey(Attention):
    """Scaled between projection and attention: fused, the scale kept."""

    def forward(self, x):
        q, k, v = self.q_proj(x), self.k_proj(x) * 0.5, self.v_proj(x)
        return self.o_proj(attend(q, k, v))


class NamesSayOtherwise(Attention):
    """`v_proj` computes the key and `k_proj` the value: roles come from dataflow."""

    def forward(self, x):
        return self.o_proj(attend(self.q_proj(x), self.v_proj(x), self.k_proj(x)))


class NormedBeforeOutput(Attention):
    """The attention's output normalised over all heads before `o_proj` (BitNet's
    `attn_sub_norm`): a tensor-parallel rank holds only its heads' share."""

    def __init__(self):
        super().__init__()
        self.sub_norm = nn.RMSNorm(Q, eps=1e-6)

    def forward(self, x):
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        return self.o_proj(self.sub_norm(attend(q, k, v)))


class ViewedWithHeadCount(Attention):
    """q, k and v viewed with the module's own head count (StableLM, OPT): a rank's
    projections give a share of the heads that count names."""

    def __init__(self):
        super().__init__()
        self.num_heads, self.num_key_value_heads = HEADS, KV_HEADS

    def forward(self, x):
        batch, tokens, _ = x.shape
        q = self.q_proj(x).view(batch, tokens, self.num_heads, HEAD).transpose(1, 2)
        k = self.k_proj(x).view(batch, tokens, self.num_key_value_heads, HEAD)
        v = self.v_proj(x).view(batch, tokens, self.num_key_value_heads, HEAD)
        out = F.scaled_dot_product_attention(
            q, k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
        )
        return self.o_proj(out.transpose(1, 2).flatten(2))


# --- packed q/k/v ------------------------------------------------------------------


class Packed(nn.Module):
    def __init__(self, width: int = Q + 2 * KV):
        super().__init__()
        self.head_dim, self.num_heads = HEAD, HEADS
        self.qkv_proj = nn.Linear(HIDDEN, width)
        self.o_proj = nn.Linear(Q, HIDDEN)


class KeyPackedFirst(Packed):
    def forward(self, x):
        k, q, v = self.qkv_proj(x).split([KV, Q, KV], dim=-1)
        return self.o_proj(attend(q, k, v))


class PackedPerHead(Packed):
    """q, k and v interleaved per head (GPT-NeoX)."""

    def __init__(self):
        super().__init__(3 * Q)

    def forward(self, x):
        qkv = self.qkv_proj(x).unflatten(-1, (HEADS, 3 * HEAD))
        q, k, v = (t.flatten(2) for t in qkv.chunk(3, dim=-1))
        return self.o_proj(attend(q, k, v))


class PackedWithAGap(Packed):
    """Slices that skip features: the packing is not q, k, v back to back."""

    def __init__(self):
        super().__init__(Q + 2 * KV + HEAD)

    def forward(self, x):
        qkv = self.qkv_proj(x)
        q = qkv[..., :Q]
        k = qkv[..., Q + HEAD : Q + HEAD + KV]
        v = qkv[..., Q + HEAD + KV :]
        return self.o_proj(attend(q, k, v))


# --- gated MLPs ----------------------------------------------------------------------


class PackedViewedWithHeadCount(nn.Module):
    """Baichuan's remote code: a packed projection chunked in three, each part
    viewed with the module's own head count, the output with its hidden size:
    under tensor parallelism a rank holds a share of the heads those name."""

    def __init__(self):
        super().__init__()
        self.hidden_size, self.num_heads, self.head_dim = Q, HEADS, HEAD
        self.W_pack = nn.Linear(HIDDEN, 3 * Q, bias=False)
        self.o_proj = nn.Linear(Q, HIDDEN, bias=False)

    def forward(self, x):
        batch, tokens, _ = x.size()
        q, k, v = (
            part.view(batch, tokens, self.num_heads, self.head_dim).transpose(1, 2)
            for part in self.W_pack(x).chunk(3, -1)
        )
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(batch, tokens, self.hidden_size))


class MLP(nn.Module):
    def __init__(self, activation: str = "silu", up_width: int = 2 * HIDDEN):
        super().__init__()
        self.gate_proj = nn.Linear(HIDDEN, 2 * HIDDEN)
        self.up_proj = nn.Linear(HIDDEN, up_width)
        self.down_proj = nn.Linear(2 * HIDDEN, HIDDEN)
        self.act_fn = ACT2FN[activation]

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class GateOverUp(MLP):
    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) / self.up_proj(x))


class UpMinusGate(MLP):
    def forward(self, x):
        return self.down_proj(self.up_proj(x) - self.act_fn(self.gate_proj(x)))


class ReluGate(MLP):
    def __init__(self):
        super().__init__("relu")


class UpOfOneFeature(MLP):
    """The up projection broadcast over the gate's features."""

    def __init__(self):
        super().__init__(up_width=1)


class GateAlsoReturned(MLP):
    def forward(self, x):
        gate = self.gate_proj(x)
        return self.down_proj(self.act_fn(gate) * self.up_proj(x)), gate


class ActivationChosenInForward(MLP):
    def __init__(self):
        super().__init__()
        self.config = AutoConfig.for_model("llama", hidden_act="silu")

    def forward(self, x):
        act = ACT2FN[self.config.hidden_act]
        return self.down_proj(act(self.gate_proj(x)) * self.up_proj(x))


class InputWrittenBetweenGateAndUp(MLP):
    def forward(self, x):
        gate = self.gate_proj(x)
        x.add_(1)
        up = self.up_proj(x)
        return self.down_proj(self.act_fn(gate) * up)


class UpTimesGateBound(MLP):
    """Each step bound to a local, the product written up first: fused."""

    def forward(self, x):
        gate = self.gate_proj(x)
        up = self.up_proj(x)
        return self.down_proj(up * self.act_fn(gate))


class NormedBeforeDown(MLP):
    """The gated product normalised over its whole width before `down_proj` (BitNet's
    `ffn_sub_norm`): a tensor-parallel rank holds only its share of that width."""

    def __init__(self):
        super().__init__()
        self.sub_norm = nn.RMSNorm(2 * HIDDEN, eps=1e-6)

    def forward(self, x):
        gated = self.act_fn(self.gate_proj(x)) * self.up_proj(x)
        return self.down_proj(self.sub_norm(gated))


# --- RMSNorms ----------------------------------------------------------------------


class Norm(nn.Module):
    def __init__(self, offset: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.full((HIDDEN,), offset))
        self.variance_epsilon = 1e-6

    def forward(self, x):
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * y.to(x.dtype)


class NormOverTokens(Norm):
    def forward(self, x):
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(1, keepdim=True) + self.variance_epsilon)
        return self.weight * y.to(x.dtype)


class LayerNormNamedRMSNorm(Norm):
    """Subtracts the mean first: a LayerNorm without bias."""

    def forward(self, x):
        y = x.float()
        y = y - y.mean(-1, keepdim=True)
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * y.to(x.dtype)


class WeightBeforeTheNorm(Norm):
    def forward(self, x):
        y = (self.weight * x).float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return y.to(x.dtype)


class WeightOnTheRoundedValue(Norm):
    """Rounded to the input dtype, then weighted in float32."""

    def forward(self, x):
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (self.weight.float() * y.to(x.dtype)).to(x.dtype)


class WeightThenCast(Norm):
    """Weighted in float32 before the cast back (OLMo 2): fused."""

    def forward(self, x):
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (self.weight * y).to(x.dtype)


class EpsOfTheConfig(Norm):
    def __init__(self):
        super().__init__()
        del self.variance_epsilon
        self.config = AutoConfig.for_model("llama", rms_norm_eps=1e-6)

    def forward(self, x):
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps)
        return self.weight * y.to(x.dtype)


class EpsOfTheDtype(Norm):
    def forward(self, x):
        y = x.float()
        eps = torch.finfo(x.dtype).eps
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
        return self.weight * y.to(x.dtype)


class OffsetByTwo(Norm):
    def forward(self, x):
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (y * (2.0 + self.weight.float())).type_as(x)


class ShiftedAfterwards(nn.Module):
    """Weightless, but shifted after normalising."""

    def __init__(self):
        super().__init__()
        self.eps = 1e-6

    def forward(self, x):
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return y.to(x.dtype) + 0.1


# --- latent attention --------------------------------------------------------------


def deepseek_attention(**replace: Callable[[nn.Linear], nn.Module]) -> nn.Module:
    """DeepSeek-V3 attention on `meta`, children replaced by `replace[name](child)`."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3Attention,
    )

    config = AutoConfig.for_model(
        "deepseek_v3",
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=96,
        kv_lora_rank=64,
        qk_rope_head_dim=16,
        qk_nope_head_dim=16,
        v_head_dim=16,
    )
    config._attn_implementation = "vllm_mla"
    with torch.device("meta"):
        module = DeepseekV3Attention(config, layer_idx=0)
        for name, make in replace.items():
            setattr(module, name, make(getattr(module, name)))
    return module


def with_bias(linear: nn.Linear) -> nn.Linear:
    return nn.Linear(linear.in_features, linear.out_features, bias=True)


def mla_with_bias() -> nn.Module:
    return deepseek_attention(kv_b_proj=with_bias)


def mla_one_down_projection_with_bias() -> nn.Module:
    return deepseek_attention(q_a_proj=with_bias)


def mla_layer_norm_latent() -> nn.Module:
    return deepseek_attention(kv_a_layernorm=lambda norm: nn.LayerNorm(64))


# --- the attention interface -------------------------------------------------------


class Interface(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer_idx, self.head_dim = 0, HEAD
        self.num_heads = self.num_key_value_heads = HEADS
        self.bias = None


class PositionBias(Interface):
    """Passes T5-style position biases, which vLLM's attention has no place for."""

    def forward(self, q, k, v):
        interface = ALL_ATTENTION_FUNCTIONS.get_interface("sdpa", None)
        return interface(self, q, k, v, None, position_bias=self.bias)


class ComputedScale(Interface):
    def forward(self, q, k, v):
        interface = ALL_ATTENTION_FUNCTIONS["sdpa"]
        # Read off the input while it runs: no value to build vLLM's layer with.
        return interface(self, q, k, v, None, scaling=1 / float(q.abs().max()))


class WindowOfTheInput(Interface):
    """Slides over a window it reads off the input while it runs: neither
    `config.layer_types` nor no window at all may stand in for it."""

    def forward(self, q, k, v):
        interface = ALL_ATTENTION_FUNCTIONS["sdpa"]
        return interface(self, q, k, v, None, sliding_window=q.shape[-2] // 2)


class WindowOfAnAbsentFlag(Interface):
    """Chooses its window by a flag this instance does not hold."""

    def forward(self, q, k, v):
        interface = ALL_ATTENTION_FUNCTIONS["sdpa"]
        window = self.head_dim if self.use_window else None
        return interface(self, q, k, v, None, sliding_window=window)


class TwoInterfaceCalls(Interface):
    def forward(self, q, k, v):
        interface = ALL_ATTENTION_FUNCTIONS.get_interface("sdpa", None)
        first, _ = interface(self, q, k, v, None)
        return interface(self, first, k, v, None)


# --- the mask the model builds (read by `masks.py`, checked against vLLM's window) --


class NarrowMask(PhimoeModel):
    """Its mask slides over half the window its config names (and vLLM would take
    for every layer): it hands the mask function a config copy."""

    def forward(self, input_ids=None, position_ids=None, **kwargs):
        hidden = self.embed_tokens(input_ids)
        narrow = copy.copy(self.config)
        narrow.sliding_window = self.config.sliding_window // 2
        mask = create_sliding_window_causal_mask(
            config=narrow,
            inputs_embeds=hidden,
            attention_mask=None,
            past_key_values=None,
            position_ids=position_ids,
        )
        position_embeddings = self.rotary_emb(hidden, position_ids)
        for layer in self.layers:
            hidden = layer(
                hidden, attention_mask=mask, position_embeddings=position_embeddings
            )
        return self.norm(hidden)


class OwnMask(PhimoeModel):
    """Builds its mask itself, with torch, not with Transformers' mask functions:
    which window it applies cannot be read."""

    def forward(self, input_ids=None, position_ids=None, **kwargs):
        hidden = self.embed_tokens(input_ids)
        tokens = hidden.shape[1]
        mask = torch.ones(tokens, tokens, device=hidden.device).tril().triu(-3)
        position_embeddings = self.rotary_emb(hidden, position_ids)
        for layer in self.layers:
            hidden = layer(
                hidden, attention_mask=mask, position_embeddings=position_embeddings
            )
        return self.norm(hidden)


@dataclass(frozen=True)
class NearMiss:
    build: Callable[[], nn.Module]
    fuser: str
    declined: str | None = None
    """A part of the reason the class analysis declines the fusion with."""
    refused: str | None = None
    """A part of the error building vLLM's attention for it raises."""
    declined_at_tp: str | None = None
    """A part of the reason each instance declines the fusion with at two
    tensor-parallel ranks (the class analysis fuses it; at one rank it computes
    the same)."""
    inputs: Callable[[torch.dtype], tuple] = lambda dtype: (
        torch.randn(2, 5, HIDDEN, generator=torch.Generator().manual_seed(1)).to(dtype),
    )


CORPUS: dict[str, NearMiss] = {
    "qkv-gated-query": NearMiss(
        GatedQuery, "QKVFuser", "q is 64 wide but the attention gets"
    ),
    "qkv-key-value-of-another-input": NearMiss(
        KeyValueOfAnotherInput, "QKVFuser", "read different inputs"
    ),
    "qkv-input-rebound-between": NearMiss(
        InputRebound, "QKVFuser", "read different inputs"
    ),
    "qkv-input-written-in-place-between": NearMiss(
        InputWrittenInPlace, "QKVFuser", "`x` changes between"
    ),
    "qkv-one-bias": NearMiss(
        OneBias, "QKVFuser", "some of the projections have a bias"
    ),
    "qkv-value-of-the-query": NearMiss(
        ValueOfTheQuery, "QKVFuser", "nor the value from the key's"
    ),
    "qkv-projection-called-twice": NearMiss(
        QueryProjectedTwice, "QKVFuser", "q_proj is called 2 times"
    ),
    "qkv-forward-with-super": NearMiss(
        ClosureForward,
        "QKVFuser",
        "forward not rewritten: ClosureForward.forward uses free",
    ),
    "qkv-scaled-key": NearMiss(ScaledKey, "QKVFuser"),
    "qkv-names-say-otherwise": NearMiss(NamesSayOtherwise, "QKVFuser"),
    "qkv-normed-before-output-at-tp": NearMiss(
        NormedBeforeOutput,
        "QKVFuser",
        declined_at_tp="sub_norm act on the whole width between the attention and",
    ),
    "qkv-viewed-with-head-count-at-tp": NearMiss(
        ViewedWithHeadCount, "QKVFuser", declined_at_tp="num_heads"
    ),
    "packed-viewed-with-head-count-at-tp": NearMiss(
        PackedViewedWithHeadCount, "PackedQKVFuser", declined_at_tp="num_heads"
    ),
    "packed-key-first": NearMiss(
        KeyPackedFirst, "PackedQKVFuser", "the attention's query is not the packed"
    ),
    "packed-per-head": NearMiss(PackedPerHead, "PackedQKVFuser", "cannot be proven"),
    "packed-with-a-gap": NearMiss(
        PackedWithAGap, "PackedQKVFuser", "do not cover the packed output once"
    ),
    "glu-normed-before-down-at-tp": NearMiss(
        NormedBeforeDown,
        "GLUFuser",
        declined_at_tp="between the gated product and down_proj",
    ),
    "glu-gate-over-up": NearMiss(
        GateOverUp, "GLUFuser", "combined by truediv, not multiplied"
    ),
    "glu-up-minus-gate": NearMiss(
        UpMinusGate, "GLUFuser", "combined by sub, not multiplied"
    ),
    "glu-relu": NearMiss(
        ReluGate, "GLUFuser", "no fused act-and-mul for the activation"
    ),
    "glu-up-of-one-feature": NearMiss(
        UpOfOneFeature, "GLUFuser", "gate_proj and up_proj differ in width"
    ),
    "glu-gate-also-returned": NearMiss(GateAlsoReturned, "GLUFuser", "used elsewhere"),
    "glu-activation-chosen-in-forward": NearMiss(
        ActivationChosenInForward,
        "GLUFuser",
        "the activation is chosen while the forward",
    ),
    "glu-input-written-between": NearMiss(
        InputWrittenBetweenGateAndUp, "GLUFuser", "`x` changes between"
    ),
    "glu-up-times-gate-bound": NearMiss(UpTimesGateBound, "GLUFuser"),
    "norm-over-tokens": NearMiss(
        NormOverTokens, "RMSNormFuser", "the mean is over dim=1"
    ),
    "norm-layer-norm-named-rms-norm": NearMiss(
        LayerNormNamedRMSNorm, "RMSNormFuser", "it does not normalise its first input"
    ),
    "norm-weight-before-the-norm": NearMiss(
        WeightBeforeTheNorm, "RMSNormFuser", "it does not normalise its first input"
    ),
    "norm-weight-on-the-rounded-value": NearMiss(
        WeightOnTheRoundedValue, "RMSNormFuser", "to a value rounded to torch.bfloat16"
    ),
    "norm-eps-of-the-config": NearMiss(
        EpsOfTheConfig, "RMSNormFuser", "is neither an attribute of it nor written"
    ),
    "norm-eps-of-the-dtype": NearMiss(
        EpsOfTheDtype, "RMSNormFuser", "is neither an attribute of it nor written"
    ),
    "norm-offset-by-two": NearMiss(OffsetByTwo, "RMSNormFuser", "offset by 2.0, not 1"),
    "norm-shifted-afterwards": NearMiss(
        ShiftedAfterwards, "RMSNormFuser", "something other than a weight follows"
    ),
    "norm-weight-then-cast": NearMiss(WeightThenCast, "RMSNormFuser"),
    "mla-kv-up-projection-with-bias": NearMiss(
        mla_with_bias, "MLAFuser", "kv_b_proj has a bias, which MLA cannot absorb"
    ),
    "mla-one-down-projection-with-bias": NearMiss(
        mla_one_down_projection_with_bias, "MLAFuser", "only one of q_a_proj and"
    ),
    "mla-layer-norm-latent": NearMiss(
        mla_layer_norm_latent, "MLAFuser", "is not an RMSNorm"
    ),
    "attention-position-bias": NearMiss(
        PositionBias, "AttentionFuser", refused="passes position_bias= to the attention"
    ),
    "attention-computed-scale": NearMiss(
        ComputedScale, "AttentionFuser", refused="passes scaling=1 / float(q.abs().max())"
    ),
    "attention-window-of-the-input": NearMiss(
        WindowOfTheInput,
        "AttentionFuser",
        refused="passes sliding_window=q.shape[-2] // 2 to the attention interface",
    ),
    "attention-window-of-an-absent-flag": NearMiss(
        WindowOfAnAbsentFlag,
        "AttentionFuser",
        refused="passes sliding_window=window to the attention interface",
    ),
    "attention-two-calls": NearMiss(
        TwoInterfaceCalls, "AttentionFuser", "calls it 2 times"
    ),
}
