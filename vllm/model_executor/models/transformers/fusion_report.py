# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The fusion report: what the backend did with a model, and what it declined.

The backend fills a `FusionReport` while it builds (`Base.__init__`) and logs its
short form; `python -m vllm.model_executor.models.transformers.report MODEL` (`report.py`) builds the
same backend on the `meta` device and prints the whole report. One code path, so the
command and the engine never disagree."""

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from vllm.model_executor.models.transformers.records import Declined

if TYPE_CHECKING:
    from vllm.model_executor.models.transformers.plan import FusionPlan
    from vllm.model_executor.models.transformers.fusers.base import BaseFuser

_ACTIVE: contextvars.ContextVar["FusionReport | None"] = contextvars.ContextVar(
    "fusion_report", default=None
)


@dataclass
class ClassReport:
    """The fusers found for one module class, and what became of them."""

    matched: list[str] = field(default_factory=list)
    applied: dict[str, int] = field(default_factory=dict)
    """Fuser -> number of instances it was applied to."""
    instances: int = 0
    declined: list[Declined] = field(default_factory=list)


@dataclass
class AttentionReport:
    layer_index: int
    module: str
    module_class: str
    scale: float
    sliding_window: int | None
    soft_cap: float | None
    mla: bool
    causal: bool = True
    """False for encoder-only (bidirectional) attention, which keeps no KV cache."""
    mask: str = ""
    """What made the mask the model applies to this layer (`masks.py`), or why it
    was not read."""


@dataclass
class LinearReport:
    module: str
    layer_class: str
    style: str
    planned: bool
    """Whether the style came from a fuser or the model's TP plan (not a fallback)."""


@dataclass
class FusionReport:
    """Everything the backend decided about one model, collected as it builds."""

    model: str = ""
    num_layers: int = 0
    classes: dict[str, ClassReport] = field(default_factory=dict)
    attention: list[AttentionReport] = field(default_factory=list)
    linears: list[LinearReport] = field(default_factory=list)
    fused_projections: int = 0
    """Original linears now computed inside a QKV or merged linear."""
    fusions: dict[str, int] = field(default_factory=dict)
    """Fuser kind (`qkv`, `glu`, `rms_norm`...) -> instances it was applied to."""
    details: dict[str, list[str]] = field(default_factory=dict)
    """Fuser kind -> a line per fused instance, for kinds that list them (`moe`)."""
    titles: dict[str, str] = field(default_factory=dict)
    """Fuser kind -> the title of the section listing its instances."""
    beside: list[str] = field(default_factory=list)
    """The kinds whose section names the other children of each instance's block."""
    summaries: dict[str, str] = field(default_factory=dict)
    """Fuser kind -> how the one-line report counts its fusions (`{n}`)."""
    coverage: dict[str, int] = field(default_factory=dict)
    """Column of `report --all` -> the fusions that tick it."""
    servable: bool = True
    reason: str | None = None
    causal: bool = True
    """Whether any layer's attention is causal (a pooling model's may all be
    encoder-only)."""
    pooler: str | None = None
    """A pooling model's pooler: which token(s) it reads, normalised or not."""
    head: str | None = None
    """A classification model's head: its modules, in order, and its labels."""
    kept: dict[str, str] = field(default_factory=dict)
    """Modules left to Transformers whole (a vision tower), by name: why."""
    not_built: dict[str, str] = field(default_factory=dict)
    """Modules not built at all (the tower of a text-only engine), by name: why."""

    def record_module(
        self, module_class: str, matched: list[str], applied: list[str]
    ) -> None:
        report = self.classes.setdefault(module_class, ClassReport())
        report.matched = report.matched or matched
        report.instances += 1
        for fuser in applied:
            report.applied[fuser] = report.applied.get(fuser, 0) + 1

    def record_fusion(self, fuser: "BaseFuser", detail: str | None = None) -> None:
        """Count one fusion under the fuser's kind, and under its summary, column
        and section as the fuser declares them."""
        self.fusions[fuser.kind] = self.fusions.get(fuser.kind, 0) + 1
        if fuser.summary:
            self.summaries[fuser.kind] = fuser.summary
        if fuser.coverage:
            self.coverage[fuser.coverage] = self.coverage.get(fuser.coverage, 0) + 1
        if detail is not None:
            self.details.setdefault(fuser.kind, []).append(detail)
            self.titles[fuser.kind] = fuser.details_title or fuser.kind
            if fuser.details_beside and fuser.kind not in self.beside:
                self.beside.append(fuser.kind)
        self.fused_projections += sum(map(len, fuser.packed_modules_mapping.values()))

    def record_plan(self, plan: "FusionPlan") -> None:
        """Keep what the plan declined: per class, and per instance (located by the
        module's name)."""
        for module_class, analysis in plan.analyses.items():
            report = self.classes.setdefault(module_class, ClassReport())
            report.declined.extend(analysis.declined)
        for declined in plan.declined:
            report = self.classes.setdefault(declined.module_class, ClassReport())
            report.declined.append(
                Declined(
                    declined.fuser, declined.module_class, declined.reason, declined.module
                )
            )

    def fail(self, reason: str) -> None:
        self.servable, self.reason = False, reason

    @property
    def linears_total(self) -> int:
        unfused = sum(
            1
            for linear in self.linears
            if linear.layer_class
            not in ("QKVParallelLinear", "MergedColumnParallelLinear")
        )
        return unfused + self.fused_projections

    def short(self) -> str:
        """One line: the verdict and how much is fused (what the engine logs)."""
        verdict = "servable" if self.servable else f"NOT servable: {self.reason}"
        return (
            f"Fusion report for {self.model}: {verdict}; vLLM attention in "
            f"{len(self.attention)}/{self.num_layers} layers"
            f"{' (MLA)' if any(a.mla for a in self.attention) else ''}; "
            f"{self.fused_projections}/{self.linears_total} projections fused; "
            + "".join(
                f"{summary.format(n=self.fusions[kind])}; "
                for kind, summary in sorted(self.summaries.items())
            )
            + f"{sum(not linear.planned for linear in self.linears)} linears "
            "replicated for lack of a tensor-parallel plan"
            + (f"; pooler: {self.pooler}" if self.pooler else "")
            + (f"; head: {self.head}" if self.head else "")
            + (f"; kept with Transformers: {', '.join(self.kept)}" if self.kept else "")
            + (f"; not built: {', '.join(self.not_built)}" if self.not_built else "")
        )

    def to_json(self) -> dict:
        data = asdict(self)
        data["short"] = self.short()
        return data


@contextmanager
def collect(model: str = "") -> Iterator[FusionReport]:
    """Make the backends built inside this block fill one report the caller keeps."""
    report = FusionReport(model=model)
    token = _ACTIVE.set(report)
    try:
        yield report
    finally:
        _ACTIVE.reset(token)


def active() -> FusionReport:
    """The report being collected, or a fresh one when nobody asked for it."""
    return _ACTIVE.get() or FusionReport()
