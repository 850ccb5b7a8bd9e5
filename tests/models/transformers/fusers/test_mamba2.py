# SPDX-License-Identifier: Apache-2.0
"""The Mamba-2 mixer fuser: which mixers vLLM's `MambaMixer2` serves, proven on a
float64 probe against the module itself, and which it declines, with why."""

import dataclasses
import math

import pytest
import torch
from configs import small_config
from transformers.models.falcon_h1.modeling_falcon_h1 import (
    FalconH1Mixer,
    compute_mup_vector,
)
from transformers.models.granitemoehybrid.modeling_granitemoehybrid import (
    GraniteMoeHybridMambaLayer,
)
from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer

from vllm.model_executor.models.transformers.fusers.base import Declined
from vllm.model_executor.models.transformers.fusers.mamba2 import Mamba2MixerFuser
from vllm.model_executor.models.transformers.mixers import Mamba2Dims

MAMBA = dict(mamba_n_heads=8, mamba_d_head=32, mamba_d_state=16)


def granite_mixer(**changes) -> GraniteMoeHybridMambaLayer:
    config = small_config("granitemoehybrid", **{**MAMBA, **changes})
    return GraniteMoeHybridMambaLayer(config, layer_idx=1)


def nemotron_mixer(**changes) -> NemotronHMamba2Mixer:
    config = small_config(
        "nemotron_h",
        mamba_num_heads=8,
        mamba_head_dim=32,
        ssm_state_size=16,
        n_groups=2,
        **changes,
    )
    return NemotronHMamba2Mixer(config, layer_idx=0)


def proven(module: torch.nn.Module) -> Mamba2Dims | str:
    fuser = Mamba2MixerFuser.match(None, module)
    assert isinstance(fuser, Mamba2MixerFuser), fuser
    return fuser.dims(module)


@pytest.mark.parametrize("n_groups", [1, 2])
def test_granite_mixer_is_proven_with_its_norm_over_the_whole_width(n_groups):
    dims = proven(granite_mixer(mamba_n_groups=n_groups))
    assert dims == Mamba2Dims(
        hidden_size=128,
        intermediate_size=256,
        num_heads=8,
        head_dim=32,
        n_groups=n_groups,
        state_size=16,
        conv_kernel=4,
        use_conv_bias=True,
        use_bias=False,
        eps=1e-6,
        activation="silu",
        norm_groups=1,  # Granite's gated norm is not grouped, whatever n_groups
    )


def test_a_norm_over_each_group_is_found_by_the_probe():
    # Nemotron-H normalises each of its B/C groups on its own (as vLLM's layer
    # does by default).
    dims = proven(nemotron_mixer())
    assert isinstance(dims, Mamba2Dims), dims
    assert (dims.n_groups, dims.norm_groups) == (2, 2)


@pytest.mark.parametrize(
    ("mixer", "limit"),
    [
        (lambda: granite_mixer(time_step_limit=(0.001, 2.0)), (0.001, 2.0)),
        (nemotron_mixer, (0.001, math.inf)),  # raised to `time_step_min`
        (lambda: nemotron_mixer(time_step_min=0.0), (0.0, math.inf)),
    ],
)
def test_the_time_step_limit_is_proven_and_kept(mixer, limit):
    dims = proven(mixer())
    assert isinstance(dims, Mamba2Dims), dims
    assert dims.time_step_limit == limit


def test_the_probe_sees_a_clamp_the_limit_does_not_name():
    # The limit is read from `time_step_limit`; the probe must show a module that
    # clamps otherwise: on it, Nemotron-H's mixer differs from the unclamped layer.
    mixer = nemotron_mixer()
    dims = proven(mixer)
    unclamped = dataclasses.replace(dims, time_step_limit=(0.0, math.inf))
    why = Mamba2MixerFuser.prove(mixer, unclamped)
    assert isinstance(why, str) and "clamped to (0.0, inf)" in why, why


def test_a_time_step_limit_that_is_no_range_is_declined():
    dims = proven(granite_mixer(time_step_limit=(0.1, 0.01)))
    assert isinstance(dims, str) and "no range of positive time steps" in dims


def test_a_mixer_that_computes_otherwise_is_declined_saying_where_it_differs():
    mixer = granite_mixer()

    def ungated(hidden_states, gate=None):  # the norm, without its gate
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return mixer.norm.weight * hidden_states * torch.rsqrt(variance + 1e-6)

    mixer.norm.forward = ungated
    dims = proven(mixer)
    assert isinstance(dims, str)
    assert "on a float64 probe vLLM's MambaMixer2" in dims and "the prefill" in dims


def test_parts_vllm_has_no_place_for_are_declined_naming_them():
    config = small_config(
        "falcon_h1", mamba_n_heads=8, mamba_d_head=32, mamba_d_state=16, mamba_d_ssm=256
    )
    mixer = FalconH1Mixer(config, layer_idx=0)
    # Falcon-H1 scales the projection's parts by a buffer (its µP multipliers).
    mixer.register_buffer("mup_vector", compute_mup_vector(config), persistent=False)
    found = Mamba2MixerFuser.match(None, mixer)
    assert isinstance(found, Declined)
    assert "mup_vector" in found.reason


def test_a_module_that_is_no_mixer_is_not_matched():
    assert Mamba2MixerFuser.match(None, torch.nn.Linear(4, 4)) is None
