# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A query/key/value projection already packed in one linear, split after it."""

import ast
from dataclasses import dataclass
from typing import TYPE_CHECKING, Self

import torch
from torch import fx, nn

from vllm.model_executor.models.transformers import fx_utils, linears, rewriting
from vllm.model_executor.models.transformers.fusers.base import (
    FusionDeclined,
    RewriteFuser,
)
from vllm.model_executor.models.transformers.fusers.heads import (
    HEAD_SIZE_ATTRIBUTES,
    NUM_HEADS_ATTRIBUTES,
    HeadLayout,
    PerInstanceHeads,
    attention_roles,
    attribute_holding,
    heads_at,
    resolve,
)
from vllm.model_executor.models.transformers.fusers.projections import (
    called_once,
    children_between,
    output_projection,
    row_parallel,
    whole_width_reason,
)
from vllm.model_executor.models.transformers.rewriting import ForwardRewrite, Span

if TYPE_CHECKING:
    from vllm.config import VllmConfig

_KEEPS_LAST_DIM = ("unsqueeze", "contiguous")
"""What may stand between the packed linear and its split: neither moves features
across the last dimension."""

Parts = tuple[list[fx.Node], list[fx.Node]]
"""The q, k, v parts of a packed output, and the nodes splitting it (one split or
chunk call, or the three slices)."""


def _last_dim(dim: object, tensor: torch.Tensor) -> bool:
    return isinstance(dim, int) and dim in (-1, tensor.ndim - 1)


def _slice_of_last_dim(node: fx.Node, tensor: torch.Tensor) -> slice | None:
    """`s` for `x[..., s]` or `x[:, :, s]`, with `s` a step-free constant slice."""
    index = node.args[1] if fx_utils.op_name(node) == "getitem" else None
    if not isinstance(index, tuple) or not index or not isinstance(index[-1], slice):
        return None
    leading, last = index[:-1], index[-1]
    if leading not in ((Ellipsis,), (slice(None),) * (tensor.ndim - 1)):
        return None
    bounds = (last.start, last.stop)
    if last.step is not None or not all(
        b is None or isinstance(b, int) for b in bounds
    ):
        return None
    return last


def _split_call_parts(split: fx.Node, tensor: torch.Tensor) -> Parts | str:
    dim = split.kwargs.get("dim", split.args[2] if len(split.args) > 2 else None)
    pieces = fx_utils.value(split)
    if not _last_dim(dim, tensor) or not isinstance(pieces, tuple) or len(pieces) != 3:
        return f"{split.target} is not into three along the last dimension"
    parts = sorted(split.users, key=lambda n: str(n.args[1:]))
    if [(fx_utils.op_name(p), p.args[1]) for p in parts] != [
        ("getitem", i) for i in range(3)
    ]:
        return "the split is not taken apart into its three parts"
    return parts, [split]


def _slice_parts(users: list[fx.Node], tensor: torch.Tensor) -> Parts | str | None:
    """The parts when `users` are three slices of the last dimension, `None` when
    they are not slices."""
    slices = [_slice_of_last_dim(user, tensor) for user in users]
    if len(users) != 3 or None in slices:
        return None
    ordered = sorted(zip(users, slices), key=lambda pair: pair[1].start or 0)
    starts = [s.start or 0 for _, s in ordered]
    stops = [s.stop for _, s in ordered]
    if (
        starts[0] != 0
        or stops[:2] != starts[1:]
        or stops[2] not in (None, tensor.shape[-1])
    ):
        return "the three slices do not cover the packed output once, in order"
    parts = [user for user, _ in ordered]
    return parts, parts


def packed_parts(packed: fx.Node) -> Parts | str:
    """The parts `packed`'s output is split into along its last dimension, or why the
    packing cannot be proven."""
    node = packed
    while (user := fx_utils.single_user(node)) is not None and (
        fx_utils.op_name(user) in _KEEPS_LAST_DIM
    ):
        dims = user.args[1:] or tuple(user.kwargs.values())
        if user.target == "unsqueeze" and _last_dim(dims[0], fx_utils.value(user)):
            break
        node = user
    tensor = fx_utils.value(node)
    if not isinstance(tensor, torch.Tensor):
        return "the shape of the packed output is unknown"
    users = list(node.users)
    if len(users) == 1 and fx_utils.op_name(users[0]) in ("split", "chunk"):
        return _split_call_parts(users[0], tensor)
    if (sliced := _slice_parts(users, tensor)) is not None:
        return sliced
    ops = ", ".join(sorted({str(fx_utils.op_name(u)) for u in users}))
    return (
        f"the packed output goes through {ops} before it is taken apart (for instance "
        "interleaved per head), so which features are q, k and v cannot be proven"
    )


@dataclass
class PackedQKVFuser(PerInstanceHeads, RewriteFuser):
    """`q, k, v = split(qkv(x))` (slices, `.split`, `.chunk` of the last dimension) ->
    the same split of a `QKVParallelLinear`, by its per-rank sizes, loading the packed
    tensor; the output projection becomes a `RowParallelLinear`.

    Only a split into query, key and value in that order, each a block of whole heads,
    is taken; any other packing is declined, never guessed."""

    kind = "packed_qkv"
    coverage = "qkv"

    packed_name: str = ""
    output_name: str = ""
    head_size_attribute: str = ""
    num_heads_attribute: str = ""
    split_spans: tuple[Span, ...] = ()
    """One span for a split/chunk call, or three for slices (q, k, v)."""
    after: tuple[tuple[str, bool], ...] = ()
    """The children between the attention and the output projection, each with
    whether the code hands it one head at a time."""

    @classmethod
    def could_match(cls, module: nn.Module) -> bool:
        return fx_utils.linear_children(module) >= 2

    @classmethod
    def match(cls, graph: fx.Graph | None, module: nn.Module) -> Self | None:
        if graph is None or (roles := attention_roles(graph)) is None:
            return None
        sources = {fx_utils.linear_feeding(role, module) for role in roles}
        if len(sources) != 1 or None in sources:
            return None
        (packed,) = sources
        if reason := called_once(graph, [packed.target]):
            return cls.decline(module, reason)
        found = packed_parts(packed)
        if isinstance(found, str):
            return cls.decline(module, found)
        parts, splits = found
        for role, part, name in zip(roles, parts, ("query", "key", "value")):
            if role is not part and fx_utils.upstream(role, lambda n: n in parts) != {
                part
            }:
                return cls.decline(
                    module,
                    f"the attention's {name} is not the packed output's "
                    f"{name[0]} part (QKVParallelLinear packs q, k, v in this order)",
                )
        query = heads_at(roles[0])
        if query is None:
            return cls.decline(module, "the head size at the attention call is unknown")
        head_size = query.shape[-1]
        sizes = [fx_utils.value(p).shape[-1] for p in parts]
        try:
            layout = HeadLayout.of(*sizes, head_size)
        except FusionDeclined as reason:
            return cls.decline(module, str(reason))
        if layout.v_head_size != head_size:
            return cls.decline(module, "value heads differ in size from query heads")
        head_size_attribute = attribute_holding(module, HEAD_SIZE_ATTRIBUTES, head_size)
        num_heads_attribute = attribute_holding(
            module, NUM_HEADS_ATTRIBUTES, layout.num_heads
        )
        if head_size_attribute is None or num_heads_attribute is None:
            return cls.decline(
                module,
                f"no attributes hold the head size {head_size} and head count "
                f"{layout.num_heads}",
            )
        output = output_projection(graph, module)
        if output is None:
            return cls.decline(module, "no single linear projects the attention output")
        if isinstance(output, str):
            return cls.decline(module, output)
        return cls(
            packed_name=packed.target,
            output_name=output.target,
            head_size_attribute=head_size_attribute,
            num_heads_attribute=num_heads_attribute,
            split_spans=tuple(s.meta.get("span") for s in splits),
            after=children_between(
                fx_utils.attention_node(graph), output, module, head_size
            ),
        )

    def mismatch(self, module: nn.Module, vllm_config: "VllmConfig") -> str | None:
        if vllm_config.parallel_config.tensor_parallel_size > 1 and (
            reason := whole_width_reason(module, self.after, self.output_name)
        ):
            return reason
        return super().mismatch(module, vllm_config)

    def layout(self, module: nn.Module) -> HeadLayout:
        """This instance's heads: its head size and count, the rest of the packed
        width split evenly between keys and values."""
        head_size = resolve(module, self.head_size_attribute)
        q_size = resolve(module, self.num_heads_attribute) * head_size
        packed = getattr(module, self.packed_name)
        kv_size, odd = divmod(linears.out_features(packed) - q_size, 2)
        if odd:
            raise FusionDeclined("the packed width leaves keys and values unequal")
        return HeadLayout.of(q_size, kv_size, kv_size, head_size)

    def update_forward(self, module: nn.Module) -> None:
        # Each rank holds its own q, k and v heads: split by the fused layer's sizes.
        rewrite = ForwardRewrite(type(module))
        splits = [rewrite.expression_at(span) for span in self.split_spans]
        sizes = f"self.{self.packed_name}.output_partition_sizes"
        if len(splits) == 1:
            (call,) = splits
            receiver, dim = _split_call(call, rewrite.function.__globals__)
            rewrite.replace(call, _split(receiver, sizes, dim))
        else:
            for index, subscript in enumerate(splits):
                if not isinstance(subscript, ast.Subscript):
                    raise FusionDeclined("the packed output is not sliced in forward")
                part = _split(subscript.value, sizes, ast.Constant(-1))
                rewrite.replace(
                    subscript, ast.Subscript(part, ast.Constant(index), ast.Load())
                )
        self.fused_forward = rewrite.compile()

    def update_attrs(
        self, module: nn.Module, prefix: str, vllm_config: "VllmConfig"
    ) -> None:
        packed = getattr(module, self.packed_name)
        name = f"{prefix}.{self.packed_name}"
        qkv = self.layout(module).qkv_linear(
            linears.in_features(packed), packed.bias is not None, name, vllm_config
        )
        setattr(module, self.packed_name, linears.load_as_stored(qkv, packed, name))
        row_parallel(module, self.output_name, prefix, vllm_config)

    @property
    def packed_modules_mapping(self) -> dict[str, list[str]]:
        # The checkpoint already holds the packed tensor; QKVParallelLinear's loader
        # splits it into its shards.
        return {self.packed_name: [self.packed_name]}

    def info(self, name: str, module: nn.Module) -> str:
        return (
            f"Fused: packed {self.packed_name} ({name}: {type(module).__name__}) -> "
            f"QKVParallelLinear; {self.output_name} -> RowParallelLinear"
        )


def _split_call(call: ast.AST, namespace: dict) -> tuple[ast.expr, ast.expr]:
    """The tensor and the dim of `x.split(...)`, `x.chunk(...)` or `torch.split(x,
    ...)`; `namespace` tells which name is `torch`."""
    if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Attribute):
        raise FusionDeclined("the split of the packed output is not a call in forward")
    function = call.func.value
    on_torch = isinstance(function, ast.Name) and namespace.get(function.id) is torch
    receiver, rest = (
        (call.args[0], call.args[2:]) if on_torch else (function, call.args[1:])
    )
    dim = next(
        (k.value for k in call.keywords if k.arg == "dim"), rest[0] if rest else None
    )
    if dim is None:
        raise FusionDeclined("the split of the packed output names no dimension")
    return receiver, dim


def _split(tensor: ast.expr, sizes: str, dim: ast.expr) -> ast.Call:
    """`<tensor>.split(<sizes>, dim=<dim>)`."""
    return ast.Call(
        ast.Attribute(tensor, "split", ast.Load()),
        [rewriting.parse_expression(sizes)],
        [ast.keyword("dim", dim)],
    )
