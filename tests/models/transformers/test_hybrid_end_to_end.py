# SPDX-License-Identifier: Apache-2.0
"""Hybrid models on the CPU engine: the tiny Granite 4.0 H (Mamba-2 mixers in layers
0 and 2, attention in 1 and 3, a mixture of experts in every layer; every 1-D
parameter perturbed, the mixers' `A_log`, `D`, `dt_bias`, convolution bias and norm
weight included) answers as Transformers does, and as vLLM's native model does;
so do a tiny Bamba (Mamba-2, two B/C groups), a tiny Nemotron-H (Mamba-2 with clamped
time steps, non-gated experts), a tiny Falcon-H1 (a Mamba-2 mixer beside attention
in every layer, its projection scaled), a tiny Mamba-2 (mixers alone), a tiny LFM2
(short convolutions, their biases perturbed), a tiny LFM2-MoE (the same beside
experts), and in bfloat16 a tiny Qwen3-Next and a tiny Qwen3.5 (gated delta nets).

The scheduler's token budget (16) is shorter than the long prompt, so its prefill is
split into chunks, each continuing from the state the one before left in vLLM's
state cache; with at most 4 sequences at once, the fifth request starts (and
prefills, chunk by chunk) while the first four decode, in batches of mixed lengths
that mix prefills with decodes."""

import functools

import pytest
import tiny

pytestmark = pytest.mark.engine

MODEL = "granitemoehybrid"
LONG = " ".join(["the small cat sees a big dog near the river and the old king walks"] * 4)
PROMPTS = [*tiny.PROMPTS, LONG]
BATCHING = dict(max_num_batched_tokens=16, max_num_seqs=4, enable_prefix_caching=False)
"""Prefix caching off: on the CPU the backend refuses Mamba-2 mixers with it on
(vLLM's CPU engine fails in them on a prompt longer than one cache block)."""


@functools.cache
def reference(model: str = MODEL, dtype: str = "float32") -> tuple[tiny.Completion, ...]:
    return tuple(tiny.reference(tiny.checkpoint(model), PROMPTS, dtype=dtype))


@functools.cache
def engine(
    impl: str,
    tensor_parallel_size: int = 1,
    model: str = MODEL,
    chunked: bool = True,
    compiled: bool = False,
    dtype: str = "float32",
) -> tiny.EngineRun:
    batching = dict(BATCHING)
    if not chunked:
        del batching["max_num_batched_tokens"]
    return tiny.run_engine(
        tiny.checkpoint(model),
        PROMPTS,
        probe=impl == "project",
        tensor_parallel_size=tensor_parallel_size,
        llm_kwargs={**batching, "enforce_eager": not compiled, "dtype": dtype},
        **tiny.IMPLS[impl],
    )


def served_as_transformers(model: str, **options: bool) -> tiny.EngineRun:
    """This backend's `engine` run of `model` with `options`, its greedy tokens and
    log-probabilities checked against Transformers' and reported."""
    run = engine("project", model=model, **options)
    gap = tiny.compare(reference(model), run.completions, tiny.logprob_atol(model))
    how = ", ".join(["project", *(name for name, on in options.items() if on)])
    tiny.report(f"{model} ({how}) vs Transformers", run, gap)
    return run


def test_the_long_prompt_needs_several_prefill_chunks():
    assert len(tiny.encode(tiny.checkpoint(MODEL), [LONG])[0]) > 3 * 16


def test_mamba2_mixers_on_vllm_equal_transformers():
    run = served_as_transformers(MODEL)
    (worker,) = run.probe
    assert worker["model_class"] == "TransformersHybridMoEForCausalLM"
    assert [a["module"] for a in worker["attached"]] == [
        "model.layers.1.self_attn",
        "model.layers.3.self_attn",
    ]
    for layer in (0, 2):
        assert f"Fused: Mamba-2 mixer -> model.layers.{layer}.mamba: " in run.log


def test_vllms_native_model_answers_the_same():
    native = engine("native")
    atol = tiny.logprob_atol(MODEL)
    gap = tiny.compare(reference(), native.completions, atol)
    tiny.report(f"{MODEL} (native, chunked prefill) vs Transformers", native, gap)
    tiny.compare(native.completions, engine("project").completions, 2 * atol)


def test_tensor_parallel_splits_the_mixers_heads_and_equals_transformers():
    # One B/C group for 8 heads: vLLM's loaders give each rank 4 heads and a copy
    # of the group; the gated norm's mean runs over both ranks.
    tp2 = engine("project", 2)
    assert len({worker["pid"] for worker in tp2.probe}) == 2
    gap = tiny.compare(reference(), tp2.completions, tiny.logprob_atol(MODEL))
    tiny.report(f"{MODEL} (project, TP=2) vs Transformers", tp2, gap)


def test_grouped_mixers_with_a_norm_over_the_whole_width_equal_transformers():
    # Bamba's mixers hold 2 B/C groups and normalise y * silu(z) over the whole
    # width: the probe finds that, and the layer is built with a norm of one group
    # (vLLM's default would take the B/C groups').
    run = served_as_transformers("bamba")
    assert "2 B/C group(s) of state 16, kernel 4, gated norm over 1 group(s)" in run.log


def test_clamped_time_steps_and_kept_experts_equal_transformers():
    # Nemotron-H clamps its time steps from below (`time_step_min`, 0.05 in the
    # tiny model, so that the clamp moves the output) in a prompt and not in a
    # decoding step; its non-gated experts stay Transformers' own, loaded from the
    # checkpoint's per-expert tensors. Prompts are prefilled whole: vLLM runs a
    # prompt's last chunk of one token on its decoding path, unclamped
    # (docs/hybrid.md), where Transformers' `generate` clamps the whole prompt.
    tiny.check_feature_changes_output("nemotron_h", time_step_min=0.0)
    run = served_as_transformers("nemotron_h", chunked=False)
    assert "gated norm over 2 group(s), time steps clamped to (0.05, inf)" in run.log


def test_compiled_mixers_beside_attention_with_scaled_projections_equal_transformers():
    # Falcon-H1: every layer sums a Mamba-2 mixer (no norm) and attention; the
    # mixer scales its input by a constant and in_proj's output per part, which
    # the backend folds into in_proj's weights as they load. Under vLLM's
    # torch.compile integration (the other hybrid tests run eager).
    tiny.check_feature_changes_output("falcon_h1", ssm_multipliers=[1.0] * 5)
    run = served_as_transformers("falcon_h1", compiled=True)
    (worker,) = run.probe
    assert worker["compiled"]
    assert worker["model_class"] == "TransformersHybridForCausalLM"
    assert len(worker["attached"]) == 4
    assert (
        "silu gate, no norm, in_proj input x 0.7 and output x mup_vector (folded "
        "into its weights)"
    ) in run.log


def test_a_decoder_of_mixers_alone_equals_transformers():
    # Mamba-2 (Mamba2ForCausalLM): no attention at all, every layer a mixer with
    # two B/C groups and its gated norm over the whole width, as Transformers'
    # normalises (vLLM's native Mamba-2 normalises per group: its greedy tokens
    # differ from Transformers' on this model, from the second on).
    run = served_as_transformers("mamba2")
    (worker,) = run.probe
    assert worker["model_class"] == "TransformersHybridForCausalLM"
    assert worker["attached"] == []
    assert "2 B/C group(s) of state 16, kernel 4, gated norm over 1 group(s)" in run.log


def test_short_convolutions_on_vllm_equal_transformers():
    # LFM2: vLLM's ShortConv in layers 0 and 2 (its convolution state in vLLM's
    # state cache, carried across the long prompt's prefill chunks and the decodes).
    run = served_as_transformers("lfm2")
    (worker,) = run.probe
    assert worker["model_class"] == "TransformersHybridForCausalLM"
    for layer in (0, 2):
        assert (
            f"Fused: short convolution -> model.layers.{layer}.conv: short "
            "convolution, width 128, kernel 3, with biases; vLLM ShortConv"
        ) in run.log


def test_short_convolutions_beside_experts_equal_transformers():
    # LFM2-MoE: LFM2's short convolutions and attention, a dense MLP in layer 0,
    # experts whose choice a per-expert bias corrects in layers 1-3.
    run = served_as_transformers("lfm2_moe")
    (worker,) = run.probe
    assert worker["model_class"] == "TransformersHybridMoEForCausalLM"
    for layer in (0, 2):
        assert f"Fused: short convolution -> model.layers.{layer}.conv: " in run.log


BFLOAT16_ATOL = 0.1
"""Log-probabilities of the gated-delta-net models served in bfloat16 (vLLM's CPU
kernels for them take nothing else): this backend, vLLM's native model and
Transformers' bfloat16 lie within 0.05 of each other and of Transformers' float32
(measured), as far as Transformers' bfloat16 from its own float32."""


def distance(
    expected: tuple[tiny.Completion, ...], actual: list[tiny.Completion]
) -> tuple[float, int]:
    """The largest log-probability gap over each prompt's tokens up to the first
    that differs, and how many tokens that is: measured, not asserted."""
    gap, steps = 0.0, 0
    for want, got in zip(expected, actual):
        for a, b, want_logprob, got_logprob in zip(
            want.token_ids, got.token_ids, want.logprobs, got.logprobs
        ):
            if a != b:
                break
            gap, steps = max(gap, abs(want_logprob - got_logprob)), steps + 1
    return gap, steps


def served_in_bfloat16(model: str) -> tiny.EngineRun:
    """This backend's bfloat16 `engine` run of `model`, its distance to
    Transformers' bfloat16 and float32 output reported."""
    run = engine("project", model=model, dtype="bfloat16")
    for dtype in ("bfloat16", "float32"):
        gap, steps = distance(reference(model, dtype), run.completions)
        tiny.report(
            f"{model} (project, bfloat16) vs Transformers {dtype}, {steps} of "
            f"{len(PROMPTS) * tiny.MAX_TOKENS} steps",
            run,
            gap,
        )
    return run


def check_gated_delta_nets(run: tiny.EngineRun, layout: str) -> None:
    (worker,) = run.probe
    assert [a["module"] for a in worker["attached"]] == [
        "model.layers.1.self_attn",
        "model.layers.3.self_attn",
    ]
    for layer in (0, 2):
        assert (
            f"Fused: gated delta net -> model.layers.{layer}.linear_attn: gated delta "
            "net, 2 key heads of 128, 4 value heads of 128, kernel 4, output gated by "
            f"silu, projections {layout}; vLLM QwenGatedDeltaNetAttention"
        ) in run.log


def test_gated_delta_nets_on_vllm_equal_vllms_native_model():
    # Qwen3-Next in bfloat16: gated delta nets (each key head's q, k, v, z in one
    # linear) in layers 0 and 2, attention with a gated query in 1 and 3, experts
    # beside a gated shared expert. Tokens equal vLLM's native model's, the
    # distance to Transformers' bfloat16 and float32 output reported.
    run = served_in_bfloat16("qwen3_next")
    assert run.probe[0]["model_class"] == "TransformersHybridMoEForCausalLM"
    check_gated_delta_nets(run, "per key head (in_proj_qkvz, in_proj_ba)")
    native = engine("native", model="qwen3_next", dtype="bfloat16")
    gap, steps = tiny.compare_rounded(native.completions, run.completions, BFLOAT16_ATOL)
    tiny.report(f"qwen3_next (project vs native, bfloat16), {steps} steps", run, gap)
    assert steps >= len(PROMPTS) * tiny.MAX_TOKENS // 2


def test_gated_delta_nets_in_four_linears_equal_transformers_bfloat16():
    # Qwen3.5: Qwen3-Next's mixers with four input projections, loaded as shards
    # of vLLM's two merged ones, and a dense MLP. vLLM's native Qwen3.5 does not
    # start here (its module imports torchvision, which vLLM's CPU build lacks):
    # compared with Transformers' own bfloat16 output.
    run = served_in_bfloat16("qwen3_5_text")
    assert run.probe[0]["model_class"] == "TransformersHybridForCausalLM"
    check_gated_delta_nets(
        run, "in four linears, loaded as shards of in_proj_qkvz and in_proj_ba"
    )
    expected = reference("qwen3_5_text", "bfloat16")
    gap, steps = tiny.compare_rounded(expected, run.completions, BFLOAT16_ATOL)
    assert steps >= len(PROMPTS) * tiny.MAX_TOKENS // 2


@pytest.mark.parametrize("model, layer_type", [(MODEL, "linear_attention")])
def test_vllms_stock_backend_refuses_it(model, layer_type):
    with pytest.raises(
        RuntimeError,
        match=rf"Layer 0 \({layer_type}\) does not dispatch through the "
        r"Transformers attention interface",
    ):
        tiny.run_engine(tiny.checkpoint(model), PROMPTS[:1], **tiny.IMPLS["stock"])
