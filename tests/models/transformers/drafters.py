# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Tiny EAGLE drafters for a tiny target, in the checkpoint layout vLLM's drafters
load (`llama_eagle.py`, `llama_eagle3.py`): a one-layer Llama config and seeded random
weights, every 1-D parameter perturbed. They share the target's input embedding (and,
for EAGLE-1, its LM head): the checkpoints hold neither, as released drafters do.

Random drafters are rarely right, which is the point of the tests that use them:
speculation must never change the target's greedy tokens, however bad the drafts."""

from __future__ import annotations

import json
from pathlib import Path

AUX_LAYERS = (0, 2, 4)
"""The target layers an EAGLE-3 drafter here reads (of 4): the embeddings, a middle
layer and the last layer's output. vLLM's default, (2, N // 2, N - 3), is (2, 2, 1)
for 4 layers, two distinct layers for a drafter that expects three. vLLM's stock
backend cannot hand over state 0 (`KeyError: -1` at load): `layers=(1, 2, 4)`
compares with it."""


def _config(target: dict, **extra) -> dict:
    return dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_size=target["hidden_size"],
        intermediate_size=256,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=target["vocab_size"],
        max_position_embeddings=target["max_position_embeddings"],
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        torch_dtype="float32",
        **extra,
    )


def _random(shapes: dict[str, tuple[int, ...]], seed: int) -> dict:
    import torch

    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in shapes.items():
        if len(shape) == 1:  # norm weights: around 1, perturbed
            tensors[name] = 1 + 0.1 * torch.randn(shape, generator=generator)
        else:
            tensors[name] = 0.1 * torch.randn(shape, generator=generator)
    return tensors


def _layer(prefix: str, hidden: int, inputs: int) -> dict[str, tuple[int, ...]]:
    """A Llama decoder layer's matrices; `inputs` is what q/k/v read."""
    return {
        f"{prefix}.self_attn.q_proj.weight": (4 * 32, inputs),
        f"{prefix}.self_attn.k_proj.weight": (2 * 32, inputs),
        f"{prefix}.self_attn.v_proj.weight": (2 * 32, inputs),
        f"{prefix}.self_attn.o_proj.weight": (hidden, 4 * 32),
        f"{prefix}.mlp.gate_proj.weight": (256, hidden),
        f"{prefix}.mlp.up_proj.weight": (256, hidden),
        f"{prefix}.mlp.down_proj.weight": (hidden, 256),
        f"{prefix}.post_attention_layernorm.weight": (hidden,),
    }


def build(
    target: Path,
    method: str,
    out: Path,
    seed: int = 0,
    layers: tuple[int, ...] = AUX_LAYERS,
) -> Path:
    """An EAGLE (`method="eagle"`) or EAGLE-3 (`"eagle3"`, reading the target's
    states at `layers`) drafter for `target`."""
    from safetensors.torch import save_file

    config = json.loads((target / "config.json").read_text())
    hidden = config["hidden_size"]
    if method == "eagle":
        # One layer over fc([embedding, hidden state]); layer 0 has no input norm,
        # and no final norm: the target's LM head reads its output.
        shapes = {
            "fc.weight": (hidden, 2 * hidden),
            **_layer("layers.0", hidden, hidden),
        }
        draft = _config(config)
    elif method == "eagle3":
        # fc(the target's states at `layers`), then one layer over the normed
        # [embedding, state], a final norm and the drafter's own LM head.
        shapes = {
            "fc.weight": (hidden, len(layers) * hidden),
            **_layer("midlayer", hidden, 2 * hidden),
            "midlayer.input_layernorm.weight": (hidden,),
            "midlayer.hidden_norm.weight": (hidden,),
            "norm.weight": (hidden,),
            "lm_head.weight": (config["vocab_size"], hidden),
        }
        draft = _config(
            config,
            draft_vocab_size=config["vocab_size"],
            eagle_config={"eagle_aux_hidden_state_layer_ids": list(layers)},
        )
    else:
        raise ValueError(f"no tiny drafter for method {method!r}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(draft, indent=2))
    save_file(_random(shapes, seed), str(out / "model.safetensors"))
    return out
