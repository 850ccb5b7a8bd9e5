# SPDX-License-Identifier: Apache-2.0
"""The short-convolution fuser: which mixers vLLM's `ShortConv` serves (LFM2's),
proven on a float64 probe against the module itself, and which it declines, with
why."""

import pytest
import torch
from configs import small_config
from transformers.models.granitemoehybrid.modeling_granitemoehybrid import (
    GraniteMoeHybridMambaLayer,
)
from transformers.models.lfm2.modeling_lfm2 import Lfm2ShortConv
from transformers.models.lfm2_moe.modeling_lfm2_moe import Lfm2MoeShortConv

from vllm.model_executor.models.transformers.fusers.base import Declined
from vllm.model_executor.models.transformers.fusers.short_conv import ShortConvFuser
from vllm.model_executor.models.transformers.mixers import ShortConvDims

LAYERS = dict(layer_types=["conv", "full_attention"])


def lfm2_mixer(model_type: str = "lfm2", **changes) -> torch.nn.Module:
    config = small_config(model_type, **{**LAYERS, **changes})
    mixer_class = Lfm2ShortConv if model_type == "lfm2" else Lfm2MoeShortConv
    return mixer_class(config, layer_idx=0)


def proven(module: torch.nn.Module) -> ShortConvDims | str:
    fuser = ShortConvFuser.match(None, module)
    assert isinstance(fuser, ShortConvFuser), fuser
    return fuser.dims(module)


@pytest.mark.parametrize(
    "model_type, bias", [("lfm2", True), ("lfm2", False), ("lfm2_moe", False)]
)
def test_lfm2_mixer_is_proven(model_type, bias):
    dims = proven(lfm2_mixer(model_type, conv_bias=bias, conv_L_cache=3))
    assert dims == ShortConvDims(hidden_size=128, conv_kernel=3, use_bias=bias)


def test_a_mixer_that_computes_otherwise_is_declined_saying_where_it_differs():
    # in_proj's parts in another order, [x | B | C]: the module computes
    # B * conv(C * x), not vLLM's C * conv(B * x).
    mixer = lfm2_mixer()
    split = mixer.in_proj.forward
    mixer.in_proj.forward = lambda h: split(h).roll(128, -1)
    dims = proven(mixer)
    assert isinstance(dims, str)
    assert "on a float64 probe vLLM's ShortConv" in dims and "in the prefill" in dims


def test_a_mixer_that_drops_its_state_is_declined_at_the_continued_prefill():
    # Equal on a first prefill; the probe's second call continues from the state.
    class Stateless(Lfm2ShortConv):
        def forward(self, hidden_states, past_key_values=None, **kwargs):
            return super().forward(hidden_states)

    dims = proven(Stateless(small_config("lfm2", **LAYERS), layer_idx=0))
    assert isinstance(dims, str) and "in the continued prefill" in dims


def test_parts_vllm_has_no_place_for_are_declined_naming_them():
    mixer = lfm2_mixer()
    mixer.register_buffer("scale", torch.ones(128), persistent=False)
    found = ShortConvFuser.match(None, mixer)
    assert isinstance(found, Declined)
    assert "['scale'], which vLLM's ShortConv has no place for" in found.reason


def test_a_mamba2_mixer_or_a_linear_is_not_matched():
    config = small_config(
        "granitemoehybrid", mamba_n_heads=8, mamba_d_head=32, mamba_d_state=16
    )
    assert ShortConvFuser.match(None, GraniteMoeHybridMambaLayer(config, 0)) is None
    assert ShortConvFuser.match(None, torch.nn.Linear(4, 4)) is None
