# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""How a vision-language model's image tokens attend, read from the model's own
mask code and checked against what vLLM's attention will compute.

Some models let the tokens of one image attend to each other both ways (Gemma 3:
its mask gives each image's tokens a block of their own, from the token types its
processor writes). vLLM computes that ("multimodal prefix-LM") only where the model
config says so (`is_mm_prefix_lm`: a list of model types, or the config's own
attribute) and the attention backend supports it (`supports_mm_prefix()`: GPU
backends; vLLM's CPU attention attends causally only). Where the two differ, the
backend refuses images at start-up rather than serve them with another attention;
a text-only engine is still served.
"""

import copy
import itertools

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel, masking_utils

from vllm.logger import init_logger
from vllm.model_executor.layers.attention import Attention, MLAAttention

logger = init_logger(__name__)

PROBE_TOKEN_TYPES = (0, 1, 1, 1, 0, 1, 1, 0)
"""The prompt the model's mask is asked about: text, an image of three tokens,
text, an image of two, text (1 marks an image token, as processors write
`mm_token_type_ids`, and Gemma 3's its `token_type_ids`)."""

TEXT_ONLY = (
    "A text-only engine serves the model's text prompts "
    "(`limit_mm_per_prompt={'image': 0}`, `--limit-mm-per-prompt '{\"image\": 0}'`)."
)


def attends_later(
    cls: type[PreTrainedModel], config: PretrainedConfig
) -> set[tuple[int, int]]:
    """The (query, key) positions of the probe prompt at which the mask of model
    class `cls` lets a token attend to a later one, in any kind of layer: the masks
    its `create_masks_for_generate` builds for `config` (what Transformers'
    `generate` builds a first step's masks with, given the processor's token
    types), as eager attention takes them."""
    types = torch.tensor([PROBE_TOKEN_TYPES], device="cpu")
    length = types.shape[-1]
    config = copy.deepcopy(config)
    config.get_text_config()._attn_implementation = "eager"
    create_masks = getattr(
        cls, "create_masks_for_generate", masking_utils.create_masks_for_generate
    )
    masks = create_masks(
        config=config,
        inputs_embeds=torch.empty(1, length, 0, device="cpu"),
        attention_mask=torch.ones(1, length, dtype=torch.long, device="cpu"),
        past_key_values=None,
        position_ids=torch.arange(length, device="cpu")[None],
        token_type_ids=types,
        mm_token_type_ids=types,
        is_first_iteration=True,
    )
    later = set()
    for mask in masks.values() if isinstance(masks, dict) else [masks]:
        if mask is None:  # causal, left to the attention's own flag
            continue
        # Eager attention adds its mask to the scores: 0 where a key is seen.
        seen = mask[0, 0] == 0 if mask.is_floating_point() else mask[0, 0]
        later |= {(q, k) for q, k in seen.nonzero().tolist() if k > q}
    return later


def _within_images() -> frozenset[tuple[int, int]]:
    images = [
        [position for position, _ in run]
        for is_image, run in itertools.groupby(
            enumerate(PROBE_TOKEN_TYPES), key=lambda item: item[1] == 1
        )
        if is_image
    ]
    return frozenset((q, k) for image in images for q in image for k in image if k > q)


WITHIN_IMAGES = _within_images()
"""The (query, key) pairs of the probe prompt that attend forward when each image's
tokens attend to each other both ways (vLLM's multimodal prefix-LM)."""


def check_image_attention(
    hf_model: PreTrainedModel, base_model: nn.Module, prefix: str
) -> None:
    """Refuse images where vLLM's attention layers in `base_model` (named under
    `prefix`) would not attend to image tokens as the model's own mask does; say
    how they attend where it is both ways."""
    name = type(hf_model).__name__
    try:
        later = attends_later(type(hf_model), hf_model.config)
    except (TypeError, ValueError) as error:
        # Its `generate` could not build them either (Transformers' generic one
        # passes Llama 4's chunked mask an argument that mask does not take); the
        # decoder, given no token types, attends causally.
        logger.warning(
            "%s.create_masks_for_generate could not build the masks for a prompt "
            "with images (%s: %s); image tokens attend causally, as its decoder's "
            "own mask without token types does.",
            name,
            type(error).__name__,
            error,
        )
        later = set()
    layers = {
        f"{prefix}.{n}": m
        for n, m in base_model.named_modules()
        if isinstance(m, Attention | MLAAttention)
    }
    backends = {layer.get_attn_backend() for layer in layers.values()}
    prefix_lm = bool(layers) and all(
        getattr(layer, "use_mm_prefix", False) for layer in layers.values()
    )
    both_ways = prefix_lm and all(b.supports_mm_prefix() for b in backends)
    mask = f"{name}.create_masks_for_generate"
    names = ", ".join(sorted(b.get_name() for b in backends))
    where = f"vLLM's attention layers ({', '.join(list(layers)[:2])}, ...) on {names}"
    if later == WITHIN_IMAGES and both_ways:
        logger.info(
            "Image tokens attend to each other both ways within each image (%s), "
            "as %s computes them.",
            mask,
            where,
        )
        return
    if not later and not both_ways:
        return
    if later == WITHIN_IMAGES:
        causal_only = sorted(
            b.get_name() for b in backends if not b.supports_mm_prefix()
        )
        why = (
            f"vLLM's {', '.join(causal_only)} attention backend does not compute it "
            "(`supports_mm_prefix()` is false)"
            if prefix_lm
            else "vLLM does not serve this model as a multimodal prefix-LM (its "
            "model config's `is_mm_prefix_lm` is false: vLLM decides it by model "
            "type, or by the config's `is_mm_prefix_lm` attribute)"
        )
        raise ValueError(
            f"{name}: its mask ({mask}) lets the tokens of one image attend to each "
            f"other both ways, and {why}, so {where} would attend to them causally, "
            "which is not the model. Images are refused. "
            f"{TEXT_ONLY} Images need an attention backend that computes it (vLLM's "
            "FlashAttention, Triton or FlexAttention backends on a GPU; vLLM's CPU "
            "attention attends causally only), with `is_mm_prefix_lm: true` in the "
            "model's config where vLLM does not list its model type."
        )
    if not later:
        raise ValueError(
            f"{name}: its mask ({mask}) lets image tokens attend causally, while "
            f"{where} would let the tokens of each image attend to each other both "
            "ways (the model config's `is_mm_prefix_lm` is true: vLLM lists its model "
            "type, or the config says so). Images are refused. `is_mm_prefix_lm: "
            f"false` in the model's config makes vLLM attend causally. {TEXT_ONLY}"
        )
    pairs = ", ".join(f"{q}->{k}" for q, k in sorted(later - WITHIN_IMAGES)[:4])
    raise ValueError(
        f"{name}: its mask ({mask}) lets tokens attend to later ones beyond the "
        f"tokens of one image (positions {pairs} of a prompt with token types "
        f"{list(PROBE_TOKEN_TYPES)}, 1 for an image's), which vLLM's attention "
        "cannot compute: it attends causally, or both ways within each image at "
        f"most. Images are refused. {TEXT_ONLY}"
    )
