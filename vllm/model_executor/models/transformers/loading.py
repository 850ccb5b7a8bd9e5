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
from transformers.core_model_loading import (
    Concatenate,
    MergeModulelist,
    WeightConverter,
    WeightRenaming,
)

from vllm.logger import init_logger
from vllm.model_executor.models.transformers.fusers.base import ShardId
from vllm.model_executor.models.utils import (
    AutoWeightsLoader,
    PPMissingLayer,
    StageMissingLayer,
    WeightsMapper,
)

logger = init_logger(__name__)

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
    lm_head_bias: bool
    renamings: list[WeightRenaming]
    ignored: list[str]
    per_expert: dict[re.Pattern, str] = field(default_factory=dict)
    """Per-expert checkpoint tensors -> `<expert>.<fused parameter>.<shard>`, the
    part of Transformers' fused experts parameter each one is."""
    stacked: dict[str, tuple[str, ShardId]] = field(default_factory=dict)
    renamed: dict[str, str] = field(default_factory=dict)
    """Checkpoint name prefix -> the prefix of the layer that loads it instead."""
    decoder_layers: tuple[str, int] | None = None
    """The decoder stack's name under the base model and how many layers it has:
    checkpoint layers past them are multi-token-prediction layers."""

    @classmethod
    def of(cls, hf_model: PreTrainedModel) -> "CheckpointLayout":
        output = hf_model.get_output_embeddings()
        lm_head_name = next(
            (name for name, child in hf_model.named_children() if child is output), None
        )
        conversions = get_model_conversion_mapping(hf_model)
        return cls(
            base_prefix=hf_model.base_model_prefix,
            base_children=tuple(
                name for name, _ in hf_model.base_model.named_children()
            ),
            lm_head_name=lm_head_name,
            lm_head_bias=getattr(output, "bias", None) is not None,
            renamings=[t for t in conversions if isinstance(t, WeightRenaming)],
            ignored=list(hf_model._keys_to_ignore_on_load_unexpected or []),
            per_expert=_per_expert_names(conversions),
        )

    def add_stacked(self, stacked: dict[str, tuple[str, ShardId]]) -> None:
        """Route original linears' tensors into the shards of a fused linear."""
        self.stacked.update(stacked)

    def add_renamed(self, renamed: dict[str, str]) -> None:
        """Load the tensors under some checkpoint prefixes into other layers."""
        self.renamed.update(renamed)

    def mapper(self) -> WeightsMapper:
        """Checkpoint names -> the backend's parameter names (`hf_to_vllm_mapper`)."""
        regex: dict[re.Pattern, str | None] = dict(self.per_expert)
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
            orig_to_new_prefix=self.renamed,
        )

    def unneeded(self, name: str) -> str | None:
        """Why the checkpoint tensor `name` (before mapping) is not loaded, `None`
        when it must be."""
        if _RECOMPUTED_BUFFERS.search(name):
            return "buffers Transformers recomputes"
        if any(re.search(pattern, name) for pattern in self.ignored):
            return "tensors the model ignores (`_keys_to_ignore_on_load_unexpected`)"
        return None

    def _past_last_layer(self, name: str) -> bool:
        """Whether the mapped `name` is in a decoder layer the model does not have
        (multi-token-prediction layers follow the last one in some checkpoints)."""
        if self.decoder_layers is None:
            return False
        stack, count = self.decoder_layers
        found = re.match(rf"{BASE}\.{re.escape(stack)}\.(\d+)\.", name)
        return found is not None and int(found.group(1)) >= count

    def load(
        self,
        model: nn.Module,
        weights: Iterable[tuple[str, torch.Tensor]],
        copies: dict[str, str] | None = None,
    ) -> set[str]:
        """Load `weights` into `model`; a tensor whose (mapped) name is a key of
        `copies` is also loaded into the parameter named by its value.

        Strict: a checkpoint tensor that nothing in `model` consumes is an error
        naming it, unless `unneeded` says why it is not needed (logged once per
        reason). vLLM's loader then fails on any parameter left unfilled."""
        copies = copies or {}
        mapper = self.mapper()
        loadable = {n for n, _ in model.named_parameters(remove_duplicate=False)}
        # Persistent buffers are in checkpoints too (Gemma 4's per-layer
        # `layer_scalar`); `AutoWeightsLoader` loads them as it loads parameters.
        loadable |= {
            f"{prefix}{'.' if prefix else ''}{name}"
            for prefix, module in model.named_modules(remove_duplicate=False)
            for name, _ in module.named_buffers(recurse=False)
            if name not in module._non_persistent_buffers_set
        }
        elsewhere = tuple(
            f"{name}."
            for name, module in model.named_modules()
            # What another pipeline stage owns, and what vLLM's pooling adapters
            # drop from a causal LM (`--convert embed|classify`: its LM head).
            if isinstance(module, PPMissingLayer | StageMissingLayer)
        )
        # A layer with its own loader (vLLM's fused MoE) checks its own names.
        self_loading = tuple(
            f"{name}."
            for name, module in model.named_modules()
            if name and callable(getattr(module, "load_weights", None))
        )
        skipped: set[str] = set()

        def skip(reason: str, name: str) -> None:
            if reason not in skipped:
                skipped.add(reason)
                logger.info("Not loading %s (such as %s)", reason, name)

        def needed(raw: Iterable[tuple[str, torch.Tensor]]):
            for name, tensor in raw:
                # Ignore patterns are loose (GPT-2's "attn.bias", a regex, also finds
                # `c_attn.bias`): like Transformers, skip only what nothing consumes.
                reason = self.unneeded(name)
                if reason is not None and mapper.map_name(name) not in loadable:
                    skip(reason, name)
                    continue
                yield name, tensor

        def checked(mapped: Iterable[tuple[str, torch.Tensor]]):
            for name, tensor in mapped:
                if name not in loadable and not name.startswith(
                    elsewhere + self_loading
                ):
                    if self._past_last_layer(name):
                        skip("multi-token-prediction layers past the last one", name)
                        continue
                    raise ValueError(
                        f"Checkpoint tensor {name!r} (as this backend names it) is "
                        f"consumed by no parameter of {type(model).__name__}: the "
                        "model built from the config has no such weight, so loading "
                        "would silently drop it and compute something else than the "
                        "checkpoint."
                    )
                yield name, tensor
                if name in copies:
                    yield copies[name], tensor

        return AutoWeightsLoader(model).load_weights(
            checked(mapper.apply(needed(weights)))
        )


def _per_expert_names(conversions: list) -> dict[re.Pattern, str]:
    """Renames for per-expert checkpoint tensors that Transformers stacks into one
    experts parameter (`MergeModulelist(dim=0)`, then for several sources
    `Concatenate(dim=1)` in their order): `experts.<e>.gate_proj.weight` ->
    `experts.<e>.gate_up_proj.0`. Other conversions are not per-expert stacks."""
    renames: dict[re.Pattern, str] = {}
    for conversion in conversions:
        if not isinstance(conversion, WeightConverter):
            continue
        operations = [(type(op), getattr(op, "dim", None)) for op in conversion.operations]
        stacked = [(MergeModulelist, 0)]
        if operations not in (stacked, [*stacked, (Concatenate, 1)]):
            continue
        (target,) = conversion.target_patterns
        parameter = target.rpartition(".")[2]
        for shard, source in enumerate(conversion.source_patterns):
            before, star, after = source.partition("*")
            if not star or not before.endswith(".") or not after.startswith("."):
                continue
            pattern = re.compile(f"{re.escape(before)}(\\d+){re.escape(after)}$")
            renames[pattern] = f"{before}\\1.{parameter}.{shard}"
    return renames
