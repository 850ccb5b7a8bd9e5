# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Checkpoint names -> this backend's module names, and loading through vLLM's loader."""

from collections.abc import Iterable
from dataclasses import dataclass, field

import regex as re
import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import WeightRenaming

from vllm.model_executor.models.transformers.fusers.base import ShardId
from vllm.model_executor.models.utils import AutoWeightsLoader, WeightsMapper

BASE = "model"
"""The backend keeps the HF base model as `self.model`."""
LM_HEAD = "lm_head"

# Buffers Transformers recomputes, found in some older checkpoints.
_RECOMPUTED_BUFFERS = re.compile(r"rotary_emb\.inv_freq$|\.masked_bias$|\.attn\.bias$")


@dataclass
class CheckpointLayout:
    """How an HF checkpoint names its tensors, relative to the backend's modules.

    A checkpoint names the base model `base_prefix` (`gpt_neox`, `transformer`) or
    nothing at all (saved from the base model), the output embedding `lm_head_name`
    (`embed_out`), and may use names Transformers has since renamed."""

    base_prefix: str
    base_children: tuple[str, ...]
    lm_head_name: str | None
    renamings: list[WeightRenaming]
    ignored: list[str]
    stacked: dict[str, tuple[str, ShardId]] = field(default_factory=dict)

    @classmethod
    def of(cls, hf_model: PreTrainedModel) -> "CheckpointLayout":
        output = hf_model.get_output_embeddings()
        lm_head_name = next(
            (name for name, child in hf_model.named_children() if child is output), None
        )
        return cls(
            base_prefix=hf_model.base_model_prefix,
            base_children=tuple(
                name for name, _ in hf_model.base_model.named_children()
            ),
            lm_head_name=lm_head_name,
            renamings=[
                t
                for t in get_model_conversion_mapping(hf_model)
                if isinstance(t, WeightRenaming)
            ],
            ignored=list(hf_model._keys_to_ignore_on_load_unexpected or []),
        )

    def add_stacked(self, stacked: dict[str, tuple[str, ShardId]]) -> None:
        """Route original linears' tensors into the shards of a fused linear."""
        self.stacked.update(stacked)

    def mapper(self) -> WeightsMapper:
        regex: dict[re.Pattern, str | None] = {_RECOMPUTED_BUFFERS: None}
        regex.update({re.compile(pattern): None for pattern in self.ignored})
        if self.base_prefix and self.base_prefix != BASE:
            regex[re.compile(rf"^{re.escape(self.base_prefix)}\.")] = f"{BASE}."
        if self.base_children:
            children = "|".join(map(re.escape, self.base_children))
            regex[re.compile(rf"^(?=(?:{children})\.)")] = f"{BASE}."
        if self.lm_head_name and self.lm_head_name != LM_HEAD:
            regex[re.compile(rf"^{re.escape(self.lm_head_name)}\.")] = f"{LM_HEAD}."
        return WeightsMapper(
            orig_to_new_renaming=self.renamings,
            orig_to_new_regex=regex,
            orig_to_new_stacked=self.stacked,
        )

    def load(
        self,
        model: nn.Module,
        weights: Iterable[tuple[str, torch.Tensor]],
        copies: dict[str, str] | None = None,
    ) -> set[str]:
        """Load `weights` into `model`; a tensor whose (mapped) name is a key of
        `copies` is also loaded into the parameter named by its value."""
        copies = copies or {}

        def with_copies(mapped: Iterable[tuple[str, torch.Tensor]]):
            for name, tensor in mapped:
                yield name, tensor
                if name in copies:
                    yield copies[name], tensor

        return AutoWeightsLoader(model).load_weights(
            with_copies(self.mapper().apply(weights))
        )
