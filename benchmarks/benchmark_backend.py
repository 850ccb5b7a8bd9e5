# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Benchmark the Transformers modeling backend against vLLM's own implementations.

One run measures, side by side, for each random model (`--models`: Llama, Qwen3 with
q/k norms, Gemma 2 with soft-capping and sliding windows, Phi-3 with packed qkv, a
Qwen3-MoE, and a Granite 4.0 H hybrid of Mamba-2 mixers and attention, which vLLM's
stock backend refuses, so it is measured beside native only) and each mode (`--modes`: eager, and vLLM's default compilation):

1. **Throughput** on the CPU engine, served three ways:
     - `this`:   this project's backend    (`model_impl="transformers"`)
     - `native`: vLLM's hand-written model (`model_impl="vllm"`)
     - `stock`:  vLLM's stock backend      (`model_impl="transformers"`,
                 `VLLM_TRANSFORMERS_BACKEND=stock`)
   Each engine runs in its own subprocess. All three start (and warm up) first and
   stay up; then they take turns timing the same fixed batch of prompts (greedy,
   `ignore_eos=True`), round after round with the order rotated, so drift in the
   machine's load (other people's tests share its cores) hits each alike. An idle
   engine sleeps, so it does not disturb the one being timed. Each turn times the
   whole generation (`MAX_TOKENS` out) and the prefill alone (one token out):
   generation tok/s = output tokens / whole; prefill tok/s = prompt tokens / prefill;
   decode tok/s = the other output tokens / (whole - prefill). Ratios to native are
   medians of the per-round ratios. Inside the worker, each decode step's model
   forward is timed as well (the model alone, no engine around it); a turn's number
   is the tenth percentile of its steps, which a busy machine disturbs far less than
   a whole batch. `--size tiny` (hidden 128) leaves the matmuls out of it: what
   remains is each implementation's per-layer Python.
2. **Engine start**, cold (a fresh compile cache, `VLLM_CACHE_ROOT`) and warm (a
   second start of the same engine on the cache the first one left), compiled mode.
3. **Construction** on the `meta` device, per implementation, in one process each:
   the whole model built for Llama configs of 2, 8, 32 and 128 layers (the best of
   three builds each), its ratio to native's (the fixed cost shows at 2 and 8
   layers) and the objects tracked by the garbage collector it leaves alive; per
   layer is the slope between 2 and 128 layers. For this backend also the fuser
   detection time (`FusionPlan(...)`, every cache cleared first), which should not
   grow with depth.
4. **Whole engine start**: `LLM(...)` of this backend and of vLLM's native Llama
   taking turns (`--start-rounds` each, per mode), each in a fresh interpreter with
   the engine in it (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), a tiny Llama of 8 layers
   on dummy weights: the medians, this backend's difference to native's, vLLM's
   "Initializing model took", and the full garbage collections during the start.

It writes a JSON summary to `.cache/benchmarks/latest.json`, prints markdown tables
for the README and plots the ratios to native (`.cache/benchmarks/latest.png`,
matplotlib, which `scripts/benchmark.sh` installs; the tests do not need it).

    bash scripts/benchmark.sh                          # everything (about an hour)
    bash scripts/benchmark.sh --models llama --modes eager --rounds 3   # quicker
    bash scripts/benchmark.sh --skip-throughput        # construction and starts
    bash scripts/benchmark.sh --skip-throughput --skip-construction --modes eager
                                                       # eager engine starts only
    bash scripts/benchmark.sh --size tiny --modes eager --skip-construction
                                                       # per-layer overhead
    bash scripts/benchmark.sh --dtype float32 --profile   # + ops of one batch each

Runs made part by part (`--out` each) merge into one summary, tables and plot:

    .venv/bin/python benchmarks/benchmark_backend.py merge OUT.json PART.json ...

The script also runs its own pieces in subprocesses (`engine SPEC`, `construct
VARIANT OUT`, `start SPEC`); those forms are internal.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import random
import re
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
"""The medium random Qwen3-MoE: the Llama's attention with q/k norms, and 16 experts
of width 512, four per token, in every layer."""

MODELS: dict[str, dict[str, Any]] = {
    "llama": MODEL,
    "qwen3": dict(MODEL, head_dim=64),  # q/k norms
    "gemma2": dict(
        MODEL,
        head_dim=64,
        query_pre_attn_scalar=64,
        sliding_window=64,  # shorter than prompt + output: the window matters
        layer_types=["sliding_attention", "full_attention"] * 3,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
        tie_word_embeddings=True,  # vLLM's native Gemma 2 has no separate head
    ),
    "phi3": MODEL,  # packed qkv_proj and gate_up_proj in the checkpoint
    "qwen3_moe": MOE_MODEL,
    # Granite 4.0 H: Mamba-2 mixers (24 heads of 64, one B/C group, state 64) in
    # layers 0, 2, 4 and attention in 1, 3, 5; in every layer 16 experts of width
    # 512 (four per token) beside a shared MLP.
    "granitemoehybrid": dict(
        MODEL,
        layer_types=["mamba", "attention"] * 3,
        mamba_n_heads=24,
        mamba_d_head=64,
        mamba_d_state=64,
        mamba_n_groups=1,
        num_local_experts=16,
        num_experts_per_tok=4,
        intermediate_size=512,
        shared_intermediate_size=1024,
    ),
    # Qwen3-Next (bfloat16 only on the CPU: vLLM's gated-delta-net kernels): gated
    # delta nets (4 key heads shared by 8 value heads, each of 128) in layers 0, 2,
    # 4, attention with a gated query in 1, 3, 5; in every layer 16 experts of
    # width 512 (four per token) beside a gated shared expert.
    "qwen3_next": dict(
        MOE_MODEL,
        layer_types=["linear_attention", "full_attention"] * 3,
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        shared_expert_intermediate_size=512,
    ),
}
"""`--models` -> the config of the random model benchmarked."""
PREFIX_CACHING_OFF = frozenset({"granitemoehybrid"})
"""Model types every engine runs without prefix caching: on the CPU this backend
serves Mamba-2 mixers only without it (vLLM's layer fails with it on a long prompt,
native alike)."""
STOCK_REFUSES = frozenset({"granitemoehybrid", "qwen3_next"})
"""Model types vLLM's stock backend refuses (the hybrids): measured beside native
only."""

SIZES: dict[str, dict[str, Any]] = {
    "medium": {},
    "tiny": dict(
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        query_pre_attn_scalar=32,
    ),
}
"""`--size` -> what changes in each model's config. Tiny keeps the depth, the batch
and every module but makes the matmuls vanish: what is left of a decode step is the
engine's Python and the model's (the same engine for all three, so the difference
is the model's per-layer overhead). Keys a model type does not have are dropped."""


def model_config(model_type: str, size: str) -> dict[str, Any]:
    """The config kwargs of the random `model_type` of `size`."""
    config = dict(MODELS[model_type])
    config.update({k: v for k, v in SIZES[size].items() if k in config})
    return config

MODES = {"eager": True, "compiled": False}
"""`--modes` -> `enforce_eager`."""

MODEL_SEED = 0


def default_dtype() -> str:
    """bfloat16 where the CPU computes it (AVX512-BF16 or AMX: oneDNN matmuls, and
    decoding is bound by weight traffic, which bf16 halves); float32 elsewhere, where
    bf16 matmuls are emulated and take most of the step (87% of a decode step on a
    2-core AVX2 host, 2026-12-05), hiding every other difference between the three."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return "bfloat16"
    return "bfloat16" if {"avx512_bf16", "amx_bf16"} & set(flags) else "float32"


DTYPE = default_dtype()

BATCH = 32
PROMPT_LEN = 32
MAX_TOKENS = 64
MAX_MODEL_LEN = 256
BATCHES_PER_ROUND = 2
"""Timed `generate` calls of the whole batch (and as many of the prefill alone) per
engine and round; the best of them is the engine's number for that round (other work
on the machine only ever slows a call down, so the best call is the least disturbed
one)."""
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
PER_LAYER = (2, 128)
"""Construction per layer: the slope between these two depths (the widest apart, so
a millisecond of noise at either end moves it least)."""

ENGINE_TIMEOUT = 420.0

START_LAYERS = 8
START_ROUNDS = 3
START_VARIANTS = ("this", "native")
INIT_MODEL_LOG = r"Initializing model took ([0-9.]+) seconds"
"""Whole engine starts: the tiny Llama of `START_LAYERS` layers (dummy weights, so
reading a checkpoint is not in it), `START_ROUNDS` starts of each variant, taking
turns, each in a fresh interpreter with the engine in that process."""


# --- the checkpoint ------------------------------------------------------------


def checkpoint(
    dtype: str, model_type: str = "llama", size: str = "medium", layers: int = 0
) -> Path:
    """Build (or reuse) the random `model_type` checkpoint of `size` (and of
    `layers` layers, where given), saved in `dtype`."""
    import hashlib

    config_kwargs = model_config(model_type, size)
    if layers:
        config_kwargs["num_hidden_layers"] = layers
    recipe = json.dumps(
        dict(model=config_kwargs, seed=MODEL_SEED, dtype=dtype), sort_keys=True
    )
    if model_type != "llama":  # the Llama's stamp predates the other models
        recipe += model_type
    stamp = hashlib.sha256(recipe.encode()).hexdigest()[:12]
    target = CACHE / "models" / f"{model_type}-{size}-{dtype}-{stamp}"
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


_DECODE_STEPS: list[float] = []


def time_decode_steps(worker) -> bool:
    """Runs inside the engine's worker: record how long each decode step's model
    forward takes (the runner's `_model_forward`, the model alone: no scheduling, no
    sampling, no messages between the engine's processes), for the steps that run
    one token of each of the batch's sequences."""
    forward = worker.model_runner._model_forward

    def timed(*args, **kwargs):
        started = time.perf_counter()
        output = forward(*args, **kwargs)
        positions = kwargs.get("positions")
        if positions is not None and positions.shape[-1] == BATCH:
            _DECODE_STEPS.append(time.perf_counter() - started)
        return output

    worker.model_runner._model_forward = timed
    return True


def decode_steps(worker) -> list[float]:
    """Runs inside the engine's worker: the decode steps timed since the last call."""
    steps = list(_DECODE_STEPS)
    _DECODE_STEPS.clear()
    return steps


def engine_main(spec_file: str) -> None:
    """One engine: start, warm up, connect back, then time batches on request.

    The orchestrator sends `("run", n)` (time `n` whole batches and `n` prefills),
    `("probe",)`, `("profile",)` (one batch under the torch profiler: the ops the
    worker spent its time in) or `("quit",)`. An idle engine sleeps (vLLM's workers
    stop spinning after a second without work), so the engines not being timed do
    not disturb the one that is."""
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
        enable_prefix_caching=spec["prefix_caching"],
    )
    start_s = time.perf_counter() - started

    def sampling(max_tokens: int) -> SamplingParams:
        return SamplingParams(
            temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False
        )

    params, prefill = sampling(spec["max_tokens"]), sampling(1)
    batch = [{"prompt_token_ids": ids} for ids in spec["prompts"]]

    def timed(sampling_params: SamplingParams) -> dict[str, float]:
        load = os.getloadavg()[0]
        started = time.perf_counter()
        outputs = llm.generate(batch, sampling_params, use_tqdm=False)
        seconds = time.perf_counter() - started
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        return dict(seconds=seconds, tokens=tokens, load=load)

    started = time.perf_counter()
    llm.generate(batch, params, use_tqdm=False)
    warmup_s = time.perf_counter() - started
    # `benchmark_backend` (not `__main__`) is importable in the worker (PYTHONPATH).
    import benchmark_backend

    llm.collective_rpc(benchmark_backend.time_decode_steps)

    connection = Client(spec["address"], authkey=bytes.fromhex(spec["authkey"]))
    connection.send(dict(start_s=start_s, warmup_s=warmup_s))
    while True:
        command = connection.recv()
        if command[0] == "run":
            llm.collective_rpc(benchmark_backend.decode_steps)
            runs = [timed(params) for _ in range(command[1])]
            steps = llm.collective_rpc(benchmark_backend.decode_steps)[0]
            prefills = [timed(prefill) for _ in range(command[1])]
            connection.send(dict(runs=runs, prefills=prefills, steps=steps))
        elif command[0] == "probe":
            probed = llm.apply_model(benchmark_backend.probe)
            connection.send(probed[0] if probed else None)
        elif command[0] == "profile":
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
        self,
        variant: str,
        spec: dict[str, Any],
        log_file: Path,
        folder: Path,
        cache_root: Path,
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
        env["VLLM_CACHE_ROOT"] = str(cache_root)  # its own compile cache
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


def _best(runs: list[dict[str, Any]]) -> float:
    return min(r["seconds"] for r in runs)


STEP_QUANTILE = 0.1
"""Which of a turn's timed decode steps is its number: the tenth percentile, so a
step that other work on the machine slowed down does not count, and a lone fast
outlier does not either."""


def round_numbers(answer: dict[str, Any], prompt_tokens: int) -> dict[str, Any]:
    """One engine's turn in a round: the best whole batch and the best prefill, and
    the model forward of a decode step (`STEP_QUANTILE` of the turn's steps)."""
    whole, prefill = _best(answer["runs"]), _best(answer["prefills"])
    tokens = answer["runs"][0]["tokens"]
    steps = sorted(answer["steps"])
    if not steps:
        raise RuntimeError(
            "the worker timed no decode step of the whole batch (did the runner's "
            "`_model_forward` stop taking `positions=` by keyword?)"
        )
    return dict(
        model_step_s=steps[int(len(steps) * STEP_QUANTILE)],
        generate_tok_s=tokens / whole,
        prefill_tok_s=prompt_tokens / prefill,
        # The first output token comes with the prefill.
        decode_tok_s=(tokens - BATCH) / max(whole - prefill, 1e-9),
        load=statistics.mean(r["load"] for r in answer["runs"]),
        **answer,
    )


METRICS = ("generate_tok_s", "prefill_tok_s", "decode_tok_s")


def measure(
    args: argparse.Namespace,
    model_type: str,
    mode: str,
    log_dir: Path,
) -> dict[str, Any]:
    """Start the three engines one after another on fresh compile caches (each warms
    up), then time batches on them in rounds, the order rotated each round, until
    `args.rounds` rounds are done or another would end more than `args.budget`
    seconds after the first began. Compiled, each engine then starts once more on
    the cache its first start left (warm)."""
    model = checkpoint(args.dtype, model_type, args.size)
    spec = dict(
        model=str(model),
        dtype=args.dtype,
        prompts=prompts(MODEL["vocab_size"]),
        max_tokens=MAX_TOKENS,
        enforce_eager=MODES[mode],
        prefix_caching=model_type not in PREFIX_CACHING_OFF,
    )
    prompt_tokens = BATCH * PROMPT_LEN
    names = [n for n in VARIANTS if n != "stock" or model_type not in STOCK_REFUSES]
    engines: dict[str, Engine] = {}
    starts: dict[str, dict[str, Any]] = {}
    rounds: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    profiles: dict[str, dict[str, Any]] = {}
    note = None
    tag = f"{model_type}-{mode}"
    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        caches = {n: Path(tmp) / f"cache-{n}" for n in names}

        def start(name: str, which: str) -> dict[str, Any]:
            engines[name] = Engine(
                name,
                spec,
                log_dir / f"engine-{tag}-{name}-{which}.log",
                Path(tmp),
                caches[name],
            )
            ready = engines[name].wait_ready()
            print(
                f"  {name:>6}: {which} start {ready['wall_s']:.0f} s "
                f"(in the engine {ready['start_s']:.0f} s; load "
                f"{os.getloadavg()[0]:.1f})",
                flush=True,
            )
            return ready

        try:
            for name in names:
                starts[name] = dict(cold=start(name, "cold"))
                starts[name]["probe"] = engines[name].ask("probe")
            deadline = time.monotonic() + args.budget
            round_seconds: list[float] = []
            for index in range(args.rounds):
                if round_seconds and time.monotonic() + max(round_seconds) > deadline:
                    note = f"stopped after {index} of {args.rounds} rounds: time budget"
                    print(f"  {note}", flush=True)
                    break
                round_started = time.monotonic()
                shift = index % len(names)
                for name in names[shift:] + names[:shift]:
                    answer = engines[name].ask("run", BATCHES_PER_ROUND)
                    rounds[name].append(
                        dict(round=index, **round_numbers(answer, prompt_tokens))
                    )
                round_seconds.append(time.monotonic() - round_started)
                print(
                    f"  round {index + 1:>2}/{args.rounds}: "
                    + ", ".join(
                        f"{n} {rounds[n][-1]['generate_tok_s']:5.0f} "
                        f"(prefill {rounds[n][-1]['prefill_tok_s']:5.0f}, decode "
                        f"{rounds[n][-1]['decode_tok_s']:4.0f}, model step "
                        f"{rounds[n][-1]['model_step_s'] * 1e3:.2f} ms)"
                        for n in names
                    )
                    + f" tok/s (load avg {os.getloadavg()[0]:.1f})",
                    flush=True,
                )
            if args.profile:
                # Where the time goes, per op, taking turns like the rounds; the
                # fastest of each engine's is the least disturbed.
                profiled: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
                for index in range(PROFILED_BATCHES):
                    shift = index % len(names)
                    for name in names[shift:] + names[:shift]:
                        profiled[name].append(engines[name].ask("profile"))
                profiles = {
                    n: min(profiled[n], key=lambda p: p["seconds"]) for n in names
                }
            for engine in engines.values():
                engine.stop()
            if not MODES[mode]:
                for name in names:
                    starts[name]["warm"] = start(name, "warm")
                    engines[name].stop()
        finally:
            for engine in engines.values():
                engine.stop()
    if profiles:
        print_profiles(profiles)

    def paired(metric: str, other: str) -> list[float]:
        return [
            x[metric] / y[metric] for x, y in zip(rounds["this"], rounds[other])
        ]

    return dict(
        model=dict(
            model_config(model_type, args.size),
            model_type=model_type,
            size=args.size,
            dtype=args.dtype,
            path=os.path.relpath(model, REPO),
        ),
        mode=mode,
        rounds=len(rounds["this"]),
        note=note,
        starts=starts,
        per_round=rounds,
        median={
            n: {m: statistics.median(r[m] for r in rounds[n]) for m in METRICS}
            for n in names
        },
        # this / other, the median over rounds of each round's ratio
        ratio={
            other: {m: statistics.median(paired(m, other)) for m in METRICS}
            for other in names
            if other != "this"
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


# --- whole engine starts -------------------------------------------------------


def start_main(spec_file: str) -> None:
    """One engine start in this interpreter (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, so
    the engine core and its worker run here too): how long `LLM(...)` takes, and the
    full (oldest-generation) garbage collections during it, which a build that
    leaves many objects alive adds. vLLM logs the model's construction time itself
    ("Initializing model took"): `engine_starts` reads it from the log."""
    spec = json.loads(Path(spec_file).read_text())
    started = time.perf_counter()
    from vllm import LLM

    import_s = time.perf_counter() - started
    full_gcs: list[float] = []
    gc_started = [0.0]

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            gc_started[0] = time.perf_counter()
        else:
            full_gcs.append(time.perf_counter() - gc_started[0])

    gc.callbacks.append(on_gc)
    started = time.perf_counter()
    # Bound until the process exits: a discarded engine would shut down (two more
    # full collections) inside the timed call.
    _engine = LLM(
        model=spec["model"],
        model_impl=spec["model_impl"],
        dtype=spec["dtype"],
        seed=0,
        max_model_len=MAX_MODEL_LEN,
        kv_cache_memory_bytes=KV_CACHE_BYTES,
        skip_tokenizer_init=True,
        load_format="dummy",
        enforce_eager=spec["enforce_eager"],
    )
    start_s = time.perf_counter() - started
    gc.callbacks.remove(on_gc)
    Path(spec["out"]).write_text(
        json.dumps(
            dict(
                import_s=import_s,
                start_s=start_s,
                full_gcs=len(full_gcs),
                full_gc_s=sum(full_gcs),
            )
        )
    )
    # Skip the interpreter's teardown of the engine: nothing is measured after this.
    os._exit(0)


def engine_starts(args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    """`args.start_rounds` starts of this backend and of vLLM's native Llama per
    mode, taking turns (the order swapped each round), each in a fresh interpreter
    on a fresh compile cache; medians, and this backend's difference to native's."""
    model = checkpoint(args.dtype, "llama", "tiny", START_LAYERS)
    results: dict[str, Any] = dict(layers=START_LAYERS, rounds=args.start_rounds)
    for mode in args.modes.split(","):
        runs: dict[str, list[dict[str, Any]]] = {n: [] for n in START_VARIANTS}
        for index in range(args.start_rounds):
            order = START_VARIANTS if index % 2 == 0 else START_VARIANTS[::-1]
            for variant in order:
                with tempfile.TemporaryDirectory(prefix="bench-start-") as tmp:
                    spec_file, out_file = Path(tmp) / "spec.json", Path(tmp) / "out.json"
                    spec_file.write_text(
                        json.dumps(
                            dict(
                                model=str(model),
                                model_impl=VARIANTS[variant]["model_impl"],
                                dtype=args.dtype,
                                enforce_eager=MODES[mode],
                                out=str(out_file),
                            )
                        )
                    )
                    env = dict(
                        os.environ,
                        VLLM_TRANSFORMERS_BACKEND=VARIANTS[variant]["backend"],
                        VLLM_ENABLE_V1_MULTIPROCESSING="0",
                        VLLM_CACHE_ROOT=str(Path(tmp) / "cache"),
                    )
                    log_file = log_dir / f"start-{mode}-{variant}-{index}.log"
                    with open(log_file, "w") as log:
                        process = subprocess.run(  # noqa: PLW1510 - checked below
                            [PYTHON, str(Path(__file__).resolve()), "start", str(spec_file)],
                            env=env,
                            cwd=tmp,
                            stdout=log,
                            stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL,
                            timeout=ENGINE_TIMEOUT,
                        )
                    if process.returncode != 0 or not out_file.is_file():
                        tail = log_file.read_text(errors="replace").splitlines()[-40:]
                        raise RuntimeError(
                            f"engine start failed ({variant}, {mode}):\n" + "\n".join(tail)
                        )
                    run = json.loads(out_file.read_text())
                took = re.search(INIT_MODEL_LOG, log_file.read_text(errors="replace"))
                run["init_model_s"] = float(took.group(1)) if took else math.nan
                run["load"] = os.getloadavg()[0]
                runs[variant].append(run)
                print(
                    f"  {mode} {variant:>6}: start {run['start_s']:.1f} s, model "
                    f"{run['init_model_s']:.2f} s, {run['full_gcs']} full collections "
                    f"({run['full_gc_s']:.2f} s; load {run['load']:.1f})",
                    flush=True,
                )
        median = {
            n: {
                key: statistics.median(r[key] for r in runs[n])
                for key in ("start_s", "init_model_s", "full_gcs", "full_gc_s")
            }
            for n in START_VARIANTS
        }
        results[mode] = dict(
            runs=runs,
            median=median,
            start_minus_native_s=median["this"]["start_s"] - median["native"]["start_s"],
            init_model_ratio=median["this"]["init_model_s"]
            / median["native"]["init_model_s"],
        )
    return results


# --- fuser detection, in one process ------------------------------------------


def _clear_caches() -> None:
    """Forget every fuser verdict and every per-class analysis this process made."""
    from vllm.model_executor.models.transformers import plan, rewriting, tracing

    plan.clear_cache()
    for module in (rewriting, tracing):
        for value in vars(module).values():
            if callable(getattr(value, "cache_clear", None)):
                value.cache_clear()


def _vllm_config(layers: int, folder: str, model_impl: str = "transformers"):
    from transformers import LlamaConfig
    from vllm.config import DeviceConfig, LoadConfig, ModelConfig, VllmConfig

    config = LlamaConfig(
        **dict(MODEL, num_hidden_layers=layers), architectures=["LlamaForCausalLM"]
    )
    config.save_pretrained(folder)
    model_config = ModelConfig(
        model=folder, model_impl=model_impl, skip_tokenizer_init=True, dtype=DTYPE
    )
    return VllmConfig(
        model_config=model_config,
        device_config=DeviceConfig("cpu"),
        load_config=LoadConfig(load_format="dummy"),
    )


def construct_once(variant: str, layers: int) -> dict[str, Any]:
    """Time the construction of `variant`'s Llama of `layers` layers on `meta` (for
    this backend with every per-class cache cleared first, so its class analysis is
    in it, and the registry alone as well), and the objects tracked by the garbage
    collector it leaves alive."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.utils.torch_utils import set_default_torch_dtype

    result: dict[str, Any] = dict(layers=layers)
    with tempfile.TemporaryDirectory() as folder:
        vllm_config = _vllm_config(
            layers, folder, VARIANTS[variant]["model_impl"]
        )
        if variant == "native":
            from vllm.model_executor.models.llama import LlamaForCausalLM as model_class
        else:
            from vllm.model_executor.models.transformers import (
                TransformersForCausalLM as model_class,
            )
        with (
            set_current_vllm_config(vllm_config),
            set_default_torch_dtype(vllm_config.model_config.dtype),
            torch.device("meta"),
        ):
            if variant == "this":
                result.update(_detect(vllm_config))
                _clear_caches()
            # Garbage from earlier builds (and this backend's detection pass, which
            # builds a second HF model) is collected here, not inside the timed build:
            # a full collection of this process's heap takes about 0.4 s.
            gc.collect()
            objects = len(gc.get_objects())
            started = time.perf_counter()
            model = model_class(vllm_config=vllm_config)
            result["construct_s"] = time.perf_counter() - started
            # What a full collection has to visit anew while the model lives.
            gc.collect()
            result["objects_kept"] = len(gc.get_objects()) - objects
            del model
    return result


def _detect(vllm_config) -> dict[str, Any]:
    """The fuser registry alone (this backend), over the HF model it builds."""
    from vllm.model_executor.models.transformers.base import build_hf_model
    from vllm.model_executor.models.transformers.plan import FusionPlan, analysed

    hf_model = build_hf_model(vllm_config)
    _clear_caches()
    started = time.perf_counter()
    fusers = FusionPlan(hf_model.base_model, vllm_config)
    return dict(
        detect_s=time.perf_counter() - started,
        modules_with_fusers=len(fusers),
        # Distinct (class, children) keys the registry analysed: constant in depth.
        keys_analysed=len(analysed()),
    )


def construct_main(variant: str, out_file: str) -> None:
    import logging
    import socket

    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    logging.getLogger("vllm").setLevel(logging.WARNING)
    # The one-process group vLLM's parallel layers need (the stock backend has no
    # helper for it, so this one is written here).
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
    rows = []
    construct_once(variant, DETECT_LAYERS[0])  # imports, first-touch: not measured
    for layers in DETECT_LAYERS:
        samples = [construct_once(variant, layers) for _ in range(DETECT_REPEATS)]
        row = dict(samples[-1], construct_samples=[s["construct_s"] for s in samples])
        for key in ("construct_s", "detect_s"):  # the least disturbed build
            if key in row:
                row[key] = min(s[key] for s in samples)
        rows.append(row)
    Path(out_file).write_text(json.dumps(rows))


def construction(log_dir: Path) -> dict[str, Any]:
    """`construct_main` for each implementation, each in its own interpreter (the
    stock backend is chosen at import); per layer is the slope over `PER_LAYER`."""
    results: dict[str, Any] = {}
    for variant in VARIANTS:
        env = dict(os.environ, VLLM_TRANSFORMERS_BACKEND=VARIANTS[variant]["backend"])
        with tempfile.TemporaryDirectory(prefix="bench-construct-") as tmp:
            out_file = Path(tmp) / "out.json"
            log_file = log_dir / f"construct-{variant}.log"
            with open(log_file, "w") as log:
                process = subprocess.run(  # noqa: PLW1510 - the return code is checked
                    [
                        PYTHON,
                        str(Path(__file__).resolve()),
                        "construct",
                        variant,
                        str(out_file),
                    ],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    timeout=900,
                )
            if process.returncode != 0 or not out_file.is_file():
                tail = "\n".join(log_file.read_text(errors="replace").splitlines()[-40:])
                raise RuntimeError(f"construction failed ({variant}):\n{tail}")
            rows = json.loads(out_file.read_text())
        by_layers = {row["layers"]: row for row in rows}
        low, high = (by_layers[n]["construct_s"] for n in PER_LAYER)
        results[variant] = dict(
            rows=rows, per_layer_s=(high - low) / (PER_LAYER[1] - PER_LAYER[0])
        )
        print(
            f"  {variant:>6}: "
            + ", ".join(
                f"{r['layers']} layers {r['construct_s'] * 1e3:.0f} ms "
                f"({r['objects_kept']} objects)"
                for r in rows
            )
            + f"; per layer {results[variant]['per_layer_s'] * 1e3:.2f} ms",
            flush=True,
        )
    return results


# --- output --------------------------------------------------------------------


LABELS = {
    "this": "this backend",
    "native": "vLLM native",
    "stock": "stock backend",
}
REFUSED = "refuses"
"""A cell of an implementation that refuses the model (stock, for the hybrids)."""


def _size(result: dict[str, Any]) -> str:
    return result["model"].get("size", "medium")  # summaries before `--size`


def _label(result: dict[str, Any]) -> str:
    """The model's row label: its type, and its size where it is not the medium."""
    size = _size(result)
    model_type = result["model"]["model_type"]
    return model_type if size == "medium" else f"{model_type} ({size})"


def _step_table(results: list[dict[str, Any]]) -> list[str]:
    """The model forward of a decode step per implementation (the median over
    rounds), and what this backend's and the stock backend's cost over native's per
    layer (the median of the per-round differences). At the tiny size this is the
    per-layer Python overhead. Nothing for summaries from before the steps were
    timed."""
    timed = [res for res in results if "model_step_s" in res["per_round"]["this"][0]]
    if not timed:
        return []
    lines = [
        (
            f"Model forward of a decode step ({BATCH} sequences, one token each; "
            "timed in the worker around the runner's `_model_forward`, the tenth "
            "percentile of each turn's steps, the median over rounds), ms, and its "
            "extra time over native per layer, us:"
        ),
        "",
        "| model | mode | "
        + " | ".join(f"{LABELS[n]} (ms)" for n in VARIANTS)
        + " | this - native per layer (us) | stock - native per layer (us) |",
        "|---|---|" + "---:|" * (len(VARIANTS) + 2),
    ]
    for res in timed:
        steps = {
            n: [r["model_step_s"] for r in runs] for n, runs in res["per_round"].items()
        }
        layers = res["model"]["num_hidden_layers"]
        over = {
            n: statistics.median(
                (x - y) / layers * 1e6 for x, y in zip(steps[n], steps["native"])
            )
            for n in ("this", "stock")
            if n in steps
        }
        lines.append(
            f"| {_label(res)} | {res['mode']} | "
            + " | ".join(
                f"{statistics.median(steps[n]) * 1e3:.2f}" if n in steps else REFUSED
                for n in VARIANTS
            )
            + " | "
            + " | ".join(f"{over[n]:.0f}" if n in over else REFUSED for n in ("this", "stock"))
            + " |"
        )
    return lines


def markdown(summary: dict[str, Any]) -> str:
    """The tables the README quotes."""
    lines = []
    results = summary.get("throughput") or []
    if results:
        m = results[0]["model"]
        widths = {_size(r): r["model"]["hidden_size"] for r in results}
        hidden = ", ".join(
            f"{w}" if size == "medium" else f"{w} ({size})" for size, w in widths.items()
        )
        loads = [
            r["load"] for res in results for runs in res["per_round"].values() for r in runs
        ]
        lines += [
            (
                f"Throughput on the CPU engine ({summary['machine']['cpus']} shared "
                f"cores, load {min(loads):.1f}-{max(loads):.1f} during the timed "
                f"batches), random models of {m['num_hidden_layers']} layers, hidden "
                f"{hidden}, vocab {m['vocab_size']}, {m['dtype']}; "
                f"{BATCH} prompts x {PROMPT_LEN} tokens in, {MAX_TOKENS} out. Ratios "
                "are this backend's tokens/s over the other's, the median of the "
                "per-round ratios (engines alternating, best of "
                f"{BATCHES_PER_ROUND} batches each per round):"
            ),
            "",
            (
                "| model | mode | rounds | this tok/s (generate) | vs native: "
                "generate | prefill | decode | vs stock: generate | decode |"
            ),
            "|---|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for res in results:
            native, stock = res["ratio"]["native"], res["ratio"].get("stock")
            versus_stock = (
                f"{stock['generate_tok_s']:.2f} | {stock['decode_tok_s']:.2f}"
                if stock
                else f"{REFUSED} | {REFUSED}"
            )
            lines.append(
                f"| {_label(res)} | {res['mode']} | {res['rounds']} "
                f"| {res['median']['this']['generate_tok_s']:.0f} "
                f"| {native['generate_tok_s']:.2f} | {native['prefill_tok_s']:.2f} "
                f"| {native['decode_tok_s']:.2f} | {versus_stock} |"
            )
        if step_table := _step_table(results):
            lines += ["", *step_table]
        warm = [res for res in results if "warm" in res["starts"]["this"]]
        if warm:
            lines += [
                "",
                (
                    "Engine start, seconds until the engine answers (compiled; cold: "
                    "a fresh compile cache, warm: the second start on it):"
                ),
                "",
                "| model | " + " | ".join(f"{LABELS[n]} cold | warm" for n in VARIANTS) + " |",
                "|---|" + "---:|---:|" * len(VARIANTS),
            ]
            for res in warm:
                cells = [
                    f"{res['starts'][n]['cold']['start_s']:.0f} "
                    f"| {res['starts'][n]['warm']['start_s']:.0f}"
                    if n in res["starts"]
                    else f"{REFUSED} | {REFUSED}"
                    for n in VARIANTS
                ]
                lines.append(f"| {_label(res)} | " + " | ".join(cells) + " |")
        lines.append("")
    built = summary.get("construction")
    if built:
        lines += [
            (
                "Construction on `meta` (Llama, hidden 768; best of "
                f"{DETECT_REPEATS}; this backend with its per-class caches cleared, "
                "so its class analysis is in every build):"
            ),
            "",
            "| layers | "
            + " | ".join(f"{LABELS[n]} (ms)" for n in VARIANTS)
            + " | this / native | this: fuser detection (ms) | module keys analysed "
            "| objects left alive, this / native |",
            "|---:|" + "---:|" * (len(VARIANTS) + 4),
        ]
        for index, row in enumerate(built["this"]["rows"]):
            native = built["native"]["rows"][index]
            cells = [f"{built[n]['rows'][index]['construct_s'] * 1e3:.0f}" for n in VARIANTS]
            # Summaries before the count was taken have none.
            kept = (
                f"{row['objects_kept']} / {native['objects_kept']}"
                if "objects_kept" in row
                else ""
            )
            lines.append(
                f"| {row['layers']} | " + " | ".join(cells)
                + f" | {row['construct_s'] / native['construct_s']:.1f}x"
                + f" | {row['detect_s'] * 1e3:.1f} | {row['keys_analysed']} | {kept} |"
            )
        lines.append(
            f"| per layer ({PER_LAYER[0]} to {PER_LAYER[1]}) | "
            + " | ".join(f"{built[n]['per_layer_s'] * 1e3:.2f}" for n in VARIANTS)
            + " | | | | |"
        )
    starts = summary.get("start")
    if starts:
        lines += [
            "",
            (
                f"Whole engine start (`LLM(...)` with the engine in the calling process, "
                f"tiny Llama of {starts['layers']} layers, dummy weights, a fresh "
                f"compile cache each; median of {starts['rounds']} starts each, "
                "alternating):"
            ),
            "",
            "| mode | this (s) | native (s) | this - native (s) | model init, this / "
            "native (s) | full collections, this / native |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for mode in MODES:
            if mode not in starts:
                continue
            this, native = starts[mode]["median"]["this"], starts[mode]["median"]["native"]
            lines.append(
                f"| {mode} | {this['start_s']:.1f} | {native['start_s']:.1f} "
                f"| {starts[mode]['start_minus_native_s']:+.1f} "
                f"| {this['init_model_s']:.2f} / {native['init_model_s']:.2f} "
                f"| {this['full_gcs']:g} / {native['full_gcs']:g} |"
            )
    return "\n".join(lines)


def plot(summary: dict[str, Any], out_file: Path) -> None:
    """Bars of this backend's and the stock backend's tokens/s over native's, per
    model and mode, for generation, prefill and decode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = summary["throughput"]
    fig, axes = plt.subplots(
        1,
        len(METRICS),
        figsize=(max(5.0, 0.6 * len(results)) * len(METRICS), 4.5),
        sharey=True,
    )
    labels = [f"{_label(r)} {r['mode']}" for r in results]
    width = 0.38
    lowest = 1.0
    for axis, metric in zip(axes, METRICS):
        xs = range(len(results))
        this = [r["ratio"]["native"][metric] for r in results]
        # stock / native = (this / native) / (this / stock); none where it refuses
        stock = [
            r["ratio"]["native"][metric] / r["ratio"]["stock"][metric]
            if "stock" in r["ratio"]
            else float("nan")
            for r in results
        ]
        lowest = min(lowest, *this, *(x for x in stock if x == x))
        axis.bar([x - width / 2 for x in xs], this, width, label="this backend")
        axis.bar([x + width / 2 for x in xs], stock, width, label="stock backend")
        axis.axhline(1.0, color="black", linewidth=0.8)
        axis.set_xticks(list(xs), labels, fontsize=8, rotation=40, ha="right")
        axis.set_title(metric.replace("_tok_s", "") + " tok/s vs vLLM native")
    # Ratios sit near 1: an axis from 0 would hide a 5% difference.
    bottom = 0.8 if lowest > 0.85 else 0.0
    axes[0].set_ylim(bottom=bottom)
    axes[0].set_ylabel(f"ratio to native (median of rounds; axis from {bottom:g})")
    axes[0].legend(loc="lower left")
    dtypes = ", ".join(sorted({r["model"].get("dtype", "bfloat16") for r in results}))
    fig.suptitle(
        f"{summary['date']}, {summary['machine']['cpus']} CPUs "
        f"({summary['machine']['processor']}), {dtypes}, "
        f"vLLM {summary.get('versions', {}).get('vllm', '?')}"
    )
    fig.tight_layout()
    fig.savefig(out_file, dpi=110)
    plt.close(fig)


def merge_main(out_file: Path, in_files: list[Path]) -> None:
    """One summary (tables and plot) from runs made part by part: their throughput
    results in order, the first construction and engine starts found, the dates and
    loads of each."""
    parts = [json.loads(f.read_text()) for f in in_files]
    summary = dict(parts[0])
    summary["throughput"] = [r for part in parts for r in part.get("throughput", [])]
    for measured in ("construction", "start"):
        summary[measured] = next(
            (part[measured] for part in parts if part.get(measured)), None
        )
    summary["parts"] = [
        dict(date=part["date"], machine=part["machine"], file=str(f))
        for part, f in zip(parts, in_files)
    ]
    out_file.write_text(json.dumps(summary, indent=1))
    print(markdown(summary))
    plot(summary, out_file.with_suffix(".png"))
    print(f"\nPlot: {out_file.with_suffix('.png')}")


def main(argv: list[str]) -> None:
    if argv[:1] == ["engine"]:
        return engine_main(argv[1])
    if argv[:1] == ["construct"]:
        return construct_main(argv[1], argv[2])
    if argv[:1] == ["start"]:
        return start_main(argv[1])
    if argv[:1] == ["merge"]:
        return merge_main(Path(argv[1]), [Path(a) for a in argv[2:]])

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--models",
        default=",".join(MODELS),
        help=f"comma-separated, of {', '.join(MODELS)} (default: all)",
    )
    parser.add_argument(
        "--modes", default=",".join(MODES), help="eager,compiled (default: both)"
    )
    parser.add_argument(
        "--rounds", type=int, default=5, help="rounds per model and mode (default 5)"
    )
    parser.add_argument(
        "--budget",
        type=float,
        default=300,
        help="seconds of rounds per model and mode (engine starts not counted): no "
        "round starts that would end past it (default 300)",
    )
    parser.add_argument(
        "--dtype",
        default=DTYPE,
        choices=["bfloat16", "float32"],
        help=f"default: bfloat16 where the CPU computes it, else float32 (here {DTYPE})",
    )
    parser.add_argument(
        "--size",
        default="medium",
        choices=list(SIZES),
        help="medium (default): the matmuls dominate; tiny: hidden 128, so a decode "
        "step is mostly Python, and the per-layer overhead shows",
    )
    parser.add_argument("--profile", action="store_true", help="ops of a batch each")
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--skip-construction", action="store_true")
    parser.add_argument(
        "--skip-start", action="store_true", help="no whole engine starts"
    )
    parser.add_argument(
        "--start-rounds",
        type=int,
        default=START_ROUNDS,
        help=f"starts of each implementation per mode (default {START_ROUNDS})",
    )
    parser.add_argument("--out", type=Path, default=CACHE / "latest.json")
    args = parser.parse_args(argv)
    models = args.models.split(",")
    modes = args.modes.split(",")
    for name, known in ((models, MODELS), (modes, MODES)):
        if unknown := set(name) - set(known):
            parser.error(f"unknown: {', '.join(sorted(unknown))}")

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
    import torch
    import transformers

    import vllm

    summary["versions"] = dict(
        vllm=vllm.__version__,
        torch=torch.__version__,
        transformers=transformers.__version__,
    )

    if not args.skip_construction:
        print("Construction on meta ...", flush=True)
        summary["construction"] = construction(log_dir)
    if not args.skip_start:
        print(f"Engine starts ({args.modes}) ...", flush=True)
        summary["start"] = engine_starts(args, log_dir)
    if not args.skip_throughput:
        summary["throughput"] = []
        for model_type in models:
            for mode in modes:
                print(f"Throughput: {model_type}, {mode} ...", flush=True)
                try:
                    result = measure(args, model_type, mode, log_dir)
                except RuntimeError as error:  # an engine that did not start
                    print(f"  failed: {error}", flush=True)
                    summary.setdefault("failed", []).append(
                        dict(model=model_type, mode=mode, error=str(error))
                    )
                    continue
                summary["throughput"].append(result)
                print(
                    "  this / native (generate, prefill, decode): "
                    + ", ".join(f"{v:.2f}" for v in result["ratio"]["native"].values())
                    + "; this / stock: "
                    + (
                        ", ".join(
                            f"{v:.2f}"
                            for v in result["ratio"].get("stock", {}).values()
                        )
                        or REFUSED
                    ),
                    flush=True,
                )
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(summary, indent=1))  # so far
    summary["seconds"] = time.monotonic() - started
    summary["machine"]["load_at_end"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=1))
    print()
    print(markdown(summary))
    if summary.get("throughput"):
        png = args.out.with_suffix(".png")
        plot(summary, png)
        print(f"\nPlot: {png}")
    print(f"\nSummary: {args.out} ({summary['seconds']:.0f} s)")


if __name__ == "__main__":
    main(sys.argv[1:])
