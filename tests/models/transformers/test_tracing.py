# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""tracing: partial tracing, the opaque attention call, source spans of the running
forward."""

import ast
import inspect
import operator
import types

import torch
import torch.nn.functional as F
from torch import fx, nn
from transformers.activations import ACT2FN
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama import modeling_llama
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP
from transformers.pytorch_utils import Conv1D
from transformers.utils.generic import can_return_tuple, merge_with_config_defaults

from configs import small_config

from vllm.model_executor.models.transformers import fx_utils
from vllm.model_executor.models.transformers.rewriting import ForwardRewrite
from vllm.model_executor.models.transformers.tracing import (
    attention_call,
    executing_span,
    trace,
)


def by_target(graph: fx.Graph, target: object) -> fx.Node:
    return next(n for n in graph.nodes if n.target == target)


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        y = self.first(x)
        if y.sum() > 0:  # data-dependent: tracing stops here
            y = -y
        return self.second(y)


class Inline(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        return ACT2FN["silu"](self.proj(x))


def test_children_are_leaves_and_shapes_are_concrete():
    traced = trace(LlamaMLP(small_config("llama", hidden_size=32, intermediate_size=48)))
    assert traced.complete
    modules = [n.target for n in traced.graph.nodes if n.op == "call_module"]
    assert modules == ["gate_proj", "act_fn", "up_proj", "down_proj"]
    assert fx_utils.value(by_target(traced.graph, "gate_proj")).shape[-1] == 48


def test_a_forward_it_cannot_finish_gives_what_was_reached():
    traced = trace(Branchy())
    assert not traced.complete and "control flow" in traced.stopped
    assert [n.target for n in traced.graph.nodes if n.op == "call_module"] == ["first"]
    assert fx_utils.returned(traced.graph) is None


class OptionalBranch(nn.Module):
    """GPT-2's attention: a branch for an optional input the module cannot serve."""

    def __init__(self):
        super().__init__()
        self.proj = Conv1D(12, 8)

    def forward(self, x, encoder_states: torch.Tensor | None = None):
        if encoder_states is not None:
            raise ValueError("built without cross-attention")
        return self.proj(x)


def test_a_trace_stopped_by_an_optional_input_is_retried_without_it():
    traced = trace(OptionalBranch())
    assert traced.complete
    # A Conv1D is a linear whose output width is its `nf`.
    assert fx_utils.value(fx_utils.returned(traced.graph)).shape[-1] == 12
    assert fx_utils.is_linear(fx_utils.returned(traced.graph), OptionalBranch())


class ConfigDefaults(nn.Module):
    """A forward under Transformers' `merge_with_config_defaults` over another
    wrapper (LLaVA-NeXT's): an input the caller does not name is filled from the
    config, by name."""

    def __init__(self):
        super().__init__()
        self.config = types.SimpleNamespace(vision_feature_layer=-2, return_dict=True)
        self.proj = nn.Linear(8, 8)

    @merge_with_config_defaults
    @can_return_tuple
    def forward(self, x, vision_feature_layer: int | None = None, scale: float = 2.0):
        return self.proj(x) * scale


def test_inputs_after_the_first_are_passed_by_name():
    """Passed positionally, `vision_feature_layer` reached the forward twice (the
    decorator adds it by name, not seeing it through the wrapper under it)."""
    traced = trace(ConfigDefaults())
    assert traced.complete, traced.stopped
    (scaled,) = [n for n in traced.graph.nodes if n.target is operator.mul]
    assert scaled.args[1] == 2.0  # a non-`None` default still reaches the forward


def test_the_attention_interface_call_is_one_opaque_node():
    config = small_config("llama", hidden_size=32, intermediate_size=48)
    config._attn_implementation = "eager"
    graph = trace(LlamaAttention(config, layer_idx=0)).graph
    calls = [n for n in graph.nodes if n.target is attention_call]
    assert len(calls) == 1
    # Nothing of eager attention's own computation is in the graph.
    assert not any(fx_utils.op_name(n) in ("matmul", "softmax") for n in graph.nodes)
    assert fx_utils.attention_node(graph) is calls[0]
    assert modeling_llama.ALL_ATTENTION_FUNCTIONS is ALL_ATTENTION_FUNCTIONS


class StoresIntoInput(nn.Module):
    """Writes into a dict it is passed (Gemma 4's `shared_kv_states`)."""

    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x, store):
        y = self.first(x)
        store["y"] = y
        return self.second(y)


def test_a_write_into_an_input_is_recorded_and_tracing_goes_on():
    traced = trace(StoresIntoInput())
    assert traced.complete, traced.stopped
    (store,) = [n for n in traced.graph.nodes if n.target is operator.setitem]
    assert store.args[1:] == ("y", by_target(traced.graph, "first"))
    assert fx_utils.returned(traced.graph).target == "second"


def test_modules_built_inside_forward_are_traced_through():
    graph = trace(Inline()).graph
    assert any(n.target is F.silu for n in graph.nodes)


def test_node_spans_locate_their_forward_expression():
    module = LlamaMLP(small_config("llama", hidden_size=32, intermediate_size=48))
    graph = trace(module).graph
    rewrite = ForwardRewrite(type(module))
    gate = rewrite.expression_at(by_target(graph, "gate_proj").meta["span"])
    assert ast.unparse(gate) == "self.gate_proj(x)"
    (product,) = by_target(graph, "up_proj").users
    assert (
        ast.unparse(rewrite.expression_at(product.meta["span"]))
        == "self.act_fn(self.gate_proj(x)) * self.up_proj(x)"
    )


def recurse(depth: int, code: types.CodeType) -> list:
    if depth == 0:
        return [executing_span(code)]
    return [executing_span(code), *recurse(depth - 1, code)]


def test_executing_span_is_the_expression_the_innermost_frame_evaluates():
    tree = ast.parse(inspect.getsource(recurse))
    offset = recurse.__code__.co_firstlineno - 1
    in_base_case, in_recursion = sorted(
        (n.lineno + offset, n.col_offset, n.end_lineno + offset, n.end_col_offset)
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "executing_span"
    )
    # Each frame of `recurse` reports its own position, not the outermost one's.
    assert recurse(1, recurse.__code__) == [in_recursion, in_base_case]


def test_executing_span_is_none_when_no_frame_of_the_code_runs():
    assert executing_span(recurse.__code__) is None
