# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Pooling models on vLLM's pooling runner: embeddings, classification, scoring.

The HF model is built, fused and given vLLM attention as a causal LM's is
(`base.py`); a module whose attention is not causal (the encoders of BERT, RoBERTa,
ModernBERT) gets vLLM's encoder-only attention, which keeps no KV cache. vLLM's
pooler then reads each sequence's hidden states:

- embeddings (`EmbeddingMixin`): the pooling and normalisation the checkpoint's
  Sentence Transformers config (`modules.json`) gives, and its Dense modules (vLLM
  reads both); the last token where there is no such config;
- classification and scoring (`SequenceClassificationMixin`): the HF
  sequence-classification model's own head, applied to the token(s) that head
  reads (`ClassifierHead.of`).

Token type ids (vLLM passes them for the second text of a scored pair) go to the base
model where its forward takes them; position ids go as the model computes them from
token ids (RoBERTa counts from `padding_idx + 1`, `position_offset`).
"""

import ast
import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn
from transformers import PreTrainedModel

from vllm.model_executor.layers.pooler import DispatchPooler
from vllm.model_executor.layers.pooler.seqwise.methods import get_seq_pooling_method
from vllm.model_executor.models.interfaces import SupportsCrossEncoding
from vllm.model_executor.models.interfaces_base import VllmModelForPooling
from vllm.model_executor.models.transformers.base import Base
from vllm.model_executor.models.transformers.loading import BASE
from vllm.model_executor.models.transformers.rewriting import forward_source
from vllm.sequence import IntermediateTensors

if TYPE_CHECKING:
    from vllm.config import VllmConfig


def position_offset(base_model: nn.Module) -> int:
    """What the model adds to a token's index in its sequence to get its position id.

    0, unless a module computes position ids from the token ids itself
    (`create_position_ids_from_input_ids`, RoBERTa's: `padding_idx + 1` onwards),
    which is asked on a probe of two tokens that are not padding."""
    for module in base_model.modules():
        create = getattr(module, "create_position_ids_from_input_ids", None)
        padding_idx = getattr(module, "padding_idx", None)
        if not callable(create) or not isinstance(padding_idx, int):
            continue
        probe = torch.full((1, 2), padding_idx + 1, dtype=torch.long)
        first, second = create(probe, padding_idx).flatten().tolist()
        if second != first + 1:
            raise ValueError(
                f"{type(module).__name__}.create_position_ids_from_input_ids gives "
                f"positions {first}, {second} to two consecutive tokens; vLLM numbers "
                "the tokens of a sequence one by one, so the backend cannot serve it."
            )
        return first
    return 0


class PoolingMixin(VllmModelForPooling, Base):
    """What embedding and classification models share: the base model's inputs.

    vLLM's registry reads `attn_type` and `default_seq_pooling_type` from the class,
    before any checkpoint is seen, and whether a model's attention is causal is only
    known once it is built. So every model is declared encoder-only: vLLM then
    schedules each prompt whole (no chunked prefill, no prefix caching), which
    bidirectional attention needs and causal attention merely does not exploit. The
    last token is the pooling where the checkpoint has no Sentence Transformers
    config (vLLM's default for decoders; set `--pooler-config` for an encoder)."""

    attn_type: ClassVar[str] = "encoder_only"
    default_seq_pooling_type: ClassVar[str] = "LAST"

    def build(self, vllm_config: "VllmConfig", prefix: str) -> PreTrainedModel:
        hf_model = super().build(vllm_config, prefix)
        self.position_offset = position_offset(self.model)
        self.takes_token_types = (
            "token_type_ids" in inspect.signature(self.model.forward).parameters
        )
        self.report.causal = any(a.causal for a in self.report.attention)
        return hf_model

    def forward(
        self, input_ids: torch.Tensor | None, positions: torch.Tensor, **step: Any
    ) -> torch.Tensor | IntermediateTensors:
        # Positions shifted as the model counts them (RoBERTa from padding_idx + 1).
        # Token types go only to a model that takes them, and always as a tensor
        # (zeros, Transformers' default, when the request has none), so that one
        # compiled graph serves requests with and without them.
        token_types = step.pop("token_type_ids", None)
        if self.takes_token_types:
            if token_types is None:
                token_types = torch.zeros_like(positions)
            step["token_type_ids"] = token_types.to(positions.dtype)[None]
        return super().forward(input_ids, positions + self.position_offset, **step)


class EmbeddingMixin(PoolingMixin):
    """Embeddings: the hidden states pooled, projected and normalised as the pooler
    config says (vLLM fills it from the checkpoint's Sentence Transformers modules)."""

    def __init__(self, *, vllm_config: "VllmConfig", prefix: str = ""):
        Base.__init__(self, vllm_config=vllm_config, prefix=prefix)
        self.pooler = DispatchPooler.for_embedding(
            vllm_config.model_config.pooler_config
        )

    def build(self, vllm_config: "VllmConfig", prefix: str) -> PreTrainedModel:
        hf_model = super().build(vllm_config, prefix)
        if isinstance(getattr(self.model, "pooler", None), nn.Module):
            self.layout.add_unused(
                f"{BASE}.pooler",
                "the base model's pooler: embeddings pool its hidden states, not "
                "its pooled output",
            )
        pooler_config = vllm_config.model_config.pooler_config
        normalized = "normalized" if pooler_config.use_activation else "not normalized"
        self.report.pooler = f"{pooler_config.seq_pooling_type} pooling, {normalized}"
        return hf_model


def _reads_first_token(module: nn.Module) -> bool:
    """Whether `module`'s forward selects the first token, `x[:, 0]` (a RoBERTa-style
    classification head takes the whole sequence)."""
    source = forward_source(type(module))
    if source is None:
        return False
    for node in ast.walk(source.tree):
        if not (isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Tuple)):
            continue
        first, *rest = node.slice.elts
        if (
            rest
            and isinstance(first, ast.Slice)
            and first.lower is first.upper is first.step is None
            and isinstance(rest[0], ast.Constant)
            and rest[0].value == 0
        ):
            return True
    return False


def _has_parameters(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


@dataclass(frozen=True)
class ClassifierHead:
    """An HF sequence classifier's head as vLLM's pooler runs it: the token(s) it reads
    (`pooling`: `CLS`, `LAST` or `MEAN`, what vLLM's pooler selects) and the modules
    it applies to them in order (names under the HF model), each given the pooled
    hidden state as a sequence of one token, so that a module selecting the first
    token (BERT's pooler, RoBERTa's head) selects it."""

    pooling: str
    modules: tuple[str, ...]
    reason: str
    """How the pooling was read, for the report."""

    @classmethod
    def of(cls, hf_model: PreTrainedModel, causal: bool) -> "ClassifierHead":
        """Read from the HF model: its children other than the base model that hold
        parameters (`classifier`, `score`, ModernBERT's `head` before it) are the
        head; what they read is, in this order, the `classifier_pooling` its config
        names (ModernBERT), the first token where the base model has a `pooler`
        (BERT's, which the head then starts with), the last token for a causal
        model (Transformers classifies a decoder's last token that is not
        padding), the first token where the head's forward selects it."""
        base = hf_model.base_model
        head = tuple(
            name
            for name, child in hf_model.named_children()
            if child is not base and _has_parameters(child)
        )
        name = type(hf_model).__name__
        if not head or head[-1] not in ("classifier", "score"):
            raise ValueError(
                f"{name}: the backend serves a classification head that ends in a "
                f"`classifier` or `score` layer; this model's head is {list(head)}."
            )
        if "pooler" in head:  # would shadow vLLM's pooler on the backend model
            raise ValueError(f"{name}: a head module named `pooler` is not supported.")
        pooler = getattr(base, "pooler", None)
        declared = getattr(hf_model.config, "classifier_pooling", None)
        if declared is not None:
            if declared.upper() not in ("CLS", "MEAN"):
                raise ValueError(
                    f"{name}: config.classifier_pooling={declared!r}; the backend "
                    "serves `cls` and `mean`."
                )
            return cls(declared.upper(), head, "config.classifier_pooling")
        if isinstance(pooler, nn.Module) and _has_parameters(pooler):
            prefix = hf_model.base_model_prefix
            return cls("CLS", (f"{prefix}.pooler", *head), f"{prefix}.pooler")
        if causal:
            return cls("LAST", head, "causal attention: the last token")
        if _reads_first_token(hf_model.get_submodule(head[0])):
            return cls("CLS", head, f"{head[0]} reads the first token")
        raise ValueError(
            f"{name}: its head {list(head)} neither selects a token itself nor follows "
            "a base model pooler, and the model is not causal, so the backend cannot "
            "tell which token(s) Transformers classifies."
        )


class SequenceClassificationMixin(SupportsCrossEncoding, PoolingMixin):
    """Classification and cross-encoder scoring with the HF model's own head, kept
    under its own names (`classifier`, `score`, ...) so the checkpoint loads into it,
    in vLLM's head dtype; the labels are the config's `id2label`."""

    head_modules: tuple[nn.Module, ...]

    def __init__(self, *, vllm_config: "VllmConfig", prefix: str = ""):
        Base.__init__(self, vllm_config=vllm_config, prefix=prefix)
        model_config = vllm_config.model_config
        self.head_dtype = model_config.head_dtype
        for module in self.head_modules:
            if not any(module is m for m in self.model.modules()):
                module.to(self.head_dtype)
        self.pooler = DispatchPooler.for_seq_cls(
            model_config.pooler_config,
            pooling=get_seq_pooling_method(self.classifier_head.pooling),
            classifier=self.classify,
        )

    def build(self, vllm_config: "VllmConfig", prefix: str) -> PreTrainedModel:
        hf_model = super().build(vllm_config, prefix)
        head = ClassifierHead.of(hf_model, self.report.causal)
        self.classifier_head = head
        modules = [hf_model.get_submodule(name) for name in head.modules]
        for name, module in zip(head.modules, modules):
            if "." not in name:  # the head's own modules; the base model's stay there
                self.add_module(name, module)
        self.head_modules = tuple(modules)
        last = modules[-1]
        self.report.pooler = f"{head.pooling} pooling ({head.reason})"
        self.report.head = (
            f"{' -> '.join(head.modules)} ({type(last).__name__}, "
            f"{hf_model.config.num_labels} labels)"
        )
        return hf_model

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """The head on `[sequences, hidden]` pooled states: `[sequences, labels]`."""
        hidden = pooled[:, None]
        for module in self.head_modules:
            dtype = next(module.parameters()).dtype
            hidden = module(hidden.to(dtype))
        return hidden.reshape(len(pooled), -1).to(self.head_dtype)
