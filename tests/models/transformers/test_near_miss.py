# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The near-miss corpus (`near_miss.py`): every module that looks like a pattern but
computes something else is declined with a reason naming the module class and the
code that decided, in the registry and in the report alike, or is refused naming the
module; what is fused computes what the original does. And every fusion declined
while building the real architectures carries a reason and a location."""

import re
from pathlib import Path

import pytest
import torch
from configs import small_config
from near_miss import CORPUS
from transformers import AutoModel
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

import vllm.model_executor.models.transformers  # noqa: F401 - registers "vllm"
from vllm.model_executor.models.transformers import plan as registry
from vllm.model_executor.models.transformers.fusers import AttentionFuser
from vllm.model_executor.models.transformers.fusion_report import FusionReport
from vllm.model_executor.models.transformers.report import Style, render

DECLINED = [name for name, case in CORPUS.items() if case.declined]
REFUSED = [name for name, case in CORPUS.items() if case.refused]
FUSED = [name for name, case in CORPUS.items() if not (case.declined or case.refused)]
DECLINED_AT_TP = [name for name, case in CORPUS.items() if case.declined_at_tp]
LOCATION = re.compile(r"(?P<file>.+):(?P<line>\d+)")


def test_the_corpus_is_large_and_mostly_declines():
    assert len(CORPUS) >= 25
    assert len(DECLINED) + len(REFUSED) > 2 * len(FUSED)


def assert_located(location: str, package_file: bool = True) -> None:
    """`location` is `file:line` of an existing line of the backend's code."""
    found = LOCATION.fullmatch(location)
    assert found, location
    path = Path(found["file"])
    assert 0 < int(found["line"]) <= len(path.read_text().splitlines())
    if package_file:
        # The fuser or rewrite that decided, not the registry that caught it.
        assert "vllm_transformers_overlay/backend/" in path.as_posix(), location
        assert path.name != "plan.py", location


@pytest.mark.parametrize("name", DECLINED)
def test_near_miss_is_declined_naming_the_module_and_the_code_that_decided(
    name, vllm_config
):
    case = CORPUS[name]
    module = case.build()
    plan = registry.FusionPlan(module, vllm_config)
    assert case.fuser not in [type(f).__name__ for f in plan[module]]
    (declined,) = [
        d for d in registry.analyse(module).declined if d.fuser == case.fuser
    ]
    assert declined.module_class == type(module).__name__
    assert case.declined in declined.reason
    assert_located(declined.location)
    assert f"{case.fuser}: {declined.reason} ({declined.location})" in plan.why_not(
        module
    )


@pytest.mark.parametrize("name", DECLINED)
def test_report_shows_the_same_reason_and_location(name, vllm_config):
    case = CORPUS[name]
    module = case.build()
    report = FusionReport(model=name)
    report.record_plan(registry.FusionPlan(module, vllm_config))
    (declined,) = [
        d for d in registry.analyse(module).declined if d.fuser == case.fuser
    ]
    text = render(report, Style(False))
    assert f"  {type(module).__name__} (" in text
    assert f"declined {case.fuser}: {declined.reason} ({declined.location})" in text


@pytest.mark.parametrize("name", REFUSED)
def test_attention_argument_vllm_cannot_honour_is_refused_naming_module_and_line(
    name,
):
    case = CORPUS[name]
    module = case.build()
    fuser = registry.get_fuser(module, AttentionFuser)
    with pytest.raises(ValueError) as error:
        fuser.attention_needs(module, None)
    message = str(error.value)
    assert case.refused in message
    described = re.match(rf"{type(module).__name__} \(layer 0, (\S+)\)", message)
    assert described, message
    assert_located(described[1], package_file=False)
    assert Path(described[1].rpartition(":")[0]) == Path(__file__).with_name(
        "near_miss.py"
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", FUSED)
def test_near_miss_that_fuses_computes_the_same(name, dtype, equivalent):
    case = CORPUS[name]
    _, applied = equivalent(case.build(), *case.inputs(dtype), dtype=dtype)
    assert [type(f).__name__ for f in applied] == [case.fuser]


@pytest.mark.parametrize("name", DECLINED_AT_TP)
def test_near_miss_is_fused_at_one_rank_and_declined_per_instance_at_two(
    name, vllm_config, monkeypatch
):
    case = CORPUS[name]
    module = case.build()
    one_rank = registry.FusionPlan(module, vllm_config)
    assert case.fuser in [type(f).__name__ for f in one_rank[module]]
    monkeypatch.setattr(vllm_config.parallel_config, "tensor_parallel_size", 2)
    plan = registry.FusionPlan(module, vllm_config)
    assert case.fuser not in [type(f).__name__ for f in plan[module]]
    (declined,) = [d for d in plan.declined if d.fuser == case.fuser]
    assert case.declined_at_tp in declined.reason, declined.reason
    assert f"{case.fuser}: {declined.reason}" in plan.why_not(module)


def causal_lm_types() -> list[str]:
    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def test_every_fusion_declined_building_real_architectures_has_a_reason_and_location(
    vllm_config,
):
    """Every causal-LM model type Transformers knows, built on `meta` as the
    backend builds it: class and instance declines alike say why (and the class
    ones where)."""
    built, class_declines, instance_declines = 0, 0, 0
    for model_type in causal_lm_types():
        try:
            config = small_config(model_type, num_hidden_layers=1, pad_token_id=0)
            config._attn_implementation = "vllm"
            with torch.device("meta"):
                model = AutoModel.from_config(config)
        except Exception:  # noqa: BLE001 - configs Transformers cannot build small
            continue
        built += 1
        plan = registry.FusionPlan(model, vllm_config)
        for analysis in plan.analyses.values():
            for declined in analysis.declined:
                class_declines += 1
                assert declined.reason.strip(), declined
                assert_located(declined.location, package_file=False)
        for declined in plan.declined:
            instance_declines += 1
            assert declined.reason.strip() and declined.module, declined
        registry.clear_cache()
    assert built >= 140
    assert class_declines >= 20 and instance_declines >= 1
