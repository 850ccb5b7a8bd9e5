# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The fuser contracts.

A fuser describes one pattern recognised in a module class. It is found once per
module class (see `plan.py`) and then applied to every instance of that class:

- `match(graph, module)` only looks, and returns a fuser, `None`, or a `Declined`;
- `mismatch(module, vllm_config)` says why one instance should not take it (and
  `validate` whether it should);
- `fuse(module, prefix, vllm_config)` applies it to that instance, and the other
  hooks tell the build what that changed (weights, packing, attention, report).
"""

import inspect
import threading
import types
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Self, TypeVar

import torch
from torch import fx, nn

# Defined where the core reads them (a leaf module, and beside the rewrites that raise
# `FusionDeclined`) and re-exported here as part of the fuser contracts.
from vllm.model_executor.models.transformers.records import (
    AttentionNeeds,
    Declined,
    ShardId,
)
from vllm.model_executor.models.transformers.rewriting import FusionDeclined  # noqa: F401

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from vllm.model_executor.models.transformers.plan import FusionPlan

T = TypeVar("T")


class ProbeResults:
    """Results of a pure probe, kept by everything they depend on (a function and
    the shapes it is probed with; a module's class, plain attributes and tensor
    shapes), so instances alike are probed once. Never a verdict kept on a fuser:
    the class analysis is cached and shared, and each instance's verdict is the
    plan's. Locked; emptied with the registry's cache (`clear_all`)."""

    _every: ClassVar[list["ProbeResults"]] = []

    def __init__(self) -> None:
        self._results: dict[Hashable, Any] = {}
        self._lock = threading.Lock()
        ProbeResults._every.append(self)

    def get(self, key: Hashable, probe: Callable[[], T]) -> T:
        """`probe()`'s result for `key`, probed the first time only (outside the
        lock: a probe may probe further)."""
        with self._lock:
            if key in self._results:
                return self._results[key]
        result = probe()
        with self._lock:
            return self._results.setdefault(key, result)

    @classmethod
    def clear_all(cls) -> None:
        for results in cls._every:
            with results._lock:
                results._results.clear()


def caller_location(depth: int = 2) -> str:
    """`file:line` of the code `depth` frames up, which is where a decision was taken."""
    frame = inspect.stack()[depth]
    return f"{frame.filename}:{frame.lineno}"


@dataclass
class BaseFuser:
    """One pattern recognised in a module class, applied per instance.

    The build asks every fuser the same questions, in three stages (DESIGN §4): the
    class analysis (`match`, and `update_forward` for rewrites), the instance plan
    (`mismatch`, then `cross_check` over the whole plan), and the apply (`fuse`, then `stacked_weights`,
    `renamed_weights`, `packed_modules_mapping`, `report_detail`, `attention_needs`/`adjust_attention`, `info` and
    `kind` for the report)."""

    redefines_forward: ClassVar[bool] = False
    """Whether applying this fuser gives the class a new forward."""
    needs_graph: ClassVar[bool] = True
    """Whether `match` reads the fx graph, so the module class must be traced."""
    kind: ClassVar[str] = ""
    """What the fusion report counts this fuser as (`qkv`, `glu`, `rms_norm`...)."""
    summary: ClassVar[str] = ""
    """The report's one-line count of this kind's fusions (`{n}`: how many), where
    the line shows them."""
    coverage: ClassVar[str] = ""
    """The column of `report --all` this kind's fusions tick, where one does."""
    details_title: ClassVar[str] = ""
    """The title of the report's section listing each fused instance (what
    `report_detail` returns), where the fuser lists them."""
    details_beside: ClassVar[bool] = False
    """Whether that section also names the other children with linears of the
    block holding each instance (an MoE block's shared expert, which runs in the
    block's own code)."""

    @classmethod
    def match(
        cls, graph: fx.Graph | None, module: nn.Module
    ) -> "Self | Declined | None":
        """Recognise the pattern in `module`'s class. Only looks; changes nothing.

        Returns the fuser, `None` when the pattern is absent, or the `Declined`
        from `decline` when it almost matches."""
        raise NotImplementedError

    @classmethod
    def could_match(cls, module: nn.Module) -> bool:
        """Cheap test, before any tracing, that `match` can succeed at all."""
        return True

    @classmethod
    def decline(cls, module: nn.Module, reason: str) -> Declined:
        """A near miss, for `match` to return; the registry logs and keeps it."""
        return Declined(
            fuser=cls.__name__,
            module_class=type(module).__name__,
            reason=reason,
            location=caller_location(),
        )

    def mismatch(self, module: nn.Module, vllm_config: "VllmConfig") -> str | None:
        """Why this instance differs from what the class analysis assumed (or cannot
        take the fusion under `vllm_config`); `None` when it takes it. Re-derives
        from the instance everything the rewrite depends on."""
        return None

    @classmethod
    def cross_check(cls, plan: "FusionPlan") -> str | None:
        """Why no instance in the model may take this fuser, given what the plan gives
        the other modules (a fusion whose output another module must consume);
        `None` when the plan is consistent. Run on the whole plan, before anything
        is built; a failed check withdraws the fuser from every instance."""
        return None

    def validate(self, module: nn.Module, vllm_config: "VllmConfig") -> bool:
        """Whether this instance of the matched class should take the fusion."""
        return self.mismatch(module, vllm_config) is None

    def fuse(
        self, module: nn.Module, prefix: str, vllm_config: "VllmConfig"
    ) -> nn.Module:
        """Apply the fusion to `module`; returns the module to keep in its place."""
        return module

    def info(self, name: str, module: nn.Module) -> str:
        """The line logged when the fusion applies to `module`, named `name`."""
        return f"Fused: {type(self).__name__} ({name}: {type(module).__name__})"

    @property
    def packed_modules_mapping(self) -> dict[str, list[str]]:
        """Merged child name -> the original child names it packs."""
        return {}

    def stacked_weights(self, prefix: str) -> dict[str, tuple[str, ShardId]]:
        """Checkpoint name fragment -> (fused name fragment, shard) for weight loading."""
        return {}

    def report_detail(self, name: str, module: nn.Module) -> str | None:
        """What the fusion report lists for this fused instance, named `name`, in a
        section of its own (`kind`); `None` when the class counts say enough."""
        return None

    def renamed_weights(self, prefix: str) -> dict[str, str]:
        """Checkpoint name prefix -> the prefix of the layer that now loads it."""
        return {}

    def attention_needs(
        self, module: nn.Module, vllm_config: "VllmConfig"
    ) -> AttentionNeeds | None:
        """The vLLM attention `module` needs, if this fuser makes it dispatch one."""
        return None

    def adjust_attention(
        self, needs: AttentionNeeds, module: nn.Module, vllm_config: "VllmConfig"
    ) -> AttentionNeeds:
        """`needs`, changed by what this fuser did to `module` (latent attention)."""
        return needs


@dataclass
class RewriteFuser(BaseFuser):
    """A fuser that gives the module class a new forward and swaps its submodules."""

    redefines_forward: ClassVar[bool] = True

    fused_forward: Callable | None = field(default=None, init=False, repr=False)
    """The rewritten forward, built once per class by `update_forward`."""

    def update_forward(self, module: nn.Module) -> None:
        """Rewrite the class's forward once and keep it as `fused_forward`.

        Raises `FusionDeclined` when the forward cannot be rewritten safely."""
        raise NotImplementedError

    def update_attrs(
        self, module: nn.Module, prefix: str, vllm_config: "VllmConfig"
    ) -> None:
        """Swap the instance's submodules for the fused ones."""
        raise NotImplementedError

    def fuse(
        self, module: nn.Module, prefix: str, vllm_config: "VllmConfig"
    ) -> nn.Module:
        assert self.fused_forward is not None, "update_forward must run first"
        self.update_attrs(module, prefix, vllm_config)
        # Bound on the instance: other instances of the class (a vision tower sharing
        # the class but not validated) keep the original forward.
        module.forward = types.MethodType(self.fused_forward, module)
        return module


@dataclass
class StackedFuser(RewriteFuser):
    """A rewrite that stacks several linears into one vLLM merged linear.

    `shards` maps each original linear's name to its shard in `fused_name`, which is
    what routes each checkpoint tensor to its slice of the merged weight."""

    fused_name: str = ""
    shards: dict[str, ShardId] = field(default_factory=dict)

    @property
    def packed_modules_mapping(self) -> dict[str, list[str]]:
        return {self.fused_name: list(self.shards)}

    def stacked_weights(self, prefix: str) -> dict[str, tuple[str, ShardId]]:
        dot = f"{prefix}." if prefix else ""
        return {
            f"{dot}{name}.": (f"{dot}{self.fused_name}.", shard)
            for name, shard in self.shards.items()
        }

    def info(self, name: str, module: nn.Module) -> str:
        merged = getattr(module, self.fused_name, None)
        return (
            f"Fused: {' + '.join(self.shards)} ({name}: {type(module).__name__}) -> "
            f"{self.fused_name} ({type(merged).__name__})"
        )


_mixer_verdicts = ProbeResults()
"""(fuser, module class, dims, plain attributes) of a mixer -> its probe's verdict:
the dims proven, or why not."""


class MixerFuser(BaseFuser):
    """What the fusers that put a mixer on one of vLLM's stateful layers share: the
    dims vLLM's layer would be built with, read off each instance's tensors
    (`measure`) and proven on a float64 probe against the module itself (`prove`),
    once per module class, dims and plain attributes (its children's too); served
    only by a model class vLLM keeps state for, and only where the layer splits over
    the ranks (`unfit`)."""

    needs_graph: ClassVar[bool] = False

    @staticmethod
    def measure(module: nn.Module) -> Any:
        """The dims from the module's tensors (not yet proven), or why they do not
        fit the layer."""
        raise NotImplementedError

    @staticmethod
    def prove(module: nn.Module, dims: Any) -> Any:
        """`dims` as the probe proves them (or corrects them), or why not."""
        raise NotImplementedError

    def unfit(
        self, module: nn.Module, dims: Any, vllm_config: "VllmConfig"
    ) -> str | None:
        """Why this engine cannot run the proven layer (its ranks, its chunking)."""
        return None

    @classmethod
    def state_of(cls, module: nn.Module) -> Any:
        """What the layer would be built with for `module` (its state's size), why
        it cannot be, or `None` when `module` is no such mixer: read before a model
        is built, to size vLLM's state cache."""
        matched = cls.match(None, module)
        if matched is None:
            return None
        if isinstance(matched, Declined):
            return matched.reason
        return cls.measure(module)

    def dims(self, module: nn.Module) -> Any:
        """The instance's dims as its probe proved them, or why it cannot be."""
        found = self.measure(module)
        if isinstance(found, str):
            return found
        # The plain attributes of the module and its children: a child's flag can
        # change what it computes (Falcon-H1's norm's `norm_before_gate`).
        attributes = tuple(
            (f"{prefix}.{name}", value)
            for prefix, part in module.named_modules()
            for name, value in vars(part).items()
            if not name.startswith("_") and isinstance(value, int | float | str | tuple)
        )
        key = (type(self), type(module), found, attributes)
        # On the CPU whatever the default device (the report builds on `meta`).
        with torch.device("cpu"):
            return _mixer_verdicts.get(key, lambda: self.prove(module, found))

    def mismatch(self, module: nn.Module, vllm_config: "VllmConfig") -> str | None:
        if not vllm_config.model_config.is_hybrid:
            return (
                "vLLM keeps no state for this model: it is served by a class that is "
                "not hybrid (vLLM named the class without the overlay's routing)"
            )
        found = self.dims(module)
        if isinstance(found, str):
            return found
        return self.unfit(module, found, vllm_config)
