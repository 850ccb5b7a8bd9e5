# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Where the vLLM layer classes the backend builds come from.

With `VLLM_USE_HW_AGNOSTIC=1` vLLM takes a layer from its hardware-agnostic package
(`vllm.model_executor.hw_agnostic.layers.<module>`, where platforms ship their own
kernels) wherever that package has it, and from `vllm.model_executor.layers.<module>`
otherwise. The fusers ask here for every such class, so one place decides, and the
source of each is logged once. A vLLM without the flag or the package (other
releases than 0.32) gets `vllm.model_executor.layers`.
"""

import importlib
from collections.abc import Callable
from types import ModuleType

from torch import nn

import vllm.envs as envs
from vllm.logger import init_logger

logger = init_logger(__name__)

HW_AGNOSTIC = "vllm.model_executor.hw_agnostic.layers"
DEFAULT = "vllm.model_executor.layers"


def use_hw_agnostic() -> bool:
    """`VLLM_USE_HW_AGNOSTIC`, as vLLM reads it (`vllm.envs`); false where this
    vLLM does not know the flag."""
    try:
        return bool(envs.VLLM_USE_HW_AGNOSTIC)
    except AttributeError:
        return False


def _hw_agnostic(module: str) -> ModuleType | None:
    try:
        return importlib.import_module(f"{HW_AGNOSTIC}.{module}")
    except ImportError:
        return None


def layer_class(module: str, name: str) -> type[nn.Module]:
    """The class `name` of vLLM's layer module `module` (`layernorm`, ...): the
    hardware-agnostic one where the flag asks for it and it exists."""
    if use_hw_agnostic():
        found = getattr(_hw_agnostic(module), name, None)
        if found is not None:
            logger.info_once("vLLM layer %s: %s.%s", name, HW_AGNOSTIC, module)
            return found
        logger.info_once(
            "vLLM layer %s: %s.%s (VLLM_USE_HW_AGNOSTIC is set, but %s.%s has none)",
            name, DEFAULT, module, HW_AGNOSTIC, module,
        )  # fmt: skip
    return getattr(importlib.import_module(f"{DEFAULT}.{module}"), name)


def act_and_mul(activation: str) -> nn.Module:
    """vLLM's fused activation-and-multiply for the activation named `activation`
    (`get_act_and_mul_fn`): the hardware-agnostic one where the flag asks for it
    and that package has one for this activation."""
    build: Callable[[str], nn.Module] | None = None
    if use_hw_agnostic():
        build = getattr(_hw_agnostic("activation"), "get_act_and_mul_fn", None)
    if build is not None:
        try:
            layer = build(activation)
        except KeyError:
            logger.info_once(
                "vLLM activation-and-mul %r: %s.activation (VLLM_USE_HW_AGNOSTIC is "
                "set, but %s.activation has none for it)",
                activation, DEFAULT, HW_AGNOSTIC,
            )  # fmt: skip
        else:
            logger.info_once(
                "vLLM activation-and-mul %r: %s.activation", activation, HW_AGNOSTIC
            )
            return layer
    from vllm.model_executor.layers.activation import get_act_and_mul_fn

    return get_act_and_mul_fn(activation)
