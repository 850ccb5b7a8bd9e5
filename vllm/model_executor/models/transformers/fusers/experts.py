# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Experts behind Transformers' experts interface, served by vLLM's fused MoE."""

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING, Self

import torch
import torch.nn.functional as F
from torch import fx, nn

from vllm.model_executor.layers.activation import SwigluOAIAndMul
from vllm.model_executor.models.transformers.experts_layer import (
    EXPERTS_ATTR,
    VLLM_EXPERTS,
    ExpertsLayout,
    VllmExperts,
)
from vllm.model_executor.models.transformers.fusers.base import BaseFuser, Declined
from vllm.model_executor.models.transformers.fusers.probes import Draws, failed

if TYPE_CHECKING:
    from vllm.config import VllmConfig

_LAYOUT_FLAGS = ("has_gate", "has_bias", "is_transposed", "is_concatenated")
"""What `@use_experts_implementation` sets on each experts instance."""


def _gated(act: Callable[[torch.Tensor], torch.Tensor], concatenated: bool):
    def gated(x: torch.Tensor) -> torch.Tensor:
        if concatenated:
            gate, up = x.chunk(2, dim=-1)
        else:
            gate, up = x[..., ::2], x[..., 1::2]
        return act(gate) * up

    return gated


def _swigluoai_reference() -> Callable[[torch.Tensor], torch.Tensor]:
    """vLLM's reference of gpt-oss's clamped SwiGLU, with the alpha and limit its
    fused MoE kernels use (the layer's defaults; the CPU kernel takes no others)."""
    defaults = inspect.signature(SwigluOAIAndMul.__init__).parameters
    constants = SimpleNamespace(
        alpha=defaults["alpha"].default, limit=defaults["limit"].default
    )
    return functools.partial(SwigluOAIAndMul.forward_native, constants)


# vLLM's activation name, whether it reads gate and up concatenated, and what it
# computes (vLLM's own reference where it has one).
_CANDIDATES: tuple[tuple[str, bool, Callable[[torch.Tensor], torch.Tensor]], ...] = (
    *(
        (name, concatenated, _gated(act, concatenated))
        for name, act in (
            ("silu", F.silu),
            ("gelu", F.gelu),
            ("gelu_tanh", lambda x: F.gelu(x, approximate="tanh")),
        )
        for concatenated in (True, False)
    ),
    ("swigluoai", False, _swigluoai_reference()),
)

_PROBE_WIDTH = 16


def _probe() -> torch.Tensor:
    """Inputs for a gate: float64, wide enough to pass any clamp vLLM applies."""
    return Draws().normal((64, 2 * _PROBE_WIDTH)) * 6


def gate_activation(module: nn.Module) -> tuple[str, bool] | str:
    """vLLM's activation for what `module._apply_gate` computes on a probe, and
    whether it reads gate and up concatenated; else why none fits."""
    probe = _probe()
    try:
        with torch.no_grad():
            computed = module._apply_gate(probe)
    except Exception as error:  # noqa: BLE001 - a gate we cannot run is declined
        return failed(error, "its gate `_apply_gate`")
    if not isinstance(computed, torch.Tensor) or computed.shape != (64, _PROBE_WIDTH):
        return "its gate `_apply_gate` does not halve the gate-and-up projection"
    for name, concatenated, reference in _CANDIDATES:
        if torch.allclose(computed, reference(probe), rtol=1e-12, atol=1e-12):
            return name, concatenated
    return (
        "its gate `_apply_gate` computes no activation vLLM's fused MoE has "
        "(SiLU, GELU or GELU-tanh times up, or gpt-oss's clamped SwiGLU with "
        "alpha 1.702 and limit 7)"
    )


def _is_experts_module(module: nn.Module) -> bool:
    forward = getattr(type(module), "forward", None)
    return getattr(forward, "__wrapped__", None) is not None and all(
        hasattr(module, flag) for flag in _LAYOUT_FLAGS
    )


TOP_K_NAMES = (
    "num_experts_per_tok",
    "num_experts_per_token",
    "top_k_experts",
    "moe_topk",
    "moe_top_k",
)
"""Where a config gives the experts chosen per token (Gemma 4: `top_k_experts`, Aria:
`moe_topk`): the names vLLM's engine reads it under (`get_num_experts_per_token`).
A wrong one cannot give a wrong answer: `VllmExperts` refuses a router choosing
another number of experts."""


def _top_k(module: nn.Module) -> int | None:
    config = getattr(module, "config", None)
    for name in TOP_K_NAMES:
        top_k = getattr(config, name, None)
        if top_k is not None:
            break
    return top_k if isinstance(top_k, int) and not isinstance(top_k, bool) else None


@dataclass
class ExpertsFuser(BaseFuser):
    """`experts(x, top_k_index, top_k_weights)`, an experts module behind
    Transformers' experts interface -> vLLM's fused MoE attached as `vllm_experts`,
    reached through the `"vllm"` experts function; the block's router chooses the
    experts (vLLM's router where `RouterFuser` proved it equal).

    The activation is what the module's `_apply_gate` computes (checked on a probe
    against each activation vLLM's fused MoE has), and so is how its
    `gate_up_proj` rows split into gate and up; sizes come from its parameters."""

    needs_graph = False
    kind = "moe"
    details_title = "Mixture-of-experts blocks"
    details_beside = True

    activation: str = ""
    concatenated: bool = True

    @classmethod
    def could_match(cls, module: nn.Module) -> bool:
        return _is_experts_module(module)

    @classmethod
    def match(cls, graph: fx.Graph | None, module: nn.Module) -> Self | Declined:
        reason = cls._unsupported(module)
        if reason is not None:
            return cls.decline(module, reason)
        found = gate_activation(module)
        if isinstance(found, str):
            return cls.decline(module, found)
        activation, concatenated = found
        return cls(activation=activation, concatenated=concatenated)

    @staticmethod
    def _unsupported(module: nn.Module) -> str | None:
        if not module.has_gate:
            return (
                "its experts have no gate projection, and vLLM's fused MoE serves "
                "gated experts only"
            )
        if module._is_expert_parallel:
            return "Transformers already splits its experts across ranks"
        return None

    def layout(self, module: nn.Module) -> ExpertsLayout | str:
        """The instance's layout, read off its parameters; else why it cannot be."""
        gate_up = getattr(module, "gate_up_proj", None)
        down = getattr(module, "down_proj", None)
        if not isinstance(gate_up, torch.Tensor) or not isinstance(down, torch.Tensor):
            return "it has no `gate_up_proj` and `down_proj` expert tensors"
        if gate_up.ndim != 3 or down.ndim != 3:
            return "its `gate_up_proj` and `down_proj` are not [experts, out, in]"
        if module.is_transposed:
            gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
        num_experts, double, hidden = gate_up.shape
        if double % 2 or down.shape != (num_experts, hidden, double // 2):
            return (
                f"its `gate_up_proj` {tuple(gate_up.shape)} and `down_proj` "
                f"{tuple(down.shape)} do not fit gated experts"
            )
        top_k = _top_k(module)
        if top_k is None:
            return (
                "its config gives no single number of experts per token (as "
                f"{', '.join(f'`{name}`' for name in TOP_K_NAMES)})"
            )
        return ExpertsLayout(
            num_experts=num_experts,
            top_k=top_k,
            hidden_size=hidden,
            intermediate_size=double // 2,
            activation=self.activation,
            concatenated=self.concatenated,
            transposed=bool(module.is_transposed),
            has_bias=bool(module.has_bias),
        )

    def mismatch(self, module: nn.Module, vllm_config: "VllmConfig") -> str | None:
        implementation = getattr(module.config, "_experts_implementation", None)
        if implementation != VLLM_EXPERTS:
            return (
                f"its config dispatches experts to {implementation!r}, not to vLLM "
                "(it is not the text model's)"
            )
        if reason := self._unsupported(module):
            return reason
        found = gate_activation(module)
        if isinstance(found, str):
            return found
        if found != (self.activation, self.concatenated):
            return (
                f"this instance's gate computes {found[0]}, not {self.activation} as "
                "in the instance the class was analysed on"
            )
        layout = self.layout(module)
        if isinstance(layout, str):
            return layout
        ranks = vllm_config.parallel_config.tensor_parallel_size
        if not vllm_config.parallel_config.enable_expert_parallel and (
            layout.intermediate_size % ranks
        ):
            return (
                f"its intermediate size {layout.intermediate_size} does not split "
                f"across {ranks} tensor-parallel ranks"
            )
        return None

    def fuse(
        self, module: nn.Module, prefix: str, vllm_config: "VllmConfig"
    ) -> nn.Module:
        layout = self.layout(module)
        assert isinstance(layout, ExpertsLayout), layout
        # The experts' tensors now live in vLLM's layer, which loads them.
        for name in [name for name, _ in module.named_parameters(recurse=False)]:
            delattr(module, name)
        setattr(
            module,
            EXPERTS_ATTR,
            VllmExperts(layout, vllm_config, prefix=f"{prefix}.{EXPERTS_ATTR}"),
        )
        return module

    def renamed_weights(self, prefix: str) -> dict[str, str]:
        return {f"{prefix}.": f"{prefix}.{EXPERTS_ATTR}."}

    def report_detail(self, name: str, module: nn.Module) -> str:
        layout = getattr(module, EXPERTS_ATTR).layout
        bias = ", with biases" if layout.has_bias else ""
        return (
            f"{name} ({type(module).__name__}): {layout.num_experts} experts, "
            f"top-{layout.top_k}, {layout.activation}{bias}; vLLM fused MoE, "
            "routed by the block's router"
        )

    def info(self, name: str, module: nn.Module) -> str:
        return f"Fused: experts -> {EXPERTS_ATTR}: {self.report_detail(name, module)}"
