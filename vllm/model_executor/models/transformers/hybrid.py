# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Hybrid causal LMs: attention beside state-space mixers (see docs/hybrid.md).

The model class tells vLLM about the mixers' state before the model is built
(`IsHybrid`, `HasInnerState`): vLLM sizes one page of its state cache from
`get_mamba_state_shape_from_config` and `get_mamba_state_dtype_from_config`, and
then gives each mixer layer the state its own `get_kv_cache_spec` asks for. The
shapes are read off the mixers of the HF model built on `meta` from the config (the
same modules the fusers will replace), never from config attribute names, which
differ from family to family."""

from typing import TYPE_CHECKING

import torch
from torch import nn
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.model_executor.layers.mamba.mamba_utils import (
    MambaStateCopyFunc,
    MambaStateCopyFuncCalculator,
)
from vllm.model_executor.models.interfaces import (
    HasInnerState,
    IsHybrid,
    SupportsMambaPrefixCaching,
)
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING, DynamicLayer
from vllm.model_executor.models.transformers.attention_bridge import (
    AttentionSite,
    cache_state_use,
)
from vllm.model_executor.models.transformers.base import build_hf_model
from vllm.model_executor.models.transformers.causal import CausalMixin
from vllm.model_executor.models.transformers.fusers import FUSER_CLASSES
from vllm.model_executor.models.transformers.fusers.base import MixerFuser
from vllm.model_executor.models.transformers.mixers import MixerDims

if TYPE_CHECKING:
    from vllm.config import VllmConfig

ATTENTION_LAYER_TYPES = frozenset(
    name
    for name, layer in DYNAMIC_LAYER_TYPE_MAPPING.items()
    if issubclass(layer, DynamicLayer)
)
"""Transformers' layer types whose cache layer holds attention keys and values
(`full_attention`, `sliding_attention`, `hybrid`, ...): the layers that must dispatch
attention to vLLM. `linear_attention`, `conv`, `mlp` and `moe` layers need not."""
RECURRENT_LAYER_TYPES = frozenset({"linear_attention", "conv", "hybrid", "hybrid_sliding"})
"""Transformers' layer types whose cache layer keeps a convolution or recurrent state
(`cache_utils.LinearAttentionLayer` and the layers combining it with attention;
`mlp` and `moe` share that class but keep nothing in it). The overlay's routing
(`vllm_transformers_overlay/routing.py`, standing for vLLM's config code) names
the hybrid class for a config declaring any of them."""

MIXER_STATES = tuple(f.state_of for f in FUSER_CLASSES if issubclass(f, MixerFuser))
"""Per mixer fuser: a module's dims on vLLM's layer, why it cannot be, or `None`
when the module is no mixer of that kind."""
STATE_COPY_FUNCS: dict[MambaAttentionBackendEnum, tuple[MambaStateCopyFunc, ...]] = {
    MambaAttentionBackendEnum.MAMBA2: (
        MambaStateCopyFuncCalculator.mamba2_state_copy_func()
    ),
    MambaAttentionBackendEnum.SHORT_CONV: (
        MambaStateCopyFuncCalculator.short_conv_state_copy_func()
    ),
    MambaAttentionBackendEnum.GDN_ATTN: (
        MambaStateCopyFuncCalculator.gated_delta_net_state_copy_func()
    ),
}
"""How vLLM copies each state of a layer (prefix caching), per kind of layer."""

_MIXERS: dict[str, tuple[MixerDims, ...]] = {}


def _mixers(vllm_config: "VllmConfig") -> tuple[MixerDims, ...]:
    """The dims of every mixer of the model `vllm_config` builds, read off its HF
    model on `meta` (once per config and process); a stateful mixer no fuser
    serves is an error naming it."""
    key = vllm_config.model_config.hf_config.to_json_string(use_diff=False)
    if key not in _MIXERS:
        _MIXERS[key] = _read_mixers(build_hf_model(vllm_config))
    return _MIXERS[key]


def _read_mixers(hf_model: nn.Module) -> tuple[MixerDims, ...]:
    found = []
    for name, module in hf_model.named_modules():
        dims = next(
            (d for read in MIXER_STATES if (d := read(module)) is not None), None
        )
        if isinstance(dims, MixerDims):
            found.append(dims)
            continue
        if isinstance(dims, str):
            why = dims
        elif (use := cache_state_use(type(module))) is not None:
            why = f"no mixer of this backend's matches it; it keeps state at {use}"
        else:
            continue
        raise ValueError(
            f"{name} ({type(module).__name__}) keeps state of its own in Transformers' "
            f"cache, which vLLM's state layers do not serve here: {why}. The "
            "Transformers modeling backend cannot serve this model."
        )
    return tuple(found)


class HybridMixin(CausalMixin, IsHybrid, HasInnerState, SupportsMambaPrefixCaching):
    """A causal LM whose decoder mixes tokens with state-space mixers beside (or
    instead of) attention: each mixer runs on one of vLLM's stateful layers
    (`MambaMixer2`, `fusers/mamba2.py`; `ShortConv`, `fusers/short_conv.py`;
    `QwenGatedDeltaNetAttention`, `fusers/gated_delta_net.py`), its states in vLLM's
    state cache."""

    @classmethod
    def _largest_mixer(cls, vllm_config: "VllmConfig") -> MixerDims:
        """The mixer whose state sizes vLLM's state pages: the largest, all of one
        kind (vLLM sizes one page shape for every mixer layer)."""
        mixers = _mixers(vllm_config)
        layer_types = sorted(set(vllm_config.model_config.hf_text_config.layer_types))
        if not mixers:
            raise ValueError(
                f"{cls.__name__}: the model's config declares recurrent layers "
                f"({layer_types}), but its HF model holds no mixer this backend serves."
            )
        if len({type(d) for d in mixers}) > 1:
            raise ValueError(
                f"{cls.__name__}: the model mixes mixers of different kinds "
                f"({sorted({type(d).__name__ for d in mixers})}), whose states vLLM's "
                "state cache does not page together here."
            )
        return max(mixers, key=lambda d: sum(d.state_elements()))

    @classmethod
    def get_mamba_state_shape_from_config(
        cls, vllm_config: "VllmConfig"
    ) -> tuple[tuple[int, ...], ...]:
        return cls._largest_mixer(vllm_config).state_shape(
            vllm_config.parallel_config.tensor_parallel_size,
            vllm_config.num_speculative_tokens,
        )

    @classmethod
    def get_mamba_state_dtype_from_config(
        cls, vllm_config: "VllmConfig"
    ) -> tuple[torch.dtype, ...]:
        return cls._largest_mixer(vllm_config).state_dtype(vllm_config)

    @classmethod
    def get_mamba_state_copy_funcs(
        cls, mamba_types: set[MambaAttentionBackendEnum]
    ) -> dict[MambaAttentionBackendEnum, tuple[MambaStateCopyFunc, ...]]:
        return {kind: STATE_COPY_FUNCS[kind] for kind in mamba_types}

    def attention_layers(self, sites: dict[int, AttentionSite]) -> list[int]:
        """The layers that must dispatch attention: those whose declared layer type
        keeps keys and values (`ATTENTION_LAYER_TYPES`), and any other that does."""
        layer_types = getattr(self.text_config, "layer_types", None) or []
        return [
            i
            for i in self.layer_range
            if i in sites
            or (i < len(layer_types) and layer_types[i] in ATTENTION_LAYER_TYPES)
        ]

    def build(self, vllm_config: "VllmConfig", prefix: str) -> nn.Module:
        hf_model = super().build(vllm_config, prefix)
        self.refuse_unserved_state()
        return hf_model

    def refuse_unserved_state(self) -> None:
        """Every layer declared recurrent holds a mixer on vLLM's state layers."""
        layer_types = getattr(self.text_config, "layer_types", None) or []
        stack, _ = self.layout.decoder_layers
        layers = self.model.get_submodule(stack)
        for i in self.layer_range:
            if i < len(layer_types) and layer_types[i] in RECURRENT_LAYER_TYPES:
                if not any(isinstance(m, MambaBase) for m in layers[i].modules()):
                    raise ValueError(
                        f"Decoder layer {i} is a {layer_types[i]!r} layer "
                        "(config.layer_types), but no module in it runs on vLLM's "
                        "state layers, so its state would be lost between steps; "
                        "the Transformers modeling backend cannot serve this model."
                    )
