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


def falcon_mixer(persistent: bool = False, **changes) -> FalconH1Mixer:
    config = small_config(
        "falcon_h1",
        mamba_n_heads=8,
        mamba_d_head=32,
        mamba_d_state=16,
        mamba_d_ssm=256,
        ssm_multipliers=[0.5, 1.5, 0.8, 1.25, 2.0],
        ssm_in_multiplier=0.7,
        **changes,
    )
    mixer = FalconH1Mixer(config, layer_idx=0)
    # Falcon-H1's model registers its µP multipliers on each mixer, per part of
    # in_proj's output.
    mup_vector = compute_mup_vector(config)
    mixer.register_buffer("mup_vector", mup_vector, persistent=persistent)
    return mixer


def test_scaled_projections_without_a_norm_are_proven_with_their_scales():
    # Falcon-H1 (`mamba_rms_norm=False`): `in_proj(h * 0.7) * mup_vector`, and
    # `y * silu(z)` with no norm. The input's scale is measured on the probe, not
    # read from an attribute.
    dims = proven(falcon_mixer())
    assert isinstance(dims, Mamba2Dims), dims
    assert not dims.gated_norm
    assert dims.input_scale == pytest.approx(0.7, rel=1e-12)
    assert dims.projection_scale == "mup_vector"


def test_a_norm_after_the_gate_is_proven_and_one_before_it_declined():
    # vLLM's layer normalises `y * silu(z)`; Falcon-H1's gated norm may instead
    # gate the normalised `y` (`mamba_norm_before_gate`), which it cannot. The two
    # mixers differ only by their norm's flag: each is proven on its own.
    after = proven(falcon_mixer(mamba_rms_norm=True, mamba_norm_before_gate=False))
    assert isinstance(after, Mamba2Dims) and after.gated_norm, after
    before = proven(falcon_mixer(mamba_rms_norm=True, mamba_norm_before_gate=True))
    assert isinstance(before, str), before
    assert "on a float64 probe vLLM's MambaMixer2" in before


def test_a_projection_scale_the_probe_does_not_confirm_is_declined():
    # A buffer of in_proj's width that the mixer's forward never applies: the
    # layer built with it would scale the projection wrongly.
    mixer = granite_mixer()
    features = mixer.in_proj.out_features
    mixer.register_buffer("unused", torch.full((features,), 2.0), persistent=False)
    dims = proven(mixer)
    assert isinstance(dims, str) and "on a float64 probe" in dims, dims


def test_parts_vllm_has_no_place_for_are_declined_naming_them():
    # A scale the checkpoint holds is a weight vLLM's layer has no place for.
    found = Mamba2MixerFuser.match(None, falcon_mixer(persistent=True))
    assert isinstance(found, Declined)
    assert "mup_vector" in found.reason


def test_a_module_that_is_no_mixer_is_not_matched():
    assert Mamba2MixerFuser.match(None, torch.nn.Linear(4, 4)) is None
