# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A mixed load for the OpenAI server, sent at once with the official async client.

Shared by the server test (`test_server.py`) and the load benchmark
(`benchmarks/benchmark_load.py`). One round sends every request of `workload()`
concurrently: completions streamed and not, prompts of every length up to the
model's limit (with their outputs), streams the client closes after the first chunk
(cancelled mid-stream), and invalid requests (a prompt past the limit, bad sampling
parameters, an unknown model). Greedy decoding throughout (`temperature=0`,
`ignore_eos`), with the two most likely tokens' log-probabilities of each step, so
that two runs of one request can be compared token by token."""

from __future__ import annotations

import asyncio
import random
import re
import statistics
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tiny

TOP = 2
"""Log-probabilities asked per step: the chosen token and its runner-up."""
TIE = 1e-4
"""Two log-probabilities closer than this are a float32 tie (two correct batchings
of one request differ by ~1e-6 here), where greedy may pick either token."""


@dataclass(frozen=True)
class Request:
    kind: str
    """`plain`, `stream`, `cancel` (a stream closed after its first chunk) or
    `invalid`."""
    prompt: str
    max_tokens: int
    changes: dict[str, Any] = field(default_factory=dict)
    """For `invalid`: what makes it so (keyword arguments of `create`)."""
    expect: str = ""
    """For `invalid`: a word the server's error message must contain."""

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt.split()) + 1  # the tiny tokenizer adds `<s>`


@dataclass
class Outcome:
    request: Request
    seconds: float
    text: str = ""
    tokens: list[str] = field(default_factory=list)
    top: list[dict[str, float]] = field(default_factory=list)
    status: int | None = None
    """The HTTP status of a refused request."""
    message: str = ""
    chunks: int = 0
    unexpected: str | None = None
    """What went wrong that should not have (an exception, a request accepted that
    should have been refused)."""


def _prompt(rng: random.Random, tokens: int) -> str:
    return " ".join(rng.choice(tiny.WORDS) for _ in range(tokens - 1))


INVALID: list[tuple[dict[str, Any], str, int]] = [
    # (changes, a word the message must have, prompt tokens)
    # The prompt alone is too long. (One that leaves too little room for its
    # `max_tokens` is valid: vLLM 0.32 stops it at the context's end.)
    ({}, "context length", tiny.MAX_MODEL_LEN + 8),
    ({"presence_penalty": 3.0}, "presence_penalty", 8),
    ({"temperature": -1.0}, "temperature", 8),
    ({"top_p": 1.5}, "top_p", 8),
    ({"max_tokens": 0}, "max_tokens", 8),
    ({"logprobs": 1000}, "logprobs", 8),
    ({"model": "no-such-model"}, "model", 8),
]


CANCELLED_PROMPT_TOKENS = 8
CANCELLED_MAX_TOKENS = tiny.MAX_MODEL_LEN - CANCELLED_PROMPT_TOKENS
"""A cancelled stream asks for the rest of the context: with 16 tokens, a client slowed
by the rest of the round (CI, 2 cores) read its first chunk after the engine had
generated all 16 for every one of the 24, and there was nothing left to abort."""


def workload(
    plain: int = 120, stream: int = 120, cancel: int = 24, invalid: int = 28,
    seed: int = 0,
) -> list[Request]:  # fmt: skip
    """The requests of one round, shuffled. Valid prompts take from 2 tokens to the
    whole context with their `max_tokens` (1 to 16): every eighth exactly fills it.
    Cancelled streams have short prompts and ask for the rest of the context."""
    rng = random.Random(seed)
    requests = []
    for index in range(plain + stream + cancel):
        kind = (
            "plain" if index < plain else "stream" if index < plain + stream else "cancel"
        )
        if kind == "cancel":
            max_tokens, tokens = CANCELLED_MAX_TOKENS, CANCELLED_PROMPT_TOKENS
        else:
            max_tokens = rng.randint(1, tiny.MAX_TOKENS)
            room = tiny.MAX_MODEL_LEN - max_tokens
            tokens = room if index % 8 == 0 else rng.randint(2, room)
        requests.append(Request(kind, _prompt(rng, tokens), max_tokens))
    for index in range(invalid):
        changes, expect, tokens = INVALID[index % len(INVALID)]
        requests.append(
            Request(
                "invalid", _prompt(rng, tokens), tiny.MAX_TOKENS, changes, expect
            )
        )
    rng.shuffle(requests)
    return requests


def client(base_url: str, connections: int = 1024):
    """The official async client, with a connection pool as wide as the load."""
    import httpx
    import openai

    return openai.AsyncOpenAI(
        base_url=base_url,
        api_key="EMPTY",
        timeout=600,
        max_retries=0,
        http_client=openai.DefaultAsyncHttpxClient(
            limits=httpx.Limits(
                max_connections=connections, max_keepalive_connections=connections
            )
        ),
    )


async def send(api, model: str, request: Request) -> Outcome:
    """Send one request; never raises (what went wrong is in the outcome)."""
    import openai

    arguments = dict(
        model=model,
        prompt=request.prompt,
        max_tokens=request.max_tokens,
        temperature=0.0,
        logprobs=TOP,
        extra_body={"ignore_eos": True},
    )
    arguments.update(request.changes)
    outcome = Outcome(request, seconds=0.0)
    start = time.perf_counter()
    try:
        if request.kind in ("plain", "invalid"):
            response = await api.completions.create(**arguments)
            _add(outcome, response.choices[0])
            outcome.chunks = 1
            if request.kind == "invalid":
                outcome.unexpected = "accepted"
        else:
            stream = await api.completions.create(**arguments, stream=True)
            async for chunk in stream:
                for choice in chunk.choices:
                    _add(outcome, choice)
                outcome.chunks += 1
                if request.kind == "cancel" and outcome.tokens:
                    await stream.close()  # mid-stream: the server must abort it
                    break
    except openai.APIStatusError as error:
        outcome.status, outcome.message = error.status_code, error.message
        if request.kind != "invalid":
            outcome.unexpected = f"{error.status_code}: {error.message}"
    except Exception as error:  # noqa: BLE001 - reported, and fails the check
        outcome.unexpected = f"{type(error).__name__}: {error}"
    outcome.seconds = time.perf_counter() - start
    return outcome


def _add(outcome: Outcome, choice) -> None:
    outcome.text += choice.text
    if choice.logprobs is not None:
        outcome.tokens += choice.logprobs.tokens or []
        outcome.top += choice.logprobs.top_logprobs or []


async def _round(base_url: str, model: str, requests: list[Request]) -> list[Outcome]:
    api = client(base_url)
    try:
        return list(await asyncio.gather(*(send(api, model, r) for r in requests)))
    finally:
        await api.close()


async def _alone(base_url: str, model: str, requests: list[Request]) -> list[Outcome]:
    api = client(base_url, connections=1)
    try:
        return [await send(api, model, r) for r in requests]
    finally:
        await api.close()


def run_round(base_url: str, model: str, requests: list[Request]) -> list[Outcome]:
    """Every request of `requests` at once."""
    return asyncio.run(_round(base_url, model, requests))


def run_alone(base_url: str, model: str, requests: list[Request]) -> list[Outcome]:
    """Each of `requests` in turn, none beside another, as a plain completion."""
    return asyncio.run(
        _alone(
            base_url,
            model,
            [Request("plain", r.prompt, r.max_tokens) for r in requests],
        )
    )


def divergence(got: Outcome, alone: Outcome) -> str | None:
    """`None` when `got` chose the tokens `alone` chose, or differs first at a float32
    tie (both candidates within `TIE` in both runs); else what differs, and where."""
    if got.tokens == alone.tokens and got.text == alone.text:
        return None
    step = next(
        (i for i, (a, b) in enumerate(zip(got.tokens, alone.tokens)) if a != b),
        min(len(got.tokens), len(alone.tokens)),
    )
    if step < min(len(got.tokens), len(alone.tokens)):
        mine, theirs = got.tokens[step], alone.tokens[step]
        if all(
            mine in top and theirs in top and abs(top[mine] - top[theirs]) <= TIE
            for top in (got.top[step], alone.top[step])
        ):
            return None
    return (
        f"{got.request.kind} request ({got.request.prompt_tokens} prompt tokens, "
        f"max_tokens {got.request.max_tokens}) differs from the same request alone "
        f"at step {step}:\n  under load {got.tokens}\n  alone      {alone.tokens}"
    )


def metric(base_url: str, name: str) -> float:
    """The sum of the Prometheus metric `name` over its series on `/metrics`."""
    root = base_url.removesuffix("/v1")
    with urllib.request.urlopen(f"{root}/metrics", timeout=30) as response:
        text = response.read().decode()
    pattern = rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$"
    return sum(float(value) for value in re.findall(pattern, text, re.M))


def settled(base_url: str, timeout: float = 30) -> float:
    """Wait until the engine runs and queues no request; returns how many it still
    held when `timeout` ran out (0 when it settled)."""
    deadline = time.monotonic() + timeout
    while True:
        held = metric(base_url, "vllm:num_requests_running") + metric(
            base_url, "vllm:num_requests_waiting"
        )
        if held == 0 or time.monotonic() > deadline:
            return held
        time.sleep(0.5)


def rss_bytes(session: int) -> int:
    """Resident memory of every process of `session` (the server and the engine
    processes it started), from /proc."""
    total = 0
    for pid in tiny.session_processes(session):
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        found = re.search(r"^VmRSS:\s+(\d+) kB", status, re.M)
        total += int(found.group(1)) * 1024 if found else 0
    return total


def latency_summary(outcomes: list[Outcome], seconds: float) -> dict[str, float]:
    """Requests/s of the round and p50/p99 latency of its completed requests."""
    done = sorted(o.seconds for o in outcomes if o.request.kind in ("plain", "stream"))
    quantiles = statistics.quantiles(done, n=100, method="inclusive")
    return dict(
        requests_per_s=len(outcomes) / seconds,
        p50_s=quantiles[49],
        p99_s=quantiles[98],
    )
