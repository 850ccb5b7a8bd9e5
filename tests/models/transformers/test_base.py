# SPDX-License-Identifier: Apache-2.0
"""Building the backend on the CPU from a config: what it attaches, and what it refuses."""

import ast
from pathlib import Path

import pytest
import torch
from transformers.models.llama import modeling_llama

from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

from configs import repository_code, small_config
from transformers import AutoConfig


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


def test_a_window_applied_by_the_models_mask_is_the_one_vllm_applies_and_reported(
    build_backend,
):
    # PhiMoE passes its attention no window: its mask slides whenever the config
    # sets `sliding_window`, and vLLM falls back to that model-wide window.
    model = build_backend(
        small_config("phimoe", num_hidden_layers=2, sliding_window=8),
        backend_class="TransformersMoEForCausalLM",
    )
    windows = [layer.self_attn.attn.sliding_window for layer in model.model.layers]
    assert windows == [8, 8]
    for attention in model.report.attention:
        assert attention.sliding_window == 8
        assert attention.mask.startswith(
            "create_sliding_window_causal_mask (config.sliding_window=8) at "
        )
        assert "modeling_phimoe.py:" in attention.mask


def test_a_config_window_the_models_mask_does_not_apply_is_refused(build_backend):
    # Llama's mask applies no window; vLLM would slide every layer over the config's.
    with pytest.raises(ValueError) as error:
        build_backend(small_config("llama", num_hidden_layers=2, sliding_window=8))
    message = str(error.value)
    assert message.startswith("model.layers.0.self_attn (LlamaAttention, layer 0): ")
    assert "vLLM's attention would apply a sliding window of 8" in message
    assert "the model's mask applies no window there (create_causal_mask at " in message
    assert "modeling_llama.py:" in message
    assert "disable_sliding_window=True" in message


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


BUILD_CODE = (
    "base.py",
    "attention_bridge.py",
    "causal.py",
    "pooling.py",
    "experts_layer.py",
    "multimodal.py",
    "hybrid.py",
    "mixers.py",
    "loading.py",
    "fusion_report.py",
)


@pytest.mark.parametrize("filename", BUILD_CODE)
def test_build_code_names_no_fuser_class(filename):
    """The build asks fusers through the contract's hooks; a new family adds fusers,
    not branches in the core (DESIGN §4)."""
    from vllm.model_executor.models.transformers import fusers

    fuser_classes = {cls.__name__ for cls in fusers.FUSER_CLASSES}
    source = (Path(fusers.__file__).parent.parent / filename).read_text()
    named = {
        node.id if isinstance(node, ast.Name) else node.attr
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Name | ast.Attribute)
    } | {
        alias.name
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }
    assert not named & fuser_classes, f"{filename} names {named & fuser_classes}"
    assert not any(name in source for name in fuser_classes)


def test_packed_mapping_and_checkpoint_name_mapper_are_exposed(build_backend):
    model = build_backend(small_config("llama"))
    assert model.packed_modules_mapping == {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }
    mapper = model.hf_to_vllm_mapper
    assert mapper.apply_list(["model.layers.0.self_attn.q_proj.weight"]) == [
        "model.layers.0.self_attn.qkv_proj.weight"
    ]


def _checkpoint(model, extra: dict[str, torch.Tensor]) -> list:
    """`model`'s own tensors under their HF names, plus `extra`."""
    layers = model.model.layers
    hf = {
        "model.embed_tokens.weight": model.model.embed_tokens.weight,
        "model.norm.weight": model.model.norm.weight,
        "lm_head.weight": model.lm_head.weight,
    }
    for i, layer in enumerate(layers):
        attention, mlp = layer.self_attn, layer.mlp
        q, k, v = attention.qkv_proj.weight.split(
            attention.qkv_proj.output_partition_sizes
        )
        gate, up = mlp.gate_up_proj.weight.chunk(2)
        for name, tensor in dict(
            zip(
                ["q_proj", "k_proj", "v_proj", "o_proj"],
                [q, k, v, attention.o_proj.weight],
            )
        ).items():
            hf[f"model.layers.{i}.self_attn.{name}.weight"] = tensor
        for name, tensor in dict(
            gate_proj=gate, up_proj=up, down_proj=mlp.down_proj.weight
        ).items():
            hf[f"model.layers.{i}.mlp.{name}.weight"] = tensor
        hf[f"model.layers.{i}.input_layernorm.weight"] = layer.input_layernorm.weight
        hf[f"model.layers.{i}.post_attention_layernorm.weight"] = (
            layer.post_attention_layernorm.weight
        )
    hf.update(extra)
    return [(name, tensor.detach().clone()) for name, tensor in hf.items()]


def test_a_checkpoint_tensor_nothing_consumes_is_an_error_naming_it(build_backend):
    # An LM-head bias on a model whose head has none would be skipped by vLLM's
    # loader without a word (it ignores unexpected biases).
    model = build_backend(small_config("llama"))
    weights = _checkpoint(model, {"lm_head.bias": torch.zeros(128)})
    with pytest.raises(ValueError, match=r"'lm_head.bias'.* consumed by no parameter"):
        model.load_weights(weights)


def test_known_unneeded_tensors_are_skipped_and_the_rest_loads(build_backend):
    model = build_backend(small_config("llama"))
    extra = {
        "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(16),
        # A multi-token-prediction layer after the last decoder layer.
        "model.layers.2.mlp.down_proj.weight": torch.ones(128, 256),
    }
    loaded = model.load_weights(_checkpoint(model, extra))
    assert loaded == {name for name, _ in model.named_parameters()}


def test_an_lm_head_with_a_bias_gets_one(build_backend):
    model = build_backend(small_config("phi", hidden_size=128, num_attention_heads=4))
    assert model.lm_head.bias is not None
    assert model.lm_head.bias.shape == (model.lm_head.num_embeddings_per_partition,)


def test_a_config_transformers_cannot_build_is_an_error_naming_class_and_why(
    build_backend,
):
    with pytest.raises(ValueError) as error:
        build_backend(small_config("llama", hidden_act="no_such_activation"))
    message = str(error.value)
    assert message.startswith("Transformers cannot build LlamaForCausalLM")
    assert "model_type 'llama'" in message
    assert "KeyError" in message and "no_such_activation" in message


def test_heads_vllm_attention_refuses_are_an_error_naming_layer_and_module(
    build_backend,
):
    with pytest.raises(ValueError) as error:
        build_backend(small_config("llama", num_key_value_heads=3))
    message = str(error.value)
    assert message.startswith("Decoder layer 0: model.layers.0.self_attn")
    assert "(LlamaAttention) needs 4 query and 3 key/value heads" in message
    assert "not divisible" in message


def test_repository_code_not_trusted_is_refused_not_replaced(build_backend, tmp_path):
    """A known `model_type` whose architecture is repository code: Transformers would
    build its own class for the type; the backend refuses, and runs no code."""
    marker = repository_code(tmp_path / "repository", small_config("llama"))
    remote = AutoConfig.from_pretrained(marker.parent, trust_remote_code=False)
    # vLLM's registry refuses the architecture first (DESIGN §6).
    with pytest.raises(ValueError) as error:
        build_backend(small_config("llama"), served_config=remote)
    message = str(error.value)
    assert "['MarkerForCausalLM'] are not Transformers classes" in message
    assert "'AutoModelForCausalLM': 'marker.MarkerForCausalLM'" in message
    assert "trust_remote_code=True" in message
    assert not marker.exists()


def test_the_compiled_forward_is_one_vllms_compile_cache_can_save(build_backend):
    """vLLM's compile cache saves the compiled model with a guard on the model's type
    and the function it traced; both must pickle, by name or by value (issue 14:
    "Can't pickle LlamaModel.forward" made every start recompile)."""
    import inspect
    import pickle

    from vllm.model_executor.models.transformers.base import source_digest

    model = build_backend(small_config("llama", num_hidden_layers=2))
    compiled = type(model.model)
    assert pickle.loads(pickle.dumps(compiled)) is compiled
    assert compiled.hf_forward is modeling_llama.LlamaModel.forward
    forward = compiled.forward
    assert forward.__closure__ is None
    # Dynamo wraps a method whose source it cannot find in a closure over the model.
    assert inspect.getsourcefile(forward) is not None
    def parameters(function) -> list[tuple]:
        return [
            (p.name, p.kind, p.default)
            for p in inspect.signature(function).parameters.values()
        ]

    assert parameters(forward) == parameters(modeling_llama.LlamaModel.forward)
    assert forward.__qualname__ == f"LlamaModel.forward[{source_digest()}]"


def test_the_compiled_forward_passes_every_argument_through():
    from vllm.model_executor.models.transformers.base import compiled_entry

    class Model:
        def forward(self, a, b=2, *rest, c, d=4, **extra):
            return a, b, rest, c, d, extra

    class Compiled(Model):
        forward = compiled_entry(Model)
        hf_forward = Model.forward

    model = Compiled()
    for args, kwargs in [
        ((1,), dict(c=3)),
        ((1, 5, 6, 7), dict(c=3, d=8, e=9)),
        ((), dict(a=1, b=5, c=3, e=9)),
    ]:
        assert model.forward(*args, **kwargs) == Model().forward(*args, **kwargs)
    with pytest.raises(TypeError):
        model.forward(1)  # `c` is required, as in the original


def test_the_compiled_forward_passes_arguments_by_keyword_as_hf_expects():
    """HF's `merge_with_config_defaults` over another decorator reads a default from
    the config unless the argument came by keyword, then passes it twice if it
    also came positionally ("got multiple values for argument 'use_cache'")."""
    import functools
    from types import SimpleNamespace

    from transformers.utils.generic import merge_with_config_defaults

    from vllm.model_executor.models.transformers.base import compiled_entry

    def original(self, input_ids=None, use_cache=None, **kwargs):
        return input_ids, use_cache, kwargs

    @functools.wraps(original)
    def decorated(self, *args, **kwargs):
        return original(self, *args, **kwargs)

    class Model:
        config = SimpleNamespace(use_cache=True)
        forward = merge_with_config_defaults(decorated)

    class Compiled(Model):
        forward = compiled_entry(Model)
        hf_forward = Model.forward

    assert Compiled().forward(input_ids=1, use_cache=False, x=2) == (1, False, {"x": 2})
    assert Compiled().forward(input_ids=1) == (1, True, {})


def test_state_kept_in_transformers_cache_is_an_error_naming_the_module(
    build_backend,
):
    # Zaya convolves its queries and keys over the tokens before, keeping the last
    # ones in Transformers' cache; vLLM runs the model without that cache, so on the
    # engine each decode step convolved without them (its log-probs 0.06-0.7 off
    # Transformers', vLLM's stock backend too). Every layer calls the attention
    # interface, so nothing else refused it.
    config = small_config(
        "zaya", head_dim=32, num_experts=4, num_experts_per_tok=1,
        moe_intermediate_size=32, router_hidden_size=32, layer_types=["hybrid"] * 2,
        num_hidden_layers=2,
    )  # fmt: skip
    with pytest.raises(
        ValueError,
        match=r"model.layers.0.self_attn.qkv_proj \(ZayaCCAProjection\) keeps state "
        r"of its own in Transformers' cache \(past_key_values.has_previous_state at "
        r".*modeling_zaya.py:\d+\)",
    ):
        build_backend(config)


def test_only_state_beyond_keys_and_values_is_refused():
    from vllm.model_executor.models.transformers.attention_bridge import cache_state_use

    def module(body: str) -> type[torch.nn.Module]:
        namespace: dict = {}
        source = f"def forward(self, x, past_key_values=None):\n    {body}\n"
        filename = f"<cache use {body!r}>"
        import linecache

        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        exec(compile(source, filename, "exec"), namespace)
        return type("Uses", (torch.nn.Module,), {"forward": namespace["forward"]})

    # Attention's keys and values (vLLM's paged cache keeps them), and reads.
    for body in (
        "return past_key_values.update(x, x, 0)",
        "return past_key_values.get_seq_length()",
        "return x",
    ):
        assert cache_state_use(module(body)) is None
    for body in (
        "return past_key_values.update_conv_state(x, 0)",
        "return past_key_values.layers[0].recurrent_states",
        "return past_key_values.update_indexer(x, 0)",
    ):
        assert body.split("return ")[1].split("(")[0].split("[")[0] in cache_state_use(
            module(body)
        )


def test_a_head_naming_another_prefix_than_its_base_models_is_served(build_backend):
    # Llama 4's causal LM says its base model is `language_model` and holds it as
    # `model`, so Transformers' `base_model` is the whole causal LM: the backend
    # took the head for the base model, and refused the checkpoint's `lm_head`
    # as missing (the engine did not start).
    config = small_config(
        "llama4_text", head_dim=32, num_local_experts=4, num_experts_per_tok=1,
        intermediate_size=64, intermediate_size_mlp=128,
        layer_types=["full_attention"] * 2, attention_chunk_size=256,
    )  # fmt: skip
    model = build_backend(config)
    assert type(model.model).__name__ == "Llama4TextModel"
    names = {name for name, _ in model.named_parameters()}
    mapper = model.hf_to_vllm_mapper
    for checkpoint_name in (
        "lm_head.weight",
        "model.embed_tokens.weight",
        "model.norm.weight",
        "model.layers.1.post_attention_layernorm.weight",
    ):
        assert mapper._map_name(checkpoint_name) in names, checkpoint_name
