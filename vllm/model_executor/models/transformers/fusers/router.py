# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""An MoE router, found from what its forward computes, moved into vLLM's router."""

import dataclasses
import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Self

import torch
import torch.nn.functional as F
from torch import fx, nn

from vllm.model_executor.models.transformers import fx_utils, tracing
from vllm.model_executor.models.transformers.fusers.base import (
    Declined,
    ProbeResults,
    RewriteFuser,
)
from vllm.model_executor.models.transformers.fusers.probes import Draws, failed
from vllm.model_executor.models.transformers.routing import (
    ROUTER_ATTR,
    Role,
    Routing,
    VllmRouter,
    reference_route,
    vllm_router_forward,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig

_SCORES = frozenset({"softmax", "sigmoid"})
_DIVISIONS = frozenset({"truediv", "div", "itruediv", "div_"})
_PROBE_TOKENS = 64
_RANKS = (2, 3)
"""Hidden states a router may be handed: `[tokens, width]`, `[batch, tokens, width]`."""


def _computed_from(node: fx.Node) -> set[fx.Node]:
    """Every node `node` is computed from, including what wrote in place into
    those nodes (`mask.scatter_(...)` before `mask` is read)."""
    found = fx_utils.ancestors(node)
    while writes := {
        user
        for read in found
        for user in read.users
        if user not in found
        and str(fx_utils.op_name(user)).endswith("_")
        and user.args[:1] == (read,)
    }:
        for write in writes:
            found |= fx_utils.ancestors(write)
    return found


def _topk_k(node: fx.Node) -> object:
    return node.kwargs.get("k", node.args[1] if len(node.args) > 1 else None)


def _attribute(node: object) -> str | None:
    """The module tensor `node` reads (through casts), `None` if it reads none."""
    node = fx_utils.uncast(node)
    if isinstance(node, fx.Node) and node.op == "get_attr":
        return str(node.target)
    return None


_RESHAPES = frozenset({"squeeze", "view", "reshape", "flatten"})


def _added_by_child(node: fx.Node, module: nn.Module) -> str | None:
    """The tensor a child of `module` adds to its one input, where that sum is all
    the child computes (Ernie 4.5's `moe_statics`: `x + bias.squeeze()`), by its
    name in `module`; `None` for any other node."""
    if (
        node.op != "call_module"
        or "." in str(node.target)
        or fx_utils.is_linear(node, module)
    ):
        return None
    child = module.get_submodule(str(node.target))
    if any(True for _ in child.children()):
        return None
    traced = tracing.trace(child)
    output = fx_utils.returned(traced.graph)
    inputs = [n for n in traced.graph.nodes if n.op == "placeholder"]
    if not traced.complete or len(inputs) != 1 or fx_utils.op_name(output) != "add":
        return None
    if len(output.args) != 2 or output.kwargs:
        return None
    first, second = output.args
    added = second if first is inputs[0] else first if second is inputs[0] else None
    while fx_utils.op_name(added) in _RESHAPES:
        added = added.args[0]
    if not isinstance(added, fx.Node) or added.op != "get_attr":
        return None
    return f"{node.target}.{added.target}"


def _is_float32_cast(node: object) -> bool:
    return fx_utils.op_name(node) == "float" or (
        fx_utils.op_name(node) in fx_utils.CASTS
        and torch.float32 in (*node.args[1:], *node.kwargs.values())
    )


@dataclass(frozen=True)
class _Projection:
    """The router's one projection: `logits = x @ weight.T (+ bias)`."""

    node: fx.Node
    weight: str
    bias: str | None
    input: object


def _projection(graph: fx.Graph, module: nn.Module) -> _Projection | str:
    found: list[_Projection] = []
    for node in graph.nodes:
        if fx_utils.op_name(node) == "linear" and node.op == "call_function":
            weight = _attribute(node.args[1])
            bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
            if weight is None or (bias is not None and _attribute(bias) is None):
                return "its projection is not of the module's own weight and bias"
            found.append(_Projection(node, weight, _attribute(bias), node.args[0]))
        elif fx_utils.is_linear(node, module):
            child = fx_utils.submodule(node, module)
            bias = f"{node.target}.bias" if child.bias is not None else None
            found.append(_Projection(node, f"{node.target}.weight", bias, node.args[0]))
    if len(found) != 1:
        return f"its logits come from {len(found)} projections, not one"
    return found[0]


def _is_topk_ids(node: object) -> bool:
    """Whether `node` is the ids half of a `topk`."""
    return (
        fx_utils.op_name(node) == "getitem"
        and fx_utils.op_name(node.args[0]) == "topk"
        and node.args[1] == 1
    )


def _returned_ids(returned: list[object]) -> fx.Node | str | None:
    """The top-k expert ids among the values a forward returns: `None` where it
    returns none (not a router), why not where it returns ids it changed."""
    ids = [value for value in returned if _is_topk_ids(value)]
    if len(ids) == 1:
        return ids[0]
    changed = any(
        _is_topk_ids(node)
        for value in returned
        if isinstance(value, fx.Node)
        for node in fx_utils.ancestors(value)
    )
    return "it changes its top-k expert ids before returning them" if changed else None


def _output_roles(
    returned: list[object], ids: fx.Node, logits: fx.Node
) -> tuple[list[Role], fx.Node] | str:
    """What each returned value is (the ids, the logits, or the weights: computed
    from what the top-k chose), and the one weights value; or why not."""
    chosen = ids.args[0]
    roles: list[Role] = []
    weights = None
    for value in returned:
        if value is ids:
            roles.append("ids")
        elif fx_utils.uncast(value) is logits:
            roles.append("logits")
        elif isinstance(value, fx.Node) and chosen in fx_utils.ancestors(value):
            roles.append("weights")
            weights = value
        else:
            return f"it returns `{value}`, which is not its logits or its top-k"
    if roles.count("weights") != 1:
        return "it returns no single tensor of top-k weights"
    return roles, weights


def _correction(
    before: set[fx.Node],
    handed: list[fx.Node],
    projection: _Projection,
    module: nn.Module,
    num_experts: int,
) -> tuple[str | None, bool] | str:
    """The one tensor added to the scores before the choice, if any (the router's
    own, one value per expert, or the input its caller hands in), and whether it is
    handed in; or why the routing is not vLLM's."""

    def added(value: object) -> str | None:
        """The own tensor or handed-in input `value` reads, if either."""
        if fx_utils.uncast(value) in handed:
            return str(fx_utils.uncast(value).target)
        return _attribute(value)

    correction = [
        name
        for node in before
        if fx_utils.op_name(node) in ("add", "iadd")
        for name in map(added, node.args[:2])
        if name is not None and name not in (projection.weight, projection.bias)
    ] + [name for node in before if (name := _added_by_child(node, module))]
    if len(correction) > 1:
        return "it adds more than one tensor of its own to the scores"
    if correction and not handed:
        held = dict(itertools.chain(module.named_parameters(), module.named_buffers()))[
            correction[0]
        ]
        if held.numel() != num_experts or held.shape[-1] != num_experts:
            return (
                f"its correction {correction[0]} of shape {list(held.shape)} is not "
                f"one value per expert ({num_experts})"
            )
    handed_in = bool(handed) and correction == [str(handed[0].target)]
    if handed and not handed_in:
        return "its routing reads inputs other than the hidden states"
    return (correction[0] if correction else None), handed_in


def _grouping(
    before: set[fx.Node], chosen: fx.Node
) -> tuple[int | None, int | None] | str:
    """`(groups, groups kept)` of a grouped top-k, `(None, None)` for a plain one;
    or why the grouping is not vLLM's."""
    # `scores.view(-1, groups, experts // groups)`, and a top-k over what each
    # group scores (not the top-k within each group, which reads the view).
    group_views = {
        node: node.args[2]
        for node in before
        if fx_utils.op_name(node) in ("view", "reshape")
        and len(node.args) == 4
        and isinstance(node.args[2], int)
    }
    groups = [count for count in group_views.values() if count > 1]
    group_topk = [
        _topk_k(node)
        for node in before - {chosen}
        if fx_utils.op_name(node) == "topk" and node.args[0] not in group_views
    ]
    if not group_views and group_topk:
        return "it takes a top-k over more than its experts"
    if len(set(groups)) > 1 or len(group_topk) > 1:
        return "it groups its experts in more than one way"
    if groups and not group_topk:
        return "it groups its experts without choosing the best groups"
    return (groups[0], group_topk[0]) if groups else (None, None)


def _renormalize_and_scale(after: set[fx.Node]) -> tuple[bool, float]:
    """Whether the chosen weights are renormalised (a softmax, or a sum and a
    division), and the constant factor they are scaled by."""
    renormalize = any(fx_utils.op_name(n) == "softmax" for n in after) or (
        any(fx_utils.op_name(n) == "sum" for n in after)
        and any(fx_utils.op_name(n) in _DIVISIONS for n in after)
    )
    scale = 1.0
    for node in after:
        if fx_utils.op_name(node) in ("mul", "imul"):
            constants = [a for a in node.args[:2] if isinstance(a, int | float)]
            scale *= constants[0] if constants else 1.0
    return renormalize, float(scale)


def read_routing(
    graph: fx.Graph, module: nn.Module
) -> "tuple[Routing, _Projection] | str | None":
    """The routing `graph` computes, by dataflow: `None` when it returns no top-k
    expert ids (not a router), else the routing or why it is not vLLM's."""
    output = next((n for n in graph.nodes if n.op == "output"), None)
    if output is None or not isinstance(output.args[0], tuple | list):
        return None
    returned = list(output.args[0])
    ids = _returned_ids(returned)
    if not isinstance(ids, fx.Node):
        return ids
    chosen = ids.args[0]
    # The hidden states, then at most one input handed in by the caller, which
    # may only correct the choice (AFMoE's block hands in its `expert_bias`).
    handed = [node for node in graph.nodes if node.op == "placeholder"][1:]
    if len(handed) > 1:
        return "its routing reads inputs other than the hidden states"
    projection = _projection(graph, module)
    if isinstance(projection, str):
        return projection
    found = _output_roles(returned, ids, projection.node)
    if isinstance(found, str):
        return found
    roles, weights = found

    top_k = _topk_k(chosen)
    if not isinstance(top_k, int):
        return "its top-k takes no constant k"
    before = _computed_from(chosen)
    after = fx_utils.between(chosen, weights) - {chosen}
    computed = before | fx_utils.ancestors(weights)
    scores = {fx_utils.op_name(n) for n in computed} & _SCORES
    if len(scores) != 1:
        return "its scores are neither a softmax nor a sigmoid of the logits"
    num_experts = module.get_parameter(projection.weight).shape[0]
    correction = _correction(before, handed, projection, module, num_experts)
    if isinstance(correction, str):
        return correction
    correction_bias, handed_in = correction
    grouping = _grouping(before, chosen)
    if isinstance(grouping, str):
        return grouping
    num_expert_group, topk_group = grouping
    renormalize, scale = _renormalize_and_scale(after)

    flat_input = fx_utils.uncast(projection.input)
    routing = Routing(
        top_k=top_k,
        scoring=scores.pop(),
        renormalize=renormalize,
        num_expert_group=num_expert_group,
        topk_group=topk_group,
        correction_bias=correction_bias,
        correction_handed_in=handed_in,
        scale=scale,
        float32_logits=_is_float32_cast(projection.input),
        flattens=fx_utils.op_name(flat_input) in ("view", "reshape"),
        outputs=tuple(roles),
    )
    if num_experts % (routing.num_expert_group or 1):
        return f"its {num_experts} experts do not split into its groups"
    return routing, projection


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    # vLLM routes in float32, whatever the logits' dtype.
    return a.shape == b.shape and torch.allclose(
        a.double(), b.double(), rtol=1e-5, atol=1e-6
    )


def _same_choice(
    expected: tuple[torch.Tensor, ...], got: tuple[torch.Tensor, ...], roles
) -> bool:
    """Whether two router outputs agree: logits equal, and per token the same
    experts with the same weights (in any order: the experts sum over them)."""
    ids_at = roles.index("ids")
    order_e = expected[ids_at].argsort(dim=-1)
    order_g = got[ids_at].argsort(dim=-1)
    for at, role in enumerate(roles):
        e, g = expected[at], got[at]
        if role == "ids":
            if not torch.equal(e.gather(-1, order_e), g.gather(-1, order_g)):
                return False
        elif role == "weights":
            if not _close(e.gather(-1, order_e), g.gather(-1, order_g)):
                return False
        elif not _close(e, g):
            return False
    return True


class _Run(NamedTuple):
    """A router run on a probe: what it returned, for what tensors and inputs."""

    outputs: tuple[torch.Tensor, ...]
    tensors: dict[str, torch.Tensor]
    x: torch.Tensor
    handed: tuple[torch.Tensor, ...]


def _ranks(ranks: tuple[int, ...]) -> str:
    return " and ".join(f"{rank}-D" for rank in ranks) or "no"


_verdicts = ProbeResults()
"""(routing, weight, bias, an instance's signature: its class, attributes and
tensor shapes) -> the ranks its probes prove the routing on, and why not others."""


@dataclass
class RouterFuser(RewriteFuser):
    """`w, ids = topk(score(x @ W.T [+ b]) [+ correction], k)` with optional
    expert groups, renormalisation and scaling -> vLLM's router (its projection a
    vLLM linear) attached as `vllm_router`, the module's outputs kept in place.

    The routing is read from the forward's dataflow, then proven equal on random
    inputs (float32 and float64) for every instance before it is replaced:
    routing that differs in any way stays Transformers', declined with why."""

    kind = "moe"
    details_title = "Mixture-of-experts blocks"
    details_beside = True

    routing: Routing | None = None
    weight: str = ""
    bias: str | None = None
    ranks: tuple[int, ...] = ()
    """The ranks of hidden states the routing was proven on (gpt-oss's router
    takes its softmax over dimension 1, which is right on `[tokens, width]` only)."""
    other_ranks: str | None = None
    """Why the routing is not served on the other ranks, where it is not on all."""

    @classmethod
    def could_match(cls, module: nn.Module) -> bool:
        """A single child that is a linear, or a weight of its own (and children
        without children of theirs, which may add a tensor to the scores)."""
        children = list(module.children())
        if len(children) == 1 and fx_utils.linear_children(module) == 1:
            return True
        return (
            fx_utils.linear_children(module) == 0
            and not any(True for child in children for _ in child.children())
            and any(p.ndim == 2 for p in module.parameters(recurse=False))
        )

    @classmethod
    def match(cls, graph: fx.Graph | None, module: nn.Module) -> Self | Declined | None:
        if graph is None:
            return None
        found = read_routing(graph, module)
        if found is None:
            return None
        if isinstance(found, str):
            return cls.decline(module, found)
        routing, projection = found
        fuser = cls(routing=routing, weight=projection.weight, bias=projection.bias)
        fuser.routing = dataclasses.replace(
            routing, weights_in_input_dtype=fuser._weights_in_input_dtype(module)
        )
        fuser.ranks, reason = fuser._verdict(module)
        if not fuser.ranks:
            return cls.decline(module, reason or "no probe ran")
        fuser.other_ranks = reason
        return fuser

    def update_forward(self, module: nn.Module) -> None:
        self.fused_forward = vllm_router_forward

    def _signature(self, module: nn.Module) -> tuple | None:
        attributes = tuple(
            (name, value)
            for name, value in vars(module).items()
            if not name.startswith("_")
        )
        tensors = tuple(
            (name, tuple(t.shape), t.dtype)
            for name, t in itertools.chain(
                module.named_parameters(), module.named_buffers()
            )
        )
        try:
            hash(attributes)
        except TypeError:
            return None
        return (type(module), attributes, tensors)

    def unproven(self, module: nn.Module) -> str | None:
        """Why vLLM's router does not compute what `module` does on a probe, on
        the ranks of hidden states the analysed instance was proven on."""
        ranks, reason = self._verdict(module)
        if not ranks:
            return reason
        if ranks != self.ranks:
            return (
                f"it is proven on {_ranks(ranks)} hidden states, the analysed "
                f"instance on {_ranks(self.ranks)}"
            )
        return None

    def _verdict(self, module: nn.Module) -> tuple[tuple[int, ...], str | None]:
        """The ranks of hidden states on which vLLM's router computes what
        `module` does (float64 and float32 probes), and why not on the others."""
        signature = self._signature(module)
        if signature is None:
            return self._probed_verdict(module)
        key = (self.routing, self.weight, self.bias, signature)
        return _verdicts.get(key, lambda: self._probed_verdict(module))

    def _probed_verdict(
        self, module: nn.Module
    ) -> tuple[tuple[int, ...], str | None]:
        proven: list[int] = []
        reasons: list[str] = []
        # On the CPU whatever the default device: the report builds on `meta`.
        with torch.device("cpu"):
            for rank in _RANKS:
                reason = next(
                    (
                        reason
                        for dtype in (torch.float64, torch.float32)
                        if (reason := self._probe(module, dtype, rank)) is not None
                    ),
                    None,
                )
                if reason is None:
                    proven.append(rank)
                else:
                    reasons.append(reason)
        return tuple(proven), reasons[0] if reasons else None

    def _run(
        self, module: nn.Module, dtype: torch.dtype, rank: int
    ) -> _Run | str:
        """`module` run on a random probe of `dtype` (its tensors random too),
        or why it fails."""
        assert self.routing is not None
        draws = Draws()
        weight = module.get_parameter(self.weight)
        num_experts, hidden = weight.shape
        tensors = {
            name: draws.normal(t.shape, 0.3, dtype)
            for name, t in itertools.chain(
                module.named_parameters(), module.named_buffers()
            )
            if t.is_floating_point()
        }
        # Logits spread a few units apart, so float32 rounding ties no choices.
        tensors[self.weight] = draws.normal(weight.shape, 2.0 / hidden**0.5, dtype)
        x = draws.normal((1, _PROBE_TOKENS, hidden)[-rank:], 1.0, dtype)
        handed = (
            (draws.normal((num_experts,), 0.3, dtype),)
            if self.routing.correction_handed_in
            else ()
        )
        try:
            with torch.no_grad():
                outputs = torch.func.functional_call(module, tensors, (x, *handed))
        except Exception as error:  # noqa: BLE001 - a router we cannot run is declined
            return failed(error)
        if not isinstance(outputs, tuple) or len(outputs) != len(self.routing.outputs):
            return "it does not return the outputs its dataflow shows"
        return _Run(outputs, tensors, x, handed)

    def _weights_in_input_dtype(self, module: nn.Module) -> bool:
        """Whether Transformers' router hands its top-k weights back in its
        input's dtype: what it returns for a float64 probe (every check after
        this one holds the routing to it)."""
        assert self.routing is not None
        with torch.device("cpu"):
            for rank in _RANKS:
                run = self._run(module, torch.float64, rank)
                if not isinstance(run, str):
                    weights = run.outputs[self.routing.outputs.index("weights")]
                    return weights.dtype == torch.float64
        return False

    def _probe(self, module: nn.Module, dtype: torch.dtype, rank: int) -> str | None:
        run = self._run(module, dtype, rank)
        if isinstance(run, str):
            return run
        routing = self.routing
        weight = run.tensors[self.weight]
        num_experts, hidden = weight.shape
        inputs = run.x.reshape(-1, hidden) if routing.flattens else run.x
        inputs = inputs.float() if routing.float32_logits else inputs
        logits = F.linear(
            inputs,
            weight.to(inputs.dtype),
            None if self.bias is None else run.tensors[self.bias].to(inputs.dtype),
        )
        if run.handed:
            correction = run.handed[0]
        elif routing.correction_bias is not None:
            # One value per expert, however it is stored (Ernie 4.5: [1, experts]).
            correction = run.tensors[routing.correction_bias].reshape(num_experts)
        else:
            correction = None
        try:
            got = reference_route(
                routing,
                logits,
                None if correction is None else correction.float(),
                run.x.dtype,
            )
        except Exception as error:  # noqa: BLE001 - vLLM refuses this routing
            return f"vLLM's router fails on it: {type(error).__name__}: {error}"
        name = str(dtype).removeprefix("torch.")
        # The weights' dtype as well as their values: in bfloat16 the experts
        # weigh with them rounded or not. (The logits' dtype may differ: callers
        # keep them for auxiliary losses, and their values are compared.)
        at = routing.outputs.index("weights")
        if run.outputs[at].dtype != got[at].dtype:
            return (
                f"on a {name} probe it returns its weights in "
                f"{run.outputs[at].dtype}, vLLM's router in {got[at].dtype}"
            )
        if not _same_choice(run.outputs, got, routing.outputs):
            return (
                f"on a {name} probe it chooses other experts or weights than "
                f"vLLM's router with the routing its dataflow shows "
                f"({routing.describe()})"
            )
        return None

    def mismatch(self, module: nn.Module, vllm_config: "VllmConfig") -> str | None:
        return self.unproven(module)

    def update_attrs(
        self, module: nn.Module, prefix: str, vllm_config: "VllmConfig"
    ) -> None:
        assert self.routing is not None
        num_experts, hidden = module.get_parameter(self.weight).shape
        router = VllmRouter(
            self.routing,
            num_experts,
            hidden,
            has_bias=self.bias is not None,
            ranks=self.ranks,
            prefix=f"{prefix}.{ROUTER_ATTR}",
        )
        # The router's tensors (or the child linear holding them) now live in
        # vLLM's router, which loads them.
        for name in {name.split(".")[0] for name in self._hf_tensors()}:
            delattr(module, name)
        setattr(module, ROUTER_ATTR, router)

    def _hf_tensors(self) -> dict[str, str]:
        """The HF router's tensors -> where vLLM's router keeps them."""
        assert self.routing is not None
        found = {self.weight: "gate.weight"}
        if self.bias is not None:
            found[self.bias] = "gate.bias"
        # A correction handed in stays where the caller keeps it.
        if self.routing.correction_bias and not self.routing.correction_handed_in:
            found[self.routing.correction_bias] = "e_score_correction_bias"
        return found

    def renamed_weights(self, prefix: str) -> dict[str, str]:
        return {
            f"{prefix}.{hf}": f"{prefix}.{ROUTER_ATTR}.{ours}"
            for hf, ours in self._hf_tensors().items()
        }

    def report_detail(self, name: str, module: nn.Module) -> str:
        assert self.routing is not None
        only = (
            ""
            if self.ranks == _RANKS
            else f" (on {_ranks(self.ranks)} inputs; on "
            f"{_ranks(tuple(r for r in _RANKS if r not in self.ranks))} ones "
            f"{self.other_ranks})"
        )
        return (
            f"{name} ({type(module).__name__}): router -> vLLM's router: "
            f"{self.routing.describe()}{only}"
        )

    def info(self, name: str, module: nn.Module) -> str:
        return f"Fused: router -> {ROUTER_ATTR}: {self.report_detail(name, module)}"
