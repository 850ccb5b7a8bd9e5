# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The gated delta net (Qwen3-Next's, Qwen3.5's linear attention) on vLLM's
`QwenGatedDeltaNetAttention`, its states in vLLM's state cache."""

import functools
import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Self

import torch
from torch import fx, nn

from vllm.model_executor.models.transformers.fusers.base import (
    Declined,
    MixerFuser,
)
from vllm.model_executor.models.transformers.mixers import (
    GatedDeltaNetDims,
    GatedDeltaNetMixer,
    causal_depthwise_kernel,
    first_gap,
    gated_delta_net_reference,
    probe_outputs,
    state_description,
)
from vllm.model_executor.models.transformers.records import ShardId
from vllm.platforms import current_platform

if TYPE_CHECKING:
    from vllm.config import VllmConfig

_OWN_TENSORS = frozenset({"A_log", "dt_bias"})
_SHARED_CHILDREN = frozenset({"conv1d", "norm", "out_proj"})
_INTERLEAVED = frozenset({"in_proj_qkvz", "in_proj_ba"})
"""Qwen3-Next's input projections: each key head's q, k, v, z (and b, a) together."""
_SEPARATE: dict[str, tuple[str, ShardId]] = {
    "in_proj_qkv": ("in_proj_qkvz", (0, 1, 2)),
    "in_proj_z": ("in_proj_qkvz", 3),
    "in_proj_b": ("in_proj_ba", 0),
    "in_proj_a": ("in_proj_ba", 1),
}
"""Qwen3.5's input projections -> the shard of vLLM's merged linear each becomes."""
_ACTIVATIONS = frozenset({"silu", "swish"})
_OUTPUT_GATES = ("silu", "sigmoid")
"""The activations of `z` vLLM's gated norm takes; the probe finds which one."""
_PROBE_VALUES = {
    "A_log": (0.0, 0.5),
    "dt_bias": (0.0, 1.0),
    "norm.weight": (1.0, 0.3),
}
"""The probe's mean and std for the mixer's own tensors: decays per token between
about 0.05 and 0.95, norm weights around 1, so that every part of the mixer matters."""


def _linear(module: nn.Module, name: str) -> nn.Linear | None:
    child = getattr(module, name, None)
    return child if isinstance(child, nn.Linear) else None


def mixer_dims(module: nn.Module) -> GatedDeltaNetDims | str:
    """The module as `QwenGatedDeltaNetAttention` would be built for it, from its
    tensors' shapes and its key-head count (`num_k_heads`: the widths alone do not
    split the keys into heads), not yet proven; or why it does not fit that layer."""
    conv, out_proj, norm = module.conv1d, module.out_proj, module.norm
    kernel = causal_depthwise_kernel(conv)
    if kernel is None:
        return "its conv1d is not a causal depthwise convolution"
    num_v_heads = module.A_log.shape[0]
    value_dim, hidden = out_proj.in_features, out_proj.out_features
    key_dim, odd = divmod(conv.weight.shape[0] - value_dim, 2)
    num_k_heads = getattr(module, "num_k_heads", None)
    norm_weight = getattr(norm, "weight", None)
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    if module.dt_bias.shape != module.A_log.shape:
        return "its A_log and dt_bias do not hold one value per value head each"
    if value_dim % num_v_heads or odd or key_dim <= 0:
        return "its widths do not split into query, key and value heads"
    head_v_dim = value_dim // num_v_heads
    if not isinstance(num_k_heads, int) or num_k_heads < 1 or key_dim % num_k_heads:
        return f"its key-head count num_k_heads={num_k_heads!r} does not split its keys"
    if num_v_heads % num_k_heads:
        return f"its {num_v_heads} value heads do not share {num_k_heads} key heads"
    if not isinstance(norm_weight, torch.Tensor) or norm_weight.shape != (head_v_dim,):
        return f"its norm holds no weight of one value head's width ({head_v_dim})"
    if not isinstance(eps, float):
        return "its norm holds no epsilon"
    activation = getattr(module, "activation", None)
    if activation not in _ACTIVATIONS:
        return f"its convolution's activation is {activation!r}, not silu"
    interleaved = hasattr(module, "in_proj_qkvz")
    widths = (
        {"in_proj_qkvz": 2 * key_dim + 2 * value_dim, "in_proj_ba": 2 * num_v_heads}
        if interleaved
        else {
            "in_proj_qkv": 2 * key_dim + value_dim,
            "in_proj_z": value_dim,
            "in_proj_b": num_v_heads,
            "in_proj_a": num_v_heads,
        }
    )
    for name, width in widths.items():
        linear = _linear(module, name)
        if linear is None or (linear.in_features, linear.out_features) != (hidden, width):
            return f"its {name} is not a linear from {hidden} to {width} features"
    if any(
        child.bias is not None
        for child in (conv, out_proj, *(_linear(module, n) for n in widths))
    ):
        return "its convolution or a projection has a bias, which vLLM's layer has not"
    return GatedDeltaNetDims(
        hidden_size=hidden,
        num_k_heads=num_k_heads,
        num_v_heads=num_v_heads,
        head_k_dim=key_dim // num_k_heads,
        head_v_dim=head_v_dim,
        conv_kernel=kernel,
        eps=eps,
        interleaved=interleaved,
    )


@dataclass
class GatedDeltaNetFuser(MixerFuser):
    """`out_proj(rmsnorm(gdn(l2(q), l2(k), v, -exp(A_log) softplus(a + dt_bias), sigmoid(b))) * gate(z))`, `[q|k|v] = silu(conv1d(in_proj_qkv(h)))` -> vLLM's `QwenGatedDeltaNetAttention`.

    The module's shapes and key-head count say how vLLM's layer is built, and its
    children where the input projections keep their parts: one linear for each
    key head's q, k, v, z and one for its b, a (Qwen3-Next), or four linears
    (Qwen3.5, loaded as shards of vLLM's two merged ones). A float64 probe of each
    instance, run against the module itself (a prefill, a prefill continued from its
    state, token-by-token decoding, through Transformers' cache), proves that layer
    computes the same and finds the activation gating its output. The module is
    then replaced by vLLM's layer under its own call signature
    (`mixers.GatedDeltaNetMixer`), its states in vLLM's state cache. A mixer that
    differs is declined with why, and the backend refuses the model naming it
    (`refuse_state_beyond_keys_and_values`): its state would be lost."""

    kind = "gated_delta_net"
    details_title = "Gated delta nets, on vLLM's stateful layers"
    coverage = "mixers"

    separate: bool = False
    """Whether the input projections are Qwen3.5's four linears."""

    @classmethod
    def could_match(cls, module: nn.Module) -> bool:
        own = {name for name, _ in module.named_parameters(recurse=False)}
        return own >= _OWN_TENSORS and "D" not in own and isinstance(
            getattr(module, "conv1d", None), nn.Conv1d
        )

    @classmethod
    def match(cls, graph: fx.Graph | None, module: nn.Module) -> Self | Declined | None:
        if not cls.could_match(module):
            return None
        own = {
            name
            for name, _ in itertools.chain(
                module.named_parameters(recurse=False),
                module.named_buffers(recurse=False),
            )
        }
        children = {name for name, _ in module.named_children()}
        projections = children - _SHARED_CHILDREN
        if own != _OWN_TENSORS or projections not in (_INTERLEAVED, set(_SEPARATE)):
            extra = sorted((own - _OWN_TENSORS) | projections)
            return cls.decline(
                module,
                f"it holds {extra}, not the parts of vLLM's QwenGatedDeltaNetAttention "
                f"({sorted(_INTERLEAVED)} or {sorted(_SEPARATE)} beside "
                f"{sorted(_SHARED_CHILDREN | _OWN_TENSORS)})",
            )
        if not _SHARED_CHILDREN <= children or _linear(module, "out_proj") is None:
            return cls.decline(module, "it lacks a part of a gated delta net")
        if not hasattr(module, "layer_idx"):
            return cls.decline(module, "it has no layer_idx to find its state by")
        return cls(separate=projections == set(_SEPARATE))

    measure = staticmethod(mixer_dims)

    @staticmethod
    def prove(module: nn.Module, dims: GatedDeltaNetDims) -> GatedDeltaNetDims | str:
        return _prove(module, dims)

    def unfit(
        self, module: nn.Module, found: GatedDeltaNetDims, vllm_config: "VllmConfig"
    ) -> str | None:
        dtype = vllm_config.model_config.dtype
        if current_platform.is_cpu() and dtype != torch.bfloat16:
            return (
                f"vLLM's CPU kernels for it compute in bfloat16 only, and the model "
                f"is served in {str(dtype).removeprefix('torch.')}: serve it with "
                "dtype=bfloat16"
            )
        tp = vllm_config.parallel_config.tensor_parallel_size
        if found.num_k_heads % tp or found.num_v_heads % tp:
            return (
                f"its {found.num_k_heads} key and {found.num_v_heads} value heads do "
                f"not divide across {tp} tensor-parallel ranks"
            )
        return None

    def fuse(
        self, module: nn.Module, prefix: str, vllm_config: "VllmConfig"
    ) -> nn.Module:
        found = self.dims(module)
        assert isinstance(found, GatedDeltaNetDims), found
        return GatedDeltaNetMixer(found, vllm_config, prefix)

    @property
    def packed_modules_mapping(self) -> dict[str, list[str]]:
        if not self.separate:
            return {}
        packed: dict[str, list[str]] = {}
        for name, (merged, _) in _SEPARATE.items():
            packed.setdefault(merged, []).append(name)
        return packed

    def stacked_weights(self, prefix: str) -> dict[str, tuple[str, ShardId]]:
        if not self.separate:
            return {}
        return {
            f"{prefix}.{name}.": (f"{prefix}.{merged}.", shard)
            for name, (merged, shard) in _SEPARATE.items()
        }

    def report_detail(self, name: str, module: nn.Module) -> str:
        d: GatedDeltaNetDims = module.dims
        layout = "per key head (in_proj_qkvz, in_proj_ba)" if d.interleaved else (
            "in four linears, loaded as shards of in_proj_qkvz and in_proj_ba"
        )
        return (
            f"{name}: gated delta net, {d.num_k_heads} key heads of {d.head_k_dim}, "
            f"{d.num_v_heads} value heads of {d.head_v_dim}, kernel {d.conv_kernel}, "
            f"output gated by {d.output_gate}, projections {layout}; vLLM "
            f"QwenGatedDeltaNetAttention, "
            f"{state_description(module, ('convolution', 'recurrent'))}"
        )

    def info(self, name: str, module: nn.Module) -> str:
        return f"Fused: gated delta net -> {self.report_detail(name, module)}"


def _prove(module: nn.Module, dims: GatedDeltaNetDims) -> GatedDeltaNetDims | str:
    """`dims` with the output gate under which vLLM's layer computes what `module`
    does on the float64 probe, or why none does."""
    tensors, x, outputs = probe_outputs(module, dims.hidden_size, _PROBE_VALUES)
    if isinstance(outputs, str):
        return outputs
    worst = (float("inf"), "")
    for gate in _OUTPUT_GATES:
        candidate = GatedDeltaNetDims(**{**vars(dims), "output_gate": gate})
        reference = functools.partial(gated_delta_net_reference, tensors, candidate)
        gap = first_gap(outputs, x, reference)
        if gap is None:
            return candidate
        worst = min(worst, gap)
    return (
        "on a float64 probe vLLM's QwenGatedDeltaNetAttention (L2-normed q and k, "
        "the delta rule with decay -exp(A_log) softplus(a + dt_bias) and "
        "sigmoid(b), a per-head RMSNorm gated by silu or sigmoid of z) differs from "
        f"it by {worst[0]:.3g} (relative) in {worst[1]}"
    )
