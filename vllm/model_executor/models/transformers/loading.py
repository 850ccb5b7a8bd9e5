# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Checkpoint names -> this backend's module names, and loading through vLLM's loader."""

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import regex as re
import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import (
    Concatenate,
    MergeModulelist,
    WeightConverter,
    WeightRenaming,
)

from vllm.logger import init_logger
from vllm.model_executor.layers.linear import LinearBase
from vllm.model_executor.models.transformers.records import ShardId
from vllm.model_executor.models.utils import (
    AutoWeightsLoader,
    PPMissingLayer,
    StageMissingLayer,
    WeightsMapper,
)

logger = init_logger(__name__)

BASE = "model"
"""The backend keeps the HF base model as `self.model`."""
LM_HEAD = "lm_head"



def base_model_of(hf_model: nn.Module) -> tuple[str, nn.Module]:
    """The HF model's base model, and the name its checkpoint gives it.

    Transformers' `base_model` is the child `base_model_prefix` names, or the model
    itself where it has no such child. A few heads name another prefix than the
    child that holds their base model (Llama 4's causal LM says `language_model`
    and holds its text model as `model`): then it is the one child that is a
    Transformers model itself and holds the input embeddings. A base model (BERT's,
    LLaVA's around its text model: no output embedding) is its own."""
    base = hf_model.base_model
    if base is not hf_model or hf_model.get_output_embeddings() is None:
        return hf_model.base_model_prefix, base
    embeddings = hf_model.get_input_embeddings()
    holders = [
        (name, child)
        for name, child in hf_model.named_children()
        if isinstance(child, PreTrainedModel)
        and any(m is embeddings for m in child.modules())
    ]
    if len(holders) == 1:
        return holders[0]
    return hf_model.base_model_prefix, base


# Buffers Transformers recomputes, found in some older checkpoints.
_RECOMPUTED_BUFFERS = re.compile(r"rotary_emb\.inv_freq$|\.masked_bias$|\.attn\.bias$")

SHOWN = 5
"""Names listed in an error about many tensors; the rest are counted."""


def _listed(names: Iterable[str]) -> str:
    """`'a', 'b' and 3 more`: names for an error message, sorted."""
    ordered = sorted(names)
    shown = ", ".join(repr(n) for n in ordered[:SHOWN])
    more = len(ordered) - SHOWN
    return f"{shown} and {more} more" if more > 0 else shown


def _tensors(
    roots: Iterable[tuple[str, nn.Module]],
) -> dict[str, tuple[tuple[int, ...], str]]:
    """Each parameter and persistent buffer under `roots` (name prefix, module), by
    the backend's name for it before stacking: its shape and its module's class."""
    found = {}
    for root, top in roots:
        for name, module in top.named_modules(remove_duplicate=False):
            tensors = [
                *module.named_parameters(recurse=False),
                *(
                    (n, b)
                    for n, b in module.named_buffers(recurse=False)
                    if n not in module._non_persistent_buffers_set
                ),
            ]
            for tensor_name, tensor in tensors:
                qualname = ".".join(filter(None, (root, name, tensor_name)))
                found[qualname] = (tuple(tensor.shape), type(module).__name__)
    return found


def safetensors_problem(path: Path) -> str | None:
    """Why the safetensors file `path` cannot be read whole (truncated, a header
    that is not one), or `None` when its size agrees with its header."""
    size = path.stat().st_size
    try:
        with path.open("rb") as file:
            length = int.from_bytes(file.read(8), "little")
            header = json.loads(file.read(length))
        end = 8 + length + max(
            (t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"),
            default=0,
        )
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        return f"{size} bytes, and no safetensors header can be read from them"
    if end > size:
        return (
            f"truncated: {size} bytes, where its header describes {end} (an "
            "interrupted download or copy?)"
        )
    return None


@dataclass(frozen=True)
class QuantisedTensors:
    """What the model's quantisation config does to checkpoint tensors before
    vLLM's loader (`AutoWeightsLoader`) hands them to parameters, as that loader
    asks it: the names its mappers give them or drop (`g_idx`, the activation order
    of GPTQ exports, which vLLM's kernels do not use; KV-cache scales moved onto
    the attention layer), and the suffixes it lets go unconsumed (KV-cache scales
    where the cache is not quantised). The strict check follows the same answers."""

    mapper: WeightsMapper | None
    """The config's cache-scale and checkpoint mappers; `None` unquantised."""
    suffixes: tuple[str, ...]
    config_name: str = ""

    @classmethod
    def of(cls, model: nn.Module) -> "QuantisedTensors":
        """The quantisation config vLLM's loader finds for `model`: the model's
        own `quant_config`, else its first child's."""
        config = next(
            (
                m.quant_config
                for m in (model, *model.children())
                if getattr(m, "quant_config", None) is not None
            ),
            None,
        )
        if config is None:
            return cls(None, ())
        return cls(
            config.get_cache_scale_mapper() | config.get_checkpoint_weight_mapper(),
            tuple(config._ignore_unexpected_suffixes),
            type(config).__name__,
        )

    def map_name(self, name: str) -> str | None:
        """`name` as the quantisation config renames it; `None` where it drops it."""
        return name if self.mapper is None else self.mapper.map_name(name)

    def may_be_unexpected(self, name: str) -> bool:
        """Whether vLLM's loader ignores `name` where no parameter consumes it."""
        return name.endswith(self.suffixes)

    @property
    def dropped(self) -> str:
        return f"tensors the quantisation config drops ({self.config_name})"

    @property
    def unexpected(self) -> str:
        return (
            f"tensors the quantisation config ({self.config_name}) lets a model "
            "without their parameter ignore"
        )


@dataclass
class CheckpointLayout:
    """How an HF checkpoint names its tensors, relative to the backend's modules.

    A checkpoint names the base model `base_prefix` (`gpt_neox`, `transformer`) or
    nothing at all (saved from the base model), the output embedding `lm_head_name`
    (`embed_out`), and may use names Transformers has since renamed."""

    base_prefix: str
    base_children: tuple[str, ...]
    lm_head_name: str | None
    lm_head_bias: bool
    renamings: list[WeightRenaming]
    ignored: list[str]
    shapes: dict[str, tuple[tuple[int, ...], str]]
    """Each tensor the HF model was built with, by the backend's name before
    stacking: its shape and its module's class (what a checkpoint tensor must fit)."""
    per_expert: dict[re.Pattern, str] = field(default_factory=dict)
    """Per-expert checkpoint tensors -> `<expert>.<fused parameter>.<shard>`, the
    part of Transformers' fused experts parameter each one is."""
    stacked: dict[str, tuple[str, ShardId]] = field(default_factory=dict)
    renamed: dict[str, str] = field(default_factory=dict)
    """Checkpoint name prefix -> the prefix of the layer that loads it instead."""
    decoder_layers: tuple[str, int] | None = None
    """The decoder stack's name under the base model and how many layers it has:
    checkpoint layers past them are multi-token-prediction layers."""
    unused: dict[str, str] = field(default_factory=dict)
    """Module name (`model.pooler`) -> why the model never uses its output: a
    checkpoint may lack its parameters (BERT's pooler, saved without it, under an
    embedding model)."""

    @classmethod
    def of(cls, hf_model: PreTrainedModel) -> "CheckpointLayout":
        output = hf_model.get_output_embeddings()
        lm_head_name = next(
            (name for name, child in hf_model.named_children() if child is output), None
        )
        conversions = get_model_conversion_mapping(hf_model)
        base_prefix, base = base_model_of(hf_model)
        return cls(
            base_prefix=base_prefix,
            base_children=tuple(name for name, _ in base.named_children()),
            lm_head_name=lm_head_name,
            lm_head_bias=getattr(output, "bias", None) is not None,
            renamings=[t for t in conversions if isinstance(t, WeightRenaming)],
            ignored=list(hf_model._keys_to_ignore_on_load_unexpected or []),
            per_expert=_per_expert_names(conversions),
            shapes=_tensors(
                [(BASE, base)]
                + ([(LM_HEAD, output)] if output is not None else [])
            ),
        )

    def add_stacked(self, stacked: dict[str, tuple[str, ShardId]]) -> None:
        """Route original linears' tensors into the shards of a fused linear."""
        self.stacked.update(stacked)

    def add_renamed(self, renamed: dict[str, str]) -> None:
        """Load the tensors under some checkpoint prefixes into other layers."""
        self.renamed.update(renamed)

    def add_unused(self, module: str, reason: str) -> None:
        """Let a checkpoint lack the parameters of `module`, whose output the
        model never uses (`reason` says why, for the log)."""
        self.unused[module] = reason

    def mapper(self) -> WeightsMapper:
        """Checkpoint names -> the backend's parameter names (`hf_to_vllm_mapper`)."""
        regex: dict[re.Pattern, str | None] = dict(self.per_expert)
        if self.base_prefix and self.base_prefix != BASE:
            regex[re.compile(rf"^{re.escape(self.base_prefix)}\.")] = f"{BASE}."
        if self.base_children:
            children = "|".join(map(re.escape, self.base_children))
            regex[re.compile(rf"^(?=(?:{children})\.)")] = f"{BASE}."
        if self.lm_head_name and self.lm_head_name != LM_HEAD:
            regex[re.compile(rf"^{re.escape(self.lm_head_name)}\.")] = f"{LM_HEAD}."
        return WeightsMapper(
            orig_to_new_renaming=self.renamings,
            orig_to_new_regex=regex,
            orig_to_new_stacked=self.stacked,
            orig_to_new_prefix=self.renamed,
        )

    def unneeded(self, name: str) -> str | None:
        """Why the checkpoint tensor `name` (before mapping) is not loaded, `None`
        when it must be."""
        if _RECOMPUTED_BUFFERS.search(name):
            return "buffers Transformers recomputes"
        if any(re.search(pattern, name) for pattern in self.ignored):
            return "tensors the model ignores (`_keys_to_ignore_on_load_unexpected`)"
        return None

    def _past_last_layer(self, name: str) -> bool:
        """Whether the mapped `name` is in a decoder layer the model does not have
        (multi-token-prediction layers follow the last one in some checkpoints)."""
        if self.decoder_layers is None:
            return False
        stack, count = self.decoder_layers
        found = re.match(rf"{BASE}\.{re.escape(stack)}\.(\d+)\.", name)
        return found is not None and int(found.group(1)) >= count

    def load(
        self,
        model: nn.Module,
        weights: Iterable[tuple[str, torch.Tensor]],
        copies: dict[str, str] | None = None,
        every_parameter: bool = True,
        source: str | None = None,
    ) -> set[str]:
        """Load `weights` into `model`; a tensor whose (mapped) name is a key of
        `copies` is also loaded into the parameter named by its value.

        Strict: a checkpoint tensor that nothing in `model` consumes is an error
        naming it, unless `unneeded` or the model's quantisation config
        (`QuantisedTensors`) says why it is not needed (logged once per reason); so
        is a tensor whose shape is not the one the model was built with,
        a fused parameter missing a shard, and (with `every_parameter`; vLLM checks
        quantised models itself) any parameter left unfilled. A checkpoint that
        cannot be read names the broken file, when `source` is its folder."""
        copies = copies or {}
        mapper = self.mapper()
        quantisation = QuantisedTensors.of(model)
        renamed = mapper.get_rename_mapper()  # names before stacking
        loadable = {n for n, _ in model.named_parameters(remove_duplicate=False)}
        # Persistent buffers are in checkpoints too (Gemma 4's per-layer
        # `layer_scalar`); `AutoWeightsLoader` loads them as it loads parameters.
        loadable |= {
            f"{prefix}{'.' if prefix else ''}{name}"
            for prefix, module in model.named_modules(remove_duplicate=False)
            for name, _ in module.named_buffers(recurse=False)
            if name not in module._non_persistent_buffers_set
        }
        elsewhere = tuple(
            f"{name}."
            for name, module in model.named_modules()
            # What another pipeline stage owns, and what vLLM's pooling adapters
            # drop from a causal LM (`--convert embed|classify`: its LM head).
            if isinstance(module, PPMissingLayer | StageMissingLayer)
        )
        # A layer with its own loader that maps checkpoint names onto its
        # parameters (vLLM's fused MoE) checks its own names; vLLM's merged
        # linears load their own parameters by name, which are checked here.
        self_loading = tuple(
            f"{name}."
            for name, module in model.named_modules()
            if name
            and callable(getattr(module, "load_weights", None))
            and not isinstance(module, LinearBase)
        )
        skipped: set[str] = set()
        shards: dict[str, set[ShardId]] = {}
        """Fused parameter -> the shards the checkpoint filled."""
        experts = _KeptStackedExperts(dict(model.named_parameters()))

        def skip(reason: str, name: str) -> None:
            if reason not in skipped:
                skipped.add(reason)
                logger.info("Not loading %s (such as %s)", reason, name)

        def needed(raw: Iterable[tuple[str, torch.Tensor]]):
            for name, tensor in _read(raw, source):
                # Ignore patterns are loose (GPT-2's "attn.bias", a regex, also finds
                # `c_attn.bias`): like Transformers, skip only what nothing consumes.
                reason = self.unneeded(name)
                if reason is not None and mapper.map_name(name) not in loadable:
                    skip(reason, name)
                    continue
                self._check_shape(name, renamed.map_name(name), tensor)
                yield name, tensor

        def checked(mapped: Iterable[tuple[str, torch.Tensor]]):
            for original, tensor in mapped:
                name = quantisation.map_name(original)
                if name is None:
                    skip(quantisation.dropped, original)
                    continue
                if name not in loadable and experts.load(name, tensor):
                    continue
                if name not in loadable and not name.startswith(
                    elsewhere + self_loading
                ):
                    if self._past_last_layer(name):
                        skip("multi-token-prediction layers past the last one", name)
                        continue
                    if quantisation.may_be_unexpected(name):
                        skip(quantisation.unexpected, name)
                        continue
                    raise ValueError(
                        f"Checkpoint tensor {name!r} (as this backend names it) is "
                        f"consumed by no parameter of {type(model).__name__}: the "
                        "model built from the config has no such weight, so loading "
                        "would silently drop it and compute something else than the "
                        "checkpoint."
                    )
                if (shard := getattr(tensor, "shard_id", None)) is not None:
                    shards.setdefault(name, set()).add(shard)
                yield name, tensor
                if name in copies:
                    yield copies[name], tensor

        loaded = AutoWeightsLoader(model).load_weights(
            checked(mapper.apply(needed(weights)))
        )
        loaded |= experts.filled()
        self._check_complete(model, loaded, shards, every_parameter)
        return loaded

    def _check_shape(
        self, name: str, renamed: str | None, tensor: torch.Tensor
    ) -> None:
        """A tensor that does not have the shape of the HF tensor it loads into is
        an error: vLLM's loaders would fail without naming it, or load a slice."""
        built = self.shapes.get(renamed) if renamed is not None else None
        if built is None or tuple(tensor.shape) == built[0]:
            return
        shape, module_class = built
        raise ValueError(
            f"Checkpoint tensor {name!r} has shape {list(tensor.shape)}, but the "
            f"model built from the config has {renamed!r} ({module_class}) of shape "
            f"{list(shape)}: the checkpoint and its config.json disagree."
        )

    def _check_complete(
        self,
        model: nn.Module,
        loaded: set[str],
        shards: dict[str, set[ShardId]],
        every_parameter: bool,
    ) -> None:
        """Every shard of each fused parameter the checkpoint filled at all, and
        (with `every_parameter`) every parameter, came from the checkpoint: vLLM
        checks neither for unquantised linears, which would keep uninitialised
        memory."""
        originals: dict[str, dict[ShardId, str]] = {}
        """Fused module name -> each shard's original module name (with dots)."""
        for original, (fused, shard) in self.stacked.items():
            for one in shard if isinstance(shard, list) else [shard]:
                originals.setdefault(fused, {})[one] = original
        missing = []
        for name, filled in shards.items():
            fused, _, tensor_name = name.rpartition(".")
            missing += [
                f"{original}{tensor_name}"
                for shard, original in originals.get(f"{fused}.", {}).items()
                if shard not in filled
            ]
        if every_parameter:
            named = dict(model.named_parameters(remove_duplicate=False))
            filled_ids = {id(named[n]) for n in loaded if n in named}
            unfilled = [
                name
                for name, param in model.named_parameters()
                if id(param) not in filled_ids
            ]
            for module, reason in self.unused.items():
                absent = [n for n in unfilled if n.startswith(f"{module}.")]
                if not absent:
                    continue
                logger.info(
                    "The checkpoint has no tensor for %s (%s): not needed, left at "
                    "zero.",
                    _listed(absent),
                    reason,
                )
                for name in absent:
                    named[name].data.zero_()
                unfilled = [n for n in unfilled if n not in absent]
            missing += unfilled
        if missing:
            raise ValueError(
                f"The checkpoint has no tensor for {_listed(missing)} (as this "
                f"backend names them), which {type(model).__name__} needs: serving "
                "it would compute with uninitialised weights."
            )


def _read(
    raw: Iterable[tuple[str, torch.Tensor]], source: str | None
) -> Iterator[tuple[str, torch.Tensor]]:
    """`raw`, with a failure to read it (a truncated or corrupt file) raised as an
    error naming the last tensor read and, in the folder `source`, the broken files."""
    tensors, last = iter(raw), None
    while True:
        try:
            name, tensor = next(tensors)
        except StopIteration:
            return
        except Exception as error:  # noqa: BLE001 - safetensors, torch, OS errors
            folder = Path(source) if source is not None else None
            broken = (
                {
                    f.name: why
                    for f in sorted(folder.glob("*.safetensors"))
                    if (why := safetensors_problem(f)) is not None
                }
                if folder is not None and folder.is_dir()
                else {}
            )
            where = "".join(f"\n  {folder / f}: {why}" for f, why in broken.items())
            after = f"after tensor {last!r}" if last else "before its first tensor"
            raise ValueError(
                f"Reading the checkpoint failed {after}: {type(error).__name__}: "
                f"{error}{where}"
            ) from error
        last = name
        yield name, tensor


class _KeptStackedExperts:
    """Loads per-expert checkpoint tensors (`<experts>.<e>.<parameter>.<shard>`, as
    `_per_expert_names` renames them) into the experts parameters Transformers
    stacks them into, where those stay Transformers' own (experts vLLM's fused MoE
    does not serve, such as Nemotron-H's non-gated ones): expert `e`'s matrix is
    `parameter[e]`, its shards (`Concatenate(dim=1)`) one after another along its
    rows, in their order."""

    _NAME = re.compile(
        r"^(?P<experts>.+)\.(?P<expert>\d+)\.(?P<parameter>[^.]+)\.(?P<shard>\d+)$"
    )

    def __init__(self, parameters: dict[str, nn.Parameter]):
        self.parameters = parameters
        self.rows: dict[str, dict[tuple[int, int], int]] = {}
        """Parameter -> the (expert, shard) matrices loaded into it, their rows."""

    def load(self, name: str, tensor: torch.Tensor) -> bool:
        """Load `tensor` if `name` is a part of a kept stacked experts parameter."""
        found = self._NAME.match(name)
        if found is None:
            return False
        target = f"{found['experts']}.{found['parameter']}"
        parameter = self.parameters.get(target)
        if parameter is None or parameter.ndim != 3:
            return False
        expert, shard = int(found["expert"]), int(found["shard"])
        rows = tensor.shape[0]
        start = shard * rows
        if tensor.ndim != 2 or expert >= parameter.shape[0] or (
            start + rows > parameter.shape[1] or tensor.shape[1] != parameter.shape[2]
        ):
            raise ValueError(
                f"Checkpoint tensor {name!r} of shape {list(tensor.shape)} does not "
                f"fit expert {expert}'s shard {shard} of {target!r} "
                f"{list(parameter.shape)}."
            )
        parameter.data[expert, start : start + rows].copy_(tensor)
        self.rows.setdefault(target, {})[(expert, shard)] = rows
        return True

    def filled(self) -> set[str]:
        """The parameters whose every expert's rows the checkpoint filled."""
        full = set()
        for target, parts in self.rows.items():
            parameter = self.parameters[target]
            per_expert = [0] * parameter.shape[0]
            for (expert, _), rows in parts.items():
                per_expert[expert] += rows
            if all(rows == parameter.shape[1] for rows in per_expert):
                full.add(target)
        return full


def _per_expert_names(conversions: list) -> dict[re.Pattern, str]:
    """Renames for per-expert checkpoint tensors that Transformers stacks into one
    experts parameter (`MergeModulelist(dim=0)`, then for several sources
    `Concatenate(dim=1)` in their order): `experts.<e>.gate_proj.weight` ->
    `experts.<e>.gate_up_proj.0`. Other conversions are not per-expert stacks."""
    renames: dict[re.Pattern, str] = {}
    for conversion in conversions:
        if not isinstance(conversion, WeightConverter):
            continue
        operations = [(type(op), getattr(op, "dim", None)) for op in conversion.operations]
        stacked = [(MergeModulelist, 0)]
        if operations not in (stacked, [*stacked, (Concatenate, 1)]):
            continue
        (target,) = conversion.target_patterns
        parameter = target.rpartition(".")[2]
        for shard, source in enumerate(conversion.source_patterns):
            before, star, after = source.partition("*")
            if not star or not before.endswith(".") or not after.startswith("."):
                continue
            pattern = re.compile(f"{re.escape(before)}(\\d+){re.escape(after)}$")
            renames[pattern] = f"{before}\\1.{parameter}.{shard}"
    return renames
