# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The engine the fusers stand on: tracing, forward source recovery, graph queries."""

import ast
import functools
import inspect
import textwrap
from dataclasses import dataclass

from torch import fx, nn

from vllm.logger import init_logger

logger = init_logger(__name__)


@dataclass(frozen=True)
class ForwardSource:
    """The parsed source of a class's `forward`, and where it was read from."""

    tree: ast.FunctionDef
    filename: str
    first_line: int

    def location(self, node: ast.AST) -> str:
        """`file:line` of `node` in the original file."""
        return f"{self.filename}:{self.first_line + getattr(node, 'lineno', 1) - 1}"


@functools.cache
def forward_source(cls: type[nn.Module]) -> ForwardSource | None:
    """The source of `cls.forward`, or `None` where Python cannot recover it."""
    forward = inspect.unwrap(cls.forward)
    try:
        lines, first_line = inspect.getsourcelines(forward)
        filename = inspect.getsourcefile(forward) or "?"
    except (OSError, TypeError):
        return None
    tree = ast.parse(textwrap.dedent("".join(lines)))
    function = tree.body[0]
    if not isinstance(function, ast.FunctionDef):
        return None
    return ForwardSource(function, filename, first_line)


@dataclass(frozen=True)
class Traced:
    """What tracing a module's forward reached, and whether it reached the end."""

    graph: fx.Graph
    complete: bool


class _ChildrenAsLeaves(fx.Tracer):
    """Every child module is a leaf: fusers look at one module's own dataflow."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return True


def trace(module: nn.Module) -> Traced:
    """Trace `module.forward` as far as it goes, keeping child modules as leaves."""
    tracer = _ChildrenAsLeaves()
    try:
        graph = tracer.trace(module)
    except Exception as error:  # noqa: BLE001 - any failure ends the trace where it is
        logger.debug("Tracing %s stopped early: %s", type(module).__name__, error)
        return Traced(tracer.graph, complete=False)
    return Traced(graph, complete=True)
