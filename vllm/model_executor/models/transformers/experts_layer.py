# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""vLLM's fused MoE for the HF experts modules that dispatch through Transformers'
experts interface (`@use_experts_implementation`), and the `"vllm"` experts function
through which those modules reach it.

The block's router chooses the experts (vLLM's router where `fusers/router.py`
proved it equal to the HF router, else the HF router) and hands its top-k ids and
weights in; the experts themselves run in vLLM's fused MoE layer, attached to the
HF experts module as `vllm_experts`, tensor- and expert-parallel as vLLM shards it."""

import functools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import regex as re
import torch
from torch import nn

from vllm.model_executor.layers.fused_moe import FusedMoEFactory

if TYPE_CHECKING:
    from vllm.config import VllmConfig

VLLM_EXPERTS = "vllm"
"""The experts implementation the backend sets in the text config."""
EXPERTS_ATTR = "vllm_experts"
"""Where the vLLM layer lives on the HF experts module."""

_PER_EXPERT = re.compile(r"(\d+)\.(\w+)\.(\d+)")
"""`<expert>.<HF parameter>.<shard>`: one expert's part of a fused HF parameter, as
`CheckpointLayout` names per-expert checkpoint tensors (shard `k` of the rows)."""


def vllm_experts_forward(
    module: nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """The `"vllm"` experts function: run `module`'s experts on `module.vllm_experts`.

    An instance the plan left unfused has no such layer and keeps Transformers' own
    experts forward (the one `@use_experts_implementation` wraps)."""
    layer = getattr(module, EXPERTS_ATTR, None)
    if layer is None:
        original = type(module).forward.__wrapped__
        return original(module, hidden_states, top_k_index, top_k_weights)
    return layer(hidden_states, top_k_index, top_k_weights)


def pack_choice(weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """A router's choice, `[weights | ids]` in float32 (exact for ids below 2**24),
    as vLLM's fused MoE takes it in place of router logits: its custom-op boundary
    passes tensors only, and `routing_chosen_by_transformers` unpacks it inside."""
    return torch.cat((weights.float(), ids.float()), dim=-1)


def routing_chosen_by_transformers(
    hidden_states: torch.Tensor,
    gating_output: torch.Tensor,
    topk: int,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's custom routing function for experts the block's router already
    chose: `gating_output` is that choice, from `pack_choice`."""
    weights, ids = gating_output.split(topk, dim=-1)
    return weights, ids.to(torch.int32)


@dataclass(frozen=True)
class ExpertsLayout:
    """How an HF experts module stores its experts, and what vLLM runs them with.

    HF keeps `gate_up_proj` as `[experts, 2 * intermediate, hidden]` (or transposed),
    its rows read as gate and up by the module's `_apply_gate`: the first half gate
    (`concatenated`) or every other row (interleaved); `down_proj` as
    `[experts, hidden, intermediate]` (or transposed)."""

    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int
    activation: str
    """vLLM's name for the gated activation (`silu`, `gelu`, `gelu_tanh`,
    `swigluoai`)."""
    concatenated: bool
    transposed: bool
    has_bias: bool

    @property
    def kernel_interleaved(self) -> bool:
        """Whether vLLM's kernel reads gate and up interleaved (`swigluoai` does)."""
        return self.activation == "swigluoai"


class VllmExperts(nn.Module):
    """One HF experts module's experts as vLLM's fused MoE (`FusedMoEFactory`),
    with the routing handed in (`pack_choice`, `routing_chosen_by_transformers`)."""

    def __init__(self, layout: ExpertsLayout, vllm_config: "VllmConfig", prefix: str):
        super().__init__()
        self.layout = layout
        self.moe = FusedMoEFactory(
            num_experts=layout.num_experts,
            top_k=layout.top_k,
            hidden_size=layout.hidden_size,
            intermediate_size=layout.intermediate_size,
            renormalize=False,
            custom_routing_function=routing_chosen_by_transformers,
            activation=layout.activation,
            has_bias=layout.has_bias,
            quant_config=vllm_config.quant_config,
            prefix=f"{prefix}.moe",
        )

    def forward(
        self,
        hidden_states: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
    ) -> torch.Tensor:
        return self.run(hidden_states, pack_choice(top_k_weights, top_k_index))

    def run(self, hidden_states: torch.Tensor, choice: torch.Tensor) -> torch.Tensor:
        """The experts on the router's `choice` (`pack_choice`), which a rewritten
        MoE block hands straight in (`fusers/moe_block.py`)."""
        if choice.shape[-1] != 2 * self.layout.top_k:
            raise ValueError(
                f"The router chose {choice.shape[-1] // 2} experts per token, but "
                f"vLLM's fused MoE was built for {self.layout.top_k}."
            )
        return self.moe(hidden_states, choice)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load the experts from HF's fused tensors (`gate_up_proj`, `down_proj`,
        their `_bias`) or from per-expert parts of them (`<expert>.<name>.<shard>`),
        each expert into the slots this rank holds (expert parallel) and each
        projection's share of the intermediate size (tensor parallel)."""
        routed = self.moe.routed_experts
        loaded: set[str] = set()
        for name, tensor in weights:
            part = _PER_EXPERT.fullmatch(name)
            if part is not None:
                expert, param, shard = int(part[1]), part[2], int(part[3])
                tensors = {expert: tensor}
            else:
                param, shard = name, 0
                if self.layout.transposed and tensor.ndim == 3:
                    tensor = tensor.transpose(1, 2)
                tensors = dict(enumerate(tensor))
            target = self._load(param, shard, tensors)
            if target is None:
                raise ValueError(
                    f"Checkpoint tensor {name!r} is not a part of the experts that "
                    f"vLLM's fused MoE at {routed.layer_name} knows how to load."
                )
            loaded.add(f"moe.routed_experts.{target}")
        return loaded

    def _load(
        self, param: str, shard: int, tensors: dict[int, torch.Tensor]
    ) -> str | None:
        """Copy each expert's `tensors` (rows `shard` of HF's `param`) into vLLM's
        parameter; returns that parameter's name, `None` for an unknown `param`."""
        routed = self.moe.routed_experts
        config = routed.moe_config
        rank, ranks = config.tp_rank, config.tp_size
        share = self.layout.intermediate_size // ranks
        expert_map = routed.expert_map_manager.expert_map
        target = {
            "gate_up_proj": "w13_weight",
            "gate_up_proj_bias": "w13_bias",
            "down_proj": "w2_weight",
            "down_proj_bias": "w2_bias",
        }.get(param)
        if target is None:
            return None
        data = getattr(routed, target).data
        for expert, tensor in tensors.items():
            local = expert if expert_map is None else int(expert_map[expert])
            if local < 0:  # another rank's expert
                continue
            if target == "w2_weight":
                data[local].copy_(tensor[:, rank * share : (rank + 1) * share])
            elif target == "w2_bias":
                # Every rank's partial sums are added up: one of them adds the bias.
                data[local].copy_(tensor if rank == 0 else torch.zeros_like(tensor))
            else:
                offset = shard * tensor.shape[0]
                rows = self.w13_rows[offset : offset + tensor.shape[0]]
                kept = rows >= 0
                data[local][rows[kept]] = tensor[kept.to(tensor.device)].to(data.dtype)
        return target

    @functools.cached_property
    def w13_rows(self) -> torch.Tensor:
        """For each row of HF's `gate_up_proj` (per expert), the row of this rank's
        `w13` it goes to, or -1 when another rank holds it (the same for every
        expert and tensor, so found once)."""
        config = self.moe.routed_experts.moe_config
        layout = self.layout
        size = layout.intermediate_size
        rank, share = config.tp_rank, size // config.tp_size
        hf_rows = torch.arange(2 * size)
        if layout.concatenated:
            is_up, index = hf_rows >= size, hf_rows % size
        else:
            is_up, index = hf_rows % 2 == 1, hf_rows // 2
        local = index - rank * share
        if layout.kernel_interleaved:
            rows = 2 * local + is_up
        else:
            rows = local + share * is_up
        return torch.where((local >= 0) & (local < share), rows, -1)
