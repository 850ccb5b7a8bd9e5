# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""One fuser per file; `FUSER_CLASSES` is the order the registry tries them in."""

from vllm.model_executor.models.transformers.fusers.attention import AttentionFuser
from vllm.model_executor.models.transformers.fusers.base import (
    BaseFuser,
    RewriteFuser,
    StackedFuser,
)

FUSER_CLASSES: tuple[type[BaseFuser], ...] = (AttentionFuser,)

__all__ = [
    "FUSER_CLASSES",
    "AttentionFuser",
    "BaseFuser",
    "RewriteFuser",
    "StackedFuser",
]
