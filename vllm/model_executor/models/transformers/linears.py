# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What counts as a linear layer in HF code, and how a checkpoint stores its weight.

Besides `nn.Linear`, GPT-2 and its relatives use Transformers' `Conv1D`: the same map
`x @ W + b`, but with the weight stored `[in, out]`, transposed. The tracer, the
fusers and the backend read any HF linear through these helpers, and a vLLM linear
built in place of a `Conv1D` transposes that weight as it loads it."""

from torch import nn
from transformers.pytorch_utils import Conv1D

from vllm.model_executor.model_loader.weight_utils import default_weight_loader

HF_LINEARS: tuple[type[nn.Module], ...] = (nn.Linear, Conv1D)
"""The HF layers that compute `x @ W + b` (swapped for vLLM linears as they are)."""


def is_linear(module: object) -> bool:
    return isinstance(module, HF_LINEARS)


def in_features(linear: nn.Module) -> int:
    return linear.nx if isinstance(linear, Conv1D) else linear.in_features


def out_features(linear: nn.Module) -> int:
    return linear.nf if isinstance(linear, Conv1D) else linear.out_features


def stores_transposed(linear: nn.Module) -> bool:
    """Whether `linear`'s checkpoint weight is `[in, out]` (a `Conv1D`)."""
    return isinstance(linear, Conv1D)


def load_as_stored(layer: nn.Module, source: nn.Module, prefix: str) -> nn.Module:
    """`layer`, a vLLM linear (named `prefix`) built in place of `source`, made to
    load the checkpoint weight the way `source` stores it: a `Conv1D`'s `[in, out]`
    is transposed before the layer's own loader shards it. Returns `layer`."""
    if not stores_transposed(source):
        return layer
    weight = getattr(layer, "weight", None)
    if not isinstance(weight, nn.Parameter) or weight.ndim != 2:
        # A quantised layout (packed `qweight`) has no `[out, in]` weight to fill.
        raise ValueError(
            f"{prefix} ({type(source).__name__}) stores its weight transposed, but "
            f"the {type(layer).__name__} built for it has no 2-D `weight` to load "
            "it into (quantised Conv1D layers are not supported)."
        )
    load = getattr(weight, "weight_loader", default_weight_loader)

    def load_transposed(param: nn.Parameter, loaded, *args, **kwargs):
        return load(param, loaded.t(), *args, **kwargs)

    # vLLM's parameters let their loader be overridden (`weight_loader` has a setter).
    weight.weight_loader = load_transposed
    return layer
