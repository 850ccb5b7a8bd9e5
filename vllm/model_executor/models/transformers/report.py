# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`python -m vllm.model_executor.models.transformers.report MODEL [--json] [--all]`

Builds the backend for MODEL (a model folder, a `config.json`, or a Transformers
`model_type`) on the `meta` device, with no weights and no GPU, and prints what it
did: the fusers each module class matched, applied and declined (with the reason and
the code that decided it), the vLLM attention of each decoder layer, the
tensor-parallel style of each linear, and whether vLLM can serve the model.

`--all` builds a small config of every causal-LM `model_type` Transformers knows and
prints a coverage table."""

import argparse
import json
import logging
import os
import socket
import sys
import tempfile
import time
import re
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import AutoConfig, PreTrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from vllm.model_executor.models.transformers import fusion_report
from vllm.model_executor.models.transformers.fusers import FUSER_CLASSES
from vllm.model_executor.models.transformers.fusion_report import (
    AttentionReport,
    FusionReport,
)

COVERAGE_COLUMNS = tuple(dict.fromkeys(f.coverage for f in FUSER_CLASSES if f.coverage))
"""The fusion columns of `--all`, as the fusers declare them, in the order tried."""

PLACEHOLDER = AutoConfig.for_model(
    "llama",
    num_hidden_layers=1,
    hidden_size=64,
    intermediate_size=64,
    num_attention_heads=2,
    vocab_size=64,
    architectures=["LlamaForCausalLM"],
)
"""Lets vLLM's own config checks pass for a model its registry refuses, so the report
can still say what the backend would do with it (and why it fails)."""


def load_config(model: str) -> PreTrainedConfig:
    """The config of a model folder, a `config.json`, or a `model_type`. Repository
    code (`auto_map`) is never run: a config that needs it is an error saying so."""
    path = Path(model)
    if path.is_dir() or path.name == "config.json":
        # Explicitly False: `None` makes Transformers ask on a terminal.
        return AutoConfig.from_pretrained(
            path.parent if path.is_file() else path, trust_remote_code=False
        )
    config = AutoConfig.for_model(model)
    if not getattr(config, "architectures", None):
        config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model, "")]
    return config


@contextmanager
def vllm_runtime() -> Iterator[None]:
    """The world-size-1 process group vLLM's parallel layers need, on the CPU."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import (
        init_distributed_environment,
        initialize_model_parallel,
        model_parallel_is_initialized,
    )

    if not model_parallel_is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with set_current_vllm_config(VllmConfig()):
            init_distributed_environment(
                world_size=1,
                rank=0,
                local_rank=0,
                distributed_init_method=f"tcp://127.0.0.1:{port}",
                backend="gloo",
            )
            initialize_model_parallel(1, 1)
    yield


def first_line(error: Exception) -> str:
    """The message of `error` without pydantic's wrapping."""
    message = str(error)
    if "Value error, " in message:
        message = message.split("Value error, ", 1)[1].split(" [type=", 1)[0]
    return message.strip()


def build_report(config: PreTrainedConfig, name: str) -> FusionReport:
    """Build the backend class vLLM would serve `config` with (a causal LM, an
    embedding, a classification or a vision-language model) on `meta` and return
    its report. A model
    folder is read as it is, so its Sentence Transformers pooling config counts."""
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        LoadConfig,
        ModelConfig,
        VllmConfig,
        set_current_vllm_config,
    )
    from vllm.model_executor.models import transformers as backend
    from vllm.model_executor.models.transformers.hybrid import HybridMixin
    from vllm.model_executor.models.transformers.multimodal import MultiModalMixin
    from vllm.model_executor.models.transformers.pooling import PoolingMixin
    from vllm.utils.torch_utils import set_default_torch_dtype

    with fusion_report.collect(name) as report, tempfile.TemporaryDirectory() as folder:
        config.save_pretrained(folder)
        source = name if Path(name).is_dir() else folder
        refused = None
        try:
            model_config = ModelConfig(
                model=source, model_impl="transformers", skip_tokenizer_init=True
            )
        except Exception as error:  # noqa: BLE001 - vLLM's checks raise many kinds
            refused = f"vLLM's registry refuses it before the backend runs: {first_line(error)}"
            PLACEHOLDER.save_pretrained(folder)
            model_config = ModelConfig(
                model=folder, model_impl="transformers", skip_tokenizer_init=True
            )
            model_config.hf_config = config
            model_config.hf_text_config = config.get_text_config()
        served_class = getattr(backend, model_config._get_transformers_backend_cls())
        built_class = (
            served_class
            if issubclass(served_class, PoolingMixin | MultiModalMixin | HybridMixin)
            else backend.TransformersForCausalLM
        )
        vllm_config = VllmConfig(
            model_config=model_config,
            # What the backend serves, not what this platform's engine defaults
            # allow: the CPU engine serves Mamba-2 mixers without prefix caching
            # only, which the engine's start-up says.
            cache_config=CacheConfig(enable_prefix_caching=False),
            device_config=DeviceConfig("cpu"),
            load_config=LoadConfig(load_format="dummy"),
        )
        try:
            with (
                set_current_vllm_config(vllm_config),
                set_default_torch_dtype(model_config.dtype),
                torch.device("meta"),
            ):
                # The causal LM classes differ only in name: the dense one serves.
                built_class(vllm_config=vllm_config)
        except Exception as error:  # noqa: BLE001 - the report says why, whatever it was
            if report.servable:
                report.fail(f"{type(error).__name__}: {error}")
        if refused is not None:
            report.fail(refused if report.servable else f"{report.reason} ({refused})")
        report.model = name
    return report


class Style:
    """ANSI colour when printing to a terminal, plain text otherwise."""

    def __init__(self, enabled: bool):
        self.enabled = enabled

    def __call__(self, text: str, code: str) -> str:
        return f"\033[{code}m{text}\033[0m" if self.enabled else text

    def good(self, text: str) -> str:
        return self(text, "32")

    def bad(self, text: str) -> str:
        return self(text, "31")

    def head(self, text: str) -> str:
        return self(text, "1")


LAYER_INDEX = re.compile(r"\.\d+\.")


def compact(indices: list[int]) -> str:
    """`0-31`, `0-24 every 2`, or `1, 5, 9`: layer indices, short."""
    if len(indices) == 1:
        return str(indices[0])
    steps = {b - a for a, b in zip(indices, indices[1:])}
    if len(steps) == 1 and len(indices) > 2:
        step = steps.pop()
        every = "" if step == 1 else f" every {step}"
        return f"{indices[0]}-{indices[-1]}{every}"
    return ", ".join(map(str, indices))


def grouped(items: Iterable[tuple[int, str]]) -> Iterator[tuple[str, str]]:
    """Layers that share one description, in order of first appearance."""
    groups: dict[str, list[int]] = {}
    for index, line in items:
        groups.setdefault(line, []).append(index)
    for line, indices in groups.items():
        yield compact(indices), line


def _attention_class(attention: AttentionReport) -> str:
    """The vLLM attention layer the module got."""
    if attention.mla:
        return "MLAAttention"
    return "Attention" if attention.causal else "EncoderOnlyAttention"


def _beside(report: FusionReport, details: list[str]) -> list[str]:
    """For each block holding listed instances, its other children with linears
    (an MoE block's shared expert and its gate), which run in the block's own code."""
    listed: dict[str, set[str]] = {}
    for detail in details:
        block, _, child = detail.split(" ", 1)[0].rpartition(".")
        listed.setdefault(block, set()).add(child)
    # Per block instance (a dense layer at the same path, AFMoE's first, is no
    # block), then grouped by path across layers.
    beside: dict[str, set[str]] = {}
    for block, children in listed.items():
        others = {
            linear.module[len(block) + 1 :].split(".")[0]
            for linear in report.linears
            if linear.module.startswith(f"{block}.")
        } - children
        if others:
            beside.setdefault(LAYER_INDEX.sub(".{i}.", block), set()).update(others)
    return [
        f"  {block}: beside them {', '.join(sorted(others))} (the block's own code, "
        "on vLLM's linears)"
        for block, others in beside.items()
    ]


def render(report: FusionReport, style: Style) -> str:
    lines = [style.head(f"Fusion report: {report.model}")]
    lines.append(style.head("\nModule classes"))
    for name, cls in sorted(report.classes.items()):
        if not (cls.matched or cls.declined):
            continue
        applied = (
            ", ".join(f"{f} x{n}" for f, n in sorted(cls.applied.items())) or "none"
        )
        lines.append(
            f"  {name} ({cls.instances} instances): matched "
            f"{', '.join(cls.matched) or 'nothing'}; applied {applied}"
        )
        for declined in cls.declined:
            lines.append(
                "    "
                + style.bad(f"declined {declined.fuser}: {declined.reason}")
                + f" ({declined.location})"
            )
    lines.append(style.head("\nAttention per decoder layer"))
    for layers, line in grouped(
        (
            a.layer_index,
            f"{a.module.replace(f'.{a.layer_index}.', '.{i}.')} ({a.module_class}) -> "
            f"{_attention_class(a)}, scale {a.scale:.6g}, "
            f"sliding window {a.sliding_window} (the model's mask: {a.mask}), "
            f"soft-cap {a.soft_cap}",
        )
        for a in sorted(report.attention, key=lambda a: a.layer_index)
    ):
        lines.append(f"  layers {layers}: {line}")
    lines.append(style.head("\nLinears (i = decoder layer)"))
    counts = Counter(
        (
            LAYER_INDEX.sub(".{i}.", linear.module),
            linear.layer_class,
            linear.style,
            linear.planned,
        )
        for linear in report.linears
    )
    for (module, layer_class, tp_style, planned), count in counts.items():
        note = "" if planned else style.bad("  (no tensor-parallel plan: replicated)")
        times = f" x{count}" if count > 1 else ""
        lines.append(f"  {module}: {layer_class} [{tp_style}]{times}{note}")
    for kind, details in sorted(report.details.items()):
        title = report.titles.get(kind, kind)
        lines.append(style.head(f"\n{title} (i = decoder layer)"))
        for detail, count in Counter(
            LAYER_INDEX.sub(".{i}.", d) for d in details
        ).items():
            lines.append(f"  {detail}{f' x{count}' if count > 1 else ''}")
        if kind in report.beside:
            lines.extend(_beside(report, details))
    if report.pooler is not None:
        lines.append(style.head("\nPooling"))
        lines.append(f"  Pooler: {report.pooler}")
        if report.head is not None:
            lines.append(f"  Head: {report.head}")
        attention = "causal" if report.causal else "encoder-only, no KV cache"
        lines.append(f"  Attention: {attention}")
    if report.kept:
        lines.append(style.head("\nKept with Transformers (not fused, replicated)"))
        for module, why in report.kept.items():
            lines.append(f"  model.{module}: {why}")
    for module, why in report.not_built.items():
        lines.append(f"  model.{module}: not built ({why})")
    verdict = style.good("SERVABLE") if report.servable else style.bad("NOT SERVABLE")
    lines.append(style.head("\nVerdict: ") + verdict)
    if report.reason:
        lines.append(f"  {report.reason}")
    lines.append(f"  {report.short()}")
    return "\n".join(lines)


def coverage_row(report: FusionReport) -> dict[str, object]:
    """What `--all` tabulates for one model type."""
    layers = report.num_layers
    return {
        "model_type": report.model,
        "built": layers > 0,
        "attention": layers > 0 and len(report.attention) == layers,
        **{column: column in report.coverage for column in COVERAGE_COLUMNS},
        "servable": report.servable,
        "reason": report.reason,
    }


_LOCATION_WORDS = {"Decoder", "layer", "N", "its", "attention"}


def cause(reason: str) -> str:
    """The model-independent part of a verdict's reason, so that model types failing
    for one cause group together: file:line, module paths, class names and numbers
    become placeholders, and sentences that only say where are skipped."""
    text = re.sub(r"\S+\.py:\d+", "<file:line>", reason.splitlines()[0])
    text = re.sub(r"\b(?:[A-Za-z_]\w*\.)+\d+(?:\.\w+)*", "<module>", text)
    text = re.sub(r"<module> \(\w+\)", "<module> (<Class>)", text)
    text = re.sub(r"\b(?!vLLM\b)[A-Za-z]\w*?[a-z0-9][A-Z]\w*", "<Class>", text)
    text = re.sub(r"\b\d+\b", "N", text)
    for sentence in re.split(r"(?<=\.)\s+", text):
        words = set(re.findall(r"[A-Za-z]+", re.sub(r"<[^>]*>", "", sentence)))
        if words - _LOCATION_WORDS:
            sentence = re.sub(r"^<Class>(?: \(layer N, <file:line>\))?:? ", "", sentence)
            # The list of what vLLM honours is the same in every such reason.
            return re.sub(r"\s*\(it honours [^)]*\)", "", sentence).rstrip(".;")
    return text


def causes(rows: list[dict[str, object]]) -> dict[str, list[str]]:
    """Model types built but not served, grouped by `cause`, largest group first."""
    groups: dict[str, list[str]] = {}
    for row in rows:
        if row.get("built") and not (row.get("servable") and row.get("attention")):
            reason = str(row.get("reason") or "attention missing in some layer")
            groups.setdefault(cause(reason), []).append(str(row["model_type"]))
    return dict(sorted(groups.items(), key=lambda group: -len(group[1])))


def run_all(as_json: bool, style: Style) -> None:
    rows = []
    started = time.perf_counter()
    for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        try:
            config = AutoConfig.for_model(model_type, num_hidden_layers=2)
            config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]]
        except Exception as error:  # noqa: BLE001 - a config Transformers cannot build
            rows.append(
                {
                    "model_type": model_type,
                    "built": False,
                    "servable": False,
                    "reason": f"no config: {error}",
                }
            )
            continue
        rows.append(coverage_row(build_report(config, model_type)))
    elapsed = time.perf_counter() - started
    columns = ("built", "attention", *COVERAGE_COLUMNS, "servable")
    totals = {c: sum(bool(r.get(c)) for r in rows) for c in columns}
    summary = f"{len(rows)} causal-LM model types in {elapsed:.0f} s: " + ", ".join(
        f"{c} {totals[c]}" for c in columns
    )
    grouped_causes = causes(rows)
    if as_json:
        print(
            json.dumps(
                {"rows": rows, "causes": grouped_causes, "summary": summary}, indent=1
            )
        )
        return
    print(style.head(f"{'model_type':<28}" + "".join(f"{c:>10}" for c in columns)))
    for row in rows:
        marks = "".join(
            style.good(f"{'yes':>10}") if row.get(c) else style.bad(f"{'no':>10}")
            for c in columns
        )
        print(f"{row['model_type']:<28}{marks}")
    unserved = sum(len(types) for types in grouped_causes.values())
    print(style.head(f"\nBuilt but not fully served ({unserved}), by cause:"))
    for reason, types in grouped_causes.items():
        print(f"{len(types):>4}  {reason}\n      {style.bad(', '.join(types))}")
    print(style.head(summary))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m vllm.model_executor.models.transformers.report",
        description=__doc__.split("\n\n")[1],
    )
    parser.add_argument(
        "model", nargs="?", help="model folder, config.json or model_type"
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("--all", action="store_true", help="every causal-LM model_type")
    args = parser.parse_args(argv)
    if not args.all and not args.model:
        parser.error("give MODEL or --all")
    # The report is the output; vLLM's own start-up chatter would bury it.
    logging.getLogger("vllm").setLevel(logging.WARNING)
    style = Style(
        sys.stdout.isatty() and not args.json and "NO_COLOR" not in os.environ
    )
    with vllm_runtime():
        if args.all:
            run_all(args.json, style)
            return
        try:
            config = load_config(args.model)
        except Exception as error:  # noqa: BLE001 - Transformers raises many kinds
            # No traceback: the message is the answer (unknown model_type, remote
            # code not trusted, a field of the wrong type...).
            sys.exit(f"Cannot read the config of {args.model}: {error}")
        report = build_report(config, args.model)
    print(
        json.dumps(report.to_json(), indent=1, default=str)
        if args.json
        else render(report, style)
    )


if __name__ == "__main__":
    main()
