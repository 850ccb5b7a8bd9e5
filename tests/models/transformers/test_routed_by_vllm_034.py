# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""End to end on the CPU engine: the architectures vLLM 0.34 adds to the ones it
routes to the Transformers backend by default (and whose native models it deleted):
Gemma, StableLM, OLMoE and Aria (a vision-language model whose decoder has experts)
equal Transformers' own output.

Same harness as `test_default_routed.py`: tiny float32 checkpoints with every 1-D
parameter perturbed (`tiny.py`, `tiny_multimodal.py`, whose recipes say what each
one exercises), greedy tokens equal to Transformers' `generate`, logprobs within
`tiny.logprob_atol`, `E2E_IMPL` to run vLLM's stock backend or vLLM 0.32's native
model instead. OLMoE's engine is the one `test_moe_end_to_end.py` starts (shared);
it runs at PP=2 in `test_parallel.py`. Aria runs with images, at PP=2: its tower and
projector on the first stage.
"""

import functools
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tiny  # noqa: E402
import tiny_multimodal  # noqa: E402
from tiny import cached_reference as reference  # noqa: E402
from tiny import compare, report  # noqa: E402

ARCHS = ["gemma", "stablelm", "olmoe"]

E2E_IMPL = tiny.e2e_impl()

NATIVE_LACKS = {
    "stablelm": "vLLM 0.32's native StableLM has no q/k LayerNorms and no parallel "
    "residual (StableLM 2 12B's layout)",
}
"""Recipes vLLM 0.32's native model computes differently from Transformers."""


@pytest.mark.parametrize("model_type", ["gemma", "stablelm"])
def test_reference_is_well_separated(model_type):
    """Greedy choices must not hinge on float32 noise."""
    tiny.check_well_separated(model_type)


@pytest.mark.parametrize(
    "model_type, change",
    [
        ("stablelm", dict(qk_layernorm=False)),
        ("stablelm", dict(use_parallel_residual=False)),
    ],
    ids=["stablelm-qk-norms", "stablelm-parallel-residual"],
)
def test_feature_changes_output(model_type, change):
    """Without the feature the reference moves far beyond the tolerance."""
    tiny.check_feature_changes_output(model_type, **change)


@pytest.mark.engine
@pytest.mark.parametrize("model_type", ARCHS)
def test_matches_transformers(model_type):
    """Greedy tokens equal Transformers' `generate`; logprobs agree."""
    if E2E_IMPL == "native" and model_type in NATIVE_LACKS:
        pytest.skip(NATIVE_LACKS[model_type])
    run = tiny.shared_engine(model_type, E2E_IMPL)
    gap = compare(reference(model_type), run.completions, tiny.logprob_atol(model_type))
    report(f"{model_type} ({E2E_IMPL}) vs Transformers", run, gap)


ARIA = "aria"


@functools.cache
def aria_engine() -> tiny_multimodal.MultiModalRun:
    """Aria on one image, two and none, at PP=2 (compiled, a core per stage)."""
    requests = tiny_multimodal.requests(tiny_multimodal.RECIPES[ARIA])
    return tiny_multimodal.run_engine(
        tiny_multimodal.build(ARIA),
        ARIA,
        list(requests.values()),
        backend=tiny.IMPLS[E2E_IMPL]["backend"],
        # vLLM profiles the tower on every stage with as many of the largest images
        # as its budgets allow (1024 of 980 px by default: 12 GB per stage).
        llm_kwargs=dict(
            tiny.PIPELINE_PARALLEL,
            pipeline_parallel_size=2,
            max_num_seqs=4,
            limit_mm_per_prompt={"image": 2},
        ),
        extra_env=dict(VLLM_CPU_OMP_THREADS_BIND="0|1"),
    )


@functools.cache
def aria_reference() -> dict[str, tiny_multimodal.Completion]:
    requests = tiny_multimodal.requests(tiny_multimodal.RECIPES[ARIA])
    completions = tiny_multimodal.reference(
        tiny_multimodal.build(ARIA), ARIA, list(requests.values())
    )
    return dict(zip(requests, completions))


@pytest.mark.engine
@pytest.mark.parametrize("request_name", list(tiny_multimodal.REQUESTS))
def test_aria_with_images_at_pipeline_parallel_equals_transformers(request_name):
    """Aria's processor (every picture padded to 980 px), its Idefics3 tower and
    cross-attending projector on every stage (run on the first), its decoder's
    experts on vLLM's fused MoE across two stages: the same tokens and
    log-probabilities as Transformers on one image, two and none."""
    if E2E_IMPL == "native":
        pytest.skip("the multimodal harness runs the Transformers backend")
    run = aria_engine()
    assert run.compiled
    want = aria_reference()[request_name]
    got = run.completions[list(tiny_multimodal.REQUESTS).index(request_name)]
    assert got.prompt_ids == want.prompt_ids, "the image placeholders differ"
    assert got.token_ids == want.token_ids
    gap = max(abs(a - b) for a, b in zip(want.logprobs, got.logprobs))
    assert gap <= tiny.LOGPROB_ATOL, f"logprob gap {gap:.3g}"
    print(f"\n[e2e] aria (PP=2), {request_name}: {run.seconds:.1f} s, gap {gap:.2e}")
