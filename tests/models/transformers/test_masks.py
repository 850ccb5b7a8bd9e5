# SPDX-License-Identifier: Apache-2.0
"""The window each decoder layer's mask applies, read from the model's own forward
(`masks.py`), and the window vLLM's attention is built with checked against it
(`attention_bridge.sliding_window`)."""

import pytest
import torch
from configs import small_config
from near_miss import NarrowMask, OwnMask
from transformers import AutoModel
from transformers.masking_utils import create_sliding_window_causal_mask

import vllm.model_executor.models.transformers  # noqa: F401 - registers "vllm"
from vllm.model_executor.models.transformers.attention_bridge import (
    AttentionSite,
    sliding_window,
)
from vllm.model_executor.models.transformers.plan import get_fuser
from vllm.model_executor.models.transformers.fusers import AttentionFuser
from vllm.model_executor.models.transformers.masks import (
    LayerMask,
    Unread,
    read_layer_masks,
)


def meta_model(model_type: str, cls: type | None = None, **overrides):
    config = small_config(model_type, num_hidden_layers=2, **overrides)
    config._attn_implementation = "vllm"
    with torch.device("meta"):
        return cls(config) if cls else AutoModel.from_config(config)


def windows(model) -> list[int | None]:
    masks = read_layer_masks(model, model.layers)
    assert all(isinstance(m, LayerMask) for m in masks.values()), masks
    return [masks[i].window for i in range(len(model.layers))]


@pytest.mark.parametrize(
    ("model_type", "overrides", "expected"),
    [
        # Mistral and PhiMoE slide every layer whenever the config sets a window.
        ("mistral", dict(sliding_window=8), [8, 8]),
        ("phimoe", dict(sliding_window=8), [8, 8]),
        ("phimoe", dict(sliding_window=None), [None, None]),
        # Llama's mask never slides, whatever the config holds.
        ("llama", dict(sliding_window=8), [None, None]),
        # Each layer the mask its `layer_types` entry names.
        (
            "gemma2",
            dict(sliding_window=8, layer_types=["full_attention", "sliding_attention"]),
            [None, 8],
        ),
    ],
)
def test_the_window_each_layers_mask_applies_is_read_from_the_forward(
    model_type, overrides, expected
):
    assert windows(meta_model(model_type, **overrides)) == expected


def narrow_model():
    return meta_model("phimoe", cls=NarrowMask, sliding_window=8)


def test_a_mask_made_with_another_config_is_read_with_that_configs_window():
    model = narrow_model()
    masks = read_layer_masks(model, model.layers)
    assert [m.window for m in masks.values()] == [4, 4]
    assert masks[0].made_by.startswith(
        "create_sliding_window_causal_mask (config.sliding_window=4) at "
    )
    assert "near_miss.py:" in masks[0].made_by  # the call in NarrowMask.forward


def test_a_mask_the_model_builds_itself_is_not_read_and_says_why():
    model = meta_model("phimoe", cls=OwnMask, sliding_window=8)
    masks = read_layer_masks(model, model.layers)
    assert all(isinstance(m, Unread) for m in masks.values())
    assert "a mask the model builds itself (Tensor)" in masks[0].reason


def test_reading_leaves_the_model_as_it_was():
    model = meta_model("mistral", sliding_window=8)
    read_layer_masks(model, model.layers)
    assert all("forward" not in vars(layer) for layer in model.layers)
    from transformers.models.mistral import modeling_mistral

    assert (
        modeling_mistral.create_sliding_window_causal_mask
        is create_sliding_window_causal_mask
    )


def site(model, index: int = 0) -> AttentionSite:
    module = model.layers[index].self_attn
    needs = get_fuser(module, AttentionFuser).attention_needs(module, None)
    return AttentionSite(f"model.layers.{index}.self_attn", module, needs, {})


@pytest.fixture
def engine_window(vllm_config, monkeypatch):
    """The model-wide window vLLM's engine sets from the config (no layer_types)."""

    def set_window(window: int | None):
        monkeypatch.setattr(vllm_config.cache_config, "sliding_window", window)
        return vllm_config

    return set_window


def test_vllm_is_given_the_window_the_mask_applies_not_the_configs(engine_window):
    # PhiMoE's attention names no window: vLLM would take the config's 8.
    model = narrow_model()
    mask = read_layer_masks(model, model.layers)[0]
    window, made_by = sliding_window(site(model), mask, engine_window(8))
    assert (window, made_by) == (4, mask.made_by)


def test_a_call_window_the_mask_does_not_apply_is_refused(engine_window):
    # Mistral passes `sliding_window=config.sliding_window` to its attention.
    model = meta_model("mistral", sliding_window=8)
    narrow = LayerMask(window=4, made_by="create_sliding_window_causal_mask (x)")
    with pytest.raises(ValueError) as error:
        sliding_window(site(model), narrow, engine_window(8))
    assert str(error.value).startswith(
        "model.layers.0.self_attn (MistralAttention, layer 0): vLLM's attention "
        "would apply a sliding window of 8 (the window its attention call or "
        "config.layer_types gives it), but the model's mask applies a sliding "
        "window of 4 there (create_sliding_window_causal_mask (x))."
    )


def test_a_mask_that_cannot_be_read_is_refused_only_where_vllm_would_slide(
    engine_window,
):
    model = meta_model("phimoe", cls=OwnMask, sliding_window=8)
    unread = read_layer_masks(model, model.layers)[0]
    window, made_by = sliding_window(site(model), unread, engine_window(None))
    assert window is None and made_by.startswith("not read: the layer is handed")
    with pytest.raises(ValueError, match=r"the window the model's mask applies cannot"):
        sliding_window(site(model), unread, engine_window(8))


def test_attention_in_chunks_is_refused_naming_the_mask(engine_window):
    model = meta_model("phimoe", sliding_window=None)
    chunked = LayerMask(None, "create_chunked_causal_mask at x.py:1", chunked=True)
    with pytest.raises(ValueError, match=r"applies attention in chunks there"):
        sliding_window(site(model), chunked, engine_window(None))
