# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""RotaryFuser: `apply_rotary_pos_emb(q, k, cos, sin)` -> vLLM's rotary kernel, fed
the half-width cos and sin of a fused rotary embedding; and the plan that fuses the
two sides together or not at all."""

import copy
import functools

import pytest
import torch
from configs import small_config
from torch import nn
from transformers.models.gpt_neox.modeling_gpt_neox import (
    GPTNeoXAttention,
    GPTNeoXRotaryEmbedding,
)
from transformers.models.llama import modeling_llama
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaRotaryEmbedding,
)
from transformers.models.phi.modeling_phi import PhiAttention, PhiRotaryEmbedding
from transformers.models.phi3.modeling_phi3 import Phi3Attention, Phi3RotaryEmbedding

from vllm.model_executor.models.transformers import plan as registry
from vllm.model_executor.models.transformers.plan import get_fuser
from vllm.model_executor.models.transformers.fusers import (
    RotaryEmbeddingFuser,
    RotaryFuser,
)
from vllm.model_executor.models.transformers.fusers import rotary

TOKENS = 7


def whole_and_half(embedding: nn.Module, tokens: int = TOKENS):
    """The embedding's cos and sin for `tokens` positions, and their first halves."""
    cos, sin = embedding(torch.zeros(1, tokens, 8), torch.arange(3, 3 + tokens)[None])
    width = cos.shape[-1] // 2
    return (cos, sin), (cos[..., :width], sin[..., :width])


@pytest.fixture
def kernel_calls(monkeypatch) -> list[int]:
    """How many times the fused function took vLLM's kernel."""
    calls = []
    original = rotary.rotate

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(rotary, "rotate", counted)
    return calls


@pytest.mark.parametrize("head_dim_at", [1, 2])
@pytest.mark.parametrize("width", [8, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# The cos and sin of one sequence may serve a batch of them (broadcast).
@pytest.mark.parametrize("batch, cos_batch", [(1, 1), (2, 1), (2, 2)])
def test_the_kernel_rotates_as_written_out(head_dim_at, width, dtype, batch, cos_batch):
    generator = torch.Generator().manual_seed(0)
    # Views of one projection, as attention modules hand them over.
    projection = torch.randn(batch, TOKENS, 6 * 16, generator=generator, dtype=dtype)
    shape = (batch, TOKENS, -1, 16)
    query = projection[..., : 4 * 16].view(shape).transpose(1, 2)
    key = projection[..., 4 * 16 :].view(shape).transpose(1, 2)
    if head_dim_at == 2:
        query, key = query.transpose(1, 2), key.transpose(1, 2)
    cos, sin = (
        torch.randn(cos_batch, TOKENS, width, generator=generator, dtype=dtype)
        for _ in "cs"
    )
    before = projection.clone()

    rotated = rotary.rotate(query, key, cos, sin, head_dim_at)

    for out, x in zip(rotated, (query, key)):
        expected = rotary.neox(x.float(), cos.float(), sin.float(), head_dim_at)
        assert out.shape == x.shape
        tolerance = 1e-6 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)
    # The inputs are left as they were: another part of the forward may read them.
    assert torch.equal(projection, before)


def eager(config):
    config._attn_implementation = "eager"
    return config


ATTENTIONS = {
    "llama": lambda: (
        LlamaAttention(eager(small_config("llama")), layer_idx=0),
        LlamaRotaryEmbedding(small_config("llama")),
    ),
    # Partial rotary: the function slices the rotary channels itself.
    "phi3-partial": lambda: (
        Phi3Attention(
            eager(small_config("phi3", partial_rotary_factor=0.5, pad_token_id=0)),
            layer_idx=0,
        ),
        Phi3RotaryEmbedding(small_config("phi3", partial_rotary_factor=0.5, pad_token_id=0)),
    ),
    # Partial rotary: the forward hands the function the rotary channels alone.
    "phi-partial": lambda: (
        PhiAttention(eager(small_config("phi", partial_rotary_factor=0.5)), layer_idx=0),
        PhiRotaryEmbedding(small_config("phi", partial_rotary_factor=0.5)),
    ),
    "gpt_neox": lambda: (
        GPTNeoXAttention(eager(small_config("gpt_neox", rotary_pct=0.25)), layer_idx=0),
        GPTNeoXRotaryEmbedding(small_config("gpt_neox", rotary_pct=0.25)),
    ),
}


@pytest.mark.parametrize("name", ATTENTIONS)
def test_attention_on_the_half_width_equals_transformers_on_the_whole(
    name, fuse, kernel_calls
):
    attention, embedding = ATTENTIONS[name]()
    reference = copy.deepcopy(attention)
    whole, half = whole_and_half(embedding)
    # What the plan checks for the width the embedding hands over (`unpaired`).
    width = half[0].shape[-1]
    fuser = get_fuser(attention, RotaryFuser)
    assert fuser.proven(attention, rotary.head_size_of(attention), width) or fuser.proven(
        attention, 2 * width, width
    )
    fused, applied = fuse(attention, paired=True)
    assert fuser in applied
    hidden = torch.randn(1, TOKENS, attention.config.hidden_size)
    with torch.no_grad():
        expected = reference(hidden, position_embeddings=whole, attention_mask=None)
        actual = fused(hidden, position_embeddings=half, attention_mask=None)
    torch.testing.assert_close(actual[0], expected[0], atol=1e-5, rtol=1e-5)
    assert kernel_calls, "the fused function did not take vLLM's kernel"


def test_calls_it_was_not_proven_on_run_the_original_on_the_whole(kernel_calls):
    attention, embedding = ATTENTIONS["llama"]()
    fuser = get_fuser(attention, RotaryFuser)
    fused = fuser._fused_function(modeling_llama.apply_rotary_pos_emb, frozenset())
    whole, half = whole_and_half(embedding)
    query = torch.randn(1, 4, TOKENS, 32)
    key = torch.randn(1, 2, TOKENS, 32)
    expected = modeling_llama.apply_rotary_pos_emb(query, key, *whole)
    for got, want in zip(fused(query, key, *half), expected):
        torch.testing.assert_close(got, want)
    assert not kernel_calls


def apply_rotary_interleaved(q, k, cos, sin):
    """GPT-J style: channel pairs `(2i, 2i + 1)` rotated together."""

    def rotate_pairs(x):
        return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)

    cos = cos[..., : cos.shape[-1] // 2].repeat_interleave(2, dim=-1).unsqueeze(1)
    sin = sin[..., : sin.shape[-1] // 2].repeat_interleave(2, dim=-1).unsqueeze(1)
    return q * cos + rotate_pairs(q) * sin, k * cos + rotate_pairs(k) * sin


def apply_rotary_one(x, cos, sin):
    return x * cos.unsqueeze(1) + modeling_llama.rotate_half(x) * sin.unsqueeze(1)


class Probe(nn.Module):
    head_dim = 16


class Interleaved(Probe):
    def forward(self, q, k, position_embeddings):
        cos, sin = position_embeddings
        return apply_rotary_interleaved(q, k, cos, sin)


class ComputedArgument(Probe):
    def forward(self, q, k, position_embeddings):
        cos, sin = position_embeddings
        return apply_rotary_pos_emb(q, k, cos, sin, self.head_dim // 16)


class OneAtATime(Probe):
    def forward(self, q, k, position_embeddings):
        cos, sin = position_embeddings
        return apply_rotary_one(q, cos, sin), apply_rotary_one(k, cos, sin)


class TwoFunctions(Probe):
    def forward(self, q, k, position_embeddings, interleaved=False):
        cos, sin = position_embeddings
        if interleaved:
            return apply_rotary_interleaved(q, k, cos, sin)
        return apply_rotary_pos_emb(q, k, cos, sin)


class ReadsCosElsewhere(Probe):
    def forward(self, q, k, position_embeddings):
        cos, sin = position_embeddings
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q * cos.mean(), k


class PassesTheEmbeddingsOn(Probe):
    def forward(self, q, k, position_embeddings):
        cos, sin = position_embeddings
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return self.other(q, position_embeddings), k


class AsAttribute(Probe):
    """Reads an attribute of the function's name: renaming the global would rename
    it too (both are in the code's one table of names)."""

    apply_rotary_pos_emb = 2.0

    def forward(self, q, k, position_embeddings):
        cos, sin = position_embeddings
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q * self.apply_rotary_pos_emb, k


class InAComprehension(Probe):
    """The call inside nested code (a comprehension) is renamed there too."""

    def forward(self, q, k, position_embeddings):
        cos, sin = position_embeddings
        return [apply_rotary_pos_emb(q, k, cos, sin) for _ in range(1)][0]


def decorated(forward):
    @functools.wraps(forward)
    def wrapper(*args, **kwargs):
        return forward(*args, **kwargs)

    return wrapper


class Decorated(Probe):
    @decorated
    def forward(self, q, k, position_embeddings):
        cos, sin = position_embeddings
        return apply_rotary_pos_emb(q, k, cos, sin)


apply_rotary_pos_emb = modeling_llama.apply_rotary_pos_emb


@pytest.mark.parametrize(
    "cls, reason",
    [
        (Interleaved, "does not rotate the halves of heads of 16 as vLLM's"),
        (ComputedArgument, "passes arguments other than constants after cos and sin"),
        (OneAtATime, "does not pass (query, key, cos, sin)"),
        (TwoFunctions, "applies rotary embeddings differently"),
        (Decorated, "its forward is wrapped by a decorator"),
        (ReadsCosElsewhere, "`cos` is read elsewhere in the forward"),
        (PassesTheEmbeddingsOn, "`position_embeddings` is read elsewhere"),
        (AsAttribute, "its forward also uses apply_rotary_pos_emb as a name"),
    ],
)
def test_functions_that_do_not_rotate_as_the_kernel_are_declined(cls, reason, declined):
    assert get_fuser(cls(), RotaryFuser) is None
    assert any(reason in r for r in declined(RotaryFuser)), declined(RotaryFuser)


def test_a_call_in_nested_code_is_fused_too(fuse, kernel_calls):
    module = InAComprehension()
    fused, applied = fuse(module, paired=True)
    assert any(isinstance(f, RotaryFuser) for f in applied)
    embedding = LlamaRotaryEmbedding(small_config("llama", head_dim=16))
    whole, half = whole_and_half(embedding)
    q, k = torch.randn(1, 4, TOKENS, 16), torch.randn(1, 2, TOKENS, 16)
    for got, want in zip(fused(q, k, half), apply_rotary_pos_emb(q, k, *whole)):
        torch.testing.assert_close(got, want)
    assert kernel_calls


def taken(model, fuser_cls) -> list[str]:
    plan = model.plan
    return sorted(plan.name(m) for m in plan if any(isinstance(f, fuser_cls) for f in plan[m]))


def test_a_model_fuses_its_embedding_and_every_attention_together(build_backend):
    model = build_backend(small_config("llama", num_hidden_layers=3))
    assert taken(model, RotaryEmbeddingFuser) == ["model.rotary_emb"]
    assert taken(model, RotaryFuser) == [f"model.layers.{i}.self_attn" for i in range(3)]


def test_an_attention_off_the_kernel_keeps_the_embedding_whole(build_backend):
    # GLM rotates channel pairs (GPT-J style): its attention is declined, so its
    # embedding, whose half-width cos would reach it, is declined too.
    model = build_backend(small_config("glm", pad_token_id=0))
    assert taken(model, RotaryEmbeddingFuser) == taken(model, RotaryFuser) == []
    (decline,) = [d for d in model.plan.declined if d.fuser == "RotaryEmbeddingFuser"]
    assert decline.module == "model.rotary_emb"
    assert "model.layers.0.self_attn (GlmAttention) does not apply" in decline.reason


def test_an_embedding_kept_whole_keeps_every_attention_off_the_kernel(build_backend):
    # Gemma 3's embeddings are declined (frequencies per layer type).
    model = build_backend(small_config("gemma3_text"))
    assert taken(model, RotaryFuser) == []
    reasons = {d.reason for d in model.plan.declined if d.fuser == "RotaryFuser"}
    assert len(reasons) == 1
    assert "the rotary embedding model.rotary_emb (Gemma3RotaryEmbedding) keeps" in (
        reasons.pop()
    )


def test_a_partial_rotary_is_proven_on_the_channels_it_rotates(build_backend):
    # Phi hands the function the rotary quarter of each head alone.
    model = build_backend(small_config("phi", partial_rotary_factor=0.25))
    assert taken(model, RotaryEmbeddingFuser) == ["model.rotary_emb"]
    attention = model.model.layers[0].self_attn
    fuser = model.plan[attention][-2]
    assert isinstance(fuser, RotaryFuser)
    assert fuser.proven(attention, 8, 4)


def test_building_again_writes_no_new_name_into_transformers(fuse):
    # The fused function lives in the modeling module's globals (the forward's code
    # reads it there): one name for one proven rotation, however many times a
    # model is built, the registry's cache cleared between builds.
    def written() -> list[str]:
        return [name for name in vars(modeling_llama) if "_on_vllm_kernel" in name]

    before = written()
    for _ in range(3):
        registry.clear_cache()
        fuse(ATTENTIONS["llama"]()[0], paired=True)
    assert len(written()) <= len(before) + 1
    assert written()[: len(before)] == before
