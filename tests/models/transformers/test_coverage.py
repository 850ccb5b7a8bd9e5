# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""End to end on the CPU engine: architectures beyond vLLM's default routes to the
Transformers backend (vLLM serves them natively unless asked for
`model_impl="transformers"`) equal Transformers' own output through this backend.

Same harness as `test_default_routed.py`: tiny float32 checkpoints (`tiny.py`, whose
recipes say what each one exercises), greedy tokens equal to Transformers'
`generate`, logprobs within `LOGPROB_ATOL`, one engine start per (model,
implementation) and `E2E_IMPL` to run vLLM's stock backend or its native model
instead.

The tests without the `engine` mark check the references themselves: that greedy
choices are well separated and that the features the recipes are meant to exercise
change the output.
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tiny  # noqa: E402
from tiny import cached_reference as reference  # noqa: E402
from tiny import checkpoint, compare, report  # noqa: E402

ARCHS = [
    "gemma4_text",
]

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


@pytest.mark.parametrize(
    "model_type, change",
    [("gemma4_text", dict(sliding_window=tiny.MAX_MODEL_LEN))],
    ids=["gemma4-window"],
)
def test_feature_changes_output(model_type, change):
    """Without the feature, the reference output moves far beyond the tolerance."""
    changed = tiny.reference(checkpoint(model_type), **change)
    assert tiny.differs(reference(model_type), changed)


# --- the engine ---------------------------------------------------------------------------


@pytest.mark.engine
@pytest.mark.parametrize("model_type", ARCHS)
def test_matches_transformers(model_type):
    """Greedy tokens equal Transformers' `generate`; logprobs agree."""
    run = tiny.shared_engine(model_type, E2E_IMPL)
    gap = compare(reference(model_type), run.completions)
    report(f"{model_type} ({E2E_IMPL}) vs Transformers", run, gap)
