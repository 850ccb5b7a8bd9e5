# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""vLLM's MoE router in place of an HF router module: the router's projection runs
as a vLLM linear, and its softmax or sigmoid top-k (grouped, bias-corrected,
renormalised, scaled) runs in vLLM's router. The router module's callers get what
they got from Transformers: the logits, the top-k weights and ids, in the same
places."""

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from vllm.model_executor.layers.fused_moe.router.cpu_router import CPURouter
from vllm.model_executor.layers.fused_moe.router.router_factory import (
    create_fused_moe_router,
)
from vllm.model_executor.layers.linear import ReplicatedLinear
from vllm.model_executor.models.transformers.experts_layer import pack_choice

ROUTER_ATTR = "vllm_router"
"""Where the vLLM router lives on the HF router module."""

Role = Literal["logits", "weights", "ids"]


@dataclass(frozen=True)
class Routing:
    """What an HF router computes, in the terms of vLLM's router."""

    top_k: int
    scoring: Literal["softmax", "sigmoid"]
    renormalize: bool
    num_expert_group: int | None
    """Experts are chosen within the best `topk_group` of this many groups."""
    topk_group: int | None
    correction_bias: str | None
    """The router's tensor added to the scores to choose (not to weigh) experts,
    or the name of the router's input carrying it."""
    correction_handed_in: bool
    """Whether the caller hands the correction in (the block keeps it)."""
    scale: float
    """The routed scaling factor the chosen weights are multiplied by."""
    float32_logits: bool
    """Whether the router projects in float32 whatever the model's dtype."""
    flattens: bool
    """Whether the router flattens its input to `[tokens, hidden]` first."""
    outputs: tuple[Role, ...]
    """What the router returns, in order."""
    weights_in_input_dtype: bool = False
    """Whether the router hands its top-k weights back in its input's dtype
    (Qwen3's `.to(router_logits.dtype)`, gpt-oss's softmax in the logits' dtype)
    rather than in float32, as vLLM's router computes them: rounded the same way,
    the experts weigh with the same numbers in bfloat16."""

    @property
    def grouped(self) -> bool:
        """Whether vLLM's grouped top-k serves it: groups, sigmoid scores or a
        correction bias (vLLM's plain top-k is softmax only)."""
        return (
            self.num_expert_group is not None
            or self.scoring == "sigmoid"
            or self.correction_bias is not None
        )

    def router_arguments(self, num_experts: int) -> dict:
        """Arguments of vLLM's router for this routing. The scaling factor is
        applied by `VllmRouter` itself: not every vLLM router applies it."""
        return dict(
            top_k=self.top_k,
            global_num_experts=num_experts,
            renormalize=self.renormalize,
            use_grouped_topk=self.grouped,
            num_expert_group=self.num_expert_group or 1 if self.grouped else None,
            topk_group=self.topk_group or 1 if self.grouped else None,
            scoring_func=self.scoring,
            routed_scaling_factor=1.0,
        )

    def describe(self) -> str:
        parts = [f"{self.scoring} top-{self.top_k}"]
        if self.num_expert_group is not None:
            parts.append(
                f"in the best {self.topk_group} of {self.num_expert_group} groups"
            )
        if self.correction_handed_in:
            parts.append(f"choice corrected by the `{self.correction_bias}` handed in")
        elif self.correction_bias is not None:
            parts.append(f"choice corrected by `{self.correction_bias}`")
        if self.renormalize:
            parts.append("renormalised")
        if self.scale != 1.0:
            parts.append(f"scaled by {self.scale:g}")
        if self.float32_logits:
            parts.append("float32 logits")
        if self.weights_in_input_dtype:
            parts.append("weights in the input's dtype")
        return ", ".join(parts)


class VllmRouter(nn.Module):
    """An HF router's projection (`gate`, a vLLM linear) and routing (vLLM's
    router, from `create_fused_moe_router`)."""

    def __init__(
        self,
        routing: Routing,
        num_experts: int,
        hidden_size: int,
        has_bias: bool,
        ranks: tuple[int, ...],
        prefix: str,
    ):
        super().__init__()
        self.routing = routing
        # The ranks of hidden states the routing was proven equal on.
        self.ranks = ranks
        self.prefix = prefix
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        # The model's dtype (vLLM's default while it builds) unless the router
        # projects in float32.
        self.gate = ReplicatedLinear(
            hidden_size,
            num_experts,
            bias=has_bias,
            params_dtype=torch.float32 if routing.float32_logits else None,
            quant_config=None,
            prefix=f"{prefix}.gate",
            return_bias=False,
        )
        bias = None
        if routing.correction_handed_in:
            # vLLM's router holds its bias as a tensor of its own: the one handed
            # in is copied into it before each choice (not in the checkpoint).
            self.register_buffer(
                "e_score_correction_bias",
                torch.zeros(num_experts, dtype=torch.float32),
                persistent=False,
            )
            bias = self.e_score_correction_bias
        elif routing.correction_bias is not None:
            self.e_score_correction_bias = nn.Parameter(
                torch.empty(num_experts, dtype=torch.float32), requires_grad=False
            )
            self.e_score_correction_bias.weight_loader = load_per_expert
            bias = self.e_score_correction_bias
        self.router = create_fused_moe_router(
            **routing.router_arguments(num_experts), e_score_correction_bias=bias
        )

    def forward(
        self, hidden_states: torch.Tensor, *handed: torch.Tensor, **by_name: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        logits, weights, ids = self._choose(hidden_states, (*handed, *by_name.values()))
        return route_outputs(self.routing, logits, weights, ids, hidden_states.dtype)

    def choice(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The experts chosen for each token and their weights, packed as vLLM's
        fused MoE takes them (`pack_choice`): for a block whose forward hands the
        router's choice to its experts and reads it nowhere else
        (`fusers/moe_block.py`), which so skips Transformers' experts interface."""
        _, weights, ids = self._choose(hidden_states, ())
        return pack_choice(
            chosen_weights(self.routing, weights, hidden_states.dtype), ids
        )

    def _choose(
        self, hidden_states: torch.Tensor, inputs: tuple[torch.Tensor, ...]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The logits, and vLLM's `[tokens, top_k]` weights and ids, for the hidden
        states and what the caller hands in (the correction bias, if it keeps it)."""
        if hidden_states.dim() not in self.ranks:
            raise ValueError(
                f"{self.prefix}: the router was proven to route as Transformers' "
                f"for hidden states of {' or '.join(map(str, self.ranks))} "
                f"dimensions, and got {hidden_states.dim()}"
            )
        if len(inputs) != self.routing.correction_handed_in:
            raise TypeError(
                f"{self.prefix}: the router takes the hidden states"
                f"{' and its correction bias' * self.routing.correction_handed_in}, "
                f"and got {len(inputs)} more inputs"
            )
        if inputs:
            self.e_score_correction_bias.copy_(inputs[0])
        if self.routing.flattens:
            hidden_states = hidden_states.reshape(-1, self.hidden_size)
        if self.routing.float32_logits:
            hidden_states = hidden_states.float()
        logits = self.gate(hidden_states)
        weights, ids = self.router.select_experts(
            hidden_states.reshape(-1, self.hidden_size), _scored_logits(logits)
        )
        return logits, weights, ids


def _scored_logits(logits: torch.Tensor) -> torch.Tensor:
    """`[tokens, experts]` logits in float32, as Transformers' routers score
    them (`softmax(logits, dtype=torch.float)`): vLLM's CPU router takes the
    softmax in the logits' dtype, which in bfloat16 weighs other numbers."""
    return logits.reshape(-1, logits.shape[-1]).float()


def load_per_expert(param: nn.Parameter, loaded: torch.Tensor) -> None:
    """Load one value per expert however many leading dimensions of one the
    checkpoint stores it with (Ernie 4.5's correction bias is `[1, experts]`)."""
    if loaded.shape[-1:] != param.shape or loaded.numel() != param.numel():
        raise ValueError(
            f"a tensor of shape {list(loaded.shape)} does not hold one value for "
            f"each of {param.numel()} experts"
        )
    param.data.copy_(loaded.reshape(param.shape))


def chosen_weights(
    routing: Routing, weights: torch.Tensor, input_dtype: torch.dtype
) -> torch.Tensor:
    """vLLM's top-k weights as the HF router hands them on: scaled, and rounded to
    its input's dtype where it rounds them."""
    if routing.scale != 1.0:
        weights = weights * routing.scale
    if routing.weights_in_input_dtype:
        weights = weights.to(input_dtype)
    return weights


def route_outputs(
    routing: Routing,
    logits: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    input_dtype: torch.dtype,
) -> tuple[torch.Tensor, ...]:
    """The router's outputs, in its order, from vLLM's `[tokens, top_k]` choice
    for an input of `input_dtype`."""
    shape = (*logits.shape[:-1], routing.top_k)
    found = {
        "logits": logits,
        "weights": chosen_weights(routing, weights, input_dtype).reshape(shape),
        # int64, as `torch.topk` gives them to Transformers' routers: experts the
        # backend leaves to Transformers index with them (`one_hot` takes no other).
        "ids": ids.reshape(shape).long(),
    }
    return tuple(found[role] for role in routing.outputs)


def reference_route(
    routing: Routing,
    logits: torch.Tensor,
    correction_bias: torch.Tensor | None,
    input_dtype: torch.dtype,
) -> tuple[torch.Tensor, ...]:
    """What vLLM's router returns for `logits` (projected from an input of
    `input_dtype`), computed by its reference router
    (the CPU router's plain torch ops, which every platform's kernels match);
    used to prove a router equal before it is replaced."""
    router = CPURouter(
        **routing.router_arguments(logits.shape[-1]),
        e_score_correction_bias=correction_bias,
    )
    flat = _scored_logits(logits)
    weights, ids = router.select_experts(flat, flat)
    return route_outputs(routing, logits, weights, ids, input_dtype)


def vllm_router_forward(
    self: nn.Module, hidden_states: torch.Tensor, *handed: torch.Tensor, **by_name
):
    """The forward a fused HF router module takes: its vLLM router's (with the
    correction bias its caller hands in, if any)."""
    return getattr(self, ROUTER_ATTR)(hidden_states, *handed, **by_name)
