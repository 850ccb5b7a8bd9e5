# SPDX-License-Identifier: Apache-2.0
"""AttentionFuser on real HF architectures built on `meta`, and on small modules."""

import linecache

import pytest
import torch
from torch import nn
from transformers import AutoConfig, AutoModel
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaAttention
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextAttention

from vllm.model_executor.models.transformers.plan import get_fuser
from vllm.model_executor.models.transformers.fusers import AttentionFuser
from vllm.model_executor.models.transformers.fusers.base import Declined


def meta_model(model_type: str, **overrides) -> nn.Module:
    config = AutoConfig.for_model(model_type, **{"num_hidden_layers": 3, **overrides})
    with torch.device("meta"):
        return AutoModel.from_config(config)


def attention_modules(model: nn.Module) -> dict[str, tuple[nn.Module, AttentionFuser]]:
    return {
        name: (module, fuser)
        for name, module in model.named_modules()
        if (fuser := get_fuser(module, AttentionFuser)) is not None
    }


@pytest.mark.parametrize(
    ("model_type", "attention_name"),
    [
        ("llama", "self_attn"),
        ("gemma3_text", "self_attn"),
        ("deepseek_v3", "self_attn"),
    ],
)
def test_exactly_the_decoder_attention_modules_match(model_type, attention_name):
    model = meta_model(model_type)
    expected = {f"layers.{i}.{attention_name}" for i in range(3)}
    assert set(attention_modules(model)) == expected


def test_layer_index_is_the_modules_own():
    # LongCat Flash has two attention sublayers per decoder layer, numbered 2i and
    # 2i + 1: the enclosing layer's position is not the KV-cache index.
    model = meta_model("longcat_flash", num_hidden_layers=6)  # 3 decoder layers
    indices = {
        name: fuser.layer_index(module)
        for name, (module, fuser) in attention_modules(model).items()
    }
    expected = {
        f"layers.{i}.self_attn.{j}": 2 * i + j for i in range(3) for j in range(2)
    }
    assert indices == expected


def test_scale_is_the_declared_one_for_gemma():
    model = meta_model("gemma3_text", head_dim=64, query_pre_attn_scalar=100)
    for module, fuser in attention_modules(model).values():
        assert fuser.scale(module) == pytest.approx(100**-0.5)


def test_scale_is_the_declared_one_for_deepseek_yarn():
    rope = {
        "rope_type": "yarn",
        "factor": 40.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
        "rope_theta": 10000.0,
    }
    model = meta_model("deepseek_v3", rope_parameters=rope)
    head_size = model.config.qk_nope_head_dim + model.config.qk_rope_head_dim
    for module, fuser in attention_modules(model).values():
        scale = fuser.scale(module)
        assert scale == pytest.approx(module.scaling)
        assert scale > head_size**-0.5 * 1.5  # the yarn mscale is applied


def test_scale_is_the_argument_not_the_attribute():
    # OPT scales the query itself, then passes scaling=1.0 to the interface.
    model = meta_model("opt")
    for module, fuser in attention_modules(model).values():
        assert module.scaling != 1.0
        assert fuser.scale(module) == 1.0


def test_no_scaling_argument_means_the_modules_own_head_size():
    class NoScaling(nn.Module):
        def __init__(self, head_dim: int):
            super().__init__()
            self.head_dim = head_dim

        def forward(self, q, k, v):
            interface = ALL_ATTENTION_FUNCTIONS.get_interface("sdpa", None)
            return interface(self, q, k, v, None)

    fuser = AttentionFuser.match(None, NoScaling(16))
    # One argument, as the design note says; each instance its own head size.
    assert fuser.scale(NoScaling(16)) == 0.25
    assert fuser.scale(NoScaling(64)) == 0.125


def test_unresolvable_scale_is_a_clear_error():
    class ComputedScale(nn.Module):
        def forward(self, q, k, v):
            interface = ALL_ATTENTION_FUNCTIONS["sdpa"]
            return interface(self, q, k, v, None, scaling=self.head_dim**-0.5)

    module = ComputedScale()
    fuser = AttentionFuser.match(None, module)
    with pytest.raises(
        ValueError,
        match=r"ComputedScale \(layer \?, .*\) passes scaling=self.head_dim \*\* \(-0.5\).*cannot resolve",
    ):
        fuser.scale(module)


def test_two_interface_calls_are_declined_with_a_reason():
    class TwoCalls(nn.Module):
        def forward(self, q, k, v):
            interface = ALL_ATTENTION_FUNCTIONS.get_interface("sdpa", None)
            first, _ = interface(self, q, k, v, None)
            return interface(self, first, k, v, None)

    declined = AttentionFuser.match(None, TwoCalls())
    assert isinstance(declined, Declined)
    assert declined.module_class == "TwoCalls"
    assert "calls it 2 times" in declined.reason


def test_module_without_interface_does_not_match():
    model = meta_model("bloom")
    assert attention_modules(model) == {}


def test_only_a_config_patched_to_vllm_is_validated():
    model = meta_model("llama")
    module, fuser = attention_modules(model)["layers.0.self_attn"]
    assert not fuser.validate(module, vllm_config=None)
    module.config._attn_implementation = "vllm"
    assert fuser.validate(module, vllm_config=None)


def test_layer_index_must_be_declared():
    model = meta_model("llama")
    module, fuser = attention_modules(model)["layers.0.self_attn"]
    del module.layer_idx
    with pytest.raises(
        ValueError, match="LlamaAttention .* declares no integer `layer_idx`"
    ):
        fuser.layer_index(module)


class CallsWith(nn.Module):
    """An attention module whose call passes `self.call_kwargs`' names, each bound
    to an attribute of the module (set per test)."""

    def __init__(self, layer_idx: int = 0, head_dim: int = 16, **attributes):
        super().__init__()
        self.layer_idx, self.head_dim = layer_idx, head_dim
        self.num_heads, self.num_key_value_heads = 4, 2
        for name, value in attributes.items():
            setattr(self, name, value)


def _calling(keywords: str) -> type[nn.Module]:
    """A `CallsWith` subclass whose forward passes `keywords` to the interface (its
    source registered with `linecache`, where `inspect` reads it)."""
    source = (
        "def forward(self, q, k, v):\n"
        "    interface = ALL_ATTENTION_FUNCTIONS.get_interface('sdpa', None)\n"
        f"    return interface(self, q, k, v, None, {keywords})\n"
    )
    filename = f"<calling {keywords}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    namespace = {"ALL_ATTENTION_FUNCTIONS": ALL_ATTENTION_FUNCTIONS}
    exec(compile(source, filename, "exec"), namespace)
    return type("Calling", (CallsWith,), {"forward": namespace["forward"]})


def _needs(module: nn.Module):
    fuser = AttentionFuser.match(None, module)
    return fuser.attention_needs(module, vllm_config=None)


def test_sinks_from_s_aux_are_honoured():
    cls = _calling("s_aux=self.sinks")
    module = cls(sinks=nn.Parameter(torch.zeros(4)))
    assert _needs(module).sinks == "sinks"


def test_an_instance_whose_sinks_are_none_gets_none():
    # MiMo-V2-Flash: sinks on its sliding layers only, `None` on the others.
    cls = _calling("s_aux=self.sinks")
    with_sinks, without = cls(sinks=nn.Parameter(torch.zeros(4))), cls(sinks=None)
    assert (_needs(with_sinks).sinks, _needs(without).sinks) == ("sinks", None)


def test_s_aux_that_is_not_a_parameter_is_refused_naming_layer_and_argument():
    cls = _calling("s_aux=q.new_zeros(4)")
    with pytest.raises(ValueError, match=r"Calling \(layer 3, .*\) passes s_aux="):
        _needs(cls(layer_idx=3))


def test_is_causal_false_is_encoder_only_attention():
    assert _needs(_calling("is_causal=False")()).causal is False
    assert _needs(_calling("is_causal=self.is_causal")(is_causal=True)).causal


def test_without_an_is_causal_argument_the_modules_own_decides():
    # BERT and ModernBERT set `self.is_causal = False` and pass no argument; as in
    # Transformers' own attention functions, an argument of `None` defers to it too.
    assert _needs(_calling("scaling=1.0")(is_causal=False)).causal is False
    deferring = _calling("is_causal=self.flag")(flag=None, is_causal=False)
    assert _needs(deferring).causal is False
    assert _needs(_calling("scaling=1.0")()).causal is True


def test_an_is_causal_that_is_not_a_bool_is_refused_naming_the_layer():
    with pytest.raises(ValueError, match=r"Calling \(layer 2, .*\).* not a bool"):
        _needs(_calling("scaling=1.0")(layer_idx=2, is_causal="yes"))


def test_scaling_computed_from_attributes_resolves():
    # ModernBERT: `scaling=self.head_dim**-0.5`.
    assert _needs(_calling("scaling=self.head_dim**-0.5")(head_dim=16)).scale == 0.25
    assert _needs(_calling("scaling=2 * self.s / 4")(s=0.5)).scale == 0.25


def test_flash_attentions_deterministic_flag_is_honoured():
    # ModernBERT passes `deterministic=`; it changes no value.
    assert _needs(_calling("deterministic=self.flag")(flag=True)).layer_index == 0


def test_per_call_sliding_window_and_softcap_are_the_instances():
    cls = _calling("sliding_window=self.sliding_window, softcap=self.cap")
    needs = _needs(cls(sliding_window=8, cap=30.0))
    assert (needs.sliding_window, needs.logits_soft_cap) == (8, 30.0)
    assert _needs(cls(sliding_window=None, cap=None)).sliding_window is None


def test_a_window_chosen_by_an_attribute_is_each_instances_own():
    cls = _calling("sliding_window=self.window if self.use_window else None")
    assert _needs(cls(window=8, use_window=True)).sliding_window == 8
    assert _needs(cls(window=8, use_window=False)).sliding_window is None
    compared = _calling("sliding_window=self.window if self.kind == 'local' else None")
    assert _needs(compared(window=8, kind="local")).sliding_window == 8
    assert _needs(compared(window=8, kind="global")).sliding_window is None


@pytest.mark.parametrize(
    "window",
    [
        "q.shape[-2] // 2",
        "self.window if q.shape[-2] > 4 else None",
        "self.window if self.missing else None",
    ],
)
def test_a_window_the_backend_cannot_resolve_is_refused_not_dropped(window):
    # Not `config.layer_types`, nor no window at all: like any other argument.
    module = _calling(f"sliding_window={window}")(layer_idx=2, window=8)
    module.config = AutoConfig.for_model(
        "llama", layer_types=["full_attention"] * 3, num_hidden_layers=3
    )
    with pytest.raises(
        ValueError,
        match=r"Calling \(layer 2, .*\) passes sliding_window=.*cannot resolve",
    ):
        _needs(module)


def test_an_argument_vllm_cannot_honour_is_refused_naming_it():
    cls = _calling("position_bias=self.bias")
    with pytest.raises(
        ValueError, match=r"Calling \(layer 1, .*\) passes position_bias= .*cannot"
    ):
        _needs(cls(layer_idx=1, bias=None))


def test_chunked_layer_types_are_refused_naming_the_layer():
    module = _calling("scaling=1.0")()
    module.config = AutoConfig.for_model(
        "llama", layer_types=["chunked_attention"], num_hidden_layers=1
    )
    with pytest.raises(ValueError, match=r"layer_types\[0\] is 'chunked_attention'"):
        _needs(module)


def test_heads_are_read_per_instance():
    # Gemma 4 style: layers of one class with other head sizes. The class is analysed
    # on the first instance; the second gets its own heads and scale.
    def attention(head_dim: int, heads: int) -> nn.Module:
        config = AutoConfig.for_model(
            "llama", hidden_size=128, num_attention_heads=heads, head_dim=head_dim
        )
        with torch.device("meta"):
            return LlamaAttention(config, layer_idx=0)

    small, large = attention(32, 4), attention(64, 2)
    fuser = get_fuser(small, AttentionFuser)
    assert get_fuser(large, AttentionFuser) is fuser  # one class verdict
    needs = fuser.attention_needs(large, None)
    assert (needs.head_size, needs.num_heads, needs.num_kv_heads) == (64, 2, 2)
    assert needs.scale == pytest.approx(64**-0.5)
    assert fuser.attention_needs(small, None).head_size == 32


def test_heads_that_disagree_with_the_projections_are_an_error():
    model = meta_model("llama", hidden_size=128, num_attention_heads=4)
    module, fuser = attention_modules(model)["layers.0.self_attn"]
    module.head_dim = 16  # the projections still produce heads of 32
    with pytest.raises(ValueError, match=r"q_proj computes the q 128 wide"):
        fuser.attention_needs(module, None)


def test_mha_key_value_heads_are_each_instances_own():
    # GPT-2 holds no key/value head count: it equalled the query heads on the
    # instance the class was analysed on, so it is each instance's query heads,
    # not the analysed instance's number (a draft model beside its target).
    small, large = (
        meta_model("gpt2", n_head=heads, n_embd=64).h[0].attn for heads in (2, 4)
    )
    fuser = get_fuser(small, AttentionFuser)
    assert get_fuser(large, AttentionFuser) is fuser
    assert fuser.same_as == {"num_kv_heads": "num_heads"}
    needs = fuser.attention_needs(large, None)
    assert (needs.num_heads, needs.num_kv_heads, needs.head_size) == (4, 4, 16)


def test_gpt_bigcode_key_value_heads_follow_multi_query():
    mha, mqa = (
        meta_model("gpt_bigcode", n_head=4, n_embd=64, multi_query=multi).h[0].attn
        for multi in (False, True)
    )
    fuser = get_fuser(mha, AttentionFuser)
    assert fuser.attention_needs(mqa, None).num_kv_heads == 1


def test_module_that_is_not_causal_gets_encoder_only_attention():
    # Without an `is_causal=` argument the interface reads the module's attribute.
    module = _calling("scaling=1.0")(is_causal=False)
    assert _needs(module).causal is False
    assert _needs(_calling("scaling=1.0")()).causal is True


def _forward_passing_mask(body: str, signature: str = "q, k, v, attention_mask=None"):
    """A `CallsWith` subclass whose forward runs `body` (which binds `mask`) and
    passes `mask` to the interface as its fifth positional argument."""
    lines = "".join(f"    {line}\n" for line in body.splitlines())
    source = (
        f"def forward(self, {signature}):\n{lines}"
        "    interface = ALL_ATTENTION_FUNCTIONS.get_interface('sdpa', None)\n"
        "    return interface(self, q, k, v, mask, scaling=1.0)\n"
    )
    filename = f"<mask {body!r} ({signature})>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    namespace = {"ALL_ATTENTION_FUNCTIONS": ALL_ATTENTION_FUNCTIONS}
    exec(compile(source, filename, "exec"), namespace)
    return type("Masking", (CallsWith,), {"forward": namespace["forward"]})


@pytest.mark.parametrize(
    ("body", "signature"),
    [
        ("mask = attention_mask", "q, k, v, attention_mask=None"),
        ("mask = None", "q, k, v"),
        # Older models slice the causal mask to the keys.
        ("mask = attention_mask[:, :, :, : k.shape[-2]]", "q, k, v, attention_mask"),
        # Zaya: a mapping of masks, the attention's under "causal".
        (
            "mapping = attention_mask or {}\nmask = mapping.get('causal')",
            "q, k, v, attention_mask=None",
        ),
        # GPT-2 and ESM: a cross-attention swaps in the mask it was handed for that.
        (
            "mask = attention_mask\nif cross:\n    mask = encoder_attention_mask",
            "q, k, v, attention_mask=None, encoder_attention_mask=None, cross=False",
        ),
        (
            "mask = encoder_attention_mask if cross else attention_mask",
            "q, k, v, attention_mask=None, encoder_attention_mask=None, cross=False",
        ),
    ],
)
def test_a_mask_handed_on_is_honoured(body, signature):
    # vLLM's attention builds the same (causal, sliding) mask from its metadata.
    assert _needs(_forward_passing_mask(body, signature)(layer_idx=2)).layer_index == 2


@pytest.mark.parametrize(
    "body",
    [
        # Doge's dynamic mask: a bias per key computed from the values.
        "mask = attention_mask + self.bias",
        "mask = attention_mask\nmask = mask.masked_fill(q[..., :1] > 0, -1e9)",
        "mask = attention_mask\nmask += self.bias",
        "mask = self.bias",
        "mask = build(attention_mask)",
        "mask = attention_mask.get('causal') + self.bias",
        "mask = attention_mask if q.sum() > 0 else self.bias",
    ],
)
def test_a_mask_the_module_computes_is_refused_naming_layer_and_mask(body):
    module = _forward_passing_mask(body)(layer_idx=1, bias=torch.zeros(1))
    with pytest.raises(
        ValueError, match=r"Masking \(layer 1, .*\) passes .* a mask it computes itself"
    ):
        _needs(module)


def test_doges_dynamic_mask_is_refused_not_dropped():
    # Doge adds a bias per key, computed from the values, to the causal mask and
    # passes that: vLLM's attention would silently attend without it.
    model = meta_model("doge", hidden_size=64, num_attention_heads=2)
    for name, (module, fuser) in attention_modules(model).items():
        with pytest.raises(ValueError, match=r"DogeAttention \(layer \d.*\(attn_mask\)"):
            fuser.attention_needs(module, None)
    # A mask handed on, on real architectures: still served.
    for model_type in ("llama", "gpt2", "zaya"):
        for module, fuser in attention_modules(meta_model(model_type)).values():
            fuser.attention_needs(module, None)


class FlatGatedAttention(Qwen3NextAttention):
    """Qwen3-Next's attention with its output gate split off the query's linear as
    one flat half (`q_proj(h).chunk(2, -1)`), not per head."""

    def forward(self, hidden_states, position_embeddings, attention_mask, **kwargs):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states, gate = self.q_proj(hidden_states).chunk(2, dim=-1)
        query_states = query_states.view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, None
        )
        attn_output, attn_weights = attention_interface(
            self, query_states, key_states, value_states, attention_mask,
            scaling=self.scaling,
        )  # fmt: skip
        attn_output = attn_output.reshape(*input_shape, -1) * torch.sigmoid(gate)
        return self.o_proj(attn_output), attn_weights


def _gated(cls: type[nn.Module]) -> nn.Module:
    config = AutoConfig.for_model(
        "qwen3_next", hidden_size=128, num_attention_heads=4, head_dim=32
    )
    with torch.device("meta"):
        return cls(config, layer_idx=3)  # a full-attention layer by default


def test_a_query_linear_holding_a_gate_per_head_is_read_as_twice_the_query():
    # Qwen3-Next: q_proj computes each head's query and output gate side by side
    # (`view(..., -1, 2 * head_dim).chunk(2, -1)`), so its rows split into whole
    # heads of both across tensor-parallel ranks.
    module = _gated(Qwen3NextAttention)
    fuser = get_fuser(module, AttentionFuser)
    assert fuser.query_parts == 2
    needs = fuser.attention_needs(module, None)
    assert (needs.num_heads, needs.head_size, needs.sources["q"]) == (4, 32, "q_proj")


def test_a_gate_split_off_flat_is_refused_naming_the_width():
    # The same widths with the gate as q_proj's second half: a rank's share of its
    # rows would not hold the heads' queries, so no width is assumed.
    module = _gated(FlatGatedAttention)
    fuser = get_fuser(module, AttentionFuser)
    assert fuser.query_parts == 1
    with pytest.raises(ValueError, match=r"q_proj computes the q 256 wide"):
        fuser.attention_needs(module, None)
