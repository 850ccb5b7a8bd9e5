# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""rewriting: recompiling forwards, stacking calls, what holds one value, names."""

import ast
import inspect

import pytest
import torch
from torch import fx, nn
from transformers.models.llama import modeling_llama
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP

from configs import small_config

from vllm.model_executor.models.transformers import rewriting
from vllm.model_executor.models.transformers.rewriting import (
    ForwardRewrite,
    FusionDeclined,
)
from vllm.model_executor.models.transformers.tracing import trace


def by_target(graph: fx.Graph, target: object) -> fx.Node:
    return next(n for n in graph.nodes if n.target == target)


def test_rewrite_compiles_in_the_original_module_globals():
    rewrite = ForwardRewrite(LlamaMLP)
    (call,) = [
        n
        for n in ast.walk(rewrite.tree)
        if isinstance(n, ast.Call) and rewriting.is_self_attribute(n.func, "up_proj")
    ]
    rewrite.replace(call, rewriting.parse_expression("self.gate_proj(x)"))
    statement = ast.parse("x = x * 2").body[0]
    rewrite.insert_before(rewrite.tree.body[0], statement)
    forward = rewrite.compile()
    assert forward.__globals__ is modeling_llama.__dict__
    assert forward.__code__.co_filename == inspect.getsourcefile(LlamaMLP)
    module = LlamaMLP(small_config("llama", hidden_size=32, intermediate_size=48))
    x = torch.randn(2, 32)
    with torch.no_grad():
        h = module.gate_proj(2 * x)
        torch.testing.assert_close(
            forward(module, x), module.down_proj(module.act_fn(h) * h)
        )


def test_stacked_calls_become_one_call_and_a_split():
    config = small_config("llama", hidden_size=32, intermediate_size=48)
    module = LlamaAttention(config, layer_idx=0)
    graph = trace(module).graph
    spans = {
        name: by_target(graph, name).meta["span"]
        for name in ("q_proj", "k_proj", "v_proj")
    }
    rewrite = ForwardRewrite(LlamaAttention)
    rewrite.stack_calls(spans, "qkv_proj")
    source = ast.unparse(rewrite.tree)
    assert (
        "q_proj_out, k_proj_out, v_proj_out = self.qkv_proj(hidden_states)"
        ".split(self.qkv_proj.output_partition_sizes[:3], dim=-1)"
    ) in source
    assert "query_states = q_proj_out.view(hidden_shape).transpose(1, 2)" in source
    assert "self.q_proj" not in source


class Guarded(nn.Module):
    def forward(self, x):
        y = self.a(x) if self.a is not None else x
        return y if self.b is None else self.b(y) if self.size is not None else y


def test_existence_guards_are_those_of_called_children_and_fold():
    rewrite = ForwardRewrite(Guarded)
    guards = rewrite.existence_guards()
    assert sorted(guards) == ["a", "b"]  # `self.size` is never called
    rewrite.fold_guards(guards["a"], present=True)
    rewrite.fold_guards(guards["b"], present=False)
    source = ast.unparse(rewrite.tree)
    assert "self.a(x) if True else x" in source
    assert "y if True else" in source
    assert "self.size is not None" in source


class Base(nn.Module):
    def forward(self, x):
        return x


class UsesSuper(Base):
    def forward(self, x):
        return super().forward(x)


class Mangled(nn.Module):
    def __init__(self):
        super().__init__()
        self.__scale = 2.0

    def forward(self, x):
        return x * self.__scale


def closure_module() -> type[nn.Module]:
    scale = 2.0

    class Closes(nn.Module):
        def forward(self, x):
            return x * scale

    return Closes


def sourceless_module() -> type[nn.Module]:
    namespace: dict = {"nn": nn}
    exec(
        "class Sourceless(nn.Module):\n    def forward(self, x):\n        return x\n",
        namespace,
    )
    return namespace["Sourceless"]


@pytest.mark.parametrize(
    ("cls", "reason"),
    [
        (UsesSuper, "free variables ['__class__']"),
        (Mangled, "name-mangled private names ['__scale']"),
        (closure_module(), "free variables ['scale']"),
        (sourceless_module(), "has no source"),
    ],
    ids=["super", "name-mangled", "closure", "no-source"],
)
def test_forwards_it_cannot_recompile_safely_are_declined(cls, reason):
    with pytest.raises(FusionDeclined) as declined:
        ForwardRewrite(cls)
    assert reason in str(declined.value)


class Rebinds(nn.Module):
    def forward(self, x, y):
        a = self.f(x)
        x = self.g(x)
        b = self.f(x)
        z = y
        return a + b + z


def test_a_name_rebound_between_uses_does_not_hold_one_value():
    rewrite = ForwardRewrite(Rebinds)
    a, _, b, z, _ = (statement.value for statement in rewrite.tree.body)
    assert not rewrite.holds_one_value("x", [a, b])
    assert rewrite.holds_one_value("x", [a])
    assert rewrite.holds_one_value("y", [a, z])
    assert rewrite.holds_one_value("a", [b, z])
    assert not rewrite.holds_one_value("z", [a])  # bound only later


@pytest.mark.parametrize(
    ("names", "merged"),
    [
        (["q_proj", "k_proj", "v_proj"], "qkv_proj"),
        (["gate_proj", "up_proj"], "gate_up_proj"),
        (["w1", "w3"], "w13"),
        (["query", "key", "value"], "query_key_value"),
    ],
)
def test_merged_names_keep_what_the_originals_share(names, merged):
    assert rewriting.merged_name(names, nn.Module()) == merged
