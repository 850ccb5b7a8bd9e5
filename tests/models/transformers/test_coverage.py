# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""End to end on the CPU engine: architectures beyond vLLM's default routes to the
Transformers backend (models vLLM has a native implementation for, and BitNet, which
has none, served here with `model_impl="transformers"`) equal Transformers' own
output.

Same harness as `test_default_routed.py`: tiny float32 checkpoints (`tiny.py`, whose
recipes say what each one exercises), greedy tokens equal to Transformers' `generate`,
logprobs within `tiny.logprob_atol`, one engine start per (model, implementation,
TP) and `E2E_IMPL` to run vLLM's stock backend or native model instead.

To add an architecture: a recipe in `tiny.ARCHS`, its name in `ARCHS` below, and in
`FEATURES` what it exercises (each must change the reference, so the engine test can
fail).
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tiny  # noqa: E402
from tiny import cached_reference as reference  # noqa: E402
from tiny import checkpoint, compare, report  # noqa: E402

ARCHS = [
    # Conv1D linears (weights stored transposed), q/k/v packed in one `c_attn`.
    # vLLM's stock backend drops `c_attn.bias` and does not start.
    "gpt2",
    # Logits divided by `logits_scaling`, and three other multipliers.
    "granite",
    # Full layers without `v_proj` (the key is the value), wider heads and fewer
    # key/value heads than the sliding ones.
    "gemma4_text",
    # AltUp streams, LAuReL, per-layer input embeddings, alternating windows, and
    # two layers reusing earlier layers' keys and values (right, though each still
    # gets a KV cache of its own: vLLM's KV sharing is not used, by stock either).
    "gemma3n_text",
    # Norms over the whole attention output and the whole gated product.
    "bitnet",
]

TENSOR_PARALLEL = ["gpt2", "bitnet"]
"""GPT-2: packed q/k/v split per rank, the output projection row-parallel, the MLP
replicated (GPT-2 has no tensor-parallel plan). BitNet: its sub-norms span the whole
width, so neither its q/k/v nor its GLU is fused at TP=2 (declined at construction,
naming the norm), and its linears stay whole on each rank (no plan either)."""

FEATURES = {
    # The logits divided by `logits_scaling` in GraniteForCausalLM.forward.
    "granite-logits-scaling": ("granite", dict(logits_scaling=1.0)),
    "granite-embedding-multiplier": ("granite", dict(embedding_multiplier=1.0)),
    "granite-residual-multiplier": ("granite", dict(residual_multiplier=1.0)),
    "granite-attention-multiplier": ("granite", dict(attention_multiplier=32**-0.5)),
    "gemma4-window": ("gemma4_text", dict(sliding_window=tiny.MAX_MODEL_LEN)),
    "gemma3n-window": ("gemma3n_text", dict(sliding_window=tiny.MAX_MODEL_LEN)),
    # AltUp's corrected active stream scaled by its learned `correct_output_scale`.
    "gemma3n-altup-correct-scale": ("gemma3n_text", dict(altup_correct_scale=False)),
}
"""A feature of a recipe -> (model_type, the config change that turns it off)."""

NO_NATIVE = {"bitnet"}
"""Recipes vLLM 0.32 has no native model for."""

E2E_IMPL = tiny.e2e_impl()


def skip_without_native(model_type: str) -> None:
    """Skip where `E2E_IMPL` is `native` and vLLM has no native `model_type`."""
    if E2E_IMPL == "native" and model_type in NO_NATIVE:
        pytest.skip(f"vLLM has no native model for {model_type}")


# --- the references themselves (no engine) --------------------------------------------


@pytest.mark.parametrize("model_type", ARCHS)
def test_reference_is_well_separated(model_type):
    """Greedy choices must not hinge on float32 noise."""
    tiny.check_well_separated(model_type)


def test_gemma4_full_layers_reuse_the_key_as_value_with_their_own_heads():
    """The tiny Gemma 4 has what the fusion must handle: full layers without
    `v_proj`, with wider heads and fewer key/value heads than the sliding ones."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(checkpoint("gemma4_text")), dtype=torch.float32
    )
    heads = [
        (a.v_proj is None, a.head_dim, a.k_proj.out_features // a.head_dim)
        for a in (layer.self_attn for layer in model.model.layers)
    ]
    assert heads == [(False, 32, 2), (True, 64, 1)] * 2


@pytest.mark.parametrize("feature", FEATURES)
def test_feature_changes_output(feature):
    """The tiny models exercise what they are meant to: without the feature, the
    reference output moves far beyond the tolerance."""
    model_type, change = FEATURES[feature]
    tiny.check_feature_changes_output(model_type, **change)


# --- the engine -----------------------------------------------------------------------


@pytest.mark.engine
@pytest.mark.parametrize("model_type", ARCHS)
def test_matches_transformers(model_type):
    """Greedy tokens equal Transformers' `generate`; logprobs agree."""
    skip_without_native(model_type)
    run = tiny.shared_engine(model_type, E2E_IMPL)
    atol = tiny.logprob_atol(model_type)
    gap = compare(reference(model_type), run.completions, atol)
    report(f"{model_type} ({E2E_IMPL}) vs Transformers", run, gap)


@pytest.mark.engine
@pytest.mark.parametrize("model_type", TENSOR_PARALLEL)
def test_tensor_parallel_matches_transformers(model_type):
    """TP=2 (one core per rank) equals Transformers and TP=1."""
    skip_without_native(model_type)
    tiny.check_tensor_parallel(model_type, E2E_IMPL)


@pytest.mark.engine
def test_bitnet_at_tensor_parallel_declines_the_fusions_its_sub_norms_break():
    """At TP=2 the engine's log names each sub-norm that keeps a fusion off."""
    if E2E_IMPL != "project":
        pytest.skip("the reasons are this backend's")
    log = tiny.shared_engine("bitnet", E2E_IMPL, 2).log
    assert "attn_sub_norm act on the whole width between the attention and o_proj" in log
    assert "ffn_sub_norm act on the whole intermediate width between the gated" in log
