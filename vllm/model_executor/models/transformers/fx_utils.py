# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The engine the fusers stand on.

- `trace`: a module's own dataflow, child modules kept as leaves. Every value carries
  a `meta` tensor (shapes are concrete, so HF's shape arithmetic traces through) and
  the span of the forward's expression that produced it. The attention interface
  call is one opaque node. A forward that cannot be traced to the end gives what was
  reached.
- graph queries the fusers share: which linear feeds a node, which one a node feeds,
  the linear whose output is returned.
- `ForwardRewrite`: a class's forward source, spliced (insert a statement, replace an
  expression) and compiled again in the original module's globals. What cannot be
  recompiled safely raises `FusionDeclined`.
"""

import ast
import copy
import functools
import inspect
import operator
import os
import sys
import textwrap
import types
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from vllm.logger import init_logger

logger = init_logger(__name__)


class FusionDeclined(Exception):
    """A pattern that almost matched, or a rewrite that cannot be applied safely."""


Span = tuple[int, int, int, int]
"""`(line, column, end line, end column)` of an expression in its file."""

PROBE_DTYPE = torch.bfloat16
"""The dtype the trace pretends the model runs in. Not float32, so that casts to
float32 and back to the input dtype are told apart in the graph."""
_PROBE_BATCH, _PROBE_TOKENS = 2, 7
_DEFAULT_WIDTH = 16


# Source -----------------------------------------------------------------------------


@dataclass(frozen=True)
class ForwardSource:
    """The parsed source of a class's `forward`, and where it was read from."""

    tree: ast.FunctionDef
    filename: str
    first_line: int
    indent: int = 0
    """Columns removed by dedenting, to map the tree's positions back to the file."""

    def location(self, node: ast.AST) -> str:
        """`file:line` of `node` in the original file."""
        return f"{self.filename}:{self.first_line + getattr(node, 'lineno', 1) - 1}"

    def span(self, node: ast.AST) -> Span:
        """Where `node` sits in its file, comparable with a graph node's span."""
        offset = self.first_line - 1
        return (
            node.lineno + offset,
            node.col_offset + self.indent,
            node.end_lineno + offset,
            node.end_col_offset + self.indent,
        )


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
    indent = len(lines[0]) - len(lines[0].lstrip())
    return ForwardSource(function, filename, first_line, indent)


# Tracing ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Traced:
    """What tracing a module's forward reached, and whether it reached the end."""

    graph: fx.Graph
    complete: bool
    stopped: str = ""
    """Why the trace stopped early; empty when it is complete."""


def attention_call(query, key, value, *args, **kwargs):
    """The target of the one opaque node that stands for the attention interface call
    (its module argument dropped). Only ever recorded, never run."""
    raise RuntimeError("attention_call is a tracing placeholder")


class _OpaqueAttentionFunctions:
    """Stands in for `ALL_ATTENTION_FUNCTIONS` while tracing: whichever function is
    asked for, calling it records one `attention_call` node."""

    def __init__(self, registry: object):
        self._registry = registry

    @staticmethod
    def _record(module: nn.Module, query, key, value, *args, **kwargs):
        tracer = next(a.tracer for a in (query, key, value) if isinstance(a, fx.Proxy))
        return tracer.create_proxy(
            "call_function", attention_call, (query, key, value, *args), kwargs
        )

    def get_interface(self, *args, **kwargs) -> Callable:
        return self._record

    def __getitem__(self, name: str) -> Callable:
        return self._record

    def __getattr__(self, name: str) -> Any:
        return getattr(self._registry, name)


_INTERFACE_REGISTRY = "ALL_ATTENTION_FUNCTIONS"

_UNKNOWN = object()
"""The meta value of a node whose value tracing could not infer."""

_STATIC_ATTRIBUTES = frozenset(
    {"shape", "dtype", "device", "ndim", "size", "dim", "is_floating_point", "numel"}
)
"""Tensor attributes answered from the meta value instead of becoming graph nodes."""

_BROADCASTING_OPS = frozenset(
    {
        operator.add,
        operator.sub,
        operator.mul,
        operator.truediv,
        torch.add,
        torch.mul,
        torch.sub,
        torch.div,
        "add",
        "sub",
        "mul",
        "div",
    }
)
"""Ops whose result has the shape of a known operand when the other one is unknown
(a broadcast cos/sin, a mask): enough for shapes downstream to stay concrete."""


class _Probe(fx.Proxy):
    """A proxy that answers shapes and dtypes from its node's meta value."""

    def __getattr__(self, name: str) -> Any:
        value = self.node.meta.get("value", _UNKNOWN)
        if name in _STATIC_ATTRIBUTES and isinstance(value, torch.Tensor):
            return getattr(value, name)
        return _ProbeAttribute(self, name)

    def __len__(self) -> int:
        value = self.node.meta.get("value", _UNKNOWN)
        if value is _UNKNOWN or not hasattr(value, "__len__"):
            raise fx.proxy.TraceError(f"length of {self.node.name} is unknown")
        return len(value)


class _ProbeAttribute(fx.proxy.Attribute, _Probe):
    pass


def _meta(value: object) -> object:
    """`value`, a tensor made a `meta` tensor (floating ones in PROBE_DTYPE)."""
    if isinstance(value, torch.Tensor):
        dtype = PROBE_DTYPE if value.is_floating_point() else value.dtype
        return torch.empty(value.shape, dtype=dtype, device="meta")
    return value


def _probe_width(module: nn.Module) -> int:
    """The guessed width of the forward's first input: the module's own
    `in_features`, else the most common input width of its linears, else the size of
    its 1-D weights."""
    if isinstance(getattr(module, "in_features", None), int):
        return module.in_features
    widths = [c.in_features for c in module.children() if isinstance(c, nn.Linear)]
    if not widths:
        widths = [p.shape[0] for p in module.parameters() if p.ndim == 1]
    return max(widths, key=widths.count) if widths else _DEFAULT_WIDTH


@functools.cache
def _positions(code: types.CodeType) -> list[tuple]:
    return list(code.co_positions())


class _DataflowTracer(fx.Tracer):
    """Children are leaves; values carry meta tensors and forward source spans."""

    def __init__(self, root: nn.Module):
        super().__init__()
        self.forward_code = inspect.unwrap(type(root).forward).__code__

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return True

    def call_module(self, m: nn.Module, forward: Callable, args: tuple, kwargs: dict):
        # A module built inside forward (`ACT2FN["silu"](x)`) is no child: inline it.
        if m not in self.submodule_paths:
            return forward(*args, **kwargs)
        return super().call_module(m, forward, args, kwargs)

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return _Probe(node, self)

    def create_args_for_root(self, root_fn, is_module, concrete_args=None):
        """Placeholders for the forward's tensors; `None` or the default for the rest.

        The first input is a probe tensor `(batch, tokens, width)`. An input with a
        non-`None` default gets it (flags such as `use_cache=False`); an input
        defaulting to `None` whose annotation names no tensor (a cache) gets `None`;
        `*args` and `**kwargs` are empty."""
        signature = inspect.signature(inspect.unwrap(root_fn))
        parameters = list(signature.parameters.values())[1:]
        positional: list[Any] = []
        keywords: dict[str, Any] = {}
        for index, parameter in enumerate(parameters):
            if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
                continue
            value: Any
            if index == 0:
                value = self.create_proxy("placeholder", parameter.name, (), {})
                width = _probe_width(self.root)
                value.node.meta["value"] = torch.empty(
                    _PROBE_BATCH, _PROBE_TOKENS, width, dtype=PROBE_DTYPE, device="meta"
                )
            elif parameter.default is not parameter.empty and (
                parameter.default is not None
                or "Tensor" not in str(parameter.annotation)
            ):
                value = parameter.default
            else:
                value = self.create_proxy("placeholder", parameter.name, (), {})
            if parameter.kind == parameter.KEYWORD_ONLY:
                keywords[parameter.name] = value
            else:
                positional.append(value)

        def call_forward():
            return root_fn(self.root, *positional, **keywords)

        return call_forward, []

    def create_proxy(self, kind, target, args, kwargs, *rest, **kwrest) -> fx.Proxy:
        proxy = super().create_proxy(kind, target, args, kwargs, *rest, **kwrest)
        node = proxy.node
        span = self._span()
        if span is not None:
            node.meta["span"] = span
        if kind != "placeholder":
            node.meta["value"] = self._infer(kind, target, node.args, node.kwargs)
        return proxy

    def _span(self) -> Span | None:
        """The span of the forward expression being evaluated, if forward runs."""
        frame = sys._getframe(2)
        while frame is not None and frame.f_code is not self.forward_code:
            frame = frame.f_back
        if frame is None:
            return None
        line, end_line, column, end_column = _positions(self.forward_code)[
            frame.f_lasti // 2
        ]
        if line is None or column is None:
            return None
        return line, column, end_line, end_column

    def _infer(self, kind: str, target: Any, args: tuple, kwargs: dict) -> object:
        """The meta value of a new node, `_UNKNOWN` where it cannot be inferred."""
        if kind == "get_attr":
            return _meta(_tensor_attribute(self.root, target))
        values = fx.node.map_arg(
            (args, kwargs), lambda n: n.meta.get("value", _UNKNOWN)
        )
        meta_args, meta_kwargs = values
        if any(v is _UNKNOWN for v in _flatten(values)):
            if target in _BROADCASTING_OPS:
                known = [a for a in meta_args if isinstance(a, torch.Tensor)]
                return known[0] if len(known) == 1 else _UNKNOWN
            return _UNKNOWN
        try:
            with torch.device("meta"):
                if target is attention_call:
                    return _attention_output(*meta_args)
                if kind == "call_function":
                    return target(*meta_args, **meta_kwargs)
                if kind == "call_method":
                    return _run_method(target, meta_args, meta_kwargs)
                if kind == "call_module":
                    return _run_leaf(self.root.get_submodule(target), meta_args)
        except Exception:  # noqa: BLE001 - a value it cannot infer stays unknown
            pass
        return _UNKNOWN

    def iter(self, obj: fx.Proxy) -> Iterator:
        value = obj.node.meta.get("value", _UNKNOWN)
        if value is _UNKNOWN or not hasattr(value, "__len__"):
            return super().iter(obj)
        return (obj[i] for i in range(len(value)))

    def keys(self, obj: fx.Proxy) -> Any:
        value = obj.node.meta.get("value", _UNKNOWN)
        return value.keys() if isinstance(value, dict) else super().keys(obj)

    def to_bool(self, obj: fx.Proxy) -> bool:
        value = obj.node.meta.get("value", _UNKNOWN)
        if value is _UNKNOWN or isinstance(value, torch.Tensor):
            return super().to_bool(obj)
        return bool(value)


def _tensor_attribute(root: nn.Module, target: str) -> torch.Tensor | None:
    """The parameter or buffer `target`, read without `getattr`, which fx patches."""
    path, _, name = target.rpartition(".")
    owner = root.get_submodule(path)
    return owner._parameters.get(name, owner._buffers.get(name))


def _flatten(value: object) -> Iterator[object]:
    if isinstance(value, list | tuple):
        for item in value:
            yield from _flatten(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _flatten(item)
    else:
        yield value


def _run_method(name: str, args: tuple, kwargs: dict) -> object:
    receiver, *rest = args
    if name in ("to", "cuda", "cpu"):
        # Keep only the dtype: a device here would allocate real memory.
        dtypes = [a.dtype if isinstance(a, torch.Tensor) else a for a in rest]
        dtypes += [kwargs[k] for k in ("dtype",) if k in kwargs]
        dtype = next((d for d in dtypes if isinstance(d, torch.dtype)), receiver.dtype)
        return receiver.to(dtype)
    return getattr(receiver, name)(*rest, **kwargs)


def _attention_output(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *_):
    """What Transformers' attention functions return: the output as
    `(batch, tokens, heads, value head size)`, and no weights."""
    batch, heads, tokens, _ = query.shape
    return torch.empty(batch, tokens, heads, value.shape[-1], dtype=query.dtype), None


def _run_leaf(module: nn.Module, args: tuple) -> object:
    """The meta output of a child module: linears by their shapes, weight-only modules
    (norms) and parameterless ones (activations, dropout) keep their input's shape.
    Other children are not run: fx patches module calls while tracing."""
    tensor = args[0] if args and isinstance(args[0], torch.Tensor) else None
    if tensor is None:
        return _UNKNOWN
    if isinstance(module, nn.Linear):
        return torch.empty(
            (*tensor.shape[:-1], module.out_features), dtype=tensor.dtype, device="meta"
        )
    parameters = list(module.parameters())
    if any(True for _ in module.children()) or any(p.ndim != 1 for p in parameters):
        return _UNKNOWN
    return tensor


@contextmanager
def _opaque_attention(namespace: dict[str, Any]) -> Iterator[None]:
    """Swaps `ALL_ATTENTION_FUNCTIONS` in `namespace` for the recording stand-in, the
    way fx itself patches globals while it traces."""
    registry = namespace.get(_INTERFACE_REGISTRY)
    if registry is None:
        yield
        return
    namespace[_INTERFACE_REGISTRY] = _OpaqueAttentionFunctions(registry)
    try:
        yield
    finally:
        namespace[_INTERFACE_REGISTRY] = registry


def trace(module: nn.Module) -> Traced:
    """Trace `module.forward` as far as it goes, keeping child modules as leaves."""
    tracer = _DataflowTracer(module)
    forward_globals = inspect.unwrap(type(module).forward).__globals__
    try:
        with _opaque_attention(forward_globals):
            graph = tracer.trace(module)
    except Exception as error:  # noqa: BLE001 - any failure ends the trace where it is
        logger.debug("Tracing %s stopped early: %s", type(module).__name__, error)
        return Traced(
            tracer.graph, complete=False, stopped=f"{type(error).__name__}: {error}"
        )
    return Traced(graph, complete=True)


# Graph queries ----------------------------------------------------------------------


def value(node: object) -> Any:
    """The meta value tracing inferred for `node`, `None` where it is unknown."""
    if not isinstance(node, fx.Node):
        return None
    found = node.meta.get("value", _UNKNOWN)
    return None if found is _UNKNOWN else found


def op_name(node: object) -> str | None:
    """`"mul"` for `a * b`, `torch.mul(a, b)` and `a.mul(b)` alike; else `None`."""
    if not isinstance(node, fx.Node):
        return None
    if node.op == "call_method":
        return node.target
    if node.op == "call_function":
        return getattr(node.target, "__name__", None)
    return None


def submodule(node: object, module: nn.Module) -> nn.Module | None:
    """The child of `module` that `node` calls, if it calls one."""
    if not isinstance(node, fx.Node) or node.op != "call_module":
        return None
    return module.get_submodule(node.target)


def is_linear(node: object, module: nn.Module) -> bool:
    return isinstance(submodule(node, module), nn.Linear)


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
    first = next(iter(_flatten(output.args[0])), None)
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
    return sum(isinstance(child, nn.Linear) for child in module.children())


# Rewriting --------------------------------------------------------------------------


def _is_private(name: str) -> bool:
    """Names Python mangles inside a class body, which recompiling outside would not."""
    return name.startswith("__") and not name.endswith("__")


def _stored_names(tree: ast.AST) -> Iterator[ast.Name]:
    """Every name `tree` binds or deletes."""
    return (
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load)
    )


def is_self_attribute(node: ast.AST, name: str | None = None) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
        and (name is None or node.attr == name)
    )


class ForwardRewrite:
    """A copy of a class's forward source to splice, then compile in the globals of the
    module that defines it (so it sees that module's imports, as the original did).

    Raises `FusionDeclined` for a forward that cannot be recompiled safely: no source,
    free variables (a closure, `super()`), name-mangled private names, or a wrapper
    that its source does not reproduce."""

    def __init__(self, cls: type[nn.Module]):
        self.function = inspect.unwrap(cls.forward)
        source = forward_source(cls)
        name = f"{cls.__name__}.forward"
        if source is None:
            raise FusionDeclined(f"{name} has no source to rewrite")
        if free := self.function.__code__.co_freevars:
            raise FusionDeclined(
                f"{name} uses free variables {list(free)} (a closure or super())"
            )
        private = sorted(
            {
                n.id
                for n in ast.walk(source.tree)
                if isinstance(n, ast.Name) and _is_private(n.id)
            }
            | {
                n.attr
                for n in ast.walk(source.tree)
                if isinstance(n, ast.Attribute) and _is_private(n.attr)
            }
        )
        if private:
            raise FusionDeclined(f"{name} uses name-mangled private names {private}")
        if cls.forward is not self.function and not source.tree.decorator_list:
            raise FusionDeclined(
                f"{name} is wrapped by something its source does not show"
            )
        self.source = source
        self.tree = copy.deepcopy(source.tree)

    def expression_at(self, span: Span | None) -> ast.expr | None:
        """The expression of this forward at `span` (a graph node's), if any."""
        if span is None:
            return None
        return next(
            (
                n
                for n in ast.walk(self.tree)
                if isinstance(n, ast.expr)
                and hasattr(n, "end_lineno")
                and self.source.span(n) == span
            ),
            None,
        )

    def self_call(self, span: Span | None, name: str) -> ast.Call:
        """The call `self.<name>(x)` at `span`, with one positional argument."""
        node = self.expression_at(span)
        if not (
            isinstance(node, ast.Call)
            and is_self_attribute(node.func, name)
            and len(node.args) == 1
            and not node.keywords
            and not isinstance(node.args[0], ast.Starred)
        ):
            raise FusionDeclined(
                f"self.{name} is not called as `self.{name}(x)` in forward"
            )
        return node

    def references(self, name: str) -> list[ast.Attribute]:
        """Every `self.<name>` in the forward."""
        return [n for n in ast.walk(self.tree) if is_self_attribute(n, name)]

    def expect_single_use(self, name: str) -> None:
        """Raise unless `self.<name>` appears once: the fused module replaces it."""
        if (uses := len(self.references(name))) != 1:
            raise FusionDeclined(f"forward uses self.{name} {uses} times, not once")

    def calls_on_one_name(self, spans: dict[str, Span]) -> tuple[list[ast.Call], str]:
        """The calls `self.<child>(x)` at `spans` (child -> span), each child used
        nowhere else in forward, all of the same local `x` holding one value across
        them; and `x`."""
        calls = [self.self_call(span, name) for name, span in spans.items()]
        for name in spans:
            self.expect_single_use(name)
        x = calls[0].args[0]
        if not isinstance(x, ast.Name) or any(
            ast.dump(c.args[0]) != ast.dump(x) for c in calls
        ):
            raise FusionDeclined(
                f"{', '.join(spans)} are not applied to one local name"
            )
        if not self.holds_one_value(x.id, calls):
            raise FusionDeclined(f"`{x.id}` changes between {', '.join(spans)}")
        return calls, x.id

    def fresh_name(self, base: str) -> str:
        """`base`, with underscores appended until no name of the forward is it."""
        taken = {n.id for n in ast.walk(self.tree) if isinstance(n, ast.Name)}
        taken |= {a.arg for a in ast.walk(self.tree) if isinstance(a, ast.arg)}
        while base in taken:
            base += "_"
        return base

    def stores(self, name: str) -> list[ast.Name]:
        return [n for n in _stored_names(self.tree) if n.id == name]

    def loads(self, name: str) -> list[ast.Name]:
        return [
            n
            for n in ast.walk(self.tree)
            if isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Load)
        ]

    def _parent(self, node: ast.AST) -> ast.AST | None:
        return next(
            (
                p
                for p in ast.walk(self.tree)
                if any(c is node for c in ast.iter_child_nodes(p))
            ),
            None,
        )

    def _blocks(self, node: ast.AST) -> list[tuple[list[ast.stmt], int]]:
        """The statement lists enclosing `node`, innermost first, each with the index
        of the statement that holds `node`."""
        chain = []
        while (parent := self._parent(node)) is not None:
            for field in ("body", "orelse", "finalbody"):
                block = getattr(parent, field, None)
                if isinstance(block, list) and any(s is node for s in block):
                    chain.append(
                        (block, next(i for i, s in enumerate(block) if s is node))
                    )
            node = parent
        return chain

    def statement(self, node: ast.AST) -> ast.stmt:
        """The innermost statement holding `node`."""
        block, index = self._blocks(node)[0]
        return block[index]

    def region(self, nodes: list[ast.AST]) -> tuple[list[ast.stmt], int, int]:
        """The innermost block holding all `nodes`, and the first and last index of
        its statements that hold one of them."""
        chains = [self._blocks(n) for n in nodes]
        for block, _ in chains[0]:
            indices = [next((i for b, i in c if b is block), None) for c in chains]
            if all(i is not None for i in indices):
                return block, min(indices), max(indices)
        raise AssertionError("nodes of one function share its body")

    def holds_one_value(self, name: str, nodes: list[ast.AST]) -> bool:
        """Whether the local `name` is bound before the statements holding `nodes`
        and not rebound among them, so an expression reading it means the same there
        as at each of `nodes`."""
        block, first, last = self.region(nodes)
        # The last statement may assign the name: its value is computed first.
        end = block[last]
        end_value = (
            end.value
            if isinstance(end, ast.Assign | ast.AnnAssign | ast.AugAssign)
            else end
        )
        if any(
            n.id == name
            for tree in (*block[first:last], end_value)
            if tree is not None
            for n in _stored_names(tree)
        ):
            return False
        arguments = {a.arg for a in ast.walk(self.tree.args) if isinstance(a, ast.arg)}
        if name in arguments:
            return True
        # Bound by a statement that runs before the region, at its level or above.
        return any(
            n.id == name
            for b, index in [(block, first), *self._blocks(block[first])[1:]]
            for s in b[:index]
            for n in _stored_names(s)
        )

    def stack_calls(self, spans: dict[str, Span], fused: str) -> None:
        """Replace the calls `self.<child>(x)` at `spans` (child -> span) by the parts
        of one call `self.<fused>(x)`, split by its per-rank output sizes in the order
        of `spans`, placed before the first of them."""
        calls, x = self.calls_on_one_name(spans)
        block, first, _ = self.region(calls)
        outputs = [self.fresh_name(f"{name}_out") for name in spans]
        split = ast.parse(
            f"{', '.join(outputs)} = self.{fused}({x})"
            f".split(self.{fused}.output_partition_sizes, dim=-1)"
        )
        self.insert_before(block[first], split.body[0])
        for call, output in zip(calls, outputs):
            self.replace(call, ast.Name(output, ast.Load()))

    def replace(self, old: ast.AST, new: ast.AST) -> None:
        """Put `new` where `old` is."""
        parent = self._parent(old)
        for field, current in ast.iter_fields(parent):
            if current is old:
                setattr(parent, field, new)
                return
            if isinstance(current, list) and any(c is old for c in current):
                current[next(i for i, c in enumerate(current) if c is old)] = new
                return

    def insert_before(self, anchor: ast.stmt, statement: ast.stmt) -> None:
        block, index = self._blocks(anchor)[0]
        block.insert(index, statement)

    def remove(self, statement: ast.stmt) -> None:
        block, index = self._blocks(statement)[0]
        del block[index]

    def compile(self) -> Callable:
        """The rewritten forward, as a plain function (decorators applied again)."""
        module = ast.Module(body=[self.tree], type_ignores=[])
        ast.fix_missing_locations(module)
        ast.increment_lineno(module, self.source.first_line - 1)
        namespace: dict[str, Any] = {}
        exec(
            compile(module, self.source.filename, "exec"),
            self.function.__globals__,
            namespace,
        )
        return namespace[self.tree.name]


def parse_expression(source: str) -> ast.expr:
    """The expression `source` (fusers build their replacements from source text)."""
    return ast.parse(source, mode="eval").body


def merged_name(names: list[str], module: nn.Module) -> str:
    """A name for the fusion of `names`: their common prefix and suffix around the
    parts that differ (`q_proj`, `k_proj`, `v_proj` -> `qkv_proj`; `gate_proj`,
    `up_proj` -> `gate_up_proj`), made unique among `module`'s attributes."""
    prefix = os.path.commonprefix(names)
    suffix = os.path.commonprefix([n[len(prefix) :][::-1] for n in names])[::-1]
    parts = [n[len(prefix) : len(n) - len(suffix)] for n in names]
    joiner = "" if all(len(p) == 1 for p in parts) else "_"
    return fresh_attribute(module, f"{prefix}{joiner.join(parts)}{suffix}")


def fresh_attribute(module: nn.Module, name: str) -> str:
    """`name`, suffixed until `module` has no attribute of that name."""
    while hasattr(module, name):
        name += "_fused"
    return name
