# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""LoRA: an adapter in PEFT's format, served through the fused layers.

The adapter is written here with `peft` on the tiny Llama checkpoint, targeting
q/k/v/o and gate/up/down, so vLLM has to split it over the fused `qkv_proj` and
`gate_up_proj` by `packed_modules_mapping`. PEFT starts B at zero (a no-op); it is drawn
at random here so the adapter changes the output. With the adapter, the engine's greedy
tokens and logprobs must equal Transformers + PEFT's.

Every prompt runs with the adapter. Base requests batched beside an adapter's are wrong
on the CPU engine with the default `max_loras=1` (vLLM's CPU LoRA ops index the slots
with -1 for "no adapter", which wraps to the last slot: the adapter); `max_loras=2`
serves them right. That is vLLM's, whichever model implementation runs.

`E2E_IMPL` (as in `test_end_to_end.py`) picks what the engine test runs: `project`,
`stock` or `native`.
"""

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from vllm.lora.utils import get_supported_lora_modules, process_packed_modules_mapping
from vllm.model_executor.models import supports_lora
from vllm.model_executor.models.transformers.base import Base

import tiny
from configs import small_config
from tiny import checkpoint, compare, report

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANK = 8
B_STD = 0.1
"""Large enough to move tokens, small enough to keep the greedy paths well separated."""
SEED = 5
"""The first from 0 whose greedy paths keep `tiny.MIN_MARGIN` (checked below)."""


@dataclass(frozen=True)
class Adapter:
    path: Path
    reference: list[tiny.Completion]
    """Transformers + PEFT's greedy completions of `tiny.PROMPTS` with the adapter."""


@pytest.fixture(scope="module")
def adapter(tmp_path_factory: pytest.TempPathFactory) -> Adapter:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = checkpoint("llama")
    torch.manual_seed(SEED)  # PEFT's A matrices
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(
            str(base), dtype=torch.float32, attn_implementation="eager"
        ),
        LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=TARGETS),
    ).eval()
    generator = torch.Generator().manual_seed(SEED + 1)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * B_STD)
    path = tmp_path_factory.mktemp("lora") / "adapter"
    model.save_pretrained(path)
    reference = tiny.greedy(model, tiny.encode(base), tiny.MAX_TOKENS)
    return Adapter(path, reference)


# --- what vLLM's LoRA manager reads (no engine) ---------------------------------------


def test_backend_classes_declare_lora_support():
    import vllm.model_executor.models.transformers as backend

    # vLLM's registry reads it from the class, before building anything.
    assert supports_lora(backend.TransformersForCausalLM)


def test_lora_manager_expects_the_names_a_llama_adapter_uses(build_backend):
    model = build_backend(small_config("llama"))
    assert supports_lora(model)
    assert model.embedding_modules == {
        "embed_tokens": "input_embeddings",
        "lm_head": "output_embeddings",
    }
    # How the manager derives the adapter modules it accepts (`_load_adapter`).
    packed = process_packed_modules_mapping(model)
    expected = {
        original
        for module in get_supported_lora_modules(model)
        for original in packed.get(module, [module])
    }
    assert expected == {*TARGETS, "embed_tokens", "lm_head"}


@pytest.mark.parametrize(
    "model_type, embedding",
    [("gpt_neox", {"embed_in": "input_embeddings"}), ("gemma2", {})],
    ids=["own-name", "scaled-embedding-stays-hf"],
)
def test_embedding_modules_follow_the_model(build_backend, model_type, embedding):
    """The input embedding under the model's own name, where vLLM's LoRA can wrap it:
    Gemma's scaled embedding keeps its HF forward, so it is left out."""
    model = build_backend(small_config(model_type))
    assert model.embedding_modules == {**embedding, "lm_head": "output_embeddings"}


def test_packed_mapping_is_known_before_layers_are_built(build_backend, monkeypatch):
    seen: list[dict[str, list[str]]] = []
    apply = Base.apply

    def spy(self, tp_plan):
        seen.append(dict(self.packed_modules_mapping))
        return apply(self, tp_plan)

    monkeypatch.setattr(Base, "apply", spy)
    build_backend(small_config("llama"))
    assert seen == [
        {
            "qkv_proj": ["q_proj", "k_proj", "v_proj"],
            "gate_up_proj": ["gate_proj", "up_proj"],
        }
    ]


# --- the reference itself (no engine) -------------------------------------------------


def test_adapter_changes_the_output_and_stays_well_separated(adapter):
    base = tiny.cached_reference("llama")
    assert any(a.token_ids != b.token_ids for a, b in zip(base, adapter.reference))
    margin = min(min(c.margins) for c in adapter.reference)
    assert margin >= tiny.MIN_MARGIN, f"top-1/top-2 margin {margin:.3g}"


# --- the engine -----------------------------------------------------------------------


@pytest.mark.engine
def test_adapter_matches_transformers_with_peft(adapter):
    """Greedy tokens equal Transformers + PEFT's; logprobs agree."""
    impl = tiny.e2e_impl()
    run = tiny.run_engine(checkpoint("llama"), lora=adapter.path, **tiny.IMPLS[impl])
    gap = compare(adapter.reference, run.completions)
    report(f"llama + LoRA ({impl}) vs Transformers + PEFT", run, gap)
