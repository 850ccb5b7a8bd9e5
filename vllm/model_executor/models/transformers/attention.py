# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Attaching vLLM's attention to the HF modules that dispatch it, and the
attention-interface function through which those modules reach it."""

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from vllm.logger import init_logger
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.models.transformers.fusers import AttentionFuser
from vllm.model_executor.models.transformers.fusion_report import (
    AttentionReport,
    FusionReport,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(__name__)

ATTN_ATTR = "attn"
"""Where the vLLM layer lives on the HF module: the name in-tree models use, and the
one vLLM's FP8 KV-scale remapping writes (`.self_attn.attn.k_scale`)."""


def vllm_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The `"vllm"` attention function: hand HF's tensors to `module.attn`.

    HF passes `[1, heads, tokens, head_dim]` and expects `[1, tokens, heads, head_dim]`
    back; vLLM's layer takes and returns `[tokens, heads * head_dim]`. The mask is
    ignored: vLLM's attention metadata already says which tokens see which."""
    attn: Attention = getattr(module, ATTN_ATTR)
    num_tokens, head_dim_v = query.shape[2], value.shape[-1]
    query, key, value = (x.transpose(1, 2).reshape(num_tokens, -1) for x in (query, key, value))
    output = attn(query, key, value)
    return output.view(1, num_tokens, -1, head_dim_v), None


@dataclass(frozen=True)
class AttentionSite:
    """One HF module that dispatches attention, and the fuser that found it."""

    qualname: str
    module: nn.Module
    fuser: AttentionFuser

    @property
    def layer_index(self) -> int:
        return self.fuser.layer_index(self.module)


def attention_sites(
    modules: dict[str, tuple[nn.Module, AttentionFuser]],
) -> dict[int, AttentionSite]:
    """The attention sites by the layer index each declares.

    Two modules claiming one index would share one KV cache, so that is an error."""
    sites: dict[int, AttentionSite] = {}
    for qualname, (module, fuser) in modules.items():
        site = AttentionSite(qualname, module, fuser)
        if (other := sites.get(site.layer_index)) is not None:
            raise ValueError(
                f"{qualname} ({type(module).__name__}) and {other.qualname} "
                f"({type(other.module).__name__}) both declare layer_idx="
                f"{site.layer_index}, so they would share one KV cache. Each attention "
                "module must declare its own `layer_idx`."
            )
        sites[site.layer_index] = site
    return sites


def attach_attention(
    sites: dict[int, AttentionSite],
    layer_indices: range,
    vllm_config: "VllmConfig",
    prefix: str,
    layer_names: dict[int, str],
    report: FusionReport,
) -> None:
    """Give each site in `layer_indices` a vLLM `Attention` as `attn`.

    Every layer in `layer_indices` must have a site: a layer vLLM cannot dispatch is a
    construction error naming that layer (`layer_names` says which module it is)."""
    model_config = vllm_config.model_config
    parallel_config = vllm_config.parallel_config
    text_config = model_config.hf_text_config
    layer_types = getattr(text_config, "layer_types", None)
    head_size = model_config.get_head_size()
    for index in layer_indices:
        site = sites.get(index)
        if site is None:
            raise ValueError(
                f"Decoder layer {index}: {layer_names.get(index, '?')}. No module in it "
                "calls the Transformers attention interface (`ALL_ATTENTION_FUNCTIONS`), "
                "so vLLM cannot serve its attention. The Transformers modeling backend "
                "needs every decoder layer's attention to dispatch through that "
                "interface."
            )
        sliding_window = None
        if layer_types is not None and layer_types[index] == "sliding_attention":
            sliding_window = text_config.sliding_window
        scale = site.fuser.scale(site.module, default=head_size**-0.5)
        soft_cap = getattr(text_config, "attn_logit_softcapping", None)
        attn = Attention(
            num_heads=model_config.get_num_attention_heads(parallel_config),
            head_size=head_size,
            scale=scale,
            num_kv_heads=model_config.get_num_kv_heads(parallel_config),
            cache_config=vllm_config.cache_config,
            quant_config=vllm_config.quant_config,
            logits_soft_cap=soft_cap,
            per_layer_sliding_window=sliding_window,
            prefix=f"{prefix}{site.qualname}.{ATTN_ATTR}",
        )
        setattr(site.module, ATTN_ATTR, attn)
        report.attention.append(
            AttentionReport(
                layer_index=index,
                module=site.qualname,
                module_class=type(site.module).__name__,
                scale=scale,
                sliding_window=sliding_window,
                soft_cap=soft_cap,
                mla=False,
            )
        )
        logger.info(
            "Attention: %s (%s) -> %s (layer %d, scale %.6g, sliding window %s, "
            "soft-cap %s)",
            site.qualname,
            type(site.module).__name__,
            ATTN_ATTR,
            index,
            scale,
            sliding_window,
            soft_cap,
        )
