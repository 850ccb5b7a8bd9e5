# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The fusion plan (the fuser registry): which fusers apply to which modules, in two
of the build's three stages (DESIGN §4).

1. Class analysis (`analyse`, cached by `key(module)`: the class and the names of its
   direct children and parameters, so the cost grows with the number of distinct
   module classes, not with depth). Pure: what it found and what it declined, with
   the reasons, live in the cache entry. Any exception while matching or rewriting a
   class declines that fuser, with the reason; it never escapes.
2. Instance plan (`FusionPlan`): each instance takes a fuser only if `mismatch` finds
   nothing in the instance that differs from what the class analysis saw; every
   instance decline is logged and kept with the module's name.

The third stage, applying the plan, is the backend's (`base.py`).
"""

import ast
import functools
import inspect
import textwrap
import threading
import traceback
from collections.abc import Callable, Collection, Hashable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from torch import fx, nn

from vllm.logger import init_logger
from vllm.model_executor.models.transformers import rewriting, tracing
from vllm.model_executor.models.transformers.fusers import FUSER_CLASSES
from vllm.model_executor.models.transformers.fusers.base import (
    BaseFuser,
    Declined,
    FusionDeclined,
    ProbeResults,
)
from vllm.model_executor.models.transformers.fusers.heads import resolve

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(__name__)

Key = tuple[
    type[nn.Module], tuple[str, ...], tuple[str, ...], tuple[tuple[str, Hashable], ...]
]
F = TypeVar("F", bound=BaseFuser)

_CONDITIONS = (ast.If, ast.IfExp, ast.While, ast.Assert)


def _self_paths(expression: ast.AST) -> Iterator[str]:
    """`a.b` for each `self.a.b` read in `expression`."""
    for node in ast.walk(expression):
        if (path := rewriting.self_attribute_path(node)) is not None:
            yield path


def _tests(function: ast.AST) -> Iterator[ast.expr]:
    """Every condition in `function`: of `if`, `while`, `assert`, `a if c else b`,
    `a and b` / `a or b`, and comprehensions."""
    for node in ast.walk(function):
        if isinstance(node, _CONDITIONS):
            yield node.test
        elif isinstance(node, ast.BoolOp):
            yield from node.values
        elif isinstance(node, ast.comprehension):
            yield from node.ifs


def _own_method(cls: type[nn.Module], name: str) -> Callable | None:
    method = inspect.getattr_static(cls, name, None)
    method = getattr(method, "__func__", method)
    if not inspect.isfunction(method) or method.__module__.startswith("torch"):
        return None
    return inspect.unwrap(method)


@functools.cache
def branch_attributes(cls: type[nn.Module]) -> tuple[str, ...]:
    """The instance attributes (`a`, `a.b` for `self.a.b`) the code of `cls`'s
    forward tests in a condition, in the forward and in the methods of its own it
    calls on `self`: the class analysis traces one instance, whose values of these
    decide which branch its trace (and every verdict read off it) follows."""
    found: dict[str, None] = {}
    pending, seen = ["forward"], set()
    while pending:
        name = pending.pop()
        seen.add(name)
        method = _own_method(cls, name)
        if method is None:
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(method)))
        except (OSError, TypeError, SyntaxError):
            continue
        for test in _tests(tree):
            found.update(dict.fromkeys(_self_paths(test)))
        for call in ast.walk(tree):
            if isinstance(call, ast.Call):
                called = next(iter(_self_paths(call.func)), None)
                if called and "." not in called and called not in seen:
                    pending.append(called)
    return tuple(found)


def _state(value: object) -> Hashable:
    """What of an attribute's value may steer a branch: plain values themselves,
    anything else its type (`self.bias is not None`)."""
    if isinstance(value, bool | int | float | str | type(None)):
        return value
    return type(value).__qualname__


def key(module: nn.Module) -> Key:
    """What fusers are found by: the module's class, the names of its direct
    children and parameters, and the values of the attributes its forward branches
    on. A forward may branch on any of them (Gemma 3n's norms apply `weight` only
    where they have one; a norm applies `1 + weight` where its `unit_offset` flag is
    set), so each combination is traced and decided on its own."""
    return (
        type(module),
        tuple(name for name, _ in module.named_children()),
        tuple(name for name, _ in module.named_parameters(recurse=False)),
        tuple(
            (path, _state(resolve(module, path)))
            for path in branch_attributes(type(module))
        ),
    )


@dataclass(frozen=True)
class ClassAnalysis:
    """What the class analysis found for one key: the fusers that apply (at most one
    redefining the forward, first) and the fusions it declined, with why."""

    fusers: tuple[BaseFuser, ...]
    declined: tuple[Declined, ...]


def _raised(
    fuser_cls: type[BaseFuser], module: nn.Module, error: Exception, reason: str
) -> Declined:
    """A fusion declined by `error`, located where it was raised (the code that
    decided, not the registry that caught it)."""
    frame = traceback.extract_tb(error.__traceback__)[-1]
    return Declined(
        fuser=fuser_cls.__name__,
        module_class=type(module).__name__,
        reason=reason,
        location=f"{frame.filename}:{frame.lineno}",
    )


def _trace_if_needed(module: nn.Module) -> fx.Graph | None:
    """Trace `module` only if a fuser that reads graphs could match it."""
    if not any(f.needs_graph and f.could_match(module) for f in FUSER_CLASSES):
        return None
    return tracing.trace(module).graph


def _match(
    fuser_cls: type[BaseFuser], graph: fx.Graph | None, module: nn.Module
) -> BaseFuser | Declined | None:
    """`fuser_cls` matched on `module`, its forward rewritten if it redefines it."""
    try:
        if not fuser_cls.could_match(module):
            return None
        found = fuser_cls.match(graph, module)
        if isinstance(found, BaseFuser) and found.redefines_forward:
            found.update_forward(module)
        return found
    except FusionDeclined as reason:
        return _raised(fuser_cls, module, reason, f"forward not rewritten: {reason}")
    except Exception as error:  # noqa: BLE001 - fail closed: the model stays unfused
        reason = f"analysis failed: {type(error).__name__}: {error}"
        return _raised(fuser_cls, module, error, reason)


_analyses: dict[Key, ClassAnalysis] = {}
# Held while an analysis runs, so each key is analysed (and its class's forward
# rewritten) once, however many threads ask for it at the same time.
_analysis_lock = threading.RLock()


def analyse(module: nn.Module) -> ClassAnalysis:
    """Stage 1 for `module`'s key: every fuser that applies, and every decline."""
    module_key = key(module)
    with _analysis_lock:
        found = _analyses.get(module_key)
        if found is None:
            found = _analyses[module_key] = _analyse(module)
        return found


def analysed() -> tuple[ClassAnalysis, ...]:
    """Every class analysis made so far."""
    with _analysis_lock:
        return tuple(_analyses.values())


def _analyse(module: nn.Module) -> ClassAnalysis:
    try:
        graph = _trace_if_needed(module)
    except Exception as error:  # noqa: BLE001 - tracing already stops where it fails
        logger.info("Not tracing %s: %s", type(module).__name__, error)
        graph = None
    rewrite: BaseFuser | None = None
    others: list[BaseFuser] = []
    declined: list[Declined] = []
    for fuser_cls in FUSER_CLASSES:
        if fuser_cls.redefines_forward and rewrite is not None:
            continue
        found = _match(fuser_cls, graph, module)
        if isinstance(found, Declined):
            logger.info(
                "Declined %s for %s: %s (%s)",
                found.fuser,
                found.module_class,
                found.reason,
                found.location,
            )
            declined.append(found)
        elif found is not None and found.redefines_forward:
            rewrite = found
        elif found is not None:
            others.append(found)
    fusers = (rewrite, *others) if rewrite is not None else tuple(others)
    if not fusers and type(module).__name__.endswith("RMSNorm"):
        logger.warning(
            "%s is named like an RMSNorm but computes something else, so it keeps "
            "Transformers' implementation; see the declined fusions above for why.",
            type(module).__name__,
        )
    return ClassAnalysis(fusers, tuple(declined))


def get_fusers(module: nn.Module) -> tuple[BaseFuser, ...]:
    """Every fuser that applies to `module`'s class (stage 1)."""
    return analyse(module).fusers


def get_fuser(module: nn.Module, cls: type[F]) -> F | None:
    """The first fuser of class `cls` that applies to `module`, or `None`."""
    return next((f for f in get_fusers(module) if isinstance(f, cls)), None)


def clear_cache() -> None:
    """Forget every class analysis, and every probe result behind the plans (tests
    that reuse a class with other shapes)."""
    with _analysis_lock:
        _analyses.clear()
        ProbeResults.clear_all()


@dataclass(frozen=True)
class InstanceDecline:
    """A fuser the class analysis found that one instance does not take, and why."""

    module: str
    module_class: str
    fuser: str
    reason: str


def _mismatch(
    fuser: BaseFuser, module: nn.Module, vllm_config: "VllmConfig"
) -> str | None:
    try:
        return fuser.mismatch(module, vllm_config)
    except Exception as error:  # noqa: BLE001 - fail closed: this instance stays unfused
        return f"checking this instance failed: {type(error).__name__}: {error}"


class FusionPlan(Mapping[nn.Module, tuple[BaseFuser, ...]]):
    """Stage 2: the fusers each module of `model` takes, in the order to apply them,
    and the class analyses and instance declines behind that plan."""

    def __init__(
        self,
        model: nn.Module,
        vllm_config: "VllmConfig",
        prefix: str = "",
        kept: Collection[str] = (),
    ):
        """`kept`: names (with `prefix`) of modules left to Transformers whole, which
        are neither analysed nor planned, nor anything under them."""
        self._fusers: dict[nn.Module, tuple[BaseFuser, ...]] = {}
        self.analyses: dict[str, ClassAnalysis] = {}
        """Module class name -> its class analysis, for the classes in `model`."""
        self.declined: list[InstanceDecline] = []
        self.analysed: dict[nn.Module, ClassAnalysis] = {}
        """Every module planned, with its class analysis."""
        self._names: dict[nn.Module, str] = {}
        self._why_not: dict[nn.Module, list[str]] = {}
        for name, module in model.named_modules(prefix=prefix):
            if any(name == k or name.startswith(f"{k}.") for k in kept):
                continue
            analysis = analyse(module)
            self.analysed[module] = analysis
            self._names[module] = name
            self._why_not[module] = [
                f"{d.fuser}: {d.reason} ({d.location})" for d in analysis.declined
            ]
            if analysis.fusers or analysis.declined:
                self.analyses.setdefault(type(module).__name__, analysis)
            taken = []
            for fuser in analysis.fusers:
                reason = _mismatch(fuser, module, vllm_config)
                if reason is None:
                    taken.append(fuser)
                    continue
                self._decline(module, fuser, reason)
            if taken:
                self._fusers[module] = tuple(taken)
        self._cross_check()

    def _decline(self, module: nn.Module, fuser: BaseFuser, reason: str) -> None:
        name = self._names[module]
        self.declined.append(
            InstanceDecline(name, type(module).__name__, type(fuser).__name__, reason)
        )
        self._why_not[module].append(f"{type(fuser).__name__}: {reason}")
        logger.info(
            "Not fused: %s in %s (%s): %s",
            type(fuser).__name__,
            name,
            type(module).__name__,
            reason,
        )

    def _cross_check(self) -> None:
        """Withdraw every fuser whose `cross_check` finds the plan around it wrong
        (a fusion whose output other modules must consume), from every instance,
        until the plan holds still: withdrawing one may fail another's check."""
        while True:
            failed = {}
            for fuser_cls in {type(f) for fs in self._fusers.values() for f in fs}:
                try:
                    reason = fuser_cls.cross_check(self)
                except Exception as error:  # noqa: BLE001 - fail closed: unfused
                    reason = f"checking the plan failed: {type(error).__name__}: {error}"
                if reason is not None:
                    failed[fuser_cls] = reason
            if not failed:
                return
            for module, fusers in list(self._fusers.items()):
                for fuser in fusers:
                    if type(fuser) in failed:
                        self._decline(module, fuser, failed[type(fuser)])
                kept = tuple(f for f in fusers if type(f) not in failed)
                if kept:
                    self._fusers[module] = kept
                else:
                    del self._fusers[module]

    def name(self, module: nn.Module) -> str:
        """The name `module` was planned under."""
        return self._names[module]

    def __getitem__(self, module: nn.Module) -> tuple[BaseFuser, ...]:
        return self._fusers.get(module, ())

    def matched(self, module: nn.Module) -> tuple[BaseFuser, ...]:
        """The fusers the class analysis found for `module`; none for a module the
        plan never saw (a vLLM layer a fuser built, which is not analysed: it is
        vLLM's already)."""
        analysis = self.analysed.get(module)
        return analysis.fusers if analysis is not None else ()

    def fuser(self, module: nn.Module, cls: type[F]) -> F | None:
        """The fuser of class `cls` the plan gives `module`, if any."""
        return next((f for f in self[module] if isinstance(f, cls)), None)

    def taking(self, cls: type[F]) -> Iterator[tuple[nn.Module, F]]:
        """Each module the plan gives a fuser of class `cls`, with that fuser."""
        for module in self:
            if (fuser := self.fuser(module, cls)) is not None:
                yield module, fuser

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(self._fusers)

    def __len__(self) -> int:
        return len(self._fusers)

    def why_not(self, module: nn.Module) -> str:
        """Every fusion declined for `module`, its class's and its own, with why."""
        return "; ".join(self._why_not.get(module, [])) or "nothing matched"

    @property
    def packed_modules_mapping(self) -> dict[str, list[str]]:
        """Every merged name the plan creates -> the original names it packs: known
        before any layer is built, so quantisation and LoRA read it in time."""
        mapping: dict[str, list[str]] = {}
        for fusers in self._fusers.values():
            for fuser in fusers:
                for merged, originals in fuser.packed_modules_mapping.items():
                    mapping.setdefault(merged, list(originals))
        return mapping
