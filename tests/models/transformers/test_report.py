# SPDX-License-Identifier: Apache-2.0
"""The fusion report: its content, its verdicts, its JSON, and that the engine logs
the same thing the command prints."""

import json
import re
import subprocess
import sys

import pytest
from configs import SMALL, repository_code, small_config
from transformers import AutoConfig, PreTrainedConfig

from vllm.model_executor.models.transformers.fusion_report import FusionReport
from vllm.model_executor.models.transformers.report import (
    Style,
    build_report,
    causes,
    load_config,
    render,
)


def test_llama_report_lists_every_fusion_per_class(vllm_runtime):
    report = build_report(small_config("llama", num_hidden_layers=3), "llama")
    assert report.servable and report.reason is None
    assert report.classes["LlamaAttention"].applied == {
        "QKVFuser": 3,
        "RotaryFuser": 3,
        "AttentionFuser": 3,
    }
    assert report.classes["LlamaRotaryEmbedding"].applied == {
        "RotaryEmbeddingFuser": 1
    }
    assert report.fusions["rotary"] == 3
    assert report.classes["LlamaMLP"].applied == {"GLUFuser": 3}
    assert report.classes["LlamaRMSNorm"].applied == {"RMSNormFuser": 7}
    assert [a.layer_index for a in report.attention] == [0, 1, 2]
    assert [a.scale for a in report.attention] == pytest.approx([32**-0.5] * 3)
    styles = {
        (linear.module, linear.layer_class, linear.style) for linear in report.linears
    }
    assert (
        "model.layers.0.self_attn.qkv_proj",
        "QKVParallelLinear",
        "colwise",
    ) in styles
    assert ("model.layers.0.mlp.down_proj", "RowParallelLinear", "rowwise") in styles
    # q, k, v, gate and up of three layers are inside merged linears.
    assert report.fused_projections == 15
    assert report.linears_total == 21


def test_declined_fusion_is_reported_with_reason_and_location(vllm_runtime):
    # GPT-NeoX packs q, k, v interleaved per head: the packed-QKV fuser must decline.
    report = build_report(small_config("gpt_neox"), "gpt_neox")
    attention = report.classes["GPTNeoXAttention"]
    assert attention.applied == {"RotaryFuser": 2, "AttentionFuser": 2}
    (declined,) = [d for d in attention.declined if d.fuser == "PackedQKVFuser"]
    assert "cannot be proven" in declined.reason
    assert re.search(r"\.py:\d+$", declined.location)
    assert report.servable


def test_model_without_interface_dispatch_is_not_servable_with_the_reason(vllm_runtime):
    report = build_report(
        small_config("bloom", n_layer=2, n_head=4, hidden_size=128), "bloom"
    )
    assert not report.servable
    assert "Decoder layer 0" in report.reason
    assert "BloomAttention" in report.reason
    assert "is not compatible with vLLM" in report.reason  # vLLM's registry, too


def test_latent_attention_passes_the_attention_width_checks(vllm_runtime):
    # Its keys join kv_b_proj's part to a rotary part from another linear, so
    # kv_b_proj's width is neither the keys' nor the keys' and values'.
    report = build_report(small_config("minicpm3"), "minicpm3")
    assert report.servable, report.reason
    assert report.attention and all(layer.mla for layer in report.attention)


def small_llava() -> PreTrainedConfig:
    """A vision-language model: Llama behind a CLIP tower."""
    return AutoConfig.for_model(
        "llava",
        architectures=["LlavaForConditionalGeneration"],
        text_config=dict(model_type="llama", **SMALL),
        vision_config=dict(
            model_type="clip_vision_model",
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=32,
            patch_size=8,
        ),
    )


def test_vision_language_report_shows_the_tower_kept_beside_the_fused_decoder(
    vllm_runtime,
):
    report = build_report(small_llava(), "llava")
    assert report.servable, report.reason
    assert len(report.attention) == 2  # the decoder's layers, not the tower's
    assert report.fusions["qkv"] == 2 and report.fusions["glu"] == 2
    assert set(report.kept) == {"vision_tower", "multi_modal_projector"}
    assert all(not c.startswith("CLIP") for c in report.classes), "tower analysed"
    rendered = render(report, Style(False))
    assert "Kept with Transformers (not fused, replicated)" in rendered
    assert "  model.vision_tower: CLIPVisionModel: encodes images" in rendered


def test_a_fuser_reaches_the_report_through_what_it_declares():
    """Its kind's summary in the one-line report, its section title over the
    instances it lists, the `--all` column it ticks: no list in the report to edit."""
    from vllm.model_executor.models.transformers.fusers.base import BaseFuser

    class Fake(BaseFuser):
        kind = "fake"
        summary = "{n} fakes on vLLM's kernel"
        coverage = "fake"
        details_title = "Fakes, on vLLM's kernel"

    report = FusionReport(model="m", num_layers=2)
    report.record_fusion(Fake(), "model.layers.0.fake: one")
    report.record_fusion(Fake(), "model.layers.1.fake: one")
    assert "; 2 fakes on vLLM's kernel; " in report.short()
    rendered = render(report, Style(False))
    section = "\nFakes, on vLLM's kernel (i = decoder layer)\n"
    assert f"{section}  model.layers.{{i}}.fake: one x2" in rendered
    assert report.coverage == {"fake": 2}


def test_a_tower_is_named_for_what_it_encodes_where_the_base_model_declares_text(
    vllm_runtime,
):
    """Aria's base model keeps Transformers' default `input_modalities`, the string
    "text"; its tower encodes images all the same."""
    import tiny_multimodal

    config = tiny_multimodal.config(tiny_multimodal.RECIPES["aria"])
    config.architectures = ["AriaForConditionalGeneration"]
    report = build_report(config, "aria")
    assert report.kept["vision_tower"].startswith(
        "Idefics3VisionTransformer: encodes images as Transformers does"
    )


def test_moe_blocks_are_listed_with_router_experts_top_k_activation_and_path(vllm_runtime):
    report = build_report(small_config("mixtral", num_local_experts=4), "mixtral")
    assert report.servable, report.reason
    assert report.details["moe"] == [
        line
        for i in range(2)
        for line in (
            f"model.layers.{i}.mlp.gate (MixtralTopKRouter): router -> vLLM's "
            "router: softmax top-2, renormalised",
            f"model.layers.{i}.mlp.experts (MixtralExperts): 4 experts, top-2, "
            "silu; vLLM fused MoE, routed by the block's router",
        )
    ]
    rendered = render(report, Style(False))
    assert "Mixture-of-experts blocks (i = decoder layer)" in rendered
    assert "  model.layers.{i}.mlp.experts (MixtralExperts): 4 experts" in rendered


def test_moe_block_lists_its_shared_expert_and_gate_beside_router_and_experts(
    vllm_runtime,
):
    report = build_report(small_config("qwen2_moe", num_experts=4), "qwen2_moe")
    rendered = render(report, Style(False))
    assert (
        "  model.layers.{i}.mlp: beside them shared_expert, shared_expert_gate "
        "(the block's own code, on vLLM's linears)"
    ) in rendered
    mixtral = render(
        build_report(small_config("mixtral", num_local_experts=4), "mixtral"),
        Style(False),
    )
    assert "beside them" not in mixtral


def test_dense_layer_at_a_block_path_is_not_listed_beside_the_experts(vllm_runtime):
    """AFMoE's first layer is a dense MLP at `mlp`, where the others have their
    experts: its projections are no part of any block."""
    report = build_report(
        small_config(
            "afmoe", num_experts=4, num_experts_per_tok=2, num_dense_layers=1,
            num_shared_experts=1,
        ),
        "afmoe",
    )
    assert report.servable, report.reason
    beside = [line for line in render(report, Style(False)).splitlines() if "beside" in line]
    assert beside == [
        "  model.layers.{i}.mlp: beside them shared_experts (the block's own code, "
        "on vLLM's linears)"
    ]


def test_unserved_model_types_group_by_cause_not_by_where(vllm_runtime):
    reports = {
        model_type: build_report(small_config(model_type, **changes), model_type)
        for model_type, changes in [
            ("bloom", dict(n_layer=2, n_head=4, hidden_size=128)),
            ("codegen", dict(n_layer=2, n_head=4, n_embd=128)),
            ("llama", {}),
        ]
    }
    reports["llava"] = build_report(small_llava(), "llava")
    rows = [
        dict(
            model_type=name,
            built=True,
            servable=r.servable,
            attention=len(r.attention) == r.num_layers,
            reason=r.reason,
        )
        for name, r in reports.items()
    ]
    grouped = causes(rows)
    # Servable ones (llama; llava through the vision-language class): in no group.
    assert list(grouped.values()) == [["bloom", "codegen"]]
    (interface,) = grouped
    assert interface.startswith("No module in it calls the Transformers attention")
    assert "Bloom" not in interface and "CodeGen" not in interface


def test_command_prints_json_and_plain_text(tmp_path):
    small_config("qwen3", head_dim=32).save_pretrained(tmp_path)
    command = [sys.executable, "-m", "vllm.model_executor.models.transformers.report"]
    data = json.loads(
        subprocess.run(
            [*command, str(tmp_path), "--json"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    assert data["servable"] is True
    assert set(data) >= {
        "model",
        "classes",
        "attention",
        "linears",
        "servable",
        "reason",
        "short",
    }
    assert data["classes"]["Qwen3Attention"]["applied"] == {
        "QKVFuser": 2,
        "RotaryFuser": 2,
        "AttentionFuser": 2,
    }
    assert {
        "layer_index",
        "module",
        "scale",
        "sliding_window",
        "soft_cap",
        "mla",
    } <= set(data["attention"][0])
    text = subprocess.run(
        [*command, str(tmp_path)], capture_output=True, text=True, check=True
    ).stdout
    assert "Verdict: SERVABLE" in text
    assert "\033[" not in text  # piped: no colour
    assert data["short"] in text


@pytest.mark.engine
def test_engine_start_up_log_agrees_with_the_command(vllm_runtime):
    from tiny import checkpoint, shared_engine as engine

    path = checkpoint("llama")
    logged = re.findall(r"Fusion report for .*", engine("llama", "project").log)
    assert logged, "the engine did not log the fusion report"
    report = build_report(load_config(str(path)), str(path))
    assert logged[-1].strip() == report.short()


@pytest.mark.parametrize(
    ("model_type", "why"),
    [
        # Unknown to Transformers: the config class is repository code too.
        ("marker_model", "Please pass the argument `trust_remote_code=True`"),
        ("llama", None),  # readable: the build refuses it (next test)
    ],
)
def test_command_never_runs_repository_code(tmp_path, model_type, why):
    config = small_config("llama")
    config.model_type = model_type
    marker = repository_code(tmp_path, config)
    if model_type != "llama":  # `save_pretrained` writes the class's own type
        data = json.loads((tmp_path / "config.json").read_text())
        data["model_type"] = model_type
        (tmp_path / "config.json").write_text(json.dumps(data))
    done = subprocess.run(
        [sys.executable, "-m", "vllm.model_executor.models.transformers.report",
         str(tmp_path)],
        capture_output=True, text=True, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert not marker.exists()
    if why is None:
        assert done.returncode == 0, done.stderr
        assert "NOT SERVABLE" in done.stdout and "trust_remote_code=True" in done.stdout
        return
    assert done.returncode == 1
    assert f"Cannot read the config of {tmp_path}: The repository" in done.stderr
    assert why in done.stderr and "Traceback" not in done.stderr


def test_command_names_an_unknown_model_type_without_a_traceback(tmp_path):
    data = small_config("llama").to_dict()
    (tmp_path / "config.json").write_text(json.dumps({**data, "model_type": "frob"}))
    done = subprocess.run(
        [sys.executable, "-m", "vllm.model_executor.models.transformers.report",
         str(tmp_path)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 1
    assert f"Cannot read the config of {tmp_path}: " in done.stderr
    assert "model type `frob`" in done.stderr and "Traceback" not in done.stderr
