# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""QKVFuser: separate q/k/v projections -> one QKVParallelLinear + split."""

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig
from transformers.models.bert.modeling_bert import BertSelfAttention
from transformers.models.bitnet.modeling_bitnet import BitNetAttention
from transformers.models.llama.modeling_llama import LlamaAttention
from transformers.models.olmo2.modeling_olmo2 import Olmo2Attention
from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention

from vllm.model_executor.layers.linear import QKVParallelLinear, RowParallelLinear
from vllm.model_executor.models.transformers.plan import get_fuser, get_fusers
from vllm.model_executor.models.transformers.plan import key as registry_key
from vllm.model_executor.models.transformers.fusers import AttentionFuser, QKVFuser
from vllm.model_executor.models.transformers.fusers.heads import HeadLayout

HIDDEN, HEAD = 32, 8


class Attention(nn.Module):
    """A small attention in the usual HF style, dispatching through SDPA."""

    def __init__(self, heads: int = 4, kv_heads: int = 2, bias: bool = False):
        super().__init__()
        self.head_dim = HEAD
        self.q_proj = nn.Linear(HIDDEN, heads * HEAD, bias=bias)
        self.k_proj = nn.Linear(HIDDEN, kv_heads * HEAD, bias=bias)
        self.v_proj = nn.Linear(HIDDEN, kv_heads * HEAD, bias=bias)
        self.o_proj = nn.Linear(heads * HEAD, HIDDEN, bias=bias)

    def attend(self, q, k, v):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).flatten(2))

    def forward(self, hidden_states):
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q = self.q_proj(hidden_states).view(shape).transpose(1, 2)
        k = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).flatten(2))


class ScrambledAttention(nn.Module):
    """Names say nothing (`c` is the query, `a` the key, `b` the value) and the
    projections run value first."""

    def __init__(self):
        super().__init__()
        self.head_dim = HEAD
        self.a, self.b, self.c, self.out = (nn.Linear(HIDDEN, HIDDEN) for _ in range(4))

    def forward(self, x):
        shape = (*x.shape[:-1], -1, self.head_dim)
        value = self.b(x).view(shape).transpose(1, 2)
        query = self.c(x).view(shape).transpose(1, 2)
        key = self.a(x).view(shape).transpose(1, 2)
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True)
        return self.out(out.transpose(1, 2).flatten(2))


class HeadNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(HEAD))

    def forward(self, x):
        return (
            x
            * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype)
            * self.weight
        )


class NormedAttention(Attention):
    """Norms on q and k between the projections and the attention."""

    def __init__(self):
        super().__init__(heads=4, kv_heads=1)
        self.q_norm, self.k_norm = HeadNorm(), HeadNorm()

    def forward(self, hidden_states):
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q = self.q_norm(self.q_proj(hidden_states).view(shape)).transpose(1, 2)
        k = self.k_norm(self.k_proj(hidden_states).view(shape)).transpose(1, 2)
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        return self.attend(q, k, v)


class CrossAttention(Attention):
    def forward(self, hidden_states, context):
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q = self.q_proj(hidden_states).view(shape).transpose(1, 2)
        k = self.k_proj(context).view(shape).transpose(1, 2)
        v = self.v_proj(context).view(shape).transpose(1, 2)
        return self.attend(q, k, v)


class GatedQueryAttention(Attention):
    """The query projection also yields a gate: wider than the query heads."""

    def __init__(self):
        super().__init__(heads=2, kv_heads=2)
        self.q_proj = nn.Linear(HIDDEN, 2 * 2 * HEAD, bias=False)

    def forward(self, hidden_states):
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q, gate = self.q_proj(hidden_states).chunk(2, dim=-1)
        q = q.reshape(shape).transpose(1, 2)
        k = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).flatten(2) * gate.sigmoid())


class MixedBiasAttention(Attention):
    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(HIDDEN, 4 * HEAD, bias=True)


class StopsBeforeProjections(Attention):
    def forward(self, hidden_states):
        if hidden_states.abs().max() > 1e4:  # data-dependent: tracing stops here
            hidden_states = hidden_states.clamp(-1e4, 1e4)
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q = self.q_proj(hidden_states).view(shape).transpose(1, 2)
        k = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        return self.attend(q, k, v)


class StopsBeforeAttention(Attention):
    def forward(self, hidden_states):
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q = self.q_proj(hidden_states).view(shape).transpose(1, 2)
        k = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        if k.abs().max() > 1e4:
            k = k.clamp(-1e4, 1e4)
        return self.attend(q, k, v)


class StopsAfterOutput(Attention):
    def forward(self, hidden_states):
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q = self.q_proj(hidden_states).view(shape).transpose(1, 2)
        k = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        out = self.attend(q, k, v)
        if out.isnan().any():
            raise ValueError("NaN")
        return out


class ProjectionReadElsewhere(Attention):
    def forward(self, hidden_states):
        hidden_states = hidden_states.to(self.q_proj.weight.dtype)
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q = self.q_proj(hidden_states).view(shape).transpose(1, 2)
        k = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        return self.attend(q, k, v)


class WritesInPlaceBetween(Attention):
    """Doubles its input between the key and the value projection: hoisting the
    value projection above that write would compute it from the undoubled input."""

    def forward(self, hidden_states):
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q = self.q_proj(hidden_states).view(shape).transpose(1, 2)
        k = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        hidden_states.mul_(2)
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        return self.attend(q, k, v)


class AddsIntoAnAliasBetween(Attention):
    """Adds into its input through another name: the trace sees a new value under
    `alias` and the same input for all three projections, but eager PyTorch modifies
    `hidden_states` itself before the key and value projections."""

    def forward(self, hidden_states):
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q = self.q_proj(hidden_states).view(shape).transpose(1, 2)
        alias = hidden_states
        alias += 1
        k = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        return self.attend(q, k, v)


def tokens(dtype=torch.float32, width: int = HIDDEN, seed: int = 1) -> torch.Tensor:
    return torch.randn(
        2, 5, width, dtype=dtype, generator=torch.Generator().manual_seed(seed)
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gqa_projections_stack_into_qkv_parallel_linear(equivalent, dtype):
    fused, applied = equivalent(Attention(), tokens(dtype), dtype=dtype)
    assert isinstance(applied[0], QKVFuser)
    assert applied[0].shards == {"q_proj": "q", "k_proj": "k", "v_proj": "v"}
    assert isinstance(fused.qkv_proj, QKVParallelLinear)
    assert (fused.qkv_proj.total_num_heads, fused.qkv_proj.total_num_kv_heads) == (4, 2)
    assert isinstance(fused.o_proj, RowParallelLinear)
    assert not hasattr(fused, "q_proj")


def test_mqa_projections_stack(equivalent):
    fused, _ = equivalent(Attention(heads=4, kv_heads=1), tokens())
    assert fused.qkv_proj.total_num_kv_heads == 1


def test_roles_come_from_dataflow_not_names_or_call_order(equivalent):
    _, (fuser, *_) = equivalent(ScrambledAttention(), tokens())
    assert fuser.shards == {"c": "q", "a": "k", "b": "v"}
    assert fuser.fused_name == "cab"
    assert fuser.output_name == "out"


def test_q_k_norms_between_projection_and_attention_are_kept(equivalent):
    fused, applied = equivalent(NormedAttention(), tokens())
    assert isinstance(applied[0], QKVFuser)
    assert isinstance(fused.qkv_proj, QKVParallelLinear)


def test_weights_land_in_their_shards_through_stacked_weights(fuse):
    module = Attention(bias=True)
    q, k, v = (getattr(module, f"{n}_proj").bias.detach().clone() for n in "qkv")
    fused, (fuser,) = fuse(module)
    assert fuser.stacked_weights("model.layers.0.self_attn") == {
        f"model.layers.0.self_attn.{n}_proj.": ("model.layers.0.self_attn.qkv_proj.", n)
        for n in "qkv"
    }
    assert fuser.packed_modules_mapping == {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    torch.testing.assert_close(fused.qkv_proj.bias.data, torch.cat([q, k, v]))


def test_llama_attention_is_fused_through_the_attention_interface(equivalent):
    config = AutoConfig.for_model(
        "llama",
        hidden_size=HIDDEN,
        num_attention_heads=4,
        num_key_value_heads=2,
        attention_bias=True,
    )
    config._attn_implementation = "eager"
    cos, sin = tokens(width=HEAD, seed=2), tokens(width=HEAD, seed=3)
    _, applied = equivalent(
        LlamaAttention(config, layer_idx=0), tokens(), (cos, sin), None
    )
    assert [type(f).__name__ for f in applied] == ["QKVFuser"]


def test_qwen3_attention_with_head_norms_is_fused(equivalent):
    config = AutoConfig.for_model(
        "qwen3",
        hidden_size=HIDDEN,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=HEAD,
    )
    config._attn_implementation = "sdpa"
    cos, sin = tokens(width=HEAD, seed=2), tokens(width=HEAD, seed=3)
    _, applied = equivalent(
        Qwen3Attention(config, layer_idx=0), tokens(), (cos, sin), None
    )
    assert isinstance(applied[0], QKVFuser)
    # Per-head norms split with the heads.
    assert applied[0].whole_width_norms(Qwen3Attention(config, layer_idx=0)) == ()


def test_output_projection_is_found_when_tracing_stops_after_it(equivalent):
    _, applied = equivalent(StopsAfterOutput(), tokens())
    assert isinstance(applied[0], QKVFuser)


def test_nothing_is_matched_when_tracing_stops_before_the_projections(declined):
    assert get_fuser(StopsBeforeProjections(), QKVFuser) is None
    assert declined(QKVFuser) == []


@pytest.mark.parametrize(
    ("module", "reason"),
    [
        (CrossAttention(), "read different inputs"),
        (GatedQueryAttention(), "q is 32 wide but the attention gets 2 heads of 8"),
        (MixedBiasAttention(), "some of the projections have a bias"),
        (StopsBeforeAttention(), "did not reach a single attention call"),
        (ProjectionReadElsewhere(), "forward uses self.q_proj 2 times"),
        (WritesInPlaceBetween(), "`hidden_states` changes between"),
        (AddsIntoAnAliasBetween(), "`hidden_states` changes between"),
    ],
    ids=[
        "cross-attention",
        "gated-query",
        "mixed-bias",
        "trace-stops-before-attention",
        "projection-read-elsewhere",
        "in-place-method-between",
        "augmented-assignment-through-alias-between",
    ],
)
def test_near_misses_are_declined_with_a_reason(module, reason, declined):
    assert get_fuser(module, QKVFuser) is None
    assert any(reason in r for r in declined(QKVFuser)), declined(QKVFuser)


def test_instances_whose_heads_do_not_split_over_tp_ranks_are_not_fused(
    vllm_config, monkeypatch
):
    fuser = get_fuser(Attention(heads=3, kv_heads=1), QKVFuser)
    monkeypatch.setattr(vllm_config.parallel_config, "tensor_parallel_size", 2)
    assert not fuser.validate(Attention(heads=3, kv_heads=1), vllm_config)


def test_norms_over_all_heads_keep_the_fusion_off_under_tensor_parallelism(
    vllm_config, monkeypatch
):
    config = AutoConfig.for_model(
        "olmo2", hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=2
    )
    attention = Olmo2Attention(config, layer_idx=0)
    fuser = get_fuser(attention, QKVFuser)
    assert fuser.whole_width_norms(attention) == ("q_norm", "k_norm")
    assert fuser.validate(attention, vllm_config)
    monkeypatch.setattr(vllm_config.parallel_config, "tensor_parallel_size", 2)
    assert not fuser.validate(attention, vllm_config)


class NormedQueryKey(nn.Module):
    """q/k norms over the whole projection: weightless in some instances (no norm
    at all), over every head at once in others."""

    def __init__(self, norm: Callable[[int], nn.Module]):
        super().__init__()
        self.head_dim = 8
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (
            nn.Linear(HIDDEN, HIDDEN) for _ in range(4)
        )
        self.q_norm, self.k_norm = norm(HIDDEN), norm(HIDDEN)

    def forward(self, x):
        shape = (*x.shape[:-1], -1, self.head_dim)
        q = self.q_norm(self.q_proj(x)).view(shape).transpose(1, 2)
        k = self.k_norm(self.k_proj(x)).view(shape).transpose(1, 2)
        v = self.v_proj(x).view(shape).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).flatten(2))


def test_whole_width_norms_are_each_instances_own(vllm_config, monkeypatch):
    # The class is analysed on an instance without norms; one with norms over all
    # heads must still keep the fusion off at TP=2 (a rank holds half the heads).
    without = NormedQueryKey(lambda width: nn.Identity())
    with_norms = NormedQueryKey(lambda width: nn.RMSNorm(width))
    fuser = get_fuser(without, QKVFuser)
    assert get_fuser(with_norms, QKVFuser) is fuser
    monkeypatch.setattr(vllm_config.parallel_config, "tensor_parallel_size", 2)
    assert fuser.validate(without, vllm_config)
    assert "q_norm, k_norm normalise all heads together" in fuser.mismatch(
        with_norms, vllm_config
    )


def test_a_norm_over_the_whole_attention_output_keeps_the_fusion_off_under_tp(
    vllm_config, monkeypatch
):
    # BitNet normalises the attention output over all heads before `o_proj`: at
    # TP=2 each rank would normalise its half of the heads on its own.
    config = AutoConfig.for_model(
        "bitnet", hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=2
    )
    attention = BitNetAttention(config, layer_idx=0)
    fuser = get_fuser(attention, QKVFuser)
    assert fuser.validate(attention, vllm_config)
    monkeypatch.setattr(vllm_config.parallel_config, "tensor_parallel_size", 2)
    assert fuser.mismatch(attention, vllm_config) == (
        "attn_sub_norm act on the whole width between the attention and o_proj, of "
        "which each tensor-parallel rank holds only its share"
    )


def test_bert_projections_fuse_without_an_output_projection_of_their_own(
    equivalent, vllm_config, monkeypatch
):
    # BERT's output projection is a sibling's (`BertSelfOutput.dense`).
    config = AutoConfig.for_model("bert", hidden_size=HIDDEN, num_attention_heads=4)
    config._attn_implementation = "sdpa"
    fused, applied = equivalent(BertSelfAttention(config), tokens())
    assert [type(f).__name__ for f in applied] == ["QKVFuser"]
    assert applied[0].output_name == ""
    assert isinstance(fused.query_key_value, QKVParallelLinear)
    # Split over ranks, whatever reads the attention output would get a share of it.
    monkeypatch.setattr(vllm_config.parallel_config, "tensor_parallel_size", 2)
    assert "without an output projection" in applied[0].mismatch(
        BertSelfAttention(config), vllm_config
    )


def test_each_instance_reads_its_own_head_layout():
    fuser = get_fuser(Attention(heads=4, kv_heads=2), QKVFuser)
    assert fuser.layout(Attention(heads=6, kv_heads=3)).num_kv_heads == 3


def test_stands_beside_the_attention_fuser():
    config = AutoConfig.for_model("llama", hidden_size=HIDDEN, num_attention_heads=4)
    config._attn_implementation = "vllm"
    names = [type(f).__name__ for f in get_fusers(LlamaAttention(config, layer_idx=0))]
    # The rotary function's swap leaves the forward alone too.
    assert names == ["QKVFuser", "RotaryFuser", "AttentionFuser"]


# --- Gemma 4: layers without v_proj, where the key is also the value -------------------

GEMMA4_HEADS = dict(sliding=(16, 2), full=(32, 1))
"""Layer kind -> (head size, key/value heads): full layers have their own."""


def gemma4_attention(layer_idx: int, implementation: str = "sdpa", **overrides):
    """Layer 0 slides, with v_proj; layer 1 is full attention with wider heads and
    no v_proj (`attention_k_eq_v`): the key is reused as the value. Both are the last
    of their kind, so both write their key and value into `shared_kv_states`."""
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextAttention

    config = AutoConfig.for_model(
        "gemma4_text",
        hidden_size=HIDDEN * 2,
        num_attention_heads=4,
        num_key_value_heads=GEMMA4_HEADS["sliding"][1],
        head_dim=GEMMA4_HEADS["sliding"][0],
        global_head_dim=GEMMA4_HEADS["full"][0],
        num_global_key_value_heads=GEMMA4_HEADS["full"][1],
        attention_k_eq_v=True,
        num_hidden_layers=2,
        layer_types=["sliding_attention", "full_attention"],
        hidden_size_per_layer_input=0,
        **overrides,
    )
    config._attn_implementation = implementation
    return Gemma4TextAttention(config, layer_idx)


def gemma4_inputs(kind: str, dtype: torch.dtype = torch.float32) -> tuple:
    head_size = GEMMA4_HEADS[kind][0]
    cos, sin = tokens(dtype, head_size, seed=2), tokens(dtype, head_size, seed=3)
    return tokens(dtype, HIDDEN * 2), (cos, sin), None, {}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("layer_idx, kind", [(0, "sliding"), (1, "full")])
def test_gemma4_attention_with_and_without_v_proj_is_equivalent(
    equivalent, dtype, layer_idx, kind
):
    fused, (fuser, *_) = equivalent(
        gemma4_attention(layer_idx), *gemma4_inputs(kind, dtype), dtype=dtype
    )
    head_size, kv_heads = GEMMA4_HEADS[kind]
    merged = getattr(fused, fuser.fused_name)
    assert isinstance(merged, QKVParallelLinear)
    assert (merged.head_size, merged.total_num_kv_heads) == (head_size, kv_heads)
    assert not hasattr(fused, "q_proj") and not hasattr(fused, "k_proj")


def test_gemma4_layers_with_and_without_v_proj_are_analysed_apart(vllm_config):
    sliding, full = gemma4_attention(0), gemma4_attention(1)
    assert isinstance(sliding.v_proj, nn.Linear) and full.v_proj is None
    with_v, without_v = get_fuser(sliding, QKVFuser), get_fuser(full, QKVFuser)
    assert with_v.shards == {"q_proj": "q", "k_proj": "k", "v_proj": "v"}
    assert (with_v.fused_name, with_v.absent) == ("qkv_proj", ())
    # The value is computed from k_proj: q and k stack, the key's part is the value.
    assert without_v.shards == {"q_proj": "q", "k_proj": "k"}
    assert (without_v.fused_name, without_v.absent) == ("qk_proj", ("v_proj",))
    assert without_v.packed_modules_mapping == {"qk_proj": ["q_proj", "k_proj"]}
    assert without_v.layout(full) == HeadLayout(32, 4, 1, 0)
    assert with_v.validate(sliding, vllm_config)
    assert without_v.validate(full, vllm_config)
    fused = without_v.fuse(full, "self_attn", vllm_config)
    assert without_v.info("self_attn", fused) == (
        "Fused: q_proj + k_proj (self_attn: Gemma4TextAttention) -> qk_proj "
        "(QKVParallelLinear) (the key is the value); o_proj -> RowParallelLinear"
    )


def test_gemma4_guards_on_v_proj_fold_away():
    """The rewritten forwards no longer look for `v_proj`: the stacked one is gone,
    the absent one is `None` on every instance that takes the fusion."""
    for layer_idx in (0, 1):
        attention = gemma4_attention(layer_idx)
        names = get_fuser(attention, QKVFuser).fused_forward.__code__.co_names
        assert ("v_proj" in names) == (layer_idx == 1)  # only its dead branch


def test_gemma4_instance_holding_what_the_analysed_one_lacked_is_not_fused(
    vllm_config,
):
    fuser = get_fuser(gemma4_attention(1), QKVFuser)
    odd = gemma4_attention(1)
    odd.v_proj = lambda x: x  # not a child, but the forward branches on it
    # The registry analyses it on its own; the analysed fuser still declines it.
    assert registry_key(odd) != registry_key(gemma4_attention(1))
    assert "v_proj exist in this instance" in fuser.mismatch(odd, vllm_config)


def test_gemma4_attention_needs_its_own_heads_per_layer(vllm_config):
    """Per-layer head sizes and key/value heads: the full layer's are not the
    config's (which Transformers refuses to read globally)."""
    for layer_idx, kind in ((0, "sliding"), (1, "full")):
        attention = gemma4_attention(layer_idx, "vllm")
        fuser = get_fuser(attention, AttentionFuser)
        assert fuser.validate(attention, vllm_config)
        needs = fuser.attention_needs(attention, vllm_config)
        head_size, kv_heads = GEMMA4_HEADS[kind]
        assert (needs.head_size, needs.head_size_v) == (head_size, head_size)
        assert (needs.num_heads, needs.num_kv_heads) == (4, kv_heads)
        assert needs.scale == 1.0
        window = attention.config.sliding_window if kind == "sliding" else None
        assert needs.sliding_window == window
        assert needs.sources["v"] == ("v_proj" if kind == "sliding" else "k_proj")


class ValueFromQuery(nn.Module):
    """The query's projection reused as the value: not a key/value sharing."""

    def __init__(self):
        super().__init__()
        self.head_dim = HEAD
        self.q_proj, self.k_proj, self.o_proj = (
            nn.Linear(HIDDEN, HIDDEN) for _ in range(3)
        )

    def forward(self, x):
        shape = (*x.shape[:-1], -1, self.head_dim)
        q = self.q_proj(x).view(shape).transpose(1, 2)
        k = self.k_proj(x).view(shape).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, q, is_causal=True)
        return self.o_proj(out.transpose(1, 2).flatten(2))


def test_value_from_the_querys_projection_is_declined(declined):
    assert get_fuser(ValueFromQuery(), QKVFuser) is None
    assert any("nor the value from the key's" in r for r in declined(QKVFuser))
