# SPDX-License-Identifier: Apache-2.0
"""`VLLM_USE_HW_AGNOSTIC=1`: the backend builds the vLLM layers vLLM's
hardware-agnostic package has (RMSNorm, SiLU-and-mul) from it, the others from
`vllm.model_executor.layers`, and says which; the output does not change."""

import logging

import pytest
import tiny
import torch
from configs import small_config
from conftest import randomize

from vllm.model_executor.models.transformers import layer_classes
from vllm.model_executor.models.transformers.layer_classes import (
    DEFAULT,
    HW_AGNOSTIC,
)

FLAG = "VLLM_USE_HW_AGNOSTIC"


def _build(build_backend, monkeypatch, hw_agnostic: bool):
    if hw_agnostic:
        monkeypatch.setenv(FLAG, "1")
    else:
        monkeypatch.delenv(FLAG, raising=False)
    return randomize(build_backend(small_config("llama")))


def test_the_switch_changes_the_classes_built_and_not_the_output(
    build_backend, monkeypatch, caplog
):
    default = _build(build_backend, monkeypatch, hw_agnostic=False)
    with caplog.at_level(logging.INFO, logger=layer_classes.__name__):
        switched = _build(build_backend, monkeypatch, hw_agnostic=True)
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, 5, 128, generator=generator)
    gate_up = torch.randn(1, 5, 2 * 256, generator=generator)
    for layer, reference in zip(switched.model.layers, default.model.layers):
        for name in ("input_layernorm", "post_attention_layernorm", "mlp.act_fn"):
            assert type(layer.get_submodule(name)).__module__.startswith(HW_AGNOSTIC)
            assert type(reference.get_submodule(name)).__module__.startswith(DEFAULT)
        # Linears: the hardware-agnostic package has none in vLLM 0.32.
        assert type(layer.mlp.gate_up_proj) is type(reference.mlp.gate_up_proj)
        with torch.no_grad():
            for name, x in (("input_layernorm", hidden), ("mlp.act_fn", gate_up)):
                torch.testing.assert_close(
                    layer.get_submodule(name)(x), reference.get_submodule(name)(x)
                )
    logged = caplog.text
    assert f"vLLM layer RMSNorm: {HW_AGNOSTIC}.layernorm" in logged
    assert f"vLLM activation-and-mul 'silu': {HW_AGNOSTIC}.activation" in logged


@pytest.mark.engine
def test_the_switch_serves_as_transformers_on_the_engine():
    run = tiny.run_engine(
        tiny.checkpoint("llama"), **tiny.IMPLS[tiny.e2e_impl()], extra_env={FLAG: "1"}
    )
    gap = tiny.compare(
        tiny.cached_reference("llama"), run.completions, tiny.logprob_atol("llama")
    )
    tiny.report(f"llama ({tiny.e2e_impl()}, {FLAG}=1) vs Transformers", run, gap)
    assert "hw_agnostic" in run.log
