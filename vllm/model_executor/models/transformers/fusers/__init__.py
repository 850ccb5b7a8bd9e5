# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""One fuser per file; `FUSER_CLASSES` is the order the registry tries them in."""

from vllm.model_executor.models.transformers.fusers.add_rms_norm import AddRMSNormFuser
from vllm.model_executor.models.transformers.fusers.attention import AttentionFuser
from vllm.model_executor.models.transformers.fusers.base import (
    BaseFuser,
    RewriteFuser,
    StackedFuser,
)
from vllm.model_executor.models.transformers.fusers.experts import ExpertsFuser
from vllm.model_executor.models.transformers.fusers.gated_delta_net import (
    GatedDeltaNetFuser,
)
from vllm.model_executor.models.transformers.fusers.glu import GLUFuser
from vllm.model_executor.models.transformers.fusers.mamba2 import Mamba2MixerFuser
from vllm.model_executor.models.transformers.fusers.mla import MLAFuser
from vllm.model_executor.models.transformers.fusers.moe_block import MoEBlockFuser
from vllm.model_executor.models.transformers.fusers.packed_qkv import PackedQKVFuser
from vllm.model_executor.models.transformers.fusers.qkv import QKVFuser
from vllm.model_executor.models.transformers.fusers.rms_norm import RMSNormFuser
from vllm.model_executor.models.transformers.fusers.rotary import RotaryFuser
from vllm.model_executor.models.transformers.fusers.rotary_embedding import (
    RotaryEmbeddingFuser,
)
from vllm.model_executor.models.transformers.fusers.router import RouterFuser
from vllm.model_executor.models.transformers.fusers.short_conv import ShortConvFuser

# Rewriters first: at most one of them redefines a class's forward.
# MLA first: a latent attention also has a query and a key/value path that a QKV
# fuser would otherwise decline.
FUSER_CLASSES: tuple[type[BaseFuser], ...] = (
    MLAFuser,
    QKVFuser,
    PackedQKVFuser,
    GLUFuser,
    RotaryEmbeddingFuser,
    RouterFuser,
    AddRMSNormFuser,
    MoEBlockFuser,
    RMSNormFuser,
    RotaryFuser,
    AttentionFuser,
    ExpertsFuser,
    Mamba2MixerFuser,
    ShortConvFuser,
    GatedDeltaNetFuser,
)

__all__ = [
    "FUSER_CLASSES",
    "AddRMSNormFuser",
    "AttentionFuser",
    "BaseFuser",
    "ExpertsFuser",
    "GLUFuser",
    "GatedDeltaNetFuser",
    "MLAFuser",
    "Mamba2MixerFuser",
    "MoEBlockFuser",
    "PackedQKVFuser",
    "QKVFuser",
    "RMSNormFuser",
    "RewriteFuser",
    "RotaryEmbeddingFuser",
    "RotaryFuser",
    "RouterFuser",
    "ShortConvFuser",
    "StackedFuser",
]
