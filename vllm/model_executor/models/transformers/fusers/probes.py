# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What the fusers that prove a fusion by running code share: random values from a
seeded generator on the CPU, whatever the default device (the report builds models
on `meta`), so a verdict is the same on every run; and a probe that raises, which
is a reason to decline, never an error.

What each fuser runs and how closely it compares stay its own: the experts' gate
(`experts.py`) and the rotation (`rotary.py`) are elementwise and equal in float64
to 1e-12; a router (`router.py`) is run whole, its tensors replaced, in float64 and
float32, and its choice compared per token in any order of the experts."""

from collections.abc import Sequence

import torch


class Draws:
    """Normal values on the CPU, each draw continuing one stream seeded with `seed`."""

    def __init__(self, seed: int = 0):
        self._generator = torch.Generator(device="cpu").manual_seed(seed)

    def normal(
        self, shape: Sequence[int], std: float = 1.0, dtype: torch.dtype = torch.float64
    ) -> torch.Tensor:
        values = torch.randn(
            tuple(shape), generator=self._generator, dtype=dtype, device="cpu"
        )
        return std * values


def failed(error: Exception, subject: str = "it") -> str:
    """Why a probe of `subject` that raised `error` declines."""
    return f"{subject} fails on a probe: {type(error).__name__}: {error}"
