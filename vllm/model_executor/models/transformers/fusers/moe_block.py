# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""An MoE block whose router's choice goes only to its experts, handed to vLLM's
fused MoE in one packed tensor."""

import ast
from dataclasses import dataclass
from typing import TYPE_CHECKING, Self

from torch import fx, nn

from vllm.model_executor.models.transformers.experts_layer import EXPERTS_ATTR
from vllm.model_executor.models.transformers.fusers.base import (
    Declined,
    RewriteFuser,
)
from vllm.model_executor.models.transformers.fusers.experts import ExpertsFuser
from vllm.model_executor.models.transformers.fusers.router import RouterFuser
from vllm.model_executor.models.transformers.rewriting import (
    ForwardRewrite,
    forward_source,
    is_self_attribute,
    loaded_names,
    parse_expression,
    stored_names,
)
from vllm.model_executor.models.transformers.routing import ROUTER_ATTR, Routing

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.model_executor.models.transformers.experts_layer import ExpertsLayout
    from vllm.model_executor.models.transformers.plan import FusionPlan


def _experts_calls(tree: ast.AST, module: nn.Module) -> list[ast.Call]:
    """Every `self.<child>(...)` in `tree` whose child is an experts module."""
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and is_self_attribute(node.func)
        and isinstance(child := getattr(module, node.func.attr, None), nn.Module)
        and ExpertsFuser.could_match(child)
    ]


def _router_call(statement: ast.stmt) -> tuple[list[ast.expr], ast.Call] | None:
    """(targets, call) where `statement` is `a, b, ... = self.<child>(x)`."""
    if not (
        isinstance(statement, ast.Assign)
        and len(statement.targets) == 1
        and isinstance(statement.targets[0], ast.Tuple)
    ):
        return None
    call = statement.value
    if not (
        isinstance(call, ast.Call)
        and is_self_attribute(call.func)
        and len(call.args) == 1
        and not isinstance(call.args[0], ast.Starred)
        and not call.keywords
    ):
        return None
    return statement.targets[0].elts, call


@dataclass
class MoEBlockFuser(RewriteFuser):
    """`_, w, ids = self.router(x); ... self.experts(h, ids, w) ...`, the ids and
    weights read nowhere else -> `choice = self.router.vllm_router.choice(x); ...
    self.experts.vllm_experts.run(h, choice) ...`.

    The block's router is on vLLM's router and its experts on vLLM's fused MoE
    anyway (`RouterFuser`, `ExpertsFuser`; `cross_check` withdraws this fuser where
    either is not): this hands the router's choice straight to the fused MoE,
    packed as it takes it, instead of handing Transformers' experts interface the
    ids and weights, reshaped and cast, for `VllmExperts` to pack again. The same
    numbers reach the same kernel; the eager step loses that Python."""

    kind = "moe_block"
    needs_graph = False

    router: str = ""
    experts: str = ""
    router_at: int = 0
    """The index, in the forward's body, of the statement calling the router."""
    outputs: int = 0
    """How many outputs the forward unpacks from the router."""
    ids_at: int = 0
    weights_at: int = 0

    @classmethod
    def could_match(cls, module: nn.Module) -> bool:
        return any(ExpertsFuser.could_match(child) for child in module.children())

    @classmethod
    def match(cls, graph: fx.Graph | None, module: nn.Module) -> Self | Declined | None:
        source = forward_source(type(module))
        if source is None:
            return None
        tree = source.tree
        calls = _experts_calls(tree, module)
        if not calls:
            return None
        if len(calls) > 1:
            return cls.decline(module, f"it calls its experts {len(calls)} times")
        call = calls[0]
        experts = call.func.attr
        if not (
            len(call.args) == 3
            and not call.keywords
            and all(isinstance(a, ast.Name) for a in call.args[1:])
        ):
            return cls.decline(
                module,
                f"it does not call its experts as `self.{experts}(x, ids, weights)` "
                "with the ids and weights in two local names",
            )
        ids, weights = call.args[1].id, call.args[2].id
        for name in (ids, weights):
            if len(stored_names(tree, name)) != 1 or len(loaded_names(tree, name)) != 1:
                return cls.decline(
                    module,
                    f"`{name}`, handed to self.{experts}, is bound or read elsewhere "
                    "in its forward (only the experts may read the router's choice)",
                )
        for index, statement in enumerate(tree.body):
            found = _router_call(statement)
            if found is None:
                continue
            targets, router_call = found
            names = [t.id if isinstance(t, ast.Name) else None for t in targets]
            if ids not in names or weights not in names:
                continue
            if None in names:
                return cls.decline(
                    module, "it unpacks the router's outputs into more than names"
                )
            if any(loaded_names(tree, n) for n in names if n not in (ids, weights)):
                return cls.decline(
                    module,
                    f"it reads another output of self.{router_call.func.attr} than "
                    "the ids and weights it hands its experts",
                )
            return cls(
                router=router_call.func.attr,
                experts=experts,
                router_at=index,
                outputs=len(names),
                ids_at=names.index(ids),
                weights_at=names.index(weights),
            )
        return cls.decline(
            module,
            f"the ids and weights it hands self.{experts} are not unpacked from "
            "one `self.<router>(x)` statement of its forward",
        )

    def mismatch(self, module: nn.Module, vllm_config: "VllmConfig") -> str | None:
        for name in (self.router, self.experts):
            if not isinstance(getattr(module, name, None), nn.Module):
                return f"this instance has no module self.{name}"
        return None

    def unfit(self, routing: Routing, layout: "ExpertsLayout | str") -> str | None:
        """Why the router's routing does not feed these experts as the forward
        hands it on; `None` where it does."""
        roles = routing.outputs
        if len(roles) != self.outputs:
            return (
                f"self.{self.router} returns {len(roles)} outputs, its block unpacks "
                f"{self.outputs}"
            )
        if (roles[self.ids_at], roles[self.weights_at]) != ("ids", "weights"):
            return (
                f"the block hands self.{self.experts} the router's "
                f"{roles[self.ids_at]} and {roles[self.weights_at]}, not its ids "
                "and weights"
            )
        if routing.correction_handed_in:
            return f"self.{self.router} takes a correction bias its block hands in"
        if isinstance(layout, str):
            return layout
        if layout.top_k != routing.top_k:
            return (
                f"self.{self.router} chooses {routing.top_k} experts per token, "
                f"self.{self.experts} is built for {layout.top_k}"
            )
        return None

    @classmethod
    def cross_check(cls, plan: "FusionPlan") -> str | None:
        for module, fuser in plan.taking(cls):
            router, experts = (
                getattr(module, name) for name in (fuser.router, fuser.experts)
            )
            router_fuser = plan.fuser(router, RouterFuser)
            experts_fuser = plan.fuser(experts, ExpertsFuser)
            for name, child, found, fuser_cls in (
                (fuser.router, router, router_fuser, RouterFuser),
                (fuser.experts, experts, experts_fuser, ExpertsFuser),
            ):
                if found is None:
                    return (
                        f"{plan.name(module)}.{name} ({type(child).__name__}) is "
                        f"not fused by {fuser_cls.__name__}: {plan.why_not(child)}"
                    )
            assert router_fuser.routing is not None
            reason = fuser.unfit(router_fuser.routing, experts_fuser.layout(experts))
            if reason is not None:
                return f"{plan.name(module)}: {reason}"
        return None

    def update_forward(self, module: nn.Module) -> None:
        rewrite = ForwardRewrite(type(module))
        choice = rewrite.fresh_name("expert_choice")
        statement = rewrite.tree.body[self.router_at]
        _, router_call = _router_call(statement)
        router_call.func = parse_expression(f"self.{self.router}.{ROUTER_ATTR}.choice")
        statement.targets = [ast.Name(choice, ast.Store())]
        (experts_call,) = _experts_calls(rewrite.tree, module)
        experts_call.func = parse_expression(f"self.{self.experts}.{EXPERTS_ATTR}.run")
        experts_call.args[1:] = [ast.Name(choice, ast.Load())]
        self.fused_forward = rewrite.compile()

    def update_attrs(
        self, module: nn.Module, prefix: str, vllm_config: "VllmConfig"
    ) -> None:
        """Nothing to swap: the router and the experts are fused on their own."""

    def info(self, name: str, module: nn.Module) -> str:
        return (
            f"Fused: self.{self.router} -> self.{self.experts} ({name}: "
            f"{type(module).__name__}) -> vLLM's router's choice handed straight to "
            "vLLM's fused MoE"
        )
