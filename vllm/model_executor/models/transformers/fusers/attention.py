# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The module that calls the Transformers attention interface."""

import ast
import operator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Self

import torch
from torch import fx, nn

from vllm.model_executor.models.transformers import fx_utils
from vllm.model_executor.models.transformers import linears
from vllm.model_executor.models.transformers.fusers.base import (
    AttentionNeeds,
    BaseFuser,
    Declined,
)
from vllm.model_executor.models.transformers.fusers.heads import (
    HEAD_SIZE_ATTRIBUTES,
    NUM_HEADS_ATTRIBUTES,
    NUM_KV_HEADS_ATTRIBUTES,
    V_HEAD_SIZE_ATTRIBUTES,
    attribute_holding,
    heads_at,
    resolve,
)
from vllm.model_executor.models.transformers.rewriting import (
    forward_source,
    is_self_attribute,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig

INTERFACE_REGISTRY = "ALL_ATTENTION_FUNCTIONS"
VLLM_ATTENTION_FUNCTIONS = ("vllm", "vllm_mla")
"""The `_attn_implementation`s that dispatch into vLLM (registered in `__init__`)."""

HONOURED = {
    "scaling": "the softmax scale",
    "sliding_window": "a sliding window of this layer",
    "softcap": "attention logit soft-capping",
    "s_aux": "attention sinks (one logit per head)",
    "is_causal": "causal (True) or encoder-only, bidirectional (False) attention",
    "dropout": "dropout, which inference never applies",
    "deterministic": "flash attention's deterministic mode, which changes no value",
    "attention_mask": "the mask, which vLLM's attention metadata replaces",
    "position_ids": "positions, which vLLM's attention metadata replaces",
    "output_attentions": "attention weights, which vLLM never returns (None)",
}
"""Keyword arguments of the attention call vLLM's `Attention` honours, and how."""

LAYER_TYPES = {
    "full_attention": False,
    "sliding_attention": True,
    "hybrid": False,
    "hybrid_sliding": True,
}
"""`config.layer_types` entries for a layer with attention -> whether it slides
(`hybrid` layers hold a mixer beside their attention: Falcon-H1's)."""


def _registry_names(forward: ast.FunctionDef) -> set[str]:
    """The names the registry goes by in the forward: its own, and any alias the
    forward imports it as in its body (`from ... import ALL_ATTENTION_FUNCTIONS as
    x`, common in remote code)."""
    return {INTERFACE_REGISTRY} | {
        alias.asname
        for node in ast.walk(forward)
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
        if alias.name == INTERFACE_REGISTRY and alias.asname
    }


def _is_registry(value: ast.expr, names: set[str]) -> bool:
    """One of `names`, or `<module>.ALL_ATTENTION_FUNCTIONS`."""
    return (isinstance(value, ast.Name) and value.id in names) or (
        isinstance(value, ast.Attribute) and value.attr == INTERFACE_REGISTRY
    )


def _binds_interface(value: ast.expr, names: set[str]) -> bool:
    """`<registry>.get_interface(...)` or `<registry>[...]`."""
    if isinstance(value, ast.Call):
        value = value.func
        return (
            isinstance(value, ast.Attribute)
            and value.attr == "get_interface"
            and _is_registry(value.value, names)
        )
    return isinstance(value, ast.Subscript) and _is_registry(value.value, names)


def _interface_locals(forward: ast.FunctionDef) -> set[str]:
    """The local names the forward binds to an attention interface."""
    registry = _registry_names(forward)
    names = set()
    for node in ast.walk(forward):
        if isinstance(node, ast.Assign) and _binds_interface(node.value, registry):
            targets = node.targets
        elif (
            isinstance(node, ast.AnnAssign)
            and node.value
            and _binds_interface(node.value, registry)
        ):
            targets = [node.target]
        else:
            continue
        names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names


_UNRESOLVED = object()


_ARITHMETIC = {
    ast.Pow: operator.pow,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}
"""Operators between resolved numbers an argument may use (`self.head_dim**-0.5`)."""


_COMPARISONS = {
    ast.Is: operator.is_,
    ast.IsNot: operator.is_not,
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
}
"""Comparisons a condition on the instance may make (`self.window is not None`)."""
_PLAIN = (bool, int, float, str, type(None))
"""Values a condition may test: what a config or a flag holds, never a tensor."""


def _resolve_condition(expression: ast.expr, module: nn.Module) -> object:
    """The truth of a condition on `module`'s attributes (`self.use_window`,
    `self.kind == "local"`, `not ...`, `... and ...`); `_UNRESOLVED` where it reads
    anything but plain values of the instance (the input, a tensor)."""
    if isinstance(expression, ast.BoolOp):
        values = [_resolve_condition(v, module) for v in expression.values]
        if any(v is _UNRESOLVED for v in values):
            return _UNRESOLVED
        return all(values) if isinstance(expression.op, ast.And) else any(values)
    if isinstance(expression, ast.UnaryOp) and isinstance(expression.op, ast.Not):
        value = _resolve_condition(expression.operand, module)
        return value if value is _UNRESOLVED else not value
    if isinstance(expression, ast.Compare) and len(expression.ops) == 1:
        compare = _COMPARISONS.get(type(expression.ops[0]))
        left = _resolve_argument(expression.left, module)
        right = _resolve_argument(expression.comparators[0], module)
        if compare is None or not all(isinstance(v, _PLAIN) for v in (left, right)):
            return _UNRESOLVED
        try:
            return bool(compare(left, right))
        except TypeError:
            return _UNRESOLVED
    value = _resolve_argument(expression, module)
    return bool(value) if isinstance(value, _PLAIN) else _UNRESOLVED


def _resolve_argument(expression: ast.expr, module: nn.Module) -> object:
    """The value of an argument of the attention call on `module`: a literal,
    `self.<attr>[.<attr>...]`, `getattr(self..., "name", default)`, numbers of
    those combined by `**`, `*` and `/`, or `a if <condition> else b` with a
    condition on the instance's attributes (`_resolve_condition`), decided for this
    instance; `_UNRESOLVED` for anything else."""
    if isinstance(expression, ast.Constant):
        return expression.value
    if isinstance(expression, ast.IfExp):
        test = _resolve_condition(expression.test, module)
        if test is _UNRESOLVED:
            return _UNRESOLVED
        chosen = expression.body if test else expression.orelse
        return _resolve_argument(chosen, module)
    if isinstance(expression, ast.BinOp) and type(expression.op) in _ARITHMETIC:
        left = _resolve_argument(expression.left, module)
        right = _resolve_argument(expression.right, module)
        if not (_is_number(left) and _is_number(right)):
            return _UNRESOLVED
        try:
            return _ARITHMETIC[type(expression.op)](left, right)
        except ArithmeticError:
            return _UNRESOLVED
    if isinstance(expression, ast.UnaryOp) and isinstance(expression.op, ast.USub):
        value = _resolve_argument(expression.operand, module)
        return -value if isinstance(value, int | float) else _UNRESOLVED
    if isinstance(expression, ast.Call) and (
        isinstance(expression.func, ast.Name)
        and expression.func.id == "getattr"
        and len(expression.args) in (2, 3)
        and isinstance(expression.args[1], ast.Constant)
    ):
        owner = _resolve_argument(expression.args[0], module)
        if owner is _UNRESOLVED:
            return _UNRESOLVED
        default = (
            _resolve_argument(expression.args[2], module)
            if len(expression.args) == 3
            else _UNRESOLVED
        )
        return getattr(owner, expression.args[1].value, default)
    path = []
    while isinstance(expression, ast.Attribute):
        path.append(expression.attr)
        expression = expression.value
    if not (isinstance(expression, ast.Name) and expression.id == "self"):
        return _UNRESOLVED
    value: object = module
    for name in reversed(path):
        if not hasattr(value, name):
            return _UNRESOLVED
        value = getattr(value, name)
    return value


def _parts_per_head(linear: fx.Node, query: fx.Node) -> int:
    """`m` where `linear`'s output is viewed into heads of `m` parts and split on
    that last axis, the query (`query` is computed from) being the first part: each
    rank's share of the linear's rows then holds whole heads of every part. 1 where
    the dataflow is not so."""
    on_path = fx_utils.between(linear, query)

    def next_on_path(node: fx.Node | None) -> fx.Node | None:
        users = [] if node is None else [u for u in node.users if u in on_path]
        return users[0] if len(users) == 1 else None

    heads = next_on_path(linear)
    split = next_on_path(heads)
    first = next_on_path(split)
    if (
        fx_utils.op_name(heads) not in ("view", "reshape")
        or fx_utils.op_name(split) not in ("chunk", "split")
        or fx_utils.op_name(first) != "getitem"
        or first.args[1] != 0
    ):
        return 1
    whole, part = fx_utils.value(heads), fx_utils.value(first)
    if not isinstance(whole, torch.Tensor) or not isinstance(part, torch.Tensor):
        return 1
    dim = split.kwargs.get("dim", split.args[2] if len(split.args) > 2 else 0)
    parts, rest = divmod(whole.shape[-1], part.shape[-1])
    if whole.shape[:-1] != part.shape[:-1] or rest or dim not in (-1, whole.ndim - 1):
        return 1
    return parts


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _mask_argument(call: ast.Call) -> ast.expr | None:
    """The mask the attention call passes: `attention_mask=`, else its fifth
    positional argument (after module, query, key and value); `None` if neither."""
    for keyword in call.keywords:
        if keyword.arg == "attention_mask":
            return keyword.value
    return call.args[4] if len(call.args) > 4 else None


def _assignments(forward: ast.FunctionDef, name: str) -> list[ast.expr | None]:
    """The value of every binding of the local `name` in `forward` (`None` for one
    whose value the source does not show: `x += ...`, a loop target, an import)."""
    values: list[ast.expr | None] = []
    for node in ast.walk(forward):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name) and target.id == name:
                    values.append(node.value)
                elif any(n.id == name for n in _bound_names(target)):
                    values.append(None)  # unpacked: not one value of its own
        elif isinstance(node, ast.AnnAssign | ast.NamedExpr):
            if isinstance(node.target, ast.Name) and node.target.id == name:
                values.append(node.value)
        elif isinstance(node, ast.AugAssign | ast.For | ast.With | ast.comprehension):
            targets = (
                [item.optional_vars for item in node.items if item.optional_vars]
                if isinstance(node, ast.With)
                else [node.target]
            )
            if any(n.id == name for t in targets for n in _bound_names(t)):
                values.append(None)
    return values


def _bound_names(target: ast.expr) -> list[ast.Name]:
    return [
        n
        for n in ast.walk(target)
        if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load)
    ]


def _passes_mask_on(
    expression: ast.expr | None, forward: ast.FunctionDef, seen: frozenset[str]
) -> bool:
    """Whether `expression` only hands on a mask the forward was given: `None`, a
    parameter of the forward, a local bound only to such values, an element or
    slice of one (`mask["causal"]`, `mapping.get("causal")`, `m[:, :, :, :n]`),
    `x or {}`, `a if c else b`. Anything computed from other tensors is a mask of
    the module's own making, which vLLM's attention would drop."""
    if expression is None:
        return False
    if isinstance(expression, ast.Constant):
        return expression.value is None
    if isinstance(expression, ast.Dict):
        return not expression.keys  # `mask or {}`
    if isinstance(expression, ast.Name):
        name = expression.id
        if name in seen:
            return True  # a rebinding from itself adds nothing
        arguments = forward.args
        parameters = {
            a.arg
            for a in (*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs)
        } - {"self"}
        values = _assignments(forward, name)
        if name not in parameters and not values:
            return False  # a global or closure: not something the caller handed in
        return all(_passes_mask_on(v, forward, seen | {name}) for v in values)
    if isinstance(expression, ast.Subscript):
        return _passes_mask_on(expression.value, forward, seen)
    if isinstance(expression, ast.Call):
        function = expression.func
        return (
            isinstance(function, ast.Attribute)
            and function.attr == "get"
            and not expression.keywords
            and len(expression.args) in (1, 2)
            and all(isinstance(a, ast.Constant) for a in expression.args)
            and _passes_mask_on(function.value, forward, seen)
        )
    if isinstance(expression, ast.BoolOp) and isinstance(expression.op, ast.Or):
        return all(_passes_mask_on(v, forward, seen) for v in expression.values)
    if isinstance(expression, ast.IfExp):
        return _passes_mask_on(expression.body, forward, seen) and _passes_mask_on(
            expression.orelse, forward, seen
        )
    return False


@dataclass
class AttentionFuser(BaseFuser):
    """`interface = ALL_ATTENTION_FUNCTIONS.get_interface(...); interface(self, q, k, v, ...)`
    -> the module gets vLLM's `Attention` as `attn`, reached by `vllm_attention_forward`.

    The call is read from the forward's **source** (tracing may stop before the
    dispatch); where tracing reaches it, the dataflow also says which child computes
    the query, key and value and which one projects the output, and which attributes
    hold the heads, so each instance's heads are its own. The forward is left alone,
    so this fuser stands beside a QKV fuser."""

    kind = "attention"

    interface_call: str = ""
    """The source of the one call into the interface."""
    arguments: dict[str, ast.expr] = field(default_factory=dict)
    """Every keyword argument of that call (`**kwargs` passed on is not one)."""
    positional: int = 0
    """How many positional arguments the call passes (`module, q, k, v, mask`)."""
    location: str = ""
    """`file:line` of that call."""
    own_mask: str | None = None
    """The source of the mask the call passes where it is not one the forward was
    handed (`_passes_mask_on`), but one the module computes itself: vLLM's attention
    builds its own mask from its metadata and would drop this one."""
    sources: dict[str, str | None] = field(default_factory=dict)
    """Role (`q`, `k`, `v`, `o`) -> the direct child computing it, from dataflow."""
    attributes: dict[str, str | None] = field(default_factory=dict)
    """`head_size`, `head_size_v`, `num_heads`, `num_kv_heads` -> the attribute that
    holds it on the traced instance, if any."""
    traced: dict[str, int] = field(default_factory=dict)
    """The same four values as seen at the call on the traced instance."""
    same_as: dict[str, str] = field(default_factory=dict)
    """`num_kv_heads` -> `num_heads`, `head_size_v` -> `head_size` where no attribute
    holds the first but it equalled the second on the traced instance (MHA, values
    as wide as keys): each instance's own, not the traced instance's number."""
    query_parts: int = 1
    """How many times as wide as the query its linear is, each head's query first
    among its parts (`view(..., -1, 2 * head_size).chunk(2, -1)`: Qwen3-Next's
    query and output gate), as dataflow shows."""

    @classmethod
    def could_match(cls, module: nn.Module) -> bool:
        source = forward_source(type(module))
        return source is not None and bool(_interface_locals(source.tree))

    @classmethod
    def match(
        cls, graph: fx.Graph | None, module: nn.Module
    ) -> Self | Declined | None:
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
        mask = _mask_argument(call)
        own_mask = None
        if mask is not None and not _passes_mask_on(mask, source.tree, frozenset()):
            own_mask = ast.unparse(mask)
        fuser = cls(
            interface_call=ast.unparse(call.func),
            arguments={kw.arg: kw.value for kw in call.keywords if kw.arg is not None},
            positional=len(call.args),
            location=source.location(call),
            own_mask=own_mask,
        )
        if graph is not None:
            fuser._read_dataflow(graph, module)
        return fuser

    def _read_dataflow(self, graph: fx.Graph, module: nn.Module) -> None:
        """Fill `sources`, `attributes` and `traced` from the traced call, if reached."""
        attention = fx_utils.attention_node(graph)
        if attention is None:
            return
        roles = dict(zip("qkv", attention.args[:3]))
        for role, node in roles.items():
            linear = fx_utils.linear_feeding(node, module)
            self.sources[role] = None if linear is None else linear.target
            if role == "q" and linear is not None:
                self.query_parts = _parts_per_head(linear, node)
        output = fx_utils.linear_fed_by(attention, module)
        self.sources["o"] = None if output is None else output.target
        query, key, value = (heads_at(roles[r]) for r in "qkv")
        if query is None or key is None or value is None:
            return
        self.traced = {
            "head_size": query.shape[-1],
            "head_size_v": value.shape[-1],
            "num_heads": query.shape[1],
            "num_kv_heads": key.shape[1],
        }
        candidates = {
            "head_size": HEAD_SIZE_ATTRIBUTES,
            "head_size_v": V_HEAD_SIZE_ATTRIBUTES,
            "num_heads": NUM_HEADS_ATTRIBUTES,
            "num_kv_heads": NUM_KV_HEADS_ATTRIBUTES,
        }
        self.attributes = {
            name: attribute_holding(module, paths, self.traced[name])
            for name, paths in candidates.items()
        }
        for name, other in (
            ("num_kv_heads", "num_heads"),
            ("head_size_v", "head_size"),
        ):
            traced = self.traced[name]
            if self.attributes[name] is None and traced == self.traced[other]:
                self.same_as[name] = other

    def mismatch(self, module: nn.Module, vllm_config: "VllmConfig") -> str | None:
        # Only modules whose config was patched to dispatch into vLLM: this is what
        # leaves a vision tower, on its own config, to Transformers.
        config = getattr(module, "config", None)
        implementation = getattr(config, "_attn_implementation", None)
        if implementation not in VLLM_ATTENTION_FUNCTIONS:
            return f"its config dispatches attention to {implementation!r}, not vLLM"
        return None

    # Per instance -------------------------------------------------------------

    def describe(self, module: nn.Module) -> str:
        """`Class (layer N, file:line)`, for errors about this call."""
        layer = getattr(module, "layer_idx", "?")
        return f"{type(module).__name__} (layer {layer}, {self.location})"

    def layer_index(self, module: nn.Module) -> int:
        """The index the module declares, which is the one its KV cache is keyed by."""
        layer_idx = getattr(module, "layer_idx", None)
        if not isinstance(layer_idx, int) or isinstance(layer_idx, bool):
            raise ValueError(
                f"{type(module).__name__} calls the attention interface "
                f"({self.location}) but declares no integer `layer_idx` "
                f"(found {layer_idx!r}), so vLLM cannot tell which KV cache it uses."
            )
        return layer_idx

    def _value(
        self,
        module: nn.Module,
        name: str,
        fallbacks: tuple[str, ...],
        default: int | None = None,
        same: int | None = None,
    ) -> int:
        """This instance's `name` (a head size or count): the attribute that held it
        on the traced instance, else `same` (this instance's value of what it equalled
        there, `same_as`), else the value traced, else the first of `fallbacks` that
        holds a positive integer, else `default`."""
        if (attribute := self.attributes.get(name)) is not None:
            value = resolve(module, attribute)
        elif name in self.same_as and same is not None:
            value = same
        elif name in self.traced:
            value = self.traced[name]
        else:
            value = next(
                (
                    v
                    for path in fallbacks
                    if type(v := resolve(module, path)) is int and v > 0
                ),
                default,
            )
        if type(value) is not int or value <= 0:
            raise ValueError(
                f"{self.describe(module)}: cannot tell its {name.replace('_', ' ')} "
                f"(found {value!r}), so vLLM's attention cannot be built for it."
            )
        return value

    def head_size(self, module: nn.Module) -> int:
        """This instance's query/key head size."""
        config = getattr(module, "config", None)
        hidden = getattr(config, "hidden_size", None)
        heads = getattr(config, "num_attention_heads", None)
        default = hidden // heads if _is_number(hidden) and _is_number(heads) else None
        return self._value(module, "head_size", HEAD_SIZE_ATTRIBUTES, default)

    def scale(self, module: nn.Module) -> float:
        """The softmax scale the module passes as `scaling=`, resolved on `module`.

        The argument wins over any attribute: OPT scales the query itself and passes
        `scaling=1.0`. With no `scaling=` (or `scaling=None`), the interface's
        default: the module's own head size `** -0.5`."""
        expression = self.arguments.get("scaling")
        if expression is None:
            return self.head_size(module) ** -0.5
        value = _resolve_argument(expression, module)
        if value is None:
            return self.head_size(module) ** -0.5
        if value is _UNRESOLVED:
            raise ValueError(
                f"{self.describe(module)} passes scaling={ast.unparse(expression)} to "
                "the attention interface, which the Transformers modeling backend "
                "cannot resolve: it needs a number or `self.<attribute>`. Store the "
                "scale in an attribute and pass that."
            )
        if not _is_number(value):
            raise ValueError(
                f"{self.describe(module)} passes scaling={ast.unparse(expression)} to "
                f"the attention interface, which is {value!r} on this module, not a "
                "number, so vLLM's attention cannot be built with it."
            )
        return float(value)

    def _argument(self, module: nn.Module, name: str) -> object:
        """The resolved keyword argument `name`; a construction error naming the
        module, its layer and the argument when it cannot be resolved."""
        expression = self.arguments[name]
        value = _resolve_argument(expression, module)
        if value is _UNRESOLVED:
            raise ValueError(
                f"{self.describe(module)} passes {name}={ast.unparse(expression)} to "
                f"the attention interface ({HONOURED[name]}), which the Transformers "
                "modeling backend cannot resolve on the module before it runs, so it "
                "cannot build vLLM's attention to honour it."
            )
        return value

    def _check_arguments(self, module: nn.Module) -> None:
        if self.positional > 5:
            raise ValueError(
                f"{self.describe(module)} passes {self.positional} positional "
                "arguments to the attention interface; vLLM's attention takes "
                "(module, query, key, value, attention_mask) and keywords it honours "
                f"({', '.join(HONOURED)})."
            )
        for name in self.arguments:
            if name not in HONOURED:
                raise ValueError(
                    f"{self.describe(module)} passes {name}= to the attention "
                    "interface, which vLLM's attention cannot honour (it honours "
                    f"{', '.join(HONOURED)}), so the Transformers modeling backend "
                    "cannot serve this layer."
                )
        if self.own_mask is not None:
            raise ValueError(
                f"{self.describe(module)} passes the attention interface a mask it "
                f"computes itself ({self.own_mask}), not the one it was handed; "
                "vLLM's attention masks from its own metadata and would drop it, so "
                "the Transformers modeling backend cannot serve this layer."
            )
        if "output_attentions" in self.arguments:
            wants = _resolve_argument(self.arguments["output_attentions"], module)
            if wants is not _UNRESOLVED and wants:
                raise ValueError(
                    f"{self.describe(module)} asks the attention interface for its "
                    "weights (output_attentions=True), which vLLM never computes."
                )

    def sliding_window(self, module: nn.Module) -> int | None:
        """The window this layer slides over, `None` for full attention: the call's
        `sliding_window=` (resolved on this instance, or refused like any other
        argument that cannot be), else what `config.layer_types` says."""
        if "sliding_window" in self.arguments:
            value = self._argument(module, "sliding_window")
            if value is None or (_is_number(value) and value > 0):
                return value
            raise ValueError(
                f"{self.describe(module)} passes sliding_window="
                f"{ast.unparse(self.arguments['sliding_window'])}, which is "
                f"{value!r} on this module."
            )
        config = getattr(module, "config", None)
        layer_types = getattr(config, "layer_types", None)
        if layer_types is None:
            return None
        index = self.layer_index(module)
        layer_type = layer_types[index] if index < len(layer_types) else None
        if layer_type not in LAYER_TYPES:
            raise ValueError(
                f"{self.describe(module)}: config.layer_types[{index}] is "
                f"{layer_type!r}; vLLM's attention in this backend serves "
                f"{', '.join(LAYER_TYPES)} layers only."
            )
        if not LAYER_TYPES[layer_type]:
            return None
        return getattr(config, "sliding_window", None)

    def causal(self, module: nn.Module) -> bool:
        """Whether each token sees only those before it, decided as Transformers'
        attention functions decide it: the call's `is_causal=` where it passes one
        that is not `None`, else the module's own `is_causal` (BERT's and ModernBERT's
        encoders set it `False`), else causal."""
        value = None
        if "is_causal" in self.arguments:
            value = self._argument(module, "is_causal")
        if value is None:
            value = getattr(module, "is_causal", True)
        if not isinstance(value, bool):
            raise ValueError(
                f"{self.describe(module)}: its attention is causal or not by "
                f"{value!r}, which is not a bool, so the backend cannot tell whether "
                "vLLM's attention must be causal or encoder-only."
            )
        return value

    def attention_needs(
        self, module: nn.Module, vllm_config: "VllmConfig"
    ) -> AttentionNeeds:
        """What vLLM's attention must be for this instance. Every argument of the
        call is honoured here or refused with module, layer and argument named."""
        self._check_arguments(module)
        head_size = self.head_size(module)
        num_heads = self._value(module, "num_heads", NUM_HEADS_ATTRIBUTES)
        num_kv_heads = self._value(
            module, "num_kv_heads", NUM_KV_HEADS_ATTRIBUTES, num_heads, same=num_heads
        )
        head_size_v = self._value(module, "head_size_v", (), head_size, same=head_size)
        self._check_widths(module, num_heads, num_kv_heads, head_size, head_size_v)
        soft_cap = None
        if "softcap" in self.arguments:
            soft_cap = self._argument(module, "softcap")
            if soft_cap is not None and not _is_number(soft_cap):
                raise ValueError(
                    f"{self.describe(module)} passes softcap={soft_cap!r}, not a number."
                )
        sinks = None
        if "s_aux" in self.arguments:
            expression = self.arguments["s_aux"]
            held = (
                getattr(module, expression.attr, None)
                if is_self_attribute(expression)
                else expression
            )
            # `None` on this instance: a layer without sinks (MiMo-V2-Flash's full
            # attention layers) beside ones that have them.
            if isinstance(held, torch.Tensor):
                sinks = expression.attr
            elif held is not None:
                raise ValueError(
                    f"{self.describe(module)} passes s_aux={ast.unparse(expression)}; "
                    "vLLM's attention takes sinks only from a parameter of the module "
                    "(`s_aux=self.<parameter>`)."
                )
        causal = self.causal(module)
        return AttentionNeeds(
            layer_index=self.layer_index(module),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_size=head_size,
            head_size_v=head_size_v,
            scale=self.scale(module),
            sliding_window=self.sliding_window(module),
            logits_soft_cap=None if soft_cap is None else float(soft_cap),
            sinks=sinks,
            causal=bool(causal),
            sources=dict(self.sources),
        )

    def _check_widths(
        self,
        module: nn.Module,
        num_heads: int,
        num_kv_heads: int,
        head_size: int,
        head_size_v: int,
    ) -> None:
        """Each linear computing one role must be as wide as the heads this instance
        says it has: head counts traced on another instance of the class (no
        attribute holds them) are caught here when this instance's differ. A linear
        computing several roles is left alone: packed, the key reused as the value
        (Gemma 4), or keys completed from another linear (latent attention), its
        width alone cannot say which, and the fuser that stacks it checks it."""
        expected = dict(
            q=num_heads * head_size * self.query_parts,
            k=num_kv_heads * head_size,
            v=num_kv_heads * head_size_v,
        )
        roles: dict[str, list[str]] = {}
        for role in "qkv":
            if (name := self.sources.get(role)) is not None:
                roles.setdefault(name, []).append(role)
        for name, computed in roles.items():
            linear = getattr(module, name, None)
            if len(computed) != 1 or not linears.is_linear(linear):
                continue
            (role,) = computed
            if (width := linears.out_features(linear)) != expected[role]:
                raise ValueError(
                    f"{self.describe(module)}: {name} computes the {role} {width} "
                    f"wide, but the module's heads say {expected[role]} "
                    f"({num_heads} query / {num_kv_heads} key-value heads of "
                    f"{head_size}); vLLM's attention would be built wrong."
                )

    def info(self, name: str, module: nn.Module) -> str:
        return (
            f"Attention interface call: {name} ({type(module).__name__}, "
            f"{self.location}) -> vLLM attention for layer {self.layer_index(module)}"
        )
