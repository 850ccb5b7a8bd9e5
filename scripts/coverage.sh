#!/usr/bin/env bash
# Fusion coverage beside vLLM's stock backend: every causal-LM model type on `meta`,
# swept once per backend through the fuser registry both share (benchmarks/coverage.py;
# a few minutes). Prints the markdown table the README quotes; --json for the rows.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup_env.sh
exec "$ROOT/.venv/bin/python" benchmarks/coverage.py "$@"
