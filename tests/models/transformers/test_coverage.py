# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""End to end on the CPU engine: architectures beyond vLLM's default routes to the
Transformers backend (served with `model_impl="transformers"`) equal Transformers'
own output.

Same harness as `test_default_routed.py`: tiny float32 checkpoints (`tiny.py`, whose
recipes say what each one exercises), greedy tokens equal to Transformers' `generate`,
logprobs within `LOGPROB_ATOL`, one engine start per (model, implementation, TP), and
`E2E_IMPL` to run vLLM's stock backend or its native model instead.
"""

import pytest

import tiny
from tiny import cached_reference as reference
from tiny import compare, report

ARCHS = [
    # Conv1D linears (weights stored transposed), q/k/v packed in one `c_attn`.
    "gpt2",
]

TENSOR_PARALLEL = ["gpt2"]
"""Packed q/k/v split per rank, the output projection row-parallel, the MLP
replicated (GPT-2 has no tensor-parallel plan)."""

E2E_IMPL = tiny.e2e_impl()


# --- the references themselves (no engine) ---------------------------------------------


@pytest.mark.parametrize("model_type", ARCHS)
def test_reference_is_well_separated(model_type):
    """Greedy choices must not hinge on float32 noise."""
    completions = reference(model_type)
    margin = min(min(c.margins) for c in completions)
    assert margin >= tiny.MIN_MARGIN, f"{model_type}: top-1/top-2 margin {margin:.3g}"
    for c in completions:
        assert len(c.token_ids) == tiny.MAX_TOKENS
        assert all(lp < 0 for lp in c.logprobs)


# --- the engine ---------------------------------------------------------------------------


@pytest.mark.engine
@pytest.mark.parametrize("model_type", ARCHS)
def test_matches_transformers(model_type):
    """Greedy tokens equal Transformers' `generate`; logprobs agree."""
    run = tiny.shared_engine(model_type, E2E_IMPL)
    gap = compare(reference(model_type), run.completions)
    report(f"{model_type} ({E2E_IMPL}) vs Transformers", run, gap)


@pytest.mark.engine
@pytest.mark.parametrize("model_type", TENSOR_PARALLEL)
def test_tensor_parallel_matches_transformers(model_type):
    """TP=2 (one core per rank) equals Transformers and TP=1."""
    tp2 = tiny.shared_engine(model_type, E2E_IMPL, 2)
    assert len(tp2.probe) == 2 and len({w["pid"] for w in tp2.probe}) == 2
    gap = compare(reference(model_type), tp2.completions)
    compare(
        tiny.shared_engine(model_type, E2E_IMPL).completions,
        tp2.completions,
        atol=2 * tiny.LOGPROB_ATOL,
    )
    report(f"{model_type} ({E2E_IMPL}, TP=2) vs Transformers", tp2, gap)
