# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""End to end on the CPU engine: mixture-of-experts models equal Transformers' own
output, their experts served by vLLM's fused MoE (`experts_layer.py`).

Same harness as `test_coverage.py`: tiny float32 checkpoints (`tiny.py`, whose recipes
say what each one exercises), greedy tokens equal to Transformers' `generate`,
logprobs within `tiny.logprob_atol`, one engine start per (model, implementation,
TP) and `E2E_IMPL` to run vLLM's stock backend or native model instead.
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tiny  # noqa: E402
from tiny import cached_reference as reference  # noqa: E402
from tiny import compare, report  # noqa: E402

ARCHS = [
    "qwen3_moe",
    "mixtral",
    "qwen2_moe",
    "olmoe",
    "flex_olmo",
    "hunyuan_v1_moe",
    "mellum",
    "gpt_oss",
    "minimax_m2",
    # GLM-4.5's routing (DeepSeek-V3's without groups) beside plain attention with
    # q/k norms and half rotary.
    "glm4_moe",
    # Ernie 4.5's router: the choice corrected by a child module's tensor.
    "ernie4_5_moe",
    # Aria's experts: stored transposed, their top-k named `moe_topk` (stock fails
    # to build it, as Gemma 4's).
    "aria_text",
    # Gemma 4's experts: its config names the top-k `top_k_experts` (vLLM's stock
    # backend fails to build it: an `AssertionError` at its `moe.py:185`).
    "gemma4_moe",
]

COMPILED = ("afmoe", "qwen3_moe")
"""Checked under torch.compile only (one engine start less for the suite each).
AFMoE: a first dense layer, then routers handed their block's correction bias, a
shared expert. Qwen3-MoE: blocks handing vLLM's router's choice straight to the
fused MoE (`MoEBlockFuser`); eager above."""

DEEPSEEK = "deepseek_v3_moe"
"""Latent attention and MoE layers (grouped top-k over sigmoid scores with a
correction bias, routed scaling, a shared expert) after a first dense layer."""

E2E_IMPL = tiny.e2e_impl()


@pytest.mark.parametrize("model_type", list(dict.fromkeys([*ARCHS, *COMPILED, DEEPSEEK])))
def test_reference_is_well_separated(model_type):
    """Greedy choices must not hinge on float32 noise."""
    tiny.check_well_separated(model_type)


@pytest.mark.engine
@pytest.mark.parametrize("model_type", ARCHS)
def test_matches_transformers(model_type):
    """Greedy tokens equal Transformers' `generate`; logprobs agree."""
    run = tiny.shared_engine(model_type, E2E_IMPL)
    atol = tiny.logprob_atol(model_type)
    gap = compare(reference(model_type), run.completions, atol)
    report(f"{model_type} ({E2E_IMPL}) vs Transformers", run, gap)


@pytest.mark.engine
@pytest.mark.skipif(E2E_IMPL != "project", reason="reads this backend's log")
@pytest.mark.parametrize("model_type", ARCHS)
def test_every_experts_module_runs_on_vllm_fused_moe(model_type):
    """Experts left to Transformers would still be right, so only the start-up log
    tells that each experts module runs on vLLM's fused MoE."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(tiny.checkpoint(model_type))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    # The flags Transformers' experts interface sets on every experts module.
    experts = [name for name, m in model.named_modules() if hasattr(m, "has_gate")]
    run = tiny.shared_engine(model_type, E2E_IMPL)
    fused = [
        line.split("vllm_experts: ")[1].split(" ")[0]
        for line in run.log.splitlines()
        if "Fused: experts -> vllm_experts: " in line
    ]
    assert experts and sorted(fused) == sorted(experts)


@pytest.mark.engine
@pytest.mark.parametrize("model_type", COMPILED)
def test_compiled_matches_transformers(model_type):
    """Under vLLM's torch.compile integration (the engine's default): AFMoE's
    routers copy the bias their blocks hand in into vLLM's router on every step;
    Qwen3-MoE's blocks hand the packed choice across the fused MoE's custom op;
    the experts run on vLLM's fused MoE."""
    run = tiny.run_engine(
        tiny.checkpoint(model_type),
        probe=True,
        llm_kwargs=dict(enforce_eager=False),
        **tiny.IMPLS[E2E_IMPL],
    )
    assert all(worker["compiled"] for worker in run.probe)
    gap = compare(reference(model_type), run.completions)
    report(f"{model_type} ({E2E_IMPL}, compiled) vs Transformers", run, gap)


@pytest.mark.engine
def test_tensor_parallel_matches_transformers():
    """TP=2: each rank holds every expert's share of the intermediate size (and
    Qwen2-MoE's shared expert is split as a dense MLP); equals Transformers and TP=1."""
    tiny.check_tensor_parallel("qwen2_moe", E2E_IMPL)


def test_deepseek_routing_features_change_the_output():
    """The tiny DeepSeek routes with what it is meant to: without the correction
    bias's groups, the scaling or the renormalisation, the reference moves."""
    tiny.check_feature_changes_output(DEEPSEEK, routed_scaling_factor=1.0)
    tiny.check_feature_changes_output(DEEPSEEK, n_group=1, topk_group=1)
    tiny.check_feature_changes_output(DEEPSEEK, norm_topk_prob=False)


@pytest.mark.engine
@pytest.mark.parametrize("mla", [True, False], ids=["mla", "mla-disabled"])
def test_deepseek_with_experts_matches_transformers(mla):
    """DeepSeek-V3's MoE layers beside its latent attention, served as MLA and as
    plain attention (`VLLM_MLA_DISABLE=1`)."""
    # vLLM's reference CPU MLA kernel: an AMX host would pick its bf16-only one.
    options = (
        dict(llm_kwargs=dict(attention_backend="CPU_MLA"))
        if mla
        else dict(extra_env=dict(VLLM_MLA_DISABLE="1"))
    )
    run = tiny.run_engine(tiny.checkpoint(DEEPSEEK), **options, **tiny.IMPLS[E2E_IMPL])
    gap = compare(reference(DEEPSEEK), run.completions)
    report(f"{DEEPSEEK} ({E2E_IMPL}, MLA {'on' if mla else 'off'})", run, gap)
