# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Root-mean-square normalisation, found from what a module computes."""

import ast
import functools
import inspect
import textwrap
from dataclasses import dataclass
from typing import TYPE_CHECKING, Self

import torch
from torch import fx, nn

from vllm.model_executor.models.transformers.layer_classes import layer_class
from vllm.model_executor.models.transformers import fx_utils
from vllm.model_executor.models.transformers import tracing
from vllm.model_executor.models.transformers.fusers.base import BaseFuser

if TYPE_CHECKING:
    from vllm.config import VllmConfig

def _past_casts(node: fx.Node) -> fx.Node:
    """`node`, or the last of a chain of casts applied to it."""
    while (user := fx_utils.single_user(node)) is not None and fx_utils.op_name(
        user
    ) in fx_utils.CASTS:
        node = user
    return node


def _dtype(node: object) -> torch.dtype | None:
    found = fx_utils.value(node)
    return found.dtype if isinstance(found, torch.Tensor) else None


def _other(node: fx.Node, operand: object) -> object:
    """The operand of the binary `node` that is not `operand`."""
    a, b = node.args[:2]
    return b if a is operand else a


def _squared(node: object) -> object:
    """What `node` squares (`a ** 2`, `a * a`, `a.square()`), `None` otherwise."""
    name = fx_utils.op_name(node)
    if (name == "pow" and node.args[1] == 2) or name == "square" or (
        name == "mul" and node.args[0] is node.args[1]
    ):
        return node.args[0]
    return None


def _inverse_root(node: object) -> object:
    """What `node` takes the inverse square root of (`rsqrt(a)`, or `a ** -0.5` as
    Gemma 3n writes it), `None` otherwise."""
    name = fx_utils.op_name(node)
    if name == "rsqrt" or (name == "pow" and node.args[1] == -0.5):
        return node.args[0]
    return None


def _mean_dim(node: fx.Node) -> tuple[object, bool]:
    """The dim and keepdim of a `mean` node."""
    dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)
    keepdim = node.kwargs.get("keepdim", node.args[2] if len(node.args) > 2 else False)
    if isinstance(dim, list | tuple) and len(dim) == 1:
        dim = dim[0]
    return dim, keepdim


@dataclass(frozen=True)
class _Core:
    """`x * rsqrt(mean(x ** 2) + eps)` found in a graph, casts anywhere in it."""

    x: fx.Node
    normalised: fx.Node
    eps: object
    mean: fx.Node


def _rms_core(graph: fx.Graph) -> _Core | None:
    for root in graph.nodes:
        add = _inverse_root(root)
        if fx_utils.op_name(add) != "add":
            continue
        mean = next((a for a in add.args[:2] if fx_utils.op_name(a) == "mean"), None)
        squared = _squared(mean.args[0]) if mean is not None else None
        if squared is None:
            continue
        scale = _past_casts(root)
        for normalised in scale.users:
            x = (
                _other(normalised, scale)
                if fx_utils.op_name(normalised) == "mul"
                else None
            )
            # Equal up to casts; whether those casts round is `_rounding`'s question.
            if isinstance(x, fx.Node) and fx_utils.uncast(x) is fx_utils.uncast(squared):
                return _Core(x, normalised, _other(add, mean), mean)
    return None


def _rounding(start: fx.Node, core: _Core) -> str | None:
    """Why the normalisation from `start` is not computed in float32 throughout, as
    vLLM computes it (a mean square or inverse root rounded to the input dtype);
    `None` when it is."""
    if _dtype(core.normalised) != torch.float32:
        return "it normalises in the input dtype; vLLM normalises in float32"
    if _dtype(core.x) != torch.float32:
        # Promoted only at the multiply: float32 for narrower inputs, but a float64
        # input would be scaled in float64, where vLLM casts it to float32 first.
        return "it scales its input uncast, in the input dtype, by a float32 root"
    for node in fx_utils.between(start, core.normalised):
        if _dtype(node) != torch.float32:
            return (
                f"it rounds an intermediate value ({node.name}) to {_dtype(node)}; "
                "vLLM normalises in float32 throughout"
            )
    return None


@functools.cache
def _literals(cls: type[nn.Module]) -> frozenset[float]:
    """The numbers written in the code of `cls`'s methods (its own and inherited,
    outside torch), but not in `__init__`, whose defaults instances override."""
    found: set[float] = set()
    for owner in cls.__mro__:
        if owner.__module__.startswith("torch") or owner is object:
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(owner)))
        except (OSError, TypeError, SyntaxError):
            continue
        for function in ast.walk(tree):
            if isinstance(function, ast.FunctionDef) and function.name != "__init__":
                found.update(
                    n.value
                    for n in ast.walk(function)
                    if isinstance(n, ast.Constant)
                    and isinstance(n.value, int | float)
                    and not isinstance(n.value, bool)
                )
    return frozenset(found)


@dataclass
class RMSNormFuser(BaseFuser):
    """`x * rsqrt(mean(x ** 2, -1) + eps) * w` (or `* (1 + w)`, or no weight at all,
    or `torch.rms_norm`) -> vLLM's `RMSNorm` (or `GemmaRMSNorm`) with the module's
    own eps and width.

    Found from the dataflow, never the class name, and only where vLLM computes the
    same thing the same way: normalised in float32; the weight applied after casting
    back to the input dtype (`RMSNorm`), or in float32 before it (`RMSNorm` keeping a
    float32 weight; `GemmaRMSNorm` for `1 + w`); no weight (`RMSNorm` with
    `has_weight=False`: Gemma 3n's `with_scale=False`, nanochat). `torch.rms_norm` is
    taken as what it is meant to be: it agrees with vLLM's to float32 rounding. The
    weight keeps the name `weight`, so checkpoints load unchanged."""

    needs_graph = True
    kind = "rms_norm"
    summary = "{n} RMSNorms on vLLM's kernel"
    coverage = "rms_norm"

    gemma: bool = False
    weight_in_float32: bool = False
    weight_cast_to_float32: bool = False
    """The weight is cast to float32 itself (`weight.float()`), not promoted to it:
    float32 exactly, even in a float64 model."""
    has_weight: bool = True
    eps_attribute: str | None = None
    """The instance attribute holding eps; `None` when it is a literal of the class."""
    eps: float = 0.0

    @classmethod
    def could_match(cls, module: nn.Module) -> bool:
        parameters = list(module.parameters())
        return not any(True for _ in module.children()) and (
            len(parameters) <= 1 and all(p.ndim == 1 for p in parameters)
        )

    @classmethod
    def match(cls, graph: fx.Graph | None, module: nn.Module) -> Self | None:
        if graph is None:
            return None
        functional = next(
            (n for n in graph.nodes if fx_utils.op_name(n) == "rms_norm"), None
        )
        if functional is not None:
            return cls._functional(graph, module, functional)
        core = _rms_core(graph)
        if core is None:
            return None
        inputs = [n for n in graph.nodes if n.op == "placeholder"]
        if fx_utils.uncast(core.x) is not inputs[0]:
            return cls.decline(module, "it does not normalise its first input")
        dim, keepdim = _mean_dim(core.mean)
        if dim not in (-1, fx_utils.value(core.x).ndim - 1) or keepdim is not True:
            return cls.decline(
                module, f"the mean is over dim={dim} (keepdim={keepdim}), not the last"
            )
        if reason := _rounding(inputs[0], core):
            return cls.decline(module, reason)
        output = fx_utils.returned(graph)
        if output is None:
            return cls.decline(module, "tracing stopped before the output")
        normalised = _past_casts(core.normalised)
        if normalised is output:
            return cls._weightless(module, output, core.eps)
        scaled = fx_utils.single_user(normalised)
        if fx_utils.op_name(scaled) != "mul" or _past_casts(scaled) is not output:
            return cls.decline(
                module, "something other than a weight follows the normalisation"
            )
        if _dtype(scaled) not in (tracing.PROBE_DTYPE, torch.float32) or (
            _dtype(normalised) != _dtype(scaled)
        ):
            return cls.decline(
                module,
                f"the weight is applied in {_dtype(scaled)} to a value rounded to "
                f"{_dtype(normalised)}, which no vLLM norm does",
            )
        cast_weight = _other(scaled, normalised)
        weight_term = fx_utils.uncast(cast_weight)
        gemma = fx_utils.op_name(weight_term) == "add"
        if gemma:
            one, weight = weight_term.args[:2]
            if isinstance(one, fx.Node):
                one, weight = weight, one
            if one != 1:
                return cls.decline(module, f"the weight is offset by {one}, not 1")
            weight = fx_utils.uncast(weight)
            if _dtype(weight_term) != torch.float32 or _dtype(scaled) != torch.float32:
                return cls.decline(
                    module,
                    "(1 + weight) is not applied in float32, as GemmaRMSNorm does",
                )
        else:
            weight = weight_term
        if reason := cls._weight_reason(weight, fx_utils.value(core.x)):
            return cls.decline(module, reason)
        if _dtype(output) != tracing.PROBE_DTYPE:
            return cls.decline(
                module, f"it returns {_dtype(output)}, not its input's dtype"
            )
        return cls._with_eps(
            module,
            core.eps,
            gemma=gemma,
            weight_in_float32=_dtype(scaled) == torch.float32,
            # Traced parameters are PROBE_DTYPE: float32 here is the forward's cast.
            weight_cast_to_float32=_dtype(cast_weight) == torch.float32,
        )

    @classmethod
    def _weightless(
        cls, module: nn.Module, output: fx.Node, eps: object
    ) -> Self | None:
        """The normalisation, cast back, is all the module computes."""
        if _dtype(output) is None:
            return cls.decline(module, "tracing could not infer what it returns")
        if _dtype(output) != tracing.PROBE_DTYPE:
            return cls.decline(
                module, f"it returns {_dtype(output)}, not its input's dtype"
            )
        if any(True for _ in module.parameters()):
            return cls.decline(module, "it has a parameter that it never applies")
        return cls._with_eps(module, eps, has_weight=False)

    @classmethod
    def _functional(
        cls, graph: fx.Graph, module: nn.Module, node: fx.Node
    ) -> Self | None:
        """`torch.rms_norm(x, (width,), self.weight, eps)`, the weight optional."""
        x, shape, weight, eps = (*node.args, None, None, None)[:4]
        weight, eps = node.kwargs.get("weight", weight), node.kwargs.get("eps", eps)
        if x.op != "placeholder" or fx_utils.returned(graph) not in (
            node,
            _past_casts(node),
        ):
            return cls.decline(module, "rms_norm is not all the module computes")
        if not isinstance(shape, list | tuple) or len(shape) != 1:
            return cls.decline(
                module, f"rms_norm normalises over {shape}, not the last dim"
            )
        if eps is None:
            return cls.decline(
                module, "rms_norm takes its dtype's eps, which vLLM does not"
            )
        if weight is None:
            return cls._weightless(module, fx_utils.returned(graph), eps)
        if reason := cls._weight_reason(weight, fx_utils.value(x)):
            return cls.decline(module, reason)
        return cls._with_eps(module, eps)

    @staticmethod
    def _weight_reason(weight: object, x: torch.Tensor) -> str | None:
        """Why `weight` is not a scale vLLM's norms can load, `None` if it is."""
        if not isinstance(weight, fx.Node) or weight.op != "get_attr":
            return "the weight is not one of its parameters"
        if weight.target != "weight":
            return f"its scale is named {weight.target!r}; vLLM's norms load `weight`"
        if fx_utils.value(weight).shape != (x.shape[-1],):
            return "the weight is not one scale per feature"
        return None

    @classmethod
    def _with_eps(cls, module: nn.Module, eps: object, **numerics: bool) -> Self | None:
        """The fuser, with where each instance's eps comes from: the one attribute
        holding it, else a literal in the class's code. An eps from anywhere else (a
        config, the input's dtype) could differ per instance or per run unseen."""
        if not isinstance(eps, float | int) or isinstance(eps, bool):
            return cls.decline(module, "eps is not a constant")
        holders = [
            name
            for name, held in vars(module).items()
            if not name.startswith("_") and type(held) in (float, int) and held == eps
        ]
        if len(holders) > 1:
            return cls.decline(module, f"eps={eps} could be any of {holders}")
        if not holders and eps not in _literals(type(module)):
            return cls.decline(
                module,
                f"eps={eps} is neither an attribute of it nor written in its code, "
                "so it cannot be read per instance",
            )
        return cls(
            eps_attribute=holders[0] if holders else None, eps=float(eps), **numerics
        )

    def mismatch(self, module: nn.Module, vllm_config: "VllmConfig") -> str | None:
        weight = getattr(module, "weight", None)
        if self.has_weight and (
            not isinstance(weight, nn.Parameter) or weight.ndim != 1
        ):
            return "this instance has no 1-D `weight` parameter"
        if not self.has_weight and any(True for _ in module.parameters()):
            return "this instance has parameters; the traced one applied no weight"
        if self.eps_attribute is not None:
            eps = getattr(module, self.eps_attribute, None)
            if isinstance(eps, bool) or not isinstance(eps, int | float):
                return f"its eps attribute {self.eps_attribute} holds {eps!r}"
        return None

    def fuse(
        self, module: nn.Module, prefix: str, vllm_config: "VllmConfig"
    ) -> nn.Module:
        eps = (
            float(getattr(module, self.eps_attribute))
            if self.eps_attribute
            else self.eps
        )
        RMSNorm = layer_class("layernorm", "RMSNorm")
        if not self.has_weight:
            # Normalises whatever width it is given (weightless norms store none:
            # Gemma 3n's drops its `dim`); the width only sizes a weight never read.
            return RMSNorm(0, eps, has_weight=False)
        hidden_size = module.weight.shape[0]
        if self.gemma:
            return layer_class("layernorm", "GemmaRMSNorm")(hidden_size, eps)
        # Built under the model's dtype: a weight applied in float32 is kept at least
        # that precise, so it multiplies as Transformers' promotion does, or exactly
        # float32 where the forward casts it so.
        dtype = torch.get_default_dtype()
        if self.weight_cast_to_float32:
            dtype = torch.float32
        elif self.weight_in_float32:
            dtype = torch.promote_types(dtype, torch.float32)
        return RMSNorm(hidden_size, eps, dtype=dtype)

    def info(self, name: str, module: nn.Module) -> str:
        width = (
            f"hidden size {module.weight.shape[0]}" if self.has_weight else "no weight"
        )
        return (
            f"Fused: {name} -> {type(module).__name__} "
            f"(eps={module.variance_epsilon}, {width})"
        )
