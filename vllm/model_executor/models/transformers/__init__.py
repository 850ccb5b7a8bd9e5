# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""vLLM's Transformers modeling backend: serve a Hugging Face model with vLLM's
attention, fused tensor-parallel layers and kernels.

Importing this package registers the `"vllm"` and `"vllm_mla"` attention functions
with Transformers; the backend sets one of them as the text config's
`_attn_implementation` (`"vllm_mla"` when vLLM uses MLA for the model). It also
registers the `"vllm"` experts function, the text config's `_experts_implementation`,
which runs experts on vLLM's fused MoE."""

from transformers import AttentionInterface
from transformers.integrations.moe import ExpertsInterface

from vllm.model_executor.models.transformers.attention_bridge import (
    vllm_attention_forward,
    vllm_mla_attention_forward,
)
from vllm.model_executor.models.transformers.causal import CausalMixin
from vllm.model_executor.models.transformers.hybrid import HybridMixin
from vllm.model_executor.models.transformers.experts_layer import (
    VLLM_EXPERTS,
    vllm_experts_forward,
)
from vllm.model_executor.models.transformers.multimodal import (
    MultiModalMixin,
    register_processor,
)
from vllm.model_executor.models.transformers.pooling import (
    EmbeddingMixin,
    SequenceClassificationMixin,
)

AttentionInterface.register("vllm", vllm_attention_forward)
AttentionInterface.register("vllm_mla", vllm_mla_attention_forward)
ExpertsInterface.register(VLLM_EXPERTS, vllm_experts_forward)


class TransformersForCausalLM(CausalMixin):
    """A dense causal LM from Transformers."""


class TransformersMoEForCausalLM(CausalMixin):
    """A mixture-of-experts causal LM from Transformers: its experts run on vLLM's
    fused MoE (`experts_layer.py`), the rest as in a dense one."""


class TransformersHybridForCausalLM(HybridMixin):
    """A hybrid causal LM from Transformers: attention beside state-space mixers,
    which run on vLLM's stateful layers (`hybrid.py`)."""


class TransformersHybridMoEForCausalLM(HybridMixin):
    """A hybrid causal LM whose feed-forward is a mixture of experts."""


class TransformersEmbeddingModel(EmbeddingMixin):
    """A dense embedding model from Transformers: an encoder or a decoder."""


class TransformersForSequenceClassification(SequenceClassificationMixin):
    """A dense sequence classifier (and cross-encoder) from Transformers."""


@register_processor
class TransformersMultiModalForCausalLM(MultiModalMixin, CausalMixin):
    """A vision-language model from Transformers: its text decoder fused on vLLM
    attention, its vision tower and projector left to Transformers."""


@register_processor
class TransformersMultiModalMoEForCausalLM(MultiModalMixin, CausalMixin):
    """A vision-language model whose text decoder is a mixture of experts (run on
    vLLM's fused MoE, `experts_layer.py`)."""


class TransformersMoEEmbeddingModel(EmbeddingMixin):
    """A mixture-of-experts embedding model: its experts on vLLM's fused MoE
    (`experts_layer.py`), pooled as a dense one's."""


class TransformersMoEForSequenceClassification(SequenceClassificationMixin):
    """A mixture-of-experts sequence classifier: its experts on vLLM's fused MoE,
    its head as a dense classifier's."""


@register_processor
class TransformersMultiModalEmbeddingModel(EmbeddingMixin, MultiModalMixin):
    """A vision-language base model as an embedder: images through the HF vision
    tower and projector, the hidden states pooled as a dense embedder's."""


@register_processor
class TransformersMultiModalForSequenceClassification(
    SequenceClassificationMixin, MultiModalMixin
):
    """A vision-language sequence classifier (Gemma 3's): images through the HF
    vision tower and projector, the HF model's own head on the pooled token."""
