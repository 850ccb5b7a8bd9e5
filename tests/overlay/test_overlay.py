# SPDX-License-Identifier: Apache-2.0
"""The overlay's switch, `VLLM_TRANSFORMERS_BACKEND`: an invalid value refuses vLLM in
every process, with the reason, instead of falling back to an implementation."""

import os
import subprocess
import sys

import pytest
import tiny

INVALID = "projet"  # a near miss


def _run(*args: str, value: str = INVALID) -> subprocess.CompletedProcess:
    env = {**os.environ, "VLLM_TRANSFORMERS_BACKEND": value}
    return subprocess.run(
        [sys.executable, *args], env=env, capture_output=True, text=True, timeout=300
    )


def _says_why(text: str) -> bool:
    return (
        "VLLM_TRANSFORMERS_BACKEND must be 'project'" in text
        and repr(INVALID) in text
        and "vLLM does not start" in text
    )


def test_the_active_implementation_command_fails_with_the_reason():
    done = _run("-m", "vllm_transformers_overlay")
    assert done.returncode == 1
    assert done.stderr.startswith("Transformers modeling backend: none (")
    assert _says_why(done.stderr)


def test_importing_vllm_fails_with_the_reason_and_nothing_else_does():
    done = _run("-c", "import vllm")
    assert done.returncode == 1
    assert "ImportError" in done.stderr and _says_why(done.stderr)
    # The interpreter itself starts quietly: the hook raises nothing at start-up.
    quiet = _run("-c", "import json; print('ok')")
    assert (quiet.returncode, quiet.stdout, quiet.stderr) == (0, "ok\n", "")


@pytest.mark.parametrize("value", ["STOCK", ""])  # case is ignored; "" is the default
def test_valid_values_choose_an_implementation(value):
    done = _run("-m", "vllm_transformers_overlay", value=value)
    assert done.returncode == 0, done.stderr
    chosen = "stock" if value.lower() == "stock" else "project"
    assert done.stdout.startswith(f"Transformers modeling backend: {chosen} (")


def test_the_server_refuses_to_start_and_leaves_nothing_behind(tmp_path):
    """Before: vLLM's registry logged the failed import of the backend class and
    served the model with its native implementation."""
    with pytest.raises(tiny.ServerExited) as exited:
        with tiny.serve(tmp_path, backend=INVALID, log_dir=tmp_path, ready_timeout=120):
            pass
    assert exited.value.returncode != 0
    assert _says_why(exited.value.log)
    assert exited.value.left_behind == [] and exited.value.port_free
