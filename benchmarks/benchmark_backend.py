# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Benchmark the Transformers modeling backend against vLLM's own implementations.

One run measures, side by side:

1. **Throughput** (output tokens/s) on the CPU engine of a medium random Llama, served
   three ways:
     - `this`:   this project's backend    (`model_impl="transformers"`)
     - `native`: vLLM's hand-written Llama (`model_impl="vllm"`)
     - `stock`:  vLLM's stock backend      (`model_impl="transformers"`,
                 `VLLM_TRANSFORMERS_BACKEND=stock`)
   Each engine runs in its own subprocess. All three start (and warm up) first and
   stay up; then they take turns timing the same fixed batch of prompts (greedy,
   `ignore_eos=True`, fixed `max_tokens`), round after round with the order rotated,
   so drift in the machine's load (other people's tests share its cores) hits each
   alike. An idle engine sleeps, so it does not disturb the one being timed. Medians
   and the ratios this/native and this/stock (median of the per-round ratios) are
   printed.
2. **Fuser detection time** over Llama configs of 2, 8, 32 and 128 layers, built on the
   `meta` device in one process: the time the registry takes (`Fusers(...)` with every
   cache cleared first) and the whole meta-device construction of the backend, with
   their ratio to the 2-layer case. Fusers are found per module class, so the
   detection time should not grow with depth.

It writes a JSON summary to `.cache/benchmarks/latest.json` and prints a markdown
table for the README.

    bash scripts/benchmark.sh                   # the whole thing (under 12 minutes)
    bash scripts/benchmark.sh --rounds 3        # quicker, noisier
    bash scripts/benchmark.sh --dtype float32   # or --eager, --skip-detection, ...
    bash scripts/benchmark.sh --model qwen3_moe --skip-detection   # a random Qwen3-MoE

The script also runs its own pieces in subprocesses (`engine SPEC`, `detect OUT`);
those forms are internal.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
CACHE = REPO / ".cache" / "benchmarks"
PYTHON = sys.executable

# --- what is measured ----------------------------------------------------------

MODEL = dict(
    vocab_size=4096,
    hidden_size=768,
    intermediate_size=2048,
    num_hidden_layers=6,
    num_attention_heads=12,  # head_dim 64 (the CPU attention takes 32/64/128)
    num_key_value_heads=4,  # GQA
    max_position_embeddings=1024,
    tie_word_embeddings=False,
    initializer_range=0.02,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
"""The medium random Llama: big enough that the matmuls dominate, small enough that an
engine starts and measures in about a minute on two cores."""

MOE_MODEL = dict(
    MODEL,
    head_dim=64,
    num_experts=16,
    num_experts_per_tok=4,
    moe_intermediate_size=512,
    norm_topk_prob=True,
)
"""The medium random Qwen3-MoE (`--model qwen3_moe`): the Llama's attention with q/k
norms, and 16 experts of width 512, four per token, in every layer."""

MODELS: dict[str, dict[str, Any]] = {"llama": MODEL, "qwen3_moe": MOE_MODEL}
"""`--model` -> the config of the random model benchmarked."""

MODEL_SEED = 0
DTYPE = "bfloat16"
"""The CPU engine runs bf16 well on a CPU with AVX512-BF16 (oneDNN matmuls; this one
has it): decoding is bound by weight traffic, which bf16 halves. `--dtype float32`
compares."""

BATCH = 32
PROMPT_LEN = 32
MAX_TOKENS = 64
MAX_MODEL_LEN = 256
BATCHES_PER_ROUND = 2
"""Timed `generate` calls of the whole batch per engine and round; the best of them is
the engine's number for that round (other work on the machine only ever slows a call
down, so the best call is the least disturbed one)."""
KV_CACHE_BYTES = 256 << 20
"""Three engines stay up at once: each gets a small KV cache (ample for the batch)."""

VARIANTS: dict[str, dict[str, str]] = {
    "this": dict(model_impl="transformers", backend="project"),
    "native": dict(model_impl="vllm", backend="project"),
    "stock": dict(model_impl="transformers", backend="stock"),
}
"""Name -> `model_impl` and `VLLM_TRANSFORMERS_BACKEND`. The native Llama does not touch
the subpackage, so the switch does not matter for it."""

PROFILED_BATCHES = 3
"""Batches each engine runs under the torch profiler (after the rounds; not timed)."""
PROFILE_ROWS = 40
PRINTED_OPS = 8

DETECT_LAYERS = (2, 8, 32, 128)
DETECT_REPEATS = 3

ENGINE_TIMEOUT = 420.0


# --- the checkpoint ------------------------------------------------------------


def checkpoint(dtype: str, model_type: str = "llama") -> Path:
    """Build (or reuse) the random `model_type` checkpoint, saved in `dtype`."""
    import hashlib

    config_kwargs = MODELS[model_type]
    recipe = json.dumps(
        dict(model=config_kwargs, seed=MODEL_SEED, dtype=dtype), sort_keys=True
    )
    if model_type != "llama":  # the Llama's stamp predates `--model`
        recipe += model_type
    stamp = hashlib.sha256(recipe.encode()).hexdigest()[:12]
    target = CACHE / "models" / f"{model_type}-medium-{dtype}-{stamp}"
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(MODEL_SEED)
    config = AutoConfig.for_model(model_type, **config_kwargs)
    model = AutoModelForCausalLM.from_config(config).to(getattr(torch, dtype)).eval()
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{model_type}-", dir=target.parent))
    model.save_pretrained(staging, safe_serialization=True)
    try:
        staging.rename(target)
    except OSError:  # another run built it meanwhile
        import shutil

        shutil.rmtree(staging, ignore_errors=True)
    return target


def prompts(vocab_size: int) -> list[list[int]]:
    """`BATCH` fixed prompts of `PROMPT_LEN` random token ids (special ids excluded)."""
    rng = random.Random(1234)
    return [
        [1] + [rng.randrange(4, vocab_size) for _ in range(PROMPT_LEN - 1)]
        for _ in range(BATCH)
    ]


# --- the engines: one interpreter each, all started before any timing ---------


def probe(model) -> dict[str, Any]:
    """Runs inside the engine's worker: which code serves, and what it fused."""
    import inspect
    from collections import Counter

    layers = Counter(type(m).__name__ for m in model.modules())
    wanted = ("QKVParallelLinear", "MergedColumnParallelLinear", "RMSNorm", "Linear")
    return dict(
        model_class=type(model).__qualname__,
        model_file=inspect.getfile(type(model)),
        layers={name: layers[name] for name in wanted if layers[name]},
    )


_PROFILER: list[Any] = []


def profile_start(model) -> bool:
    """Runs inside the engine's worker: start recording the ops it runs."""
    import torch

    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    profiler.__enter__()
    _PROFILER.append(profiler)
    return True


def profile_stop(model) -> list[tuple[str, float, int]]:
    """Runs inside the engine's worker: stop recording; (op, self CPU ms, calls), most
    expensive first."""
    profiler = _PROFILER.pop()
    profiler.__exit__(None, None, None)
    rows = [
        (e.key, e.self_cpu_time_total / 1e3, e.count) for e in profiler.key_averages()
    ]
    return sorted(rows, key=lambda row: -row[1])[:PROFILE_ROWS]


def engine_main(spec_file: str) -> None:
    """One engine: start, warm up, connect back, then time batches on request.

    The orchestrator sends `("run", n)` (time `n` batches), `("probe",)`, `("profile",)`
    (one batch under the torch profiler: the ops the worker spent its time in) or
    `("quit",)`. An idle engine sleeps (vLLM's workers stop spinning after a second
    without work), so the engines not being timed do not disturb the one that is."""
    from multiprocessing.connection import Client

    spec = json.loads(Path(spec_file).read_text())
    started = time.perf_counter()
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=spec["model"],
        model_impl=spec["model_impl"],
        dtype=spec["dtype"],
        seed=0,
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=BATCH,
        kv_cache_memory_bytes=KV_CACHE_BYTES,
        skip_tokenizer_init=True,
        enforce_eager=spec["enforce_eager"],
    )
    start_s = time.perf_counter() - started
    params = SamplingParams(
        temperature=0.0,
        max_tokens=spec["max_tokens"],
        ignore_eos=True,
        detokenize=False,
    )
    batch = [{"prompt_token_ids": ids} for ids in spec["prompts"]]

    started = time.perf_counter()
    llm.generate(batch, params, use_tqdm=False)
    warmup_s = time.perf_counter() - started

    connection = Client(spec["address"], authkey=bytes.fromhex(spec["authkey"]))
    connection.send(dict(start_s=start_s, warmup_s=warmup_s))
    while True:
        command = connection.recv()
        if command[0] == "run":
            runs = []
            for _ in range(command[1]):
                load = os.getloadavg()[0]
                started = time.perf_counter()
                outputs = llm.generate(batch, params, use_tqdm=False)
                seconds = time.perf_counter() - started
                tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
                runs.append(
                    dict(
                        seconds=seconds,
                        tokens=tokens,
                        tok_s=tokens / seconds,
                        load=load,
                    )
                )
            connection.send(runs)
        elif command[0] == "probe":
            # `benchmark_backend` (not `__main__`) is importable in the worker
            # (PYTHONPATH).
            import benchmark_backend

            probed = llm.apply_model(benchmark_backend.probe)
            connection.send(probed[0] if probed else None)
        elif command[0] == "profile":
            import benchmark_backend

            llm.apply_model(benchmark_backend.profile_start)
            started = time.perf_counter()
            llm.generate(batch, params, use_tqdm=False)
            seconds = time.perf_counter() - started
            rows = llm.apply_model(benchmark_backend.profile_stop)[0]
            connection.send(dict(seconds=seconds, ops=rows))
        else:
            break
    connection.close()
    del llm


class Engine:
    """A running engine subprocess for one variant, and the line to talk to it."""

    def __init__(
        self, variant: str, spec: dict[str, Any], log_file: Path, folder: Path
    ):
        import secrets
        from multiprocessing.connection import Listener

        self.variant = variant
        self.log_file = log_file
        authkey = secrets.token_bytes(16)
        self.listener = Listener(str(folder / f"{variant}.sock"), authkey=authkey)
        spec_file = folder / f"{variant}.json"
        spec_file.write_text(
            json.dumps(
                dict(
                    spec,
                    model_impl=VARIANTS[variant]["model_impl"],
                    address=self.listener.address,
                    authkey=authkey.hex(),
                )
            )
        )
        env = dict(os.environ)
        env["VLLM_TRANSFORMERS_BACKEND"] = VARIANTS[variant]["backend"]
        env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # apply_model ships `probe`
        env.setdefault("VLLM_LOGGING_LEVEL", "INFO")
        env["PYTHONPATH"] = os.pathsep.join(
            [str(HERE), *filter(None, [env.get("PYTHONPATH")])]
        )
        self.started = time.monotonic()
        with open(log_file, "w") as log:
            self.process = subprocess.Popen(
                [PYTHON, str(Path(__file__).resolve()), "engine", str(spec_file)],
                env=env,
                cwd=folder,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self.connection = None

    def wait_ready(self, timeout: float = ENGINE_TIMEOUT) -> dict[str, Any]:
        """Block until the engine has started and warmed up; return its report."""
        import threading

        accepted: list[Any] = []
        thread = threading.Thread(
            target=lambda: accepted.append(self.listener.accept()), daemon=True
        )
        thread.start()
        deadline = time.monotonic() + timeout
        while thread.is_alive():
            thread.join(1)
            if self.process.poll() is not None and not accepted:
                self.fail(f"exited with {self.process.returncode} before it was ready")
            if time.monotonic() > deadline:
                self.fail(f"not ready after {timeout:.0f} s")
        self.connection = accepted[0]
        ready = self._receive(timeout)
        ready["wall_s"] = time.monotonic() - self.started
        return ready

    def ask(self, *command: Any, timeout: float = 300) -> Any:
        self.connection.send(command)
        return self._receive(timeout)

    def _receive(self, timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        while not self.connection.poll(1):
            if self.process.poll() is not None:
                self.fail(f"exited with {self.process.returncode}")
            if time.monotonic() > deadline:
                self.fail(f"no answer in {timeout:.0f} s")
        return self.connection.recv()

    def fail(self, why: str) -> None:
        tail = "\n".join(self.log_file.read_text(errors="replace").splitlines()[-40:])
        self.stop()
        raise RuntimeError(f"{self.variant} engine {why}; log {self.log_file}:\n{tail}")

    def stop(self) -> None:
        """Ask the engine to quit, then clear its whole process group."""
        import signal

        if self.connection is not None and self.process.poll() is None:
            try:
                self.connection.send(("quit",))
                self.process.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                pass
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.process.pid, sig)  # its engine core and workers too
            except ProcessLookupError:
                break
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self.listener.close()


def throughput(
    args: argparse.Namespace, log_dir: Path, deadline: float
) -> dict[str, Any]:
    """Start the three engines one after another (each warms up), then time batches on
    them in rounds, the order rotated each round, until `args.rounds` rounds are done or
    another would end after `deadline` (a `time.monotonic()` value)."""
    model = checkpoint(args.dtype, args.model)
    spec = dict(
        model=str(model),
        dtype=args.dtype,
        prompts=prompts(MODEL["vocab_size"]),
        max_tokens=MAX_TOKENS,
        enforce_eager=args.eager,
    )
    names = list(VARIANTS)
    engines: dict[str, Engine] = {}
    starts: dict[str, dict[str, Any]] = {}
    rounds: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    note = None
    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        try:
            for name in names:
                engines[name] = Engine(
                    name, spec, log_dir / f"engine-{name}.log", Path(tmp)
                )
                starts[name] = engines[name].wait_ready()
                starts[name]["probe"] = engines[name].ask("probe")
                print(
                    f"  {name:>6}: started in {starts[name]['wall_s']:.0f} s "
                    f"({starts[name]['probe']['model_class']})",
                    flush=True,
                )
            round_seconds: list[float] = []
            for index in range(args.rounds):
                if round_seconds and time.monotonic() + max(round_seconds) > deadline:
                    note = (
                        f"stopped after {index} of {args.rounds} rounds: time budget "
                        f"({args.budget:.0f} s)"
                    )
                    print(f"  {note}", flush=True)
                    break
                round_started = time.monotonic()
                shift = index % len(names)
                for name in names[shift:] + names[:shift]:
                    runs = engines[name].ask("run", BATCHES_PER_ROUND)
                    rounds[name].append(
                        dict(
                            round=index, tok_s=max(r["tok_s"] for r in runs), runs=runs
                        )
                    )
                round_seconds.append(time.monotonic() - round_started)
                print(
                    f"  round {index + 1:>2}/{args.rounds}: "
                    + ", ".join(f"{n} {rounds[n][-1]['tok_s']:6.0f}" for n in names)
                    + f" tok/s (load avg {os.getloadavg()[0]:.1f})",
                    flush=True,
                )
            # Where the time goes, per op: batches under the profiler, taking turns like
            # the rounds; the fastest of each engine's is the least disturbed.
            profiled: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
            for index in range(PROFILED_BATCHES):
                shift = index % len(names)
                for name in names[shift:] + names[:shift]:
                    profiled[name].append(engines[name].ask("profile"))
            profiles = {n: min(profiled[n], key=lambda p: p["seconds"]) for n in names}
        finally:
            for engine in engines.values():
                engine.stop()
        print_profiles(profiles)

    medians = {n: statistics.median(r["tok_s"] for r in rounds[n]) for n in names}

    def paired(a: str, b: str) -> list[float]:
        return [x["tok_s"] / y["tok_s"] for x, y in zip(rounds[a], rounds[b])]

    return dict(
        model=dict(
            MODELS[args.model],
            model_type=args.model,
            dtype=args.dtype,
            path=os.path.relpath(model, REPO),
        ),
        batch=BATCH,
        prompt_len=PROMPT_LEN,
        max_tokens=MAX_TOKENS,
        batches_per_round=BATCHES_PER_ROUND,
        metric=(
            "output tokens/s; per engine and round, the best of its timed batches; "
            "medians over rounds"
        ),
        rounds=len(rounds["this"]),
        note=note,
        enforce_eager=args.eager,
        starts=starts,
        per_round={n: rounds[n] for n in names},
        median_tok_s=medians,
        ratio={
            "this/native": medians["this"] / medians["native"],
            "this/stock": medians["this"] / medians["stock"],
        },
        paired_ratios={
            "this/native": paired("this", "native"),
            "this/stock": paired("this", "stock"),
        },
        median_paired_ratio={
            "this/native": statistics.median(paired("this", "native")),
            "this/stock": statistics.median(paired("this", "stock")),
        },
        profiles=profiles,
    )


def print_profiles(profiles: dict[str, dict[str, Any]]) -> None:
    """The most expensive ops of one profiled batch, side by side (self CPU ms,
    calls)."""
    names = list(profiles)
    table = {
        n: {op: (ms, calls) for op, ms, calls in profiles[n]["ops"]} for n in names
    }
    ops = sorted(
        {op for n in names for op, *_ in profiles[n]["ops"][:PRINTED_OPS]},
        key=lambda op: -max(table[n].get(op, (0, 0))[0] for n in names),
    )
    print("  fastest profiled batch, self CPU ms (calls) per op:")
    print("    " + f"{'op':<44}" + "".join(f"{n:>18}" for n in names))
    for op in ops:
        cells = [
            f"{table[n][op][0]:.1f} ({table[n][op][1]})" if op in table[n] else "-"
            for n in names
        ]
        print(f"    {op[:44]:<44}" + "".join(f"{cell:>18}" for cell in cells))
    print(
        "    "
        + f"{'(batch wall time, profiled)':<44}"
        + "".join(f"{profiles[n]['seconds'] * 1e3:>15.0f} ms" for n in names),
        flush=True,
    )


# --- fuser detection, in one process ------------------------------------------


def _clear_caches() -> None:
    """Forget every fuser verdict and every per-class analysis this process made."""
    from vllm.model_executor.models.transformers import fuser, rewriting, tracing

    fuser.clear_cache()
    for module in (rewriting, tracing):
        for value in vars(module).values():
            if callable(getattr(value, "cache_clear", None)):
                value.cache_clear()


def _vllm_config(layers: int, folder: str):
    from transformers import LlamaConfig
    from vllm.config import DeviceConfig, LoadConfig, ModelConfig, VllmConfig

    config = LlamaConfig(
        **dict(MODEL, num_hidden_layers=layers), architectures=["LlamaForCausalLM"]
    )
    config.save_pretrained(folder)
    model_config = ModelConfig(
        model=folder, model_impl="transformers", skip_tokenizer_init=True, dtype=DTYPE
    )
    return VllmConfig(
        model_config=model_config,
        device_config=DeviceConfig("cpu"),
        load_config=LoadConfig(load_format="dummy"),
    )


def detect_once(layers: int) -> dict[str, Any]:
    """Time the registry alone, then the whole backend construction, on `meta`."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.utils.torch_utils import set_default_torch_dtype

    from vllm.model_executor.models import transformers as backend
    from vllm.model_executor.models.transformers import fusion_report
    from vllm.model_executor.models.transformers.base import build_hf_model
    from vllm.model_executor.models.transformers.fuser import Fusers, get_fusers

    result: dict[str, Any] = dict(layers=layers)
    with tempfile.TemporaryDirectory() as folder:
        # The registry alone, over the real HF model the backend builds.
        vllm_config = _vllm_config(layers, folder)
        with (
            set_current_vllm_config(vllm_config),
            set_default_torch_dtype(vllm_config.model_config.dtype),
            torch.device("meta"),
        ):
            hf_model = build_hf_model(vllm_config)
            _clear_caches()
            started = time.perf_counter()
            fusers = Fusers(hf_model.base_model, vllm_config)
            result["detect_s"] = time.perf_counter() - started
            result["modules_with_fusers"] = len(fusers)
            # Distinct (class, children) keys the registry analysed: constant in depth.
            result["keys_analysed"] = len(get_fusers.cache)
        del hf_model, fusers

        # The whole construction (HF build on meta, fusers, vLLM layers, attention).
        vllm_config = _vllm_config(layers, folder)
        with (
            fusion_report.collect(f"llama-{layers}") as report,
            set_current_vllm_config(vllm_config),
            set_default_torch_dtype(vllm_config.model_config.dtype),
            torch.device("meta"),
        ):
            _clear_caches()
            started = time.perf_counter()
            backend.TransformersForCausalLM(vllm_config=vllm_config)
            result["construct_s"] = time.perf_counter() - started
        result["applied"] = {
            f"{cls}.{fuser}": count
            for cls, cls_report in sorted(report.classes.items())
            for fuser, count in sorted(cls_report.applied.items())
        }
    return result


def detect_main(out_file: str) -> None:
    import logging

    logging.getLogger("vllm").setLevel(logging.WARNING)
    from vllm.model_executor.models.transformers.report import vllm_runtime

    rows = []
    with vllm_runtime():
        detect_once(DETECT_LAYERS[0])  # imports, first-touch: not measured
        for layers in DETECT_LAYERS:
            samples = [detect_once(layers) for _ in range(DETECT_REPEATS)]
            rows.append(
                dict(
                    samples[-1],
                    detect_s=statistics.median(s["detect_s"] for s in samples),
                    construct_s=statistics.median(s["construct_s"] for s in samples),
                    detect_samples=[s["detect_s"] for s in samples],
                    construct_samples=[s["construct_s"] for s in samples],
                )
            )
    base = rows[0]
    for row in rows:
        row["detect_ratio"] = row["detect_s"] / base["detect_s"]
        row["construct_ratio"] = row["construct_s"] / base["construct_s"]
    Path(out_file).write_text(json.dumps(rows))


def detection(log_dir: Path) -> list[dict[str, Any]]:
    env = dict(os.environ, VLLM_TRANSFORMERS_BACKEND="project")
    with tempfile.TemporaryDirectory(prefix="bench-detect-") as tmp:
        out_file = Path(tmp) / "out.json"
        log_file = log_dir / "detect.log"
        with open(log_file, "w") as log:
            process = subprocess.run(  # noqa: PLW1510 - the return code is checked
                [PYTHON, str(Path(__file__).resolve()), "detect", str(out_file)],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                timeout=600,
            )
        if process.returncode != 0 or not out_file.is_file():
            tail = "\n".join(log_file.read_text(errors="replace").splitlines()[-40:])
            raise RuntimeError(f"detection failed ({process.returncode}):\n{tail}")
        return json.loads(out_file.read_text())


# --- output --------------------------------------------------------------------


LABELS = {
    "this": "this backend (`transformers`)",
    "native": "vLLM native (`vllm`)",
    "stock": "vLLM stock backend (`transformers`, stock)",
}


def markdown(summary: dict[str, Any]) -> str:
    """The tables the README quotes."""
    lines = []
    tp = summary.get("throughput")
    if tp:
        m = tp["model"]
        compilation = "eager" if tp["enforce_eager"] else "default compilation"
        lines += [
            (
                f"Throughput on the CPU engine ({summary['machine']['cpus']} shared "
                f"cores), random {m.get('model_type', 'llama')} "
                f"({m['num_hidden_layers']} layers, hidden "
                f"{m['hidden_size']}, vocab {m['vocab_size']}, {m['dtype']}), "
                f"{tp['batch']} prompts x {tp['max_tokens']} output tokens, "
                f"{compilation}; the three engines alternate over {tp['rounds']} "
                f"rounds, each round's number is the best of "
                f"{tp['batches_per_round']} timed batches:"
            ),
            "",
            (
                "| implementation | output tok/s (median) | range over rounds "
                "| this / it (median of rounds) |"
            ),
            "|---|---:|---:|---:|",
        ]
        for name, label in LABELS.items():
            values = [r["tok_s"] for r in tp["per_round"][name]]
            ratio = tp["median_paired_ratio"].get(f"this/{name}", 1.0)
            lines.append(
                f"| {label} | {tp['median_tok_s'][name]:.0f} "
                f"| {min(values):.0f}-{max(values):.0f} | {ratio:.2f} |"
            )
        lines.append("")
    det = summary.get("detection")
    if det:
        lines += [
            (
                "Fuser detection on `meta` (Llama, registry and fx caches cleared, "
                f"median of {DETECT_REPEATS}):"
            ),
            "",
            (
                "| layers | detection (ms) | vs 2 layers | module keys analysed "
                "| whole construction (ms) | vs 2 layers |"
            ),
            "|---:|---:|---:|---:|---:|---:|",
        ]
        for row in det:
            lines.append(
                f"| {row['layers']} | {row['detect_s'] * 1e3:.1f} "
                f"| {row['detect_ratio']:.2f} | {row['keys_analysed']} "
                f"| {row['construct_s'] * 1e3:.0f} | {row['construct_ratio']:.2f} |"
            )
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    if argv[:1] == ["engine"]:
        return engine_main(argv[1])
    if argv[:1] == ["detect"]:
        return detect_main(argv[1])

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--rounds", type=int, default=20, help="A/B/C rounds (default 20)"
    )
    parser.add_argument(
        "--budget",
        type=float,
        default=660,
        help="seconds for the whole run: no round starts that would end past it "
        "(default 660)",
    )
    parser.add_argument(
        "--model",
        default="llama",
        choices=sorted(MODELS),
        help="the random model whose throughput is measured (default llama)",
    )
    parser.add_argument("--dtype", default=DTYPE, choices=["bfloat16", "float32"])
    parser.add_argument(
        "--eager", action="store_true", help="enforce_eager for all three"
    )
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--skip-detection", action="store_true")
    parser.add_argument("--out", type=Path, default=CACHE / "latest.json")
    args = parser.parse_args(argv)

    started = time.monotonic()
    log_dir = CACHE / "logs" / time.strftime("%Y%m%d-%H%M%S")
    log_dir.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = dict(
        date=time.strftime("%Y-%m-%d %H:%M:%S"),
        machine=dict(
            cpus=os.cpu_count(),
            processor=platform.processor() or platform.machine(),
            load_at_start=os.getloadavg(),
        ),
        logs=os.path.relpath(log_dir, REPO),
    )
    try:
        import torch
        import transformers

        import vllm

        summary["versions"] = dict(
            vllm=vllm.__version__,
            torch=torch.__version__,
            transformers=transformers.__version__,
        )
    except ImportError:
        pass

    if not args.skip_detection:
        print("Fuser detection on meta ...", flush=True)
        summary["detection"] = detection(log_dir)
        for row in summary["detection"]:
            print(
                f"  {row['layers']:>3} layers: detection "
                f"{row['detect_s'] * 1e3:7.1f} ms (x{row['detect_ratio']:.2f}, "
                f"{row['keys_analysed']} module keys analysed), construction "
                f"{row['construct_s'] * 1e3:7.0f} ms (x{row['construct_ratio']:.2f})",
                flush=True,
            )
    if not args.skip_throughput:
        print(f"Throughput ({args.rounds} rounds, {args.dtype}) ...", flush=True)
        summary["throughput"] = throughput(args, log_dir, started + args.budget)
        tp = summary["throughput"]
        print(
            "  medians: "
            + ", ".join(f"{n} {v:.0f}" for n, v in tp["median_tok_s"].items())
            + " tok/s; ratios of medians: "
            + ", ".join(f"{k} {v:.2f}" for k, v in tp["ratio"].items())
            + "; per round: "
            + "; ".join(
                f"{k} " + " ".join(f"{x:.2f}" for x in v)
                for k, v in tp["paired_ratios"].items()
            ),
            flush=True,
        )
    summary["seconds"] = time.monotonic() - started
    summary["machine"]["load_at_end"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=1))
    print()
    print(markdown(summary))
    print(f"\nSummary: {args.out} ({summary['seconds']:.0f} s)")


if __name__ == "__main__":
    main(sys.argv[1:])
