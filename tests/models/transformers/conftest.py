# SPDX-License-Identifier: Apache-2.0
"""Fixtures for building the backend in-process, on the CPU, from a config alone."""

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import PreTrainedConfig

from vllm.config import (
    DeviceConfig,
    LoadConfig,
    ModelConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.model_executor.models.transformers import report
from vllm.utils.torch_utils import set_default_torch_dtype


@pytest.fixture(scope="session")
def vllm_runtime() -> Iterator[None]:
    """A world-size-1 gloo group, which vLLM's parallel layers need to exist."""
    with report.vllm_runtime():
        yield


@pytest.fixture
def build_backend(vllm_runtime: None, tmp_path: Path) -> Callable[..., nn.Module]:
    """Build a backend class (default `TransformersForCausalLM`) for `config`, on the
    CPU, as vLLM would, but without weights and without an engine.

    `served_config` replaces the config vLLM parsed, for architectures vLLM's own
    registry refuses before any of the backend's code runs (DESIGN §6)."""

    def build(
        config: PreTrainedConfig,
        backend_class: str = "TransformersForCausalLM",
        served_config: PreTrainedConfig | None = None,
    ) -> nn.Module:
        import vllm.model_executor.models.transformers as backend

        config.save_pretrained(tmp_path)
        model_config = ModelConfig(
            model=str(tmp_path),
            model_impl="transformers",
            dtype="float32",
            skip_tokenizer_init=True,
        )
        if served_config is not None:
            model_config.hf_config = served_config
            model_config.hf_text_config = served_config.get_text_config()
        vllm_config = VllmConfig(
            model_config=model_config,
            device_config=DeviceConfig("cpu"),
            load_config=LoadConfig(load_format="dummy"),
        )
        with (
            set_current_vllm_config(vllm_config),
            set_default_torch_dtype(torch.float32),
        ):
            return getattr(backend, backend_class)(vllm_config=vllm_config)

    return build
