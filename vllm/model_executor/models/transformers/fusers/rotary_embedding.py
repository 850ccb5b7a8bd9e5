# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Rotary embeddings whose cos and sin repeat one half: computed at half width."""

import ast
from dataclasses import dataclass
from typing import TYPE_CHECKING, Self

import torch
from torch import fx, nn

from vllm.model_executor.models.transformers import fx_utils
from vllm.model_executor.models.transformers import tracing
from vllm.model_executor.models.transformers.fusers.base import (
    Declined,
    FusionDeclined,
    RewriteFuser,
)
from vllm.model_executor.models.transformers.rewriting import ForwardRewrite, Span

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.model_executor.models.transformers.plan import FusionPlan

ELEMENTWISE = frozenset({"cos", "sin"}) | fx_utils.CASTS
"""Operators between the concatenation and the outputs acting on each element alone."""
SCALINGS = frozenset({"mul", "truediv"})
"""Operators that are elementwise when the other operand is a number."""


def frequencies(module: nn.Module) -> torch.Tensor | None:
    """The rotary frequencies `module` holds (`inv_freq`, or one per layer type,
    `sliding_attention_inv_freq`, as every Transformers rotary embedding does)."""
    return next(
        (
            buffer
            for name, buffer in module.named_buffers(recurse=False)
            if name.endswith("inv_freq")
        ),
        None,
    )


def is_rotary_embedding(module: nn.Module) -> bool:
    """Whether `module` makes a cos and sin that attention modules consume."""
    return frequencies(module) is not None


def _elementwise(node: fx.Node, source: fx.Node) -> bool:
    """Whether `node` computes each element of its output from the same element of
    `source` alone: cos, sin, a cast, or a product or quotient with a number."""
    name = fx_utils.op_name(node)
    if name in ELEMENTWISE:
        return node.args[0] is source
    if name in SCALINGS and len(node.args) == 2 and not node.kwargs:
        left, right = node.args
        return (left is source and isinstance(right, int | float)) or (
            name == "mul" and right is source and isinstance(left, int | float)
        )
    return False


def _duplicated(node: fx.Node) -> fx.Node | None:
    """`x` where `node` is `torch.cat((x, x), dim=-1)`."""
    if fx_utils.op_name(node) != "cat" or node.op != "call_function":
        return None
    parts = node.args[0] if node.args else node.kwargs.get("tensors")
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    if not (isinstance(parts, tuple | list) and len(parts) == 2):
        return None
    if parts[0] is not parts[1]:
        return None
    half = fx_utils.value(parts[0])
    last = -1 if half is None else half.dim() - 1
    return parts[0] if dim in (-1, last) else None


def _halved_concatenation(graph: fx.Graph) -> fx.Node | str:
    """The one `cat((x, x), dim=-1)` every output of the forward is computed from by
    elementwise operators alone, or why there is none."""
    output = next((n for n in graph.nodes if n.op == "output"), None)
    if output is None:
        return "the forward was not traced to its end"
    outputs = list(tracing.flatten(output.args[0]))
    if len(outputs) != 2 or not all(isinstance(o, fx.Node) for o in outputs):
        return "it does not return two tensors (cos and sin)"
    cats = [n for n in graph.nodes if _duplicated(n) is not None]
    if len(cats) != 1:
        return (
            "no `cat((x, x), dim=-1)` repeats the frequencies"
            if not cats
            else f"{len(cats)} concatenations repeat a tensor"
        )
    (cat,) = cats
    # Every value computed from the concatenation must be elementwise in it and end
    # in an output: then each output repeats its first half as the concatenation does.
    frontier, reached = [cat], set()
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if user.op == "output":
                continue
            if not _elementwise(user, node):
                return (
                    f"`{user.format_node()}` is computed from the repeated frequencies "
                    "by more than an elementwise operator"
                )
            if user not in reached:
                reached.add(user)
                frontier.append(user)
    if not all(o is cat or o in reached for o in outputs):
        return "an output is not computed from the repeated frequencies"
    return cat


@dataclass
class RotaryEmbeddingFuser(RewriteFuser):
    """`cos(cat((f, f), -1)) * s, sin(cat((f, f), -1)) * s` ->
    `cos(f) * s, sin(f) * s`: a rotary embedding whose cos and sin repeat their first
    half returns that half, the form vLLM's rotary kernel takes (`rotary.py`, which
    consumes it, tells the half from a whole by its width).

    Proven from dataflow: the outputs are computed from the concatenation by
    elementwise operators only, at every position and whatever the frequencies
    (dynamic and scaled rotary embeddings included). Since a half-width cos is wrong
    for any other consumer, a model takes it only where every attention module takes
    the rotary kernel (`cross_check`)."""

    kind = "rotary_embedding"

    span: Span | None = None
    """Where the forward concatenates the frequencies with themselves."""

    @classmethod
    def could_match(cls, module: nn.Module) -> bool:
        return is_rotary_embedding(module)

    @classmethod
    def match(cls, graph: fx.Graph | None, module: nn.Module) -> Self | Declined:
        if graph is None:
            return cls.decline(module, "its forward could not be traced")
        found = _halved_concatenation(graph)
        if isinstance(found, str):
            return cls.decline(module, found)
        return cls(span=found.meta.get("span"))

    def mismatch(self, module: nn.Module, vllm_config: "VllmConfig") -> str | None:
        # The forward may branch on the instance's attributes (its rotary type):
        # this instance must compute its outputs as the analysed one did.
        found = _halved_concatenation(tracing.trace(module).graph)
        if isinstance(found, str):
            return found
        if found.meta.get("span") != self.span:
            return "this instance repeats its frequencies elsewhere in the forward"
        return None

    def update_forward(self, module: nn.Module) -> None:
        rewrite = ForwardRewrite(type(module))
        cat = rewrite.expression_at(self.span)
        parts = cat.args[0] if isinstance(cat, ast.Call) and cat.args else None
        if not (
            isinstance(parts, ast.Tuple | ast.List)
            and len(parts.elts) == 2
            and all(isinstance(p, ast.Name) for p in parts.elts)
            and parts.elts[0].id == parts.elts[1].id
        ):
            raise FusionDeclined(
                "the repeated frequencies are not concatenated as `cat((x, x), ...)`"
            )
        rewrite.replace(cat, ast.Name(parts.elts[0].id, ast.Load()))
        self.fused_forward = rewrite.compile()

    def update_attrs(
        self, module: nn.Module, prefix: str, vllm_config: "VllmConfig"
    ) -> None:
        """Nothing to swap: only the forward changes."""

    @classmethod
    def cross_check(cls, plan: "FusionPlan") -> str | None:
        # rotary.py imports this module.
        from vllm.model_executor.models.transformers.fusers import rotary

        return rotary.unpaired(plan)

    def info(self, name: str, module: nn.Module) -> str:
        return (
            f"Fused: rotary embedding ({name}: {type(module).__name__}) -> "
            "half width"
        )
