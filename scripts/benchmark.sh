#!/usr/bin/env bash
# The benchmark: set up the environment, then measure this backend against vLLM's
# native Llama and vLLM's stock backend (throughput on the CPU engine) and time fuser
# detection over 2-128 layers (benchmarks/benchmark_backend.py; about 11 minutes).
# Writes .cache/benchmarks/latest.json and prints a markdown table for the README.
# Extra arguments go to the script (--rounds N, --dtype float32, --eager, --skip-...).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup_env.sh
exec "$ROOT/.venv/bin/python" benchmarks/benchmark_backend.py "$@"
