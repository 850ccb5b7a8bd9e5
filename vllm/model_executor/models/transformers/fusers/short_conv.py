# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The short-convolution mixer (LFM2's) on vLLM's `ShortConv`, its state in vLLM's
state cache."""

import functools
import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Self

from torch import fx, nn

from vllm.model_executor.models.transformers.fusers.base import (
    Declined,
    MixerFuser,
)
from vllm.model_executor.models.transformers.mixers import (
    ShortConvDims,
    ShortConvMixer,
    causal_depthwise_kernel,
    first_gap,
    probe_outputs,
    short_conv_reference,
    state_description,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig

_CHILDREN = frozenset({"in_proj", "conv", "out_proj"})


def mixer_dims(module: nn.Module) -> ShortConvDims | str:
    """The module as `ShortConv` would be built for it, from its tensors' shapes
    (not yet proven); or why it does not fit that layer."""
    in_proj, conv, out_proj = module.in_proj, module.conv, module.out_proj
    channels, _, kernel = conv.weight.shape
    hidden = in_proj.in_features
    if causal_depthwise_kernel(conv) is None:
        return "its conv is not a causal depthwise convolution"
    if kernel < 2:
        return f"its convolution's kernel of {kernel} keeps no state"
    out_widths = (out_proj.in_features, out_proj.out_features)
    if (in_proj.out_features, channels, *out_widths) != (3 * hidden, *[hidden] * 3):
        return (
            f"its widths (in_proj {hidden} -> {in_proj.out_features}, conv "
            f"{channels} channels, out_proj {out_proj.in_features} -> "
            f"{out_proj.out_features}) are not the hidden size, and three times it "
            "for in_proj's B, C and x, as vLLM's ShortConv has them"
        )
    biases = {part.bias is not None for part in (in_proj, conv, out_proj)}
    if len(biases) != 1:
        return "some of in_proj, conv and out_proj have a bias and others not"
    return ShortConvDims(hidden_size=hidden, conv_kernel=kernel, use_bias=biases.pop())


@dataclass
class ShortConvFuser(MixerFuser):
    """`out_proj(C * conv(B * x))`, `[B|C|x] = in_proj(h)` -> vLLM's `ShortConv`.

    The module's shapes (width, kernel, biases) say how vLLM's layer is built; a
    float64 probe of each instance, run against the module itself (a prefill, a
    prefill continued from its state, token-by-token decoding, through Transformers'
    cache), proves that layer computes the same: the split of `in_proj` into B, C
    and x in that order, the gating, no activation. The module is then replaced by
    vLLM's layer under its own call signature (`mixers.ShortConvMixer`), its
    convolution state in vLLM's state cache. A mixer that differs is declined with
    why, and the backend refuses the model naming it
    (`refuse_state_beyond_keys_and_values`): its state would be lost."""

    kind = "short_conv"
    details_title = "Short convolutions, on vLLM's stateful layers"
    coverage = "mixers"

    @classmethod
    def could_match(cls, module: nn.Module) -> bool:
        return isinstance(getattr(module, "conv", None), nn.Conv1d) and all(
            isinstance(getattr(module, name, None), nn.Linear)
            for name in ("in_proj", "out_proj")
        )

    @classmethod
    def match(cls, graph: fx.Graph | None, module: nn.Module) -> Self | Declined | None:
        if not cls.could_match(module):
            return None
        parts = itertools.chain(
            module.named_parameters(recurse=False),
            module.named_buffers(recurse=False),
            module.named_children(),
        )
        extra = sorted({name for name, _ in parts} - _CHILDREN)
        if extra:
            return cls.decline(
                module, f"it holds {extra}, which vLLM's ShortConv has no place for"
            )
        if not hasattr(module, "layer_idx"):
            return cls.decline(module, "it has no layer_idx to find its state by")
        return cls()

    measure = staticmethod(mixer_dims)

    @staticmethod
    def prove(module: nn.Module, dims: ShortConvDims) -> ShortConvDims | str:
        return _prove(module, dims)

    def unfit(
        self, module: nn.Module, found: ShortConvDims, vllm_config: "VllmConfig"
    ) -> str | None:
        tp = vllm_config.parallel_config.tensor_parallel_size
        if found.hidden_size % tp:
            return (
                f"its width {found.hidden_size} does not divide across {tp} "
                "tensor-parallel ranks as ShortConv splits its channels"
            )
        return None

    def fuse(
        self, module: nn.Module, prefix: str, vllm_config: "VllmConfig"
    ) -> nn.Module:
        found = self.dims(module)
        assert isinstance(found, ShortConvDims), found
        return ShortConvMixer(found, module.layer_idx, vllm_config, prefix)

    def report_detail(self, name: str, module: nn.Module) -> str:
        d: ShortConvDims = module.dims
        return (
            f"{name}: short convolution, width {d.hidden_size}, kernel "
            f"{d.conv_kernel}, {'with' if d.use_bias else 'no'} biases; vLLM "
            f"ShortConv, {state_description(module, ('convolution',))}"
        )

    def info(self, name: str, module: nn.Module) -> str:
        return f"Fused: short convolution -> {self.report_detail(name, module)}"


def _prove(module: nn.Module, dims: ShortConvDims) -> ShortConvDims | str:
    """`dims` where vLLM's layer computes what `module` does on the float64 probe,
    else where and by how much it differs."""
    tensors, x, outputs = probe_outputs(module, dims.hidden_size, {})
    if isinstance(outputs, str):
        return outputs
    gap = first_gap(outputs, x, functools.partial(short_conv_reference, tensors, dims))
    if gap is None:
        return dims
    return (
        "on a float64 probe vLLM's ShortConv (out_proj(C * conv(B * x)), "
        f"[B|C|x] = in_proj(h), no activation) differs from it by {gap[0]:.3g} "
        f"(relative) in {gap[1]}"
    )
