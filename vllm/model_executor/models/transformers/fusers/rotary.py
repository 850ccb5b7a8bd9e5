# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The rotary position embedding an attention module applies, on vLLM's kernel."""

import ast
import hashlib
import inspect
import re
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Self

import torch
from torch import fx, nn

from vllm import _custom_ops as ops
from vllm.model_executor.models.transformers.fusers.attention import AttentionFuser
from vllm.model_executor.models.transformers.fusers.base import (
    BaseFuser,
    Declined,
    ProbeResults,
)
from vllm.model_executor.models.transformers.fusers.heads import (
    HEAD_SIZE_ATTRIBUTES,
    resolve,
)
from vllm.model_executor.models.transformers.fusers.rotary_embedding import (
    RotaryEmbeddingFuser,
    frequencies,
    is_rotary_embedding,
)
from vllm.model_executor.models.transformers.fusers.mla import MLAFuser
from vllm.model_executor.models.transformers.fusers.probes import Draws
from vllm.model_executor.models.transformers.rewriting import (
    forward_source,
    loaded_names,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.model_executor.models.transformers.plan import FusionPlan

ROTARY_FUNCTION = re.compile(r"rot|rope", re.IGNORECASE)
"""Names of the module-level functions that may apply a rotary embedding
(`apply_rotary_pos_emb`); which of them do is proven by probing them."""
LAYOUTS = (1, 2)
"""Where the head dimension of the query may sit: `[batch, heads, tokens, head]` (1)
or `[batch, tokens, heads, head]` (2); cos and sin are `[batch, tokens, width]`."""
_PROBE_HEADS, _PROBE_KV_HEADS, _PROBE_TOKENS = 4, 2, 3
CONSUMERS = frozenset({AttentionFuser.__name__, MLAFuser.__name__, "RotaryFuser"})
"""Fusers whose modules may consume a rotary embedding's cos and sin."""


def neox(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim_at: int
) -> torch.Tensor:
    """What vLLM's rotary kernel computes in neox style, written out: the first
    `2 * w` channels of each head (`w` the width of `cos`) rotated as two halves
    by the angle whose cos and sin are given, the other channels passed through."""
    width = cos.shape[-1]
    cos, sin = cos.unsqueeze(head_dim_at), sin.unsqueeze(head_dim_at)
    first, second = x[..., :width], x[..., width : 2 * width]
    return torch.cat(
        (first * cos - second * sin, second * cos + first * sin, x[..., 2 * width :]),
        dim=-1,
    )


def rotate(
    query: torch.Tensor,
    key: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    head_dim_at: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`neox` of the query and the key, by vLLM's kernel, on copies (the inputs may
    be views of a projection that something else reads)."""
    query = query.movedim(head_dim_at, 2).clone(memory_format=torch.contiguous_format)
    key = key.movedim(head_dim_at, 2).clone(memory_format=torch.contiguous_format)
    batch, tokens, _, head_size = query.shape
    count = batch * tokens
    # One row of the kernel's cos/sin cache per token, each at its own position.
    cache = torch.cat((cos, sin), dim=-1).to(query.dtype)
    cache = cache.expand(batch, tokens, -1).reshape(count, -1)
    positions = torch.arange(count, device=query.device)
    ops.rotary_embedding(
        positions, query.view(count, -1), key.view(count, -1), head_size, cache, True
    )
    return query.movedim(2, head_dim_at), key.movedim(2, head_dim_at)


def _rotates(
    function: Callable,
    channels: int,
    width: int,
    head_dim_at: int,
    args: tuple,
    kwargs: tuple[tuple[str, Any], ...],
) -> bool:
    """Whether `function(q, k, cat(c, c), cat(s, s), *args, **kwargs)` equals `neox`
    of `q` and `k` with `c` and `s` of width `width`, on heads of `channels` laid
    out as `head_dim_at` says; float64, random values. Probed once per inputs."""
    key = (function, channels, width, head_dim_at, args, kwargs)
    return _rotations.get(
        key, lambda: _probe(function, channels, width, head_dim_at, args, dict(kwargs))
    )


def _probe(
    function: Callable,
    channels: int,
    width: int,
    head_dim_at: int,
    args: tuple,
    kwargs: dict[str, Any],
) -> bool:
    draws = Draws(seed=width)

    def heads(count: int) -> torch.Tensor:
        shape = [1, count, _PROBE_TOKENS, channels]
        if head_dim_at == 2:
            shape[1], shape[2] = shape[2], shape[1]
        return draws.normal(shape)

    q, k = heads(_PROBE_HEADS), heads(_PROBE_KV_HEADS)
    cos = draws.normal((1, _PROBE_TOKENS, width))
    sin = draws.normal((1, _PROBE_TOKENS, width))
    try:
        with torch.no_grad():
            out = function(
                q.clone(),
                k.clone(),
                torch.cat((cos, cos), dim=-1),
                torch.cat((sin, sin), dim=-1),
                *args,
                **kwargs,
            )
    except Exception:  # noqa: BLE001 - a width the function cannot take
        return False
    expected = (neox(q, cos, sin, head_dim_at), neox(k, cos, sin, head_dim_at))
    return (
        isinstance(out, tuple | list)
        and len(out) == 2
        and all(
            isinstance(o, torch.Tensor)
            and o.shape == e.shape
            and o.dtype == e.dtype
            and torch.allclose(o, e, rtol=1e-12, atol=1e-12)
            for o, e in zip(out, expected)
        )
    )


def proven_widths(
    function: Callable,
    channels: int,
    head_dim_at: int,
    args: tuple,
    kwargs: tuple[tuple[str, Any], ...],
) -> frozenset[int]:
    """The half widths `w` at which `function` rotates heads of `channels` as the
    kernel does (`_rotates`). From 2: at width 1 every pairing of channels is the
    same (neox's and GPT-J's)."""
    return frozenset(
        width
        for width in range(2, channels // 2 + 1)
        if _rotates(function, channels, width, head_dim_at, args, kwargs)
    )


_rotations = ProbeResults()
"""(function, channels, half width, layout, arguments) -> whether it rotates so."""
_renamed_code = ProbeResults()
"""(code, old global, new global) -> the code reading the new one."""


@dataclass(frozen=True)
class _Call:
    """A call `function(q, k, cos, sin, *args, **kwargs)` in the forward's source."""

    name: str
    args: tuple
    kwargs: tuple[tuple[str, Any], ...]


def _rotary_calls(
    forward: ast.FunctionDef, namespace: dict[str, Any]
) -> list[ast.Call]:
    """The calls of module-level functions named like a rotary embedding."""
    return [
        node
        for node in ast.walk(forward)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and ROTARY_FUNCTION.search(node.func.id)
        and isinstance(namespace.get(node.func.id), types.FunctionType)
    ]


def _read_call(call: ast.Call) -> _Call | str:
    """The call's function and constant arguments after (q, k, cos, sin), or why it
    is not of that form."""
    source = ast.unparse(call)
    if len(call.args) < 4 or any(isinstance(a, ast.Starred) for a in call.args):
        return f"`{source}` does not pass (query, key, cos, sin)"
    extra = [*call.args[4:], *(k.value for k in call.keywords)]
    if any(k.arg is None for k in call.keywords) or not all(
        isinstance(e, ast.Constant) for e in extra
    ):
        return f"`{source}` passes arguments other than constants after cos and sin"
    return _Call(
        name=call.func.id,
        args=tuple(a.value for a in call.args[4:]),
        kwargs=tuple((k.arg, k.value.value) for k in call.keywords),
    )


def _none_test(node: ast.Name, tree: ast.AST) -> bool:
    """Whether `node` is only compared with `None` (`x is None`, `x is not None`)."""
    return any(
        isinstance(c, ast.Compare)
        and c.left is node
        and all(isinstance(op, ast.Is | ast.IsNot) for op in c.ops)
        and all(isinstance(v, ast.Constant) and v.value is None for v in c.comparators)
        for c in ast.walk(tree)
    )


def _read_elsewhere(forward: ast.FunctionDef, calls: list[ast.Call]) -> str | None:
    """Why the cos and sin the calls rotate by may reach anything else, or `None`:
    each must be a local read by those calls alone, and a tuple they are unpacked
    from (`cos, sin = position_embeddings`) read nowhere else but for `is None`."""
    handed = [a for c in calls for a in c.args[2:4]]
    if not all(isinstance(a, ast.Name) for a in handed):
        return "cos and sin are not handed to it as local names"
    for name in {a.id for a in handed}:
        if any(not any(n is a for a in handed) for n in loaded_names(forward, name)):
            return f"`{name}` is read elsewhere in the forward"
        for statement in ast.walk(forward):
            if not (
                isinstance(statement, ast.Assign)
                and isinstance(statement.value, ast.Name)
                and any(
                    isinstance(t, ast.Tuple)
                    and any(isinstance(e, ast.Name) and e.id == name for e in t.elts)
                    for t in statement.targets
                )
            ):
                continue
            source = statement.value.id
            for load in loaded_names(forward, source):
                if load is not statement.value and not _none_test(load, forward):
                    return f"`{source}` is read elsewhere in the forward"
    return None


def head_size_of(module: nn.Module) -> int | None:
    """The instance's head size, read as the attention fuser reads it."""
    return next(
        (
            held
            for path in HEAD_SIZE_ATTRIBUTES
            if type(held := resolve(module, path)) is int
        ),
        None,
    )


def _renamed(code: types.CodeType, old: str, new: str) -> types.CodeType:
    """`code`, nested code included, reading the global `new` where it read `old`
    (`match` declines a forward that also uses `old` as an attribute name, which
    shares the same table of names)."""
    consts = tuple(
        _renamed(c, old, new) if isinstance(c, types.CodeType) else c
        for c in code.co_consts
    )
    names = tuple(new if n == old else n for n in code.co_names)
    return code.replace(co_names=names, co_consts=consts)


def _names(code: types.CodeType, name: str) -> bool:
    """Whether `code`, nested code included, reads the global (or attribute) `name`."""
    return name in code.co_names or any(
        _names(c, name) for c in code.co_consts if isinstance(c, types.CodeType)
    )


@dataclass
class RotaryFuser(BaseFuser):
    """`apply_rotary_pos_emb(q, k, cos, sin)` -> `rotary_embedding(positions, q, k,
    head_size, cat(cos, sin))`, vLLM's neox-style rotary kernel, where the rotary
    embedding hands over half-width cos and sin (`rotary_embedding.py`).

    The function is found by name in the forward's source and proven by probing it:
    given cos and sin that repeat their halves, it must rotate each head as the kernel
    does (channels `[0, w)` against `[w, 2w)`, the rest passed through). GPT-J style
    (interleaved) functions differ there and are declined. The forward itself is not
    rewritten: each instance gets a copy whose code calls the fused function (kept in
    the modeling module's globals under a name of its own) where it called the
    original, so this composes with any rewrite of the same forward. The fused
    function falls back to the original, on the whole cos and sin, for any call it
    was not proven on (another head size, other arguments)."""

    needs_graph = False
    kind = "rotary"
    summary = "rotary embeddings on vLLM's kernel in {n} attention modules"
    coverage = "rotary"

    call: _Call | None = None
    head_dim_at: int = 1

    @classmethod
    def could_match(cls, module: nn.Module) -> bool:
        source = forward_source(type(module))
        return source is not None and bool(
            _rotary_calls(source.tree, inspect.unwrap(type(module).forward).__globals__)
        )

    @classmethod
    def match(cls, graph: fx.Graph | None, module: nn.Module) -> Self | Declined:
        forward = type(module).forward
        if inspect.unwrap(forward) is not forward:
            return cls.decline(module, "its forward is wrapped by a decorator")
        source = forward_source(type(module))
        nodes = _rotary_calls(source.tree, forward.__globals__)
        calls = [_read_call(c) for c in nodes]
        if reason := next((c for c in calls if isinstance(c, str)), None):
            return cls.decline(module, reason)
        # Half-width cos and sin are right for the fused function alone.
        if reason := _read_elsewhere(source.tree, nodes):
            return cls.decline(module, reason)
        if len(set(calls)) != 1:
            listed = ", ".join(sorted({c.name for c in calls}))
            return cls.decline(
                module, f"it applies rotary embeddings differently ({listed})"
            )
        call = calls[0]
        if any(
            isinstance(n, ast.Attribute) and n.attr == call.name
            or isinstance(n, ast.alias) and call.name in (n.name, n.asname)
            for n in ast.walk(source.tree)
        ):
            return cls.decline(module, f"its forward also uses {call.name} as a name")
        head_size = head_size_of(module)
        if head_size is None:
            return cls.decline(module, "it holds no head size (head_dim, ...)")
        function = forward.__globals__[call.name]
        proven = {
            layout: proven_widths(function, head_size, layout, call.args, call.kwargs)
            for layout in LAYOUTS
        }
        layouts = [layout for layout, widths in proven.items() if widths]
        if len(layouts) != 1:
            return cls.decline(
                module,
                f"{call.name} does not rotate the halves of heads of {head_size} as "
                "vLLM's neox-style kernel does"
                if not layouts
                else f"{call.name} rotates heads in more than one layout",
            )
        return cls(call=call, head_dim_at=layouts[0])

    def proven(self, module: nn.Module, channels: int, width: int) -> bool:
        """Whether the function `module`'s forward calls is proven to rotate a query
        of `channels` per head as the kernel does, given cos of half width `width`."""
        original = self._original(module.forward.__func__)
        return width in proven_widths(
            original, channels, self.head_dim_at, self.call.args, self.call.kwargs
        )

    def proven_pairs(
        self, original: Callable, head_size: int
    ) -> frozenset[tuple[int, int]]:
        """The (channels, half width) calls the fused function may take the kernel
        for on heads of `head_size`: the whole head at each width proven, and the
        rotary channels alone (`2 * w`, partial rotaries that hand the function
        only those) at each width `w` where that is proven."""
        args, kwargs = self.call.args, self.call.kwargs
        whole = proven_widths(original, head_size, self.head_dim_at, args, kwargs)
        alone = (
            w
            for w in range(2, head_size // 2 + 1)
            if _rotates(original, 2 * w, w, self.head_dim_at, args, kwargs)
        )
        return frozenset({(head_size, w) for w in whole} | {(2 * w, w) for w in alone})

    def _original(self, forward: Callable) -> Callable:
        return forward.__globals__[self.call.name]

    def mismatch(self, module: nn.Module, vllm_config: "VllmConfig") -> str | None:
        if head_size_of(module) is None:
            return "this instance holds no head size (head_dim, ...)"
        forward = getattr(module.forward, "__func__", None)
        if forward is None or not _names(forward.__code__, self.call.name):
            return f"this instance's forward does not call {self.call.name}"
        return None

    def fuse(
        self, module: nn.Module, prefix: str, vllm_config: "VllmConfig"
    ) -> nn.Module:
        # The forward as it is now: the class's, or a rewrite bound to the instance.
        forward = module.forward.__func__
        original = self._original(forward)
        proven = self.proven_pairs(original, head_size_of(module))
        fused_name = self._install(forward.__globals__, original, proven)
        code = _renamed_code.get(
            (forward.__code__, self.call.name, fused_name),
            lambda: _renamed(forward.__code__, self.call.name, fused_name),
        )
        rebound = types.FunctionType(
            code,
            forward.__globals__,
            forward.__name__,
            forward.__defaults__,
            forward.__closure__,
        )
        rebound.__kwdefaults__ = forward.__kwdefaults__
        module.forward = types.MethodType(rebound, module)
        return module

    def _install(
        self,
        namespace: dict[str, Any],
        original: Callable,
        proven: frozenset[tuple[int, int]],
    ) -> str:
        """The name in `namespace` (the modeling module's globals) under which the
        fused function for `original` and `proven` lives, written there once.

        The forward's code reads the function by that name and its globals stay the
        module's (torch.compile guards on them by module). This is the one write
        into Transformers' modules that outlives the build: the name is a digest
        of what the function is built from, the same in every process, so building
        the same model again writes nothing new, and a model with other heads
        (other proven widths) adds one name."""
        built_from = (
            original.__module__,
            original.__qualname__,
            self.call.args,
            self.call.kwargs,
            self.head_dim_at,
            sorted(proven),
        )
        digest = hashlib.sha256(repr(built_from).encode()).hexdigest()[:12]
        name = f"{self.call.name}_on_vllm_kernel_{digest}"
        # Another function of that name (a modeling module loaded again) keeps its own.
        while (held := namespace.get(name)) is not None and (
            getattr(held, "__wrapped__", None) is not original
        ):
            name += "_"
        if held is None:
            namespace[name] = self._fused_function(original, proven)
        return name

    def _fused_function(
        self, original: Callable, proven: frozenset[tuple[int, int]]
    ) -> Callable:
        """`original`, on vLLM's kernel for the (channels, half width) `proven`."""
        args, kwargs = self.call.args, dict(self.call.kwargs)
        head_dim_at = self.head_dim_at

        def fused(query, key, cos, sin, *rest, **options):
            if (
                rest == args
                and options == kwargs
                and query.dim() == key.dim() == 4
                and cos.dim() == 3
                and sin.shape == cos.shape
                and key.shape[-1] == query.shape[-1]
                and (query.shape[-1], cos.shape[-1]) in proven
            ):
                return rotate(query, key, cos, sin, head_dim_at)
            # Not a call the kernel was proven on: the original, on the whole cos and
            # sin (the rotary embedding hands over their first half).
            return original(
                query,
                key,
                torch.cat((cos, cos), dim=-1),
                torch.cat((sin, sin), dim=-1),
                *rest,
                **options,
            )

        fused.__name__ = f"{original.__name__}_on_vllm_kernel"
        fused.__wrapped__ = original
        return fused

    @classmethod
    def cross_check(cls, plan: "FusionPlan") -> str | None:
        return unpaired(plan)

    def info(self, name: str, module: nn.Module) -> str:
        return (
            f"Fused: {self.call.name} ({name}: {type(module).__name__}) -> "
            "vLLM's rotary kernel"
        )


def handed_width(embedding: nn.Module) -> int | str:
    """The width of the cos and sin `embedding` hands over once halved (read off one
    position through its original forward), or why it cannot be read."""
    device = frequencies(embedding).device
    x = torch.zeros(1, 1, device=device)
    position_ids = torch.zeros(1, 1, dtype=torch.long, device=device)
    try:
        with torch.no_grad():
            cos, sin = type(embedding).forward(embedding, x, position_ids)
    except Exception as error:  # noqa: BLE001 - whatever the model's code raises
        return f"it cannot be run on one position: {type(error).__name__}: {error}"
    return cos.shape[-1] // 2


def unpaired(plan: "FusionPlan") -> str | None:
    """Why the model's rotary embeddings and the modules that consume them cannot
    take their fusions together, or `None`. Half-width cos and sin are right only for
    the fused rotary function, so every rotary embedding must make them, every module
    that may consume them (each module analysed as dispatching attention or applying
    a rotary function) must take the fused function, and each of those must be proven
    on the width every embedding hands over; else neither side is fused."""
    widths: dict[int, str] = {}
    for module in (m for m in plan.analysed if is_rotary_embedding(m)):
        described = (
            f"the rotary embedding {plan.name(module)} ({type(module).__name__})"
        )
        if plan.fuser(module, RotaryEmbeddingFuser) is None:
            return f"{described} keeps its whole width: {plan.why_not(module)}"
        width = handed_width(module)
        if isinstance(width, str):
            return f"{described}: {width}"
        widths.setdefault(width, described)
    if not widths:
        return "no rotary embedding of this model makes its cos and sin at half width"
    consumers = 0
    for module, analysis in plan.analysed.items():
        found = {type(f).__name__ for f in analysis.fusers}
        found |= {d.fuser for d in analysis.declined}
        if not found & CONSUMERS:
            continue
        consumers += 1
        described = f"{plan.name(module)} ({type(module).__name__})"
        fuser = plan.fuser(module, RotaryFuser)
        if fuser is None:
            return (
                f"{described} does not apply the rotary embedding on vLLM's kernel: "
                f"{plan.why_not(module)}"
            )
        head_size = head_size_of(module)
        for width, embedding in widths.items():
            # A partial rotary hands the function the rotary channels alone (Phi).
            if not (
                fuser.proven(module, head_size, width)
                or fuser.proven(module, 2 * width, width)
            ):
                return (
                    f"{described} is not proven to rotate as vLLM's kernel does at the "
                    f"half width {width} that {embedding} hands over"
                )
    if not consumers:
        return "no module of this model applies the rotary embedding on vLLM's kernel"
    return None
