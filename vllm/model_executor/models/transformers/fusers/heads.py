# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Reading an attention module's heads: from the dataflow at the attention call on
the traced instance, and from the attributes that hold the same values on every
other instance."""

import torch
from torch import fx, nn

from vllm.model_executor.models.transformers import fx_utils

# Where attention modules keep their head sizes and counts. The dataflow gives them
# for the traced instance; the attribute holding the same value is what every other
# instance of the class is read from.
HEAD_SIZE_ATTRIBUTES = (
    "head_dim",
    "head_size",
    "attention_head_size",
    "qk_head_dim",
    "config.head_dim",
)
NUM_HEADS_ATTRIBUTES = (
    "num_heads",
    "num_attention_heads",
    "config.num_attention_heads",
)
NUM_KV_HEADS_ATTRIBUTES = (
    "num_key_value_heads",
    "num_kv_heads",
    "kv_heads",
    "config.num_key_value_heads",
)
V_HEAD_SIZE_ATTRIBUTES = ("v_head_dim", *HEAD_SIZE_ATTRIBUTES)


def resolve(module: nn.Module, path: str) -> object:
    """`module.<path>` for a dotted `path`, `None` where an attribute is missing or
    holds no single value: a per-layer attribute read off a heterogeneous config
    (Gemma 4's `config.num_key_value_heads`), which Transformers refuses with a
    `RuntimeError` subclass."""
    for name in path.split("."):
        try:
            module = getattr(module, name, None)
        except RuntimeError:
            return None
    return module


def attribute_holding(
    module: nn.Module, paths: tuple[str, ...], value: int
) -> str | None:
    """The first of `paths` at which `module` holds the integer `value`."""
    return next(
        (p for p in paths if type(held := resolve(module, p)) is int and held == value),
        None,
    )


def heads_at(node: fx.Node) -> torch.Tensor | None:
    """The `(batch, heads, tokens, head size)` value reaching the attention call as
    `node`, read where it was last known: shapes through a partial rotary embedding
    are not, the projection viewed into heads just before it is."""
    if isinstance(found := fx_utils.value(node), torch.Tensor):
        return found
    known = fx_utils.upstream(
        node, lambda n: isinstance(v := fx_utils.value(n), torch.Tensor) and v.ndim == 4
    )
    shapes = {fx_utils.value(n).shape for n in known}
    return fx_utils.value(known.pop()) if len(shapes) == 1 else None


def attention_roles(graph: fx.Graph) -> tuple[fx.Node, fx.Node, fx.Node] | None:
    """The query, key and value the attention call takes, if tracing reached it."""
    attention = fx_utils.attention_node(graph)
    return None if attention is None else tuple(attention.args[:3])
