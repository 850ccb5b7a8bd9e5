# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""End to end on the CPU engine: every dense architecture vLLM 0.32 routes to the
Transformers backend by default (`_TRANSFORMERS_SUPPORTED_MODELS` in vLLM's model
registry: none has a native vLLM model any more) equals Transformers' own output.

Same harness as `test_end_to_end.py` (where GPT-NeoX, also routed here by default, is
tested): tiny float32 checkpoints (`tiny.py`, whose recipes say what each one
exercises), greedy tokens equal to Transformers' `generate`, logprobs within
`tiny.logprob_atol`, one engine start per (model, implementation, TP) and `E2E_IMPL` to
run vLLM's stock backend instead (`native` skips: there is no native model).

The tests without the `engine` mark check the references themselves: that greedy
choices are well separated and that the features the recipes are meant to exercise
change the output.
"""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tiny  # noqa: E402
from tiny import cached_reference as reference  # noqa: E402
from tiny import checkpoint, compare, report  # noqa: E402

ARCHS = [
    "arcee",
    "cwm",
    "glm",
    "gpt_bigcode",
    "hunyuan_v1_dense",
    "jais2",
    "olmo",
    "olmo2",
    "olmo3",
    "phi",
    "seed_oss",
    "smollm3",
    "starcoder2",
    "vaultgemma",
]

TENSOR_PARALLEL = ["olmo2"]
"""Its q/k norms span every head, so a rank's slice of q/k cannot be normalised on its
own (OLMo 3's too: not run at TP=2 here, for the suite's time)."""

E2E_IMPL = tiny.e2e_impl()

CPU_SOFTCAP_LIMIT = 88.7
"""vLLM's CPU attention gives NaN once |q.k * scale| / softcap passes this (the exp
in its tanh overflows float32)."""


def engine(model_type: str, tensor_parallel_size: int = 1) -> tiny.EngineRun:
    if E2E_IMPL == "native":
        pytest.skip(f"vLLM has no native model for {model_type}")
    return tiny.shared_engine(model_type, E2E_IMPL, tensor_parallel_size)


def test_every_dense_default_route_is_covered():
    """The list follows vLLM's registry: a dense architecture it routes here by
    default (and Transformers knows) is tested here or in test_end_to_end.py."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    from vllm.model_executor.models.registry import _TRANSFORMERS_SUPPORTED_MODELS

    dense = {
        arch
        for arch, (_, cls) in _TRANSFORMERS_SUPPORTED_MODELS.items()
        if cls == "TransformersForCausalLM"
    }
    configs = {name: t for t, name in CONFIG_MAPPING_NAMES.items()}
    tested = {
        json.loads((checkpoint(t) / "config.json").read_text())["architectures"][0]
        for t in ARCHS
    } | {"GPTNeoXForCausalLM"}
    known = {a for a in dense if a.removesuffix("ForCausalLM") + "Config" in configs}
    assert known - tested == set(), sorted(known - tested)


# --- the references themselves (no engine) ---------------------------------------------


@pytest.mark.parametrize("model_type", ARCHS)
def test_reference_is_well_separated(model_type):
    """Greedy choices must not hinge on float32 noise."""
    tiny.check_well_separated(model_type)


@pytest.mark.parametrize(
    "model_type, change",
    [
        ("cwm", dict(sliding_window=tiny.MAX_MODEL_LEN)),
        ("cwm", dict(rope_parameters=dict(rope_type="default", rope_theta=1e6))),
        ("olmo", dict(clip_qkv=None)),
        ("olmo3", dict(sliding_window=tiny.MAX_MODEL_LEN)),
        ("smollm3", dict(no_rope_layers=[1] * 4)),
        ("starcoder2", dict(sliding_window=None)),
        ("vaultgemma", dict(sliding_window=tiny.MAX_MODEL_LEN)),
        ("vaultgemma", dict(attn_logit_softcapping=None)),
        ("vaultgemma", dict(final_logit_softcapping=None)),
        ("vaultgemma", dict(query_pre_attn_scalar=32)),  # = head_dim
    ],
    ids=[
        "cwm-window",
        "cwm-llama3-rope",
        "olmo-clip-qkv",
        "olmo3-window",
        "smollm3-nope",
        "starcoder2-window",
        "vaultgemma-window",
        "vaultgemma-attn-cap",
        "vaultgemma-final-cap",
        "vaultgemma-scale",
    ],
)
def test_feature_changes_output(model_type, change):
    """The tiny models exercise what they are meant to: without the feature, the
    reference output moves far beyond the tolerance."""
    tiny.check_feature_changes_output(model_type, **change)


def test_phi_lm_head_bias_changes_output():
    """Phi's `lm_head` has a bias: the checkpoint's is perturbed away from zero, and
    zeroing it changes the reference (so an engine that dropped it would fail)."""
    import torch
    from transformers import AutoModelForCausalLM

    path = checkpoint("phi")
    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    bias = model.lm_head.bias
    assert bias is not None and bias.abs().min() > 0
    with torch.no_grad():
        bias.zero_()
    changed = tiny.greedy(model, tiny.encode(path), tiny.MAX_TOKENS)
    assert tiny.differs(reference("phi"), changed)


def test_vaultgemma_attention_logits_fit_cpu_softcap(monkeypatch):
    """The soft-capped attention logits stay where vLLM's CPU kernel computes them
    (no NaN): the largest |q.k * scale| / softcap, masked positions included."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.models.vaultgemma import modeling_vaultgemma as vaultgemma

    eager = vaultgemma.eager_attention_forward
    largest = 0.0

    def attention(module, query, key, value, attention_mask, **kwargs):
        nonlocal largest
        key_states = vaultgemma.repeat_kv(key, module.num_key_value_groups)
        logits = query @ key_states.transpose(2, 3) * kwargs["scaling"]
        largest = max(largest, (logits.abs().max() / kwargs["softcap"]).item())
        return eager(module, query, key, value, attention_mask, **kwargs)

    # Looked up when called, so every layer's eager attention goes through the probe.
    monkeypatch.setattr(vaultgemma, "eager_attention_forward", attention)
    path = checkpoint("vaultgemma")
    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    probed = tiny.greedy(model, tiny.encode(path), tiny.MAX_TOKENS)
    assert not tiny.differs(reference("vaultgemma"), probed)
    assert 0 < largest < CPU_SOFTCAP_LIMIT / 4, largest


# --- the engine ---------------------------------------------------------------------------


@pytest.mark.engine
@pytest.mark.parametrize("model_type", ARCHS)
def test_matches_transformers(model_type):
    """Greedy tokens equal Transformers' `generate`; logprobs agree."""
    run = engine(model_type)
    atol = tiny.logprob_atol(model_type)
    gap = compare(reference(model_type), run.completions, atol)
    report(f"{model_type} ({E2E_IMPL}) vs Transformers", run, gap)


@pytest.mark.engine
@pytest.mark.parametrize("model_type", TENSOR_PARALLEL)
def test_tensor_parallel_matches_transformers(model_type):
    """TP=2 (one core per rank) equals Transformers and TP=1."""
    engine(model_type, 2)  # skips where vLLM has no native model
    tiny.check_tensor_parallel(model_type, E2E_IMPL)
