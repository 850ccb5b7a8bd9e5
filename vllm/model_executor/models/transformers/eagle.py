# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What an EAGLE drafter reads from a target this backend serves.

EAGLE-1/2 drafters read the target's last hidden states: what `forward` returns.
EAGLE-3 drafters also read the residual stream at a few decoder layers they name
(vLLM's "auxiliary hidden states"), defined as vLLM's native models define them:
state `L` is what enters decoder layer `L`, so `0` is the embeddings and
`num_hidden_layers` the last layer's output before the final norm.

Transformers runs the decoder loop, so there is no loop of the backend's own to pick
them out of. Instead the decoder layers are tapped (`HiddenStateTaps`): a forward hook
on layer `L - 1` (a pre-hook on layer 0 for `L = 0`) copies the layer's output into a
buffer of the tap's own, sized for the largest step the engine schedules, and the
model's forward hands the drafter the rows of this step. A copy into a persistent
buffer is plain tensor dataflow, so it runs the same eager, under vLLM's torch.compile
of the HF base model (Dynamo traces the hooks of the layers it inlines; the buffer is
a graph input written in place) and under CUDA graphs (its address never changes).

Pipeline parallel: each stage taps the states its own layers produce, `(start, end]`,
and the first stage also state 0, as vLLM's native models split them. A stage hands
the states it took and those it received on to the next one in its intermediate
tensors, under vLLM's keys (`aux_hidden_states_<i>`, `i` the state's place among the
layers asked for), and the last stage returns them all, in order: the protocol of
vLLM's `EagleModelMixin`, for a runner that asks every stage for the layers."""

from collections.abc import Sequence

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from vllm.model_executor.models.interfaces import EagleModelMixin
from vllm.sequence import IntermediateTensors

AUX_KEY = EagleModelMixin.AUX_HIDDEN_STATE_KEY
"""The intermediate-tensor key prefix vLLM's runners relay these states under."""


def default_eagle3_layers(num_layers: int) -> tuple[int, ...]:
    """vLLM's default for a target that names none (`SupportsEagle3`)."""
    return (2, num_layers // 2, num_layers - 3)


class Tap(nn.Module):
    """A copy of the hidden states a decoder layer takes in or puts out, one row per
    token of the current step. It is the layer's child (`TAP_IN`, `TAP_OUT`) and the
    hooks are module functions, so what a compiled graph reads is named the same in
    every process: vLLM's compile cache saves graphs by such names."""

    def __init__(self, max_tokens: int, hidden_size: int, dtype: torch.dtype, device):
        super().__init__()
        self.register_buffer(
            "states",
            torch.zeros(max_tokens, hidden_size, dtype=dtype, device=device),
            persistent=False,
        )

    def write(self, hidden_states: torch.Tensor) -> None:
        rows = hidden_states.reshape(-1, hidden_states.shape[-1])
        self.states[: rows.shape[0]].copy_(rows)


TAP_IN, TAP_OUT = "aux_hidden_state_in", "aux_hidden_state_out"


def _tap_input(layer: nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook (with kwargs): the hidden states the layer takes."""
    getattr(layer, TAP_IN).write(args[0] if args else kwargs["hidden_states"])


def _tap_output(layer: nn.Module, args: tuple, output) -> None:
    """Forward hook: the layer's output (the first item of a tuple)."""
    getattr(layer, TAP_OUT).write(output[0] if isinstance(output, tuple) else output)


class HiddenStateTaps:
    """The EAGLE-3 states one pipeline stage holds: those its own decoder layers
    produce (tapped) and those earlier stages relayed."""

    def __init__(
        self,
        layers: Sequence[int],
        decoder_layers: nn.ModuleList,
        stage: range,
        is_first_stage: bool,
        max_tokens: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        num_layers = len(decoder_layers)
        self.layers = tuple(sorted(set(layers)))
        wrong = [layer for layer in self.layers if not 0 <= layer <= num_layers]
        if wrong:
            raise ValueError(
                f"EAGLE-3 asks for the hidden states of layers {wrong}, outside the "
                f"target's 0..{num_layers} (state L enters decoder layer L; "
                f"{num_layers} is the last layer's output)."
            )
        first = stage.start if not is_first_stage else -1
        self.relayed = [i for i, layer in enumerate(self.layers) if layer <= first]
        """Places of the states earlier stages took."""
        self.taps: list[tuple[int, Tap]] = []
        """(place, tap) of the states this stage takes."""
        self.tapped: list[tuple[nn.Module, str, RemovableHandle]] = []
        for place, layer in enumerate(self.layers):
            if layer <= first or layer > stage.stop:
                continue
            tap = Tap(max_tokens, hidden_size, dtype, device)
            if layer == 0:
                module, name = decoder_layers[0], TAP_IN
                hook = module.register_forward_pre_hook(_tap_input, with_kwargs=True)
            else:
                module, name = decoder_layers[layer - 1], TAP_OUT
                hook = module.register_forward_hook(_tap_output)
            module.register_module(name, tap)
            self.taps.append((place, tap))
            self.tapped.append((module, name, hook))

    def remove(self) -> None:
        for module, name, hook in self.tapped:
            hook.remove()
            delattr(module, name)

    def relay_keys(self) -> list[str]:
        """The intermediate-tensor keys this stage receives."""
        return [f"{AUX_KEY}{place}" for place in self.relayed]

    def this_step(
        self, num_tokens: int, received: IntermediateTensors | None
    ) -> dict[str, torch.Tensor]:
        """Every state this stage holds for the current step, by its relay key."""
        states = {
            f"{AUX_KEY}{place}": tap.states[:num_tokens] for place, tap in self.taps
        }
        for key in self.relay_keys():
            if received is None or key not in received.tensors:
                raise RuntimeError(
                    f"EAGLE-3: the hidden states {key} an earlier pipeline stage "
                    "takes did not arrive with its intermediate tensors"
                )
            states[key] = received[key][:num_tokens]
        return states

    def in_order(self, states: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        return [states[f"{AUX_KEY}{place}"] for place in range(len(self.layers))]
