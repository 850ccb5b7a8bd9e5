# SPDX-License-Identifier: Apache-2.0
"""Building the backend on the CPU from a config: what it attaches, and what it refuses."""

import pytest
from transformers.models.llama import modeling_llama

from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

from configs import small_config


def test_each_layer_gets_vllm_attention_as_attn(build_backend):
    model = build_backend(small_config("llama", num_hidden_layers=3))
    for index, layer in enumerate(model.model.layers):
        attn = layer.self_attn.attn
        assert isinstance(attn, Attention)
        assert attn.layer_name == f"model.layers.{index}.self_attn.attn"
        assert attn.impl.scale == pytest.approx(32**-0.5)
    # In the module tree, so `named_modules()` and weight post-processing find it.
    assert "model.layers.2.self_attn.attn" in dict(model.named_modules())
    assert isinstance(model.model.embed_tokens, VocabParallelEmbedding)


def test_sliding_window_and_soft_cap_follow_the_config(build_backend):
    config = small_config(
        "gemma2",
        num_hidden_layers=4,
        head_dim=32,
        sliding_window=16,
        attn_logit_softcapping=30.0,
        layer_types=["sliding_attention", "full_attention"] * 2,
    )
    model = build_backend(config)
    windows = [layer.self_attn.attn.sliding_window for layer in model.model.layers]
    assert windows == [16, None, 16, None]
    caps = {layer.self_attn.attn.impl.logits_soft_cap for layer in model.model.layers}
    assert caps == {30.0}


def test_decoder_layer_without_dispatch_is_an_error_naming_module_and_layer(
    build_backend,
):
    # vLLM's registry refuses bloom before the backend runs (DESIGN §6), so the
    # parsed config is swapped in after vLLM's own checks.
    bloom = small_config("bloom", n_layer=2, n_head=4, hidden_size=128)
    with pytest.raises(ValueError) as error:
        build_backend(small_config("llama"), served_config=bloom)
    message = str(error.value)
    assert "Decoder layer 0" in message
    assert "model.h.0.self_attention (BloomAttention)" in message
    assert "attention interface" in message


def test_two_modules_claiming_one_layer_index_is_an_error(build_backend, monkeypatch):
    original_init = modeling_llama.LlamaAttention.__init__

    def every_layer_claims_zero(self, config, layer_idx):
        original_init(self, config, 0)

    monkeypatch.setattr(
        modeling_llama.LlamaAttention, "__init__", every_layer_claims_zero
    )
    with pytest.raises(ValueError) as error:
        build_backend(small_config("llama"))
    message = str(error.value)
    assert "model.layers.1.self_attn (LlamaAttention)" in message
    assert "model.layers.0.self_attn (LlamaAttention)" in message
    assert "layer_idx=0" in message


@pytest.mark.parametrize(
    "backend_class",
    [
        "TransformersMoEForCausalLM",
        "TransformersMultiModalForCausalLM",
        "TransformersEmbeddingModel",
        "TransformersForSequenceClassification",
    ],
)
def test_other_backend_classes_say_not_supported_and_name_the_switch(
    build_backend, backend_class
):
    with pytest.raises(NotImplementedError, match="VLLM_TRANSFORMERS_BACKEND=stock"):
        build_backend(small_config("llama"), backend_class=backend_class)
