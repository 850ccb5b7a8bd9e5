# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""fx_utils: graph queries along the dataflow of a traced forward."""

from torch import fx
from transformers.models.llama.modeling_llama import LlamaAttention

from configs import small_config

from vllm.model_executor.models.transformers import fx_utils
from vllm.model_executor.models.transformers.tracing import trace


def by_target(graph: fx.Graph, target: object) -> fx.Node:
    return next(n for n in graph.nodes if n.target == target)


def test_graph_queries_follow_the_dataflow():
    config = small_config("llama", hidden_size=32, intermediate_size=48)
    module = LlamaAttention(config, layer_idx=0)
    graph = trace(module).graph
    attention = fx_utils.attention_node(graph)
    query, key, value = attention.args[:3]
    assert fx_utils.linear_feeding(query, module).target == "q_proj"
    assert fx_utils.linear_feeding(value, module).target == "v_proj"
    assert fx_utils.linear_fed_by(attention, module).target == "o_proj"
    assert fx_utils.returned_linear(graph, module).target == "o_proj"
    assert fx_utils.is_linear_on_input(by_target(graph, "q_proj"), module)
    assert not fx_utils.is_linear_on_input(by_target(graph, "o_proj"), module)
