# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Attaching vLLM's attention to the HF modules that dispatch it, and the
attention-interface functions through which those modules reach it: `"vllm"` for
vLLM's `Attention`, `"vllm_mla"` for its latent attention, `MLAAttention`."""

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from vllm.logger import init_logger
from vllm.model_executor.layers.attention import Attention, MLAAttention
from vllm.model_executor.layers.attention.mla_attention import get_mla_dims
from vllm.model_executor.models.transformers.fuser import get_fuser
from vllm.model_executor.models.transformers.fusers import AttentionFuser, MLAFuser
from vllm.model_executor.models.transformers.fusers.base import DECLINED
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
    ignored: vLLM's attention metadata already says which tokens see which.

    Values narrower than vLLM's layer takes them (latent attention served as plain
    attention, `VLLM_MLA_DISABLE=1`: value heads of `v_head_dim`, query and key heads
    of `qk_nope_head_dim + qk_rope_head_dim`) are zero-padded, and the padding is
    dropped from the output."""
    attn: Attention = getattr(module, ATTN_ATTR)
    num_tokens, head_dim_v = query.shape[2], value.shape[-1]
    padding = attn.head_size_v - head_dim_v
    if padding > 0:
        value = F.pad(value, (0, padding))
    query, key, value = (
        x.transpose(1, 2).reshape(num_tokens, -1) for x in (query, key, value)
    )
    output = attn(query, key, value)
    if padding > 0:
        return output.view(1, num_tokens, -1, attn.head_size_v)[..., :head_dim_v], None
    return output.view(1, num_tokens, -1, head_dim_v), None


def vllm_mla_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The `"vllm_mla"` attention function: hand `module.attn`, an `MLAAttention`, the
    query and the compressed KV.

    A forward rewritten by `MLAFuser` passes the normalised latent
    `[1, 1, tokens, kv_lora_rank]` as `key` and the rotary key
    `[1, 1, tokens, qk_rope_head_dim]` as `value`, never expanded: `MLAAttention`
    caches them as they are and applies `kv_b` itself. The query is
    `[1, heads, tokens, qk_nope_head_dim + qk_rope_head_dim]`; HF gets
    `[1, tokens, heads, v_head_dim]` back."""
    attn: MLAAttention = getattr(module, ATTN_ATTR)
    num_tokens = query.shape[2]
    output = attn(
        query.transpose(1, 2).reshape(num_tokens, -1, attn.qk_head_dim),
        key.reshape(num_tokens, attn.kv_lora_rank),
        value.reshape(num_tokens, 1, attn.qk_rope_head_dim),
        output_shape=(num_tokens, attn.num_heads * attn.v_head_dim),
    )
    return output.view(1, num_tokens, attn.num_heads, attn.v_head_dim), None


@dataclass(frozen=True)
class AttentionSite:
    """One HF module that dispatches attention, and the fuser that found it."""

    qualname: str
    module: nn.Module
    fuser: AttentionFuser
    mla: MLAFuser | None = None
    """The latent attention fused in this module, if it was."""

    @property
    def layer_index(self) -> int:
        return self.fuser.layer_index(self.module)


def attention_sites(
    modules: dict[str, tuple[nn.Module, AttentionFuser, MLAFuser | None]],
) -> dict[int, AttentionSite]:
    """The attention sites by the layer index each declares.

    Two modules claiming one index would share one KV cache, so that is an error."""
    sites: dict[int, AttentionSite] = {}
    for qualname, (module, fuser, mla) in modules.items():
        site = AttentionSite(qualname, module, fuser, mla)
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
    """Give each site in `layer_indices` a vLLM `Attention` as `attn` (an
    `MLAAttention` when the model uses MLA).

    Every layer in `layer_indices` must have a site: a layer vLLM cannot dispatch is a
    construction error naming that layer (`layer_names` says which module it is). So
    is, under MLA, a layer whose attention did not fuse as latent attention."""
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
        sliding_window = soft_cap = None
        attn: Attention | MLAAttention
        if model_config.use_mla:
            attn = mla_attention(site, vllm_config, prefix, layer_names.get(index, "?"))
            scale = attn.scale
        else:
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
                mla=isinstance(attn, MLAAttention),
            )
        )
        logger.info(
            "Attention: %s (%s) -> %s %s (layer %d, scale %.6g, sliding window %s, "
            "soft-cap %s)",
            site.qualname,
            type(site.module).__name__,
            ATTN_ATTR,
            type(attn).__name__,
            index,
            scale,
            sliding_window,
            soft_cap,
        )


def mla_attention(
    site: AttentionSite, vllm_config: "VllmConfig", prefix: str, layer_name: str
) -> MLAAttention:
    """vLLM's `MLAAttention` for a site whose latent attention was fused, built with
    the model's MLA dimensions and the module's own `kv_b` projection.

    vLLM allocates every layer's KV cache for the latent when the model uses MLA, so a
    site that did not fuse is a construction error naming its layer and why."""
    model_config = vllm_config.model_config
    if site.mla is None:
        raise ValueError(
            f"Decoder layer {site.layer_index}: {layer_name}. Its attention "
            f"{site.qualname} ({type(site.module).__name__}) did not fuse as latent "
            f"attention (MLA): {why_not_mla(site, vllm_config)}. The model's config "
            "says it uses MLA, so vLLM caches a compressed latent for every layer, "
            "which plain attention cannot use. Set VLLM_MLA_DISABLE=1 to serve every "
            "layer with plain attention instead."
        )
    dims = get_mla_dims(model_config)
    default_scale = (dims.qk_nope_head_dim + dims.qk_rope_head_dim) ** -0.5
    return MLAAttention(
        num_heads=model_config.get_num_attention_heads(vllm_config.parallel_config),
        scale=site.fuser.scale(site.module, default=default_scale),
        qk_nope_head_dim=dims.qk_nope_head_dim,
        qk_rope_head_dim=dims.qk_rope_head_dim,
        v_head_dim=dims.v_head_dim,
        q_lora_rank=dims.q_lora_rank,
        kv_lora_rank=dims.kv_lora_rank,
        kv_b_proj=getattr(site.module, site.mla.kv_b),
        cache_config=vllm_config.cache_config,
        quant_config=vllm_config.quant_config,
        prefix=f"{prefix}{site.qualname}.{ATTN_ATTR}",
    )


def why_not_mla(site: AttentionSite, vllm_config: "VllmConfig") -> str:
    """Why `MLAFuser` did not apply to the site's module."""
    matched = get_fuser(site.module, MLAFuser)
    if matched is not None:
        return matched.mismatch(site.module, vllm_config) or "it was not applied"
    module_class = type(site.module).__name__
    reasons = [
        d.reason
        for d in DECLINED
        if d.fuser == "MLAFuser" and d.module_class == module_class
    ]
    return reasons[-1] if reasons else "its forward has no latent attention pattern"
