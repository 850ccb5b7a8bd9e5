# SPDX-License-Identifier: Apache-2.0
"""Pipeline parallel: which layers and modules each stage builds (on `meta`), and
end to end on the CPU engine at PP=2 (compiled: vLLM's runner fails eager PP on this
engine, for native models too)."""

import sys
from pathlib import Path
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tiny  # noqa: E402


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


def test_lists_inside_the_stack_are_not_taken_for_it():
    """StableLM's q/k norms per head are ModuleLists, one of them as long as the
    stack here (4 heads, 4 layers)."""
    config = small_config(
        "stablelm", num_hidden_layers=4, num_attention_heads=4, qk_layernorm=True
    )
    with torch.device("meta"):
        model = AutoModel.from_config(config)
    assert decoder_layers(model, config)[0] == "layers"


def test_last_stage_keeps_the_embedding_when_the_head_is_tied():
    _, present, _ = built_on(1, 2, tie=True)
    assert present == {"embed_tokens", "norm"}


def _stages(
    model, text_config, rank: int, everywhere: tuple[str, ...] = ()
) -> set[str]:
    """The modules with parameters that `rank` of 2 drops, outside the stack."""
    name, _ = decoder_layers(model, text_config)
    layer_range = stage_layer_range(text_config, stage(rank, 2))
    drop_other_stages(model, name, layer_range, stage(rank, 2), False, everywhere)
    return {
        n
        for n, m in model.named_modules()
        if isinstance(m, PPMissingLayer) and not n.startswith(name)
    }


def test_a_norm_declared_before_the_layers_runs_on_the_last_stage():
    """OPT declares its final norm before its layers, one level down
    (`decoder.layers`): where the forward reads it decides, not the declaration."""
    config = small_config("opt", num_hidden_layers=4)
    dropped = []
    for rank in (0, 1):
        with torch.device("meta"):
            model = AutoModel.from_config(config)
        dropped.append(_stages(model, config, rank))
    assert dropped == [
        {"decoder.final_layer_norm"},
        {"decoder.embed_tokens", "decoder.embed_positions"},
    ]


def test_a_vision_tower_stays_on_every_stage_and_the_decoder_embedding_on_the_first():
    """A vision-language model's stack is `language_model.layers`: its norm runs on
    the last stage only (at the end of every stage it would normalise what the next
    one takes) and the text embedding on the first; the tower and projector, kept
    with Transformers, stay on every stage (vLLM runs them on the first stage, but
    profiles them on each)."""
    import tiny_multimodal

    config = tiny_multimodal.config(tiny_multimodal.RECIPES["llava"])
    dropped = []
    for rank in (0, 1):
        with torch.device("meta"):
            model = AutoModel.from_config(config)
        kept = ("vision_tower", "multi_modal_projector")
        dropped.append(_stages(model, config.text_config, rank, kept))
    assert dropped == [{"language_model.norm"}, {"language_model.embed_tokens"}]


def test_single_stage_keeps_everything():
    kept, present, _ = built_on(0, 1)
    assert kept == [0, 1, 2, 3, 4] and present == {"embed_tokens", "norm"}


# --- the engine --------------------------------------------------------------------

E2E_IMPL = tiny.e2e_impl()

PIPELINE_PARALLEL = ["olmoe", "gemma2"]
"""A mixture of experts (OLMoE: experts on vLLM's fused MoE, q/k norms over the whole
projection width); a dense model with sliding and full layers (Gemma 2: attention and
final soft-caps, tied embeddings, so the last stage keeps the input embedding for its
head). Aria (a vision tower before an MoE decoder) runs at PP=2 in
`test_routed_by_vllm_034.py`."""


@pytest.mark.engine
@pytest.mark.parametrize("model_type", PIPELINE_PARALLEL)
def test_pipeline_parallel_equals_transformers_and_one_stage(model_type):
    """PP=2, compiled, a worker process per stage bound to its own core: the same
    tokens and log-probabilities as Transformers and as PP=1; each stage attends
    with its own half of the layers."""
    run = tiny.check_pipeline_parallel(model_type, E2E_IMPL)
    if E2E_IMPL == "project":
        stages = [sorted(a["layer_name"] for a in w["attached"]) for w in run.probe]
        assert stages == [
            [f"model.layers.{i}.self_attn.attn" for i in layers]
            for layers in ([0, 1], [2, 3])
        ]
