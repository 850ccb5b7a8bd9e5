# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""End to end on the CPU engine: DeepSeek latent attention (MLA) through `MLAAttention`.

Two tiny float32 checkpoints (`tiny.py`): DeepSeek-V3 with query LoRA and DeepSeek-V2
without it. Each runs twice: through `MLAAttention` (vLLM's reference CPU MLA kernel,
`attention_backend="CPU_MLA"`: an AMX host would otherwise pick its bf16-only one), and
with MLA disabled by vLLM's own switch (`VLLM_MLA_DISABLE=1`), as plain attention over
expanded keys and values. Both must give Transformers' greedy tokens, with close
log-probabilities; the KV cache the engine allocates per token must be the latent's
(`kv_lora_rank + qk_rope_head_dim`), not full keys and values. Four engine starts.
"""

import functools
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tiny  # noqa: E402

ARCHS = ["deepseek_v3", "deepseek_v2"]
"""deepseek_v3 has query LoRA (q_a/q_b), deepseek_v2 a single q_proj."""

FLOAT32_BYTES = 4


@functools.cache
def engine(model_type: str, mla: bool) -> tiny.EngineRun:
    """One engine start per (model, MLA on/off), shared by the tests."""
    if mla:
        options = dict(llm_kwargs=dict(attention_backend="CPU_MLA"))
    else:
        options = dict(extra_env=dict(VLLM_MLA_DISABLE="1"))
    return tiny.run_engine(
        tiny.checkpoint(model_type), probe=True, kv_cache=True, **options
    )


@pytest.mark.parametrize("model_type", ARCHS)
def test_reference_is_well_separated(model_type):
    """Greedy choices must not hinge on float32 noise (no engine)."""
    margin = min(min(c.margins) for c in tiny.cached_reference(model_type))
    assert margin >= tiny.MIN_MARGIN, f"{model_type}: top-1/top-2 margin {margin:.3g}"


@pytest.mark.engine
@pytest.mark.parametrize("model_type", ARCHS)
def test_mla_matches_transformers(model_type):
    """Through `MLAAttention`, attached to every decoder layer's attention module."""
    run = engine(model_type, mla=True)
    gap = tiny.compare(tiny.cached_reference(model_type), run.completions)
    (worker,) = run.probe
    layers = tiny.overrides(model_type)["num_hidden_layers"]
    assert [a["layer_name"] for a in worker["attached"]] == [
        f"model.layers.{i}.self_attn.attn" for i in range(layers)
    ]
    assert {a["attn_class"] for a in worker["attached"]} == {"MLAAttention"}
    assert "(MLA)" in run.log  # the fusion report's verdict
    tiny.report(f"{model_type} (MLA) vs Transformers", run, gap)


@pytest.mark.engine
@pytest.mark.parametrize("model_type", ARCHS)
def test_mla_disabled_matches_transformers(model_type):
    """`VLLM_MLA_DISABLE=1`: the same model as plain attention (the HF forward
    expands the latent; values narrower than the heads are padded)."""
    run = engine(model_type, mla=False)
    gap = tiny.compare(tiny.cached_reference(model_type), run.completions)
    (worker,) = run.probe
    assert {a["attn_class"] for a in worker["attached"]} == {"Attention"}
    tiny.report(f"{model_type} (MLA disabled) vs Transformers", run, gap)


@pytest.mark.engine
@pytest.mark.parametrize("model_type", ARCHS)
def test_kv_cache_per_token_is_the_latent(model_type):
    """Per layer and token, the engine caches `kv_lora_rank + qk_rope_head_dim` values
    under MLA; with MLA disabled, keys and values of every head."""
    config = tiny.overrides(model_type)
    latent = (config["kv_lora_rank"] + config["qk_rope_head_dim"]) * FLOAT32_BYTES
    head_size = config["qk_nope_head_dim"] + config["qk_rope_head_dim"]
    full = 2 * config["num_key_value_heads"] * head_size * FLOAT32_BYTES
    (mla,) = engine(model_type, mla=True).kv_cache
    (plain,) = engine(model_type, mla=False).kv_cache
    assert len(mla) == len(plain) == config["num_hidden_layers"]
    for spec in mla.values():
        assert spec["type"] == "MLAAttentionSpec"
        assert (spec["num_kv_heads"], spec["head_size"]) == (1, latent // FLOAT32_BYTES)
        assert spec["bytes_per_token"] == latent
    for spec in plain.values():
        assert spec["type"] == "FullAttentionSpec"
        assert spec["bytes_per_token"] == full
    print(
        f"\n[e2e] {model_type}: KV cache per token and layer {latent} bytes with MLA, "
        f"{full} bytes without (float32)"
    )
