# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The OpenAI-compatible server with `--model-impl transformers` answers a completion
with Transformers' own greedy text (tiny Llama, 127.0.0.1, the official client)."""

import json
import shutil
import sys
import time
from pathlib import Path

import pytest
from configs import repository_code
from transformers import AutoConfig

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


MEMORY_GROWTH = 128 << 20
"""How much the server's and its engine's resident memory (3 GiB here) may grow from
one round of load to the next, once a first round has warmed them up (same requests
each round). Measured: the API server and the engine core stay within 2 MiB; the
worker grows 16-63 MiB a round, less and less over eight rounds."""
GENERATED = "vllm:generation_tokens_total"


@pytest.mark.engine
def test_the_server_under_load_loses_nothing(tmp_path):
    """All requests of `load.workload()` (292: 240 completions, streamed and not,
    24 streams cancelled after their first chunk, 28 invalid) at once, in three
    rounds. Every valid one completes with the tokens it gets alone; every cancelled
    one is aborted by the engine; every invalid one gets a 4xx that says what is
    wrong; no request is left in the engine; memory stays flat after the first
    round; the server still answers."""
    pytest.importorskip("openai")
    import load

    requests = load.workload()
    valid = [r for r in requests if r.kind in ("plain", "stream")]
    rounds, memory = [], []
    with tiny.serve(tiny.build("llama"), log_dir=tmp_path) as server:
        url, model = server.base_url, server.model
        # Tokens the cancelled streams would generate if they were not aborted.
        unaborted = sum(r.max_tokens for r in requests if r.kind == "cancel")
        for _ in range(3):
            generated = load.metric(url, GENERATED)
            started = time.perf_counter()
            outcomes = load.run_round(url, model, requests)
            rounds.append((outcomes, time.perf_counter() - started))
            assert load.settled(url) == 0, "requests left in the engine"
            memory.append(load.rss_bytes(server.process.pid))
            for_cancelled = (
                load.metric(url, GENERATED)
                - generated
                - sum(r.max_tokens for r in valid)
            )
            print(f"\n[load] cancelled streams generated {for_cancelled:.0f} tokens")
            assert 0 < for_cancelled < unaborted, (for_cancelled, unaborted)
        alone = load.run_alone(url, model, valid)
        (final,) = load.run_round(url, model, valid[:1])
        assert server.process.poll() is None

    for outcomes, seconds in rounds:
        unexpected = [(o.request, o.unexpected) for o in outcomes if o.unexpected]
        assert not unexpected, unexpected[:5]
        completed = [o for o in outcomes if o.request.kind in ("plain", "stream")]
        assert all(len(o.tokens) == o.request.max_tokens for o in completed)
        differences = [
            d for o, a in zip(completed, alone) if (d := load.divergence(o, a))
        ]
        assert not differences, "\n".join(differences[:3])
        ties = sum(o.tokens != a.tokens for o, a in zip(completed, alone))
        for o in outcomes:
            if o.request.kind == "invalid":
                assert 400 <= o.status < 500, (o.request, o.status)
                assert o.request.expect in o.message.lower(), (o.request, o.message)
            elif o.request.kind == "cancel":
                # Closed after its first chunk, which may already hold every token
                # on a busy machine (the server coalesces what a slow client has
                # not read): that the engine aborts them is checked on its count.
                assert o.chunks >= 1 and o.tokens
        figures = load.latency_summary(outcomes, seconds)
        print(
            f"\n[load] {len(outcomes)} requests in {seconds:.1f} s: "
            f"{figures['requests_per_s']:.1f} req/s, p50 {figures['p50_s']:.2f} s, "
            f"p99 {figures['p99_s']:.2f} s; {ties} differing from alone at a tie"
        )
    assert load.divergence(final, alone[0]) is None
    print(f"[load] resident memory after each round: {[m >> 20 for m in memory]} MiB")
    assert memory[2] - memory[1] <= MEMORY_GROWTH, memory


def _refused_at_start(path: Path, log_dir: Path, **serve) -> tiny.ServerExited:
    """Start the server on `path`, which must refuse it; check nothing is left."""
    with pytest.raises(tiny.ServerExited) as exited:
        with tiny.serve(path, log_dir=log_dir, ready_timeout=240, **serve):
            pass
    refused = exited.value
    assert refused.returncode != 0
    assert refused.left_behind == [], "engine processes outlived the server"
    assert refused.port_free
    return refused


@pytest.mark.engine
def test_a_truncated_checkpoint_stops_the_server_naming_the_file(tmp_path):
    """The error path through the engine: the worker's load fails, the engine core
    and the server follow, and the log names the file (after safetensors' own
    traceback, which does not)."""
    folder = tmp_path / "checkpoint"
    shutil.copytree(tiny.build("llama"), folder)
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    refused = _refused_at_start(folder, tmp_path)
    assert "ValueError: Reading the checkpoint failed before its first" in refused.log
    assert f"{weights}: truncated: {len(data) // 2} bytes" in refused.log


@pytest.mark.engine
def test_repository_code_not_trusted_stops_the_server_without_running_it(tmp_path):
    config = AutoConfig.from_pretrained(tiny.build("llama"))
    config.model_type = "marker_model"
    marker = repository_code(tmp_path / "checkpoint", config)
    path = marker.parent / "config.json"
    path.write_text(
        json.dumps({**json.loads(path.read_text()), "model_type": "marker_model"})
    )
    refused = _refused_at_start(marker.parent, tmp_path)
    assert "trust_remote_code=True" in refused.log
    assert not marker.exists()
