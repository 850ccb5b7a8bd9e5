# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What the fusers that stack or split a module's linears share: finding its
projections in its graph, the row-parallel output projection, and the children a
rank's share of the width would pass through on its way there."""

from typing import TYPE_CHECKING

import torch
from torch import fx, nn

from vllm.model_executor.models.transformers import fx_utils
from vllm.model_executor.models.transformers.utils import replace_linear_class

if TYPE_CHECKING:
    from vllm.config import VllmConfig


def output_projection(graph: fx.Graph, module: nn.Module) -> fx.Node | str | None:
    """The one linear applied to the attention output; `None` when the module has
    none (the output leaves it), or why the one it has cannot be used."""
    output = fx_utils.linear_fed_by(fx_utils.attention_node(graph), module)
    if output is None:
        return None
    if "." in output.target:
        return f"the output projection {output.target} is not a direct child"
    return output


def row_parallel(
    module: nn.Module, name: str, prefix: str, vllm_config: "VllmConfig"
) -> None:
    """Swap `module.<name>` for a row-parallel linear: it reads what a column-parallel
    fusion leaves sharded across ranks."""
    linear = replace_linear_class(
        getattr(module, name),
        "rowwise",
        vllm_config.quant_config,
        prefix=f"{prefix}.{name}",
    )
    setattr(module, name, linear)


def _reads_one_head(node: fx.Node, head_size: int) -> bool:
    """Whether the child `node` calls reads features one head wide (per head)."""
    features = fx_utils.value(node.args[0]) if node.args else None
    return isinstance(features, torch.Tensor) and features.shape[-1] == head_size


def whole_width(
    module: nn.Module, children: tuple[tuple[str, bool], ...]
) -> tuple[str, ...]:
    """Those of `children` (name, whether the code hands it one head at a time)
    that on this instance hold weights over more than one head: a norm over all
    heads together (OLMo 2's q/k norms), wrong on one rank's share of them."""
    found = []
    for name, per_head in children:
        child = getattr(module, name, None)
        if not isinstance(child, nn.Module) or per_head or name in found:
            continue
        if any(True for _ in child.parameters()):
            found.append(name)
    return tuple(found)


def children_between(
    start: fx.Node, end: fx.Node, module: nn.Module, head_size: int = 0
) -> tuple[tuple[str, bool], ...]:
    """The children called between `start` and `end` (neither included), each with
    whether the code hands it one head (`head_size` features) at a time."""
    return tuple(
        (node.target, _reads_one_head(node, head_size))
        for node in sorted(fx_utils.between(start, end) - {end}, key=lambda n: n.name)
        if fx_utils.submodule(node, module) is not None
    )


def whole_width_reason(
    module: nn.Module, children: tuple[tuple[str, bool], ...], output: str
) -> str | None:
    """Why one rank's share of the heads cannot go through `children` on their way
    to `output` (a row-parallel projection): those that hold weights over more than
    one head act on a width each rank holds only a share of (BitNet's
    `attn_sub_norm`, a norm over the whole attention output)."""
    if found := whole_width(module, children):
        return (
            f"{', '.join(found)} act on the whole width between the attention and "
            f"{output}, of which each tensor-parallel rank holds only its share"
        )
    return None


def called_once(graph: fx.Graph, names: list[str]) -> str | None:
    """Why the children `names` cannot be fused as called, `None` if each is a direct
    child called once."""
    for name in names:
        if "." in name:
            return f"{name} is not a direct child"
        calls = sum(n.op == "call_module" and n.target == name for n in graph.nodes)
        if calls != 1:
            return f"{name} is called {calls} times"
    return None
