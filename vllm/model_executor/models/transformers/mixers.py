# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""State-space mixers on vLLM's stateful layers (see docs/hybrid.md).

A Transformers hybrid decoder layer calls its mixer as
`mixer(hidden_states, cache_params=..., attention_mask=..., **kwargs)` (or
`past_key_values=...`), keeping the mixer's convolution and recurrent states in
Transformers' cache. The backend runs the HF model without that cache, so a mixer
the fusers prove equal to vLLM's layer is replaced, in place, by that layer under the
HF call signature (`Mamba2Mixer`, `ShortConvMixer`, `GatedDeltaNetMixer`): it ignores Transformers' cache
and mask (vLLM hands the batch's sequences and each one's state slot to the layer
through its forward context) and keeps its states in vLLM's state cache, sized per
sequence by the model class (`hybrid.py`).

`mamba2_reference`, `short_conv_reference` and `gated_delta_net_reference` are what
vLLM's `MambaMixer2`, `ShortConv` and `QwenGatedDeltaNetAttention` compute, written
as plain recurrences, in whatever dtype they are given.
The fusers prove a module with one probe (`probe_outputs`, `first_gap`): the module
itself, in float64 through Transformers' cache, on a prefill, a prefill continued
from its state (vLLM's chunked prefill) and token-by-token decoding, against the
reference."""

import inspect
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING, TypeAlias

import torch
import torch.nn.functional as F
from torch import nn
from transformers.cache_utils import Cache, LinearAttentionLayer

from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import (
    QwenGatedDeltaNetAttention,
)
from vllm.model_executor.layers.mamba.mamba_mixer2 import (
    MambaMixer2,
    Mixer2RMSNormGated,
)
from vllm.model_executor.layers.mamba.mamba_utils import (
    MambaStateDtypeCalculator,
    MambaStateShapeCalculator,
)
from vllm.model_executor.layers.mamba.short_conv import ShortConv
from vllm.model_executor.models.transformers.attention_bridge import CACHE_PARAMETERS

if TYPE_CHECKING:
    from vllm.config import VllmConfig


@dataclass(frozen=True)
class Mamba2Dims:
    """A Mamba-2 mixer as vLLM's `MambaMixer2` is built for it, read off the HF
    module (its tensors' shapes and what it holds) and proven by the probe."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    head_dim: int
    n_groups: int
    state_size: int
    conv_kernel: int
    use_conv_bias: bool
    use_bias: bool
    eps: float
    activation: str
    norm_groups: int
    """How many groups the gated RMSNorm normalises separately: 1 (Granite 4.0,
    Bamba, Mamba-2) or the B/C group count (Nemotron-H, Zamba2)."""
    time_step_limit: tuple[float, float] = (0.0, math.inf)
    """What the time steps `softplus(dt + dt_bias)` are clamped to (Nemotron-H and
    Zamba2 raise them to `time_step_min`)."""
    gated_norm: bool = True
    """Whether `y * silu(z)` is normalised (Falcon-H1's `mamba_rms_norm=False`
    mixers hold no norm)."""
    input_scale: float = 1.0
    """What the module multiplies its input by before `in_proj` (Falcon-H1's
    `ssm_in_multiplier`), measured on the probe."""
    projection_scale: str | None = None
    """The module's buffer that multiplies `in_proj`'s output feature by feature
    (Falcon-H1's `mup_vector`), by name; `None` where there is none."""

    @property
    def clamps_time_steps(self) -> bool:
        return self.time_step_limit != (0.0, math.inf)

    @property
    def scales_projection(self) -> bool:
        return self.input_scale != 1.0 or self.projection_scale is not None

    @property
    def conv_dim(self) -> int:
        return self.intermediate_size + 2 * self.n_groups * self.state_size

    def state_elements(self) -> tuple[int, int]:
        """Elements of one sequence's convolution and SSM state (all ranks)."""
        return (
            self.conv_dim * (self.conv_kernel - 1),
            self.num_heads * self.head_dim * self.state_size,
        )

    def state_shape(self, tp_size: int, num_spec: int) -> tuple[tuple[int, ...], ...]:
        """One sequence's states on each of `tp_size` ranks, as the layer asks."""
        return MambaStateShapeCalculator.mamba2_state_shape(
            tp_world_size=tp_size,
            intermediate_size=self.intermediate_size,
            n_groups=self.n_groups,
            num_heads=self.num_heads,
            head_dim=self.head_dim,
            state_size=self.state_size,
            conv_kernel=self.conv_kernel,
            num_spec=num_spec,
        )

    @staticmethod
    def state_dtype(vllm_config: "VllmConfig") -> tuple[torch.dtype, ...]:
        cache = vllm_config.cache_config
        return MambaStateDtypeCalculator.mamba2_state_dtype(
            vllm_config.model_config.dtype,
            cache.mamba_cache_dtype,
            cache.mamba_ssm_cache_dtype,
        )


@dataclass(frozen=True)
class ShortConvDims:
    """A short-convolution mixer as vLLM's `ShortConv` is built for it: one width
    for the hidden state, the convolution's channels and each of `in_proj`'s three
    parts; one bias flag for the three."""

    hidden_size: int
    conv_kernel: int
    use_bias: bool

    def state_elements(self) -> tuple[int]:
        """Elements of one sequence's convolution state (all ranks)."""
        return (self.hidden_size * (self.conv_kernel - 1),)

    def state_shape(self, tp_size: int, num_spec: int) -> tuple[tuple[int, ...], ...]:
        """One sequence's state on each of `tp_size` ranks, as the layer asks."""
        return MambaStateShapeCalculator.short_conv_state_shape(
            tp_world_size=tp_size,
            intermediate_size=self.hidden_size,
            conv_kernel=self.conv_kernel,
            num_spec=num_spec,
        )

    @staticmethod
    def state_dtype(vllm_config: "VllmConfig") -> tuple[torch.dtype, ...]:
        return MambaStateDtypeCalculator.short_conv_state_dtype(
            vllm_config.model_config.dtype, vllm_config.cache_config.mamba_cache_dtype
        )


@dataclass(frozen=True)
class GatedDeltaNetDims:
    """A gated delta net (Qwen3-Next's, Qwen3.5's) as vLLM's
    `QwenGatedDeltaNetAttention` is built for it: key heads shared by groups of
    value heads, a causal convolution over `[q | k | v]`, and where the input
    projections keep their parts (`interleaved`: Qwen3-Next's `in_proj_qkvz` and
    `in_proj_ba`, each key head's q, k, v, z (and b, a) side by side; else
    Qwen3.5's four linears)."""

    hidden_size: int
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int
    eps: float
    interleaved: bool
    output_gate: str = "silu"
    """The activation of `z` that gates the normalised output (`silu`, `sigmoid`),
    found by the probe."""

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    def state_elements(self) -> tuple[int, int]:
        """Elements of one sequence's convolution and recurrent state (all ranks)."""
        return (
            self.conv_dim * (self.conv_kernel - 1),
            self.num_v_heads * self.head_k_dim * self.head_v_dim,
        )

    def state_shape(self, tp_size: int, num_spec: int) -> tuple[tuple[int, ...], ...]:
        """One sequence's states on each of `tp_size` ranks, as the layer asks."""
        return MambaStateShapeCalculator.gated_delta_net_state_shape(
            tp_size,
            self.num_k_heads,
            self.num_v_heads,
            self.head_k_dim,
            self.head_v_dim,
            self.conv_kernel,
            num_spec,
        )

    @staticmethod
    def state_dtype(vllm_config: "VllmConfig") -> tuple[torch.dtype, ...]:
        cache = vllm_config.cache_config
        return MambaStateDtypeCalculator.gated_delta_net_state_dtype(
            vllm_config.model_config.dtype,
            cache.mamba_cache_dtype,
            cache.mamba_ssm_cache_dtype,
        )


MixerDims: TypeAlias = Mamba2Dims | ShortConvDims | GatedDeltaNetDims
"""How one of vLLM's stateful layers is built for a mixer, and its state's size."""


class Mamba2Mixer(MambaMixer2):
    """vLLM's `MambaMixer2` called the way a Transformers decoder layer calls its
    Mamba-2 mixer: `(hidden_states [batch 1, tokens, hidden], cache_params=...,
    attention_mask=..., **kwargs)`. Transformers' cache and mask are not read (the
    backend passes neither; vLLM's forward context carries each sequence's state)."""

    def __init__(
        self,
        dims: Mamba2Dims,
        vllm_config: "VllmConfig",
        prefix: str,
        projection_scale: torch.Tensor | None = None,
    ):
        super().__init__(
            hidden_size=dims.hidden_size,
            ssm_state_size=dims.state_size,
            conv_kernel_size=dims.conv_kernel,
            intermediate_size=dims.intermediate_size,
            use_conv_bias=dims.use_conv_bias,
            use_bias=dims.use_bias,
            n_groups=dims.n_groups,
            num_heads=dims.num_heads,
            head_dim=dims.head_dim,
            rms_norm_eps=dims.eps,
            activation=dims.activation,
            use_rms_norm=dims.gated_norm,
            model_config=vllm_config.model_config,
            cache_config=vllm_config.cache_config,
            quant_config=vllm_config.quant_config,
            prefix=prefix,
        )
        self.dims = dims
        if dims.gated_norm and dims.norm_groups != dims.n_groups:
            # vLLM builds the norm with the B/C groups; the module normalises
            # over another count (proven by the probe).
            self.norm = Mixer2RMSNormGated(
                dims.intermediate_size, dims.norm_groups, eps=dims.eps
            )
        self.time_step_preimage = tuple(map(_softplus_preimage, dims.time_step_limit))
        if dims.scales_projection:
            self._fold_into_in_proj(projection_scale)

    def _fold_into_in_proj(self, projection_scale: torch.Tensor | None) -> None:
        """Load `in_proj` so that it computes what the module computes around it,
        `in_proj(x * input_scale) * projection_scale`: its checkpoint weight's rows
        multiplied by `input_scale * projection_scale`, its bias by
        `projection_scale`, before vLLM's loaders split them across the ranks. The
        scales cost nothing per step, and the per-rank layout stays the loaders'."""
        d = self.dims
        features = d.intermediate_size + d.conv_dim + d.num_heads  # the checkpoint's
        per_feature = (
            torch.ones(features) if projection_scale is None else projection_scale
        )
        for param, input_scale in ((self.in_proj.weight, d.input_scale),
                                   (self.in_proj.bias, 1.0)):  # fmt: skip
            if param is not None:
                param.weight_loader = _scaled_rows(
                    param.weight_loader, per_feature, input_scale
                )

    def conv_ssm_forward(
        self, projected_states: torch.Tensor, output: torch.Tensor
    ) -> None:
        """vLLM's convolution and scan (run inside its custom op, where the batch's
        metadata is known), the prefill tokens' time steps clamped first.

        Transformers' mixers, like mamba_ssm's kernels, clamp the time steps in
        their chunked scan (a prompt) and not in single-token decoding; vLLM's
        kernels never clamp. The time step is `softplus(dt + dt_bias)` and softplus
        rises monotonically, so clamping `dt + dt_bias` to the limit's preimage
        clamps it. vLLM puts the decode tokens first. It runs a prompt's tokens as
        prefill tokens, except a chunk of one token that continues a sequence's
        state (the last of a chunked or prefix-cached prompt), which takes its
        decoding path: unclamped here, as Transformers computes one token fed with
        its cache."""
        if self.dims.clamps_time_steps:
            metadata = get_forward_context().attn_metadata
            metadata = metadata.get(self.prefix) if isinstance(metadata, dict) else None
            if metadata is not None and metadata.num_prefills:
                projected_states = self._clamp_time_steps(
                    projected_states, metadata.num_decode_tokens
                )
        super().conv_ssm_forward(projected_states, output)

    def _clamp_time_steps(
        self, projected_states: torch.Tensor, first: int
    ) -> torch.Tensor:
        """`projected_states` (`[z | xBC | dt]`, this rank's share) with the `dt` of
        tokens `first:` clamped so that `dt + dt_bias` lies in the limit's
        preimage."""
        low, high = self.time_step_preimage
        heads = self.dt_bias.shape[0]
        dt_bias = self.dt_bias.to(projected_states.dtype)
        clamped = projected_states.clone()
        clamped[first:, -heads:] = torch.clamp(
            projected_states[first:, -heads:], min=low - dt_bias, max=high - dt_bias
        )
        return clamped

    def forward(
        self,
        hidden_states: torch.Tensor,
        cache_params: object = None,
        attention_mask: torch.Tensor | None = None,
        **kwargs: object,
    ) -> torch.Tensor:
        flat = hidden_states.reshape(-1, hidden_states.shape[-1])
        return super().forward(flat).view(hidden_states.shape)


class ShortConvMixer(ShortConv):
    """vLLM's `ShortConv` called the way a Transformers decoder layer calls its
    short convolution (LFM2's): `(hidden_states [batch 1, tokens, hidden],
    past_key_values=..., attention_mask=..., **kwargs)`, returning the output vLLM's
    layer writes. Transformers' cache and mask are not read."""

    def __init__(
        self,
        dims: ShortConvDims,
        layer_idx: int,
        vllm_config: "VllmConfig",
        prefix: str,
    ):
        super().__init__(
            # The two config fields vLLM's layer reads.
            config=SimpleNamespace(
                conv_L_cache=dims.conv_kernel, conv_bias=dims.use_bias
            ),
            dim=dims.hidden_size,
            layer_idx=layer_idx,
            model_config=vllm_config.model_config,
            cache_config=vllm_config.cache_config,
            quant_config=vllm_config.quant_config,
            prefix=prefix,
        )
        self.dims = dims

    def forward(
        self,
        hidden_states: torch.Tensor,
        past_key_values: object = None,
        attention_mask: torch.Tensor | None = None,
        **kwargs: object,
    ) -> torch.Tensor:
        flat = hidden_states.reshape(-1, hidden_states.shape[-1])
        output = torch.empty_like(flat)
        super().forward(flat, output)
        return output.view(hidden_states.shape)


class GatedDeltaNetMixer(QwenGatedDeltaNetAttention):
    """vLLM's `QwenGatedDeltaNetAttention` called the way a Transformers decoder
    layer calls its gated delta net: `(hidden_states [batch 1, tokens, hidden],
    cache_params=..., attention_mask=..., **kwargs)`. vLLM's layer reads its sizes
    from a model config; it is given the fields it reads, from the proven dims."""

    def __init__(self, dims: GatedDeltaNetDims, vllm_config: "VllmConfig", prefix: str):
        config = SimpleNamespace(
            hidden_size=dims.hidden_size,
            hidden_act="silu",  # the convolution's activation
            rms_norm_eps=dims.eps,
            linear_num_key_heads=dims.num_k_heads,
            linear_num_value_heads=dims.num_v_heads,
            linear_key_head_dim=dims.head_k_dim,
            linear_value_head_dim=dims.head_v_dim,
            linear_conv_kernel_dim=dims.conv_kernel,
            output_gate_type=dims.output_gate,
        )
        super().__init__(
            config, vllm_config, prefix, gqa_interleaved_layout=dims.interleaved
        )
        self.dims = dims

    def forward(
        self,
        hidden_states: torch.Tensor,
        cache_params: object = None,
        attention_mask: torch.Tensor | None = None,
        **kwargs: object,
    ) -> torch.Tensor:
        flat = hidden_states.reshape(-1, hidden_states.shape[-1])
        return super().forward(flat).view(hidden_states.shape)


def _scaled_rows(load: Callable, scale: torch.Tensor, factor: float) -> Callable:
    """`load`, given the checkpoint tensor with its rows multiplied by `factor` and
    by `scale` (one value per row, read as the weights load: the report builds
    modules on `meta`), the whole tensor, before the loader takes this rank's share."""

    def scaled(
        param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None
    ) -> None:
        rows = scale.detach().reshape(-1)
        if shard_id is not None or loaded.shape[0] != rows.shape[0]:
            raise ValueError(
                f"in_proj's checkpoint tensor {list(loaded.shape)} is not the whole "
                f"projection of {rows.shape[0]} features, which the backend scales "
                "feature by feature as it loads"
            )
        rows = rows.to(loaded.device, torch.float64) * factor
        wide = loaded.to(torch.float64) * rows.view(-1, *[1] * (loaded.ndim - 1))
        load(param, wide.to(loaded.dtype))

    return scaled


def state_description(layer: MambaBase, parts: tuple[str, ...]) -> str:
    """`state N bytes per sequence on each rank (part [shape] dtype, ...)`: the
    state `layer` asks of vLLM's state cache, its parts named by `parts`."""
    shapes, dtypes = layer.get_state_shape(), layer.get_state_dtype()
    size = sum(math.prod(s) * t.itemsize for s, t in zip(shapes, dtypes))
    states = ", ".join(
        f"{part} {list(s)} {str(t).removeprefix('torch.')}"
        for part, s, t in zip(parts, shapes, dtypes)
    )
    return f"state {size} bytes per sequence on each rank ({states})"


State: TypeAlias = tuple[torch.Tensor, ...]
Reference: TypeAlias = Callable[
    [torch.Tensor, State | None], tuple[torch.Tensor, State]
]
"""One sequence's tokens and the state before them -> output, state after them."""


def _softplus_preimage(value: float) -> float:
    """The `x` with `softplus(x) == value` (`-inf` for 0, `inf` for `inf`)."""
    if value == 0.0:
        return -math.inf
    if math.isinf(value):
        return math.inf
    return value + math.log(-math.expm1(-value))


def causal_depthwise_kernel(conv: nn.Conv1d) -> int | None:
    """The kernel size of `conv` where it is a causal depthwise convolution (one
    filter per channel, padded by `kernel - 1` so that each output sees only its
    token and those before), as vLLM's causal convolution computes; else `None`."""
    channels, _, kernel = conv.weight.shape
    causal = (channels, (1,), (1,), (kernel - 1,))
    if (conv.groups, conv.stride, conv.dilation, conv.padding) != causal:
        return None
    return kernel


def _causal_conv(
    history: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """A causal depthwise convolution of `history` ([state + tokens, channels], the
    state being its first `kernel - 1` rows) with a `[channels, 1, kernel]` weight:
    one output per token."""
    windows = history.unfold(0, weight.shape[-1], 1)  # [tokens, channels, kernel]
    out = (windows * weight[:, 0, :]).sum(-1)
    return out if bias is None else out + bias


def _last_inputs(history: torch.Tensor, kernel: int) -> torch.Tensor:
    return history[history.shape[0] - (kernel - 1) :]


def mamba2_reference(
    tensors: dict[str, torch.Tensor],
    dims: Mamba2Dims,
    x: torch.Tensor,
    state: State | None = None,
) -> tuple[torch.Tensor, State]:
    """What `MambaMixer2` computes for one sequence's tokens `x` ([tokens, hidden])
    from `state` (the last `conv_kernel - 1` convolution inputs, the SSM state;
    zeros when `None`), with the HF module's tensors by their HF names. Returns the
    output and the state after the last token.

    `in_proj(x * input_scale) * projection_scale = [z | x B C | dt]` (the
    scales 1 where the module has none); `x B C` through the causal depthwise
    convolution and the activation; `dt = softplus(dt + dt_bias)`, clamped to
    `time_step_limit` in a prefill (a first call, or more than one token), not in
    a decoding step, as Transformers' chunked scan and single-token update do;
    `h = exp(dt A) h + dt x B^T`, `y = h C + D x` with `A = -exp(A_log)` per head
    and B, C shared by the heads of a group; `out_proj(rmsnorm(y * silu(z)))`, the
    norm over `norm_groups` groups (`out_proj(y * silu(z))` without `gated_norm`)."""
    d = dims
    conv_dim, width = d.conv_dim, d.n_groups * d.state_size
    tokens = x.shape[0]
    prefill = state is None or tokens > 1
    if state is None:
        state = (
            x.new_zeros(d.conv_kernel - 1, conv_dim),
            x.new_zeros(d.num_heads, d.head_dim, d.state_size),
        )
    conv_state, ssm_state = state
    projected = F.linear(
        x * d.input_scale, tensors["in_proj.weight"], tensors.get("in_proj.bias")
    )
    if d.projection_scale is not None:
        projected = projected * tensors[d.projection_scale].reshape(-1)
    z, xbc, dt = projected.split([d.intermediate_size, conv_dim, d.num_heads], -1)
    history = torch.cat([conv_state, xbc])
    conv = F.silu(
        _causal_conv(
            history,
            tensors["conv1d.weight"],
            tensors["conv1d.bias"] if d.use_conv_bias else None,
        )
    )
    xs, B, C = conv.split([d.intermediate_size, width, width], -1)
    per_group = d.num_heads // d.n_groups
    xs = xs.view(tokens, d.num_heads, d.head_dim)
    B = B.view(tokens, d.n_groups, d.state_size).repeat_interleave(per_group, 1)
    C = C.view(tokens, d.n_groups, d.state_size).repeat_interleave(per_group, 1)
    dt = F.softplus(dt + tensors["dt_bias"])
    if prefill:
        dt = dt.clamp(*d.time_step_limit)
    A = -torch.exp(tensors["A_log"])
    D = tensors["D"]
    h = ssm_state
    ys = []
    for t in range(tokens):
        decay = torch.exp(dt[t] * A)[:, None, None]
        h = h * decay + (dt[t][:, None] * xs[t])[:, :, None] * B[t][:, None, :]
        ys.append((h * C[t][:, None, :]).sum(-1) + D[:, None] * xs[t])
    y = torch.stack(ys).reshape(tokens, d.intermediate_size) * F.silu(z)
    if d.gated_norm:
        grouped = y.view(tokens, d.norm_groups, -1)
        grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + d.eps)
        y = grouped.reshape(tokens, d.intermediate_size) * tensors["norm.weight"]
    out = F.linear(y, tensors["out_proj.weight"], tensors.get("out_proj.bias"))
    return out, (_last_inputs(history, d.conv_kernel), h)


def short_conv_reference(
    tensors: dict[str, torch.Tensor],
    dims: ShortConvDims,
    x: torch.Tensor,
    state: State | None = None,
) -> tuple[torch.Tensor, State]:
    """What `ShortConv` computes for one sequence's tokens `x` ([tokens, hidden])
    from `state` (the last `conv_kernel - 1` convolution inputs; zeros when `None`),
    with the HF module's tensors by their HF names: `[B | C | x] = in_proj(h)`,
    `out_proj(C * conv(B * x))`, the convolution causal and depthwise, with its bias
    and no activation. Returns the output and the state after the last token."""
    (conv_state,) = state or (x.new_zeros(dims.conv_kernel - 1, dims.hidden_size),)
    B, C, xs = F.linear(
        x, tensors["in_proj.weight"], tensors.get("in_proj.bias")
    ).chunk(3, -1)
    history = torch.cat([conv_state, B * xs])
    conv = _causal_conv(history, tensors["conv.weight"], tensors.get("conv.bias"))
    out = F.linear(C * conv, tensors["out_proj.weight"], tensors.get("out_proj.bias"))
    return out, (_last_inputs(history, dims.conv_kernel),)


def _l2_normed(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)


def gated_delta_net_reference(
    tensors: dict[str, torch.Tensor],
    dims: GatedDeltaNetDims,
    x: torch.Tensor,
    state: State | None = None,
) -> tuple[torch.Tensor, State]:
    """What `QwenGatedDeltaNetAttention` computes for one sequence's tokens `x`
    ([tokens, hidden]) from `state` (the last `conv_kernel - 1` convolution inputs,
    the recurrent state per value head, `[head_k_dim, head_v_dim]`; zeros when
    `None`), with the HF module's tensors by their HF names. Returns the output and
    the state after the last token.

    `[q | k | v]`, `z`, `b`, `a` from the input projections (per key head where
    `interleaved`); `q k v` through the causal depthwise convolution and silu; q and
    k L2-normed per head (q also by `head_k_dim ** -0.5`) and shared by
    `num_v_heads / num_k_heads` value heads each; `g = -exp(A_log) softplus(a +
    dt_bias)`, `beta = sigmoid(b)`; per token `S = exp(g) S`, `S += k (beta (v - k
    S))^T`, `o = q S`; `out_proj(rmsnorm(o) * norm.weight * gate(z))` per value
    head."""
    d = dims
    tokens, ratio = x.shape[0], d.num_v_heads // d.num_k_heads
    if state is None:
        state = (
            x.new_zeros(d.conv_kernel - 1, d.conv_dim),
            x.new_zeros(d.num_v_heads, d.head_k_dim, d.head_v_dim),
        )
    conv_state, recurrent = state
    if d.interleaved:
        per_head = F.linear(x, tensors["in_proj_qkvz.weight"]).view(
            tokens, d.num_k_heads, -1
        )
        q, k, v, z = per_head.split(
            [d.head_k_dim, d.head_k_dim, ratio * d.head_v_dim, ratio * d.head_v_dim],
            -1,
        )
        qkv = torch.cat([part.reshape(tokens, -1) for part in (q, k, v)], -1)
        z = z.reshape(tokens, d.value_dim)
        b, a = F.linear(x, tensors["in_proj_ba.weight"]).view(
            tokens, d.num_k_heads, -1
        ).split([ratio, ratio], -1)
        b, a = b.reshape(tokens, -1), a.reshape(tokens, -1)
    else:
        qkv = F.linear(x, tensors["in_proj_qkv.weight"])
        z = F.linear(x, tensors["in_proj_z.weight"])
        b = F.linear(x, tensors["in_proj_b.weight"])
        a = F.linear(x, tensors["in_proj_a.weight"])
    history = torch.cat([conv_state, qkv])
    conv = F.silu(_causal_conv(history, tensors["conv1d.weight"], None))
    q, k, v = conv.split([d.key_dim, d.key_dim, d.value_dim], -1)
    q = _l2_normed(q.view(tokens, d.num_k_heads, d.head_k_dim)) * d.head_k_dim**-0.5
    k = _l2_normed(k.view(tokens, d.num_k_heads, d.head_k_dim))
    q, k = q.repeat_interleave(ratio, 1), k.repeat_interleave(ratio, 1)
    v = v.view(tokens, d.num_v_heads, d.head_v_dim)
    decay = torch.exp(-torch.exp(tensors["A_log"]) * F.softplus(a + tensors["dt_bias"]))
    beta = torch.sigmoid(b)
    S = recurrent
    outputs = []
    for t in range(tokens):
        S = S * decay[t][:, None, None]
        remembered = (S * k[t][:, :, None]).sum(1)  # [heads, head_v_dim]
        update = (v[t] - remembered) * beta[t][:, None]
        S = S + k[t][:, :, None] * update[:, None, :]
        outputs.append((S * q[t][:, :, None]).sum(1))
    o = torch.stack(outputs)  # [tokens, heads, head_v_dim]
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + d.eps) * tensors["norm.weight"]
    gate = z.view(tokens, d.num_v_heads, d.head_v_dim)
    o = o * (F.silu(gate) if d.output_gate == "silu" else torch.sigmoid(gate))
    out = F.linear(o.reshape(tokens, d.value_dim), tensors["out_proj.weight"])
    return out, (_last_inputs(history, d.conv_kernel), S)


PROBE_SEGMENTS = (5, 3, 1, 1)
"""The probe's calls: a prefill, a prefill continued from its state (vLLM's chunked
prefill), then token-by-token decoding."""
PROBE_RTOL = 1e-4
"""Relative to the output's scale. Transformers' Mamba-2 scan computes in float32
even on a float64 probe; any other gating, norm or recurrence is off by 1e-1 or more."""


def probe_outputs(
    module: nn.Module, hidden_size: int, values: dict[str, tuple[float, float]]
) -> tuple[dict[str, torch.Tensor], torch.Tensor, list[torch.Tensor] | str]:
    """The probe of `module`: float64 values for every tensor of it (normal, with
    the mean and std `values` names for a tensor, else around 0 and scaled by its
    fan-in), an input of `PROBE_SEGMENTS` tokens, and the module's outputs for it
    fed in those segments, its state kept in Transformers' cache between calls; or
    why it cannot be run so."""
    generator = torch.Generator().manual_seed(0)

    def normal(shape: torch.Size, mean: float, std: float) -> torch.Tensor:
        return mean + std * torch.randn(shape, generator=generator, dtype=torch.float64)

    tensors = {}
    named = itertools.chain(module.named_parameters(), module.named_buffers())
    for name, tensor in named:
        if name in values:
            tensors[name] = normal(tensor.shape, *values[name])
        elif tensor.ndim >= 2:  # a linear's [out, in], a conv1d's [channels, 1, kernel]
            tensors[name] = normal(tensor.shape, 0.0, tensor.shape[-1] ** -0.5)
        else:
            tensors[name] = normal(tensor.shape, 0.0, 0.5)
    x = normal(torch.Size([sum(PROBE_SEGMENTS), hidden_size]), 0.0, 1.0)
    return tensors, x, _run_module(module, tensors, x)


def _run_module(
    module: nn.Module, tensors: dict[str, torch.Tensor], x: torch.Tensor
) -> list[torch.Tensor] | str:
    parameters = inspect.signature(module.forward).parameters
    keyword = next((p for p in parameters if p in CACHE_PARAMETERS), None)
    if keyword is None or not isinstance(getattr(module, "layer_idx", None), int):
        return "it takes no Transformers cache, or has no layer_idx to keep state by"
    cache = Cache(layers=[LinearAttentionLayer() for _ in range(module.layer_idx + 1)])
    outputs = []
    for segment in torch.split(x, list(PROBE_SEGMENTS)):
        try:
            with torch.no_grad():
                out = torch.func.functional_call(
                    module, tensors, (segment[None],), {keyword: cache}
                )
        except Exception as error:  # noqa: BLE001 - a mixer we cannot run is declined
            return f"it fails on a probe: {type(error).__name__}: {error}"
        # Falcon-H1's gated norm drops the token axis of a single token.
        if (
            not isinstance(out, torch.Tensor)
            or out.shape[-1] != segment.shape[-1]
            or out.numel() != segment.numel()
        ):
            return "it does not return one hidden state per token"
        outputs.append(out.reshape(segment.shape).to(torch.float64))
    return outputs


def first_gap(
    outputs: list[torch.Tensor], x: torch.Tensor, reference: Reference
) -> tuple[float, str] | None:
    """`None` where `reference`, fed `x` in `PROBE_SEGMENTS` from the state it
    left, gives `outputs`; else the first relative gap above `PROBE_RTOL` and the
    call it is in."""
    state = None
    segments = torch.split(x, list(PROBE_SEGMENTS))
    for i, (segment, got) in enumerate(zip(segments, outputs)):
        want, state = reference(segment, state)
        gap = float((got - want).abs().max() / want.abs().max().clamp_min(1.0))
        if not gap <= PROBE_RTOL:
            where = (
                "the prefill" if i == 0 else "the continued prefill" if i == 1 else
                f"decode step {i - 1}"
            )
            return gap, where
    return None
