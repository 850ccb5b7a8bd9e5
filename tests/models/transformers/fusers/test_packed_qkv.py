# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""PackedQKVFuser: a packed projection split into q, k, v -> QKVParallelLinear
(an `nn.Linear`, or GPT-2's `Conv1D` whose weight loads transposed)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig
from transformers.models.gpt2.modeling_gpt2 import GPT2Attention
from transformers.models.gpt_bigcode.modeling_gpt_bigcode import GPTBigCodeAttention
from transformers.models.phi3.modeling_phi3 import Phi3Attention
from near_miss import PackedViewedWithHeadCount
from transformers.pytorch_utils import Conv1D

from vllm.model_executor.layers.linear import QKVParallelLinear, RowParallelLinear
from vllm.model_executor.models.transformers.plan import get_fuser
from vllm.model_executor.models.transformers.fusers import PackedQKVFuser, QKVFuser

HIDDEN, HEAD, HEADS, KV_HEADS = 32, 8, 4, 2
Q, KV = HEADS * HEAD, KV_HEADS * HEAD


class Packed(nn.Module):
    """One projection for q, k and v, sliced apart as Phi-3 does."""

    def __init__(self):
        super().__init__()
        self.head_dim, self.num_heads = HEAD, HEADS
        self.qkv_proj = nn.Linear(HIDDEN, Q + 2 * KV, bias=True)
        self.o_proj = nn.Linear(Q, HIDDEN)

    def attend(self, q, k, v):
        shape = (*q.shape[:-1], -1, self.head_dim)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).flatten(2))

    def forward(self, hidden_states):
        qkv = self.qkv_proj(hidden_states)
        q_size = self.num_heads * self.head_dim
        q = qkv[..., :q_size]
        k = qkv[..., q_size : q_size + KV]
        v = qkv[..., q_size + KV :]
        return self.attend(q, k, v)


class PackedSplit(Packed):
    def forward(self, hidden_states):
        q, k, v = self.qkv_proj(hidden_states).split([Q, KV, KV], dim=-1)
        return self.attend(q, k, v)


class PackedTorchSplit(Packed):
    def forward(self, hidden_states):
        q, k, v = torch.split(
            self.qkv_proj(hidden_states).unsqueeze(1), [Q, KV, KV], dim=3
        )
        return self.attend(q[:, 0], k[:, 0], v[:, 0])


class PackedChunk(Packed):
    def __init__(self):
        super().__init__()
        self.qkv_proj = nn.Linear(HIDDEN, 3 * Q)

    def forward(self, hidden_states):
        q, k, v = self.qkv_proj(hidden_states).chunk(3, dim=-1)
        return self.attend(q, k, v)


class InterleavedPerHead(Packed):
    """GPT-NeoX packs q, k, v per head: which features are which depends on a view."""

    def __init__(self):
        super().__init__()
        self.qkv_proj = nn.Linear(HIDDEN, 3 * Q)

    def forward(self, hidden_states):
        qkv = self.qkv_proj(hidden_states).view(
            *hidden_states.shape[:-1], -1, 3 * self.head_dim
        )
        q, k, v = qkv.transpose(1, 2).chunk(3, dim=-1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).flatten(2))


class KeyFirst(Packed):
    def forward(self, hidden_states):
        k, q, v = self.qkv_proj(hidden_states).split([KV, Q, KV], dim=-1)
        return self.attend(q, k, v)


class StopsAfterOutput(Packed):
    def forward(self, hidden_states):
        q, k, v = self.qkv_proj(hidden_states).split([Q, KV, KV], dim=-1)
        out = self.attend(q, k, v)
        if out.isnan().any():
            raise ValueError("NaN")
        return out


def tokens(width: int = HIDDEN, seed: int = 1) -> torch.Tensor:
    return torch.randn(2, 5, width, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    "module",
    [Packed(), PackedSplit(), PackedTorchSplit(), PackedChunk(), StopsAfterOutput()],
    ids=["slices", "split", "torch-split", "chunk", "trace-stops-after-output"],
)
def test_packed_projection_becomes_qkv_parallel_linear(module, equivalent):
    fused, applied = equivalent(module, tokens())
    assert isinstance(applied[0], PackedQKVFuser)
    assert isinstance(fused.qkv_proj, QKVParallelLinear)
    assert isinstance(fused.o_proj, RowParallelLinear)


def test_packed_tensor_loads_through_the_qkv_loader(fuse):
    module = Packed()
    packed = module.qkv_proj.bias.detach().clone()
    fused, (fuser,) = fuse(module)
    # Checkpoint names are unchanged: the QKV loader splits the packed tensor itself.
    assert fuser.stacked_weights("model.layers.0.self_attn") == {}
    assert fuser.packed_modules_mapping == {"qkv_proj": ["qkv_proj"]}
    assert (fused.qkv_proj.total_num_heads, fused.qkv_proj.total_num_kv_heads) == (
        HEADS,
        KV_HEADS,
    )
    # (The weight itself is repacked for the CPU GEMM once loaded; the bias is not.)
    torch.testing.assert_close(fused.qkv_proj.bias.data, packed)


def test_phi3_attention_is_fused(equivalent):
    config = AutoConfig.for_model(
        "phi3",
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
    )
    config._attn_implementation = "eager"
    cos, sin = tokens(HEAD, 2), tokens(HEAD, 3)
    _, applied = equivalent(
        Phi3Attention(config, layer_idx=0), tokens(), (cos, sin), None
    )
    assert [type(f) for f in applied] == [PackedQKVFuser]


def test_gpt_bigcode_multi_query_attention_is_fused(equivalent):
    config = AutoConfig.for_model(
        "gpt_bigcode", n_embd=HIDDEN, n_head=HEADS, multi_query=True
    )
    config._attn_implementation = "eager"
    fused, _ = equivalent(GPTBigCodeAttention(config, layer_idx=0), tokens())
    assert fused.c_attn.total_num_kv_heads == 1
    assert isinstance(fused.c_proj, RowParallelLinear)


@pytest.mark.parametrize(
    ("module", "reason"),
    [
        (InterleavedPerHead(), "goes through view before it is taken apart"),
        (KeyFirst(), "query is not the packed output's q part"),
    ],
    ids=["interleaved-per-head", "key-first"],
)
def test_packings_it_cannot_prove_are_declined(module, reason, declined):
    assert get_fuser(module, PackedQKVFuser) is None
    assert get_fuser(module, QKVFuser) is None
    assert any(reason in r for r in declined(PackedQKVFuser)), declined(PackedQKVFuser)


def test_gpt_bigcode_per_head_packing_is_declined(declined):
    config = AutoConfig.for_model(
        "gpt_bigcode", n_embd=HIDDEN, n_head=HEADS, multi_query=False
    )
    assert get_fuser(GPTBigCodeAttention(config, layer_idx=0), PackedQKVFuser) is None
    assert any("interleaved per head" in r for r in declined(PackedQKVFuser))


# --- GPT-2: the packed projection is a Conv1D (weight stored [in, out]) ----------------


def gpt2_config(**overrides):
    config = AutoConfig.for_model(
        "gpt2", n_embd=HIDDEN, n_head=HEADS, n_inner=4 * HIDDEN, **overrides
    )
    config._attn_implementation = "eager"
    return config


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gpt2_conv1d_c_attn_becomes_qkv_parallel_linear(dtype, equivalent):
    fused, applied = equivalent(
        GPT2Attention(gpt2_config(), layer_idx=0), tokens().to(dtype), dtype=dtype
    )
    assert [type(f) for f in applied] == [PackedQKVFuser]
    assert isinstance(fused.c_attn, QKVParallelLinear)
    assert fused.c_attn.total_num_heads == fused.c_attn.total_num_kv_heads == HEADS
    assert isinstance(fused.c_proj, RowParallelLinear)


def test_gpt2_conv1d_weight_loads_transposed_bias_as_is(fuse):
    module = GPT2Attention(gpt2_config(), layer_idx=0)
    with torch.no_grad():
        module.c_attn.bias.normal_()  # zeros from Conv1D's init would hide a mix-up
    weight, bias = (p.detach().clone() for p in module.c_attn.parameters())
    fused, (fuser,) = fuse(module)
    assert fuser.packed_modules_mapping == {"c_attn": ["c_attn"]}
    # Conv1D stores [in, out]; vLLM's layer holds [out, in] (not repacked: only the
    # CPU GEMM's own layers are, and process_weights_after_loading keeps the values).
    torch.testing.assert_close(fused.c_attn.bias.data, bias)
    x = tokens()
    torch.testing.assert_close(fused.c_attn(x), x @ weight + bias, atol=1e-5, rtol=1e-5)


class Conv1DInterleavedPerHead(InterleavedPerHead):
    def __init__(self):
        super().__init__()
        self.qkv_proj = Conv1D(3 * Q, HIDDEN)
        self.o_proj = Conv1D(HIDDEN, Q)


class Conv1DKeyFirst(KeyFirst):
    def __init__(self):
        super().__init__()
        self.qkv_proj = Conv1D(Q + 2 * KV, HIDDEN)
        self.o_proj = Conv1D(HIDDEN, Q)


@pytest.mark.parametrize(
    ("module", "reason"),
    [
        (Conv1DInterleavedPerHead(), "goes through view before it is taken apart"),
        (Conv1DKeyFirst(), "query is not the packed output's q part"),
    ],
    ids=["interleaved-per-head", "key-first"],
)
def test_conv1d_packings_it_cannot_prove_are_declined(module, reason, declined):
    assert get_fuser(module, PackedQKVFuser) is None
    assert any(reason in r for r in declined(PackedQKVFuser)), declined(PackedQKVFuser)


def test_a_forward_viewing_with_the_whole_head_count_is_not_fused_under_tp(
    vllm_config, monkeypatch
):
    # At TP=2 the fused projection hands each rank half the heads, which
    # `.view(batch, tokens, self.num_heads, ...)` cannot take: refused at
    # construction (the module stays whole on every rank), not at the first step.
    module = PackedViewedWithHeadCount()
    fuser = get_fuser(module, PackedQKVFuser)
    assert fuser.validate(module, vllm_config)
    monkeypatch.setattr(vllm_config.parallel_config, "tensor_parallel_size", 2)
    assert fuser.mismatch(module, vllm_config) == (
        "its forward reshapes with self.num_heads (4), a count or width of all its "
        "heads, where each of 2 tensor-parallel ranks would hold only its share of them"
    )


def test_a_forward_viewing_with_the_whole_head_count_computes_the_same_at_tp_1(
    equivalent,
):
    _, applied = equivalent(PackedViewedWithHeadCount(), torch.randn(2, 5, 32))
    assert [type(f).__name__ for f in applied] == ["PackedQKVFuser"]
