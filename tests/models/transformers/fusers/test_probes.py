# SPDX-License-Identifier: Apache-2.0
"""What the fusers that probe share (`fusers/probes.py`): draws on the CPU whatever
the default device, the same on every run, and a failed probe's reason."""

import torch

from vllm.model_executor.models.transformers.fusers.probes import Draws, failed


def test_draws_are_on_the_cpu_under_a_meta_default_and_repeat():
    # The report builds models with `meta` as the default device.
    with torch.device("meta"):
        first = Draws(seed=3).normal((2, 5), std=0.5, dtype=torch.float32)
    again = Draws(seed=3).normal((2, 5), std=0.5, dtype=torch.float32)
    assert first.device.type == "cpu" and first.dtype == torch.float32
    assert torch.equal(first, again)


def test_each_draw_continues_one_stream():
    draws = Draws()
    first, second = draws.normal((4,)), draws.normal((4,))
    assert not torch.equal(first, second)
    both = Draws().normal((8,))
    assert torch.equal(torch.cat((first, second)), both)


def test_a_failed_probe_says_what_raised():
    reason = failed(ValueError("no such width"), "its gate `_apply_gate`")
    assert reason == (
        "its gate `_apply_gate` fails on a probe: ValueError: no such width"
    )
    assert failed(RuntimeError("x")) == "it fails on a probe: RuntimeError: x"
