# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Tracing a module's own dataflow, as far as it goes.

`trace(module)` records the module's forward with its child modules kept as leaves.
Every value carries a `meta` tensor (shapes are concrete, so HF's shape arithmetic
traces through) and the span of the forward's expression that produced it. The
attention interface call is one opaque node. A forward that cannot be traced to the
end gives what was reached.
"""

import functools
import inspect
import operator
import sys
import threading
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from transformers import modeling_utils

from vllm.logger import init_logger
from vllm.model_executor.models.transformers import linears
from vllm.model_executor.models.transformers.rewriting import Span

logger = init_logger(__name__)

PROBE_DTYPE = torch.bfloat16
"""The dtype the trace pretends the model runs in. Not float32, so that casts to
float32 and back to the input dtype are told apart in the graph."""
_PROBE_BATCH, _PROBE_TOKENS = 2, 7
_DEFAULT_WIDTH = 16


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

UNKNOWN = object()
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
        value = self.node.meta.get("value", UNKNOWN)
        if name in _STATIC_ATTRIBUTES and isinstance(value, torch.Tensor):
            return getattr(value, name)
        return _ProbeAttribute(self, name)

    def __setitem__(self, key: Any, item: Any) -> None:
        # A write into an input (Gemma 4 stores its keys and values in the
        # `shared_kv_states` dict it is passed) is recorded, so tracing goes on to
        # the attention call after it.
        self.tracer.create_proxy(
            "call_function", operator.setitem, (self, key, item), {}
        )

    def __len__(self) -> int:
        value = self.node.meta.get("value", UNKNOWN)
        if value is UNKNOWN or not hasattr(value, "__len__"):
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
    widths = [
        linears.in_features(c) for c in module.children() if linears.is_linear(c)
    ]
    if not widths:
        widths = [p.shape[0] for p in module.parameters() if p.ndim == 1]
    return max(widths, key=widths.count) if widths else _DEFAULT_WIDTH


@functools.cache
def _positions(code: types.CodeType) -> list[tuple]:
    return list(code.co_positions())


def executing_span(code: types.CodeType) -> Span | None:
    """The span of the expression the innermost running frame of `code` is
    evaluating, `None` when no frame of `code` is running.

    The only place that reads interpreter internals: CPython 3.11+ frames, whose
    `f_lasti` is a byte offset into 2-byte code units, indexing `co_positions()`."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code is not code:
        frame = frame.f_back
    if frame is None:
        return None
    line, end_line, column, end_column = _positions(code)[frame.f_lasti // 2]
    if line is None or column is None:
        return None
    return line, column, end_line, end_column


class _DataflowTracer(fx.Tracer):
    """Children are leaves; values carry meta tensors and forward source spans."""

    def __init__(self, root: nn.Module, optional_as_none: bool = False):
        super().__init__()
        self.forward_code = inspect.unwrap(type(root).forward).__code__
        self.optional_as_none = optional_as_none

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
        defaulting to `None` whose annotation names no tensor (a cache) gets `None`,
        and so does every input defaulting to `None` under `optional_as_none`;
        `*args` and `**kwargs` are empty. Inputs after the first are passed by name,
        as Transformers' callers pass them: a decorator that fills an input from
        the config when it was not passed (`merge_with_config_defaults`: LLaVA-NeXT's
        `vision_feature_layer`) looks for it among the keywords and, where it wraps
        another wrapper, cannot see it among the positional arguments, so it would
        be given twice."""
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
                or self.optional_as_none
            ):
                value = parameter.default
            else:
                value = self.create_proxy("placeholder", parameter.name, (), {})
            if parameter.kind == parameter.KEYWORD_ONLY or (
                index > 0 and parameter.kind != parameter.POSITIONAL_ONLY
            ):
                keywords[parameter.name] = value
            else:
                positional.append(value)

        def call_forward():
            return root_fn(self.root, *positional, **keywords)

        return call_forward, []

    def create_proxy(self, kind, target, args, kwargs, *rest, **kwrest) -> fx.Proxy:
        proxy = super().create_proxy(kind, target, args, kwargs, *rest, **kwrest)
        node = proxy.node
        span = executing_span(self.forward_code)
        if span is not None:
            node.meta["span"] = span
        if kind != "placeholder":
            node.meta["value"] = self._infer(kind, target, node.args, node.kwargs)
        return proxy

    def _infer(self, kind: str, target: Any, args: tuple, kwargs: dict) -> object:
        """The meta value of a new node, `UNKNOWN` where it cannot be inferred."""
        if kind == "get_attr":
            return _meta(_tensor_attribute(self.root, target))
        values = fx.node.map_arg(
            (args, kwargs), lambda n: n.meta.get("value", UNKNOWN)
        )
        meta_args, meta_kwargs = values
        if any(v is UNKNOWN for v in flatten(values)):
            if target in _BROADCASTING_OPS:
                known = [a for a in meta_args if isinstance(a, torch.Tensor)]
                return known[0] if len(known) == 1 else UNKNOWN
            return UNKNOWN
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
        return UNKNOWN

    def iter(self, obj: fx.Proxy) -> Iterator:
        value = obj.node.meta.get("value", UNKNOWN)
        if value is UNKNOWN or not hasattr(value, "__len__"):
            return super().iter(obj)
        return (obj[i] for i in range(len(value)))

    def keys(self, obj: fx.Proxy) -> Any:
        value = obj.node.meta.get("value", UNKNOWN)
        return value.keys() if isinstance(value, dict) else super().keys(obj)

    def to_bool(self, obj: fx.Proxy) -> bool:
        value = obj.node.meta.get("value", UNKNOWN)
        if value is UNKNOWN or isinstance(value, torch.Tensor):
            return super().to_bool(obj)
        return bool(value)


def _tensor_attribute(root: nn.Module, target: str) -> torch.Tensor | None:
    """The parameter or buffer `target`, read without `getattr`, which fx patches."""
    path, _, name = target.rpartition(".")
    owner = root.get_submodule(path)
    return owner._parameters.get(name, owner._buffers.get(name))


def flatten(value: object) -> Iterator[object]:
    if isinstance(value, list | tuple):
        for item in value:
            yield from flatten(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from flatten(item)
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
        return UNKNOWN
    if linears.is_linear(module):
        return torch.empty(
            (*tensor.shape[:-1], linears.out_features(module)),
            dtype=tensor.dtype,
            device="meta",
        )
    parameters = list(module.parameters())
    if any(True for _ in module.children()) or any(p.ndim != 1 for p in parameters):
        return UNKNOWN
    return tensor


_swap_lock = threading.RLock()
"""One swap at a time: two overlapping ones would restore each other's stand-in."""


@contextmanager
def _opaque_attention(*namespaces: dict[str, Any]) -> Iterator[None]:
    """Swaps `ALL_ATTENTION_FUNCTIONS` in each of `namespaces` that holds it for the
    recording stand-in, the way fx itself patches globals while it traces."""
    with _swap_lock:
        swapped = {
            id(namespace): (namespace, registry)
            for namespace in namespaces
            if (registry := namespace.get(_INTERFACE_REGISTRY)) is not None
        }
        for namespace, registry in swapped.values():
            namespace[_INTERFACE_REGISTRY] = _OpaqueAttentionFunctions(registry)
        try:
            yield
        finally:
            for namespace, registry in swapped.values():
                namespace[_INTERFACE_REGISTRY] = registry


def trace(module: nn.Module) -> Traced:
    """Trace `module.forward` as far as it goes, keeping child modules as leaves.

    A trace that stops early is tried again with every optional input at its default
    `None`, and that one is kept if it reaches the end: an optional tensor the caller
    never passes can steer the forward into a branch that never runs (GPT-2's
    attention takes its cross-attention branch when `encoder_hidden_states` is a
    tensor, and fails there on a module built without one)."""
    traced = _trace(module, optional_as_none=False)
    if traced.complete:
        return traced
    retried = _trace(module, optional_as_none=True)
    return retried if retried.complete else traced


def _trace(module: nn.Module, optional_as_none: bool) -> Traced:
    tracer = _DataflowTracer(module, optional_as_none)
    forward_globals = inspect.unwrap(type(module).forward).__globals__
    try:
        # Also where the registry lives: a forward that imports it in its body (as
        # remote code does) reads it from there when it runs, not from its globals.
        with _opaque_attention(forward_globals, vars(modeling_utils)):
            graph = tracer.trace(module)
    except Exception as error:  # noqa: BLE001 - any failure ends the trace where it is
        logger.debug("Tracing %s stopped early: %s", type(module).__name__, error)
        return Traced(
            tracer.graph, complete=False, stopped=f"{type(error).__name__}: {error}"
        )
    return Traced(graph, complete=True)

