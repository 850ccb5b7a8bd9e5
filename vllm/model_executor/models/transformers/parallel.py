# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Pipeline-parallel plumbing: which decoder layers this stage builds.

(Tensor parallelism is per linear: the fusers and the model's TP plan decide it.)"""

import ast
from collections.abc import Collection

from torch import nn
from transformers import PreTrainedConfig

from vllm.distributed.parallel_state import GroupCoordinator
from vllm.distributed.utils import get_pp_indices
from vllm.model_executor.models.transformers.rewriting import forward_source
from vllm.model_executor.models.utils import PPMissingLayer


def decoder_layers(
    base_model: nn.Module,
    text_config: PreTrainedConfig,
    outside: Collection[str] = (),
) -> tuple[str, nn.ModuleList]:
    """The base model's stack of decoder layers: the `ModuleList` with one entry per
    hidden layer (`layers`, `decoder.layers`, `h`), not under the modules named in
    `outside` (a vision tower's own stack may have as many layers) nor inside
    another such list (StableLM's per-head norms, as many as its layers)."""
    num_layers = text_config.num_hidden_layers
    lists = [
        (name, module)
        for name, module in base_model.named_modules()
        if isinstance(module, nn.ModuleList)
        and len(module) == num_layers
        and not any(name == o or name.startswith(f"{o}.") for o in outside)
    ]
    stacks = [
        (name, module)
        for name, module in lists
        if not any(name.startswith(f"{outer}.") for outer, _ in lists)
    ]
    if len(stacks) != 1:
        # Name the lists it does hold: a stack with two attentions per entry
        # (LongCat Flash: num_hidden_layers / 2 entries) is told apart from none.
        lists = [
            (name, len(module))
            for name, module in base_model.named_modules()
            if isinstance(module, nn.ModuleList) and len(module) != num_layers
        ]
        others = [
            f"{name} ({length} entries)"
            for name, length in lists
            if not any(name.startswith(f"{outer}.") for outer, _ in lists)
        ]
        found = ", ".join(name for name, _ in stacks) or "none"
        held = f" (its other ModuleLists: {', '.join(others)})" if others else ""
        raise ValueError(
            f"{type(base_model).__name__} must hold exactly one ModuleList of "
            f"num_hidden_layers={num_layers} decoder layers; found {found}{held}."
        )
    return stacks[0]


def stage_layer_range(
    text_config: PreTrainedConfig, pp_group: GroupCoordinator
) -> range:
    """The decoder layers this pipeline stage builds."""
    start, end = get_pp_indices(
        text_config.num_hidden_layers, pp_group.rank_in_group, pp_group.world_size
    )
    return range(start, end)


def _first_reads(module: nn.Module) -> dict[str, tuple[int, int]]:
    """Where `module`'s forward first reads each `self.<name>` (line, column)."""
    source = forward_source(type(module))
    if source is None:
        return {}
    reads: dict[str, tuple[int, int]] = {}
    for node in ast.walk(source.tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "self"
        ):
            where = (node.lineno, node.col_offset)
            reads[node.attr] = min(reads.get(node.attr, where), where)
    return reads


def drop_other_stages(
    base_model: nn.Module,
    layers_name: str,
    layer_range: range,
    pp_group: GroupCoordinator,
    tie_word_embeddings: bool,
    everywhere: Collection[str] = (),
) -> None:
    """Replace what other pipeline stages own with `PPMissingLayer` (an identity).

    At every level from the base model down to the stack (a vision-language model's
    `language_model.layers`, OPT's `decoder.layers`), the modules that run before
    the path to the stack (embeddings, a vision tower) stay on the first stage, the
    input embedding on the last one too when the LM head is tied to it; those that
    run after it (the final norm) stay on the last stage. What runs first is where
    the level's forward first reads each module (OPT declares its final norm
    before its layers), else the order they are declared in. Parameter-free
    modules (rotary embeddings) stay everywhere, and so do the modules named in
    `everywhere` (a vision tower: vLLM's runner profiles the encoder on every
    stage, and its native models build their towers on each)."""
    if pp_group.world_size == 1:
        return
    layers = base_model.get_submodule(layers_name)
    for index in range(len(layers)):
        if index not in layer_range:
            layers[index] = PPMissingLayer()
    embedding = base_model.get_input_embeddings()
    path = layers_name.split(".")
    for depth, on_path in enumerate(path):
        holder = base_model.get_submodule(".".join(path[:depth]))
        names = [name for name, _ in holder.named_children()]
        reads = _first_reads(holder)
        for name in names:
            child = holder.get_submodule(name)
            if (
                name == on_path
                or next(child.parameters(), None) is None
                or ".".join([*path[:depth], name]) in everywhere
            ):
                continue
            after = (
                reads[name] > reads[on_path]
                if name in reads and on_path in reads
                else names.index(name) > names.index(on_path)
            )
            if after:
                keep = pp_group.is_last_rank
            else:
                tied = tie_word_embeddings and child is embedding
                keep = pp_group.is_first_rank or (tied and pp_group.is_last_rank)
            if not keep:
                setattr(holder, name, PPMissingLayer())
