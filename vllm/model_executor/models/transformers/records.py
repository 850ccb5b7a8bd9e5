# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What the build plan records and hands between its stages: a declined fusion, the
attention a module needs, the shard a linear becomes.

A leaf module: the core (attention, loading, the report) reads these without
importing the fusers."""

from dataclasses import dataclass, field
from typing import Any

ShardId = str | int
"""Which shard of a merged linear an original linear becomes (`"q"`, `0`, ...)."""


@dataclass(frozen=True)
class Declined:
    """One declined fusion: which fuser, for which module class, why, decided where."""

    fuser: str
    module_class: str
    reason: str
    location: str


@dataclass(frozen=True)
class AttentionNeeds:
    """What a module that dispatches attention needs from vLLM, read off the instance
    (model-wide values are wrong for models with per-layer head sizes or windows).

    Head counts are the module's totals; how many of them each tensor-parallel rank
    feeds is decided once its projections are swapped (`attention_bridge.py`)."""

    layer_index: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    head_size_v: int
    scale: float
    sliding_window: int | None = None
    logits_soft_cap: float | None = None
    sinks: str | None = None
    """The module's parameter holding one attention-sink logit per head (`s_aux`)."""
    causal: bool = True
    sources: dict[str, str | None] = field(default_factory=dict)
    """Role (`q`, `k`, `v`, `o`) -> the child linear that computes it (`o`: that
    projects the attention output), where dataflow says so."""
    latent: Any = None
    """Set by a fuser that serves the module with latent attention (MLA)."""
