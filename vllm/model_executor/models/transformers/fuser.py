# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The fuser registry: which fusers apply to which modules.

Fusers are found once per `key(module)` (the class and the names of its direct
children), so the cost grows with the number of distinct module classes in a model,
not with its depth.
"""

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, TypeVar

from cachetools import cached
from torch import fx, nn

from vllm.logger import init_logger
from vllm.model_executor.models.transformers import tracing
from vllm.model_executor.models.transformers.fusers import FUSER_CLASSES
from vllm.model_executor.models.transformers.fusers.base import (
    BaseFuser,
    FusionDeclined,
    RewriteFuser,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(__name__)

FUSERS: tuple[type[BaseFuser], ...] = FUSER_CLASSES
"""Every fuser, in the order they are tried."""

Key = tuple[type[nn.Module], tuple[str, ...]]
F = TypeVar("F", bound=BaseFuser)


def key(module: nn.Module) -> Key:
    """What fusers are found by: the module's class and its direct children's names."""
    return type(module), tuple(name for name, _ in module.named_children())


def _trace_if_needed(module: nn.Module) -> fx.Graph | None:
    """Trace `module` only if a fuser that reads graphs could match it."""
    if not any(f.needs_graph and f.could_match(module) for f in FUSERS):
        return None
    return tracing.trace(module).graph


@cached(cache={}, key=key)
def get_fusers(module: nn.Module) -> tuple[BaseFuser, ...]:
    """Every fuser that applies to `module`'s class.

    At most one redefines the forward, and it comes first; any number that leave the
    forward alone follow. A rewrite that cannot be applied is dropped with its reason
    logged."""
    graph = _trace_if_needed(module)
    rewrite: RewriteFuser | None = None
    others: list[BaseFuser] = []
    for fuser_cls in FUSERS:
        if not fuser_cls.could_match(module):
            continue
        if fuser_cls.redefines_forward and rewrite is not None:
            continue
        fuser = fuser_cls.match(graph, module)
        if fuser is None:
            continue
        if isinstance(fuser, RewriteFuser):
            try:
                fuser.update_forward(module)
            except FusionDeclined as reason:
                fuser_cls.decline(module, f"forward not rewritten: {reason}")
                continue
            rewrite = fuser
        else:
            others.append(fuser)
    if rewrite is None and not others and type(module).__name__.endswith("RMSNorm"):
        # Cached per key, so this warns once per class.
        logger.warning(
            "%s is named like an RMSNorm but computes something else, so it keeps "
            "Transformers' implementation; see the declined fusions above for why.",
            type(module).__name__,
        )
    return (rewrite, *others) if rewrite is not None else tuple(others)


def get_fuser(module: nn.Module, cls: type[F]) -> F | None:
    """The first fuser of class `cls` that applies to `module`, or `None`."""
    return next((f for f in get_fusers(module) if isinstance(f, cls)), None)


class Fusers(Mapping[nn.Module, tuple[BaseFuser, ...]]):
    """The validated fusers of every module in `model`, in the order to apply them."""

    def __init__(self, model: nn.Module, vllm_config: "VllmConfig"):
        self._fusers: dict[nn.Module, tuple[BaseFuser, ...]] = {}
        for module in model.modules():
            found = tuple(
                fuser
                for fuser in get_fusers(module)
                if fuser.validate(module, vllm_config)
            )
            if found:
                self._fusers[module] = found

    def __getitem__(self, module: nn.Module) -> tuple[BaseFuser, ...]:
        return self._fusers.get(module, ())

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(self._fusers)

    def __len__(self) -> int:
        return len(self._fusers)
