# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Fusion coverage of this backend beside vLLM's stock backend, on one sweep.

For every causal-LM `model_type` Transformers knows: a two-layer config, the model
built on `meta` with its attention dispatched to `"vllm"` (as the backend builds it),
and the plan each backend's fuser registry makes for it. Both registries keep the same
contract, `FusionPlan(model, vllm_config)[module]` -> the fusers that instance takes, so
the two are counted the same way: a model type counts for a column when at least one
of its modules takes a fuser of that kind. Each backend is swept in its own
subprocess (`VLLM_TRANSFORMERS_BACKEND=project|stock`).

    bash scripts/coverage.sh              # the table for the README
    bash scripts/coverage.sh --json       # per model type, for both backends

The `sweep OUT` form is internal (one backend, in a subprocess).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BACKENDS = ("project", "stock")
KINDS = {
    "AttentionFuser": "attention",
    "QKVFuser": "qkv",
    "PackedQKVFuser": "qkv",
    "MLAFuser": "qkv",
    "GLUFuser": "glu",
    "RMSNormFuser": "rms_norm",
}
"""Fuser class (the same names in both registries) -> the column it counts for; q/k/v
counts separate, packed and latent projections alike."""
COLUMNS = ("attention", "qkv", "glu", "rms_norm")


def _vllm_config(config):
    """A `VllmConfig` for `config`: vLLM's checks on a placeholder where its registry
    refuses the model (MoE, multimodal: the fusers still apply to their modules)."""
    from transformers import AutoConfig

    from vllm.config import DeviceConfig, LoadConfig, ModelConfig, VllmConfig

    with tempfile.TemporaryDirectory() as folder:
        config.save_pretrained(folder)
        try:
            model_config = ModelConfig(
                model=folder, model_impl="transformers", skip_tokenizer_init=True
            )
        except Exception:  # noqa: BLE001 - vLLM's checks raise many kinds
            # As the report's placeholder, which the stock backend cannot import.
            AutoConfig.for_model(
                "llama",
                num_hidden_layers=1,
                hidden_size=64,
                intermediate_size=64,
                num_attention_heads=2,
                vocab_size=64,
                architectures=["LlamaForCausalLM"],
            ).save_pretrained(folder)
            model_config = ModelConfig(
                model=folder, model_impl="transformers", skip_tokenizer_init=True
            )
            model_config.hf_config = config
            model_config.hf_text_config = config.get_text_config()
    return VllmConfig(
        model_config=model_config,
        device_config=DeviceConfig("cpu"),
        load_config=LoadConfig(load_format="dummy"),
    )


def _kinds(model_type: str) -> list[str]:
    """The kinds of fusion the active backend's plan takes in `model_type`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    )

    from vllm.config import set_current_vllm_config
    from vllm.model_executor.models.transformers.plan import FusionPlan

    config = AutoConfig.for_model(model_type, num_hidden_layers=2)
    config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]]
    vllm_config = _vllm_config(config)
    model_config = vllm_config.model_config
    # Only the text model dispatches to vLLM, as both backends build it.
    model_config.hf_text_config._attn_implementation = (
        "vllm_mla" if model_config.use_mla else "vllm"
    )
    with set_current_vllm_config(vllm_config), torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config.hf_config)
        plan = FusionPlan(model, vllm_config)
        return sorted(
            {
                KINDS[type(fuser).__name__]
                for module in model.modules()
                for fuser in plan[module]
                if type(fuser).__name__ in KINDS
            }
        )


def sweep(out: Path) -> None:
    """Sweep every causal-LM model type with the active backend; write the rows."""
    import logging

    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    )

    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import (
        init_distributed_environment,
        initialize_model_parallel,
    )

    logging.getLogger("vllm").setLevel(logging.ERROR)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    # The world-size-1 process group vLLM's parallel layers need.
    with (
        tempfile.NamedTemporaryFile(suffix=".init") as rendezvous,
        set_current_vllm_config(VllmConfig()),
    ):
        init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            distributed_init_method=f"file://{rendezvous.name}",
            backend="gloo",
        )
        initialize_model_parallel(1, 1)
    rows: dict[str, list[str] | str] = {}
    for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        try:
            rows[model_type] = _kinds(model_type)
        except Exception as error:  # noqa: BLE001 - counted as nothing fused, with why
            rows[model_type] = f"{type(error).__name__}: {str(error)[:200]}"
    out.write_text(json.dumps(rows, indent=1))


def _run(backend: str) -> dict[str, list[str] | str]:
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "rows.json"
        env = {**os.environ, "VLLM_TRANSFORMERS_BACKEND": backend}
        subprocess.run(
            [sys.executable, __file__, "sweep", str(out)], env=env, check=True
        )
        return json.loads(out.read_text())


def main(argv: list[str]) -> None:
    if argv[:1] == ["sweep"]:
        sweep(Path(argv[1]))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="per model type")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    results = {backend: _run(backend) for backend in BACKENDS}
    if args.json:
        print(json.dumps(results, indent=1))
        return
    types = len(results["project"])
    counts = {
        backend: {
            column: sum(
                isinstance(kinds, list) and column in kinds for kinds in rows.values()
            )
            for column in COLUMNS
        }
        for backend, rows in results.items()
    }
    print(
        f"{types} causal-LM model types, two-layer configs on `meta` "
        f"({time.perf_counter() - started:.0f} s):\n"
    )
    print("| model types where ... | this backend | stock backend |")
    print("|---|---:|---:|")
    for column in COLUMNS:
        label = {
            "attention": "attention dispatches to vLLM",
            "qkv": "q/k/v fused (separate, packed or latent)",
            "glu": "gate/up fused",
            "rms_norm": "RMSNorm on vLLM's kernel",
        }[column]
        print(f"| {label} | {counts['project'][column]} | {counts['stock'][column]} |")
    totals = {b: sum(counts[b].values()) for b in BACKENDS}
    print(f"| total | {totals['project']} | {totals['stock']} |")


if __name__ == "__main__":
    main(sys.argv[1:])
