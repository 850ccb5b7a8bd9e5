# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Queries on a traced graph that the fusers share: the meta value of a node, which
linear feeds a node, which one a node feeds, the linear whose output is returned, the
attention call."""

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import fx, nn

from vllm.model_executor.models.transformers import linears
from vllm.model_executor.models.transformers.tracing import (
    UNKNOWN,
    attention_call,
    flatten,
)

def value(node: object) -> Any:
    """The meta value tracing inferred for `node`, `None` where it is unknown."""
    if not isinstance(node, fx.Node):
        return None
    found = node.meta.get("value", UNKNOWN)
    return None if found is UNKNOWN else found


def op_name(node: object) -> str | None:
    """`"mul"` for `a * b`, `torch.mul(a, b)` and `a.mul(b)` alike; else `None`."""
    if not isinstance(node, fx.Node):
        return None
    if node.op == "call_method":
        return node.target
    if node.op == "call_function":
        return getattr(node.target, "__name__", None)
    return None


CASTS = frozenset({"to", "type", "type_as", "float", "double", "half", "bfloat16"})
"""Methods that only change a tensor's dtype."""


def uncast(node: object) -> object:
    """What `node` casts, through a chain of casts; `node` itself if it is none."""
    while op_name(node) in CASTS:
        node = node.args[0]
    return node


def submodule(node: object, module: nn.Module) -> nn.Module | None:
    """The child of `module` that `node` calls, if it calls one."""
    if not isinstance(node, fx.Node) or node.op != "call_module":
        return None
    return module.get_submodule(node.target)


def is_linear(node: object, module: nn.Module) -> bool:
    return linears.is_linear(submodule(node, module))


def is_linear_on_input(node: object, module: nn.Module) -> bool:
    """Whether `node` is a linear applied directly to one of the forward's inputs."""
    return (
        is_linear(node, module)
        and isinstance(node.args[0], fx.Node)
        and node.args[0].op == "placeholder"
    )


def _reach(
    start: fx.Node,
    step: Callable[[fx.Node], Iterable[fx.Node]],
    stop: Callable[[fx.Node], bool],
) -> set[fx.Node]:
    """The nodes satisfying `stop` reached from `start` by `step`, not past them."""
    found: set[fx.Node] = set()
    seen: set[fx.Node] = set()
    frontier = list(step(start))
    while frontier:
        node = frontier.pop()
        if node in seen:
            continue
        seen.add(node)
        if stop(node):
            found.add(node)
        else:
            frontier.extend(step(node))
    return found


def upstream(node: fx.Node, stop: Callable[[fx.Node], bool]) -> set[fx.Node]:
    """The nearest nodes satisfying `stop` that `node` is computed from."""
    return _reach(node, lambda n: n.all_input_nodes, stop)


def downstream(node: fx.Node, stop: Callable[[fx.Node], bool]) -> set[fx.Node]:
    """The nearest nodes satisfying `stop` computed from `node`."""
    return _reach(node, lambda n: n.users, stop)


def _all_reached(
    start: fx.Node, step: Callable[[fx.Node], Iterable[fx.Node]]
) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    frontier = list(step(start))
    while frontier:
        node = frontier.pop()
        if node not in seen:
            seen.add(node)
            frontier.extend(step(node))
    return seen


def ancestors(node: fx.Node) -> set[fx.Node]:
    """Every node `node` is computed from, `node` included."""
    return _all_reached(node, lambda n: n.all_input_nodes) | {node}


def between(start: fx.Node, end: fx.Node) -> set[fx.Node]:
    """The nodes on the dataflow from `start` to `end`, `end` included."""
    after = _all_reached(start, lambda n: n.users)
    return after & (_all_reached(end, lambda n: n.all_input_nodes) | {end})


def _only(nodes: set[fx.Node]) -> fx.Node | None:
    return next(iter(nodes)) if len(nodes) == 1 else None


def linear_feeding(node: fx.Node, module: nn.Module) -> fx.Node | None:
    """The one linear `node` is computed from, `None` when there are none or several."""
    return _only(upstream(node, lambda n: is_linear(n, module)))


def linear_fed_by(node: fx.Node, module: nn.Module) -> fx.Node | None:
    """The one linear computed from `node`, `None` when there are none or several."""
    return _only(downstream(node, lambda n: is_linear(n, module)))


def returned(graph: fx.Graph) -> fx.Node | None:
    """The forward's (first) returned value, `None` when tracing did not reach it."""
    output = next((n for n in graph.nodes if n.op == "output"), None)
    if output is None:
        return None
    first = next(iter(flatten(output.args[0])), None)
    return first if isinstance(first, fx.Node) else None


def returned_linear(graph: fx.Graph, module: nn.Module) -> fx.Node | None:
    """The linear whose output the forward returns (possibly after dropout, casts)."""
    result = returned(graph)
    if result is None or is_linear(result, module):
        return result
    return linear_feeding(result, module)


def attention_node(graph: fx.Graph) -> fx.Node | None:
    """The one attention call (the interface, or SDPA), whose first three arguments
    are the query, key and value."""
    calls = [
        n
        for n in graph.nodes
        if n.op == "call_function"
        and n.target
        in (attention_call, torch.nn.functional.scaled_dot_product_attention)
    ]
    return calls[0] if len(calls) == 1 else None


def single_user(node: fx.Node) -> fx.Node | None:
    return next(iter(node.users)) if len(node.users) == 1 else None


def linear_children(module: nn.Module) -> int:
    """How many direct children of `module` are linears (a cheap pre-check)."""
    return sum(linears.is_linear(child) for child in module.children())

