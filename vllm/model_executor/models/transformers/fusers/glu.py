# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Gated linear units: gate and up projections, stacked, with vLLM's act-and-mul."""

import ast
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Self

import torch.nn.functional as F
from torch import fx, nn
from vllm.model_executor.layers.linear import MergedColumnParallelLinear

from vllm.model_executor.models.transformers import (
    fx_utils,
    linears,
    rewriting,
    tracing,
)
from vllm.model_executor.models.transformers.fusers.base import (
    Declined,
    FusionDeclined,
    ProbeResults,
    StackedFuser,
)
from vllm.model_executor.models.transformers.fusers.projections import (
    called_once,
    children_between,
    row_parallel,
    whole_width,
)
from vllm.model_executor.models.transformers.layer_classes import act_and_mul
from vllm.model_executor.models.transformers.rewriting import ForwardRewrite, Span

if TYPE_CHECKING:
    from vllm.config import VllmConfig


def _activation(node: fx.Node, module: nn.Module) -> str | None:
    """vLLM's act-and-mul name for the activation `node` applies, from what it computes
    (`F.silu`, `F.gelu`), whether it is a function call or a child module."""
    if (child := fx_utils.submodule(node, module)) is not None:
        return _activation_of_module(child)
    if node.op != "call_function":
        return None
    if node.target is F.silu:
        return "silu"
    if node.target is F.gelu:
        approximate = node.kwargs.get("approximate", "none")
        return {"none": "gelu", "tanh": "gelu_pytorch_tanh"}.get(approximate)
    return None


_FUNCTIONS = {F.silu: "silu", F.gelu: "gelu"}
"""Activation functions an instance may hold as a plain attribute (`self.act = F.silu`)
and vLLM's act-and-mul name for each, with their default arguments."""


_activations = ProbeResults()
"""`_state(module)` -> what `_traced_activation(module)` found for it."""


_MODULE_INTERNALS = frozenset(vars(nn.Module())) - {"training"}
"""What every `nn.Module` keeps in its `__dict__` (hooks, parameter dicts...)."""


def _state(module: nn.Module) -> Hashable | None:
    """Everything that decides what an activation module computes: its class, its
    plain attributes (`GELUActivation`'s function, an `approximate=`), the names of
    its parameters and buffers, and its children's states; `None` where an attribute
    cannot be compared (then the module is traced itself)."""
    plain = tuple(
        sorted(
            (name, value)
            for name, value in vars(module).items()
            if name not in _MODULE_INTERNALS
        )
    )
    children = tuple((n, _state(c)) for n, c in module.named_children())
    state = (
        type(module),
        plain,
        tuple(module._parameters),
        tuple(module._buffers),
        children,
    )
    try:
        hash(state)
    except TypeError:
        return None
    return None if any(c is None for _, c in children) else state


def _activation_of_module(child: object) -> str | None:
    """vLLM's act-and-mul name for the activation module `child` computes: traced
    once per state (`_state`), not once per instance, since a model holds one
    activation per layer."""
    if not isinstance(child, nn.Module):
        return None
    state = _state(child)
    if state is None:
        return _traced_activation(child)
    return _activations.get(state, lambda: _traced_activation(child))


def _traced_activation(child: nn.Module) -> str | None:
    traced = tracing.trace(child)
    calls = [n for n in traced.graph.nodes if n.op not in ("placeholder", "output")]
    if not traced.complete or len(calls) != 1:
        return None
    return _activation(calls[0], child)


def _activation_source(act: fx.Node, module: nn.Module) -> str | Declined:
    """Where the activation `act` comes from, so each instance can be checked: a
    child module, a function the instance holds, or one the forward's code names.
    An activation chosen any other way (`ACT2FN[self.config.hidden_act](x)`) is
    declined: the analysed instance's choice says nothing about the others."""
    if act.op == "call_module":
        return f"child:{act.target}"
    source = rewriting.forward_source(type(module))
    call = source.expression_at(act.meta.get("span")) if source else None
    function = call.func if isinstance(call, ast.Call) else None
    if source is None or function is None:
        return GLUFuser.decline(module, "the activation call is not in the source")
    if rewriting.is_self_attribute(function):
        return f"attribute:{function.attr}"
    # Names the forward binds itself (or `self`) may differ per instance; a
    # function looked up from globals only (`F.silu`, `ACT2FN["silu"]`) may not.
    local = {a.arg for a in ast.walk(source.tree.args) if isinstance(a, ast.arg)}
    local |= {
        n.id
        for n in ast.walk(source.tree)
        if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load)
    }
    names = [n.id for n in ast.walk(function) if isinstance(n, ast.Name)]
    if names and not any(n in local or n == "self" for n in names):
        return "code"
    return GLUFuser.decline(
        module,
        f"the activation is chosen while the forward runs ({ast.unparse(call)}), "
        "so other instances may use another one",
    )


def _gate_and_up(
    node: fx.Node, module: nn.Module
) -> tuple[fx.Node, fx.Node, fx.Node] | None:
    """`(act, gate, up)` where `node` combines `act(gate(x))` and `up(x)`, two
    linears of one input, by an operation on the two (a product, in a GLU)."""
    if node.op not in ("call_function", "call_method"):
        return None
    if len(node.all_input_nodes) != 2 or len(node.args) != 2:
        return None
    for act, up in (node.args, node.args[::-1]):
        gate = act.args[0] if isinstance(act, fx.Node) and act.args else None
        if (
            fx_utils.is_linear(up, module)
            and fx_utils.is_linear(gate, module)
            and gate is not up
            and gate.args[0] is up.args[0]
        ):
            return act, gate, up
    return None


def _describe(node: fx.Node) -> str:
    return (
        node.target if node.op == "call_module" else fx_utils.op_name(node) or node.name
    )


@dataclass
class GLUFuser(StackedFuser):
    """`down_proj(act(gate_proj(x)) * up_proj(x))` ->
    `down_proj(act_and_mul(gate_up_proj(x)))`, with `gate_up_proj` a
    `MergedColumnParallelLinear`, `act_and_mul` vLLM's fused activation (`SiluAndMul`,
    `GeluAndMul`) and `down_proj` a `RowParallelLinear`.

    The gate is the projection the activation is applied to, found from dataflow; the
    activation from what it computes, so `ACT2FN[...]` modules and `F.silu(...)`
    calls alike. One vLLM has no fused act-and-mul for is declined."""

    kind = "glu"
    coverage = "glu"

    activation: str = ""
    """vLLM's name for it, as `get_act_and_mul_fn` takes it."""
    activation_source: str = ""
    """Where each instance's activation comes from: `child:<name>` (an activation
    module, re-read per instance), `attribute:<name>` (a function the instance holds)
    or `code` (a function the forward names)."""
    activation_name: str = ""
    """The attribute holding the fused act-and-mul: the HF activation module's own
    name when it is replaced whole, else a new one."""
    down_name: str = ""
    after: tuple[tuple[str, bool], ...] = ()
    """The children called between the gated product and the down projection."""
    spans: dict[str, Span] = field(default_factory=dict)
    """Spans of the product, the activation and the gate and up calls."""

    @classmethod
    def could_match(cls, module: nn.Module) -> bool:
        return fx_utils.linear_children(module) >= 3

    @classmethod
    def match(cls, graph: fx.Graph | None, module: nn.Module) -> Self | None:
        if graph is None:
            return None
        pairs = [(n, pair) for n in graph.nodes if (pair := _gate_and_up(n, module))]
        for node, (act, gate, up) in pairs:
            if fx_utils.op_name(node) == "mul":
                return cls._gated(graph, module, node, act, gate, up)
        if pairs:
            node, (act, gate, up) = pairs[0]
            return cls.decline(
                module,
                f"{gate.target}(x) through {_describe(act)} and {up.target}(x) are "
                f"combined by {fx_utils.op_name(node) or node.name}, not multiplied",
            )
        return None

    @classmethod
    def _gated(
        cls,
        graph: fx.Graph,
        module: nn.Module,
        product: fx.Node,
        act: fx.Node,
        gate: fx.Node,
        up: fx.Node,
    ) -> Self | None:
        """Whether the gated product `act(gate(x)) * up(x)` found in `graph` fuses."""
        names = [gate.target, up.target]
        if reason := called_once(graph, names):
            return cls.decline(module, reason)
        activation = _activation(act, module)
        source = _activation_source(act, module)
        if isinstance(source, Declined):
            return source
        if activation is None:
            return cls.decline(
                module,
                f"vLLM has no fused act-and-mul for the activation {_describe(act)}",
            )
        if any(len(n.users) != 1 for n in (gate, up, act)):
            return cls.decline(
                module, "the gate, up or activation output is used elsewhere"
            )
        gate_mod, up_mod = (module.get_submodule(name) for name in names)
        if linears.out_features(gate_mod) != linears.out_features(up_mod):
            return cls.decline(module, f"{gate.target} and {up.target} differ in width")
        if (gate_mod.bias is None) != (up_mod.bias is None):
            return cls.decline(
                module, f"one of {gate.target} and {up.target} has a bias"
            )
        down = fx_utils.linear_fed_by(product, module)
        if down is None or "." in down.target:
            return cls.decline(
                module, "no single direct child projects the gated product"
            )
        # The HF activation module gives way to the act-and-mul when the forward calls
        # it only here.
        replaced = act.op == "call_module" and not called_once(graph, [act.target])
        return cls(
            fused_name=rewriting.merged_name(names, module),
            shards={gate.target: 0, up.target: 1},
            activation=activation,
            activation_source=source,
            activation_name=(
                act.target
                if replaced
                else rewriting.fresh_attribute(module, "act_and_mul")
            ),
            down_name=down.target,
            after=children_between(product, down, module),
            spans={
                "product": product.meta.get("span"),
                "act": act.meta.get("span"),
                gate.target: gate.meta.get("span"),
                up.target: up.meta.get("span"),
            },
        )

    def mismatch(self, module: nn.Module, vllm_config: "VllmConfig") -> str | None:
        if vllm_config.parallel_config.tensor_parallel_size > 1 and (
            found := whole_width(module, self.after)
        ):
            return (
                f"{', '.join(found)} act on the whole intermediate width between the "
                f"gated product and {self.down_name}, of which each tensor-parallel "
                "rank holds only its share"
            )
        gate, up = (getattr(module, name, None) for name in self.shards)
        if not linears.is_linear(gate) or not linears.is_linear(up):
            return f"{' and '.join(self.shards)} are not both linears in this instance"
        if linears.stores_transposed(gate) != linears.stores_transposed(up):
            return f"only one of {' and '.join(self.shards)} stores its weight transposed"
        shapes = {(linears.in_features(m), linears.out_features(m)) for m in (gate, up)}
        if len(shapes) != 1:
            return f"{' and '.join(self.shards)} differ in shape in this instance"
        if (gate.bias is None) != (up.bias is None):
            return f"only one of {' and '.join(self.shards)} has a bias"
        origin, _, name = self.activation_source.partition(":")
        if origin == "child":
            found = _activation_of_module(getattr(module, name, None))
        elif origin == "attribute":
            found = _FUNCTIONS.get(getattr(module, name, None))
        else:
            found = self.activation
        if found != self.activation:
            return (
                f"this instance's activation is {found or 'one vLLM cannot fuse'}, not "
                f"{self.activation} as in the instance the class was analysed on"
            )
        return None

    def update_forward(self, module: nn.Module) -> None:
        rewrite = ForwardRewrite(type(module))
        product = rewrite.expression_at(self.spans["product"])
        if product is None:
            raise FusionDeclined("the gated product is not computed in forward")
        calls, x = rewrite.calls_on_one_name({n: self.spans[n] for n in self.shards})
        if not rewrite.holds_one_value(x, [*calls, product]):
            raise FusionDeclined(
                f"`{x}` changes between the projections and the product"
            )
        if hasattr(module, self.activation_name):
            rewrite.expect_single_use(self.activation_name)
        act = rewrite.expression_at(self.spans["act"])
        # Parts bound to locals before the product (`gate = self.gate_proj(x)`) go.
        pattern = [e for e in (act, *calls) if e is not None]
        bindings: list[ast.stmt] = []
        for part in pattern:
            if not _inside(part, product):
                binding = _single_use_binding(rewrite, part, [product, *pattern])
                if not any(binding is b for b in bindings):
                    bindings.append(binding)
        for binding in bindings:
            rewrite.remove(binding)
        fused = f"self.{self.activation_name}(self.{self.fused_name}({x}))"
        rewrite.replace(product, rewriting.parse_expression(fused))
        self.fused_forward = rewrite.compile()

    def update_attrs(
        self, module: nn.Module, prefix: str, vllm_config: "VllmConfig"
    ) -> None:
        gate, up = (getattr(module, name) for name in self.shards)
        name = f"{prefix}.{self.fused_name}"
        merged = MergedColumnParallelLinear(
            input_size=linears.in_features(gate),
            output_sizes=[linears.out_features(gate), linears.out_features(up)],
            bias=gate.bias is not None,
            quant_config=vllm_config.quant_config,
            prefix=name,
            return_bias=False,
        )
        for shard in self.shards:
            delattr(module, shard)
        setattr(module, self.fused_name, linears.load_as_stored(merged, gate, name))
        setattr(module, self.activation_name, act_and_mul(self.activation))
        row_parallel(module, self.down_name, prefix, vllm_config)

    def info(self, name: str, module: nn.Module) -> str:
        act = type(getattr(module, self.activation_name)).__name__
        fused = super().info(name, module)
        return f"{fused} + {act}; {self.down_name} -> RowParallelLinear"


def _inside(node: ast.AST, outer: ast.AST) -> bool:
    return any(n is node for n in ast.walk(outer))


def _single_use_binding(
    rewrite: ForwardRewrite, part: ast.expr, pattern: list[ast.AST]
) -> ast.stmt:
    """The statement `name = <part>` binding a part of the pattern to a local read
    once, by another part of it; anything else would keep the part alive."""
    statement = rewrite.statement(part)
    target = statement.targets[0] if isinstance(statement, ast.Assign) else None
    if (
        not isinstance(target, ast.Name)
        or len(statement.targets) != 1
        or not any(statement.value is p for p in pattern)
    ):
        source = ast.unparse(statement).strip()
        raise FusionDeclined(f"`{source}` keeps a part of the gated product")
    reads = rewrite.loads(target.id)
    if (
        len(rewrite.stores(target.id)) != 1
        or len(reads) != 1
        or not any(_inside(reads[0], p) for p in pattern if p is not part)
    ):
        raise FusionDeclined(f"`{target.id}` is read outside the gated product")
    return statement
