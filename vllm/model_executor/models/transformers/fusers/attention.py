# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The module that calls the Transformers attention interface."""

import ast
from dataclasses import dataclass
from typing import TYPE_CHECKING, Self

from torch import fx, nn

from vllm.model_executor.models.transformers.rewriting import forward_source
from vllm.model_executor.models.transformers.fusers.base import BaseFuser

if TYPE_CHECKING:
    from vllm.config import VllmConfig

INTERFACE_REGISTRY = "ALL_ATTENTION_FUNCTIONS"
VLLM_ATTENTION_FUNCTIONS = ("vllm", "vllm_mla")
"""The `_attn_implementation`s that dispatch into vLLM (registered in `__init__`)."""


def _binds_interface(value: ast.expr) -> bool:
    """`ALL_ATTENTION_FUNCTIONS.get_interface(...)` or `ALL_ATTENTION_FUNCTIONS[...]`."""
    if isinstance(value, ast.Call):
        value = value.func
        return (
            isinstance(value, ast.Attribute)
            and value.attr == "get_interface"
            and isinstance(value.value, ast.Name)
            and value.value.id == INTERFACE_REGISTRY
        )
    return (
        isinstance(value, ast.Subscript)
        and isinstance(value.value, ast.Name)
        and value.value.id == INTERFACE_REGISTRY
    )


def _interface_locals(forward: ast.FunctionDef) -> set[str]:
    """The local names the forward binds to an attention interface."""
    names = set()
    for node in ast.walk(forward):
        if isinstance(node, ast.Assign) and _binds_interface(node.value):
            targets = node.targets
        elif (
            isinstance(node, ast.AnnAssign)
            and node.value
            and _binds_interface(node.value)
        ):
            targets = [node.target]
        else:
            continue
        names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names


@dataclass
class AttentionFuser(BaseFuser):
    """`interface = ALL_ATTENTION_FUNCTIONS.get_interface(...); interface(self, q, k, v, ...)`
    -> the module gets vLLM's `Attention` as `attn`, reached by `vllm_attention_forward`.

    Read from the forward's source, not its fx trace: tracing may stop before the
    dispatch. The forward is left alone, so this fuser stands beside a QKV fuser."""

    needs_graph = False

    interface_call: str = ""
    """The source of the one call into the interface."""
    scaling: ast.expr | None = None
    """The `scaling=` argument of that call, `None` when it passes none."""
    location: str = ""
    """`file:line` of that call."""

    @classmethod
    def could_match(cls, module: nn.Module) -> bool:
        return forward_source(type(module)) is not None

    @classmethod
    def match(cls, graph: fx.Graph | None, module: nn.Module) -> Self | None:
        source = forward_source(type(module))
        if source is None:
            return None
        interface_names = _interface_locals(source.tree)
        if not interface_names:
            return None
        calls = [
            node
            for node in ast.walk(source.tree)
            if isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in interface_names
        ]
        if len(calls) != 1:
            return cls.decline(
                module,
                f"binds the attention interface to {sorted(interface_names)} but calls "
                f"it {len(calls)} times; exactly one call is one attention layer",
            )
        (call,) = calls
        scaling = next((kw.value for kw in call.keywords if kw.arg == "scaling"), None)
        return cls(
            interface_call=ast.unparse(call.func),
            scaling=scaling,
            location=source.location(call),
        )

    def validate(self, module: nn.Module, vllm_config: "VllmConfig") -> bool:
        # Only modules whose config was patched to dispatch into vLLM: this is what
        # leaves a vision tower, on its own config, to Transformers.
        config = getattr(module, "config", None)
        return getattr(config, "_attn_implementation", None) in VLLM_ATTENTION_FUNCTIONS

    def layer_index(self, module: nn.Module) -> int:
        """The index the module declares, which is the one its KV cache is keyed by."""
        layer_idx = getattr(module, "layer_idx", None)
        if not isinstance(layer_idx, int):
            raise ValueError(
                f"{type(module).__name__} calls the attention interface "
                f"({self.location}) but declares no integer `layer_idx` "
                f"(found {layer_idx!r}), so vLLM cannot tell which KV cache it uses."
            )
        return layer_idx

    def scale(self, module: nn.Module, default: float) -> float:
        """The softmax scale the module passes as `scaling=`, resolved on `module`.

        The argument wins over any attribute: OPT scales the query itself and passes
        `scaling=1.0`. With no `scaling=`, the interface's default is `default`."""
        if self.scaling is None:
            return default
        expression = ast.unparse(self.scaling)
        if isinstance(self.scaling, ast.Constant):
            value = self.scaling.value
        elif (
            isinstance(self.scaling, ast.Attribute)
            and isinstance(self.scaling.value, ast.Name)
            and self.scaling.value.id == "self"
        ):
            value = getattr(module, self.scaling.attr, None)
        else:
            raise ValueError(
                f"{type(module).__name__} passes scaling={expression} to the attention "
                f"interface ({self.location}), which the Transformers modeling backend "
                "cannot resolve: it needs a number or `self.<attribute>`. Store the "
                "scale in an attribute and pass that."
            )
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(
                f"{type(module).__name__} passes scaling={expression} to the attention "
                f"interface ({self.location}), which is {value!r} on this module, not a "
                "number, so vLLM's attention cannot be built with it."
            )
        return float(value)

    def info(self, name: str, module: nn.Module) -> str:
        return (
            f"Attention: {name} ({type(module).__name__}) -> attn "
            f"(layer {self.layer_index(module)}, {self.location})"
        )
