#!/usr/bin/env bash
# The whole suite: set up the environment, then run every test (the engine tests too;
# `-m "not engine"` skips those). Extra arguments go to pytest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup_env.sh
exec "$ROOT/.venv/bin/python" -m pytest tests -q -p no:cacheprovider --durations=15 "$@"
