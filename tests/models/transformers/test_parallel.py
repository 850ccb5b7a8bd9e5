# SPDX-License-Identifier: Apache-2.0
"""Pipeline parallel on `meta`: which layers each stage builds (the CPU engine cannot
run PP, DESIGN §6, so the split is checked here)."""

from types import SimpleNamespace

import pytest
import torch
from configs import small_config
from transformers import AutoModel

from vllm.model_executor.models.transformers.parallel import (
    decoder_layers,
    drop_other_stages,
    stage_layer_range,
)
from vllm.model_executor.models.utils import PPMissingLayer


def stage(rank: int, size: int) -> SimpleNamespace:
    return SimpleNamespace(
        rank_in_group=rank,
        world_size=size,
        is_first_rank=rank == 0,
        is_last_rank=rank == size - 1,
    )


def built_on(rank: int, size: int, tie: bool = False):
    config = small_config("llama", num_hidden_layers=5)
    with torch.device("meta"):
        model = AutoModel.from_config(config)
    name, layers = decoder_layers(model, config)
    layer_range = stage_layer_range(config, stage(rank, size))
    drop_other_stages(model, name, layer_range, stage(rank, size), tie)
    kept = [
        i for i, layer in enumerate(layers) if not isinstance(layer, PPMissingLayer)
    ]
    present = {
        n
        for n in ("embed_tokens", "norm")
        if not isinstance(getattr(model, n), PPMissingLayer)
    }
    return kept, present, layer_range


@pytest.mark.parametrize(
    ("rank", "layers", "present"),
    [(0, [0, 1, 2], {"embed_tokens"}), (1, [3, 4], {"norm"})],
)
def test_each_stage_builds_its_layers_and_the_modules_around_them(
    rank, layers, present
):
    kept, found, layer_range = built_on(rank, 2)
    assert kept == layers == list(layer_range)
    assert found == present


def test_a_stack_of_another_length_is_refused_naming_the_lists_it_holds():
    """LongCat Flash holds num_hidden_layers / 2 entries, two attentions each."""
    config = small_config("longcat_flash", num_hidden_layers=4)
    with torch.device("meta"):
        model = AutoModel.from_config(config)
    with pytest.raises(ValueError) as error:
        decoder_layers(model, config)
    assert "num_hidden_layers=4 decoder layers; found none" in str(error.value)
    assert "layers (2 entries)" in str(error.value)


def test_last_stage_keeps_the_embedding_when_the_head_is_tied():
    _, present, _ = built_on(1, 2, tie=True)
    assert present == {"embed_tokens", "norm"}


def test_single_stage_keeps_everything():
    kept, present, _ = built_on(0, 1)
    assert kept == [0, 1, 2, 3, 4] and present == {"embed_tokens", "norm"}
