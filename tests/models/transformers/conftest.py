# SPDX-License-Identifier: Apache-2.0
"""Fixtures for building the backend in-process, on the CPU, from a config alone; a
clean fuser registry per test; fusing a module the way the backend does and loading
the original weights into the result through vLLM's weight loaders."""

import copy
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import PreTrainedConfig

from vllm.config import (
    CacheConfig,
    DeviceConfig,
    LoadConfig,
    ModelConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.model_executor.models.transformers import plan as registry
from vllm.model_executor.models.transformers import report
from vllm.model_executor.models.transformers.fusers.base import BaseFuser
from vllm.model_executor.models.utils import AutoWeightsLoader, WeightsMapper
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
        prefix_caching: bool = False,
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
        # The model-wide window as vLLM's engine sets it (`EngineArgs`): where the
        # config has no `layer_types`, or only sliding ones.
        layer_types = getattr(model_config.hf_text_config, "layer_types", None)
        every_layer_slides = layer_types is None or all(
            t == "sliding_attention" for t in layer_types
        )
        vllm_config = VllmConfig(
            model_config=model_config,
            cache_config=CacheConfig(
                sliding_window=model_config.get_sliding_window()
                if every_layer_slides
                else None,
                # Off unless asked: on the CPU a Mamba-2 mixer is served only
                # without it (`fusers/mamba2.py`).
                enable_prefix_caching=prefix_caching,
            ),
            device_config=DeviceConfig("cpu"),
            load_config=LoadConfig(load_format="dummy"),
        )
        with (
            set_current_vllm_config(vllm_config),
            set_default_torch_dtype(torch.float32),
        ):
            return getattr(backend, backend_class)(vllm_config=vllm_config)

    return build


TOLERANCES = {
    # GEMMs of other shapes round differently in float32; float64 shows the rest.
    torch.float32: (1e-5, 1e-4),
    torch.float64: (1e-10, 1e-10),
    # Only elementwise fusions are checked in bfloat16, and they must be exact.
    torch.bfloat16: (0.0, 0.0),
}


@pytest.fixture(scope="session")
def _session_vllm_config(vllm_runtime: None) -> VllmConfig:
    return VllmConfig()


@pytest.fixture
def vllm_config(_session_vllm_config: VllmConfig) -> Iterator[VllmConfig]:
    """The current vLLM config, over the world-size-1 group of `vllm_runtime`: vLLM's
    layers need both to be built and run on the CPU."""
    with set_current_vllm_config(_session_vllm_config):
        yield _session_vllm_config


@pytest.fixture(autouse=True)
def clean_registry() -> Iterator[None]:
    """Each test finds its fusers afresh: the registry caches by class and children,
    and tests reuse classes with other shapes. Every fusion a test's class analyses
    declined must say why and where (`file:line`)."""
    registry.clear_cache()
    yield
    unexplained = [
        declined
        for analysis in registry.analysed()
        for declined in analysis.declined
        if not declined.reason.strip() or not re.fullmatch(r".+:\d+", declined.location)
    ]
    registry.clear_cache()
    assert not unexplained, f"declined without a reason or a location: {unexplained}"


@pytest.fixture
def declined() -> Callable[[type[BaseFuser]], list[str]]:
    """`declined(fuser)`: the reasons the class analyses of this test recorded for
    declining `fuser`."""
    return lambda fuser: [
        d.reason
        for analysis in registry.analysed()
        for d in analysis.declined
        if d.fuser == fuser.__name__
    ]


@pytest.fixture
def fuse(vllm_config: VllmConfig) -> Callable[..., tuple[nn.Module, list[BaseFuser]]]:
    """`fuse(module, dtype, paired=False)`: `module` fused as the backend fuses it, its
    original weights loaded into the fused layers through their weight loaders and
    `stacked_weights`; returns the module to use in its place and the fusers applied.

    A module fused alone has no plan around it, so fusers that a plan-wide
    `cross_check` pairs with other modules' (the rotary embedding and the attention
    consuming its half-width cos and sin) are left out unless `paired`: the test
    then feeds the module what its pair would."""
    return lambda module, dtype=torch.float32, paired=False: _fuse(
        module, vllm_config, dtype, paired=paired
    )


@pytest.fixture
def equivalent(fuse) -> Callable[..., tuple[nn.Module, list[BaseFuser]]]:
    """`equivalent(module, *inputs, dtype=...)`: fuse `module` (with random weights,
    in `dtype`) and check it computes what the original did on `inputs`; returns what
    `fuse` does."""

    def check(module: nn.Module, *inputs, dtype: torch.dtype = torch.float32):
        module = randomize(module, dtype)
        reference = copy.deepcopy(module)
        fused, applied = fuse(module, dtype)
        with torch.no_grad():
            expected, actual = reference(*inputs), fused(*inputs)
        if isinstance(expected, tuple):
            expected, actual = expected[0], actual[0]
        atol, rtol = TOLERANCES[dtype]
        torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)
        return fused, applied

    return check


def _fuse(
    module: nn.Module,
    vllm_config: VllmConfig,
    dtype: torch.dtype,
    attach: Callable[[nn.Module, list[BaseFuser]], None] | None = None,
    paired: bool = False,
) -> tuple[nn.Module, list[BaseFuser]]:
    """`module` fused under `vllm_config`, `attach(fused, applied)` run before the
    weights load (what the backend attaches, such as latent attention, may change
    how they are processed), its original weights loaded (through `stacked_weights`
    and `renamed_weights`); and the fusers applied."""
    weights = {f"m.{k}": v.clone() for k, v in module.state_dict().items()}
    parent = nn.Module()
    parent.m = module
    applied = [
        f
        for f in registry.get_fusers(module)
        if f.validate(module, vllm_config)
        and (paired or type(f).cross_check.__func__ is BaseFuser.cross_check.__func__)
    ]
    stacked, renamed = {}, {}
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        for fuser in applied:
            parent.m = fuser.fuse(parent.m, "m", vllm_config)
            stacked.update(fuser.stacked_weights("m"))
            renamed.update(fuser.renamed_weights("m"))
    finally:
        torch.set_default_dtype(default)
    if attach is not None:
        attach(parent.m, applied)
    mapper = WeightsMapper(orig_to_new_stacked=stacked, orig_to_new_prefix=renamed)
    AutoWeightsLoader(parent).load_weights(mapper.apply(weights.items()))
    for layer in parent.modules():
        if (method := getattr(layer, "quant_method", None)) is not None:
            method.process_weights_after_loading(layer)
    return parent.m, applied


def randomize(
    module: nn.Module, dtype: torch.dtype = torch.float32, seed: int = 0
) -> nn.Module:
    """`module` in `dtype` with every parameter random, so zero- or one-initialised
    weights (norms, biases) are exercised too."""
    module = module.to(dtype)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(
                torch.randn(param.shape, generator=generator, dtype=dtype) * 0.5
            )
    return module.eval()
