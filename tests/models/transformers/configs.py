# SPDX-License-Identifier: Apache-2.0
"""Small configs for building models on `meta` or in-process, without weights."""

from pathlib import Path

from transformers import AutoConfig, PreTrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

# Small enough to build in a second, with a head size the CPU attention supports.
SMALL = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    max_position_embeddings=256,
)


def small_config(model_type: str, **overrides) -> PreTrainedConfig:
    """A small config of `model_type`, naming its causal-LM class as a checkpoint would."""
    architecture = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]
    return AutoConfig.for_model(
        model_type, **{**SMALL, "architectures": [architecture], **overrides}
    )


def repository_code(folder: Path, config: PreTrainedConfig) -> Path:
    """Make `folder` a checkpoint whose architecture is repository code: `config` with
    an `auto_map` naming `marker.MarkerConfig` / `marker.MarkerForCausalLM`, and a
    `marker.py` that writes the returned marker file when anything executes it."""
    folder.mkdir(parents=True, exist_ok=True)
    marker = folder / "EXECUTED"
    (folder / "marker.py").write_text(
        f"from pathlib import Path\n\nPath({str(marker)!r}).write_text('ran')\n"
    )
    config.architectures = ["MarkerForCausalLM"]
    config.auto_map = {
        "AutoConfig": "marker.MarkerConfig",
        "AutoModelForCausalLM": "marker.MarkerForCausalLM",
    }
    config.save_pretrained(folder)
    return marker
