# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Causal language models: the base plus vLLM's LM head and logits processor."""

from typing import TYPE_CHECKING

import torch

from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    VocabParallelEmbedding,
)
from vllm.model_executor.models.interfaces_base import VllmModelForTextGeneration
from vllm.model_executor.models.transformers.base import Base
from vllm.model_executor.models.utils import PPMissingLayer, maybe_prefix

if TYPE_CHECKING:
    from vllm.config import VllmConfig


class CausalMixin(VllmModelForTextGeneration, Base):
    """Adds the LM head (tied to the input embedding when the config says so, with a
    bias when the HF head has one) and the logits processor with the config's logit
    scale and final soft-cap."""

    def __init__(self, *, vllm_config: "VllmConfig", prefix: str = ""):
        Base.__init__(self, vllm_config=vllm_config, prefix=prefix)
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
            scale=getattr(text_config, "logit_scale", 1.0),
            soft_cap=getattr(text_config, "final_logit_softcapping", None),
        )

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        # An LM head with a bias (Phi) adds it to the logits.
        return self.logits_processor(self.lm_head, hidden_states, self.lm_head.bias)
