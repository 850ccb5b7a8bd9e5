# SPDX-License-Identifier: Apache-2.0
"""The demo reads what the backend did from the log lines the backend writes: each
attention layer with its index and scale, and each fusion."""

import importlib.util
import logging
from pathlib import Path

import pytest

from configs import small_config

REPO = Path(__file__).resolve().parents[3]


def load_demo():
    spec = importlib.util.spec_from_file_location("demo", REPO / "scripts" / "demo.py")
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    return demo


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def backend_log():
    handler = Lines()
    logger = logging.getLogger("vllm.model_executor.models.transformers")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler.lines
    logger.removeHandler(handler)
    logger.setLevel(level)


def test_the_demo_shows_every_attention_layers_index_and_scale(
    build_backend, backend_log
):
    config = small_config("llama", num_hidden_layers=3, head_dim=16)
    build_backend(config)
    attention, fused, _ = load_demo().backend_activity("\n".join(backend_log))

    assert sorted(int(entry["layer"]) for entry in attention) == [0, 1, 2]
    assert {entry["scale"] for entry in attention} == {f"{16**-0.5:.6g}"}
    assert any("qkv_proj" in line for line in fused)
