# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Reading an attention module's heads: from the dataflow at the attention call on
the traced instance, and from the attributes that hold the same values on every
other instance; the layout they make, and the checks every fuser that builds a
`QKVParallelLinear` makes of each instance's heads."""

import ast
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import fx, nn
from vllm.model_executor.layers.linear import QKVParallelLinear

from vllm.model_executor.models.transformers import fx_utils, rewriting
from vllm.model_executor.models.transformers.rewriting import FusionDeclined

if TYPE_CHECKING:
    from vllm.config import VllmConfig

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


@dataclass(frozen=True)
class HeadLayout:
    """Heads of one attention instance, as `QKVParallelLinear` takes them."""

    head_size: int
    num_heads: int
    num_kv_heads: int
    v_head_size: int

    @classmethod
    def of(cls, q_size: int, k_size: int, v_size: int, head_size: int) -> "HeadLayout":
        """The layout of projections of these widths; `FusionDeclined` saying why
        when they are not whole heads."""
        if head_size <= 0 or q_size % head_size or k_size % head_size:
            raise FusionDeclined(
                f"query width {q_size} and key width {k_size} are not whole heads "
                f"of {head_size}"
            )
        num_heads, num_kv_heads = q_size // head_size, k_size // head_size
        if num_heads % num_kv_heads or v_size % num_kv_heads:
            raise FusionDeclined(
                f"{num_heads} query heads, {num_kv_heads} key heads and value width "
                f"{v_size} do not group into key/value heads"
            )
        return cls(head_size, num_heads, num_kv_heads, v_size // num_kv_heads)

    def check_divides(self, tp_size: int) -> None:
        """`FusionDeclined` unless `tp_size` ranks can share these heads."""
        kv, heads = self.num_kv_heads, self.num_heads
        if heads % tp_size or (kv % tp_size if kv >= tp_size else tp_size % kv):
            raise FusionDeclined(
                f"{heads} query / {kv} key-value heads do not split over "
                f"{tp_size} ranks"
            )

    def qkv_linear(
        self, hidden_size: int, bias: bool, prefix: str, vllm_config: "VllmConfig"
    ) -> QKVParallelLinear:
        return QKVParallelLinear(
            hidden_size=hidden_size,
            head_size=self.head_size,
            total_num_heads=self.num_heads,
            total_num_kv_heads=self.num_kv_heads,
            bias=bias,
            quant_config=vllm_config.quant_config,
            prefix=prefix,
            return_bias=False,
            v_head_size=self.v_head_size,
        )


_RESHAPES = frozenset({"view", "reshape", "unflatten", "expand"})


@functools.cache
def reshaped_with(cls: type[nn.Module]) -> tuple[str, ...]:
    """The attributes (`num_heads`, `config.hidden_size`) `cls`'s forward reshapes
    with: read in the arguments of a `view`, `reshape`, `unflatten` or `expand`, or
    in a local they are handed (`shape = (b, t, self.num_heads, -1)`)."""
    source = rewriting.forward_source(cls)
    if source is None:
        return ()
    values: dict[str, list[ast.expr]] = {}
    for node in ast.walk(source.tree):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    values.setdefault(target.id, []).append(node.value)
    found: dict[str, None] = {}
    calls = sorted(
        (n for n in ast.walk(source.tree) if isinstance(n, ast.Call)),
        key=lambda n: (n.lineno, n.col_offset),
    )
    for call in calls:
        if not (isinstance(call.func, ast.Attribute) and call.func.attr in _RESHAPES):
            continue
        pending = [*call.args, *(k.value for k in call.keywords)]
        seen: set[str] = set()
        while pending:
            expression = pending.pop()
            for node in ast.walk(expression):
                if (path := rewriting.self_attribute_path(node)) is not None:
                    found[path] = None
                elif isinstance(node, ast.Name) and node.id not in seen:
                    seen.add(node.id)
                    pending.extend(values.get(node.id, []))
    return tuple(found)


class PerInstanceHeads:
    """What the fusers building a `QKVParallelLinear` share: each instance reads its
    own heads, and takes the fusion only if they split over the TP ranks and its
    forward reshapes with no count or width of all its heads (Baichuan's and
    StableLM's `.view(batch, tokens, self.num_heads, head_dim)`)."""

    def layout(self, module: nn.Module) -> HeadLayout:
        raise NotImplementedError

    def mismatch(self, module: nn.Module, vllm_config: "VllmConfig") -> str | None:
        tp_size = vllm_config.parallel_config.tensor_parallel_size
        try:
            layout = self.layout(module)
            layout.check_divides(tp_size)
        except FusionDeclined as reason:
            return str(reason)
        if tp_size == 1:
            return None
        q_size = layout.num_heads * layout.head_size
        kv_size = layout.num_kv_heads * layout.head_size
        whole = {
            layout.num_heads,
            layout.num_kv_heads,
            q_size,
            kv_size,
            layout.num_kv_heads * layout.v_head_size,
            q_size + 2 * kv_size,
        }
        for path in reshaped_with(type(module)):
            value = resolve(module, path)
            if path in HEAD_SIZE_ATTRIBUTES or type(value) is not int:
                continue
            if value in whole:
                return (
                    f"its forward reshapes with self.{path} ({value}), a count or "
                    f"width of all its heads, where each of {tp_size} tensor-parallel "
                    "ranks would hold only its share of them"
                )
        return None
