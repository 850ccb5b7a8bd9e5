# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""How image tokens attend (`image_attention.py`): read from the model's own mask,
checked against what vLLM's attention layers compute, images refused at start-up
where the two differ. No engine: the backend built on the CPU as vLLM builds it
(`test_multimodal.py` serves Gemma 3's text on the engine)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tiny  # noqa: E402
import tiny_multimodal  # noqa: E402

from vllm.model_executor.models.transformers import image_attention  # noqa: E402
from vllm.model_executor.models.transformers.image_attention import (  # noqa: E402
    WITHIN_IMAGES,
    attends_later,
)
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend  # noqa: E402


def _config(name: str, **attributes):
    config = tiny_multimodal.config(tiny_multimodal.RECIPES[name])
    config.architectures = [
        type(config).__name__.replace("Config", "ForConditionalGeneration")
    ]
    for key, value in attributes.items():
        setattr(config, key, value)
    return config


def _paligemma_config():
    """PaliGemma: its mask lets the whole prompt (the images and the text given
    with them) attend both ways, a prefix-LM."""
    from transformers import AutoConfig

    return AutoConfig.for_model(
        "paligemma",
        architectures=["PaliGemmaForConditionalGeneration"],
        text_config=dict(
            tiny_multimodal.TEXT,
            model_type="gemma",
            vocab_size=tiny.VOCAB_SIZE + 1,
            head_dim=32,
        ),
        vision_config=dict(tiny_multimodal.CLIP_32, model_type="siglip_vision_model"),
        image_token_index=tiny.VOCAB_SIZE,
        projection_dim=128,
        hidden_size=128,
    )


@pytest.fixture
def prefix_lm_backend(monkeypatch):
    """vLLM's CPU attention backend as if it computed image tokens both ways, as
    vLLM's GPU backends do (FlashAttention, Triton, FlexAttention)."""
    monkeypatch.setattr(
        CPUAttentionBackend, "supports_mm_prefix", classmethod(lambda cls: True)
    )


def _build(build_backend, config):
    return build_backend(config, backend_class="TransformersMultiModalForCausalLM")


def test_model_mask_is_read_from_its_own_code():
    """Gemma 3's mask (its `create_masks_for_generate`, given token types 1 for
    image tokens) lets each image's tokens attend to each other both ways, and
    nothing else attend forward; LLaVA's and Qwen2-VL's are causal."""
    from transformers import (
        Gemma3ForConditionalGeneration,
        LlavaForConditionalGeneration,
        Qwen2VLForConditionalGeneration,
    )

    for cls, name, want in (
        (Gemma3ForConditionalGeneration, "gemma3", WITHIN_IMAGES),
        (LlavaForConditionalGeneration, "llava", set()),
        (Qwen2VLForConditionalGeneration, "qwen2_vl", set()),
    ):
        assert attends_later(cls, _config(name)) == want, name
    assert WITHIN_IMAGES == {(1, 2), (1, 3), (2, 3), (5, 6)}


def test_image_tokens_attending_both_ways_are_refused_on_the_cpu_engine(
    build_backend,
):
    """Gemma 3 on vLLM's CPU attention, which attends causally only: images are
    refused at start-up, saying which mask, which layers and backend, and what
    serves the model (a text-only engine; a backend that computes it). It was
    served, its image tokens attending causally: log-probabilities 0.79 off
    Transformers' on the tiny Gemma 3, greedy tokens apart at the fourth step
    (vLLM's native Gemma 3 does the same on this engine, unrefused)."""
    with pytest.raises(ValueError) as error:
        _build(build_backend, _config("gemma3"))
    message = str(error.value)
    assert message.startswith(
        "Gemma3ForConditionalGeneration: its mask (Gemma3ForConditionalGeneration."
        "create_masks_for_generate) lets the tokens of one image attend to each "
        "other both ways, and vLLM's CPU_ATTN attention backend does not compute it"
    )
    assert "model.language_model.layers.0.self_attn.attn" in message
    assert (
        "on CPU_ATTN would attend to them causally, which is not the model" in message
    )
    assert "limit_mm_per_prompt={'image': 0}" in message


def test_image_tokens_attending_both_ways_are_served_where_vllm_computes_it(
    build_backend, prefix_lm_backend, monkeypatch
):
    """Near miss: an attention backend that computes each image's tokens both
    ways (`supports_mm_prefix()`), with vLLM serving Gemma 3 as a multimodal
    prefix-LM (its model type): built, saying so."""
    said: list[str] = []
    monkeypatch.setattr(
        image_attention.logger,
        "info",
        lambda message, *args: said.append(message % args),
    )
    model = _build(build_backend, _config("gemma3"))
    assert model.report.servable
    assert any(
        line.startswith(
            "Image tokens attend to each other both ways within each "
            "image (Gemma3ForConditionalGeneration.create_masks_for_generate)"
        )
        for line in said
    )


@pytest.mark.parametrize(
    "name, attributes, why",
    [
        (
            "gemma3",
            dict(is_mm_prefix_lm=False),
            "vLLM does not serve this model as a multimodal prefix-LM",
        ),
        (
            "llava",
            dict(is_mm_prefix_lm=True),
            "lets image tokens attend causally, while vLLM's attention layers",
        ),
        ("paligemma", {}, "lets tokens attend to later ones beyond the tokens of one"),
    ],
)
def test_image_attention_vllm_would_compute_otherwise_is_refused(
    build_backend, prefix_lm_backend, name, attributes, why
):
    """On a backend that computes image tokens both ways: Gemma 3 with a config
    that tells vLLM it is no prefix-LM (vLLM would attend causally); LLaVA, whose
    mask is causal, with a config that tells vLLM it is one (vLLM would attend both
    ways); PaliGemma, whose whole prompt attends both ways (vLLM can do images
    only). Each refused, naming why."""
    config = _paligemma_config() if name == "paligemma" else _config(name)
    for key, value in attributes.items():
        setattr(config, key, value)
    with pytest.raises(ValueError, match="Images are refused") as error:
        _build(build_backend, config)
    assert why in str(error.value)
