# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The window each decoder layer's attention mask applies, read from the model.

vLLM's attention drops the mask the model builds and masks from its own metadata,
so the window it slides over must be the one the model's mask applies. That mask is
made by the forward of the module that runs the decoder layers: which of
Transformers' mask functions (`masking_utils`) it calls, with which config, and
which mask it hands to which layer (PhiMoE builds a sliding-window mask whenever
`config.sliding_window` is set and passes its attention no window at all; Qwen2
hands each layer the mask of its `config.layer_types` entry).

`read_layer_masks` runs that forward once, on `meta` tensors, with the mask
functions in its globals recording what they were asked for and the decoder layers
recording the mask they were handed, and returns it by layer. Nothing is computed
but the forward's own bookkeeping (embeddings, positions, its rotary embedding).
"""

import inspect
import sys
import threading
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import masking_utils

_TOKENS = 8


def _window(config: object) -> int | None:
    return getattr(config, "sliding_window", None)


def _no_window(config: object) -> None:
    return None


MASK_FUNCTIONS: dict[Callable, Callable[[object], int | None]] = {
    masking_utils.create_causal_mask: _no_window,
    masking_utils.create_bidirectional_mask: _no_window,
    masking_utils.create_sliding_window_causal_mask: _window,
    masking_utils.create_bidirectional_sliding_window_mask: _window,
    masking_utils.create_chunked_causal_mask: _no_window,
}
"""Transformers' mask functions -> the window the mask they make applies, read as
they read it (from the config they are given)."""
CHUNKED = masking_utils.create_chunked_causal_mask


@dataclass(frozen=True)
class LayerMask:
    """The mask one decoder layer is handed: the window it applies and what made it."""

    window: int | None
    made_by: str
    """`create_sliding_window_causal_mask (config.sliding_window=8) at file:line`."""
    chunked: bool = False
    """Attention in chunks (`create_chunked_causal_mask`), which is no window."""


@dataclass(frozen=True)
class Unread:
    """Why the window a layer's mask applies could not be read."""

    reason: str


@dataclass(frozen=True)
class _Made:
    """What a recording mask function returns in place of a mask."""

    function: Callable
    config: object
    location: str

    def read(self) -> LayerMask:
        window = MASK_FUNCTIONS[self.function](self.config)
        described = (
            f" (config.sliding_window={window})"
            if MASK_FUNCTIONS[self.function] is _window
            else ""
        )
        return LayerMask(
            window=None if self.function is CHUNKED else window,
            made_by=f"{self.function.__name__}{described} at {self.location}",
            chunked=self.function is CHUNKED,
        )


def _recording(function: Callable) -> Callable:
    def record(*args: Any, **kwargs: Any) -> _Made:
        caller = sys._getframe(1)
        config = kwargs.get("config", args[0] if args else None)
        return _Made(function, config, f"{caller.f_code.co_filename}:{caller.f_lineno}")

    return record


def _handed(args: tuple, kwargs: dict[str, Any]) -> LayerMask | Unread:
    """The mask a decoder layer was called with."""
    if "attention_mask" in kwargs:
        mask = kwargs["attention_mask"]
    else:
        made = [a for a in args if isinstance(a, _Made)]
        if len(made) != 1:
            return Unread(
                "the layer is handed no `attention_mask=` the backend can see"
            )
        mask = made[0]
    if mask is None:
        return LayerMask(window=None, made_by="no mask at all")
    if isinstance(mask, _Made):
        return mask.read()
    if (
        isinstance(mask, dict)
        and mask
        and all(isinstance(m, _Made) for m in mask.values())
    ):
        masks = {name: m.read() for name, m in mask.items()}
        if len({(m.window, m.chunked) for m in masks.values()}) == 1:
            return next(iter(masks.values()))
        return Unread(
            f"the layer is handed several masks ({', '.join(masks)}) and chooses "
            "among them itself"
        )
    return Unread(
        f"the layer is handed a mask the model builds itself ({type(mask).__name__}), "
        "not one of Transformers' mask functions"
    )


_swap_lock = threading.RLock()


@contextmanager
def _recording_masks(namespace: dict[str, Any]) -> Iterator[None]:
    """Every mask function `namespace` holds, recording instead, for the while."""
    with _swap_lock:
        swapped = {
            name: value
            for name, value in namespace.items()
            if isinstance(value, types.FunctionType) and value in MASK_FUNCTIONS
        }
        for name, function in swapped.items():
            namespace[name] = _recording(function)
        try:
            yield
        finally:
            namespace.update(swapped)


@contextmanager
def _recording_layers(
    layers: nn.ModuleList, handed: dict[int, LayerMask | Unread]
) -> Iterator[None]:
    """Each layer of `layers` records the mask it is handed and returns its first
    input, for the while (an instance `forward`, restored after)."""
    own = {i: vars(layer).get("forward") for i, layer in enumerate(layers)}

    def recorder(index: int) -> Callable:
        def forward(*args: Any, **kwargs: Any) -> Any:
            handed[index] = _handed(args, kwargs)
            return args[0] if args else kwargs.get("hidden_states")

        return forward

    for index, layer in enumerate(layers):
        layer.forward = recorder(index)
    try:
        yield
    finally:
        for index, layer in enumerate(layers):
            if own[index] is None:
                del layer.forward
            else:
                layer.forward = own[index]


def read_layer_masks(
    owner: nn.Module, layers: nn.ModuleList
) -> dict[int, LayerMask | Unread]:
    """The mask `owner`'s forward hands each of its decoder `layers` (by position),
    read by running that forward once on `meta` (module docstring): from token ids,
    as the engine runs it, else from embeddings (a forward that reads the ids'
    values, which `meta` has none of)."""
    positions = torch.arange(_TOKENS, device="meta")[None]
    width = getattr(getattr(owner, "config", None), "hidden_size", None)
    inputs = [{"input_ids": torch.zeros(1, _TOKENS, dtype=torch.long, device="meta")}]
    if isinstance(width, int):
        dtype = next((p.dtype for p in owner.parameters()), torch.float32)
        embeds = torch.empty(1, _TOKENS, width, dtype=dtype, device="meta")
        inputs.append({"input_ids": None, "inputs_embeds": embeds})
    namespace = inspect.unwrap(type(owner).forward).__globals__
    failures = []
    for given in inputs:
        handed: dict[int, LayerMask | Unread] = {}
        with _recording_masks(namespace), _recording_layers(layers, handed):
            try:
                with torch.no_grad():
                    owner(
                        **given,
                        position_ids=positions,
                        use_cache=False,
                        return_dict=False,
                    )
            except Exception as error:  # noqa: BLE001 - whatever the model raises
                failures.append(f"{type(error).__name__}: {error}")
        # A forward that fails after its layers ran (on what the stand-ins
        # returned) has handed every layer its mask already.
        if len(handed) == len(layers):
            return handed
    reason = (
        f"running {type(owner).__name__}.forward on meta failed "
        f"({'; '.join(failures)})"
        if failures
        else "its layers never ran"
    )
    return {index: handed.get(index, Unread(reason)) for index in range(len(layers))}
