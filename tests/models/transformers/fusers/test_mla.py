# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""MLAFuser: DeepSeek-style latent attention -> the latent handed to `MLAAttention`.

On `meta`: the roles found in DeepSeek-V2/V3 attention, with and without query LoRA,
and the near misses declined. On the CPU: the rewritten forward, with the latent
consumed as `MLAAttention` consumes it (query absorbed through `kv_b`), equals the
original forward that expands the latent itself. In-process backend construction:
`MLAAttention` attached per layer, a layer that did not fuse named, and plain
attention under `VLLM_MLA_DISABLE=1`."""

import copy
import importlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig

import vllm.model_executor.models.transformers  # noqa: F401 - registers "vllm_mla"
from vllm.config import DeviceConfig, LoadConfig, ModelConfig, VllmConfig
from vllm.model_executor.layers.attention import Attention, MLAAttention
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from vllm.model_executor.models.transformers.plan import get_fuser, get_fusers
from vllm.model_executor.models.transformers.fusers import AttentionFuser, MLAFuser
from vllm.model_executor.models.transformers import plan as registry
from vllm.model_executor.models.utils import AutoWeightsLoader, WeightsMapper

HIDDEN, HEADS, RANK, ROPE, NOPE, V_HEAD, Q_RANK = 128, 4, 512, 64, 64, 64, 96
"""The CPU MLA kernels take kv_lora_rank 512 and a rotary head of 64; the rest is small."""

VARIANTS = [
    ("deepseek_v3", Q_RANK),
    ("deepseek_v3", None),
    ("deepseek_v2", Q_RANK),
    ("deepseek_v2", None),
]
IDS = ["v3-q_lora", "v3-no-q_lora", "v2-q_lora", "v2-no-q_lora"]

WITH_LORA = dict(
    q_a="q_a_proj",
    q_norm="q_a_layernorm",
    q_proj="q_b_proj",
    kv_a="kv_a_proj_with_mqa",
    kv_norm="kv_a_layernorm",
    kv_b="kv_b_proj",
    o_proj="o_proj",
)
WITHOUT_LORA = {**WITH_LORA, "q_a": None, "q_norm": None, "q_proj": "q_proj"}


def deepseek_config(model_type: str, q_lora_rank: int | None, **overrides):
    architecture = {
        "deepseek_v3": "DeepseekV3ForCausalLM",
        "deepseek_v2": "DeepseekV2ForCausalLM",
    }
    return AutoConfig.for_model(
        model_type,
        **{
            "vocab_size": 128,
            "hidden_size": HIDDEN,
            "intermediate_size": 256,
            "num_hidden_layers": 2,
            "num_attention_heads": HEADS,
            "num_key_value_heads": HEADS,
            "kv_lora_rank": RANK,
            "qk_rope_head_dim": ROPE,
            "qk_nope_head_dim": NOPE,
            "v_head_dim": V_HEAD,
            "q_lora_rank": q_lora_rank,
            "n_routed_experts": 0,
            "first_k_dense_replace": 2,
            "max_position_embeddings": 256,
            "pad_token_id": 0,
            "architectures": [architecture[model_type]],
            **overrides,
        },
    )


def modeling_class(model_type: str, config, kind: str) -> type:
    """`DeepseekV3Attention` for ("deepseek_v3", config, "Attention"), and the like."""
    module = importlib.import_module(
        f"transformers.models.{model_type}.modeling_{model_type}"
    )
    return getattr(module, f"{type(config).__name__.removesuffix('Config')}{kind}")


def attention(
    model_type: str, q_lora_rank: int | None, device: str = "meta", **overrides
):
    """The model's attention module, its config dispatching to vLLM's latent attention."""
    config = deepseek_config(model_type, q_lora_rank, **overrides)
    config._attn_implementation = "vllm_mla"
    cls = modeling_class(model_type, config, "Attention")
    with torch.device(device):
        return cls(config, layer_idx=0)


# --- matching, on meta -------------------------------------------------------------


@pytest.mark.parametrize(("model_type", "q_lora_rank"), VARIANTS, ids=IDS)
def test_deepseek_attention_matches_the_expected_roles(
    model_type, q_lora_rank, declined
):
    module = attention(model_type, q_lora_rank)
    fusers = get_fusers(module)
    assert [type(f) for f in fusers] == [MLAFuser, AttentionFuser]
    fuser = fusers[0]
    assert fuser.roles == (WITH_LORA if q_lora_rank else WITHOUT_LORA)
    if q_lora_rank:
        assert fuser.shards == {"q_a_proj": 0, "kv_a_proj_with_mqa": 1}
        assert fuser.fused_name == "fused_qkv_a_proj"
        assert fuser.packed_modules_mapping == {
            "fused_qkv_a_proj": ["q_a_proj", "kv_a_proj_with_mqa"]
        }
        assert fuser.stacked_weights("model.layers.0.self_attn") == {
            "model.layers.0.self_attn.q_a_proj.": (
                "model.layers.0.self_attn.fused_qkv_a_proj.",
                0,
            ),
            "model.layers.0.self_attn.kv_a_proj_with_mqa.": (
                "model.layers.0.self_attn.fused_qkv_a_proj.",
                1,
            ),
        }
    else:
        assert fuser.shards == {} and fuser.packed_modules_mapping == {}
    assert declined(MLAFuser) == []


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "olmo2"])
def test_ordinary_attention_is_no_near_miss(model_type, declined):
    """Per-head q/k norms (Qwen3) and full-width ones (OLMo2) are no latent chain."""
    from configs import small_config
    from transformers import AutoModel

    config = small_config(model_type, num_hidden_layers=1, pad_token_id=0)
    config._attn_implementation = "vllm"
    with torch.device("meta"):
        model = AutoModel.from_config(config)
    module = model.layers[0].self_attn
    assert get_fuser(module, MLAFuser) is None
    assert type(get_fusers(module)[0]).__name__ == "QKVFuser"
    assert declined(MLAFuser) == []


class HeadRMSNorm(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.variance_epsilon = 1e-6

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(dtype)


class TwoLatents(nn.Module):
    """Two linears each compressed through a narrower norm: which one is the KV?"""

    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(HIDDEN, HEADS * (NOPE + ROPE), bias=False)
        self.k_a = nn.Linear(HIDDEN, RANK + ROPE, bias=False)
        self.k_norm = HeadRMSNorm(RANK)
        self.v_a = nn.Linear(HIDDEN, RANK + ROPE, bias=False)
        self.v_norm = HeadRMSNorm(RANK)
        self.k_b = nn.Linear(RANK, HEADS * NOPE, bias=False)
        self.v_b = nn.Linear(RANK, HEADS * (NOPE + ROPE), bias=False)
        self.o_proj = nn.Linear(HEADS * (NOPE + ROPE), HIDDEN, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, HEADS, -1).transpose(1, 2)
        k_latent, k_rot = torch.split(self.k_a(x), [RANK, ROPE], dim=-1)
        v_latent, _ = torch.split(self.v_a(x), [RANK, ROPE], dim=-1)
        k = self.k_b(self.k_norm(k_latent)).view(b, t, HEADS, NOPE).transpose(1, 2)
        k = torch.cat([k, k_rot[:, None].expand(b, HEADS, t, ROPE)], dim=-1)
        v = self.v_b(self.v_norm(v_latent)).view(b, t, HEADS, -1).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class NoUpProjection(nn.Module):
    """The normalised latent is repeated over the heads as is: nothing up-projects it."""

    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(HIDDEN, HEADS * (RANK + ROPE), bias=False)
        self.kv_a = nn.Linear(HIDDEN, RANK + ROPE, bias=False)
        self.kv_norm = HeadRMSNorm(RANK)
        self.o_proj = nn.Linear(HEADS * RANK, HIDDEN, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, HEADS, -1).transpose(1, 2)
        latent, k_rot = torch.split(self.kv_a(x), [RANK, ROPE], dim=-1)
        latent = self.kv_norm(latent)[:, None].expand(b, HEADS, t, RANK)
        k = torch.cat([latent, k_rot[:, None].expand(b, HEADS, t, ROPE)], dim=-1)
        out = F.scaled_dot_product_attention(q, k, latent, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class InlineExpansion(nn.Module):
    """Latent attention whose forward expands the latent itself, with no method call
    it could skip."""

    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(HIDDEN, HEADS * (NOPE + ROPE), bias=False)
        self.kv_a = nn.Linear(HIDDEN, RANK + ROPE, bias=False)
        self.kv_norm = HeadRMSNorm(RANK)
        self.kv_b = nn.Linear(RANK, HEADS * (NOPE + V_HEAD), bias=False)
        self.o_proj = nn.Linear(HEADS * V_HEAD, HIDDEN, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, HEADS, -1).transpose(1, 2)
        latent, k_rot = torch.split(self.kv_a(x), [RANK, ROPE], dim=-1)
        kv = self.kv_b(self.kv_norm(latent)).view(b, t, HEADS, -1).transpose(1, 2)
        k_nope, v = torch.split(kv, [NOPE, V_HEAD], dim=-1)
        k = torch.cat([k_nope, k_rot[:, None].expand(b, HEADS, t, ROPE)], dim=-1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


def layer_norm_latent():
    """DeepSeek-V3 attention whose KV latent goes through a LayerNorm."""
    module = attention("deepseek_v3", Q_RANK)
    module.kv_a_layernorm = nn.LayerNorm(RANK, device="meta")
    return module


@pytest.mark.parametrize(
    ("build", "reason"),
    [
        (TwoLatents, "2 KV down-projection chains (k_a -> k_norm, v_a -> v_norm)"),
        (
            NoUpProjection,
            "no single linear up-projects the KV latent kv_norm normalises",
        ),
        (
            layer_norm_latent,
            "kv_a_layernorm (LayerNorm) normalises the KV latent of "
            "kv_a_proj_with_mqa but is not an RMSNorm",
        ),
        (
            InlineExpansion,
            "kv_b is not applied inside one call that returns the key and value",
        ),
    ],
    ids=["two-kv-chains", "no-up-projection", "layer-norm", "inline-expansion"],
)
def test_near_misses_are_declined_with_the_reason(build, reason, declined):
    module = build()
    assert get_fuser(module, MLAFuser) is None
    reasons = declined(MLAFuser)
    assert len(reasons) == 1 and reasons[0].startswith(reason), reasons
    (record,) = [
        d for d in registry.analyse(module).declined if d.fuser == "MLAFuser"
    ]
    assert record.module_class == type(module).__name__
    assert "fusers/mla.py:" in record.location  # the code that decided


def test_validates_only_when_vllm_uses_mla(mla_vllm_config, monkeypatch):
    module = attention("deepseek_v3", Q_RANK)
    fuser = get_fuser(module, MLAFuser)
    assert fuser.validate(module, mla_vllm_config)
    monkeypatch.setenv("VLLM_MLA_DISABLE", "1")
    assert not mla_vllm_config.model_config.use_mla
    assert not fuser.validate(module, mla_vllm_config)
    assert (
        fuser.mismatch(module, mla_vllm_config)
        == "vLLM does not use MLA for this model"
    )


def test_instance_with_other_dimensions_is_not_validated(mla_vllm_config):
    module = attention("deepseek_v3", Q_RANK, v_head_dim=32)
    fuser = get_fuser(module, MLAFuser)
    assert "kv_b_proj width 384 (expected 512)" in fuser.mismatch(
        module, mla_vllm_config
    )
    assert not fuser.validate(module, mla_vllm_config)


# --- numerics, on the CPU -----------------------------------------------------------


@pytest.fixture(scope="module")
def mla_vllm_config(vllm_runtime, tmp_path_factory) -> VllmConfig:
    """A vLLM config for a DeepSeek-V3 checkpoint of the dimensions above: MLA in use
    (no VLLM_MLA_DISABLE), as `validate` asks."""
    folder = tmp_path_factory.mktemp("deepseek_v3")
    deepseek_config("deepseek_v3", Q_RANK).save_pretrained(folder)
    model_config = ModelConfig(
        model=str(folder),
        model_impl="transformers",
        dtype="float32",
        skip_tokenizer_init=True,
    )
    return VllmConfig(
        model_config=model_config,
        device_config=DeviceConfig("cpu"),
        load_config=LoadConfig(load_format="dummy"),
    )


class LatentAttention(nn.Module):
    """What `MLAAttention` computes from the compressed KV, in plain torch: the query
    absorbed into the latent space through `kv_b`'s key half, attention over the
    latent and the rotary key of every earlier token, the output taken out of the
    latent space through `kv_b`'s value half. One causal sequence."""

    def __init__(self, kv_b: nn.Module, scale: float):
        super().__init__()
        self.kv_b_proj = kv_b
        # As MLAAttention does: kv_b keeps a plain weight on the CPU, read here.
        kv_b._cpu_skip_gemm_dispatch = True
        self.scale = scale
        self.num_heads, self.v_head_dim = HEADS, V_HEAD
        self.kv_lora_rank, self.qk_rope_head_dim = RANK, ROPE
        self.qk_head_dim = NOPE + ROPE

    def forward(self, q, kv_c, k_pe, output_shape):
        weight = self.kv_b_proj.weight.view(HEADS, NOPE + V_HEAD, RANK)
        w_uk, w_uv = weight[:, :NOPE], weight[:, NOPE:]
        q_nope, q_pe = q.split([NOPE, ROPE], dim=-1)
        q_latent = torch.einsum("thn,hnr->thr", q_nope, w_uk)
        scores = torch.einsum("thr,sr->hts", q_latent, kv_c)
        scores = scores + torch.einsum("thp,sp->hts", q_pe, k_pe[:, 0])
        tokens = q.shape[0]
        future = torch.ones(tokens, tokens, dtype=torch.bool).triu(1)
        probs = (scores * self.scale).masked_fill(future, float("-inf")).softmax(-1)
        out_latent = torch.einsum("hts,sr->thr", probs, kv_c)
        return torch.einsum("thr,hvr->thv", out_latent, w_uv).reshape(output_shape)


def fuse_like_the_backend(
    module: nn.Module, vllm_config: VllmConfig
) -> tuple[nn.Module, list]:
    """Fuse `module` as the backend does, attach the latent attention as `attn`, load
    the original weights through the fused layers' loaders (and `stacked_weights`)."""
    weights = {f"m.{k}": v.clone() for k, v in module.state_dict().items()}
    applied = [f for f in get_fusers(module) if f.validate(module, vllm_config)]
    parent = nn.Module()
    parent.m = module
    stacked = {}
    for fuser in applied:
        parent.m = fuser.fuse(parent.m, "m", vllm_config)
        stacked.update(fuser.stacked_weights("m"))
    mla, attention_fuser = applied
    fused = parent.m
    fused.attn = LatentAttention(
        getattr(fused, mla.kv_b),
        attention_fuser.scale(fused),
    )
    mapper = WeightsMapper(orig_to_new_stacked=stacked)
    AutoWeightsLoader(parent).load_weights(mapper.apply(weights.items()))
    for layer in parent.modules():
        if (method := getattr(layer, "quant_method", None)) is not None:
            method.process_weights_after_loading(layer)
    return fused, applied


@pytest.mark.parametrize(("model_type", "q_lora_rank"), VARIANTS, ids=IDS)
def test_rewritten_forward_equals_the_expanding_one(
    model_type, q_lora_rank, mla_vllm_config
):
    """float32 only: Transformers' eager attention takes its softmax in float32 anyway."""
    dtype = torch.float32
    torch.manual_seed(0)
    with torch.device("cpu"):
        module = attention(model_type, q_lora_rank, device="cpu").to(dtype).eval()
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn_like(param) * 0.3)
    reference = copy.deepcopy(module)
    reference.config._attn_implementation = "eager"

    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        fused, applied = fuse_like_the_backend(module, mla_vllm_config)
    finally:
        torch.set_default_dtype(default)
    assert [type(f) for f in applied] == [MLAFuser, AttentionFuser]
    assert isinstance(fused.kv_b_proj, ColumnParallelLinear)
    assert isinstance(fused.o_proj, RowParallelLinear)
    if q_lora_rank:
        assert type(fused.fused_qkv_a_proj) is MergedColumnParallelLinear
        assert fused.fused_qkv_a_proj.disable_tp
        assert not hasattr(fused, "q_a_proj") and not hasattr(
            fused, "kv_a_proj_with_mqa"
        )
        assert isinstance(fused.q_b_proj, ColumnParallelLinear)
    else:
        assert isinstance(fused.kv_a_proj_with_mqa, ReplicatedLinear)
        assert isinstance(fused.q_proj, ColumnParallelLinear)

    tokens = 9
    hidden = torch.randn(1, tokens, HIDDEN, dtype=dtype)
    positions = torch.arange(tokens)[None]
    rotary = modeling_class(model_type, reference.config, "RotaryEmbedding")(
        reference.config
    )
    position_embeddings = rotary(hidden, positions)
    if isinstance(position_embeddings, tuple):
        position_embeddings = tuple(p.to(dtype) for p in position_embeddings)
    causal = torch.full((tokens, tokens), float("-inf"), dtype=dtype).triu(1)[
        None, None
    ]
    with torch.no_grad():
        expected, _ = reference(
            hidden, position_embeddings=position_embeddings, attention_mask=causal
        )
        actual, _ = fused(
            hidden, position_embeddings=position_embeddings, attention_mask=None
        )
    torch.testing.assert_close(actual, expected, atol=2e-5, rtol=1e-4)


# --- the backend, built in-process --------------------------------------------------


@pytest.fixture
def cpu_mla_kernel(monkeypatch):
    """The reference CPU MLA kernel, which runs float32 (an AMX host would otherwise
    pick its bf16-only kernel)."""
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)


@pytest.mark.parametrize(("model_type", "q_lora_rank"), VARIANTS, ids=IDS)
def test_backend_attaches_mla_attention_with_the_modules_kv_b(
    model_type, q_lora_rank, build_backend, cpu_mla_kernel
):
    model = build_backend(deepseek_config(model_type, q_lora_rank))
    for index, layer in enumerate(model.model.layers):
        module = layer.self_attn
        assert isinstance(module.attn, MLAAttention)
        assert module.attn.kv_b_proj is module.kv_b_proj
        assert (module.attn.num_heads, module.attn.kv_lora_rank) == (HEADS, RANK)
        assert (module.attn.qk_nope_head_dim, module.attn.qk_rope_head_dim) == (
            NOPE,
            ROPE,
        )
        assert (module.attn.v_head_dim, module.attn.q_lora_rank) == (
            V_HEAD,
            q_lora_rank,
        )
        assert module.attn.head_size == RANK + ROPE  # what one token caches: the latent
        assert module.attn.layer_name == f"model.layers.{index}.self_attn.attn"
        assert module.attn.scale == pytest.approx((NOPE + ROPE) ** -0.5)
    assert model.model.config._attn_implementation == "vllm_mla"
    assert [a.mla for a in model.report.attention] == [True, True]
    assert "(MLA)" in model.report.short()
    if q_lora_rank:
        assert model.packed_modules_mapping["fused_qkv_a_proj"] == [
            "q_a_proj",
            "kv_a_proj_with_mqa",
        ]


def test_backend_names_the_layer_that_did_not_fuse(
    build_backend, cpu_mla_kernel, monkeypatch
):
    mismatch = MLAFuser.mismatch

    def second_layer_differs(self, module, vllm_config):
        if module.layer_idx == 1:
            return "(test) this layer's widths differ"
        return mismatch(self, module, vllm_config)

    monkeypatch.setattr(MLAFuser, "mismatch", second_layer_differs)
    with pytest.raises(ValueError) as error:
        build_backend(deepseek_config("deepseek_v3", Q_RANK))
    message = str(error.value)
    assert message.startswith(
        "Decoder layer 1: model.layers.1 (DeepseekV3DecoderLayer)"
    )
    assert (
        "model.layers.1.self_attn (DeepseekV3Attention) did not fuse as latent"
        in message
    )
    assert "(test) this layer's widths differ" in message
    assert "VLLM_MLA_DISABLE=1" in message


@pytest.mark.parametrize(
    ("model_type", "q_lora_rank"), [VARIANTS[0], VARIANTS[3]], ids=[IDS[0], IDS[3]]
)
def test_backend_serves_plain_attention_when_mla_is_disabled(
    model_type, q_lora_rank, build_backend, monkeypatch
):
    monkeypatch.setenv("VLLM_MLA_DISABLE", "1")
    model = build_backend(deepseek_config(model_type, q_lora_rank))
    assert model.model.config._attn_implementation == "vllm"
    for layer in model.model.layers:
        module = layer.self_attn
        assert type(module.attn) is Attention
        # Query and key heads of qk_nope + qk_rope, values padded to them.
        assert (module.attn.num_heads, module.attn.num_kv_heads) == (HEADS, HEADS)
        assert module.attn.head_size == module.attn.head_size_v == NOPE + ROPE
        assert "forward" not in vars(module)  # the expanding forward of Transformers
        assert isinstance(module.kv_b_proj, nn.Module)
    assert [a.mla for a in model.report.attention] == [False, False]
