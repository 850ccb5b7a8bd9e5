# SPDX-License-Identifier: Apache-2.0
"""The logits: the scale and soft-cap the backend reads from a causal LM's own
forward (`LogitsHead.of`), checked against what that forward computes, and the
construction errors for heads it cannot reproduce."""

import re

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, LlamaForCausalLM, PhiForCausalLM
from transformers.modeling_outputs import CausalLMOutputWithPast

from vllm.model_executor.models.transformers.causal import LogitsHead
from vllm.model_executor.models.transformers.utils import parameters_on_meta

from configs import small_config

HEADS = {
    "llama": ({}, LogitsHead()),
    # logits / logits_scaling
    "granite": (dict(logits_scaling=4.0), LogitsHead(scale=0.25)),
    # logits * self.logit_scale (copied from the config in __init__)
    "cohere": (dict(logit_scale=0.125), LogitsHead(scale=0.125)),
    # tanh(logits / cap) * cap
    "gemma2": (dict(final_logit_softcapping=12.0), LogitsHead(soft_cap=12.0)),
    # lm_head(hidden_states / (hidden_size / dim_model_base)), a head without bias
    "minicpm3": (
        dict(dim_model_base=32, q_lora_rank=32, kv_lora_rank=32, num_key_value_heads=4),
        LogitsHead(scale=0.25),
    ),
}


def build(model_type: str, **overrides) -> transformers.PreTrainedModel:
    """A small HF causal LM with seeded random weights, on the CPU."""
    torch.manual_seed(0)
    config = small_config(model_type, **overrides)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


@pytest.mark.parametrize("model_type", HEADS)
def test_found_from_the_forward_on_meta(model_type):
    overrides, expected = HEADS[model_type]
    with parameters_on_meta():
        model = AutoModelForCausalLM.from_config(small_config(model_type, **overrides))
    assert LogitsHead.of(model) == pytest.approx(expected)


def processed(head: LogitsHead, logits: torch.Tensor) -> torch.Tensor:
    """What vLLM's `LogitsProcessor(scale=, soft_cap=)` does to the head's logits."""
    if head.soft_cap is not None:
        logits = torch.tanh(logits / head.soft_cap) * head.soft_cap
    return logits * head.scale


@pytest.mark.parametrize("model_type", HEADS)
def test_reproduces_the_logits_transformers_returns(model_type):
    """Applied the way vLLM's logits processor applies it to `lm_head(hidden)`, the
    head gives the logits the HF forward returns (and it matters: it differs from
    the bare `lm_head` for every model but llama)."""
    overrides, _ = HEADS[model_type]
    model = build(model_type, **overrides)
    ids = torch.randint(4, 128, (1, 9))
    with torch.no_grad():
        hidden = model.base_model(input_ids=ids).last_hidden_state
        bare = model.get_output_embeddings()(hidden)
        expected = model(input_ids=ids).logits
    got = processed(LogitsHead.of(model), bare)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert (model_type == "llama") == torch.allclose(bare, expected)


def test_scale_and_cap_compose_around_one_tanh():
    """Constants before and after the tanh, in any order, fold into one cap and one
    scale: 3 * c * tanh(2h / (2c)) is a cap of c and a scale of 3."""

    class Composed(LlamaForCausalLM):
        def forward(self, input_ids=None, **kwargs):
            hidden_states = self.model(input_ids=input_ids).last_hidden_state
            logits = self.lm_head(hidden_states * 2.0).float()
            logits = 3.0 * (torch.tanh(logits / 10.0) * 5.0)
            return CausalLMOutputWithPast(logits=logits)

    model = Composed(small_config("llama")).eval()
    head = LogitsHead.of(model)
    assert head == pytest.approx(LogitsHead(scale=3.0, soft_cap=5.0))
    ids = torch.randint(4, 128, (1, 9))
    with torch.no_grad():
        hidden = model.model(input_ids=ids).last_hidden_state
        got = processed(head, model.lm_head(hidden))
        torch.testing.assert_close(got, model(input_ids=ids).logits)


class Clamped(LlamaForCausalLM):
    def forward(self, input_ids=None, **kwargs):
        hidden_states = self.model(input_ids=input_ids).last_hidden_state
        logits = self.lm_head(hidden_states)
        logits = logits.clamp(-5.0, 5.0)
        return CausalLMOutputWithPast(logits=logits)


class LearnedScale(LlamaForCausalLM):
    def __init__(self, config):
        super().__init__(config)
        self.logit_scale = torch.nn.Parameter(torch.ones(()))

    def forward(self, input_ids=None, **kwargs):
        hidden_states = self.model(input_ids=input_ids).last_hidden_state
        return CausalLMOutputWithPast(
            logits=self.lm_head(hidden_states) * self.logit_scale
        )


class NormedBeforeHead(LlamaForCausalLM):
    def forward(self, input_ids=None, **kwargs):
        hidden_states = self.model(input_ids=input_ids).last_hidden_state
        hidden_states = torch.tanh(hidden_states)
        return CausalLMOutputWithPast(logits=self.lm_head(hidden_states))


class ScaledIntoBias(PhiForCausalLM):
    def forward(self, input_ids=None, **kwargs):
        hidden_states = self.model(input_ids=input_ids).last_hidden_state
        return CausalLMOutputWithPast(logits=self.lm_head(hidden_states / 2.0))


@pytest.mark.parametrize(
    "cls, model_type, code, why",
    [
        (
            Clamped,
            "llama",
            "logits.clamp(-5.0, 5.0)",
            "after its output embedding `lm_head`",
        ),
        (
            LearnedScale,
            "llama",
            "self.lm_head(hidden_states) * self.logit_scale",
            "which mixes in a tensor other than",
        ),
        (
            NormedBeforeHead,
            "llama",
            "torch.tanh(hidden_states)",
            "before its output embedding `lm_head`",
        ),
        (
            ScaledIntoBias,
            "phi",
            "hidden_states / 2.0",
            "before its output embedding `lm_head`, which has a bias",
        ),
    ],
)
def test_a_head_it_cannot_reproduce_is_an_error(cls, model_type, code, why):
    """The error names the class, the code (and where it is) and its place."""
    with parameters_on_meta():
        model = cls(small_config(model_type))
    with pytest.raises(ValueError) as error:
        LogitsHead.of(model)
    message = str(error.value)
    assert message.startswith(f"{cls.__name__}: its forward computes `{code}` (")
    assert "test_causal.py:" in message
    assert why in message
    assert "cannot serve" in message


class Negated(LlamaForCausalLM):
    def forward(self, input_ids=None, **kwargs):
        hidden_states = self.model(input_ids=input_ids).last_hidden_state
        return CausalLMOutputWithPast(logits=self.lm_head(hidden_states) * -1.0)


class TupleOut(LlamaForCausalLM):
    def forward(self, input_ids=None, **kwargs):
        hidden_states = self.model(input_ids=input_ids).last_hidden_state
        return (self.lm_head(hidden_states),)


@pytest.mark.parametrize(
    "cls, why",
    [
        (Negated, "its logits are scaled by -1.0"),
        (TupleOut, "its forward returns no `logits` tensor"),
    ],
)
def test_a_head_it_cannot_read_is_an_error(cls, why):
    """A negative scale (vLLM's greedy path refuses it) and logits it cannot find."""
    with parameters_on_meta():
        model = cls(small_config("llama"))
    with pytest.raises(ValueError, match=rf"^{cls.__name__}: {re.escape(why)}"):
        LogitsHead.of(model)


def test_the_backend_takes_the_head_from_the_forward(build_backend):
    model = build_backend(small_config("granite", logits_scaling=4.0))
    assert model.logits_processor.scale == pytest.approx(0.25)
    assert model.logits_processor.soft_cap is None


def test_the_backend_refuses_a_head_it_cannot_reproduce(build_backend, monkeypatch):
    # The backend builds the class the config names, found in `transformers`.
    monkeypatch.setattr(transformers, "Clamped", Clamped, raising=False)
    with pytest.raises(ValueError, match=r"^Clamped: .*logits\.clamp"):
        build_backend(
            small_config("llama"),
            served_config=small_config("llama", architectures=["Clamped"]),
        )
