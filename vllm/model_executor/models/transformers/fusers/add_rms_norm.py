# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Residual adds that feed an RMSNorm, on vLLM's fused add-and-norm."""

import ast
from dataclasses import dataclass
from typing import TYPE_CHECKING, Self

from torch import fx, nn

from vllm.model_executor.models.transformers.fusers.base import (
    Declined,
    RewriteFuser,
)
from vllm.model_executor.models.transformers.fusers.rms_norm import RMSNormFuser
from vllm.model_executor.models.transformers.rewriting import (
    ForwardRewrite,
    forward_source,
    is_self_attribute,
    stored_names,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.model_executor.models.transformers.plan import FusionPlan


@dataclass(frozen=True)
class Site:
    """`hidden = residual + hidden; residual = hidden; hidden = self.<norm>(hidden)`,
    three statements from `index` in the forward's body, whose `hidden` before the
    add is the output of the child `source`."""

    index: int
    hidden: str
    residual: str
    norm: str
    source: str


def _bound_name(statement: ast.stmt) -> str | None:
    """`x` where `statement` is `x = <value>`."""
    if (
        isinstance(statement, ast.Assign)
        and len(statement.targets) == 1
        and isinstance(statement.targets[0], ast.Name)
    ):
        return statement.targets[0].id
    return None


def _name(node: ast.AST) -> str | None:
    return node.id if isinstance(node, ast.Name) else None


def _mentions(tree: ast.AST, name: str) -> bool:
    return any(isinstance(n, ast.Name) and n.id == name for n in ast.walk(tree))


def _binds(statement: ast.stmt, name: str) -> bool:
    return bool(stored_names(statement, name))


def _holds_weights(module: nn.Module, child: str) -> bool:
    """Whether `module.<child>` is a module with parameters: its output is a new
    tensor (a child without any may hand back its input: dropout, identity)."""
    found = getattr(module, child, None)
    return isinstance(found, nn.Module) and any(True for _ in found.parameters())


def _self_call(node: ast.AST) -> str | None:
    """`child` where `node` is `self.<child>(...)`."""
    if isinstance(node, ast.Call) and is_self_attribute(node.func):
        return node.func.attr
    return None


def _norm_of_sum(body: list[ast.stmt], index: int) -> tuple[str, str, str] | None:
    """(hidden, residual, norm) where the statements from `index` bind `hidden`, then
    are `residual = hidden` and `hidden = self.<norm>(hidden)`; `None` otherwise."""
    bind, alias, norm = body[index : index + 3]
    hidden = _name(alias.value) if isinstance(alias, ast.Assign) else None
    residual = _bound_name(alias)
    if None in (hidden, residual) or hidden == residual or not _binds(bind, hidden):
        return None
    call = norm.value if _bound_name(norm) == hidden else None
    if (
        _self_call(call) is None
        or [_name(a) for a in call.args] != [hidden]
        or call.keywords
    ):
        return None
    return hidden, residual, call.func.attr


def _added(statement: ast.stmt, hidden: str, residual: str) -> bool:
    """Whether `statement` is `hidden = residual + hidden` (or `hidden + residual`)."""
    value = statement.value if _bound_name(statement) == hidden else None
    return (
        isinstance(value, ast.BinOp)
        and isinstance(value.op, ast.Add)
        and sorted([_name(value.left), _name(value.right)], key=str)
        == sorted([hidden, residual])
    )


def _last_binding(body: list[ast.stmt], name: str, before: int) -> int | None:
    return next(
        (i for i in range(before - 1, -1, -1) if _binds(body[i], name)), None
    )


def _unshared_output(
    body: list[ast.stmt], index: int, hidden: str, module: nn.Module
) -> str:
    """The child whose output `hidden` holds at the add, where no other name can hold
    that value; raises `ValueError` with why not."""
    bound = _last_binding(body, hidden, index)
    statement = body[bound] if bound is not None else None
    source = _self_call(statement.value) if isinstance(statement, ast.Assign) else None
    targets = statement.targets if source is not None else []
    if not (
        len(targets) == 1
        and any(
            isinstance(n, ast.Name) and n.id == hidden
            for n in (
                targets[0].elts if isinstance(targets[0], ast.Tuple) else targets
            )
        )
    ):
        raise ValueError(
            f"`{hidden}` is not bound to a child module's output before the add"
        )
    if not _holds_weights(module, source):
        raise ValueError(f"`{hidden}` comes from self.{source}, which holds no weights")
    if any(_mentions(s, hidden) for s in body[bound + 1 : index]):
        raise ValueError(f"`{hidden}` is read between self.{source} and the add")
    return source


def _check_residual(body: list[ast.stmt], index: int, residual: str) -> None:
    """Raise `ValueError` unless `residual` is the only name holding its value at the
    add: bound as `residual = x`, and `x` rebound before anything else reads it."""
    bound = _last_binding(body, residual, index)
    statement = body[bound] if bound is not None else None
    alias = _name(statement.value) if _bound_name(statement) == residual else None
    if alias is None:
        raise ValueError(f"`{residual}` is not bound as `{residual} = <name>`")
    if any(_mentions(s, residual) for s in body[bound + 1 : index]):
        raise ValueError(f"`{residual}` is read before the add")
    rebound = next(
        (i for i in range(bound + 1, index) if _mentions(body[i], alias)), None
    )
    if rebound is None:
        raise ValueError(f"`{alias}` still holds the residual's value at the add")
    if not _binds(body[rebound], alias):
        raise ValueError(
            f"`{alias}`, which holds the residual's value too, is read before it is "
            "rebound"
        )


def sites(body: list[ast.stmt], module: nn.Module) -> list[Site | str]:
    """Every add-then-norm at the top level of a forward's `body`: a `Site` where the
    dataflow proves it may take the fused add-and-norm, else why not."""
    found: list[Site | str] = []
    for index in range(len(body) - 2):
        shape = _norm_of_sum(body, index)
        if shape is None:
            continue
        hidden, residual, norm = shape
        child = getattr(module, norm, None)
        if not (isinstance(child, nn.Module) and RMSNormFuser.could_match(child)):
            continue
        into = f"`{residual} = {hidden}` before self.{norm}"
        if not _added(body[index], hidden, residual):
            value = body[index].value if isinstance(body[index], ast.Assign) else None
            if not (
                isinstance(value, ast.BinOp)
                and isinstance(value.op, ast.Add)
                and _mentions(value, residual)
            ):
                continue
            # A residual add, but of something other than the two names.
            found.append(
                f"{into} takes `{ast.unparse(body[index])}`, not "
                f"`{hidden} = {residual} + {hidden}`"
            )
            continue
        try:
            source = _unshared_output(body, index, hidden, module)
            _check_residual(body, index, residual)
        except ValueError as reason:
            found.append(f"{into}: {reason}")
            continue
        found.append(Site(index, hidden, residual, norm, source))
    return found


@dataclass
class AddRMSNormFuser(RewriteFuser):
    """`h = r + h; r = h; h = self.norm(h)` -> `h, r = self.norm(h, r)`: a residual
    add that feeds an RMSNorm becomes vLLM's fused add-and-norm, as in vLLM's native
    decoder layers (one kernel where the add and the norm were two).

    vLLM's kernel may write in place (CUDA's does): the sum into `r`'s tensor, the
    normalised output into `h`'s. So a site is taken only where the forward's own
    statements, at its top level, prove neither value is read again: `h` before the
    add is the output of a child holding weights (a new tensor, not its input) and
    read by nothing else; `r` was bound as `r = x` with `x` rebound before anything
    else read it (the layer's input, which the decoder loop replaces with the
    layer's output, as vLLM's native layers overwrite it too). The fused call runs
    where the two share dtype and shape (the kernel's sum takes `h`'s dtype and does
    not broadcast); else the three original statements run. The norm must be on
    vLLM's RMSNorm in every instance (`cross_check`), or no site is fused."""

    kind = "add_rms_norm"
    summary = "the residual add fused into one in {n} modules"
    coverage = "add_norm"
    needs_graph = False

    sites: tuple[Site, ...] = ()

    @classmethod
    def could_match(cls, module: nn.Module) -> bool:
        return any(True for _ in module.children())

    @classmethod
    def match(cls, graph: fx.Graph | None, module: nn.Module) -> Self | Declined | None:
        source = forward_source(type(module))
        if source is None:
            return None
        found = sites(source.tree.body, module)
        if not found:
            return None
        if declined := [s for s in found if isinstance(s, str)]:
            return cls.decline(module, "; ".join(declined))
        return cls(sites=tuple(found))

    @property
    def norms(self) -> tuple[str, ...]:
        return tuple(site.norm for site in self.sites)

    def mismatch(self, module: nn.Module, vllm_config: "VllmConfig") -> str | None:
        for site in self.sites:
            if not _holds_weights(module, site.source):
                return f"self.{site.source} holds no weights in this instance"
            if not isinstance(getattr(module, site.norm, None), nn.Module):
                return f"this instance has no module self.{site.norm}"
        return None

    @classmethod
    def cross_check(cls, plan: "FusionPlan") -> str | None:
        for module, fuser in plan.taking(cls):
            for norm in fuser.norms:
                child = getattr(module, norm)
                if plan.fuser(child, RMSNormFuser) is None:
                    return (
                        f"{plan.name(module)}.{norm} ({type(child).__name__}) is not "
                        f"on vLLM's RMSNorm: {plan.why_not(child)}"
                    )
        return None

    def update_forward(self, module: nn.Module) -> None:
        rewrite = ForwardRewrite(type(module))
        body = rewrite.tree.body
        # From the last site back, so each site's index still holds.
        for site in reversed(self.sites):
            h, r, norm = site.hidden, site.residual, site.norm
            fused = ast.parse(
                f"if {h}.dtype == {r}.dtype and {h}.shape == {r}.shape:\n"
                f"    {h}, {r} = self.{norm}({h}, {r})\n"
                "else:\n"
                "    pass\n"
            ).body[0]
            fused.orelse = body[site.index : site.index + 3]
            body[site.index : site.index + 3] = [fused]
        self.fused_forward = rewrite.compile()

    def update_attrs(
        self, module: nn.Module, prefix: str, vllm_config: "VllmConfig"
    ) -> None:
        """Nothing to swap: the norms are fused on their own (`RMSNormFuser`)."""

    def info(self, name: str, module: nn.Module) -> str:
        fused = ", ".join(f"{s.residual} + {s.hidden} -> {s.norm}" for s in self.sites)
        return (
            f"Fused: {fused} ({name}: {type(module).__name__}) -> vLLM's fused "
            "add-and-norm"
        )
