# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""RotaryEmbeddingFuser: `cos(cat((f, f), -1)) * s` -> `cos(f) * s`, the first half."""

import pytest
import torch
from configs import small_config
from torch import nn
from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

from vllm.model_executor.models.transformers.plan import get_fuser
from vllm.model_executor.models.transformers.fusers import RotaryEmbeddingFuser

HEAD = 16


def llama(**overrides) -> LlamaRotaryEmbedding:
    return LlamaRotaryEmbedding(small_config("llama", **overrides))


EMBEDDINGS = {
    "llama": lambda: llama(),
    # Scaled frequencies; the scale multiplies cos and sin (attention_scaling).
    "llama-yarn": lambda: llama(
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=10000.0,
            factor=4.0,
            original_max_position_embeddings=32,
        )
    ),
    # Partial rotary: a quarter of each head.
    "phi3-partial": lambda: Phi3RotaryEmbedding(
        small_config("phi3", partial_rotary_factor=0.25, pad_token_id=0)
    ),
}


def positions(count: int = 40) -> torch.Tensor:
    # Past the yarn recipe's original length.
    return torch.arange(count)[None]


@pytest.mark.parametrize("name", EMBEDDINGS)
def test_the_fused_embedding_returns_the_first_half_of_both_outputs(name, fuse):
    module = EMBEDDINGS[name]()
    reference = EMBEDDINGS[name]()
    fused, applied = fuse(module, paired=True)
    assert any(isinstance(f, RotaryEmbeddingFuser) for f in applied)
    x = torch.zeros(1, 40, 8)
    for whole, half in zip(reference(x, positions()), fused(x, positions())):
        width = whole.shape[-1] // 2
        assert half.shape == (*whole.shape[:-1], width)
        # Elementwise on the same values: equal, not close.
        assert torch.equal(whole[..., :width], half)
        assert torch.equal(whole[..., width:], half)


class Interleaved(nn.Module):
    """GPT-J style: each frequency repeated in place, `[f0, f0, f1, f1, ...]`."""

    def __init__(self):
        super().__init__()
        self.inv_freq = nn.Buffer(1.0 / 10000 ** (torch.arange(0, HEAD, 2) / HEAD))

    def forward(self, x, position_ids):
        freqs = position_ids[..., None].float() * self.inv_freq
        emb = torch.repeat_interleave(freqs, 2, dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


class TwoFrequencies(Interleaved):
    """Two halves, but not the same one twice."""

    def forward(self, x, position_ids):
        freqs = position_ids[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, 2 * freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


class ScaledPerChannel(Interleaved):
    """Repeated halves, then scaled by a tensor that differs between them."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Buffer(torch.linspace(0.5, 1.5, HEAD))

    def forward(self, x, position_ids):
        freqs = position_ids[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * self.scale, emb.sin() * self.scale


class AlsoReturnsTheAngles(Interleaved):
    def forward(self, x, position_ids):
        freqs = position_ids[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin(), emb


class AlongTokens(Interleaved):
    """The same tensor twice, but concatenated along the tokens."""

    def forward(self, x, position_ids):
        freqs = position_ids[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=1)
        return emb.cos(), emb.sin()


@pytest.mark.parametrize(
    "cls, reason",
    [
        (Interleaved, "no `cat((x, x), dim=-1)` repeats the frequencies"),
        (TwoFrequencies, "no `cat((x, x), dim=-1)` repeats the frequencies"),
        (ScaledPerChannel, "by more than an elementwise operator"),
        (AlsoReturnsTheAngles, "does not return two tensors"),
        (AlongTokens, "no `cat((x, x), dim=-1)` repeats the frequencies"),
    ],
)
def test_embeddings_whose_halves_may_differ_are_declined(cls, reason, declined):
    module = cls()
    assert get_fuser(module, RotaryEmbeddingFuser) is None
    assert any(reason in r for r in declined(RotaryEmbeddingFuser)), declined(
        RotaryEmbeddingFuser
    )


def test_an_embedding_with_frequencies_per_layer_type_is_declined(declined):
    # Gemma 3 picks its frequencies by a name built from an argument
    # (`getattr(self, f"{layer_type}_inv_freq")`), which tracing cannot follow.
    module = Gemma3RotaryEmbedding(small_config("gemma3_text"))
    assert get_fuser(module, RotaryEmbeddingFuser) is None
    assert declined(RotaryEmbeddingFuser) == ["the forward was not traced to its end"]


def test_an_embedding_that_branches_on_the_positions_is_declined(declined):
    # Dynamic rotary recomputes its frequencies past the trained length, deciding
    # on the positions' values, which tracing cannot follow.
    module = llama(
        rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0),
        max_position_embeddings=16,
    )
    assert get_fuser(module, RotaryEmbeddingFuser) is None
    assert declined(RotaryEmbeddingFuser) == ["the forward was not traced to its end"]


class Switchable(Interleaved):
    """Repeated halves or interleaved frequencies, chosen per instance."""

    def __init__(self, interleaved: bool):
        super().__init__()
        self.interleaved = interleaved

    def forward(self, x, position_ids):
        freqs = position_ids[..., None].float() * self.inv_freq
        if self.interleaved:
            emb = torch.repeat_interleave(freqs, 2, dim=-1)
        else:
            emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()


def test_an_instance_that_takes_another_branch_is_declined(vllm_config):
    halves, interleaved = Switchable(False), Switchable(True)
    fuser = get_fuser(halves, RotaryEmbeddingFuser)
    assert fuser is not None and fuser.mismatch(halves, vllm_config) is None
    # The forward branches on `interleaved`: each value is analysed on its own,
    # and the analysis of one still declines an instance taking the other branch.
    assert get_fuser(interleaved, RotaryEmbeddingFuser) is None
    assert "no `cat((x, x), dim=-1)`" in fuser.mismatch(interleaved, vllm_config)
