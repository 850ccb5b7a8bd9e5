# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The Mamba-2 mixer on vLLM's `MambaMixer2`, its states in vLLM's state cache."""

import functools
import itertools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Self

import torch
from torch import fx, nn

from vllm.model_executor.models.transformers.fusers.base import (
    Declined,
    MixerFuser,
)
from vllm.model_executor.models.transformers.mixers import (
    Mamba2Dims,
    Mamba2Mixer,
    causal_depthwise_kernel,
    first_gap,
    mamba2_reference,
    probe_outputs,
    state_description,
)
from vllm.platforms import current_platform

if TYPE_CHECKING:
    from vllm.config import VllmConfig

_OWN_TENSORS = frozenset({"A_log", "D", "dt_bias"})
_CHILDREN = frozenset({"in_proj", "conv1d", "norm", "out_proj", "act"})
_ACTIVATIONS = frozenset({"silu", "swish"})
"""What vLLM's causal convolution applies (it takes no other activation)."""
_PROBE_VALUES = {
    "A_log": (-1.0, 0.5),
    "D": (1.0, 0.3),
    "norm.weight": (1.0, 0.3),
    "dt_bias": (-3.0, 3.0),
}
"""The probe's mean and std for the mixer's own tensors: decays between 0.3 and 1,
skip and norm weights around 1, so that every part of the mixer matters; time-step
biases from -9 to 3, so that about one time step in ten falls below 0.001 and a
clamp the module applies (or not) shows."""


def projection_scale(module: nn.Module) -> str | None:
    """The module's own buffer, besides a Mamba-2 mixer's tensors, that could scale
    `in_proj`'s output feature by feature (Falcon-H1's `mup_vector`): one value
    per feature, computed when the module is built (not a weight the checkpoint
    holds). Whether it does is the probe's to prove."""
    features = getattr(getattr(module, "in_proj", None), "out_features", None)
    found = [
        name
        for name, buffer in module.named_buffers(recurse=False)
        if name in module._non_persistent_buffers_set
        and tuple(buffer.shape[-1:]) == (features,)
        and buffer.numel() == features
    ]
    return found[0] if len(found) == 1 else None


def mixer_dims(module: nn.Module) -> Mamba2Dims | str:
    """The module as `MambaMixer2` would be built for it, from its tensors' shapes
    and what it holds (the norm's group count not yet proven: the B/C groups'); or
    why it does not fit that layer."""
    in_proj, conv, out_proj = module.in_proj, module.conv1d, module.out_proj
    num_heads = module.A_log.shape[0]
    conv_dim, _, kernel = conv.weight.shape
    intermediate = out_proj.in_features
    n_groups = getattr(module, "n_groups", None)
    norm = module.norm
    gated_norm = next(norm.parameters(), None) is not None  # else an `nn.Identity`
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    activation = getattr(module, "activation", None)
    limit = getattr(module, "time_step_limit", (0.0, math.inf))
    try:
        limit = tuple(float(v) for v in limit)
    except (TypeError, ValueError):
        return f"its time-step limit {limit!r} is not two numbers"
    if {module.D.shape[0], module.dt_bias.shape[0]} != {num_heads}:
        return "its A_log, D and dt_bias do not hold one value per head each"
    if causal_depthwise_kernel(conv) is None:
        return "its conv1d is not a causal depthwise convolution"
    if in_proj.out_features != intermediate + conv_dim + num_heads:
        return (
            f"its in_proj gives {in_proj.out_features} features, not the gate, the "
            "convolution's input and one time step per head"
        )
    if out_proj.out_features != in_proj.in_features:
        return "its out_proj does not return the hidden size it takes"
    if (in_proj.bias is None) != (out_proj.bias is None):
        return "one of in_proj and out_proj has a bias and the other not"
    if not isinstance(n_groups, int) or n_groups < 1 or num_heads % n_groups:
        return f"its group count n_groups={n_groups!r} does not divide its heads"
    if intermediate % num_heads or (conv_dim - intermediate) % (2 * n_groups):
        return "its widths do not split into heads and B/C groups"
    if activation not in _ACTIVATIONS:
        return f"its convolution's activation is {activation!r}, not silu"
    if gated_norm and not isinstance(eps, float):
        return "its norm holds no epsilon"
    if len(limit) != 2 or not 0.0 <= limit[0] < limit[1]:
        return f"its time-step limit {limit} is no range of positive time steps"
    return Mamba2Dims(
        hidden_size=in_proj.in_features,
        intermediate_size=intermediate,
        num_heads=num_heads,
        head_dim=intermediate // num_heads,
        n_groups=n_groups,
        state_size=(conv_dim - intermediate) // (2 * n_groups),
        conv_kernel=kernel,
        use_conv_bias=conv.bias is not None,
        use_bias=in_proj.bias is not None,
        eps=eps if gated_norm else 1e-5,  # vLLM's, unused without a norm
        activation=activation,
        norm_groups=n_groups,
        time_step_limit=limit,
        gated_norm=gated_norm,
        projection_scale=projection_scale(module),
    )


@dataclass
class Mamba2MixerFuser(MixerFuser):
    """`out_proj(rmsnorm_G(ssd(silu(conv1d(xBC)), clamp(softplus(dt + dt_bias)), -exp(A_log), D) * silu(z)))`, `[z|xBC|dt] = in_proj(h * c) * s` -> vLLM's `MambaMixer2`.

    The module's shapes and what it holds (heads, groups, kernel, biases, eps,
    activation, time-step limit, chunk size, a norm or none, a buffer `s` scaling
    in_proj's features) say how vLLM's layer is built; a float64 probe of each
    instance, run against the module itself (a prefill, a prefill continued from its
    state, token-by-token decoding, through Transformers' cache), proves that layer
    computes the same, measures the constant `c` in_proj's input is scaled by, and
    finds over how many groups the gated norm normalises. The scales `c` and `s` are
    folded into in_proj's weights as they load. The module is then replaced by
    vLLM's layer under its own call signature (`mixers.Mamba2Mixer`), its states in
    vLLM's state cache. A mixer that differs is declined with why, and the backend
    refuses the model naming it (`refuse_state_beyond_keys_and_values`): its state
    would be lost."""

    kind = "mamba2"
    details_title = "State-space mixers, on vLLM's stateful layers"
    coverage = "mixers"

    @classmethod
    def could_match(cls, module: nn.Module) -> bool:
        # A gated delta net holds A_log and conv1d too, and no skip `D`.
        own = {name for name, _ in module.named_parameters(recurse=False)}
        return {"A_log", "D"} <= own and isinstance(
            getattr(module, "conv1d", None), nn.Conv1d
        )

    @classmethod
    def match(cls, graph: fx.Graph | None, module: nn.Module) -> Self | Declined | None:
        if not cls.could_match(module):
            return None
        own = {
            name
            for name, _ in itertools.chain(
                module.named_parameters(recurse=False), module.named_buffers(recurse=False)
            )
        }
        own.discard(projection_scale(module))
        children = {name for name, _ in module.named_children()}
        if own - _OWN_TENSORS or children - _CHILDREN:
            extra = sorted((own - _OWN_TENSORS) | (children - _CHILDREN))
            return cls.decline(
                module, f"it holds {extra}, which vLLM's MambaMixer2 has no place for"
            )
        if not _CHILDREN - {"act"} <= children or not own == _OWN_TENSORS:
            return cls.decline(module, "it lacks a part of a Mamba-2 mixer")
        if not all(
            isinstance(getattr(module, n), nn.Linear) for n in ("in_proj", "out_proj")
        ):
            return cls.decline(module, "its in_proj or out_proj is not a linear")
        if not hasattr(module, "layer_idx"):
            return cls.decline(module, "it has no layer_idx to find its state by")
        return cls()

    measure = staticmethod(mixer_dims)

    @staticmethod
    def prove(module: nn.Module, dims: Mamba2Dims) -> Mamba2Dims | str:
        return _prove(module, dims)

    def unfit(
        self, module: nn.Module, found: Mamba2Dims, vllm_config: "VllmConfig"
    ) -> str | None:
        chunk_size = getattr(module, "chunk_size", None)
        vllm_chunk = vllm_config.model_config.get_mamba_chunk_size()
        if chunk_size is not None and chunk_size != vllm_chunk:
            return (
                f"it scans in chunks of {chunk_size} tokens, and vLLM's Mamba-2 "
                f"metadata in chunks of {vllm_chunk} for every layer"
            )
        if current_platform.is_cpu() and vllm_config.cache_config.enable_prefix_caching:
            # Measured 2026-12-07 with vLLM 0.32, vLLM's native Mamba-2 models alike:
            # the CPU scan does not return the per-chunk states the prefix cache
            # keeps (`IndexError` in `MambaMixer2.conv_ssm_forward`).
            return (
                "with prefix caching on, vLLM's CPU engine fails in this layer on the "
                "first prompt longer than one cache block: serve it with "
                "enable_prefix_caching=False (--no-enable-prefix-caching)"
            )
        if found.scales_projection and vllm_config.quant_config is not None:
            return (
                "it scales in_proj's input or output, which the backend folds into "
                "in_proj's weights as they load; quantised weights cannot be scaled so"
            )
        tp = vllm_config.parallel_config.tensor_parallel_size
        if found.num_heads % tp or (found.n_groups % tp and found.n_groups != 1):
            return (
                f"its {found.num_heads} heads in {found.n_groups} groups do not "
                f"divide across {tp} tensor-parallel ranks as MambaMixer2 splits them"
            )
        return None

    def fuse(
        self, module: nn.Module, prefix: str, vllm_config: "VllmConfig"
    ) -> nn.Module:
        found = self.dims(module)
        assert isinstance(found, Mamba2Dims), found
        scale = None
        if found.projection_scale is not None:
            scale = module.get_buffer(found.projection_scale)
        return Mamba2Mixer(found, vllm_config, prefix, scale)

    def renamed_weights(self, prefix: str) -> dict[str, str]:
        # vLLM's layer keeps A = -exp(A_log), computed by the parameter's loader.
        return {f"{prefix}.A_log": f"{prefix}.A"}

    def report_detail(self, name: str, module: nn.Module) -> str:
        d: Mamba2Dims = module.dims
        parts = [
            f"{d.num_heads} heads of {d.head_dim}",
            f"{d.n_groups} B/C group(s) of state {d.state_size}",
            f"kernel {d.conv_kernel}",
            f"gated norm over {d.norm_groups} group(s)"
            if d.gated_norm
            else "silu gate, no norm",
        ]
        if d.clamps_time_steps:
            parts.append(f"time steps clamped to {d.time_step_limit}")
        scaled = [f"input x {d.input_scale:.4g}"] * (d.input_scale != 1.0)
        scaled += [f"output x {d.projection_scale}"] * (d.projection_scale is not None)
        if scaled:
            parts.append(f"in_proj {' and '.join(scaled)} (folded into its weights)")
        return (
            f"{name}: Mamba-2, {', '.join(parts)}; vLLM MambaMixer2, "
            f"{state_description(module, ('convolution', 'SSM'))}"
        )

    def info(self, name: str, module: nn.Module) -> str:
        return f"Fused: Mamba-2 mixer -> {self.report_detail(name, module)}"


def _prove(module: nn.Module, dims: Mamba2Dims) -> Mamba2Dims | str:
    """`dims` with the norm group count under which vLLM's layer computes what
    `module` does on the float64 probe, or why no count does."""
    values = dict(_PROBE_VALUES)
    if dims.projection_scale is not None:
        values[dims.projection_scale] = (1.0, 0.3)
    projected: list[torch.Tensor] = []
    hook = module.in_proj.register_forward_pre_hook(
        lambda _, args: projected.extend(args[:1])
    )
    try:
        tensors, x, outputs = probe_outputs(module, dims.hidden_size, values)
    finally:
        hook.remove()
    if isinstance(outputs, str):
        return outputs
    input_scale = _input_scale(projected, x)
    if input_scale is None:
        return "its in_proj does not take the mixer's input times one constant"
    worst = (math.inf, "")
    for groups in sorted({dims.n_groups, 1} if dims.gated_norm else {1}):
        candidate = Mamba2Dims(
            **{**vars(dims), "norm_groups": groups, "input_scale": input_scale}
        )
        reference = functools.partial(mamba2_reference, tensors, candidate)
        gap = first_gap(outputs, x, reference)
        if gap is None:
            return candidate
        worst = min(worst, gap)
    norm = (
        f"silu-gated RMSNorm over 1 or {dims.n_groups} groups"
        if dims.gated_norm
        else "a silu gate without a norm"
    )
    return (
        f"on a float64 probe vLLM's MambaMixer2 ({norm}, softplus time steps "
        f"clamped to {dims.time_step_limit}) differs from it "
        f"by {worst[0]:.3g} (relative) in {worst[1]}"
    )


def _input_scale(inputs: list[torch.Tensor], x: torch.Tensor) -> float | None:
    """The constant `c` with `in_proj`'s inputs on the probe equal to `c * x` (the
    probe's input, fed in segments), or `None` where there is none."""
    if not inputs or any(not isinstance(t, torch.Tensor) for t in inputs):
        return None
    seen = torch.cat([t.reshape(-1, x.shape[-1]) for t in inputs]).to(x.dtype)
    if seen.shape != x.shape:
        return None
    scale = float((seen * x).sum() / (x * x).sum())
    return scale if torch.allclose(seen, scale * x, rtol=1e-9, atol=1e-12) else None
