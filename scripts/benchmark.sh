#!/usr/bin/env bash
# The benchmark: set up the environment (plus matplotlib, for the plot; the tests do
# not need it), then measure this backend against vLLM's native models and vLLM's
# stock backend on the CPU engine: throughput (generation, prefill, decode), engine
# start cold and warm, construction per layer (benchmarks/benchmark_backend.py).
# Writes .cache/benchmarks/latest.json and latest.png, prints markdown tables.
# Extra arguments go to the script (--models llama,qwen3 --modes eager --rounds 3 ...).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup_env.sh
if ! "$ROOT/.venv/bin/python" -c "import matplotlib" >/dev/null 2>&1; then
    "$ROOT/.venv/bin/python" -m pip install -q matplotlib
fi
exec "$ROOT/.venv/bin/python" benchmarks/benchmark_backend.py "$@"
