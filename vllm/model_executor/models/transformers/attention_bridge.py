# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Attaching vLLM's attention to the HF modules that dispatch it, and the
attention-interface functions through which those modules reach it: `"vllm"` for
vLLM's `Attention`, `"vllm_mla"` for its latent attention, `MLAAttention`."""

import ast
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from vllm.distributed import get_tensor_model_parallel_rank
from vllm.logger import init_logger
from vllm.model_executor.layers.attention import (
    Attention,
    EncoderOnlyAttention,
    MLAAttention,
)
from vllm.model_executor.layers.attention.mla_attention import get_mla_dims
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    LinearBase,
    QKVParallelLinear,
    RowParallelLinear,
)
from vllm.model_executor.models.transformers.records import AttentionNeeds
from vllm.model_executor.models.transformers.fusion_report import (
    AttentionReport,
    FusionReport,
)
from vllm.model_executor.models.transformers.masks import LayerMask, Unread
from vllm.model_executor.models.transformers.rewriting import forward_source
from vllm.model_executor.models.utils import maybe_prefix

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
    _check_heads(module, attn, query, key, value)
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


def _check_heads(
    module: nn.Module,
    attn: Attention,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
) -> None:
    """The heads the module hands in must be the ones `attn` was built for: they were
    read off the module at construction (its attributes, where tracing did not reach
    the call), and a module that reshapes or repeats its keys and values before the
    call (JetMoE tiles them to its query heads) would otherwise have its tensors
    reinterpreted by vLLM's layer, a wrong answer without an error."""
    handed = (query.shape[1], key.shape[1], value.shape[1], query.shape[-1])
    built = (attn.num_heads, attn.num_kv_heads, attn.num_kv_heads, attn.head_size)
    if (
        handed == built
        and key.shape[-1] == attn.head_size
        and value.shape[-1] <= attn.head_size_v
    ):
        return
    raise ValueError(
        f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')}) hands "
        f"the attention interface {handed[0]} query heads of {query.shape[-1]}, "
        f"{handed[1]} key heads of {key.shape[-1]} and {handed[2]} value heads of "
        f"{value.shape[-1]}, but vLLM's attention was built for it with "
        f"{attn.num_heads} query heads and {attn.num_kv_heads} key/value heads of "
        f"{attn.head_size} (values {attn.head_size_v}), read from the module's "
        "attributes: the module changes its heads before the call (repeats or "
        "reshapes its keys and values), so the Transformers modeling backend cannot "
        "serve this layer."
    )


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

    A forward rewritten by the latent-attention fuser passes the normalised latent
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
    """One HF module that dispatches attention, and what attention it needs."""

    qualname: str
    module: nn.Module
    needs: AttentionNeeds
    packed: dict[str, str]
    """Original child name -> the merged child that now computes it (after fusion)."""

    @property
    def layer_index(self) -> int:
        return self.needs.layer_index


def attention_sites(sites: list[AttentionSite]) -> dict[int, AttentionSite]:
    """The attention sites by the layer index each declares.

    Two modules claiming one index would share one KV cache, so that is an error."""
    by_index: dict[int, AttentionSite] = {}
    for site in sites:
        if (other := by_index.get(site.layer_index)) is not None:
            raise ValueError(
                f"{site.qualname} ({type(site.module).__name__}) and {other.qualname} "
                f"({type(other.module).__name__}) both declare layer_idx="
                f"{site.layer_index}, so they would share one KV cache. Each attention "
                "module must declare its own `layer_idx`."
            )
        by_index[site.layer_index] = site
    return by_index


def _share(layer: nn.Module | None, role: str, shard: int) -> Fraction | None:
    """The share of the `role` heads a child computes on one tensor-parallel rank:
    1 where it is whole on every rank, `1/tp` where its output is split; `None` where
    the child is unknown."""
    if isinstance(layer, QKVParallelLinear):
        if role == "q":
            return Fraction(layer.num_heads, layer.total_num_heads)
        return Fraction(layer.num_kv_heads, layer.total_num_kv_heads)
    if isinstance(layer, ColumnParallelLinear):
        if layer.gather_output or getattr(layer, "disable_tp", False):
            return Fraction(1)
        sizes = layer.output_partition_sizes
        totals = getattr(layer, "output_sizes", None) or [layer.output_size]
        index = shard if len(totals) == len(sizes) > shard else 0
        return Fraction(sizes[index], totals[index])
    if isinstance(layer, LinearBase | nn.Linear):
        return Fraction(1)
    return None


def _input_share(layer: nn.Module | None) -> Fraction | None:
    """The share of its input a child reads on one rank (the output projection)."""
    if isinstance(layer, RowParallelLinear):
        if not layer.input_is_parallel or getattr(layer, "disable_tp", False):
            return Fraction(1)
        return Fraction(layer.input_size_per_partition, layer.input_size)
    if isinstance(layer, LinearBase | nn.Linear):
        return Fraction(1)
    return None


def heads_per_rank(site: AttentionSite, tp_size: int) -> tuple[int, int]:
    """The query and key/value heads `site`'s module feeds its attention on each
    rank, read off the (swapped) children that compute them.

    A construction error, naming the module and the fix, when they are not whole
    heads, when query and key/value are split differently from each other or from
    the output projection, or when nothing says how they are split under TP."""
    needs, module = site.needs, site.module
    shares: dict[str, Fraction] = {}
    for role in ("q", "k", "v", "o"):
        name = needs.sources.get(role)
        if name is None:
            continue
        holder = site.packed.get(name, name)
        layer = getattr(module, holder, None)
        if role == "o":
            share = _input_share(layer)
        else:
            members = [n for n, h in site.packed.items() if h == holder]
            shard = members.index(name) if name in members and len(members) > 1 else 0
            share = _share(layer, role, shard)
        if share is not None:
            shares[role] = share
    describe = f"{site.qualname} ({type(module).__name__}, layer {site.layer_index})"
    if tp_size == 1:
        return needs.num_heads, needs.num_kv_heads
    query = shares.get("q")
    key_value = shares.get("k", shares.get("v"))
    if query is None or key_value is None:
        raise ValueError(
            f"{describe}: tracing did not show which children compute its query, key "
            f"and value, so under tensor parallelism ({tp_size} ranks) the backend "
            "cannot check how many heads each rank feeds vLLM's attention. Serve it "
            "with tensor_parallel_size=1, or make its forward traceable."
        )
    num_heads = needs.num_heads * query
    num_kv_heads = needs.num_kv_heads * key_value
    problems = []
    if num_heads.denominator != 1 or num_kv_heads.denominator != 1:
        problems.append(
            f"{needs.num_heads} query / {needs.num_kv_heads} key-value heads are not "
            "split into whole heads"
        )
    if query == 1 and num_kv_heads != needs.num_kv_heads:
        problems.append("the query is whole on every rank but the keys are split")
    if "o" in shares and shares["o"] != query:
        problems.append(
            f"{needs.sources['o']} reads {shares['o']} of the attention output on each "
            f"rank, while the query carries {query} of the heads"
        )
    if problems:
        raise ValueError(
            f"{describe} under tensor parallelism ({tp_size} ranks): "
            f"{'; '.join(problems)}. vLLM's attention would get other heads than it "
            "is built with. Serve it with tensor_parallel_size=1, or give the model a "
            "tensor-parallel plan that splits q/k/v column-wise and the output "
            "projection row-wise."
        )
    return int(num_heads), max(1, int(num_kv_heads))


CACHE_PARAMETERS = frozenset({"past_key_values", "past_key_value", "cache_params"})
"""The names Transformers' forwards take their cache by."""
STATELESS_CACHE_USES = frozenset(
    {
        "update",  # an attention's keys and values: what vLLM's paged cache keeps
        "get_seq_length",
        "get_mask_sizes",
        "is_compileable",
        "is_initialized",
        # Encoder-decoder caches, read by encoders (BERT) only when one is given.
        "is_updated",
        "self_attention_cache",
        "cross_attention_cache",
    }
)
"""What a forward may ask of Transformers' cache without keeping state in it that
vLLM does not (vLLM runs the HF model without a cache)."""


@functools.cache
def cache_state_use(cls: type[nn.Module]) -> str | None:
    """Where `cls.forward` keeps or reads state of its own in Transformers' cache
    (a convolution's or a recurrence's, an indexer's), `file:line` and the use;
    `None` when it asks of it only what `STATELESS_CACHE_USES` lists."""
    try:
        source = forward_source(cls)
    except SyntaxError:  # a forward whose source does not parse on its own
        return None
    if source is None:
        return None
    for node in ast.walk(source.tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in CACHE_PARAMETERS
            and node.attr not in STATELESS_CACHE_USES
        ):
            return f"{ast.unparse(node)} at {source.location(node)}"
    return None


def refuse_state_beyond_keys_and_values(
    model: nn.Module, prefix: str, why_not: Callable[[nn.Module], str] | None = None
) -> None:
    """A construction error naming the first module that keeps state of its own in
    Transformers' cache: vLLM's cache holds attention keys and values only, and the
    HF model runs without Transformers' cache, so such state (Zaya's convolution
    over the queries and keys, before its attention call) would be lost between
    steps and every generated token computed without it, a wrong answer. Mixers
    that a fuser put on vLLM's state layers are gone by then; `why_not` says why
    the fusers left a module alone."""
    for name, module in model.named_modules(prefix=prefix):
        if (use := cache_state_use(type(module))) is not None:
            why = f" Not on vLLM's state layers: {why_not(module)}." if why_not else ""
            raise ValueError(
                f"{name} ({type(module).__name__}) keeps state of its "
                f"own in Transformers' cache ({use}). vLLM runs the model without that "
                "cache (its paged cache holds attention keys and values only), so "
                "the state would be lost between steps and the output would be "
                f"wrong; the Transformers modeling backend cannot serve this model.{why}"
            )


def _sinks(site: AttentionSite, num_heads: int, tp_rank: int) -> torch.Tensor | None:
    """The module's sink logits as vLLM's attention takes them: this rank's heads,
    in float32, loaded in place from the checkpoint (`s_aux`)."""
    name = site.needs.sinks
    if name is None:
        return None
    total = site.needs.num_heads
    start = tp_rank * num_heads if num_heads != total else 0

    def load(param: nn.Parameter, loaded: torch.Tensor) -> None:
        param.data.copy_(loaded[start : start + num_heads].to(param.dtype))

    sinks = nn.Parameter(torch.empty(num_heads, dtype=torch.float32), requires_grad=False)
    sinks.weight_loader = load
    setattr(site.module, name, sinks)
    return sinks


def sliding_window(
    site: AttentionSite,
    mask: LayerMask | Unread | None,
    vllm_config: "VllmConfig",
) -> tuple[int | None, str]:
    """The window vLLM's attention is built with for `site`: the one the model's
    mask applies there (`masks.py`), which is what Transformers computes with; and
    that mask, described. A construction error naming the module, the layer and the
    mask where vLLM's attention cannot apply it.

    vLLM's attention takes the window the site gives it (its call's
    `sliding_window=`, or `config.layer_types`), else the config's model-wide
    `sliding_window` (vLLM's engine sets that where the config has no `layer_types`,
    or only sliding ones), so a mask that applies no window cannot be honoured
    where either is set, nor one that applies another window than the call's, nor
    attention in chunks. A mask that cannot be read is refused where vLLM would
    slide, and served (as it always was) where vLLM would not."""
    given = site.needs.sliding_window
    model_wide = vllm_config.cache_config.sliding_window
    if given is not None:
        window = given
        source = "the window its attention call or config.layer_types gives it"
    else:
        window, source = model_wide, (
            f"the config's model-wide sliding_window={model_wide}, which vLLM's "
            "attention applies to every layer given no window of its own"
        )
    hint = ""
    if isinstance(mask, LayerMask) and not mask.chunked:
        if mask.window is not None and given in (None, mask.window):
            return mask.window, mask.made_by
        if mask.window is None and window is None:
            return None, mask.made_by
        applied = (
            "no window" if mask.window is None else f"a sliding window of {mask.window}"
        )
        problem = f"the model's mask applies {applied} there ({mask.made_by})"
        if mask.window is None and given is None:
            hint = (
                " Its config sets a `sliding_window` its mask does not apply: serve "
                "it with disable_sliding_window=True."
            )
    elif isinstance(mask, LayerMask):
        problem = f"the model's mask applies attention in chunks there ({mask.made_by})"
    else:
        why = "no decoder layer holds it" if mask is None else mask.reason
        if window is None:
            return None, f"not read: {why}"
        problem = f"the window the model's mask applies cannot be read ({why})"
    vllm_applies = (
        "no window" if window is None else f"a sliding window of {window}"
    )
    raise ValueError(
        f"{site.qualname} ({type(site.module).__name__}, layer {site.layer_index}): "
        f"vLLM's attention would apply {vllm_applies} ({source}), but {problem}. "
        "The Transformers modeling backend cannot serve this layer as Transformers "
        f"computes it.{hint}"
    )


def attach_attention(
    sites: dict[int, AttentionSite],
    layer_indices: Sequence[int],
    vllm_config: "VllmConfig",
    prefix: str,
    layer_names: dict[int, str],
    report: FusionReport,
    why_not_latent: dict[str, str],
    layer_masks: dict[str, LayerMask | Unread],
) -> None:
    """Give each site in `layer_indices` a vLLM `Attention` as `attn` (an
    `MLAAttention` where a fuser made it latent attention), built with the heads its
    module feeds on this rank, every argument of its call honoured and the window
    the model's mask applies (`layer_masks`: by decoder layer name, `masks.py`).

    Every layer in `layer_indices` must have a site: a layer vLLM cannot dispatch is a
    construction error naming that layer (`layer_names` says which module it is). So
    is, under MLA, a layer whose attention did not fuse as latent attention
    (`why_not_latent` says why, by module name)."""
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
        needs = site.needs
        # A draft model is built under the prefix `draft_model`.
        layer_prefix = maybe_prefix(prefix, f"{site.qualname}.{ATTN_ATTR}")
        mask = next(
            (
                mask
                for name, mask in layer_masks.items()
                if site.qualname.startswith(f"{name}.")
            ),
            None,
        )
        window, masked_by = sliding_window(site, mask, vllm_config)
        attn: Attention | MLAAttention
        if vllm_config.model_config.use_mla:
            if needs.latent is None:
                raise ValueError(
                    f"Decoder layer {index}: {layer_names.get(index, '?')}. Its "
                    f"attention {site.qualname} ({type(site.module).__name__}) did not "
                    "fuse as latent attention (MLA): "
                    f"{why_not_latent.get(site.qualname, 'its forward has no latent attention pattern')}. "
                    "The model's config says it uses MLA, so vLLM caches a "
                    "compressed latent for every layer, which plain attention cannot "
                    "use. Set VLLM_MLA_DISABLE=1 to serve every layer with plain "
                    "attention instead."
                )
            attn = mla_attention(site, vllm_config, layer_prefix)
        else:
            attn = plain_attention(site, window, vllm_config, layer_prefix)
        setattr(site.module, ATTN_ATTR, attn)
        _record(report, site, attn, window, masked_by)


def plain_attention(
    site: AttentionSite, window: int | None, vllm_config: "VllmConfig", prefix: str
) -> Attention:
    """vLLM's `Attention` for a site (`EncoderOnlyAttention` where it attends both
    ways), with the heads its module feeds on this rank, its scale, soft-cap and
    sinks, and the sliding `window` its layer applies."""
    needs = site.needs
    num_heads, num_kv_heads = heads_per_rank(
        site, vllm_config.parallel_config.tensor_parallel_size
    )
    sinks = _sinks(site, num_heads, get_tensor_model_parallel_rank())
    extra = {} if sinks is None else {"sinks": sinks}
    # Not `Attention(attn_type=ENCODER_ONLY)`: only this subclass's backend builds
    # its metadata non-causal; the plain layer attends causally.
    layer_class = Attention if needs.causal else EncoderOnlyAttention
    try:
        return layer_class(
            num_heads=num_heads,
            head_size=needs.head_size,
            scale=needs.scale,
            num_kv_heads=num_kv_heads,
            cache_config=vllm_config.cache_config,
            quant_config=vllm_config.quant_config,
            logits_soft_cap=needs.logits_soft_cap,
            per_layer_sliding_window=window,
            prefix=prefix,
            **extra,
        )
    except (AssertionError, ValueError) as error:
        raise ValueError(
            f"Decoder layer {site.layer_index}: {site.qualname} "
            f"({type(site.module).__name__}) needs {num_heads} query and "
            f"{num_kv_heads} key/value heads of size {needs.head_size}, "
            f"which vLLM's Attention refuses: {error}"
        ) from error


def _record(
    report: FusionReport,
    site: AttentionSite,
    attn: Attention | MLAAttention,
    window: int | None,
    masked_by: str | None,
) -> None:
    """What a site's `attn` was built with, in the report and the log."""
    needs = site.needs
    report.attention.append(
        AttentionReport(
            layer_index=site.layer_index,
            module=site.qualname,
            module_class=type(site.module).__name__,
            scale=needs.scale,
            sliding_window=window,
            soft_cap=needs.logits_soft_cap,
            mla=isinstance(attn, MLAAttention),
            causal=needs.causal,
            mask=masked_by,
        )
    )
    logger.info(
        "Attention: %s (%s) -> %s %s (layer %d, scale %.6g, sliding window %s "
        "(the model's mask: %s), soft-cap %s, sinks %s, %s)",
        site.qualname,
        type(site.module).__name__,
        ATTN_ATTR,
        type(attn).__name__,
        site.layer_index,
        needs.scale,
        window,
        masked_by,
        needs.logits_soft_cap,
        needs.sinks,
        "causal" if needs.causal else "encoder-only",
    )


def mla_attention(
    site: AttentionSite, vllm_config: "VllmConfig", prefix: str
) -> MLAAttention:
    """vLLM's `MLAAttention` for a site whose latent attention was fused, built with
    the model's MLA dimensions and the module's own `kv_b` projection."""
    model_config = vllm_config.model_config
    dims = get_mla_dims(model_config)
    return MLAAttention(
        num_heads=model_config.get_num_attention_heads(vllm_config.parallel_config),
        scale=site.needs.scale,
        qk_nope_head_dim=dims.qk_nope_head_dim,
        qk_rope_head_dim=dims.qk_rope_head_dim,
        v_head_dim=dims.v_head_dim,
        q_lora_rank=dims.q_lora_rank,
        kv_lora_rank=dims.kv_lora_rank,
        kv_b_proj=getattr(site.module, site.needs.latent),
        cache_config=vllm_config.cache_config,
        quant_config=vllm_config.quant_config,
        prefix=prefix,
    )
