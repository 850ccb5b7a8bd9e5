# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The OpenAI-compatible server with `--model-impl transformers` answers a completion
with Transformers' own greedy text (tiny Llama, 127.0.0.1, the official client)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tiny  # noqa: E402

PROMPT = tiny.PROMPTS[0]


@pytest.mark.engine
def test_completion_matches_transformers(tmp_path):
    openai = pytest.importorskip("openai")
    path = tiny.build("llama")
    (want,) = tiny.reference(path, [PROMPT], tiny.MAX_TOKENS)

    with tiny.serve(path, model_impl="transformers", log_dir=tmp_path) as server:
        client = openai.OpenAI(
            base_url=server.base_url, api_key="EMPTY", timeout=120, max_retries=0
        )
        response = client.completions.create(
            model=server.model,
            prompt=PROMPT,
            max_tokens=tiny.MAX_TOKENS,
            temperature=0.0,
            logprobs=1,
            extra_body={"ignore_eos": True},
        )
        log = server.log()

    (choice,) = response.choices
    assert choice.text == want.text, (
        f"\nserver:       {choice.text!r}\nTransformers: {want.text!r}"
    )
    assert response.usage.completion_tokens == tiny.MAX_TOKENS
    assert response.usage.prompt_tokens == len(want.prompt_ids)
    gaps = [abs(a - b) for a, b in zip(choice.logprobs.token_logprobs, want.logprobs)]
    assert len(gaps) == tiny.MAX_TOKENS and max(gaps) <= 5e-5, gaps
    # The server's engine ran this project's backend.
    assert "Transformers modeling backend: project" in log, tiny._tail(log)
    print(f"\n[server] {choice.text!r}, max |logprob gap| {max(gaps):.2e}")
