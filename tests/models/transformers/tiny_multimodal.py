# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Tiny local vision-language (and audio-language) checkpoints, Transformers' greedy
reference on images (or audio), and a vLLM engine runner for prompts with them. Built
on `tiny.py`'s vocabulary, cache and process handling.

Each checkpoint is a Transformers `...ForConditionalGeneration` with seeded random
weights (every 1-D parameter perturbed, the vision tower's too) and the model's real
processor: its Transformers processor class, around the PIL image processor of the
family (`...ImageProcessorPil`: the default "fast" ones need torchvision, which does
not match the engine's torch; VibeVoiceAsr's: its audio feature extractor), `tiny`'s
word-level tokenizer with the model's image (or audio) tokens added, and a chat
template that writes each image as the model's placeholder.
Qwen2-VL's and Qwen2.5-VL's processors are built and loaded without their video
processor (Transformers' video processors need torchvision), which their saved
processor config still names, as a real checkpoint's does.
Images are small generated RGB pictures (seeded noise over a gradient); audio clips
are generated waveforms (a seeded mix of sines), a few hundred ms long.

Command line (the engine runner uses it):
    python tiny_multimodal.py engine SPEC.json OUT.json
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tiny  # noqa: E402

RECIPE_VERSION = 2

TEXT: dict[str, Any] = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,  # head_dim 32: the CPU attention's smallest
    num_key_value_heads=2,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    pad_token_id=tiny.PAD_ID,
    bos_token_id=tiny.BOS_ID,
    eos_token_id=tiny.EOS_ID,
    initializer_range=0.1,
)
"""The text decoder of every recipe (its vocabulary: `tiny`'s plus the image tokens)."""

MAX_MODEL_LEN = 256
MAX_TOKENS = 8
MIN_MARGIN = 0.02
MIN_DISTINCT = 3
"""Distinct tokens each greedy continuation must have: a model that repeats one
token (its `<s>`) would hide a wrong image or position behind the same output."""
MAX_SEED_TRIES = 32
FIRST_GOOD_SEED = {
    "aria": 1,
    "emu3": 2,
    "qwen2_5_vl": 5,
    "qwen2_vl": 3,
    "vibevoice_asr": 2,
}
"""Where `build` starts its search for a recipe (as `tiny.FIRST_GOOD_SEED`)."""


@dataclass(frozen=True)
class Recipe:
    model_type: str
    image_tokens: tuple[str, ...]
    """Tokens the processor and config name, appended to `tiny.VOCAB` in this order."""
    placeholder: str
    """What the chat template writes for an image (the processor expands it)."""
    video_processor: dict[str, Any] | None = None
    """The video processor its processor always loads and which needs torchvision
    (Qwen2-VL's): written into the saved processor config as a real checkpoint
    has it, while the processor is built and loaded here with its tokenizer and
    image processor only (`without_video`)."""
    engine_prefix: str = ""
    """What the processor writes before any text (Emu3's processor its `<s>`), which
    a prompt given to vLLM (tokenized, not processed) spells itself."""
    modality: str = "image"
    """What the placeholder stands for, written `{image}` or `{audio}` in requests."""
    tokenizer_adds_bos: bool = True
    """Whether the tokenizer writes `<s>` first. VibeVoiceAsr's (Qwen2's) does not;
    its processor tokenizes without special tokens and vLLM with them, so a tokenizer
    that added one would give the two different prompts."""
    text_tokens: tuple[str, ...] = ()
    """Plain (not special) tokens appended after the image tokens, matched longest
    first: Gemma's runs of newlines (`NEWLINES`)."""


QWEN_VL_TOKENS = (
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
QWEN_VL_PLACEHOLDER = "<|vision_start|> <|image_pad|> <|vision_end|>"
QWEN_VL_PATCHES: dict[str, Any] = dict(
    patch_size=8, merge_size=2, temporal_patch_size=2
)
"""Qwen2-VL's and Qwen2.5-VL's patching: 8 px patches, merged 2x2 into one token."""
QWEN_VL_VIDEO = dict(QWEN_VL_PATCHES, video_processor_type="Qwen2VLVideoProcessor")

NEWLINES = ("\n", "\n\n", "\n\n\n", "\n\n\n\n")
"""Gemma's vocabulary has a token for each run of up to four newlines, which its
BPE merges: the `"\n\n"` Gemma 3's processor writes around an image becomes one
`"\n\n\n"` with a newline of the prompt beside it."""

RECIPES: dict[str, Recipe] = {
    # LLaVA: CLIP tower (class token dropped, `vision_feature_layer=-2`), a GELU
    # projector, a Llama decoder; 16 image tokens for a 32x32 picture.
    "llava": Recipe("llava", ("<image>",), "<image>"),
    # Qwen2-VL: its own vision transformer at the image's own resolution (patches of
    # 8 px merged 2x2), M-RoPE over (time, height, width) in the decoder. Its
    # processor's video processor needs torchvision.
    "qwen2_vl": Recipe(
        "qwen2_vl",
        QWEN_VL_TOKENS,
        QWEN_VL_PLACEHOLDER,
        video_processor=QWEN_VL_VIDEO,
    ),
    # Qwen2.5-VL: Qwen2-VL's layout, a vision transformer with windowed attention
    # (full attention in its last block) and a GLU MLP.
    "qwen2_5_vl": Recipe(
        "qwen2_5_vl",
        QWEN_VL_TOKENS,
        QWEN_VL_PLACEHOLDER,
        video_processor=QWEN_VL_VIDEO,
    ),
    # Gemma 3: SigLIP tower, average-pooled to 4 soft tokens, a Gemma 3 decoder
    # whose image tokens attend to each other both ways in Transformers; Gemma's
    # newline tokens, which merge with the newlines its processor writes.
    "gemma3": Recipe(
        "gemma3",
        ("<start_of_image>", "<end_of_image>", "<image_soft_token>"),
        "<start_of_image>",
        text_tokens=NEWLINES,
    ),
    # Emu3: no vision encoder but a VQ-VAE (`vqmodel`) that turns a picture into
    # discrete tokens, embedded with the text embeddings; each image is written as
    # its size and rows of image tokens, one more per row for the row ends.
    "emu3": Recipe(
        "emu3",
        (
            "<image>",
            "<|image start|>",
            "<|image end|>",
            "<|image token|>",
            "<|extra_201|>",
            "<|extra_200|>",
            *(f"<|visual token {i:06d}|>" for i in range(32)),
        ),
        "<image>",
        engine_prefix=f"{tiny.BOS} ",
    ),
    # LLaVA-NeXT ("anyres"): the picture resized onto the best of a few grids of
    # 32 px tiles, each tile and a 32 px overview through the CLIP tower, the tiles'
    # features unpadded to the picture's aspect with a newline embedding per row.
    "llava_next": Recipe("llava_next", ("<image>",), "<image>"),
    # LLaVA-OneVision: LLaVA-NeXT's tiles (grids up to 2x2 of 32 px) through a
    # SigLIP tower, every patch kept, a Qwen2 decoder. Its processor always loads
    # a video processor.
    "llava_onevision": Recipe(
        "llava_onevision",
        ("<image>", "<video>"),
        "<image>",
        video_processor=dict(video_processor_type="LlavaOnevisionVideoProcessor"),
    ),
    # Idefics3: the picture split into 32 px tiles and a 32 px global view, each
    # through a SigLIP-like tower, pixel-shuffled 2x2, a Llama decoder; tiles
    # written between `<fake_token_around_image>` with their row and column.
    "idefics3": Recipe(
        "idefics3",
        ("<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"),
        "<image>",
    ),
    # SmolVLM: Idefics3's layout; its processor always loads a video processor
    # and needs the `num2words` package (not installed by setup_env.sh).
    "smolvlm": Recipe(
        "smolvlm",
        ("<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"),
        "<image>",
        video_processor=dict(video_processor_type="SmolVLMVideoProcessor"),
    ),
    # GLM-4V: Qwen2-VL's dynamic resolution and M-RoPE (over half of each head,
    # `partial_rotary_factor` 0.5), its own vision transformer, a GLM-4 decoder.
    # Its processor always loads a video processor.
    "glm4v": Recipe(
        "glm4v",
        (
            "<|begin_of_image|>",
            "<|end_of_image|>",
            "<|image|>",
            "<|begin_of_video|>",
            "<|end_of_video|>",
            "<|video|>",
        ),
        "<|begin_of_image|> <|image|> <|end_of_image|>",
        video_processor=dict(
            QWEN_VL_PATCHES, video_processor_type="Glm4vVideoProcessor"
        ),
    ),
    # Qwen3-VL: Qwen2-VL's layout (interleaved M-RoPE), a vision transformer with
    # learned position embeddings whose intermediate features ("deepstack") are
    # added to the image tokens' hidden states in the first decoder layers.
    "qwen3_vl": Recipe(
        "qwen3_vl",
        QWEN_VL_TOKENS,
        QWEN_VL_PLACEHOLDER,
        video_processor=dict(
            QWEN_VL_PATCHES, video_processor_type="Qwen3VLVideoProcessor"
        ),
    ),
    # Aya Vision: the picture cut into up to 4 tiles of 32 px and a thumbnail
    # (GOT-OCR2's image processor), each through a SigLIP tower, pixel-shuffled
    # 2x2, a SwiGLU projector, a Cohere 2 decoder (sliding layers, logit scale);
    # every tile written as its own run of patch tokens.
    "aya_vision": Recipe(
        "aya_vision",
        (
            "<image>",
            "<|START_OF_IMG|>",
            "<|END_OF_IMG|>",
            "<|IMG_PATCH|>",
            "<|IMG_LINE_BREAK|>",
            "TILE",
            "TILE_GLOBAL",
        ),
        "<image>",
    ),
    # InternVL: GOT-OCR2's tiles, an InternViT tower, pixel-shuffled 2x2, an MLP
    # projector, a Qwen2 decoder; `<img>`, the tiles' `<IMG_CONTEXT>` tokens,
    # `</img>`. Its processor always loads a video processor.
    "internvl": Recipe(
        "internvl",
        ("<img>", "</img>", "<IMG_CONTEXT>", "<video>"),
        "<IMG_CONTEXT>",
        video_processor=dict(video_processor_type="InternVLVideoProcessor"),
    ),
    # Aria: an Idefics3 vision tower on pictures padded to 980 px, a projector whose
    # learned queries cross-attend to the patches (196 patches of 70 px -> 8 image
    # tokens here), a decoder with experts and a shared MLP (`aria_text`).
    "aria": Recipe("aria", ("<|img|>",), "<|img|>"),
    # VibeVoiceAsr (audio in, text out): two convolutional audio encoders (acoustic,
    # semantic) whose latents a projector sums, one audio token per 3200 samples at
    # 24 kHz, a Qwen2 decoder; the processor expands `<|box_start|>`.
    "vibevoice_asr": Recipe(
        "vibevoice_asr",
        ("<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>"),
        "<|object_ref_start|> <|box_start|> <|object_ref_end|>",
        modality="audio",
        tokenizer_adds_bos=False,
    ),
}


def token_id(recipe: Recipe, token: str) -> int:
    return tiny.VOCAB_SIZE + (recipe.image_tokens + recipe.text_tokens).index(token)


def vocab_size(recipe: Recipe) -> int:
    return tiny.VOCAB_SIZE + len(recipe.image_tokens) + len(recipe.text_tokens)


CHAT_TEMPLATE = (
    "{{ bos_token }} "
    "{%- for message in messages -%}"
    "{%- if message['content'] is string -%}{{ message['content'] }} "
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' or part['type'] == 'image_url' -%}"
    "{{ placeholder }} {% else %}{{ part['text'] }} {% endif -%}"
    "{%- endfor -%}{%- endif -%}{%- endfor -%}"
)
"""`<s>`, then each message's parts in order, an image as the recipe's placeholder,
words apart (vLLM tokenizes a rendered chat without adding `<s>` itself)."""


@dataclass(frozen=True)
class Image:
    """A generated picture: `width` x `height` RGB, from `seed`."""

    width: int
    height: int
    seed: int

    def pil(self):
        import numpy as np
        from PIL import Image as PILImage

        rng = np.random.default_rng(self.seed)
        gradient = np.linspace(0, 255, self.width)[None, :, None]
        noise = rng.integers(0, 256, (self.height, self.width, 3))
        pixels = 0.5 * gradient + 0.5 * noise
        return PILImage.fromarray(pixels.astype(np.uint8), "RGB")


SAMPLE_RATE = 24000
"""VibeVoiceAsr's feature extractor's rate, at which the clips are generated."""


@dataclass(frozen=True)
class Audio:
    """A generated mono clip of `seconds` at `SAMPLE_RATE`, from `seed`: three sines
    of seeded pitch and weight, and a little noise."""

    seconds: float
    seed: int

    def waveform(self):
        import numpy as np

        rng = np.random.default_rng(self.seed)
        t = np.arange(int(self.seconds * SAMPLE_RATE)) / SAMPLE_RATE
        pitches, weights = rng.uniform(100, 2000, 3), rng.uniform(0.1, 0.5, 3)
        wave = sum(w * np.sin(2 * np.pi * f * t) for f, w in zip(pitches, weights))
        wave = wave + 0.01 * rng.standard_normal(len(t))
        return wave.astype(np.float32)


@dataclass(frozen=True)
class Request:
    """A prompt in the tiny vocabulary, with the recipe's placeholder written `{image}`
    (or `{audio}`) once per item, and its images (or audio clips)."""

    text: str
    images: tuple[Image, ...] = ()
    audios: tuple[Audio, ...] = ()

    def prompt(self, recipe: Recipe) -> str:
        return self.text.replace(f"{{{recipe.modality}}}", recipe.placeholder)


RED, WIDE, TALL = Image(32, 32, 1), Image(48, 32, 2), Image(32, 48, 3)
REQUESTS: dict[str, Request] = {
    "one image": Request("the small cat sees {image} near the river", (RED,)),
    "two images": Request(
        "{image} one two three {image} the dog", (WIDE, TALL)
    ),
    "text only": Request("today the king and the queen walks near the old city"),
}
"""Requests every family is checked on (Qwen2-VL sees the wide and tall pictures at
their own resolution; the fixed-size towers see them resized)."""

NEWLINE_REQUESTS: dict[str, Request] = {
    "newlines": Request("the small cat sees\n{image}\n\nnear the river", (RED,)),
}
"""Requests of a recipe with newline tokens: its processor's `"\n\n"` around the
image merges with the prompt's newlines (into `"\n\n\n"` before it and
`"\n\n\n\n"` after)."""

AUDIO_REQUESTS: dict[str, Request] = {
    "one audio": Request(
        "the small cat sees {audio} near the river", audios=(Audio(0.5, 1),)
    ),
    "two audios": Request(
        "{audio} one two three {audio} the dog", audios=(Audio(0.3, 2), Audio(0.8, 3))
    ),
    "text only": REQUESTS["text only"],
}
"""Requests an audio recipe is checked on (clips of 4, 3 and 6 audio tokens)."""


CLIP_32: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=2,
    image_size=32,
    patch_size=8,
    initializer_range=0.1,
)
"""A CLIP vision tower on 32 px pictures: 16 patches of 8 px and a class token."""

LLAVA_NEXT_GRIDS = [[32, 64], [64, 32], [64, 64]]
"""LLaVA-NeXT's tile grids (height, width) in pixels: 1x2, 2x1 and 2x2 tiles of
32 px."""


ONEVISION_GRIDS = [[32, 32], [32, 64], [64, 32], [64, 64]]
"""LLaVA-OneVision's tile grids (height, width) in pixels."""

ARIA_IMAGE_SIZE = 980
"""Aria's processor resizes every picture to 980 px (its image processor takes 490
too, but the processor always asks for 980): patches of 70 px keep the tiny tower
at 14 x 14 patches."""


def config(recipe: Recipe):
    """The Transformers config of `recipe`'s tiny model: its vocabulary is `tiny`'s
    words and the recipe's image tokens."""
    from transformers import AutoConfig

    tid = lambda token: token_id(recipe, token)  # noqa: E731
    text = dict(TEXT, vocab_size=vocab_size(recipe))
    if recipe.model_type == "llava":
        return AutoConfig.for_model(
            "llava",
            text_config=dict(text, model_type="llama"),
            vision_config=dict(
                model_type="clip_vision_model",
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=3,
                num_attention_heads=2,
                image_size=32,
                patch_size=8,
                initializer_range=0.1,
            ),
            image_token_id=tid("<image>"),
            projector_hidden_act="gelu",
            vision_feature_layer=-2,
            vision_feature_select_strategy="default",
        )
    if recipe.model_type == "llava_next":
        return AutoConfig.for_model(
            "llava_next",
            text_config=dict(text, model_type="llama"),
            vision_config=dict(CLIP_32, model_type="clip_vision_model"),
            image_token_id=tid("<image>"),
            image_grid_pinpoints=LLAVA_NEXT_GRIDS,
            projector_hidden_act="gelu",
            vision_feature_layer=-2,
            vision_feature_select_strategy="default",
        )
    if recipe.model_type == "llava_onevision":
        return AutoConfig.for_model(
            "llava_onevision",
            text_config=dict(text, model_type="qwen2"),
            vision_config=dict(
                CLIP_32, model_type="siglip_vision_model", num_hidden_layers=2
            ),
            image_token_index=tid("<image>"),
            video_token_index=tid("<video>"),
            image_grid_pinpoints=ONEVISION_GRIDS,
            vision_feature_select_strategy="full",
            vision_feature_layer=-1,
        )
    if recipe.model_type in ("idefics3", "smolvlm"):
        return AutoConfig.for_model(
            recipe.model_type,
            text_config=dict(text, model_type="llama"),
            vision_config=dict(
                CLIP_32,
                model_type=f"{recipe.model_type}_vision",
                num_hidden_layers=2,
            ),
            image_token_id=tid("<image>"),
            scale_factor=2,
            pad_token_id=tiny.PAD_ID,
        )
    if recipe.model_type == "glm4v":
        return AutoConfig.for_model(
            "glm4v",
            text_config=dict(
                text,
                model_type="glm4v_text",
                rope_parameters=dict(
                    rope_type="default",
                    rope_theta=10000.0,
                    partial_rotary_factor=0.5,
                    mrope_section=[2, 3, 3],
                ),
            ),
            vision_config=dict(
                depth=2,
                hidden_size=64,
                intermediate_size=128,
                num_heads=2,
                image_size=32,
                patch_size=QWEN_VL_PATCHES["patch_size"],
                spatial_merge_size=QWEN_VL_PATCHES["merge_size"],
                temporal_patch_size=QWEN_VL_PATCHES["temporal_patch_size"],
                out_hidden_size=TEXT["hidden_size"],
                initializer_range=0.1,
            ),
            image_token_id=tid("<|image|>"),
            video_token_id=tid("<|video|>"),
            image_start_token_id=tid("<|begin_of_image|>"),
            image_end_token_id=tid("<|end_of_image|>"),
            video_start_token_id=tid("<|begin_of_video|>"),
            video_end_token_id=tid("<|end_of_video|>"),
        )
    if recipe.model_type == "aya_vision":
        return AutoConfig.for_model(
            "aya_vision",
            text_config=dict(
                text,
                model_type="cohere2",
                sliding_window=8,
                layer_types=["sliding_attention", "full_attention"] * 2,
            ),
            vision_config=dict(
                CLIP_32, model_type="siglip_vision_model", num_hidden_layers=2
            ),
            image_token_index=tid("<|IMG_PATCH|>"),
            downsample_factor=2,
            tie_word_embeddings=False,
        )
    if recipe.model_type == "internvl":
        return AutoConfig.for_model(
            "internvl",
            text_config=dict(text, model_type="qwen2"),
            vision_config=dict(
                model_type="internvl_vision",
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=2,
                image_size=[32, 32],
                patch_size=[8, 8],
                initializer_range=0.1,
            ),
            image_token_id=tid("<IMG_CONTEXT>"),
            image_seq_length=4,
            downsample_ratio=0.5,
            tie_word_embeddings=False,
        )
    if recipe.model_type in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl"):
        patches = dict(
            patch_size=QWEN_VL_PATCHES["patch_size"],
            spatial_merge_size=QWEN_VL_PATCHES["merge_size"],
            temporal_patch_size=QWEN_VL_PATCHES["temporal_patch_size"],
            initializer_range=0.1,
        )
        text_extra: dict[str, Any] = {}
        if recipe.model_type == "qwen3_vl":
            # Qwen3-VL's head size defaults to 128 (its M-RoPE always interleaves
            # the sections: t, h, w, t, h, w...).
            text_extra = dict(head_dim=32)
            vision = dict(
                patches,
                depth=2,
                hidden_size=64,
                intermediate_size=128,
                num_heads=2,
                out_hidden_size=TEXT["hidden_size"],
                num_position_embeddings=64,  # an 8x8 grid, interpolated
                deepstack_visual_indexes=[0],
            )
        elif recipe.model_type == "qwen2_vl":
            vision = dict(
                patches,
                depth=2,
                embed_dim=64,
                hidden_size=TEXT["hidden_size"],
                num_heads=2,
                mlp_ratio=2,
            )
        else:
            # Windows of 32 px (2x2 merged tokens): a 48x32 picture spans two.
            vision = dict(
                patches,
                depth=2,
                hidden_size=64,
                intermediate_size=128,
                num_heads=2,
                out_hidden_size=TEXT["hidden_size"],
                window_size=32,
                fullatt_block_indexes=[1],
            )
        return AutoConfig.for_model(
            recipe.model_type,
            text_config=dict(
                text,
                model_type=f"{recipe.model_type}_text",
                rope_parameters=dict(
                    rope_type="default", rope_theta=10000.0, mrope_section=[4, 6, 6]
                ),
                **text_extra,
            ),
            vision_config=vision,
            image_token_id=tid("<|image_pad|>"),
            video_token_id=tid("<|video_pad|>"),
            vision_start_token_id=tid("<|vision_start|>"),
            vision_end_token_id=tid("<|vision_end|>"),
        )
    if recipe.model_type == "gemma3":
        return AutoConfig.for_model(
            "gemma3",
            text_config=dict(
                text,
                model_type="gemma3_text",
                head_dim=32,
                query_pre_attn_scalar=32,
                sliding_window=8,
                layer_types=["sliding_attention", "full_attention"] * 2,
            ),
            vision_config=dict(
                model_type="siglip_vision_model",
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=2,
                image_size=32,
                patch_size=8,
            ),
            mm_tokens_per_image=4,
            # Gemma 3 ties its LM head to the embeddings by default: with random
            # weights the model then only repeats its input.
            tie_word_embeddings=False,
            image_token_index=tid("<image_soft_token>"),
            boi_token_index=tid("<start_of_image>"),
            eoi_token_index=tid("<end_of_image>"),
            initializer_range=0.1,
        )
    if recipe.model_type == "aria":
        return AutoConfig.for_model(
            "aria",
            text_config=dict(
                text,
                model_type="aria_text",
                head_dim=32,
                moe_num_experts=8,
                moe_topk=2,
                intermediate_size=64,
                moe_num_shared_experts=1,
            ),
            vision_config=dict(
                model_type="idefics3_vision",
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=2,
                image_size=ARIA_IMAGE_SIZE,
                patch_size=70,
                initializer_range=0.1,
            ),
            projector_patch_to_query_dict={(ARIA_IMAGE_SIZE // 70) ** 2: 8},
            image_token_index=tid("<|img|>"),
            initializer_range=0.1,
        )
    if recipe.model_type == "emu3":
        return AutoConfig.for_model(
            "emu3",
            text_config=text,
            vocabulary_map={token: tid(token) for token in recipe.image_tokens},
            vq_config=dict(
                codebook_size=32,
                embed_dim=4,
                latent_channels=4,
                base_channels=32,  # GroupNorm's 32 groups
                channel_multiplier=[1, 1, 1, 1],  # 8 px per image token
                num_res_blocks=1,
                attn_resolutions=[],
                hidden_size=32,
                num_attention_heads=1,
            ),
        )
    if recipe.model_type == "vibevoice_asr":
        # Small encoders, every stage kept (hop length 3200); `vae_std` 0: Transformers'
        # `get_audio_features` adds `vae_std` x normal noise to the acoustic latents,
        # which would make two runs differ.
        encoder = dict(hidden_size=16, num_filters=4, depths=[1] * 7, vae_std=0.0)
        return AutoConfig.for_model(
            "vibevoice_asr",
            acoustic_tokenizer_encoder_config=encoder,
            semantic_tokenizer_encoder_config=dict(encoder, hidden_size=8),
            text_config=dict(text, model_type="qwen2"),
            audio_token_id=tid("<|box_start|>"),
            audio_bos_token_id=tid("<|object_ref_start|>"),
            audio_eos_token_id=tid("<|object_ref_end|>"),
            # At most 32 audio tokens per clip (its `max_position_embeddings`).
            acoustic_tokenizer_chunk_size=3200 * 32,
        )
    raise KeyError(recipe.model_type)


TOKENIZER_NAMES: dict[str, dict[str, str]] = {
    "aria": {"image_token": "<|img|>"},
    "gemma3": {
        "boi_token": "<start_of_image>",
        "eoi_token": "<end_of_image>",
        "image_token": "<image_soft_token>",
    },
    "internvl": {
        "start_image_token": "<img>",
        "end_image_token": "</img>",
        "context_image_token": "<IMG_CONTEXT>",
        "video_token": "<video>",
    },
    "emu3": {
        "image_token": "<image>",
        "boi_token": "<|image start|>",
        "eoi_token": "<|image end|>",
        "image_wrapper_token": "<|image token|>",
        "eof_token": "<|extra_201|>",
    },
}


def make_tokenizer(recipe: Recipe):
    """`tiny`'s word-level tokenizer with the recipe's image tokens as special tokens
    and its text tokens as plain ones (ids in `token_id` order), named as the model's
    processor looks them up."""
    from tokenizers import AddedToken, decoders, processors

    tokenizer = tiny.make_tokenizer()
    if not recipe.tokenizer_adds_bos:
        tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
            single="$A", pair="$A $B"
        )
    tokenizer.add_special_tokens(
        {"additional_special_tokens": list(recipe.image_tokens)}
    )
    if recipe.text_tokens:
        tokenizer.add_tokens(
            [AddedToken(t, normalized=False, special=False) for t in recipe.text_tokens]
        )
        # Words come back with a space between them, newlines without one: the
        # text decodes as it encodes (a newline beside another merges again).
        tokenizer.backend_tokenizer.decoder = decoders.Sequence(
            [decoders.WordPiece(prefix="##", cleanup=False), decoders.Replace(" \n", "\n")]
        )
    for token in recipe.image_tokens + recipe.text_tokens:
        assert tokenizer.convert_tokens_to_ids(token) == token_id(recipe, token)
    # Gemma 3's and Emu3's processors read these names off their tokenizer.
    names = TOKENIZER_NAMES.get(recipe.model_type)
    if names is not None:
        tokenizer._set_model_specific_special_tokens(names)
    template = CHAT_TEMPLATE.replace("{{ placeholder }}", recipe.placeholder)
    tokenizer.chat_template = template
    return tokenizer


def without_video(cls):
    """Processor class `cls` built and loaded without its video processor (which
    needs torchvision here): Transformers takes a processor's sub-processors from
    `get_attributes()`; the rest of the class is unchanged."""
    attributes = [a for a in cls.get_attributes() if a != "video_processor"]
    return type(
        cls.__name__,
        (cls,),
        {"get_attributes": classmethod(lambda _: list(attributes))},
    )


def processor_class(recipe: Recipe):
    """The Transformers processor class of `recipe`, as it can be built here."""
    import transformers as t

    cls = dict(
        llava=t.LlavaProcessor,
        llava_next=t.LlavaNextProcessor,
        llava_onevision=t.LlavaOnevisionProcessor,
        idefics3=t.Idefics3Processor,
        smolvlm=t.SmolVLMProcessor,
        glm4v=t.Glm4vProcessor,
        aya_vision=t.AyaVisionProcessor,
        internvl=t.InternVLProcessor,
        gemma3=t.Gemma3Processor,
        aria=t.AriaProcessor,
        emu3=t.Emu3Processor,
        qwen2_vl=t.Qwen2VLProcessor,
        qwen2_5_vl=t.Qwen2_5_VLProcessor,
        qwen3_vl=t.Qwen3VLProcessor,
        vibevoice_asr=t.VibeVoiceAsrProcessor,
    )[recipe.model_type]
    return without_video(cls) if recipe.video_processor is not None else cls


def make_processor(recipe: Recipe, tokenizer):
    """The family's Transformers processor around its PIL image processor."""
    import transformers as t

    template = tokenizer.chat_template
    if recipe.model_type in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl"):
        # Images of 32x32 to 64x64 px keep their size (multiples of 16 px).
        images = t.Qwen2VLImageProcessorPil(
            **QWEN_VL_PATCHES, min_pixels=32 * 32, max_pixels=64 * 64
        )
        return processor_class(recipe)(
            image_processor=images, tokenizer=tokenizer, chat_template=template
        )
    if recipe.model_type == "llava":
        images = t.CLIPImageProcessorPil(
            size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}
        )
        return t.LlavaProcessor(
            image_processor=images,
            tokenizer=tokenizer,
            patch_size=8,
            vision_feature_select_strategy="default",
            num_additional_image_tokens=1,
            chat_template=template,
        )
    if recipe.model_type == "llava_next":
        images = t.LlavaNextImageProcessorPil(
            size={"shortest_edge": 32},
            crop_size={"height": 32, "width": 32},
            image_grid_pinpoints=LLAVA_NEXT_GRIDS,
        )
        return t.LlavaNextProcessor(
            image_processor=images,
            tokenizer=tokenizer,
            patch_size=8,
            vision_feature_select_strategy="default",
            num_additional_image_tokens=1,
            chat_template=template,
        )
    if recipe.model_type == "llava_onevision":
        images = t.LlavaOnevisionImageProcessorPil(
            size={"height": 32, "width": 32}, image_grid_pinpoints=ONEVISION_GRIDS
        )
        return processor_class(recipe)(
            image_processor=images,
            tokenizer=tokenizer,
            num_image_tokens=16,
            vision_feature_select_strategy="full",
            chat_template=template,
        )
    if recipe.model_type == "glm4v":
        images = t.Glm4vImageProcessorPil(
            **QWEN_VL_PATCHES,
            size={"shortest_edge": 32 * 32, "longest_edge": 64 * 64},
        )
        return processor_class(recipe)(
            image_processor=images, tokenizer=tokenizer, chat_template=template
        )
    if recipe.model_type in ("idefics3", "smolvlm"):
        pil = dict(
            idefics3=t.Idefics3ImageProcessorPil, smolvlm=t.SmolVLMImageProcessorPil
        )[recipe.model_type]
        images = pil(
            size={"longest_edge": 64},
            max_image_size={"longest_edge": 32},
            do_image_splitting=True,
        )
        cls = processor_class(recipe)
        if recipe.video_processor is not None:
            # Built without one: SmolVLM's `__init__` takes it by position.
            cls = functools.partial(cls, video_processor=None)
        return cls(
            image_processor=images,
            tokenizer=tokenizer,
            image_seq_len=4,
            chat_template=template,
        )
    if recipe.model_type in ("aya_vision", "internvl"):
        # A 32 px thumbnail, and up to 4 tiles of 32 px when the picture is not
        # square (GOT-OCR2's image processor).
        images = t.GotOcr2ImageProcessorPil(
            size={"height": 32, "width": 32},
            crop_to_patches=True,
            min_patches=1,
            max_patches=4,
        )
        if recipe.model_type == "internvl":
            return processor_class(recipe)(
                image_processor=images,
                tokenizer=tokenizer,
                image_seq_length=4,
                chat_template=template,
            )
        return t.AyaVisionProcessor(
            image_processor=images,
            tokenizer=tokenizer,
            patch_size=16,  # 8 px patches, pixel-shuffled 2x2
            img_size=32,
            chat_template=template,
        )
    if recipe.model_type == "gemma3":
        images = t.Gemma3ImageProcessorPil(size={"height": 32, "width": 32})
        return t.Gemma3Processor(
            image_processor=images,
            tokenizer=tokenizer,
            image_seq_length=4,
            chat_template=template,
        )
    if recipe.model_type == "aria":
        images = t.AriaImageProcessorPil(max_image_size=ARIA_IMAGE_SIZE)
        return t.AriaProcessor(
            image_processor=images,
            tokenizer=tokenizer,
            size_conversion={ARIA_IMAGE_SIZE: 8},
            chat_template=template,
        )
    if recipe.model_type == "emu3":
        # Emu3's image processor is numpy/PIL-based already (no torchvision).
        images = t.Emu3ImageProcessor(
            min_pixels=32 * 32, max_pixels=32 * 32, spatial_factor=8
        )
        return t.Emu3Processor(
            image_processor=images, tokenizer=tokenizer, chat_template=template
        )
    if recipe.model_type == "vibevoice_asr":
        # The feature extractor's defaults: 24 kHz, padded to its hop of 3200 samples.
        audio = t.VibeVoiceAcousticTokenizerFeatureExtractor()
        return t.VibeVoiceAsrProcessor(
            feature_extractor=audio, tokenizer=tokenizer, chat_template=template
        )
    raise KeyError(recipe.model_type)


def requests(recipe: Recipe) -> dict[str, Request]:
    """The requests the recipe is checked on: all of its modality's, and those
    with newlines where its tokenizer has newline tokens."""
    if recipe.modality == "audio":
        return dict(AUDIO_REQUESTS)
    return {**REQUESTS, **(NEWLINE_REQUESTS if recipe.text_tokens else {})}


def fingerprint(name: str) -> str:
    recipe = RECIPES[name]
    data = dict(
        version=RECIPE_VERSION,
        recipe=asdict(recipe),
        config=config(recipe).to_json_string(use_diff=False),
        requests={k: asdict(r) for k, r in requests(recipe).items()},
        vocab=tiny.VOCAB,
        max_tokens=MAX_TOKENS,
        min_distinct=MIN_DISTINCT,
        template=CHAT_TEMPLATE,
    )
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def _random_model(recipe: Recipe, seed: int):
    import torch
    from transformers import AutoModelForMultimodalLM, GenerationConfig

    model_config = config(recipe)
    model_config.dtype = torch.float32
    torch.manual_seed(seed)
    model = AutoModelForMultimodalLM.from_config(
        model_config, dtype=torch.float32, attn_implementation="eager"
    )
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for _, param in sorted(model.named_parameters()):
            if param.ndim == 1:
                param.add_(torch.randn(param.shape, generator=generator) * 0.1)
        model.get_output_embeddings().weight.mul_(2.0)
    model.generation_config = GenerationConfig(
        do_sample=False,
        bos_token_id=tiny.BOS_ID,
        pad_token_id=tiny.PAD_ID,
        eos_token_id=None,
        max_new_tokens=MAX_TOKENS,
    )
    return model.eval()


@dataclass
class Completion:
    """Greedy continuation of one request."""

    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    margins: list[float] = field(default_factory=list)
    text: str = ""


def greedy(
    model,
    processor,
    recipe: Recipe,
    requests: list[Request],
) -> list[Completion]:
    """Transformers' greedy `generate` on each request (its processor's inputs)."""
    import torch

    completions = []
    for request in requests:
        media: dict[str, Any] = {}
        if request.images:
            media["images"] = [i.pil() for i in request.images]
        if request.audios:
            media["audio"] = [a.waveform() for a in request.audios]
        inputs = processor(text=request.prompt(recipe), return_tensors="pt", **media)
        with torch.no_grad():
            out = model.generate(
                **inputs,
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=tiny.PAD_ID,
                output_logits=True,
                return_dict_in_generate=True,
            )
        prompt_ids = inputs["input_ids"][0].tolist()
        token_ids = out.sequences[0, len(prompt_ids) :].tolist()
        logprobs, margins = [], []
        for token, logits in zip(token_ids, out.logits):
            logits = logits[0].float()
            assert int(torch.argmax(logits)) == token
            logprobs.append(torch.log_softmax(logits, dim=-1)[token].item())
            top2 = torch.topk(logits, 2).values
            margins.append((top2[0] - top2[1]).item())
        completions.append(Completion(prompt_ids, token_ids, logprobs, margins))
    return completions


def build(name: str) -> Path:
    """Build (or reuse) the tiny checkpoint folder of recipe `name`, with its
    processor files; seeds are tried until every greedy step of its requests keeps a
    top-1/top-2 logit gap of `MIN_MARGIN` and every continuation has `MIN_DISTINCT`
    tokens."""
    recipe = RECIPES[name]
    target = tiny.CACHE / f"mm-{name}"
    stamp = target / "tiny.json"
    want = fingerprint(name)
    if stamp.is_file() and json.loads(stamp.read_text()).get("fingerprint") == want:
        return target
    tiny._quiet_transformers()
    processor = make_processor(recipe, make_tokenizer(recipe))
    checked = list(requests(recipe).values())
    best = (float("-inf"), None)
    first = FIRST_GOOD_SEED.get(name, tiny.SEED)
    for seed in range(first, first + MAX_SEED_TRIES):
        model = _random_model(recipe, seed)
        completions = greedy(model, processor, recipe, checked)
        margin = min(min(c.margins) for c in completions)
        varied = all(len(set(c.token_ids)) >= MIN_DISTINCT for c in completions)
        best = max(best, (margin, seed), key=lambda b: b[0])
        if margin >= MIN_MARGIN and varied:
            break
    else:
        raise RuntimeError(
            f"{name}: no seed gives a margin of {MIN_MARGIN} and {MIN_DISTINCT} "
            f"distinct tokens per continuation (best margin {best})"
        )
    tiny.CACHE.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".mm-{name}-", dir=tiny.CACHE))
    try:
        model.save_pretrained(staging, safe_serialization=True)
        # A fresh processor: calling one can leave its tokenizer's padding on (the
        # VibeVoiceAsr processor pads), which would be saved and change later calls.
        make_processor(recipe, make_tokenizer(recipe)).save_pretrained(staging)
        if recipe.video_processor is not None:
            saved = staging / "processor_config.json"
            data = json.loads(saved.read_text())
            data["video_processor"] = recipe.video_processor
            saved.write_text(json.dumps(data, indent=2))
        (staging / "tiny.json").write_text(
            json.dumps(dict(fingerprint=want, seed=seed, min_margin=margin), indent=2)
        )
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def reference(
    path: Path,
    name: str,
    requests: list[Request],
    lora: Path | None = None,
) -> list[Completion]:
    """Transformers' greedy generation in float32 (eager attention) from the saved
    checkpoint and processor, with the PEFT adapter `lora` applied where given."""
    import torch
    from transformers import AutoModelForMultimodalLM, AutoProcessor

    tiny._quiet_transformers()
    recipe = RECIPES[name]
    # A processor that cannot load its video processor here is loaded without it.
    loader = processor_class(recipe) if recipe.video_processor else AutoProcessor
    processor = loader.from_pretrained(str(path))
    model = AutoModelForMultimodalLM.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    if lora is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(lora)).eval()
    completions = greedy(model, processor, recipe, requests)
    tokenizer = getattr(processor, "tokenizer", processor)
    for c in completions:
        c.text = tiny.continuation_text(tokenizer, c.prompt_ids, c.token_ids)
    return completions


# --- vLLM engine, in a fresh interpreter --------------------------------------------


@dataclass
class MultiModalRun:
    completions: list[Completion]
    seconds: float
    log: str
    report: str | None = None
    """The fusion report's text, read inside the worker."""
    compiled: bool = False
    """Whether vLLM's torch.compile wrapper compiled a module of the model."""


def run_engine(
    path: Path,
    name: str,
    requests: list[Request],
    *,
    backend: str = "project",
    llm_kwargs: dict[str, Any] | None = None,
    timeout: float = 600,
    lora: Path | None = None,
    extra_env: dict[str, str] | None = None,
) -> MultiModalRun:
    """Start `vllm.LLM` on the checkpoint in a subprocess and generate greedily for
    each request (its text through the engine's tokenizer, its images as PIL, its
    audio clips as (waveform, sample rate)); with the PEFT adapter `lora` on every
    request where given. `extra_env` is added to the engine's environment."""
    recipe = RECIPES[name]
    spec = dict(
        model=str(path),
        requests=[
            dict(
                prompt=recipe.engine_prefix + r.prompt(recipe),
                images=[asdict(i) for i in r.images],
                audios=[asdict(a) for a in r.audios],
            )
            for r in requests
        ],
        llm_kwargs=llm_kwargs or {},
        lora=None if lora is None else str(lora),
    )
    env = dict(os.environ)
    env["VLLM_TRANSFORMERS_BACKEND"] = backend
    env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    env.setdefault("VLLM_LOGGING_LEVEL", "INFO")
    here = str(Path(__file__).resolve().parent)
    env["PYTHONPATH"] = os.pathsep.join([here, *filter(None, [env.get("PYTHONPATH")])])
    env.pop("PYTEST_CURRENT_TEST", None)
    env.update(extra_env or {})
    out, seconds, log = tiny.run_engine_script(__file__, spec, env, timeout)
    return MultiModalRun(
        [Completion(**c) for c in out["completions"]],
        seconds,
        log,
        out["report"],
        out["compiled"],
    )


def _report(model) -> str | None:
    """The backend's one-line fusion report, inside the worker (none for stock)."""
    report = getattr(model, "report", None)
    return report.short() if report is not None else None


def _compiled(model) -> bool:
    """Inside the worker: whether vLLM's torch.compile wrapper compiled a module of
    the model (it marks the module it compiled)."""
    return any(getattr(module, "compiled", False) is True for module in model.modules())


def _engine_main(spec_file: str, out_file: str) -> None:
    spec = json.loads(Path(spec_file).read_text())
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    kwargs = dict(
        model=spec["model"],
        model_impl="transformers",
        dtype="float32",
        seed=0,
        max_model_len=MAX_MODEL_LEN,
        kv_cache_memory_bytes=1 << 30,
        enforce_eager=True,
        enable_lora=spec["lora"] is not None,
    )
    kwargs.update(spec["llm_kwargs"])
    llm = LLM(**kwargs)
    lora = LoRARequest("adapter", 1, spec["lora"]) if spec["lora"] else None
    params = SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1
    )
    prompts = []
    for request in spec["requests"]:
        prompt: dict[str, Any] = dict(prompt=request["prompt"])
        media: dict[str, Any] = {}
        if request["images"]:
            media["image"] = [Image(**i).pil() for i in request["images"]]
        if request["audios"]:
            media["audio"] = [
                (Audio(**a).waveform(), SAMPLE_RATE) for a in request["audios"]
            ]
        if media:
            prompt["multi_modal_data"] = media
        prompts.append(prompt)
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=lora)
    completions = []
    for output in outputs:
        sample = output.outputs[0]
        token_ids = list(sample.token_ids)
        logprobs = [step[t].logprob for t, step in zip(token_ids, sample.logprobs)]
        completions.append(
            asdict(
                Completion(
                    list(output.prompt_token_ids), token_ids, logprobs, text=sample.text
                )
            )
        )
    import tiny_multimodal  # importable in every engine process (PYTHONPATH)

    # One answer per worker (tensor parallel): the report is the first rank's.
    report = llm.apply_model(tiny_multimodal._report)[0]
    compiled = all(llm.apply_model(tiny_multimodal._compiled))
    Path(out_file).write_text(
        json.dumps(dict(completions=completions, report=report, compiled=compiled))
    )
    del llm


if __name__ == "__main__":
    if sys.argv[1:2] != ["engine"]:
        raise SystemExit(__doc__)
    _engine_main(*sys.argv[2:4])
