# SPDX-License-Identifier: Apache-2.0
"""Hybrid models: vLLM routes them to the hybrid class (through the overlay's one
replaced function), which tells vLLM about the mixers' state before the model is
built and puts each Mamba-2 mixer on vLLM's `MambaMixer2`."""

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
from configs import small_config

from vllm.config import ModelConfig
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.models.transformers.report import coverage_row

HYBRID = dict(
    layer_types=["linear_attention", "full_attention"],
    mamba_n_heads=8,
    mamba_d_head=32,
    mamba_d_state=16,
    num_local_experts=4,
    intermediate_size=64,
)


def granite_hybrid(**changes):
    return small_config("granitemoehybrid", **{**HYBRID, **changes})


def model_config(config, tmp_path) -> ModelConfig:
    config.save_pretrained(tmp_path)
    return ModelConfig(
        model=str(tmp_path), model_impl="transformers", skip_tokenizer_init=True
    )


def test_a_hybrid_config_reaches_the_hybrid_class_and_vllm_inspects_it(tmp_path):
    # vLLM's registry inspects the class in a subprocess: it must import there
    # and say it is hybrid, or vLLM allocates no state cache.
    served = model_config(granite_hybrid(), tmp_path)
    assert served.architecture == "TransformersHybridMoEForCausalLM"
    assert served.is_hybrid and served.has_inner_state


@pytest.mark.parametrize(
    "original, layer_types, expected",
    [
        ("TransformersMoEForCausalLM", ["linear_attention"], "TransformersHybridMoEForCausalLM"),
        ("TransformersForCausalLM", ["full_attention", "conv"], "TransformersHybridForCausalLM"),
        ("TransformersForCausalLM", ["full_attention", "mlp"], "TransformersForCausalLM"),
        ("TransformersMultiModalForCausalLM", ["linear_attention"], "TransformersMultiModalForCausalLM"),
        ("TransformersEmbeddingModel", ["linear_attention"], "TransformersEmbeddingModel"),
    ],
)  # fmt: skip
def test_only_a_causal_lm_keeping_recurrent_state_gets_the_hybrid_name(
    original, layer_types, expected
):
    from vllm_transformers_overlay.routing import hybrid_aware

    name = hybrid_aware(lambda self: original)
    config = SimpleNamespace(hf_text_config=SimpleNamespace(layer_types=layer_types))
    assert name(config) == expected


def test_stock_keeps_vllms_own_function():
    code = (
        "from vllm.config.model import ModelConfig\n"
        "print(hasattr(ModelConfig._get_transformers_backend_cls, 'replaced'))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "VLLM_TRANSFORMERS_BACKEND": "stock"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-1] == "False"


def test_another_vllm_version_keeps_the_original_and_says_so(monkeypatch):
    import vllm
    from vllm_transformers_overlay import routing

    def original(self) -> str:
        return "TransformersForCausalLM"

    module = SimpleNamespace(
        ModelConfig=type("ModelConfig", (), {"_get_transformers_backend_cls": original})
    )
    warnings = []
    monkeypatch.setattr(routing.logger, "warning", lambda *a: warnings.append(a))
    monkeypatch.setattr(vllm, "__version__", "0.33.0")
    routing.install_routing(module)
    assert module.ModelConfig._get_transformers_backend_cls is original
    assert warnings and "0.33.0" in warnings[0]
    monkeypatch.setattr(vllm, "__version__", "0.32.0")
    routing.install_routing(module)
    assert module.ModelConfig._get_transformers_backend_cls.replaced is original


def test_routing_and_the_backend_agree_on_the_recurrent_layer_types():
    from vllm_transformers_overlay.routing import RECURRENT_LAYER_TYPES as routed

    from vllm.model_executor.models.transformers.hybrid import RECURRENT_LAYER_TYPES

    assert routed == RECURRENT_LAYER_TYPES


def test_each_mixer_runs_on_mamba_mixer2_and_attention_layers_get_attention(
    build_backend,
):
    from vllm.model_executor.models.transformers.mixers import Mamba2Mixer

    model = build_backend(granite_hybrid(), "TransformersHybridMoEForCausalLM")
    mixer, attention = model.model.layers
    assert isinstance(mixer.mamba, Mamba2Mixer) and mixer.self_attn is None
    assert mixer.mamba.prefix == "model.layers.0.mamba"
    assert isinstance(attention.self_attn.attn, Attention)
    # The state vLLM sizes its pages from is the state the layer asks for.
    vllm_config = model.vllm_config
    assert type(model).get_mamba_state_shape_from_config(
        vllm_config
    ) == mixer.mamba.get_state_shape()
    assert type(model).get_mamba_state_dtype_from_config(
        vllm_config
    ) == mixer.mamba.get_state_dtype()
    # A_log loads into vLLM's A (its loader takes -exp).
    assert model.hf_to_vllm_mapper._map_name("model.layers.0.mamba.A_log") == (
        "model.layers.0.mamba.A"
    )
    (detail,) = model.report.details["mamba2"]
    assert "model.layers.0.mamba: Mamba-2, 8 heads of 32" in detail
    assert "vLLM MambaMixer2, state 19840 bytes per sequence on each rank" in detail
    assert coverage_row(model.report)["mixers"]


def test_a_mixer_vllm_computes_otherwise_is_refused_naming_it_and_why(build_backend):
    config = granite_hybrid(hidden_act="gelu")
    with pytest.raises(
        ValueError,
        match=r"model.layers.0.mamba \(GraniteMoeHybridMambaLayer\) keeps state of "
        r"its own in Transformers' cache .* Not on vLLM's state layers: "
        r"Mamba2MixerFuser: its convolution's activation is 'gelu', not silu",
    ):
        build_backend(config, "TransformersHybridMoEForCausalLM")


def test_mamba2_mixers_with_prefix_caching_on_the_cpu_are_refused_naming_the_flag(
    build_backend,
):
    # vLLM's CPU scan does not give the per-chunk states the prefix cache keeps:
    # the engine would fail at the first prompt longer than a cache block.
    with pytest.raises(
        ValueError,
        match=r"model.layers.0.mamba .* Mamba2MixerFuser: with prefix caching on, "
        r"vLLM's CPU engine fails .*\(--no-enable-prefix-caching\)",
    ):
        build_backend(
            granite_hybrid(), "TransformersHybridMoEForCausalLM", prefix_caching=True
        )


def test_each_short_convolution_runs_on_vllms_short_conv(build_backend):
    from vllm.model_executor.models.transformers.mixers import ShortConvMixer

    config = small_config(
        "lfm2", layer_types=["conv", "full_attention"], conv_bias=True
    )
    model = build_backend(config, "TransformersHybridForCausalLM")
    mixer, attention = model.model.layers
    assert isinstance(mixer.conv, ShortConvMixer)
    assert mixer.conv.prefix == "model.layers.0.conv"
    assert isinstance(attention.self_attn.attn, Attention)
    vllm_config = model.vllm_config
    assert type(model).get_mamba_state_shape_from_config(
        vllm_config
    ) == mixer.conv.get_state_shape()
    assert type(model).get_mamba_state_dtype_from_config(
        vllm_config
    ) == mixer.conv.get_state_dtype()
    assert coverage_row(model.report)["mixers"]
    (detail,) = model.report.details["short_conv"]
    assert detail == (
        "model.layers.0.conv: short convolution, width 128, kernel 3, with biases; "
        "vLLM ShortConv, state 1024 bytes per sequence on each rank (convolution "
        "[2, 128] float32)"
    )
