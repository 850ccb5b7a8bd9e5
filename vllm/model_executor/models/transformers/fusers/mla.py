# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""DeepSeek-style latent attention (MLA), handed to vLLM's `MLAAttention` compressed."""

import ast
import dataclasses
import functools
import inspect
import textwrap
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Self

from torch import fx, nn
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
)

from vllm.model_executor.models.transformers import fx_utils, rewriting, tracing
from vllm.model_executor.models.transformers.fusers.base import (
    AttentionNeeds,
    Declined,
    FusionDeclined,
    StackedFuser,
)
from vllm.model_executor.models.transformers.fusers.projections import (
    called_once,
    row_parallel,
)
from vllm.model_executor.models.transformers.fusers.rms_norm import RMSNormFuser
from vllm.model_executor.models.transformers.rewriting import ForwardRewrite, Span
from vllm.model_executor.models.transformers.utils import replace_linear_class

if TYPE_CHECKING:
    from vllm.config import VllmConfig

_SLICING = frozenset(
    {
        "getitem",
        "split",
        "split_with_sizes",
        "chunk",
        "tensor_split",
        "narrow",
        "contiguous",
        "to",
        "float",
        "type_as",
    }
)
"""Ops that may stand between a down-projection and its norm: they take features of
the last dimension apart (or cast them), never regroup them into heads."""


def _is_rms_norm(child: nn.Module) -> bool:
    """Whether `child` computes an RMSNorm, as `RMSNormFuser` recognises one."""
    if not RMSNormFuser.could_match(child):
        return False
    return isinstance(RMSNormFuser.match(tracing.trace(child).graph, child), RMSNormFuser)


def _sliced_from(node: object) -> object:
    """What `node` is a slice (or cast) of, looking back through `_SLICING` ops."""
    while fx_utils.op_name(node) in _SLICING and node.args:
        node = node.args[0]
    return node


def _width(node: fx.Node) -> int | None:
    found = fx_utils.value(node)
    return found.shape[-1] if hasattr(found, "shape") and found.ndim else None


@dataclass(frozen=True)
class _Chain:
    """`norm(linear(input)[..., part])`: a down-projection and the norm of its output."""

    linear: fx.Node
    norm: fx.Node

    def widths(self, module: nn.Module) -> tuple[int, int]:
        return module.get_submodule(self.linear.target).out_features, _width(
            self.norm.args[0]
        )


def _down_chains(graph: fx.Graph, module: nn.Module) -> list[_Chain]:
    """Every norm-like child (parameters, not a linear) applied to the output of a
    linear on an input, or to a part of it along the last dimension. A linear whose
    output several such children normalise (a packed q/k/v with q/k norms) is no
    down-projection and is left out."""
    chains = []
    for node in graph.nodes:
        child = fx_utils.submodule(node, module)
        if child is None or isinstance(child, nn.Linear) or "." in node.target:
            continue
        if next(child.parameters(), None) is None or not node.args:
            continue
        linear = _sliced_from(node.args[0])
        if not fx_utils.is_linear_on_input(linear, module) or "." in linear.target:
            continue
        inner, outer = fx_utils.value(node.args[0]), fx_utils.value(linear)
        if inner is None or outer is None or inner.shape[:-1] != outer.shape[:-1]:
            continue
        chains.append(_Chain(linear, node))
    counts = [c.linear for c in chains]
    return [c for c in chains if counts.count(c.linear) == 1]


def _kv_and_query_chains(
    graph: fx.Graph, module: nn.Module
) -> tuple[list[_Chain], list[_Chain]]:
    """The down-projection chains by role: a KV chain's norm is narrower than its
    linear (the rest of the linear's output is the rotary key), a query LoRA chain's
    as wide. A chain whose norm is wider than its linear is neither."""
    kv_chains, q_chains = [], []
    for chain in _down_chains(graph, module):
        linear_width, norm_width = chain.widths(module)
        if norm_width is None or norm_width > linear_width:
            continue
        (kv_chains if linear_width > norm_width else q_chains).append(chain)
    return kv_chains, q_chains


@dataclass(frozen=True)
class _KVPath:
    """`kv_b(norm(kv_a(x)[..., :rank]))` into the attention call."""

    chain: _Chain
    attention: fx.Node
    kv_b: fx.Node


@dataclass(frozen=True)
class _QueryPath:
    """`q_proj(norm(q_a(x)))` with query LoRA, else `q_proj(x)`."""

    q_a: fx.Node | None
    q_norm: fx.Node | None
    q_proj: fx.Node


def _output_projection(
    graph: fx.Graph, module: nn.Module, attention: fx.Node
) -> fx.Node | None:
    """The linear the forward returns, if it projects the attention's output."""
    output = fx_utils.returned_linear(graph, module)
    if output is not None and not fx_utils.upstream(output, lambda n: n is attention):
        return None  # the module returns something else than the attention, projected
    return output


def _linear_before(
    node: fx.Node, attention: fx.Node, module: nn.Module
) -> fx.Node | None:
    """The one linear computed from `node` before the attention call, if any."""
    found = fx_utils.downstream(
        node, lambda n: n is attention or fx_utils.is_linear(n, module)
    )
    linears = [n for n in found if n is not attention]
    return linears[0] if len(linears) == 1 else None


def _linears_upstream(node: object, module: nn.Module) -> set[fx.Node]:
    if not isinstance(node, fx.Node):
        return set()
    return fx_utils.upstream(node, lambda n: fx_utils.is_linear(n, module))


@functools.cache
def _method_tree(cls: type[nn.Module], name: str) -> ast.FunctionDef | None:
    """The parsed source of the method `cls.<name>`, `None` where it has none."""
    method = inspect.getattr_static(cls, name, None)
    if not inspect.isfunction(method):
        return None
    try:
        source = textwrap.dedent(inspect.getsource(method))
    except (OSError, TypeError):
        return None
    tree = ast.parse(source).body[0]
    return tree if isinstance(tree, ast.FunctionDef) else None


def _latent_parameter(tree: ast.FunctionDef, kv_b: str) -> int:
    """Which of the expansion method's two arguments is the latent: the one it applies
    `self.<kv_b>` to. Also checks it takes two arguments and returns a pair."""
    parameters = [a.arg for a in tree.args.args][1:]
    if (
        len(parameters) != 2
        or tree.args.vararg
        or tree.args.kwarg
        or tree.args.kwonlyargs
    ):
        raise FusionDeclined(f"{tree.name} does not take exactly two arguments")
    returns = [n.value for n in ast.walk(tree) if isinstance(n, ast.Return)]
    if not returns or any(
        not (isinstance(r, ast.Tuple) and len(r.elts) == 2) for r in returns
    ):
        raise FusionDeclined(f"{tree.name} does not return a pair")
    applied = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and rewriting.is_self_attribute(n.func, kv_b)
    ]
    if len(applied) != 1 or len(applied[0].args) != 1 or applied[0].keywords:
        raise FusionDeclined(
            f"{tree.name} does not apply self.{kv_b} once, to one argument"
        )
    (latent,) = applied[0].args
    if not isinstance(latent, ast.Name) or latent.id not in parameters:
        raise FusionDeclined(
            f"{tree.name} applies self.{kv_b} to something but an argument"
        )
    # Rebinding the argument before expanding it would make the latent something else.
    for statement in tree.body:
        if any(n is applied[0] for n in ast.walk(statement)):
            break
        if any(
            isinstance(n, ast.Name)
            and n.id == latent.id
            and not isinstance(n.ctx, ast.Load)
            for n in ast.walk(statement)
        ):
            raise FusionDeclined(f"{tree.name} changes {latent.id} before expanding it")
    return parameters.index(latent.id)


@dataclass
class MLAFuser(StackedFuser):
    """`attend(q_b(norm(q_a(x))), *expand(norm(kv_a(x)[:r]), rope(kv_a(x)[r:])))` ->
    `attend(q, latent, rope_key)` with `attn` vLLM's `MLAAttention`, which caches the
    latent and absorbs the expansion `kv_b` itself.

    Roles come from dataflow: the KV down-projection `kv_a` is the one linear on the
    input whose output (a part of it) an RMSNorm normalises to a narrower width (the
    rest is the rotary key); an optional second such chain of equal widths is the
    query LoRA (`q_a`, its up-projection `q_b` is the linear the norm feeds); without
    it the one remaining linear on the input is the query projection. `kv_b` is the
    linear fed by the KV norm, the output projection the linear the forward returns.

    The rewritten forward hands the latent and the rotary key to the attention
    interface in place of the module's own KV-expansion method call (two arguments,
    returns a pair, applies `kv_b`). With query LoRA, `q_a` and `kv_a` read the same
    input and merge into one replicated `MergedColumnParallelLinear`, split after it.
    The query projection and `kv_b` become column-parallel (heads split over the TP
    ranks), the output projection row-parallel. Validated only when vLLM's model
    config uses MLA (`VLLM_MLA_DISABLE=1` leaves the module, expansion and all, to
    vLLM's plain attention)."""

    kind = "mla"
    coverage = "qkv"

    q_a: str | None = None
    q_norm: str | None = None
    q_proj: str = ""
    """The query projection: `q_b` with query LoRA, else the one on the input."""
    kv_a: str = ""
    kv_norm: str = ""
    kv_b: str = ""
    o_proj: str | None = None
    spans: dict[str, Span] = field(default_factory=dict)
    """Spans of the down-projection calls, of the expansion call and of the
    attention interface call."""

    @classmethod
    def could_match(cls, module: nn.Module) -> bool:
        children = list(module.children())
        linears = sum(isinstance(c, nn.Linear) for c in children)
        normed = any(
            not isinstance(c, nn.Linear) and next(c.parameters(), None) is not None
            for c in children
        )
        return linears >= 3 and normed

    @property
    def roles(self) -> dict[str, str | None]:
        """Role -> child name (`None` for a role this module does not have)."""
        return {
            "q_a": self.q_a,
            "q_norm": self.q_norm,
            "q_proj": self.q_proj,
            "kv_a": self.kv_a,
            "kv_norm": self.kv_norm,
            "kv_b": self.kv_b,
            "o_proj": self.o_proj,
        }

    @classmethod
    def match(cls, graph: fx.Graph | None, module: nn.Module) -> Self | None:
        if graph is None:
            return None
        kv_chains, q_chains = _kv_and_query_chains(graph, module)
        if not kv_chains:
            return None
        kv = cls._kv_path(graph, module, kv_chains)
        if isinstance(kv, Declined):
            return kv
        query = cls._query_path(graph, module, q_chains, kv)
        if isinstance(query, Declined):
            return query
        if (declined := cls._unfit_attention_inputs(module, kv, query)) is not None:
            return declined
        output = _output_projection(graph, module, kv.attention)
        linears = [
            n.target
            for n in (query.q_a, query.q_proj, kv.chain.linear, kv.kv_b, output)
            if n is not None
        ]
        if reason := called_once(graph, linears):
            return cls.decline(module, reason)

        kv_a = kv.chain.linear.target
        spans = {
            "expansion": kv.kv_b.meta.get("span"),
            "attention": kv.attention.meta.get("span"),
        }
        shards: dict[str, int] = {}
        fused_name = ""
        if query.q_a is not None:
            shards = {query.q_a.target: 0, kv_a: 1}
            fused_name = rewriting.fresh_attribute(module, "fused_qkv_a_proj")
            spans[query.q_a.target], spans[kv_a] = (
                query.q_a.meta.get("span"),
                kv.chain.linear.meta.get("span"),
            )
        return cls(
            fused_name=fused_name,
            shards=shards,
            q_a=None if query.q_a is None else query.q_a.target,
            q_norm=None if query.q_norm is None else query.q_norm.target,
            q_proj=query.q_proj.target,
            kv_a=kv_a,
            kv_norm=kv.chain.norm.target,
            kv_b=kv.kv_b.target,
            o_proj=None if output is None else output.target,
            spans=spans,
        )

    @classmethod
    def _kv_path(
        cls, graph: fx.Graph, module: nn.Module, kv_chains: list[_Chain]
    ) -> _KVPath | Declined:
        """The one KV down-projection chain, its norm an RMSNorm, and the bias-free
        linear that expands the latent before the one attention call."""
        if len(kv_chains) > 1:
            names = ", ".join(
                f"{c.linear.target} -> {c.norm.target}" for c in kv_chains
            )
            return cls.decline(
                module,
                f"{len(kv_chains)} KV down-projection chains ({names}); latent "
                "attention has exactly one",
            )
        (kv,) = kv_chains
        kv_a, kv_norm = kv.linear.target, kv.norm.target
        if not _is_rms_norm(module.get_submodule(kv_norm)):
            return cls.decline(
                module,
                f"{kv_norm} ({type(module.get_submodule(kv_norm)).__name__}) normalises "
                f"the KV latent of {kv_a} but is not an RMSNorm",
            )
        attention = fx_utils.attention_node(graph)
        if attention is None:
            return cls.decline(
                module,
                f"{kv_a} looks like a KV down-projection but tracing did not reach "
                "a single attention call",
            )
        kv_b = _linear_before(kv.norm, attention, module)
        if kv_b is None:
            return cls.decline(
                module,
                f"no single linear up-projects the KV latent {kv_norm} normalises",
            )
        if module.get_submodule(kv_b.target).bias is not None:
            return cls.decline(
                module, f"{kv_b.target} has a bias, which MLA cannot absorb"
            )
        return _KVPath(kv, attention, kv_b)

    @classmethod
    def _query_path(
        cls,
        graph: fx.Graph,
        module: nn.Module,
        q_chains: list[_Chain],
        kv: _KVPath,
    ) -> _QueryPath | Declined:
        """The query LoRA (`q_b(norm(q_a(x)))`, `q_a` mergeable with `kv_a`) if the
        module has one chain for it, else the one other linear on the input."""
        kv_a = kv.chain.linear.target
        if len(q_chains) > 1:
            return cls.decline(module, f"{len(q_chains)} candidate query LoRA chains")
        if not q_chains:
            others = [
                n
                for n in graph.nodes
                if fx_utils.is_linear_on_input(n, module) and n is not kv.chain.linear
            ]
            if len(others) != 1:
                return cls.decline(
                    module,
                    f"{len(others)} linears besides {kv_a} read the input; without query "
                    "LoRA exactly one is the query projection",
                )
            return _QueryPath(q_a=None, q_norm=None, q_proj=others[0])
        (q,) = q_chains
        q_a, q_norm = q.linear, q.norm
        if not _is_rms_norm(module.get_submodule(q_norm.target)):
            return cls.decline(
                module, f"the query LoRA norm {q_norm.target} is not an RMSNorm"
            )
        q_proj = _linear_before(q_norm, kv.attention, module)
        if q_proj is None:
            return cls.decline(
                module,
                f"no single linear up-projects the query {q_norm.target} normalises",
            )
        if q_a.args[0] is not kv.chain.linear.args[0]:
            return cls.decline(module, f"{q_a.target} and {kv_a} read different inputs")
        biases = {
            module.get_submodule(n.target).bias is None for n in (q_a, kv.chain.linear)
        }
        if len(biases) != 1:
            return cls.decline(
                module, f"only one of {q_a.target} and {kv_a} has a bias"
            )
        return _QueryPath(q_a=q_a, q_norm=q_norm, q_proj=q_proj)

    @classmethod
    def _unfit_attention_inputs(
        cls, module: nn.Module, kv: _KVPath, query: _QueryPath
    ) -> Declined | None:
        """Why the attention call's inputs are not the query from `q_proj` alone and
        the key and value from one call that applies `kv_b`; `None` when they are."""
        q_proj, kv_b = query.q_proj, kv.kv_b
        query_in, key, value = kv.attention.args[:3]
        if _linears_upstream(query_in, module) != {q_proj}:
            return cls.decline(
                module,
                f"the query reaching attention is not computed from {q_proj.target} alone",
            )
        if any(kv_b not in _linears_upstream(x, module) for x in (key, value)):
            return cls.decline(
                module,
                f"the key and value reaching attention are not expanded by {kv_b.target}",
            )
        # Key and value come out of the one forward expression that applies kv_b.
        expansion = kv_b.meta.get("span")
        if any(
            not isinstance(x, fx.Node) or x.meta.get("span") != expansion
            for x in (key, value)
        ):
            return cls.decline(
                module,
                f"{kv_b.target} is not applied inside one call that returns the key and "
                "value (a KV-expansion method the forward could skip)",
            )
        return None

    # Per instance ---------------------------------------------------------------

    def mismatch(self, module: nn.Module, vllm_config: "VllmConfig") -> str | None:
        """Why this instance cannot be served by `MLAAttention` under `vllm_config`,
        `None` when it can: MLA must be in use, the widths must be the model's MLA
        dimensions and the heads must split over the TP ranks."""
        from vllm.model_executor.layers.attention.mla_attention import get_mla_dims

        model_config = vllm_config.model_config
        if model_config is None or not model_config.use_mla:
            return "vLLM does not use MLA for this model"
        dims = get_mla_dims(model_config)
        qk_head_dim = dims.qk_nope_head_dim + dims.qk_rope_head_dim
        q, kv_a, kv_b = (
            getattr(module, n) for n in (self.q_proj, self.kv_a, self.kv_b)
        )
        heads, rest = divmod(q.out_features, qk_head_dim)
        if rest:
            return f"{self.q_proj} width {q.out_features} is not whole heads of {qk_head_dim}"
        kv_b_width = heads * (dims.qk_nope_head_dim + dims.v_head_dim)
        expected = {
            f"{self.kv_a} width": (
                kv_a.out_features,
                dims.kv_lora_rank + dims.qk_rope_head_dim,
            ),
            f"{self.kv_b} input": (kv_b.in_features, dims.kv_lora_rank),
            f"{self.kv_b} width": (kv_b.out_features, kv_b_width),
        }
        if self.q_a is not None:
            q_a = getattr(module, self.q_a)
            expected[f"{self.q_a} width"] = (q_a.out_features, dims.q_lora_rank)
        if self.o_proj is not None:
            o_proj = getattr(module, self.o_proj)
            expected[f"{self.o_proj} input"] = (
                o_proj.in_features,
                heads * dims.v_head_dim,
            )
        wrong = [
            f"{what} {got} (expected {want})"
            for what, (got, want) in expected.items()
            if got != want
        ]
        if wrong:
            return f"its widths are not the model's MLA dimensions {dims}: {', '.join(wrong)}"
        tp_size = vllm_config.parallel_config.tensor_parallel_size
        if heads % tp_size:
            return f"{heads} heads do not split over {tp_size} ranks"
        return None

    def adjust_attention(
        self, needs: AttentionNeeds, module: nn.Module, vllm_config: "VllmConfig"
    ) -> AttentionNeeds:
        # vLLM's MLAAttention caches the latent and applies `kv_b` itself.
        return dataclasses.replace(needs, latent=self.kv_b)

    # Rewriting --------------------------------------------------------------------

    def update_forward(self, module: nn.Module) -> None:
        rewrite = ForwardRewrite(type(module))
        # Everything is found before anything changes: spans are looked up in the tree.
        expansion, latent_and_rope = self._expansion(rewrite, type(module))
        if self.shards:
            calls = [rewrite.self_call(self.spans[name], name) for name in self.shards]
            for name in self.shards:
                rewrite.expect_single_use(name)
            x = calls[0].args[0]
            if not isinstance(x, ast.Name) or ast.dump(calls[1].args[0]) != ast.dump(x):
                raise FusionDeclined(
                    "the down-projections are not applied to one local name"
                )
            if not rewrite.holds_one_value(x.id, calls):
                raise FusionDeclined(f"`{x.id}` changes between the down-projections")
            block, first, _ = rewrite.region(calls)
            outputs = [rewrite.fresh_name(f"{name}_out") for name in self.shards]
            rewrite.insert_before(
                block[first],
                ast.parse(
                    f"{', '.join(outputs)} = self.{self.fused_name}({x.id})"
                    f".split(self.{self.fused_name}.output_partition_sizes, dim=-1)"
                ).body[0],
            )
            for call, output in zip(calls, outputs):
                rewrite.replace(call, ast.Name(output, ast.Load()))
        rewrite.replace(expansion, latent_and_rope)
        self.fused_forward = rewrite.compile()

    def _expansion(
        self, rewrite: ForwardRewrite, cls: type[nn.Module]
    ) -> tuple[ast.Call, ast.Tuple]:
        """The call `self.expand(latent, rope_key)` in `k, v = self.expand(...)`, and
        what replaces it: `(latent, rope_key)` in the order that passes the latent as
        the attention interface's key and the rotary key as its value (`k` and `v`
        are passed there, and used nowhere else)."""
        call = rewrite.expression_at(self.spans["expansion"])
        if not (
            isinstance(call, ast.Call)
            and rewriting.is_self_attribute(call.func)
            and len(call.args) == 2
            and not call.keywords
            and not any(isinstance(a, ast.Starred) for a in call.args)
        ):
            raise FusionDeclined(
                f"{self.kv_b} is not applied by a call `self.<method>(latent, rope_key)` "
                "in forward"
            )
        name = call.func.attr
        tree = _method_tree(cls, name)
        if tree is None:
            raise FusionDeclined(
                f"self.{name} is not a method whose source can be read"
            )
        latent_index = _latent_parameter(tree, self.kv_b)
        statement = rewrite.statement(call)
        unpacks = (
            isinstance(statement, ast.Assign)
            and statement.value is call
            and len(statement.targets) == 1
            and isinstance(statement.targets[0], ast.Tuple)
        )
        targets = statement.targets[0].elts if unpacks else []
        if len(targets) != 2 or not all(isinstance(t, ast.Name) for t in targets):
            raise FusionDeclined(
                f"the pair self.{name} returns is not unpacked into two names"
            )
        interface = rewrite.expression_at(self.spans["attention"])
        if not isinstance(interface, ast.Call) or len(interface.args) < 4:
            raise FusionDeclined(
                "the attention interface is not called with (self, query, key, value)"
            )
        passed = [
            a.id if isinstance(a, ast.Name) else None for a in interface.args[2:4]
        ]
        if sorted(filter(None, passed)) != sorted(t.id for t in targets):
            raise FusionDeclined(
                f"what self.{name} returns is not passed as the key and value"
            )
        for target in targets:
            if (
                len(rewrite.stores(target.id)) != 1
                or len(rewrite.loads(target.id)) != 1
            ):
                raise FusionDeclined(f"`{target.id}` is used beyond the attention call")
        latent, rope_key = call.args[latent_index], call.args[1 - latent_index]
        # The key position gets the latent, the value position the rotary key.
        ordered = (
            [latent, rope_key] if passed[0] == targets[0].id else [rope_key, latent]
        )
        return call, ast.copy_location(ast.Tuple(ordered, ast.Load()), call)

    def update_attrs(
        self, module: nn.Module, prefix: str, vllm_config: "VllmConfig"
    ) -> None:
        quant_config = vllm_config.quant_config
        if self.shards:
            q_a, kv_a = (getattr(module, name) for name in self.shards)
            merged = MergedColumnParallelLinear(
                input_size=q_a.in_features,
                output_sizes=[q_a.out_features, kv_a.out_features],
                bias=q_a.bias is not None,
                quant_config=quant_config,
                prefix=f"{prefix}.{self.fused_name}",
                return_bias=False,
                disable_tp=True,
            )
            for name in self.shards:
                delattr(module, name)
            setattr(module, self.fused_name, merged)
        else:
            self._swap(module, self.kv_a, "replicate", prefix, vllm_config)
        self._swap(module, self.q_proj, "colwise", prefix, vllm_config)
        # Called by MLAAttention only, which wants vLLM's (output, bias) pair.
        kv_b = getattr(module, self.kv_b)
        setattr(
            module,
            self.kv_b,
            ColumnParallelLinear(
                input_size=kv_b.in_features,
                output_size=kv_b.out_features,
                bias=False,
                quant_config=quant_config,
                prefix=f"{prefix}.{self.kv_b}",
            ),
        )
        if self.o_proj is not None:
            row_parallel(module, self.o_proj, prefix, vllm_config)

    @staticmethod
    def _swap(
        module: nn.Module, name: str, style: str, prefix: str, vllm_config: "VllmConfig"
    ) -> None:
        linear = replace_linear_class(
            getattr(module, name),
            style,
            vllm_config.quant_config,
            prefix=f"{prefix}.{name}",
        )
        setattr(module, name, linear)

    @property
    def packed_modules_mapping(self) -> dict[str, list[str]]:
        return {self.fused_name: list(self.shards)} if self.shards else {}

    def info(self, name: str, module: nn.Module) -> str:
        merged = (
            f"{super().info(name, module)}; "
            if self.shards
            else (
                f"Fused: latent attention ({name}: {type(module).__name__}); "
                f"{self.kv_a} -> ReplicatedLinear; "
            )
        )
        output = f"; {self.o_proj} -> RowParallelLinear" if self.o_proj else ""
        return (
            f"{merged}{self.q_proj} -> ColumnParallelLinear; {self.kv_b} -> "
            f"ColumnParallelLinear, absorbed by MLAAttention (KV expansion bypassed)"
            f"{output}"
        )
