# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""State-space mixers on vLLM's stateful layers (see docs/hybrid.md).

A Transformers hybrid decoder layer calls its mixer as
`mixer(hidden_states, cache_params=..., attention_mask=..., **kwargs)`, keeping the
mixer's convolution and recurrent states in Transformers' cache. The backend runs the
HF model without that cache, so a mixer the fusers prove equal to vLLM's layer is
replaced, in place, by that layer under the HF call signature (`Mamba2Mixer`): it
ignores Transformers' cache and mask (vLLM hands the batch's sequences and each
one's state slot to the layer through its forward context) and keeps its states in
vLLM's state cache, sized per sequence by the model class (`hybrid.py`).

`mamba2_reference` is what vLLM's `MambaMixer2` computes, written as the plain
recurrence, in whatever dtype it is given: the fuser's probe runs it in float64
against the HF module, which computes the same thing with a chunked scan."""

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from vllm.model_executor.layers.mamba.mamba_mixer2 import (
    MambaMixer2,
    Mixer2RMSNormGated,
)

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

    @property
    def conv_dim(self) -> int:
        return self.intermediate_size + 2 * self.n_groups * self.state_size

    def state_elements(self) -> tuple[int, int]:
        """Elements of one sequence's convolution and SSM state (all ranks)."""
        return (
            self.conv_dim * (self.conv_kernel - 1),
            self.num_heads * self.head_dim * self.state_size,
        )


class Mamba2Mixer(MambaMixer2):
    """vLLM's `MambaMixer2` called the way a Transformers decoder layer calls its
    Mamba-2 mixer: `(hidden_states [batch 1, tokens, hidden], cache_params=...,
    attention_mask=..., **kwargs)`. Transformers' cache and mask are not read (the
    backend passes neither; vLLM's forward context carries each sequence's state)."""

    def __init__(self, dims: Mamba2Dims, vllm_config: "VllmConfig", prefix: str):
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
            model_config=vllm_config.model_config,
            cache_config=vllm_config.cache_config,
            quant_config=vllm_config.quant_config,
            prefix=prefix,
        )
        self.dims = dims
        if dims.norm_groups != dims.n_groups:
            # vLLM builds the norm with the B/C groups; the module normalises
            # over another count (proven by the probe).
            self.norm = Mixer2RMSNormGated(
                dims.intermediate_size, dims.norm_groups, eps=dims.eps
            )

    def forward(
        self,
        hidden_states: torch.Tensor,
        cache_params: object = None,
        attention_mask: torch.Tensor | None = None,
        **kwargs: object,
    ) -> torch.Tensor:
        flat = hidden_states.reshape(-1, hidden_states.shape[-1])
        return super().forward(flat).view(hidden_states.shape)


def mamba2_reference(
    tensors: dict[str, torch.Tensor],
    dims: Mamba2Dims,
    x: torch.Tensor,
    state: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """What `MambaMixer2` computes for one sequence's tokens `x` ([tokens, hidden])
    from `state` (the last `conv_kernel - 1` convolution inputs, the SSM state;
    zeros when `None`), with the HF module's tensors by their HF names. Returns the
    output and the state after the last token.

    `in_proj(x) = [z | x B C | dt]`; `x B C` through the causal depthwise
    convolution and the activation; `dt = softplus(dt + dt_bias)`, unclamped;
    `h = exp(dt A) h + dt x B^T`, `y = h C + D x` with `A = -exp(A_log)` per head
    and B, C shared by the heads of a group; `out_proj(rmsnorm(y * silu(z)))`, the
    norm over `norm_groups` groups."""
    d = dims
    conv_dim, width = d.conv_dim, d.n_groups * d.state_size
    tokens = x.shape[0]
    if state is None:
        state = (
            x.new_zeros(d.conv_kernel - 1, conv_dim),
            x.new_zeros(d.num_heads, d.head_dim, d.state_size),
        )
    conv_state, ssm_state = state
    projected = F.linear(x, tensors["in_proj.weight"], tensors.get("in_proj.bias"))
    z, xbc, dt = projected.split([d.intermediate_size, conv_dim, d.num_heads], -1)
    history = torch.cat([conv_state, xbc])
    windows = history.unfold(0, d.conv_kernel, 1)  # [tokens, conv_dim, kernel]
    conv = (windows * tensors["conv1d.weight"][:, 0, :]).sum(-1)
    if d.use_conv_bias:
        conv = conv + tensors["conv1d.bias"]
    conv = F.silu(conv)
    xs, B, C = conv.split([d.intermediate_size, width, width], -1)
    per_group = d.num_heads // d.n_groups
    xs = xs.view(tokens, d.num_heads, d.head_dim)
    B = B.view(tokens, d.n_groups, d.state_size).repeat_interleave(per_group, 1)
    C = C.view(tokens, d.n_groups, d.state_size).repeat_interleave(per_group, 1)
    dt = F.softplus(dt + tensors["dt_bias"])
    A = -torch.exp(tensors["A_log"])
    D = tensors["D"]
    h = ssm_state
    ys = []
    for t in range(tokens):
        decay = torch.exp(dt[t] * A)[:, None, None]
        h = h * decay + (dt[t][:, None] * xs[t])[:, :, None] * B[t][:, None, :]
        ys.append((h * C[t][:, None, :]).sum(-1) + D[:, None] * xs[t])
    y = torch.stack(ys).reshape(tokens, d.intermediate_size) * F.silu(z)
    grouped = y.view(tokens, d.norm_groups, -1)
    grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + d.eps)
    y = grouped.reshape(tokens, d.intermediate_size) * tensors["norm.weight"]
    out = F.linear(y, tensors["out_proj.weight"], tensors.get("out_proj.bias"))
    return out, (history[history.shape[0] - (d.conv_kernel - 1) :], h)

