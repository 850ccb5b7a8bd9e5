# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The registry (`plan.py`): class analysis cached per key, pure and failing closed;
the instance plan re-checking every instance against the class verdict."""

import importlib.util
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch
from torch import nn
from configs import small_config
from transformers import AutoConfig, AutoModel, modeling_utils
from transformers.models.llama.modeling_llama import LlamaMLP

from vllm.model_executor.models.transformers import plan as registry
from vllm.model_executor.models.transformers.fusers import (
    AttentionFuser,
    GLUFuser,
    QKVFuser,
)
from vllm.model_executor.models.transformers.fusers import base as fuser_base
from vllm.model_executor.models.transformers.utils import parameters_on_meta


def mlp(hidden_act: str) -> LlamaMLP:
    config = AutoConfig.for_model(
        "llama", hidden_size=32, intermediate_size=64, hidden_act=hidden_act
    )
    return LlamaMLP(config)


def test_an_instance_unlike_the_analysed_one_declines_with_its_reason(vllm_config):
    # Same class and children, so one class verdict: GLUFuser with SiluAndMul.
    silu, relu = mlp("silu"), mlp("relu")
    parent = nn.Module()
    parent.silu, parent.relu = silu, relu
    analysed = registry.get_fuser(silu, GLUFuser)
    assert analysed is not None and registry.get_fuser(relu, GLUFuser) is analysed
    plan = registry.FusionPlan(parent, vllm_config)
    assert [type(f) for f in plan[silu]] == [GLUFuser]
    assert plan[relu] == ()
    (declined,) = plan.declined
    assert (declined.module, declined.fuser) == ("relu", "GLUFuser")
    assert "activation is one vLLM cannot fuse, not silu" in declined.reason


def test_a_fuser_that_raises_is_declined_not_raised(monkeypatch):
    def broken(cls, graph, module):
        raise RuntimeError("boom")

    monkeypatch.setattr(GLUFuser, "match", classmethod(broken))
    analysis = registry.analyse(mlp("silu"))
    assert not any(isinstance(f, GLUFuser) for f in analysis.fusers)
    (declined,) = [d for d in analysis.declined if d.fuser == "GLUFuser"]
    assert declined.reason == "analysis failed: RuntimeError: boom"
    line = broken.__code__.co_firstlineno + 1
    assert declined.location.endswith(f"{Path(__file__).name}:{line}")


def test_declines_live_in_the_cache_entry_not_in_module_state():
    assert not hasattr(fuser_base, "DECLINED")
    module = mlp("silu")
    assert registry.analyse(module) is registry.analyse(mlp("silu"))
    registry.clear_cache()
    assert registry.analyse(module) is not None


def _state(fuser) -> dict[str, str]:
    return {name: repr(value) for name, value in vars(fuser).items()}


@pytest.mark.parametrize(
    ("model_type", "overrides"),
    [
        # A partial rotary: the function is proven on the rotary channels per plan.
        ("phi", dict(partial_rotary_factor=0.25)),
        # A router, proven on a probe of each instance.
        ("qwen3_moe", dict(num_experts=4, num_experts_per_tok=2)),
    ],
)
def test_planning_writes_nothing_into_the_cached_class_analyses(
    model_type, overrides, vllm_config
):
    # The cache holds what the class analysis decided; every instance's verdict is
    # the plan's, so planning a model (twice) leaves every cached fuser as it was.
    config = small_config(model_type, num_hidden_layers=2, **overrides)
    config._attn_implementation = "vllm"
    with parameters_on_meta():
        model = AutoModel.from_config(config)
    cached = [f for m in model.modules() for f in registry.get_fusers(m)]
    before = [_state(f) for f in cached]
    # An instance unlike the analysed one (a router the probe must run on again).
    second = model.layers[1]
    for module in (second.self_attn, getattr(second.mlp, "gate", None)):
        if module is not None:
            module.note = "the second"
    for _ in range(2):
        registry.FusionPlan(model, vllm_config)
    assert [_state(f) for f in cached] == before


def test_concurrent_analyses_of_one_key_agree():
    modules = [mlp("silu") for _ in range(8)]
    results = []
    threads = [
        threading.Thread(target=lambda m=m: results.append(registry.analyse(m)))
        for m in modules
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 8
    assert len({tuple(type(f) for f in r.fusers) for r in results}) == 1
    assert len({id(r) for r in [registry.analyse(m) for m in modules]}) == 1


FUTURE_ANNOTATIONS = """
    from __future__ import annotations

    from typing import TYPE_CHECKING

    import torch.nn.functional as F
    from torch import nn

    if TYPE_CHECKING:
        from a_package_that_is_not_installed import Tensor


    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.head_dim = 8
            self.q_proj, self.k_proj, self.v_proj, self.o_proj = (
                nn.Linear(32, 32) for _ in range(4)
            )

        def forward(self, hidden_states: Tensor) -> Tensor:
            shape = (*hidden_states.shape[:-1], -1, self.head_dim)
            q = self.q_proj(hidden_states).view(shape).transpose(1, 2)
            k = self.k_proj(hidden_states).view(shape).transpose(1, 2)
            v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.o_proj(out.transpose(1, 2).flatten(2))
"""


def test_forward_annotated_with_names_only_type_checkers_import(tmp_path, equivalent):
    # Common in remote code: annotations are strings under `from __future__ import
    # annotations`, naming what is imported only under TYPE_CHECKING.
    path = tmp_path / "remote_attention.py"
    path.write_text(textwrap.dedent(FUTURE_ANNOTATIONS))
    spec = importlib.util.spec_from_file_location("remote_attention", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["remote_attention"] = module
    try:
        spec.loader.exec_module(module)
        inputs = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(0))
        fused, applied = equivalent(module.Attention(), inputs)
        assert [type(f) for f in applied] == [QKVFuser]
    finally:
        del sys.modules["remote_attention"]


LOCAL_IMPORT = """
    from torch import nn
    from transformers.models.llama.modeling_llama import eager_attention_forward


    class Attention(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.config, self.layer_idx, self.is_causal = config, 0, True
            self.head_dim = config.hidden_size // config.num_attention_heads
            self.num_key_value_groups = (
                config.num_attention_heads // config.num_key_value_heads
            )
            self.scaling = self.head_dim**-0.5
            kv_width = config.num_key_value_heads * self.head_dim
            self.q_proj = nn.Linear(config.hidden_size, config.hidden_size)
            self.k_proj = nn.Linear(config.hidden_size, kv_width)
            self.v_proj = nn.Linear(config.hidden_size, kv_width)
            self.o_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)

        def forward(self, hidden_states, attention_mask=None, **kwargs):
            {import_line}

            shape = (*hidden_states.shape[:-1], -1, self.head_dim)
            query = self.q_proj(hidden_states).view(shape).transpose(1, 2)
            key = self.k_proj(hidden_states).view(shape).transpose(1, 2)
            value = self.v_proj(hidden_states).view(shape).transpose(1, 2)
            attention_interface = {interface}
            output, _ = attention_interface(
                self, query, key, value, attention_mask, scaling=self.scaling, **kwargs
            )
            return self.o_proj(output.reshape(*hidden_states.shape[:-1], -1))
"""


@pytest.mark.parametrize(
    ("import_line", "interface"),
    [
        (
            "from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS",
            "ALL_ATTENTION_FUNCTIONS.get_interface("
            "self.config._attn_implementation, eager_attention_forward)",
        ),
        (
            "from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS as af",
            "af[self.config._attn_implementation]",
        ),
        (
            "from transformers import modeling_utils",
            "modeling_utils.ALL_ATTENTION_FUNCTIONS[self.config._attn_implementation]",
        ),
    ],
    ids=["get_interface", "aliased", "module-attribute"],
)
def test_forward_importing_the_attention_registry_in_its_body(
    import_line, interface, tmp_path, equivalent
):
    # Common in remote code. The forward reads the registry from its home module
    # when it runs, so tracing must make it opaque there, not only in its globals.
    registry_before = modeling_utils.ALL_ATTENTION_FUNCTIONS
    source = LOCAL_IMPORT.replace("{import_line}", import_line)
    path = tmp_path / "remote_local_import.py"
    path.write_text(textwrap.dedent(source.replace("{interface}", interface)))
    spec = importlib.util.spec_from_file_location("remote_local_import", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["remote_local_import"] = module
    config = AutoConfig.for_model(
        "llama", hidden_size=32, num_attention_heads=4, num_key_value_heads=2
    )
    try:
        spec.loader.exec_module(module)
        config._attn_implementation = "vllm"
        qkv, attention = registry.get_fusers(module.Attention(config))
        assert modeling_utils.ALL_ATTENTION_FUNCTIONS is registry_before
        assert type(qkv) is QKVFuser and type(attention) is AttentionFuser
        roles = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj"}
        assert attention.sources == roles
        assert attention.traced["num_kv_heads"] == 2
        # The same class on Transformers' own attention: fused, computing the same.
        config._attn_implementation = "sdpa"
        inputs = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(0))
        _, applied = equivalent(module.Attention(config), inputs)
        assert [type(f) for f in applied] == [QKVFuser]
    finally:
        del sys.modules["remote_local_import"]
