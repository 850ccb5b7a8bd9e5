# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Tiny local checkpoints, their Transformers reference, and a vLLM engine runner.

Shared by the end-to-end tests, the demo and the benchmarks. There is no network and
no model hub here, so every model is built from `AutoConfig.for_model(model_type,
**overrides)` with seeded random weights and a word-level tokenizer, and saved (float32
safetensors) under `<repo>/.cache/tiny-models/<model_type>/`. A folder is rebuilt when
its recipe changes (a fingerprint is kept beside it).

Random tiny models have near-uniform logits, which would let float32 noise flip a greedy
choice. Weights are drawn with a large `initializer_range`, and every 1-D parameter
(norm weights, biases) is perturbed so that biases and norm weights actually matter;
`reference()` reports the smallest top-1/top-2 logit margin met along each greedy path
so tests can check it is comfortable.

Engines run in a fresh interpreter (`run_engine()`), so tensor-parallel settings and
`VLLM_TRANSFORMERS_BACKEND` never leak between tests; one start serves several prompts.

Command line (the engine runner uses the second form):
    python tiny.py build [MODEL_TYPE ...]      build (or reuse) and print the folders
    python tiny.py engine SPEC.json OUT.json   run one engine, write its outputs
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[3]
CACHE = Path(os.environ.get("TINY_MODELS_CACHE", REPO / ".cache" / "tiny-models"))
PYTHON = sys.executable

SEED = 0
FIRST_GOOD_SEED: dict[str, int] = {
    "afmoe": 4,
    "arcee": 3,
    "aria_text": 12,
    "bamba": 1,
    "bitnet": 3,
    "deepseek_v3_moe": 6,
    "ernie4_5_moe": 3,
    "falcon_h1": 2,
    "flex_olmo": 1,
    "gemma": 6,
    "gemma2": 3,
    "gemma4_text": 7,
    "glm4_moe": 3,
    "gpt2": 1,
    "gpt_bigcode": 2,
    "granite": 4,
    "granitemoehybrid": 3,
    "hunyuan_v1_dense": 2,
    "hunyuan_v1_moe": 3,
    "jais2": 1,
    "lfm2": 2,
    "lfm2_moe": 1,
    "llama": 10,
    "mamba2": 2,
    "mellum": 16,
    "minimax_m2": 7,
    "mistral": 2,
    "mixtral": 6,
    "nemotron_h": 1,
    "olmo": 5,
    "olmo2": 17,
    "olmo3": 3,
    "olmoe": 1,
    "opt": 2,
    "phi": 1,
    "phi3": 4,
    "qwen2_moe": 2,
    "qwen3_5_text": 42,
    "qwen3_next": 57,
    "qwen3": 5,
    "qwen3_moe": 5,
    "stablelm": 2,
    "starcoder2": 2,
    "vaultgemma": 2,
}
"""Where `build` starts its search for a recipe, past the seeds it found wanting
(the same checkpoint as a search from `SEED`, found without retrying them: a fresh
cache, as in CI, builds each model once). A changed recipe searches on from here."""
RECIPE_VERSION = 3
"""Bump to rebuild every cached folder after changing how models are made."""

# --- tokenizer ---------------------------------------------------------------------

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
SPECIAL_TOKENS = [PAD, BOS, EOS, UNK]
PAD_ID, BOS_ID, EOS_ID, UNK_ID = range(4)

WORDS = """
the a an one two three four five six seven eight nine ten red green blue yellow black
white small big old new good bad fast slow hot cold cat dog bird fish horse cow sheep
mouse lion tiger bear wolf fox tree flower grass river lake sea sky sun moon star rain
snow wind cloud house door window table chair bed book pen paper cup plate bread milk
water tea apple orange banana city road car bus train boat plane man woman child friend
king queen is was are were has had can will runs walks sees eats likes makes goes comes
and or but with without in on under over near far here there today tomorrow yesterday
very not all some many few
""".split()
VOCAB = SPECIAL_TOKENS + WORDS
VOCAB_SIZE = len(VOCAB)
assert len(set(VOCAB)) == VOCAB_SIZE, "duplicate words in the tiny vocabulary"

PROMPTS = [
    "the small cat sees a big dog near the river",
    "one two three four five",
    "today the king and the queen walks near the old city with many friend",
    "rain",
]
"""Prompts of different lengths (the longest plus the generation exceeds the sliding
windows below), written in the tiny vocabulary."""

MAX_TOKENS = 16
"""Greedy tokens generated per prompt."""

MAX_MODEL_LEN = 128


# --- architectures ------------------------------------------------------------------

COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,  # head_dim 32: the CPU attention's smallest
    num_key_value_heads=2,  # GQA
    max_position_embeddings=MAX_MODEL_LEN,
    tie_word_embeddings=False,
    pad_token_id=PAD_ID,
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
)

SLIDING_WINDOW = 8
"""Shorter than every prompt but one plus `MAX_TOKENS`: the window changes the output."""

GATED_DELTA_NETS: dict[str, Any] = dict(
    layer_types=["linear_attention", "full_attention"] * 2,
    head_dim=32,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
)
"""What the gated-delta-net recipes share (served in bfloat16: `MIN_MARGINS`)."""

MLA: dict[str, Any] = dict(
    num_key_value_heads=4,  # DeepSeek expands the latent to every head
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    qk_nope_head_dim=64,
    n_routed_experts=0,
    first_k_dense_replace=COMMON["num_hidden_layers"],
)
"""What the DeepSeek (MLA) recipes share."""

GEMMA4: dict[str, Any] = dict(
    head_dim=32,
    global_head_dim=64,
    num_global_key_value_heads=1,
    attention_k_eq_v=True,
    sliding_window=SLIDING_WINDOW,
    layer_types=["sliding_attention", "full_attention"] * 2,
    hidden_size_per_layer_input=0,
)
"""What the Gemma 4 recipes share (the attention of `gemma4_text`)."""

HYBRID_LAYERS: dict[str, Any] = dict(
    layer_types=["linear_attention", "full_attention"] * 2,
)
"""A hybrid decoder's layers: a state-space or linear-attention mixer, then attention."""

ARCHS: dict[str, dict[str, Any]] = {
    "llama": {},
    "mistral": dict(sliding_window=SLIDING_WINDOW),
    # Qwen2 has a bias on q/k/v (perturbed away from zero, see `Init`).
    "qwen2": {},
    # Qwen3 normalises q and k per head; head_dim is explicit.
    "qwen3": dict(head_dim=32),
    # Gemma2: alternating sliding/full layers, attention and final logit soft-capping,
    # a softmax scale from `query_pre_attn_scalar` (48**-0.5, not head_dim**-0.5),
    # tied embeddings.
    "gemma2": dict(
        head_dim=32,
        sliding_window=SLIDING_WINDOW,
        query_pre_attn_scalar=48,
        attn_logit_softcapping=4.0,
        final_logit_softcapping=12.0,
        tie_word_embeddings=True,
    ),
    # OPT: learned positions, LayerNorm, biases; scales q itself and passes scaling=1.0.
    "opt": dict(
        ffn_dim=256,
        word_embed_proj_dim=128,
        num_key_value_heads=None,
        intermediate_size=None,
        tie_word_embeddings=True,
    ),
    # Phi3 packs q/k/v in one `qkv_proj` and gate/up in one `gate_up_proj`.
    "phi3": dict(original_max_position_embeddings=MAX_MODEL_LEN),
    # GPT-NeoX: packed `query_key_value`, partial rotary, parallel residual, no GQA.
    "gpt_neox": dict(
        num_key_value_heads=None,
        rope_parameters=dict(
            rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25
        ),
        use_parallel_residual=True,
    ),
    # DeepSeek-V3 latent attention (MLA) with query LoRA, interleaved rotary. The CPU
    # MLA kernels need kv_lora_rank=512 and qk_rope_head_dim=64; heads of 64 + 64
    # (what plain attention gets with VLLM_MLA_DISABLE=1) and values of 64 (padded
    # there). Dense MLPs only (no experts: MoE is another backend class).
    "deepseek_v3": dict(**MLA, q_lora_rank=96, v_head_dim=64),
    # DeepSeek-V2: MLA without query LoRA (one `q_proj`), complex rotary, values as
    # wide as query/key heads.
    "deepseek_v2": dict(**MLA, q_lora_rank=None, v_head_dim=128),
    # --- dense architectures vLLM 0.32 routes to this backend by default ---
    # Arcee: Llama with a non-gated ReLU^2 MLP (up/down, no gate to fuse).
    "arcee": dict(head_dim=32),
    # CWM: Llama with llama3 rope scaling and one full layer in four, the others
    # sliding (config default `layer_types`: full, sliding x3). Its default rope
    # parameters still rescale the low frequencies here (Transformers warns that
    # their original 8192 positions exceed `max_position_embeddings`).
    "cwm": dict(head_dim=32, sliding_window=SLIDING_WINDOW),
    # GLM: rotary on half of each head, interleaved; q/k/v biases; packed
    # `gate_up_proj`.
    "glm": dict(head_dim=32),
    # GPTBigCode: multi-query attention (one KV head) packed in `c_attn` with q,
    # learned positions, LayerNorm, biases everywhere, tied embeddings.
    "gpt_bigcode": dict(
        n_inner=256,
        intermediate_size=None,
        num_key_value_heads=None,
        multi_query=True,
        tie_word_embeddings=True,
    ),
    # GPT-2: Conv1D linears (weights stored [in, out]), q/k/v packed in `c_attn`,
    # learned positions, LayerNorm, biases everywhere, tied embeddings.
    "gpt2": dict(
        n_inner=256,
        intermediate_size=None,
        num_key_value_heads=None,
        tie_word_embeddings=True,
    ),
    # HunYuan dense: q/k RMSNorm per head, applied after the rotary embedding.
    "hunyuan_v1_dense": dict(head_dim=32),
    # Jais2: LayerNorm, a non-gated ReLU^2 MLP, biases on attention and MLP.
    "jais2": dict(head_dim=32),
    # OLMo: LayerNorm without parameters; q/k/v clamped in place to +-clip_qkv (set
    # to clip part of them).
    "olmo": dict(clip_qkv=1.0),
    # OLMo 2: q/k RMSNorm over the whole projection width (all heads at once, not
    # per head), norms after each sublayer instead of before.
    "olmo2": {},
    # OLMo 3: OLMo 2 with sliding layers (config default `layer_types`: sliding x3,
    # then full).
    "olmo3": dict(sliding_window=SLIDING_WINDOW),
    # Phi: rotary on half of each head (`partial_rotary_factor` 0.5, its default),
    # attention and MLP in parallel from one LayerNorm, biases everywhere, including
    # the `lm_head`'s.
    "phi": {},
    # Seed-OSS: q/k/v biases without an o_proj bias; attention and residual dropout
    # (0.1 by default: must be off at inference).
    "seed_oss": dict(head_dim=32),
    # SmolLM3: no rotary on every fourth layer (NoPE: layer 3 here), tied embeddings.
    "smollm3": dict(tie_word_embeddings=True),
    # Starcoder2: LayerNorm, non-gated MLP, biases everywhere, sliding window on every
    # layer, tied embeddings.
    "starcoder2": dict(sliding_window=SLIDING_WINDOW, tie_word_embeddings=True),
    # VaultGemma: Gemma 2 without post-norms: alternating sliding/full layers,
    # attention and final logit soft-capping, `query_pre_attn_scalar` scale, scaled
    # tied embeddings. vLLM's CPU attention gives NaN once |q.k * scale| / softcap
    # passes ~88.7 (exp overflows in its tanh): with Gemma2's cap of 4 this model
    # reaches 38, so the cap is 10 (largest 15.6, kept under a quarter of the limit
    # by test_default_routed.py), which still changes the output.
    "vaultgemma": dict(
        head_dim=32,
        sliding_window=SLIDING_WINDOW,
        query_pre_attn_scalar=48,
        attn_logit_softcapping=10.0,
        final_logit_softcapping=12.0,
        tie_word_embeddings=True,
    ),
    # --- what vLLM 0.34 also routes to this backend by default (test_routed_034.py) ---
    # Gemma: embeddings scaled by sqrt(hidden) in their own module, RMSNorm weights
    # as (1 + w), a GELU-tanh GLU, tied embeddings.
    "gemma": dict(head_dim=32, tie_word_embeddings=True),
    # StableLM 2 (12B's layout): rotary on a quarter of each head, LayerNorm, q/k/v
    # biases, q and k LayerNorms per head (one module per head), attention and MLP
    # in parallel from one norm.
    "stablelm": dict(use_qkv_bias=True, qk_layernorm=True, use_parallel_residual=True),
    # --- beyond vLLM's default routes (test_coverage.py) ---
    # BitNet's layout, unquantised: RMSNorms over the whole attention output before
    # `o_proj` and over the whole gated product before `down_proj` (`attn_sub_norm`,
    # `ffn_sub_norm`), which one rank's share of the heads or of the intermediate
    # width cannot take. SiLU, not its ReLU^2 (no fused act-and-mul), so its GLU is
    # fused at TP=1.
    "bitnet": dict(head_dim=32, hidden_act="silu"),
    # Granite: Llama with four multipliers, all away from their default of 1: the
    # input embeddings, each residual branch, the softmax scale (not head_dim**-0.5)
    # and the logits, which its causal LM's forward divides by `logits_scaling`.
    "granite": dict(
        head_dim=32,
        embedding_multiplier=2.0,
        residual_multiplier=0.5,
        attention_multiplier=0.125,
        logits_scaling=4.0,
    ),
    # Gemma 4 text: sliding layers with heads of 32 and v_proj, full layers with
    # heads of 64, one KV head and no v_proj (`attention_k_eq_v`: the key is the
    # value), proportional rotary on a quarter of the full heads, q/k/v norms,
    # softmax scale 1. No per-layer input embeddings, no KV sharing.
    "gemma4_text": GEMMA4,
    # Gemma 3n text: AltUp (2 streams: predict, correct, the active one through the
    # layer), LAuReL low-rank residual, per-layer input embeddings (own vocabulary
    # table plus a projection of the embeddings) gated into every layer, q/k/v norms
    # (v without weight), softmax scale 1, alternating sliding/full layers with their
    # own rope thetas, final logit soft-capping. The last two layers (one of each
    # type) have no k/v projections: they attend to the keys and values of the last
    # earlier layer of their type (`num_kv_shared_layers`). No activation sparsity.
    "gemma3n_text": dict(
        head_dim=32,
        sliding_window=SLIDING_WINDOW,
        layer_types=["sliding_attention", "full_attention"] * 2,
        intermediate_size=[256] * 4,
        laurel_rank=16,
        hidden_size_per_layer_input=16,
        vocab_size_per_layer_input=VOCAB_SIZE,
        num_kv_shared_layers=2,
        activation_sparsity_pattern=[0.0] * 4,
        altup_num_inputs=2,
        altup_active_idx=0,
        altup_coef_clip=120.0,
    ),
    # --- mixtures of experts (test_moe_end_to_end.py): 8 experts of width 64, two
    # per token, every layer sparse unless said otherwise ---
    # Qwen3-MoE: softmax router in float32, top-k renormalised.
    "qwen3_moe": dict(
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        norm_topk_prob=True,
    ),
    # Mixtral: `block_sparse_moe` with `w1`/`w2`/`w3` experts in the checkpoint,
    # renamed by Transformers; softmax top-k renormalised.
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=64),
    # Qwen2-MoE: top-k not renormalised, and a shared expert behind a sigmoid gate.
    "qwen2_moe": dict(
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=128,
        norm_topk_prob=False,
    ),
    # OLMoE: q/k norms over the whole projection width, top-k not renormalised.
    "olmoe": dict(num_experts=8, num_experts_per_tok=2, intermediate_size=64),
    # FlexOlmo: OLMo 2's norms after each sublayer, with experts.
    "flex_olmo": dict(num_experts=8, num_experts_per_tok=2, intermediate_size=64),
    # HunYuan MoE: float32 router, top-k renormalised, a shared MLP beside the
    # experts, q/k norms after the rotary embedding.
    "hunyuan_v1_moe": dict(
        head_dim=32, num_experts=8, moe_topk=2, intermediate_size=64
    ),
    # Mellum: sliding layers and sparse layers as the config lists them.
    "mellum": dict(
        head_dim=32,
        num_local_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        sliding_window=SLIDING_WINDOW,
        layer_types=["sliding_attention", "full_attention"] * 2,
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
    ),
    # gpt-oss: experts with biases and a clamped SwiGLU (gate and up interleaved,
    # stored transposed), a router with a bias whose top-k logits are softmaxed,
    # attention sinks, alternating sliding/full layers.
    "gpt_oss": dict(
        head_dim=32,
        num_local_experts=8,
        num_experts_per_tok=2,
        intermediate_size=64,
        sliding_window=SLIDING_WINDOW,
        layer_types=["sliding_attention", "full_attention"] * 2,
    ),
    # MiniMax-M2: sigmoid router choosing with a correction bias its block keeps
    # (and hands in), top-k renormalised; q/k norms over the whole projection width,
    # rotary on half of each head.
    "minimax_m2": dict(
        head_dim=32,
        num_local_experts=8,
        num_experts_per_tok=2,
        intermediate_size=64,
        partial_rotary_factor=0.5,
    ),
    # AFMoE: a first dense layer, then sigmoid routing with the block's `expert_bias`
    # handed in to choose, renormalised and scaled by `route_scale`; a shared
    # expert; gated attention with q/k norms; sliding and full layers.
    "afmoe": dict(
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        num_dense_layers=1,
        num_shared_experts=1,
        route_scale=2.0,
        sliding_window=SLIDING_WINDOW,
        global_attn_every_n_layers=2,
    ),
    # DeepSeek-V3 with real MoE layers after a first dense one: sigmoid scores with a
    # correction bias (perturbed) choosing, grouped top-k (2 of 4 groups), the chosen
    # scores renormalised and scaled by `routed_scaling_factor`, a shared expert.
    "deepseek_v3_moe": dict(
        **{**MLA, "first_k_dense_replace": 1, "n_routed_experts": 8},
        q_lora_rank=96,
        v_head_dim=64,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        n_group=4,
        topk_group=2,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
    ),
    # GLM-4.5: a first dense layer, then sigmoid scores with a correction bias
    # (perturbed) choosing, renormalised and scaled by `routed_scaling_factor`, a
    # shared expert; q/k norms per head, rotary on half of each head, q/k/v biases.
    "glm4_moe": dict(
        head_dim=32,
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        first_k_dense_replace=1,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        use_qk_norm=True,
        attention_bias=True,
        partial_rotary_factor=0.5,
    ),
    # Ernie 4.5 MoE: a first dense layer, then softmax routing whose choice a child
    # module corrects (`moe_statics`, perturbed), renormalised with a floor
    # (`moe_norm_min`); shared experts.
    "ernie4_5_moe": dict(
        head_dim=32,
        moe_num_experts=8,
        moe_k=2,
        moe_intermediate_size=64,
        moe_num_shared_experts=1,
        moe_layer_start_index=1,
    ),
    # Aria's decoder: experts stored transposed, top-k named `moe_topk`, softmax
    # top-k renormalised, a shared MLP beside the experts.
    "aria_text": dict(
        head_dim=32,
        moe_num_experts=8,
        moe_topk=2,
        intermediate_size=64,
        moe_num_shared_experts=1,
    ),
    # Gemma 4 with experts (the 26B-A4B's layout): in every layer a dense MLP beside
    # GELU-tanh experts fed the layer's input, their top-k named `top_k_experts`, a
    # router of its own (a norm, a learned input scale, a per-expert scale on the
    # chosen weights), each branch normed before the two are summed; the attention
    # as in the `gemma4_text` recipe.
    "gemma4_moe": dict(
        **GEMMA4,
        enable_moe_block=True,
        num_experts=8,
        top_k_experts=2,
        moe_intermediate_size=64,
    ),
    # Granite 4.0 hybrid: Mamba-2 mixers (8 heads of 32, state 16) in layers 0 and
    # 2, attention in 1 and 3, every layer a mixture of experts beside a shared MLP.
    "granitemoehybrid": dict(
        **HYBRID_LAYERS,
        mamba_n_heads=8,
        mamba_d_head=32,
        mamba_d_state=16,
        mamba_n_groups=1,
        num_local_experts=4,
        num_experts_per_tok=2,
        intermediate_size=64,
        shared_intermediate_size=128,
    ),
    # Bamba: Mamba-2 mixers with two B/C groups (its gated norm is not grouped), in
    # layers 0 and 2; rotary attention in 1 and 3; a dense MLP.
    "bamba": dict(
        attn_layer_indices=[1, 3],
        mamba_n_heads=8,
        mamba_d_head=32,
        mamba_d_state=16,
        mamba_n_groups=2,
    ),
    # Nemotron-H: a Mamba-2 mixer (8 heads of 32 in 2 B/C groups, its norm per
    # group, its time steps clamped from `time_step_min` in a prefill: 0.05, not
    # 0.001, so that the clamp moves the output), attention, a second mixer and a
    # mixture of non-gated (relu²) experts, one per layer.
    "nemotron_h": dict(
        time_step_min=0.05,
        time_step_max=0.2,
        layer_types=["linear_attention", "full_attention", "linear_attention", "moe"],
        mamba_num_heads=8,
        mamba_head_dim=32,
        ssm_state_size=16,
        n_groups=2,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        moe_shared_expert_intermediate_size=64,
        n_group=1,
        topk_group=1,
    ),
    # Falcon-H1: in every layer a Mamba-2 mixer (8 heads of 32, one B/C group, no
    # norm: `y * silu(z)`) beside attention, summed; the mixer's input scaled by a
    # constant and its in_proj's output per part (`ssm_multipliers`, Transformers'
    # `mup_vector`), attention's input, keys and output scaled, the MLP's gate and
    # down projection scaled, the embeddings and the logits scaled.
    "falcon_h1": dict(
        mamba_n_heads=8,
        mamba_d_head=32,
        mamba_d_ssm=256,
        mamba_d_state=16,
        mamba_n_groups=1,
        ssm_multipliers=[0.5, 1.5, 0.8, 1.25, 2.0],
        ssm_in_multiplier=0.7,
        ssm_out_multiplier=1.3,
        attention_in_multiplier=0.9,
        attention_out_multiplier=1.1,
        key_multiplier=0.6,
        mlp_multipliers=[0.8, 1.25],
        embedding_multiplier=2.0,
        lm_head_multiplier=0.5,
    ),
    # Mamba-2 alone: four mixers (8 heads of 32, two B/C groups, the gated norm
    # over the whole width), no attention.
    "mamba2": dict(num_heads=8, head_dim=32, state_size=16, n_groups=2, expand=2),
    # LFM2: short convolutions (kernel 3, with biases) in layers 0 and 2, attention
    # (q and k normed per head) in 1 and 3, tied embeddings; `conv_dim` and
    # `block_dim` as LiquidAI's checkpoints carry them (vLLM's native model reads
    # them, Transformers does not).
    "lfm2": dict(
        layer_types=["conv", "full_attention"] * 2,
        conv_L_cache=3,
        conv_bias=True,
        block_auto_adjust_ff_dim=False,
        tie_word_embeddings=True,
        conv_dim=128,
        block_dim=128,
    ),
    # LFM2-MoE: LFM2's layers, a dense MLP in layer 0, then 4 experts (top 2, their
    # choice corrected by a per-expert bias) in layers 1-3.
    "lfm2_moe": dict(
        layer_types=["conv", "full_attention"] * 2,
        conv_L_cache=3,
        conv_bias=True,
        tie_word_embeddings=True,
        num_dense_layers=1,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
    ),
    # Qwen3-Next: gated delta nets (2 key heads shared by 4 value heads, each of
    # 128: the CPU kernel's size) in layers 0 and 2, attention with a gated query
    # and normed q/k in 1 and 3, experts beside a gated shared expert in every layer.
    "qwen3_next": dict(
        GATED_DELTA_NETS,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
    ),
    # Qwen3.5: the same mixers with four input projections, a dense MLP.
    "qwen3_5_text": dict(GATED_DELTA_NETS),
}
"""Recipe name -> config overrides on top of `COMMON` (`None` drops a common key).
The recipe name is the `model_type`, or a variant of one (`VARIANTS`)."""

VARIANTS = {"deepseek_v3_moe": "deepseek_v3", "gemma4_moe": "gemma4_text"}
"""Recipes that are a variant of another model type: their `model_type`."""


@dataclass(frozen=True)
class Init:
    """How a tiny model's random weights are drawn.

    The body is kept well conditioned (hidden states of order 10, not 100s: float32
    error grows with them) and the logits are sharpened at the very end instead."""

    std: float = 0.1
    """`initializer_range` (OPT: `init_std`) for matrices and embeddings."""
    perturb: float = 0.1
    """Std of noise added to every 1-D parameter, so norm weights and biases matter."""
    embed_scale: float = 1.0
    """Multiplies the input embeddings after init."""
    head_scale: float = 2.0
    """Multiplies the logits: the untied `lm_head`, or the `final_norm` if tied."""
    final_norm: str | None = None
    """The final LayerNorm (weight and bias scaled) of a model with tied embeddings."""


INITS: dict[str, Init] = {
    # Tied embeddings, which at full size swamp the residual stream, so the model only
    # repeats its input. Gemma2 also scales them by sqrt(hidden); its final norm is
    # (1 + w), so its logits are left as they come.
    "gemma2": Init(std=0.4, perturb=1.0, embed_scale=0.2, head_scale=1.0),
    "opt": Init(
        std=0.2,
        embed_scale=0.25,
        head_scale=6.0,
        final_norm="model.decoder.final_layer_norm",
    ),
    # Seed 0 only just clears MIN_MARGIN at the default head scale.
    "glm": Init(head_scale=4.0),
    # Tied embeddings: the logits are sharpened through the final norm.
    "gpt_bigcode": Init(
        std=0.2, embed_scale=0.25, head_scale=6.0, final_norm="transformer.ln_f"
    ),
    "gpt2": Init(
        std=0.2, embed_scale=0.25, head_scale=6.0, final_norm="transformer.ln_f"
    ),
    "smollm3": Init(head_scale=4.0, final_norm="model.norm"),
    "starcoder2": Init(head_scale=4.0, final_norm="model.norm"),
    # As Gemma2.
    "gemma": Init(std=0.4, perturb=1.0, embed_scale=0.2, head_scale=1.0),
    # As Gemma2, but without post-norms the embeddings need more weight to give
    # well-separated logits.
    "vaultgemma": Init(std=0.4, perturb=1.0, embed_scale=0.4, head_scale=1.0),
    # Its forward divides the logits by `logits_scaling` (4): sharpened 4x as much.
    "granite": Init(head_scale=8.0),
    "lfm2": Init(head_scale=4.0, final_norm="model.embedding_norm"),
    "lfm2_moe": Init(head_scale=4.0, final_norm="model.embedding_norm"),
    # Served in bfloat16: at the default std, rounding the gated delta nets' inputs
    # to bfloat16 moves Transformers' own log-probabilities by up to 5 (teacher-forced
    # against float32); at 0.02 (real checkpoints' `initializer_range`) by 0.05.
    "qwen3_next": Init(std=0.02, head_scale=8.0),
    "qwen3_5_text": Init(std=0.02, head_scale=8.0),
}

MIN_MARGIN = 0.02
"""Smallest top-1/top-2 logit gap accepted on the greedy paths of `PROMPTS`: some 1000x
the float32 differences between two correct implementations (~1e-5)."""
MIN_MARGINS: dict[str, float] = {"qwen3_next": 0.04, "qwen3_5_text": 0.04}
"""Recipes served in bfloat16 (vLLM's CPU gated-delta-net kernels take nothing else),
whose logits two correct implementations round some 1e-2 apart."""


def min_margin(model_type: str) -> float:
    return MIN_MARGINS.get(model_type, MIN_MARGIN)
MAX_SEED_TRIES = 64


def overrides(model_type: str) -> dict[str, Any]:
    """The config keyword arguments for `model_type`'s tiny model."""
    if model_type not in ARCHS:
        raise KeyError(f"no tiny recipe for {model_type!r}; known: {sorted(ARCHS)}")
    merged = {**COMMON, **ARCHS[model_type]}
    std = INITS.get(model_type, Init()).std
    merged["init_std" if model_type == "opt" else "initializer_range"] = std
    # `None` drops a common key; for any other key it is the value (q_lora_rank=None).
    return {k: v for k, v in merged.items() if v is not None or k not in COMMON}


def fingerprint(model_type: str) -> str:
    recipe = dict(
        version=RECIPE_VERSION,
        seed=SEED,
        model_type=model_type,
        overrides=overrides(model_type),
        init=asdict(INITS.get(model_type, Init())),
        vocab=VOCAB,
        prompts=PROMPTS,
        max_tokens=MAX_TOKENS,
        min_margin=min_margin(model_type),
    )
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]


def make_tokenizer():
    """A word-level fast tokenizer over `VOCAB` that prepends `<s>`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(
        models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token=UNK)
    )
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, BOS_ID)]
    )
    # WordPiece's decoder joins words with spaces (no "##" continuation in this vocab),
    # which also makes vLLM's incremental detokenizer put the spaces back.
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        pad_token=PAD,
        model_max_length=MAX_MODEL_LEN,
    )


def _quiet_transformers() -> None:
    """No progress bars from Transformers (loading and saving tiny models is instant)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def _random_model(model_type: str, seed: int):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    init = INITS.get(model_type, Init())
    config = AutoConfig.for_model(
        VARIANTS.get(model_type, model_type), **overrides(model_type)
    )
    config.dtype = torch.float32
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(
        config, dtype=torch.float32, attn_implementation="eager"
    )
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            # Expert biases are one row per expert: 1-D parameters all the same.
            if param.ndim == 1 or name.endswith("_bias"):
                param.add_(torch.randn(param.shape, generator=generator) * init.perturb)
        # Buffers a checkpoint holds and a forward reads (DeepSeek's score
        # correction bias), away from their zeros too.
        for name, buffer in sorted(model.named_buffers()):
            if name.endswith("_bias") and buffer.is_floating_point():
                buffer.add_(torch.randn(buffer.shape, generator=generator) * init.perturb)
        embeddings = model.get_input_embeddings().weight
        embeddings.mul_(init.embed_scale)
        head = model.get_output_embeddings().weight
        if head is not embeddings:
            head.mul_(init.head_scale)
        elif init.final_norm is not None:
            for param in model.get_submodule(init.final_norm).parameters():
                param.mul_(init.head_scale)
        elif init.head_scale != 1.0:
            raise ValueError(
                f"{model_type}: tied embeddings, so `head_scale` needs `final_norm`"
            )
    # Never stop early: no eos for generation (vLLM is run with `ignore_eos`).
    model.generation_config = GenerationConfig(
        do_sample=False,
        bos_token_id=BOS_ID,
        pad_token_id=PAD_ID,
        eos_token_id=None,
        max_new_tokens=MAX_TOKENS,
    )
    return model.eval()


def build(model_type: str, *, force: bool = False) -> Path:
    """Build (or reuse) the tiny checkpoint folder for `model_type`; returns it.

    Seeds are tried from `FIRST_GOOD_SEED` (else `SEED`) until the greedy paths of
    `PROMPTS` keep every top-1/top-2 logit gap above `MIN_MARGIN`; the seed and the
    margin are kept in `tiny.json`."""
    target = CACHE / model_type
    stamp = target / "tiny.json"
    want = fingerprint(model_type)
    if not force and stamp.is_file():
        try:
            if json.loads(stamp.read_text()).get("fingerprint") == want:
                return target
        except (OSError, ValueError):
            pass

    _quiet_transformers()
    prompt_ids = encode(None, PROMPTS)
    best = (float("-inf"), None)
    first = FIRST_GOOD_SEED.get(model_type, SEED)
    for seed in range(first, first + MAX_SEED_TRIES):
        model = _random_model(model_type, seed)
        margin = min(min(c.margins) for c in greedy(model, prompt_ids, MAX_TOKENS))
        best = max(best, (margin, seed), key=lambda b: b[0])
        if margin >= min_margin(model_type):
            break
    else:
        raise RuntimeError(
            f"no seed in {first}..{first + MAX_SEED_TRIES - 1} gives {model_type} a greedy "
            f"margin of {min_margin(model_type)} (best {best[0]:.4g} with seed "
            f"{best[1]})"
        )

    CACHE.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{model_type}-", dir=CACHE))
    try:
        model.save_pretrained(staging, safe_serialization=True)
        make_tokenizer().save_pretrained(staging)
        (staging / "tiny.json").write_text(
            json.dumps(
                dict(
                    fingerprint=want,
                    model_type=model_type,
                    seed=seed,
                    min_margin=margin,
                    init=asdict(INITS.get(model_type, Init())),
                    overrides=overrides(model_type),
                ),
                indent=2,
            )
        )
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def load_tokenizer(path: Path | str):
    """The checkpoint's tokenizer as saved.

    Not `AutoTokenizer`: for a few model types (qwen2 among them) Transformers 5 swaps
    in the architecture's own tokenizer class, which rebuilds a byte-level pipeline
    over our word-level vocabulary. vLLM loads it through `AutoTokenizer`, so its
    *text* is wrong for those types; tests pass token ids and compare ids."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(path))


def encode(path: Path | str | None, prompts: list[str] = PROMPTS) -> list[list[int]]:
    """Prompt token ids as the tiny tokenizer makes them (`<s>` first)."""
    tokenizer = make_tokenizer() if path is None else load_tokenizer(path)
    ids = [tokenizer(p)["input_ids"] for p in prompts]
    for prompt, row in zip(prompts, ids):
        assert UNK_ID not in row, (
            f"prompt {prompt!r} has words outside the tiny vocabulary"
        )
        assert row[0] == BOS_ID, "the tiny tokenizer did not prepend <s>"
    return ids


# --- Transformers reference -----------------------------------------------------------


@dataclass
class Completion:
    """Greedy continuation of one prompt."""

    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    """Log-probability of each chosen token (from raw logits, float32)."""
    margins: list[float] = field(default_factory=list)
    """Top-1 minus top-2 logit at each step."""
    text: str = ""


def greedy(model, prompt_ids: list[list[int]], max_tokens: int) -> list[Completion]:
    """Transformers' greedy `generate`, one prompt at a time (no padding)."""
    import torch

    completions = []
    for ids in prompt_ids:
        input_ids = torch.tensor([ids])
        with torch.no_grad():
            out = model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=max_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=PAD_ID,
                output_logits=True,
                return_dict_in_generate=True,
            )
        token_ids = out.sequences[0, len(ids) :].tolist()
        assert len(token_ids) == max_tokens, "Transformers stopped early"
        logprobs, margins = [], []
        for token, logits in zip(token_ids, out.logits):
            logits = logits[0].to(torch.promote_types(logits.dtype, torch.float32))
            assert int(torch.argmax(logits)) == token
            logprobs.append(torch.log_softmax(logits, dim=-1)[token].item())
            top2 = torch.topk(logits, 2).values
            margins.append((top2[0] - top2[1]).item())
        completions.append(
            Completion(
                prompt_ids=list(ids),
                token_ids=token_ids,
                logprobs=logprobs,
                margins=margins,
            )
        )
    return completions


def reference(
    path: Path | str,
    prompts: list[str] = PROMPTS,
    max_tokens: int = MAX_TOKENS,
    dtype: str = "float32",
    **config_changes: Any,
) -> list[Completion]:
    """Transformers' greedy `generate` in `dtype` with eager attention.

    `config_changes` edit the checkpoint's config first (e.g. `sliding_window=None`,
    to show that a feature changes the output)."""
    import torch
    from transformers import AutoModelForCausalLM

    _quiet_transformers()
    tokenizer = load_tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(
        str(path),
        dtype=getattr(torch, dtype),
        attn_implementation="eager",
        **config_changes,
    ).eval()
    completions = greedy(model, encode(path, prompts), max_tokens)
    for c in completions:
        c.text = continuation_text(tokenizer, c.prompt_ids, c.token_ids)
    return completions


def continuation_text(tokenizer, prompt_ids: list[int], token_ids: list[int]) -> str:
    """The text the continuation adds to the prompt's text, the way vLLM's incremental
    detokenizer reports it (so with the space that separates it from the prompt)."""
    prompt = tokenizer.decode(prompt_ids, skip_special_tokens=True)
    full = tokenizer.decode(prompt_ids + token_ids, skip_special_tokens=True)
    assert full.startswith(prompt), (prompt, full)
    return full[len(prompt) :]


# --- vLLM engine, in a fresh interpreter ------------------------------------------------


@dataclass
class EngineRun:
    """What one engine start produced."""

    completions: list[Completion]
    probe: list[dict[str, Any]] | None
    """Per worker: what `_probe` saw inside the worker process (when asked)."""
    seconds: float
    log: str
    kv_cache: list[dict[str, dict[str, Any]]] | None = None
    """Per worker: the KV cache spec of each attention layer, as the engine sizes its
    cache from it (`_kv_cache_probe`, when asked)."""
    spec_decode: dict[str, Any] | None = None
    """vLLM's speculative decoding counters (`vllm:spec_decode_*`), when asked."""


def run_engine(
    path: Path | str,
    prompts: list[str] = PROMPTS,
    *,
    model_impl: str = "transformers",
    backend: str = "project",
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    max_tokens: int = MAX_TOKENS,
    probe: bool = False,
    llm_kwargs: dict[str, Any] | None = None,
    timeout: float = 600,
    kv_cache: bool = False,
    extra_env: dict[str, str] | None = None,
    lora: Path | str | None = None,
    spec_decode: bool = False,
) -> EngineRun:
    """Start `vllm.LLM` in a subprocess, generate greedily with logprobs, return it.

    `backend` sets `VLLM_TRANSFORMERS_BACKEND` (`"project"` or `"stock"`); with
    `tensor_parallel_size=2` each worker is bound to its own core, and so with
    `pipeline_parallel_size=2` (`PIPELINE_PARALLEL`: compiled, a worker process per
    stage). `probe` also runs
    `_probe` on the model inside each worker (`LLM.apply_model`); `kv_cache` reads
    each worker's KV cache spec (`_kv_cache_probe`). `extra_env` is added to the
    engine's environment (e.g. `VLLM_MLA_DISABLE=1`). `lora` is a PEFT adapter folder:
    the engine starts with `enable_lora=True` and every prompt runs with it.
    `spec_decode` also returns vLLM's speculative decoding counters (drafts, draft
    tokens, accepted tokens, accepted per position)."""
    if pipeline_parallel_size > 1:
        llm_kwargs = dict(
            PIPELINE_PARALLEL,
            pipeline_parallel_size=pipeline_parallel_size,
            **(llm_kwargs or {}),
        )
    spec = dict(
        model=str(path),
        prompt_token_ids=encode(path, prompts),
        model_impl=model_impl,
        tensor_parallel_size=tensor_parallel_size,
        max_tokens=max_tokens,
        probe=probe,
        kv_cache=kv_cache,
        llm_kwargs=llm_kwargs or {},
        lora=None if lora is None else str(lora),
        spec_decode=spec_decode,
    )
    env = dict(os.environ)
    env["VLLM_TRANSFORMERS_BACKEND"] = backend
    env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # apply_model ships a function
    env.setdefault("VLLM_LOGGING_LEVEL", "INFO")
    workers = tensor_parallel_size * pipeline_parallel_size
    if workers > 1:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i) for i in range(workers))
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(__file__).resolve().parent), *filter(None, [env.get("PYTHONPATH")])]
    )
    env.pop("PYTEST_CURRENT_TEST", None)
    env.update(extra_env or {})
    out, seconds, log = run_engine_script(__file__, spec, env, timeout)
    return EngineRun(
        completions=[Completion(**c) for c in out["completions"]],
        probe=out["probe"],
        kv_cache=out.get("kv_cache"),
        spec_decode=out.get("spec_decode"),
        seconds=seconds,
        log=log,
    )


def run_engine_script(
    script: str, spec: dict[str, Any], env: dict[str, str], timeout: float
) -> tuple[dict[str, Any], float, str]:
    """Run `python script engine SPEC OUT` in its own session (killed with whatever
    it started when done), bounded by `timeout`; returns the JSON it wrote to OUT,
    the seconds it took and its log. A failure raises with the engine's first
    traceback.

    The engine core runs in the script's own process unless `env` says otherwise
    (`VLLM_ENABLE_V1_MULTIPROCESSING=0`): the model is built and run by the same code
    either way, and a start takes about 22 s instead of 50, two interpreters fewer
    importing vLLM and torch. Tensor-parallel ranks are still worker processes of
    their own; the OpenAI server tests run vLLM's processes as users do."""
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", **env}
    with tempfile.TemporaryDirectory(prefix="tiny-engine-") as tmp:
        spec_file, out_file = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_file.write_text(json.dumps(spec))
        start = time.monotonic()
        process = subprocess.Popen(
            [PYTHON, script, "engine", str(spec_file), str(out_file)],
            env=env,
            cwd=tmp,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
        )
        try:
            log, _ = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            stop(process, grace=5)
            log, _ = process.communicate()
            raise RuntimeError(
                f"engine did not finish in {timeout:.0f} s:\n{_tail(log)}"
            ) from None
        finally:
            stop(process, grace=5)  # and whatever it left behind in its session
        seconds = time.monotonic() - start
        if process.returncode != 0 or not out_file.is_file():
            raise RuntimeError(
                f"engine exited with {process.returncode}:\n{_failure(log)}"
            )
        return json.loads(out_file.read_text()), seconds, log


def _tail(text: str | bytes | None, lines: int = 80) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return "\n".join((text or "").splitlines()[-lines:])


TRACEBACK = "Traceback (most recent call last):"


def first_traceback(log: str, max_lines: int = 80) -> str | None:
    """The first traceback in an engine log, through its exception line.

    The root cause is usually there: a failed worker makes the engine core, then the
    `LLM` in the main process, fail in turn, and their tracebacks fill the tail. Lines
    from engine processes carry a prefix such as `(EngineCore_DP0 pid=12) `, kept as
    the traceback's own."""
    lines = log.splitlines()
    start = next((i for i, line in enumerate(lines) if TRACEBACK in line), None)
    if start is None:
        return None
    prefix = lines[start][: lines[start].index(TRACEBACK)]
    block = [lines[start]]
    for line in lines[start + 1 : start + max_lines]:
        if not line.startswith(prefix):
            continue  # another process's line, interleaved
        block.append(line)
        body = line[len(prefix) :]
        if body and not body[0].isspace():
            break  # the exception line (frames and their source are indented)
    return "\n".join(block)


def _failure(log: str) -> str:
    """What a failed engine run shows: its first traceback, then the log's tail."""
    first = first_traceback(log)
    head = f"first traceback in the engine log:\n{first}\n\n" if first else ""
    return f"{head}log tail:\n{_tail(log, 40)}"


def _probe(model) -> dict[str, Any]:
    """Runs inside a vLLM worker on the model: where its code came from, and what the
    backend attached."""
    import inspect
    import os
    import sys

    import vllm_transformers_overlay as overlay

    package = sys.modules.get("vllm.model_executor.models.transformers")
    attached = []
    for name, module in model.named_modules():
        attn = getattr(module, "attn", None)
        if attn is not None and type(attn).__name__ in (
            "Attention",
            "EncoderOnlyAttention",
            "MLAAttention",
        ):
            impl = getattr(attn, "impl", None)
            attached.append(
                dict(
                    module=name,
                    module_class=type(module).__name__,
                    attn_class=type(attn).__name__,
                    layer_name=getattr(attn, "layer_name", None),
                    scale=getattr(impl, "scale", None),
                    sliding_window=getattr(impl, "sliding_window", None),
                    logits_soft_cap=getattr(impl, "logits_soft_cap", None),
                )
            )
    return dict(
        pid=os.getpid(),
        model_class=type(model).__qualname__,
        model_file=inspect.getfile(type(model)),
        package_file=getattr(package, "__file__", None),
        # vLLM's torch.compile wrapper marks the module it compiled.
        compiled=bool(getattr(getattr(model, "model", None), "compiled", False)),
        overlay_active=overlay.active(),
        overlay_requested=overlay.requested(),
        project_dir=str(overlay.project_dir()),
        attached=attached,
    )


def _kv_cache_probe(worker) -> dict[str, dict[str, Any]]:
    """Runs inside a vLLM worker (`collective_rpc`): the KV cache spec the engine
    allocates each attention layer's cache from, per layer name."""
    specs = {}
    for name, spec in worker.get_kv_cache_spec().items():
        specs[name] = dict(
            type=type(spec).__name__,
            block_size=spec.block_size,
            page_size_bytes=spec.page_size_bytes,
            bytes_per_token=spec.page_size_bytes // spec.block_size,
            num_kv_heads=getattr(spec, "num_kv_heads", None),
            head_size=getattr(spec, "head_size", None),
            dtype=str(getattr(spec, "dtype", None)),
        )
    return specs


def _engine_main(spec_file: str, out_file: str) -> None:
    spec = json.loads(Path(spec_file).read_text())
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    kwargs = dict(
        model=spec["model"],
        model_impl=spec["model_impl"],
        tensor_parallel_size=spec["tensor_parallel_size"],
        dtype="float32",
        seed=0,
        max_model_len=MAX_MODEL_LEN,
        kv_cache_memory_bytes=1 << 30,
        enforce_eager=True,
        enable_lora=spec["lora"] is not None,
        disable_log_stats=not spec.get("spec_decode"),
    )
    kwargs.update(spec["llm_kwargs"])
    llm = LLM(**kwargs)
    params = SamplingParams(
        temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True, logprobs=2
    )
    prompts = [{"prompt_token_ids": ids} for ids in spec["prompt_token_ids"]]
    lora = LoRARequest("adapter", 1, spec["lora"]) if spec["lora"] else None
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=lora)
    completions = []
    for ids, output in zip(spec["prompt_token_ids"], outputs):
        sample = output.outputs[0]
        token_ids = list(sample.token_ids)
        logprobs = [step[t].logprob for t, step in zip(token_ids, sample.logprobs)]
        # The top two log-probabilities differ by what their logits do.
        top_two = [sorted((p.logprob for p in step.values()), reverse=True)[:2]
                   for step in sample.logprobs]  # fmt: skip
        completions.append(
            asdict(
                Completion(
                    prompt_ids=ids,
                    token_ids=token_ids,
                    logprobs=logprobs,
                    margins=[first - second for first, second in top_two],
                    text=sample.text,
                )
            )
        )
    # Shipped by reference: `tiny` (not `__main__`) is importable in every process
    # the engine starts (PYTHONPATH, set by `run_engine`).
    import tiny

    probe = llm.apply_model(tiny._probe) if spec["probe"] else None
    kv_cache = (
        llm.collective_rpc(tiny._kv_cache_probe) if spec.get("kv_cache") else None
    )
    spec_decode = (
        {
            m.name: m.values if hasattr(m, "values") else m.value
            for m in llm.get_metrics()
            if m.name.startswith("vllm:spec_decode")
        }
        if spec.get("spec_decode")
        else None
    )
    Path(out_file).write_text(
        json.dumps(
            dict(
                completions=completions,
                probe=probe,
                kv_cache=kv_cache,
                spec_decode=spec_decode,
            )
        )
    )
    del llm


# --- OpenAI server -----------------------------------------------------------------------


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Server:
    """A running OpenAI-compatible server (see `serve`)."""

    base_url: str
    model: str
    process: subprocess.Popen
    log_file: Path

    def log(self) -> str:
        return (
            self.log_file.read_text(errors="replace") if self.log_file.exists() else ""
        )


def server_command(
    path: Path | str,
    port: int,
    *,
    model_impl: str = "transformers",
    extra_args: tuple[str, ...] = (),
) -> list[str]:
    """The OpenAI server on 127.0.0.1 for a tiny checkpoint.

    `python -m vllm.entrypoints.openai.api_server`, not the `vllm` console script,
    which dies at start in `vllm-cpu` 0.32.0 (its distribution is named `vllm-cpu`)."""
    return [
        PYTHON, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(path),
        "--model-impl", model_impl,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--dtype", "float32",
        "--seed", "0",
        "--max-model-len", str(MAX_MODEL_LEN),
        "--kv-cache-memory-bytes", str(1 << 30),
        "--enforce-eager",
        *extra_args,
    ]  # fmt: skip


@contextlib.contextmanager
def serve(
    path: Path | str,
    *,
    model_impl: str = "transformers",
    backend: str = "project",
    ready_timeout: float = 300,
    log_dir: Path | str | None = None,
    extra_env: dict[str, str] | None = None,
    extra_args: tuple[str, ...] = (),
):
    """Start the server (`extra_args` appended to `server_command`'s, such as
    `--runner pooling`), wait (bounded) until `/health` answers, yield a `Server`, and
    always stop it (SIGTERM to its process group, then SIGKILL). A server that exits
    before it is ready raises `ServerExited`."""
    port = free_port()
    env = dict(os.environ)
    env["VLLM_TRANSFORMERS_BACKEND"] = backend
    env.setdefault("VLLM_LOGGING_LEVEL", "INFO")
    env.update(extra_env or {})
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="tiny-server-"))
    log_file = log_dir / "server.log"
    with open(log_file, "w") as log:
        process = subprocess.Popen(
            server_command(path, port, model_impl=model_impl, extra_args=extra_args),
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    server = Server(f"http://127.0.0.1:{port}/v1", str(path), process, log_file)
    try:
        _wait_ready(server, port, ready_timeout)
        yield server
    finally:
        stop(process)


def session_processes(session: int) -> list[int]:
    """The live (not zombie) processes of `session`, from /proc: a process started
    with `start_new_session=True` leads the session whose id is its pid, and its
    children stay in that session even once orphaned."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # After "pid (command)": state, ppid, pgrp, session, ...
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        if int(fields[3]) == session and fields[0] != "Z":
            pids.append(int(stat.parent.name))
    return pids


def port_free(port: int) -> bool:
    """Whether a new server could listen on 127.0.0.1:`port` (as uvicorn binds it)."""
    import socket

    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


ORPHAN_GRACE = 15.0
"""Seconds the processes a failed server started get to exit after it did."""


class ServerExited(RuntimeError):
    """The server exited before it was ready: its exit status and log, the processes
    of its session still alive `ORPHAN_GRACE` s after it exited (left behind), and
    whether its port was free again then."""

    def __init__(self, server: Server, port: int):
        deadline = time.monotonic() + ORPHAN_GRACE
        while (left := session_processes(server.process.pid)) and (
            time.monotonic() < deadline
        ):
            time.sleep(0.2)
        self.returncode = server.process.returncode
        self.log = server.log()
        self.left_behind = left
        self.port_free = port_free(port)
        super().__init__(
            f"server exited with {self.returncode} before it was ready (left behind: "
            f"{left or 'nothing'}; port {port} free: {self.port_free}):\n"
            f"{_failure(self.log)}"
        )


def _wait_ready(server: Server, port: int, timeout: float) -> None:
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise ServerExited(server, port)
        try:
            with urllib.request.urlopen(
                f"http://127.0.0.1:{port}/health", timeout=2
            ) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        time.sleep(0.5)
    raise TimeoutError(
        f"server not ready after {timeout:.0f} s:\n{_tail(server.log())}"
    )


def stop(process: subprocess.Popen, grace: float = 30) -> None:
    """Stop `process` and everything in its session (it was started in a new one)."""
    import signal

    if process.poll() is None:
        try:
            os.killpg(process.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
    # Engine processes can outlive the server's main process: clear the whole group.
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=10)


LOGPROB_ATOL = 5e-5
"""float32: two correct implementations differ by ~1e-5 on these models (Transformers
float32 against float64 already does); a wrong scale, window or cap moves them by 1e-2+."""


DECODED_NOISE = frozenset({"nemotron_h"})
"""Recipes whose model computes a prompt and a decoding step differently (Nemotron-H's
mixers clamp their time steps in a prompt only): their float64 side is decoded as the
reference is, one token at a time (slower: 5-20 s a model here), not teacher-forced."""


@functools.cache
def float32_noise(model_type: str) -> float:
    """How far the float32 reference's logprobs lie from the same checkpoint's in
    float64 (teacher-forced on the reference's tokens, or decoded the same way for
    `DECODED_NOISE`): the rounding error any float32 implementation of it carries,
    in either direction."""
    import torch
    from transformers import AutoModelForCausalLM

    _quiet_transformers()
    model = AutoModelForCausalLM.from_pretrained(
        str(checkpoint(model_type)),
        dtype=torch.float64,
        attn_implementation="eager",
        # Transformers' default grouped_mm experts take no float64.
        experts_implementation="eager",
    ).eval()
    completions = cached_reference(model_type)
    if model_type in DECODED_NOISE:
        exact = greedy(model, [c.prompt_ids for c in completions], MAX_TOKENS)
        for c, e in zip(completions, exact):
            assert c.token_ids == e.token_ids, f"{model_type}: float64 decodes otherwise"
        exact_logprobs = [e.logprobs for e in exact]
    else:
        exact_logprobs = []
        for c in completions:
            ids = torch.tensor([c.prompt_ids + c.token_ids])
            with torch.no_grad():
                logits = model(ids).logits[0, len(c.prompt_ids) - 1 : -1]
            chosen = torch.log_softmax(logits, dim=-1)[range(len(c.token_ids)), c.token_ids]
            exact_logprobs.append(chosen.tolist())
    noise = 0.0
    for c, exact in zip(completions, exact_logprobs):
        noise = max(noise, *(abs(a - b) for a, b in zip(c.logprobs, exact)))
    return noise


def logprob_atol(model_type: str) -> float:
    """`LOGPROB_ATOL`, or three times the reference's float32 noise where a checkpoint
    rounds more (the tiny Gemma 4: 2.8e-5 from float64, and vLLM's engine as far the
    other way, native model included): the engine's rounding is of the same size as the
    reference's, so two correct implementations can be twice the noise apart."""
    return max(LOGPROB_ATOL, 3 * float32_noise(model_type))


@functools.cache
def checkpoint(model_type: str) -> Path:
    """`build(model_type)`, once per process."""
    return build(model_type)


@functools.cache
def cached_reference(model_type: str) -> tuple[Completion, ...]:
    """`reference()` of the tiny `model_type` checkpoint, once per process."""
    return tuple(reference(checkpoint(model_type)))


def compare(
    expected: tuple[Completion, ...] | list[Completion],
    actual: list[Completion],
    atol: float = LOGPROB_ATOL,
) -> float:
    """Assert equal greedy tokens and close logprobs; return the largest logprob gap."""
    assert len(actual) == len(expected)
    worst = 0.0
    for i, (want, got) in enumerate(zip(expected, actual)):
        assert got.prompt_ids == want.prompt_ids
        first_diff = next(
            (
                t
                for t, (a, b) in enumerate(zip(want.token_ids, got.token_ids))
                if a != b
            ),
            None,
        )
        assert got.token_ids == want.token_ids, (
            f"prompt {i}: greedy tokens differ from step {first_diff}:\n"
            f"  expected {want.token_ids}\n  got      {got.token_ids}"
        )
        gaps = [abs(a - b) for a, b in zip(want.logprobs, got.logprobs)]
        worst = max(worst, *gaps)
        step = max(range(len(gaps)), key=gaps.__getitem__)
        assert gaps[step] <= atol, (
            f"prompt {i}: logprob of token {step} differs by {gaps[step]:.3g} "
            f"(expected {want.logprobs[step]:.6f}, got {got.logprobs[step]:.6f}; "
            f"tolerance {atol:g})"
        )
    return worst


def compare_rounded(
    expected: tuple[Completion, ...] | list[Completion],
    actual: list[Completion],
    atol: float,
) -> tuple[float, int]:
    """`compare` for runs that round to bfloat16, where two correct implementations
    may break a near-tie either way: a prompt's tokens are compared up to the first
    that differs where `expected`'s top two log-probabilities lie within `2 * atol`
    (the sequences part there); another token anywhere else fails, and so does a
    log-probability more than `atol` off. Returns the largest gap and how many steps
    were compared."""
    assert len(actual) == len(expected)
    worst, compared = 0.0, 0
    for i, (want, got) in enumerate(zip(expected, actual)):
        assert got.prompt_ids == want.prompt_ids
        steps = zip(want.token_ids, got.token_ids, want.logprobs, got.logprobs)
        for step, (a, b, want_logprob, got_logprob) in enumerate(steps):
            if a != b:
                assert want.margins[step] <= 2 * atol, (
                    f"prompt {i}: greedy tokens differ from step {step}, where the "
                    f"top two are {want.margins[step]:.3g} apart:\n  expected "
                    f"{want.token_ids}\n  got      {got.token_ids}"
                )
                break
            gap = abs(want_logprob - got_logprob)
            assert gap <= atol, (
                f"prompt {i}: logprob of token {step} differs by {gap:.3g} "
                f"(expected {want_logprob:.6f}, got {got_logprob:.6f}; tolerance "
                f"{atol:g})"
            )
            worst, compared = max(worst, gap), compared + 1
    return worst, compared


def differs(
    base: tuple[Completion, ...] | list[Completion],
    changed: tuple[Completion, ...] | list[Completion],
) -> bool:
    """Other greedy tokens, or logprobs moved far beyond `LOGPROB_ATOL`: what a
    feature that matters does to a reference when it is turned off."""
    if any(a.token_ids != b.token_ids for a, b in zip(base, changed)):
        return True
    gap = max(
        abs(x - y)
        for a, b in zip(base, changed)
        for x, y in zip(a.logprobs, b.logprobs)
    )
    return gap > 100 * LOGPROB_ATOL


def check_well_separated(model_type: str) -> None:
    """The reference's greedy choices do not hinge on float32 noise."""
    completions = cached_reference(model_type)
    margin = min(min(c.margins) for c in completions)
    assert margin >= min_margin(model_type), (
        f"{model_type}: top-1/top-2 margin {margin:.3g}"
    )
    for c in completions:
        assert len(c.token_ids) == MAX_TOKENS
        assert all(lp < 0 for lp in c.logprobs)
    # A checkpoint rounding more than this would loosen `logprob_atol` past what
    # tells a correct implementation from a slightly wrong one.
    noise = float32_noise(model_type)
    assert noise <= LOGPROB_ATOL, f"{model_type}: float32 is {noise:.3g} from float64"


def check_feature_changes_output(model_type: str, **config_changes: Any) -> None:
    """Without a feature (`config_changes` turn it off), the reference moves far
    beyond the tolerance: the tiny model exercises it, so a test can fail on it."""
    changed = reference(checkpoint(model_type), **config_changes)
    assert differs(cached_reference(model_type), changed), config_changes


def check_tensor_parallel(model_type: str, impl: str) -> None:
    """TP=2 (one worker process per rank) equals Transformers, and TP=1."""
    tp2 = shared_engine(model_type, impl, 2)
    assert len(tp2.probe) == 2 and len({w["pid"] for w in tp2.probe}) == 2
    atol = logprob_atol(model_type)
    gap = compare(cached_reference(model_type), tp2.completions, atol)
    compare(shared_engine(model_type, impl).completions, tp2.completions, 2 * atol)
    report(f"{model_type} ({impl}, TP=2) vs Transformers", tp2, gap)


PIPELINE_PARALLEL: dict[str, Any] = dict(
    distributed_executor_backend="mp", enforce_eager=False
)
"""What pipeline parallel takes on the CPU engine besides its size: worker processes
(`mp`), and compiled: vLLM's runner allocates the buffer a later stage receives its
hidden states in only while warming up the compiled model, so eager PP fails
(`assert self.intermediate_tensors is not None`), for native models too."""


def check_pipeline_parallel(model_type: str, impl: str) -> EngineRun:
    """PP=2 (a compiled worker process per stage) equals Transformers, and PP=1
    (this process's engine for the model, which the end-to-end tests share)."""
    pp2 = shared_engine(model_type, impl, pipeline_parallel_size=2)
    assert len(pp2.probe) == 2 and len({w["pid"] for w in pp2.probe}) == 2
    assert all(worker["compiled"] for worker in pp2.probe)
    atol = logprob_atol(model_type)
    gap = compare(cached_reference(model_type), pp2.completions, atol)
    compare(shared_engine(model_type, impl).completions, pp2.completions, 2 * atol)
    report(f"{model_type} ({impl}, PP=2, compiled) vs Transformers", pp2, gap)
    return pp2


def report(what: str, run: EngineRun, gap: float) -> None:
    print(f"\n[e2e] {what}: {run.seconds:.1f} s, max |logprob gap| {gap:.2e}")


# --- engine runs shared by the end-to-end test files ------------------------------

IMPLS: dict[str, dict[str, str]] = {
    "project": dict(model_impl="transformers", backend="project"),
    "stock": dict(model_impl="transformers", backend="stock"),
    "native": dict(model_impl="vllm", backend="project"),
}
"""What `E2E_IMPL` can pick for the parity tests: this project's backend, vLLM's own
copy of the subpackage, or vLLM's native model."""


def e2e_impl() -> str:
    """`E2E_IMPL` (default `project`), checked."""
    impl = os.environ.get("E2E_IMPL", "project")
    if impl not in IMPLS:
        raise ValueError(f"E2E_IMPL must be one of {sorted(IMPLS)}, got {impl!r}")
    return impl


_ENGINE_RUNS: dict[tuple[str, str, int, int], EngineRun | Exception] = {}


def shared_engine(
    model_type: str,
    impl: str,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
) -> EngineRun:
    """One engine start per (model, implementation, TP, PP) and process, shared by
    the tests; a start that failed is not retried (its error is raised again)."""
    key = (model_type, impl, tensor_parallel_size, pipeline_parallel_size)
    if key not in _ENGINE_RUNS:
        try:
            _ENGINE_RUNS[key] = run_engine(
                checkpoint(model_type),
                tensor_parallel_size=tensor_parallel_size,
                pipeline_parallel_size=pipeline_parallel_size,
                probe=True,
                **IMPLS[impl],
            )
        except Exception as e:
            _ENGINE_RUNS[key] = e
    run = _ENGINE_RUNS[key]
    if isinstance(run, Exception):
        raise RuntimeError(f"engine {key} failed to run (see its first test)") from run
    return run


def main(argv: list[str]) -> None:
    if argv[:1] == ["engine"]:
        _engine_main(*argv[1:3])
    elif argv[:1] == ["build"]:
        for model_type in argv[1:] or list(ARCHS):
            print(build(model_type))
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
