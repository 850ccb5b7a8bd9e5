#!/usr/bin/env bash
# The demo: set up the environment, then serve a tiny Llama through the Transformers
# modeling backend, ask it once, and show what the backend did (scripts/demo.py).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup_env.sh
exec "$ROOT/.venv/bin/python" scripts/demo.py "$@"
