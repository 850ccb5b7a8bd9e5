# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Layer replacement helpers for the Transformers modeling backend.

`replace_linear_class` and `recursive_replace_linear` are also used by vLLM models
outside this package (vision and audio towers), so their signatures are stable.
"""

import fnmatch
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Literal

import torch
from torch import nn

from vllm.logger import init_logger
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    LinearBase,
    ReplicatedLinear,
    RowParallelLinear,
    UnquantizedLinearMethod,
)
from vllm.model_executor.models.transformers import linears
from vllm.model_executor.models.utils import maybe_prefix

if TYPE_CHECKING:
    from vllm.model_executor.layers.quantization import QuantizationConfig

    QuantConfig = QuantizationConfig | None

logger = init_logger(__name__)

Style = Literal[
    "colwise", "rowwise", "replicate", "colwise_gather_output", "rowwise_split_input"
]

# HF tensor-parallel plan styles -> (vLLM linear class, its extra arguments).
_LINEAR_STYLES: dict[str, tuple[type[nn.Module], dict[str, bool]]] = {
    "colwise": (ColumnParallelLinear, {}),
    "rowwise": (RowParallelLinear, {}),
    "replicate": (ReplicatedLinear, {}),
    "colwise_gather_output": (ColumnParallelLinear, {"gather_output": True}),
    "rowwise_split_input": (RowParallelLinear, {"input_is_parallel": False}),
}


VllmLinear = ColumnParallelLinear | RowParallelLinear | ReplicatedLinear


def replace_linear_class(
    linear: nn.Module, style: Style = "replicate", quant_config: "QuantConfig" = None,
    *, prefix: str = "",
) -> VllmLinear:  # fmt: skip
    """The vLLM linear that stands in for `linear` (an `nn.Linear`, or a `Conv1D`
    whose checkpoint weight it loads transposed) under tensor-parallel `style`,
    quantised by `quant_config` and named `prefix`.

    A style vLLM has no linear for is served replicated, which is always correct."""
    if not isinstance(style, str):
        raise ValueError(f"Tensor parallel style must be a str, got {type(style)}")
    linear_cls, extra = _LINEAR_STYLES.get(style, _LINEAR_STYLES["replicate"])
    layer = linear_cls(
        input_size=linears.in_features(linear),
        output_size=linears.out_features(linear),
        bias=linear.bias is not None,
        quant_config=quant_config,
        prefix=prefix,
        return_bias=False,
        **extra,
    )
    return linears.load_as_stored(layer, linear, prefix)


def recursive_replace_linear(
    model: nn.Module,
    quant_config: "QuantizationConfig | None",
    prefix: str = "",
) -> None:
    """Replace every `nn.Linear` under `model` with a replicated vLLM linear."""
    for name, child in model.named_children():
        qualname = maybe_prefix(prefix, name)
        if isinstance(child, nn.Linear):
            setattr(
                model,
                name,
                replace_linear_class(child, "replicate", quant_config, prefix=qualname),
            )
        else:
            recursive_replace_linear(child, quant_config, qualname)


def tp_style(qualname: str, plan: Mapping[str, str]) -> str | None:
    """The style `plan` (HF's `base_model_tp_plan`, `*` for one name) gives `qualname`."""
    parts = qualname.split(".")
    for pattern, style in plan.items():
        pattern_parts = pattern.split(".")
        if len(pattern_parts) == len(parts) and all(
            fnmatch.fnmatchcase(part, wanted)
            for part, wanted in zip(parts, pattern_parts)
        ):
            return style
    return None


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Create every parameter on `meta`, but buffers where they would be.

    Buffers such as rotary `inv_freq` are computed in `__init__` and are not in the
    checkpoint, so they must be real; parameters are allocated later, by vLLM's
    layers or `materialize`."""
    register_parameter = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None):
        if param is not None and param.device.type != "meta":
            param = type(param)(param.to("meta"), requires_grad=param.requires_grad)
        register_parameter(module, name, param)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register_parameter


def materialize(module: nn.Module, dtype: torch.dtype) -> None:
    """Allocate the parameters still on `meta` (those no vLLM layer replaced) on the
    default device, which vLLM sets to the target device while it builds a model.

    A vLLM layer (one with a `quant_method`) owns its parameters: those it leaves on
    `meta` stay there (online quantisation allocates them while loading, through
    their `weight_loader`)."""
    for submodule in module.modules():
        if getattr(submodule, "quant_method", None) is not None:
            continue
        for name, param in list(submodule.named_parameters(recurse=False)):
            if param.device.type == "meta":
                data = torch.empty(param.shape, dtype=dtype)
                setattr(submodule, name, nn.Parameter(data, requires_grad=False))


def tokens_as_rows(model: nn.Module) -> None:
    """Hand each quantised vLLM linear under `model` its input as `[tokens,
    features]`, the shape vLLM's own models give it, and its output back in the
    input's leading shape. Transformers' modules pass `[1, tokens, features]` (the
    backend runs the step as a batch of one), which some quantised kernels refuse
    (the CPU int8 GEMM: "mat1 must be a 2D tensor")."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if not isinstance(module, LinearBase) or isinstance(
            method, UnquantizedLinearMethod
        ):
            continue
        if not getattr(method, "takes_tokens_as_rows", False):
            method.apply = _rows(method.apply)
            method.takes_tokens_as_rows = True


def _rows(apply: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def apply_to_rows(
        layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        out = apply(layer, x.reshape(-1, x.shape[-1]), bias)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    return apply_to_rows
