# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Separate query, key and value projections, stacked into one `QKVParallelLinear`."""

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Self

from torch import fx, nn

from vllm.model_executor.models.transformers import fx_utils, linears, rewriting
from vllm.model_executor.models.transformers.fusers.base import (
    FusionDeclined,
    StackedFuser,
)
from vllm.model_executor.models.transformers.fusers.heads import (
    HEAD_SIZE_ATTRIBUTES,
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
    whole_width,
    whole_width_reason,
)
from vllm.model_executor.models.transformers.rewriting import ForwardRewrite, Span

if TYPE_CHECKING:
    from vllm.config import VllmConfig

@dataclass
class QKVFuser(PerInstanceHeads, StackedFuser):
    """`q_proj(x), k_proj(x), v_proj(x)` -> `qkv_proj(x).split(sizes)` with `qkv_proj`
    a `QKVParallelLinear`; the output projection becomes a `RowParallelLinear`.

    Roles come from dataflow: the linear each of the attention call's query, key and
    value is computed from, whatever the names or the call order, norms or rotary
    embeddings in between. The head size is the query's last dimension at the call.

    A value computed from the key's projection (Gemma 4's `attention_k_eq_v` layers,
    which hold `v_proj = None`) stacks the query and key only: the value keeps
    coming from the key's part, as in Transformers. Guards on a projection's
    existence (`self.v_proj is not None`) fold to what the analysed instance had,
    and every instance must have the same."""

    kind = "qkv"
    coverage = "qkv"

    output_name: str = ""
    head_size_attribute: str = ""
    call_spans: dict[str, Span] = field(default_factory=dict)
    after: tuple[tuple[str, bool], ...] = ()
    """The same for the children between the attention and the output projection."""
    between: tuple[tuple[str, bool], ...] = ()
    """Children called between a projection and the attention, each with whether
    the code hands it one head at a time: which of them hold weights over more
    than one head (`whole_width_norms`) is each instance's own."""
    absent: tuple[str, ...] = ()
    """Callables the forward guards with `self.<name> is None` that were `None` on
    the analysed instance: the guards are folded, so every instance must lack them."""

    @classmethod
    def could_match(cls, module: nn.Module) -> bool:
        return fx_utils.linear_children(module) >= 3

    @classmethod
    def match(cls, graph: fx.Graph | None, module: nn.Module) -> Self | None:
        if graph is None:
            return None
        roles = attention_roles(graph)
        if roles is None:
            shared = [n for n in graph.nodes if fx_utils.is_linear(n, module)]
            inputs = [n.args[0] for n in shared]
            if any(inputs.count(i) >= 3 for i in inputs):
                return cls.decline(
                    module,
                    "three linears read one input but tracing did not reach a single "
                    "attention call, so query, key and value cannot be told apart",
                )
            return None
        sources = [fx_utils.linear_feeding(role, module) for role in roles]
        if all(linear is None for linear in sources) or len(set(sources)) == 1:
            return None  # nothing to stack, or one packed projection
        q, k, v = sources
        if None in sources or not (
            len(set(sources)) == 3 or (v is k and q is not k)
        ):
            return cls.decline(
                module,
                "query, key and value do not each come from their own linear (nor "
                "the value from the key's)",
            )
        names = list(dict.fromkeys(n.target for n in sources))
        if reason := called_once(graph, names):
            return cls.decline(module, reason)
        if not q.args[0] is k.args[0] is v.args[0]:
            return cls.decline(module, f"{', '.join(names)} read different inputs")
        projections = [module.get_submodule(n.target) for n in sources]
        if len({(m.bias is None) for m in projections}) != 1:
            return cls.decline(module, "some of the projections have a bias, some not")
        query, key, value = (heads_at(role) for role in roles)
        if query is None or key is None or value is None:
            return cls.decline(module, "the head size at the attention call is unknown")
        head_size = query.shape[-1]
        widths = [linears.out_features(m) for m in projections]
        try:
            HeadLayout.of(*widths, head_size)
        except FusionDeclined as reason:
            return cls.decline(module, str(reason))
        for role, at_call, width in zip("qkv", (query, key, value), widths):
            if at_call.shape[1] * at_call.shape[-1] != width:
                return cls.decline(
                    module,
                    f"{role} is {width} wide but the attention gets "
                    f"{at_call.shape[1]} heads of {at_call.shape[-1]}",
                )
        if key.shape[-1] != head_size:
            return cls.decline(
                module, f"key heads of {key.shape[-1]}, query heads of {head_size}"
            )
        head_size_attribute = attribute_holding(module, HEAD_SIZE_ATTRIBUTES, head_size)
        if head_size_attribute is None:
            return cls.decline(module, f"no attribute holds the head size {head_size}")
        output = output_projection(graph, module)
        # BERT-style: the output projection is a sibling's (`BertSelfOutput.dense`);
        # the fusion stands alone, whole on one rank (see `mismatch`).
        if isinstance(output, str):
            return cls.decline(module, output)
        between = tuple(
            child
            for linear, role in zip((q, k, v), roles)
            for child in children_between(linear, role, module, head_size)
        )
        after = (
            ()
            if output is None
            else children_between(
                fx_utils.attention_node(graph), output, module, head_size
            )
        )
        return cls(
            fused_name=rewriting.merged_name(names, module),
            shards=dict(zip(names, "qkv")),
            output_name="" if output is None else output.target,
            head_size_attribute=head_size_attribute,
            call_spans={n.target: n.meta.get("span") for n in (q, k, v)},
            between=between,
            after=after,
        )

    def layout(self, module: nn.Module) -> HeadLayout:
        """This instance's heads: its head size attribute over its projections (no
        value width where the value is the key)."""
        widths = {
            s: linears.out_features(getattr(module, n)) for n, s in self.shards.items()
        }
        return HeadLayout.of(
            widths["q"],
            widths["k"],
            widths.get("v", 0),
            resolve(module, self.head_size_attribute),
        )

    def whole_width_norms(self, module: nn.Module) -> tuple[str, ...]:
        """This instance's children between a projection and the attention that
        see more than one head at a time."""
        return whole_width(module, self.between)

    def mismatch(self, module: nn.Module, vllm_config: "VllmConfig") -> str | None:
        sharded = vllm_config.parallel_config.tensor_parallel_size > 1
        if sharded and (norms := self.whole_width_norms(module)):
            return (
                f"{', '.join(norms)} normalise all heads together, "
                "which one rank's share of the heads cannot do"
            )
        if sharded and (
            reason := whole_width_reason(module, self.after, self.output_name)
        ):
            return reason
        if not self.output_name and sharded:
            return (
                "the attention output leaves the module without an output "
                "projection, so whatever reads it would get one rank's share of "
                "the heads"
            )
        if present := [n for n in self.absent if getattr(module, n, None) is not None]:
            return (
                f"{', '.join(present)} exist in this instance, not in the analysed "
                "one, and the guards on them were folded"
            )
        projections = [getattr(module, name, None) for name in self.shards]
        if not all(linears.is_linear(p) for p in projections):
            return f"{', '.join(self.shards)} are not all linears in this instance"
        if len({linears.stores_transposed(p) for p in projections}) != 1:
            return f"only some of {', '.join(self.shards)} store their weight transposed"
        if len({p.bias is None for p in projections}) != 1:
            return "some of the projections have a bias in this instance, some not"
        if len({linears.in_features(p) for p in projections}) != 1:
            return "the projections read inputs of different widths"
        return super().mismatch(module, vllm_config)

    def update_forward(self, module: nn.Module) -> None:
        rewrite = ForwardRewrite(type(module))
        absent = []
        for name, guards in rewrite.existence_guards().items():
            if name in self.shards:  # stacked away: the guard must not look for it
                rewrite.fold_guards(guards, present=True)
            elif getattr(module, name, None) is None:
                rewrite.fold_guards(guards, present=False)
                absent.append(name)
        rewrite.stack_calls(self.call_spans, self.fused_name)
        self.fused_forward = rewrite.compile()
        self.absent = tuple(absent)

    def update_attrs(
        self, module: nn.Module, prefix: str, vllm_config: "VllmConfig"
    ) -> None:
        q = getattr(module, next(iter(self.shards)))
        name = f"{prefix}.{self.fused_name}"
        qkv = self.layout(module).qkv_linear(
            linears.in_features(q), q.bias is not None, name, vllm_config
        )
        for shard in self.shards:
            delattr(module, shard)
        setattr(module, self.fused_name, linears.load_as_stored(qkv, q, name))
        if self.output_name:
            row_parallel(module, self.output_name, prefix, vllm_config)

    def info(self, name: str, module: nn.Module) -> str:
        value = "" if "v" in self.shards.values() else " (the key is the value)"
        fused = f"{super().info(name, module)}{value}"
        if not self.output_name:
            return fused
        return f"{fused}; {self.output_name} -> RowParallelLinear"
