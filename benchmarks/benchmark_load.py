# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The OpenAI server under load: this backend against vLLM's native model.

Two servers on 127.0.0.1 serve the tiny Llama of the tests, one with
`--model-impl transformers` (this backend), one with `--model-impl vllm` (vLLM's
hand-written Llama). Both start first and stay up; then they take turns taking the
same round of load (`tests/models/transformers/load.py`: 292 requests sent at once
with the official async client: 240 greedy completions streamed and not, 24 streams
cancelled after their first chunk, 28 invalid requests), order rotated each round,
after one warm-up round each. Reported per implementation: requests/s of a round
(median over rounds), p50/p99 latency of the completed requests (over all rounds),
resident memory of the server and its engine processes after each round, and how
many completions differ between the two (beyond float32 ties).

    .venv/bin/python benchmarks/benchmark_load.py [--rounds 5]

Writes `.cache/benchmarks/load.json` and prints a markdown table for the README.
"""

import argparse
import contextlib
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "models" / "transformers"))
import load  # noqa: E402
import tiny  # noqa: E402

IMPLS = {"this backend": "transformers", "vLLM native": "vllm"}
"""Row name -> `--model-impl`."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    path = tiny.build("llama")
    requests = load.workload()
    valid = [i for i, r in enumerate(requests) if r.kind in ("plain", "stream")]
    results = {name: dict(seconds=[], outcomes=[], rss_mib=[]) for name in IMPLS}
    with contextlib.ExitStack() as stack:
        servers = {
            name: stack.enter_context(tiny.serve(path, model_impl=impl))
            for name, impl in IMPLS.items()
        }
        for server in servers.values():  # warm-up
            load.run_round(server.base_url, server.model, requests)
        names = list(IMPLS)
        for round_index in range(args.rounds):
            for name in names[round_index % 2 :] + names[: round_index % 2]:
                server = servers[name]
                started = time.perf_counter()
                outcomes = load.run_round(server.base_url, server.model, requests)
                seconds = time.perf_counter() - started
                load.settled(server.base_url)
                rss = load.rss_bytes(server.process.pid) >> 20
                result = results[name]
                result["seconds"].append(seconds)
                result["outcomes"].append(outcomes)
                result["rss_mib"].append(rss)
                print(
                    f"round {round_index}: {name}: {seconds:.2f} s, {rss} MiB",
                    flush=True,
                )

    summary = {}
    for name, result in results.items():
        outcomes = [o for round_ in result["outcomes"] for o in round_]
        unexpected = sum(o.unexpected is not None for o in outcomes)
        latencies = load.latency_summary(outcomes, sum(result["seconds"]))
        summary[name] = dict(
            requests_per_s=len(requests) / statistics.median(result["seconds"]),
            p50_s=latencies["p50_s"],
            p99_s=latencies["p99_s"],
            rss_mib=result["rss_mib"],
            unexpected=unexpected,
        )
    ours, native = (results[name]["outcomes"][-1] for name in IMPLS)
    differing = sum(load.divergence(ours[i], native[i]) is not None for i in valid)

    machine = f"{platform.machine()}, {os.cpu_count()} cores (shared)"
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    print(f"\n{len(requests)} requests a round, {args.rounds} rounds; {when}")
    print(machine)
    print("| implementation | requests/s (median) | p50 latency | p99 latency | "
          "RSS after each round (MiB) | failed |")
    print("|---|---:|---:|---:|---|---:|")
    for name, row in summary.items():
        print(
            f"| {name} (`--model-impl {IMPLS[name]}`) | {row['requests_per_s']:.1f} | "
            f"{row['p50_s']:.2f} s | {row['p99_s']:.2f} s | "
            f"{', '.join(map(str, row['rss_mib']))} | {row['unexpected']} |"
        )
    print(f"completions differing between the two: {differing}/{len(valid)}")
    out = REPO / ".cache" / "benchmarks" / "load.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(dict(when=when, machine=machine, rounds=args.rounds,
                        requests=len(requests), summary=summary,
                        differing=differing), indent=1)
    )  # fmt: skip


if __name__ == "__main__":
    main()
