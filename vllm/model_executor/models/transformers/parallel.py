# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Pipeline-parallel plumbing: which decoder layers this stage builds.

(Tensor parallelism is per linear: the fusers and the model's TP plan decide it.)"""

from collections.abc import Collection

from torch import nn
from transformers import PreTrainedConfig

from vllm.distributed.parallel_state import GroupCoordinator
from vllm.distributed.utils import get_pp_indices
from vllm.model_executor.models.utils import PPMissingLayer


def decoder_layers(
    base_model: nn.Module,
    text_config: PreTrainedConfig,
    outside: Collection[str] = (),
) -> tuple[str, nn.ModuleList]:
    """The base model's stack of decoder layers: the `ModuleList` with one entry per
    hidden layer (`layers`, `decoder.layers`, `h`), not under the modules named in
    `outside` (a vision tower's own stack may have as many layers)."""
    num_layers = text_config.num_hidden_layers
    stacks = [
        (name, module)
        for name, module in base_model.named_modules()
        if isinstance(module, nn.ModuleList)
        and len(module) == num_layers
        and not any(name == o or name.startswith(f"{o}.") for o in outside)
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


def drop_other_stages(
    base_model: nn.Module,
    layers_name: str,
    layer_range: range,
    pp_group: GroupCoordinator,
    tie_word_embeddings: bool,
) -> None:
    """Replace what other pipeline stages own with `PPMissingLayer` (an identity).

    The modules declared before the stack (embeddings) stay on the first stage, and on
    the last one too when the LM head is tied to them; those after it (final norm) stay
    on the last stage. Parameter-free modules (rotary embeddings) stay everywhere."""
    if pp_group.world_size == 1:
        return
    layers = base_model.get_submodule(layers_name)
    for index in range(len(layers)):
        if index not in layer_range:
            layers[index] = PPMissingLayer()
    top = layers_name.split(".")[0]
    names = [name for name, _ in base_model.named_children()]
    for position, name in enumerate(names):
        child = base_model.get_submodule(name)
        if name == top or next(child.parameters(), None) is None:
            continue
        before_stack = position < names.index(top)
        keep = (
            (pp_group.is_first_rank or (tie_word_embeddings and pp_group.is_last_rank))
            if before_stack
            else pp_group.is_last_rank
        )
        if not keep:
            setattr(base_model, name, PPMissingLayer())
