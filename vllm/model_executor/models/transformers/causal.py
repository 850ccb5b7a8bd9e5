# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Causal language models: the base plus vLLM's LM head and logits processor.

What the HF causal LM computes around its output embedding (Granite divides the
logits by `logits_scaling`, Cohere multiplies them by `logit_scale`, Gemma 2 soft-caps
them, MiniCPM3 scales the hidden states first) is read from a trace of its own
`forward` (`LogitsHead.of`), not from config attribute names, and handed to vLLM's
`LogitsProcessor` as its `scale` and `soft_cap`. Anything else there is a
construction error."""

import ast
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import fx, nn
from transformers import PreTrainedModel

from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    VocabParallelEmbedding,
)
from vllm.model_executor.models.interfaces import SupportsEagle, SupportsEagle3
from vllm.model_executor.models.interfaces_base import VllmModelForTextGeneration
from vllm.model_executor.models.transformers import fx_utils
from vllm.model_executor.models.transformers.base import Base
from vllm.model_executor.models.transformers.eagle import (
    HiddenStateTaps,
    default_eagle3_layers,
)
from vllm.model_executor.models.transformers.loading import base_model_of
from vllm.model_executor.models.transformers.rewriting import forward_source
from vllm.model_executor.models.transformers.tracing import trace
from vllm.model_executor.models.utils import (
    PPMissingLayer,
    make_empty_intermediate_tensors_factory,
    maybe_prefix,
)
from vllm.sequence import IntermediateTensors

if TYPE_CHECKING:
    from vllm.config import VllmConfig

_CASTS = frozenset({"float", "to", "type", "contiguous"})
"""Methods that keep the values: the backend computes the logits in one dtype."""


def _factor(node: fx.Node, on: fx.Node) -> float | None:
    """The constant `node` multiplies `on` by (`on * c`, `c * on`, `on / c`)."""
    name, args = fx_utils.op_name(node), node.args
    if len(args) != 2 or node.kwargs:
        return None
    other = args[1] if args[0] is on else args[0]
    if not isinstance(other, int | float) or isinstance(other, bool):
        return None
    if name == "mul":
        return float(other)
    if name in ("truediv", "div") and args[0] is on and other != 0:
        return 1.0 / other
    return None


def _selects(node: fx.Node) -> bool:
    """Whether `node` picks the hidden states of every token out of its input:
    `.last_hidden_state`, `[0]`, or a slice keeping everything (`logits_to_keep=0`)."""
    if node.target is getattr:
        return node.args[1] == "last_hidden_state"
    if fx_utils.op_name(node) != "getitem":
        return False
    index = node.args[1]
    slices = index if isinstance(index, tuple) else (index,)
    return index == 0 or all(
        isinstance(s, slice)
        and s.start in (None, 0)
        and s.stop is None
        and s.step in (None, 1)
        for s in slices
    )


@dataclass(frozen=True)
class LogitsHead:
    """The logits a causal LM returns, as `scale * cap * tanh(head(h) / cap)` (no
    tanh without a cap): what vLLM's `LogitsProcessor` computes."""

    scale: float = 1.0
    soft_cap: float | None = None

    @classmethod
    def of(cls, model: PreTrainedModel) -> "LogitsHead":
        """Read from `model.forward`'s trace: from the base model's hidden states
        through the output embedding to the returned `logits`, the dataflow may only
        select, cast, multiply or divide by constants (before a head without bias,
        or after the head) and apply one `tanh` after the head."""
        head = model.get_output_embeddings()
        if head is None:
            raise _refuse(model, "it has no output embedding")
        traced = trace(model)
        if not traced.complete:
            raise _refuse(model, f"its forward cannot be traced ({traced.stopped})")
        output = next(n for n in traced.graph.nodes if n.op == "output").args[0]
        logits = output.get("logits") if isinstance(output, dict) else None
        if not isinstance(logits, fx.Node):
            raise _refuse(model, "its forward returns no `logits` tensor")

        base = set(base_model_of(model)[1].modules())
        chain: list[fx.Node] = []  # from the logits back to the base model's call
        node = logits
        while not (
            fx_utils.submodule(node, model) in base
            and all(n.op == "placeholder" for n in node.all_input_nodes)
        ):
            if len(node.all_input_nodes) != 1:
                raise _refuse(
                    model,
                    f"its forward computes {_code(model, node)}, which mixes in "
                    "a tensor other than its base model's hidden states",
                )
            chain.append(node)
            node = node.all_input_nodes[0]

        head_name = next(n for n, m in model.named_modules() if m is head)
        has_bias = getattr(head, "bias", None) is not None
        scale, soft_cap, after_head = 1.0, None, False
        for node in reversed(chain):
            (value,) = node.all_input_nodes
            factor = _factor(node, value)
            name = fx_utils.op_name(node)
            if not after_head and fx_utils.submodule(node, model) is head:
                after_head = True
            elif factor is not None and (after_head or not has_bias):
                # head(c * h) = c * head(h) for a head without bias.
                scale *= factor
            elif name == "tanh" and after_head and soft_cap is None:
                # tanh(scale * x) = tanh(x / cap) for cap = 1 / scale, and the
                # factor in front stays: tanh(x / cap) = (1 / cap) * cap * tanh(...).
                soft_cap = 1.0 / scale
            elif name not in _CASTS and (after_head or not _selects(node)):
                where = "after" if after_head else "before"
                bias = ", which has a bias" if factor is not None else ""
                raise _refuse(
                    model,
                    f"its forward computes {_code(model, node)} {where} its output "
                    f"embedding `{head_name}`{bias}",
                )
        if not after_head:
            raise _refuse(model, "its logits do not come from its output embedding")
        if scale <= 0 or (soft_cap is not None and soft_cap <= 0):
            raise _refuse(
                model,
                f"its logits are scaled by {scale} (soft-cap {soft_cap}), and vLLM's "
                "greedy and top-k paths refuse a factor that is not positive",
            )
        return cls(scale, soft_cap)


def _refuse(model: nn.Module, why: str) -> ValueError:
    return ValueError(
        f"{type(model).__name__}: {why}. vLLM's logits processor can only multiply "
        "the output embedding's logits by a constant and soft-cap them "
        "(`cap * tanh(x / cap)`), so this backend cannot serve the model."
    )


def _code(model: nn.Module, node: fx.Node) -> str:
    """The code of `model.forward` behind `node`: `` `expr` (file:line) ``."""
    source = forward_source(type(model))
    span = node.meta.get("span")
    expression = source.expression_at(span) if source is not None else None
    if expression is None:
        return f"`{fx_utils.op_name(node) or node.target}`"
    return f"`{ast.unparse(expression)}` ({source.filename}:{span[0]})"


class CausalMixin(VllmModelForTextGeneration, SupportsEagle, SupportsEagle3, Base):
    """Adds the LM head (tied to the input embedding when the config says so, with a
    bias when the HF head has one) and the logits processor with the scale and
    soft-cap the HF head applies (`LogitsHead`).

    A target for EAGLE drafters: EAGLE-1/2 read the hidden states `forward` returns,
    EAGLE-3 also the states entering the decoder layers it names (`eagle.py`)."""

    def __init__(self, *, vllm_config: "VllmConfig", prefix: str = ""):
        Base.__init__(self, vllm_config=vllm_config, prefix=prefix)
        self.aux_hidden_states: HiddenStateTaps | None = None
        if not self.pp_group.is_last_rank:
            self.lm_head = PPMissingLayer()
            return
        text_config = self.text_config
        self.lm_head = ParallelLMHead(
            text_config.vocab_size,
            text_config.hidden_size,
            bias=self.layout.lm_head_bias,
            quant_config=self.quant_config,
            prefix=maybe_prefix(prefix, "lm_head"),
        )
        # Tied heads share the vocab-parallel embedding's weight. An embedding with a
        # forward of its own (Gemma's scaled one) stays replicated, so the head loads
        # a vocab-parallel copy of its checkpoint tensor instead.
        embedding = self.model.get_input_embeddings()
        if self.tie_word_embeddings and isinstance(embedding, VocabParallelEmbedding):
            self.lm_head = self.lm_head.tie_weights(embedding)
        elif self.tie_word_embeddings:
            name = next(n for n, p in self.named_parameters() if p is embedding.weight)
            self.weight_copies[name] = "lm_head.weight"
        # vLLM's LoRA finds the head by this name and wraps `logits_processor` with it.
        self.embedding_modules = {
            **self.embedding_modules,
            "lm_head": "output_embeddings",
        }
        self.logits_processor = LogitsProcessor(
            text_config.vocab_size,
            scale=self.logits_head.scale,
            soft_cap=self.logits_head.soft_cap,
        )

    def build(self, vllm_config: "VllmConfig", prefix: str) -> PreTrainedModel:
        hf_model = super().build(vllm_config, prefix)
        # In `build`, so that a head the backend cannot reproduce fails the report too.
        self.logits_head = LogitsHead.of(hf_model)
        return hf_model

    def get_eagle3_default_aux_hidden_state_layers(self) -> tuple[int, ...]:
        return default_eagle3_layers(self.text_config.num_hidden_layers)

    def set_aux_hidden_state_layers(self, layers: tuple[int, ...]) -> None:
        """Tap the decoder layers whose input EAGLE-3 reads, on this stage; the
        states earlier stages tap arrive with the intermediate tensors."""
        if self.aux_hidden_states is not None:
            self.aux_hidden_states.remove()
        layers_name, _ = self.layout.decoder_layers
        hidden_size = self.text_config.hidden_size
        self.aux_hidden_states = HiddenStateTaps(
            layers,
            self.model.get_submodule(layers_name),
            self.layer_range,
            self.pp_group.is_first_rank,
            max_tokens=self.vllm_config.scheduler_config.max_num_batched_tokens,
            hidden_size=hidden_size,
            dtype=self.vllm_config.model_config.dtype,
            device=next(self.model.parameters()).device,
        )
        self.make_empty_intermediate_tensors = make_empty_intermediate_tensors_factory(
            ["hidden_states", *self.aux_hidden_states.relay_keys()], hidden_size
        )

    def forward(
        self, input_ids: torch.Tensor | None, positions: torch.Tensor, **step: Any
    ) -> torch.Tensor | IntermediateTensors | tuple[torch.Tensor, list[torch.Tensor]]:
        """The base's step; with EAGLE-3 states asked for, the last stage also
        returns them (in the order of their layers), the others relay them."""
        received = step.get("intermediate_tensors")
        output = super().forward(input_ids, positions, **step)
        if self.aux_hidden_states is None:
            return output
        states = self.aux_hidden_states.this_step(positions.shape[-1], received)
        if isinstance(output, IntermediateTensors):
            output.tensors.update(states)
            return output
        return output, self.aux_hidden_states.in_order(states)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        # An LM head with a bias (Phi) adds it to the logits.
        return self.logits_processor(self.lm_head, hidden_states, self.lm_head.bias)
