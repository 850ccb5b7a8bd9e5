# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The fuser contracts.

A fuser describes one pattern recognised in a module class. It is found once per
module class (see `fuser.py`) and then applied to every instance of that class:

- `match(graph, module)` only looks, and returns a fuser or `None`;
- `validate(module, vllm_config)` says whether one instance should take it;
- `fuse(module, prefix, vllm_config)` applies it to that instance.
"""

import inspect
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Self

from torch import fx, nn

from vllm.logger import init_logger

# Defined beside the rewrites that raise it (rewriting.py cannot import fusers/),
# and
# re-exported here as part of the fuser contracts.
from vllm.model_executor.models.transformers.rewriting import FusionDeclined  # noqa: F401

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(__name__)

ShardId = str | int
"""Which shard of a merged linear an original linear becomes (`"q"`, `0`, ...)."""


@dataclass(frozen=True)
class Declined:
    """One declined fusion: which fuser, for which module class, why, decided where."""

    fuser: str
    module_class: str
    reason: str
    location: str


DECLINED: list[Declined] = []
"""Every fusion declined in this process, in order (the fusion report reads it)."""


def caller_location(depth: int = 2) -> str:
    """`file:line` of the code `depth` frames up, which is where a decision was taken."""
    frame = inspect.stack()[depth]
    return f"{frame.filename}:{frame.lineno}"


@dataclass
class BaseFuser:
    """One pattern recognised in a module class, applied per instance."""

    redefines_forward: ClassVar[bool] = False
    """Whether applying this fuser gives the class a new forward."""
    needs_graph: ClassVar[bool] = True
    """Whether `match` reads the fx graph, so the module class must be traced."""

    @classmethod
    def match(cls, graph: fx.Graph | None, module: nn.Module) -> Self | None:
        """Recognise the pattern in `module`'s class. Only looks; changes nothing."""
        raise NotImplementedError

    @classmethod
    def could_match(cls, module: nn.Module) -> bool:
        """Cheap test, before any tracing, that `match` can succeed at all."""
        return True

    @classmethod
    def decline(cls, module: nn.Module, reason: str) -> None:
        """Record and log a near miss; returns `None` so `match` can return it."""
        declined = Declined(
            fuser=cls.__name__,
            module_class=type(module).__name__,
            reason=reason,
            location=caller_location(),
        )
        DECLINED.append(declined)
        logger.info(
            "Declined %s for %s: %s (%s)",
            declined.fuser,
            declined.module_class,
            reason,
            declined.location,
        )
        return None

    def validate(self, module: nn.Module, vllm_config: "VllmConfig") -> bool:
        """Whether this instance of the matched class should take the fusion."""
        return True

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
