# SPDX-License-Identifier: Apache-2.0
"""Loading a checkpoint folder through vLLM's own loader (as the engine's worker
does, in-process): what is loaded, and each broken checkpoint refused with the tensor
or file named and why."""

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from configs import small_config
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from vllm.config import LoadConfig, set_current_vllm_config
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
from vllm.model_executor.models.transformers.loading import safetensors_problem

FILE = "model.safetensors"


@pytest.fixture
def checkpoint(tmp_path: Path) -> dict[str, torch.Tensor]:
    """A random small Llama saved in `tmp_path` (where `build_backend` builds from);
    returns its tensors."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(small_config("llama"))
    model.save_pretrained(tmp_path)
    return _read(tmp_path / FILE)


def _read(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of `path`, copied out of its memory map (the tests rewrite it)."""
    return {name: t.clone() for name, t in load_file(path).items()}


def _replace(path: Path, write: Callable[[Path], None]) -> None:
    """Write `path` anew through `write` (a new file, so no memory map of the old one
    sees it change)."""
    staged = path.with_suffix(".new")
    write(staged)
    staged.replace(path)


@pytest.fixture
def load(build_backend, tmp_path: Path) -> Callable[..., torch.nn.Module]:
    """`load(edit)`: rewrite the checkpoint's tensors with `edit` (a dict, in place;
    no edit: the file as it is), then build the backend and load the folder with
    vLLM's safetensors loader."""

    def run(edit: Callable[[dict[str, torch.Tensor]], None] | None = None):
        if edit is not None:
            tensors = _read(tmp_path / FILE)
            edit(tensors)
            _replace(
                tmp_path / FILE,
                lambda path: save_file(tensors, path, metadata={"format": "pt"}),
            )
        model = build_backend(small_config("llama"))
        config = LoadConfig(load_format="safetensors")
        with set_current_vllm_config(model.vllm_config):
            DefaultModelLoader(config).load_weights(
                model, model.vllm_config.model_config
            )
        return model

    return run


def test_a_whole_checkpoint_loads_every_tensor_where_it_belongs(checkpoint, load):
    model = load()
    layer = model.model.layers[1]
    q, k, v = layer.self_attn.qkv_proj.weight.split(
        layer.self_attn.qkv_proj.output_partition_sizes
    )
    hf = "model.layers.1.self_attn"
    torch.testing.assert_close(k, checkpoint[f"{hf}.k_proj.weight"], rtol=0, atol=0)
    torch.testing.assert_close(
        layer.self_attn.o_proj.weight, checkpoint[f"{hf}.o_proj.weight"], rtol=0, atol=0
    )
    torch.testing.assert_close(
        model.lm_head.weight, checkpoint["lm_head.weight"], rtol=0, atol=0
    )


@pytest.mark.parametrize(
    "dropped",
    [
        # One shard of a fused linear: vLLM's loader sees the fused parameter
        # loaded (by the gate shard) and would keep uninitialised memory for `up`.
        ["model.layers.1.mlp.up_proj.weight"],
        # Whole parameters: vLLM exempts unquantised linears and embeddings from its
        # own check, so these loaded without a word.
        ["model.layers.1.self_attn.o_proj.weight", "model.embed_tokens.weight"],
    ],
)
def test_a_tensor_missing_from_the_checkpoint_is_an_error_naming_it(
    checkpoint, load, dropped
):
    def drop(tensors):
        for name in dropped:
            del tensors[name]

    with pytest.raises(ValueError, match="has no tensor for") as error:
        load(drop)
    for name in dropped:
        assert repr(name) in str(error.value)
    assert "uninitialised" in str(error.value)


@pytest.mark.parametrize(
    ("name", "shape"),
    [
        # Narrower than built: vLLM's loader fails without naming the tensor.
        ("model.layers.1.self_attn.k_proj.weight", (32, 128)),
        # Wider than built: vLLM's loaders narrow it and load a slice, silently.
        ("model.layers.1.self_attn.k_proj.weight", (128, 128)),
        ("model.layers.1.self_attn.o_proj.weight", (128, 256)),
        ("model.norm.weight", (64,)),
    ],
)
def test_a_tensor_of_the_wrong_shape_is_an_error_naming_it_and_both_shapes(
    checkpoint, load, name, shape
):
    built = list(checkpoint[name].shape)

    def reshape(tensors):
        tensors[name] = torch.zeros(shape)

    with pytest.raises(ValueError) as error:
        load(reshape)
    message = str(error.value)
    assert f"{name!r} has shape {list(shape)}" in message
    assert f"of shape {built}" in message
    assert "disagree" in message


def test_a_truncated_safetensors_file_is_an_error_naming_the_file(
    checkpoint, load, tmp_path
):
    # Cut in the tensor data. (A cut in the header fails earlier, in vLLM's own
    # config checks, which read the header for the model's size and dtype.)
    path = tmp_path / FILE
    data = path.read_bytes()
    _replace(path, lambda new: new.write_bytes(data[: len(data) // 2]))
    with pytest.raises(ValueError) as error:
        load()
    message = str(error.value)
    assert message.startswith("Reading the checkpoint failed")
    assert f"{path}: truncated: {len(data) // 2} bytes, where its header" in message


def test_a_file_cut_in_its_header_is_named_as_unreadable(checkpoint, tmp_path):
    path = tmp_path / FILE
    assert safetensors_problem(path) is None
    _replace(path, lambda new: new.write_bytes(path.read_bytes()[:100]))
    assert safetensors_problem(path) == (
        "100 bytes, and no safetensors header can be read from them"
    )
