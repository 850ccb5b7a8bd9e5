# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""AddRMSNormFuser: `h = r + h; r = h; h = self.norm(h)` -> `h, r = self.norm(h, r)`
on vLLM's fused add-and-norm, where the forward's statements prove that the kernel
may write into both tensors."""

import copy
import functools

import pytest
import torch
from configs import small_config
from conftest import randomize
from torch import nn
from transformers import AutoModel
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from vllm import ir
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.models.transformers.plan import FusionPlan, get_fuser
from vllm.model_executor.models.transformers.fusers import (
    AddRMSNormFuser,
    RMSNormFuser,
)
from vllm.model_executor.models.transformers.fusers.add_rms_norm import Site

HIDDEN = 16
TOKENS = 5


@pytest.fixture
def kernel_calls(monkeypatch) -> list[int]:
    """vLLM's fused add-and-norm counting its calls and writing into its inputs as
    CUDA's kernel does: the sum, rounded to the input dtype, into the residual, the
    normalised sum into the input. Whatever reads either tensor afterwards reads
    those, so an unproven site gives a wrong answer here."""
    calls = []
    op = ir.ops.fused_add_rms_norm

    def in_place(x, residual, weight, epsilon, variance_size=None):
        calls.append(1)
        residual.copy_(x + residual)
        summed = residual.float()
        normalised = summed * torch.rsqrt(summed.pow(2).mean(-1, keepdim=True) + epsilon)
        if weight is not None:
            normalised = normalised.to(weight.dtype) * weight
        x.copy_(normalised)
        return x, residual

    monkeypatch.setattr(op, "maybe_inplace", in_place)
    return calls


def fuse_plan(model: nn.Module, vllm_config, fusers=(AddRMSNormFuser, RMSNormFuser)):
    """`model` with the plan's `fusers` applied (children first), every other module
    left as Transformers' own; the weights copied across."""
    plan = FusionPlan(model, vllm_config)
    for name, module in reversed(list(model.named_modules())):
        for fuser in plan[module]:
            if not isinstance(fuser, fusers):
                continue
            fused = fuser.fuse(module, name, vllm_config)
            if fused is not module:
                fused.load_state_dict(module.state_dict())
                parent, _, child = name.rpartition(".")
                setattr(model.get_submodule(parent), child, fused)
    return plan


def eager(config):
    config._attn_implementation = "eager"
    return config


MODELS = {
    # name: (config, in-place kernel calls per forward and layer)
    "llama": (lambda: small_config("llama", num_hidden_layers=3), 1),
    # Gemma 2: four norms a layer (`1 + w`), the add before the pre-feedforward norm;
    # vLLM's GemmaRMSNorm adds and normalises out of place.
    "gemma2": (lambda: small_config("gemma2", num_hidden_layers=3, head_dim=32), 0),
    # A mixture-of-experts decoder layer.
    "mixtral": (
        lambda: small_config(
            "mixtral", num_hidden_layers=2, num_local_experts=4, intermediate_size=64
        ),
        1,
    ),
}


@pytest.mark.parametrize("name", MODELS)
def test_decoder_equals_transformers_with_the_kernel_writing_in_place(
    name, vllm_config, kernel_calls
):
    make_config, calls_per_layer = MODELS[name]
    config = eager(make_config())
    reference = randomize(AutoModel.from_config(config))
    model = copy.deepcopy(reference)
    plan = fuse_plan(model, vllm_config)
    layers = [m for m in plan if any(isinstance(f, AddRMSNormFuser) for f in plan[m])]
    assert len(layers) == config.num_hidden_layers
    embeds = torch.randn(1, TOKENS, config.hidden_size)
    with torch.no_grad():
        expected = reference(inputs_embeds=embeds).last_hidden_state
        # The first layer's input is written into, as in vLLM's native models.
        actual = model(inputs_embeds=embeds.clone()).last_hidden_state
        from_ids = model(input_ids=torch.arange(TOKENS)[None]).last_hidden_state
        expected_from_ids = reference(input_ids=torch.arange(TOKENS)[None])
    assert len(kernel_calls) == 2 * calls_per_layer * config.num_hidden_layers
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(
        from_ids, expected_from_ids.last_hidden_state, atol=1e-5, rtol=1e-5
    )


def test_in_bfloat16_the_sum_is_transformers_and_its_norm_one_rounding_off(fuse):
    # Transformers normalises the sum rounded to bfloat16; vLLM's native add-and-norm
    # the float32 sum (CUDA's kernel rounds it first, as Transformers does).
    norm = randomize(LlamaRMSNorm(HIDDEN), torch.bfloat16)
    vllm_norm, _ = fuse(copy.deepcopy(norm), torch.bfloat16)
    assert isinstance(vllm_norm, RMSNorm)
    generator = torch.Generator().manual_seed(0)
    x, residual = (
        torch.randn(64, HIDDEN, generator=generator).to(torch.bfloat16) for _ in "xr"
    )
    with torch.no_grad():
        normalised, summed = vllm_norm(x.clone(), residual.clone())
        expected = norm(residual + x)
    assert torch.equal(summed, residual + x)
    torch.testing.assert_close(normalised, expected, atol=1e-2, rtol=2**-7)


class Block(nn.Module):
    """A pre-norm decoder block, the add before the second norm as Llama's."""

    def __init__(self, norm: type[nn.Module] = LlamaRMSNorm):
        super().__init__()
        self.norm1 = norm(HIDDEN)
        self.attn = nn.Linear(HIDDEN, HIDDEN)
        self.norm2 = norm(HIDDEN)
        self.mlp = nn.Linear(HIDDEN, HIDDEN)
        self.act = nn.Identity()

    def forward(self, hidden_states):
        residual = hidden_states
        hidden_states = self.norm1(hidden_states)
        hidden_states = self.attn(hidden_states)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.norm2(hidden_states)
        hidden_states = self.mlp(hidden_states)
        return residual + hidden_states


class Stack(nn.Module):
    def __init__(self, block: type[nn.Module] = Block, norm=LlamaRMSNorm):
        super().__init__()
        self.layers = nn.ModuleList([block(norm) for _ in range(2)])

    def forward(self, hidden_states):
        for layer in self.layers:
            hidden_states = layer(hidden_states)
        return hidden_states


def test_the_fused_forward_adds_into_the_norm():
    fuser = get_fuser(Block(), AddRMSNormFuser)
    assert [(s.hidden, s.residual, s.norm, s.source) for s in fuser.sites] == [
        ("hidden_states", "residual", "norm2", "attn")
    ]


class AliasReadLater(Block):
    def forward(self, hidden_states):
        residual = hidden_states
        layer_input = hidden_states
        hidden_states = self.norm1(hidden_states)
        hidden_states = self.attn(hidden_states)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.norm2(hidden_states)
        return self.mlp(hidden_states) + residual + layer_input


class ResidualReadBeforeAdd(Block):
    def forward(self, hidden_states):
        residual = hidden_states
        hidden_states = self.norm1(hidden_states)
        kept = residual
        hidden_states = self.attn(hidden_states)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.norm2(hidden_states)
        return self.mlp(hidden_states) + residual + kept


class OutputReadBeforeAdd(Block):
    def forward(self, hidden_states):
        residual = hidden_states
        hidden_states = self.norm1(hidden_states)
        hidden_states = self.attn(hidden_states)
        attended = hidden_states
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.norm2(hidden_states)
        return self.mlp(hidden_states) + residual + attended


class OutputOfAnIdentity(Block):
    # With no attention between, `act` hands back the residual's own tensor.
    def forward(self, hidden_states):
        residual = hidden_states
        hidden_states = self.norm1(hidden_states)
        hidden_states = self.act(residual)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.norm2(hidden_states)
        return self.mlp(hidden_states) + residual


class ScaledSum(Block):
    # Granite, MiniCPM: the branch is scaled before the add.
    def forward(self, hidden_states):
        residual = hidden_states
        hidden_states = self.norm1(hidden_states)
        hidden_states = self.attn(hidden_states)
        hidden_states = residual + hidden_states * 0.5
        residual = hidden_states
        hidden_states = self.norm2(hidden_states)
        return self.mlp(hidden_states) + residual


class ResidualNeverRebound(Block):
    def forward(self, x):
        hidden_states = self.attn(self.norm1(x))
        residual = x
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.norm2(hidden_states)
        return self.mlp(hidden_states) + residual + x


NEAR_MISSES = {
    AliasReadLater: "`hidden_states`, which holds the residual's value too, is read",
    ResidualReadBeforeAdd: "`residual` is read before the add",
    OutputReadBeforeAdd: "`hidden_states` is read between self.attn and the add",
    OutputOfAnIdentity: "`hidden_states` comes from self.act, which holds no weights",
    ScaledSum: "takes `hidden_states = residual + hidden_states * 0.5`, not "
    "`hidden_states = residual + hidden_states`",
    ResidualNeverRebound: "`x` still holds the residual's value at the add",
}


@pytest.mark.parametrize("cls", NEAR_MISSES, ids=lambda c: c.__name__)
def test_sites_the_statements_do_not_prove_are_declined(cls, declined):
    block = cls(LlamaRMSNorm)
    assert get_fuser(block, AddRMSNormFuser) is None
    (reason,) = declined(AddRMSNormFuser)
    assert NEAR_MISSES[cls] in reason


@pytest.mark.parametrize("cls", [AliasReadLater, OutputReadBeforeAdd], ids=lambda c: c.__name__)
def test_a_declined_site_fused_anyway_is_wrong_where_the_kernel_writes_in_place(
    cls, vllm_config, kernel_calls
):
    # Why those sites are declined: the forward reads again a tensor the kernel
    # overwrote (the layer's input through another name, the attention's output).
    block = randomize(cls(RMSNorm))
    forced = AddRMSNormFuser(
        sites=(Site(4, "hidden_states", "residual", "norm2", "attn"),)
    )
    forced.update_forward(block)
    x = torch.randn(TOKENS, HIDDEN)
    with torch.no_grad():
        expected = block(x.clone())
        actual = forced.fused_forward(block, x.clone())
    assert kernel_calls
    assert not torch.allclose(actual, expected, atol=1e-3)


def test_a_norm_not_on_vllms_kernel_keeps_every_add_apart(vllm_config):
    # A LayerNorm without bias looks like a norm, but it is no RMSNorm: the plan
    # withdraws the fused add from every layer.
    no_bias = functools.partial(nn.LayerNorm, bias=False)
    plan = FusionPlan(Stack(norm=no_bias), vllm_config)
    assert not any(isinstance(f, AddRMSNormFuser) for m in plan for f in plan[m])
    reasons = {d.reason for d in plan.declined if d.fuser == "AddRMSNormFuser"}
    assert len(reasons) == 1
    assert "layers.0.norm2 (LayerNorm) is not on vLLM's RMSNorm" in reasons.pop()


def test_a_stack_of_blocks_equals_the_original(vllm_config, kernel_calls):
    reference = randomize(Stack())
    model = copy.deepcopy(reference)
    fuse_plan(model, vllm_config)
    assert isinstance(model.layers[1].norm2, RMSNorm)
    x = torch.randn(TOKENS, HIDDEN)
    with torch.no_grad():
        torch.testing.assert_close(model(x.clone()), reference(x), atol=1e-6, rtol=1e-6)
    assert len(kernel_calls) == 2


class CastsItsBranch(Block):
    """The branch in another dtype than the residual: the sum takes the wider one,
    the fused kernel would take the branch's."""

    def forward(self, hidden_states):
        residual = hidden_states
        hidden_states = self.norm1(hidden_states)
        hidden_states = self.attn(hidden_states.to(torch.bfloat16))
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.norm2(hidden_states)
        return self.mlp(hidden_states) + residual


def test_operands_of_other_dtypes_take_the_original_statements(
    vllm_config, kernel_calls
):
    block = randomize(CastsItsBranch(LlamaRMSNorm))
    block.attn.to(torch.bfloat16)
    reference = copy.deepcopy(block)
    stack = nn.Module()
    stack.block = block
    fuse_plan(stack, vllm_config)
    assert isinstance(stack.block.norm2, RMSNorm)
    x = torch.randn(TOKENS, HIDDEN)
    with torch.no_grad():
        torch.testing.assert_close(stack.block(x), reference(x))
    assert not kernel_calls


def test_declined_models_say_why(build_backend):
    # Phi-3 adds its attention output through a dropout module.
    model = build_backend(small_config("phi3", pad_token_id=0))
    (reason,) = {
        d.reason
        for analysis in model.plan.analyses.values()
        for d in analysis.declined
        if d.fuser == "AddRMSNormFuser"
    }
    assert "residual + self.resid_attn_dropout(hidden_states)" in reason


def test_every_llama_layer_adds_its_residual_in_the_norm(build_backend):
    model = build_backend(small_config("llama", num_hidden_layers=3))
    plan = model.plan
    taken = sorted(
        plan.name(m) for m in plan if any(isinstance(f, AddRMSNormFuser) for f in plan[m])
    )
    assert taken == [f"model.layers.{i}" for i in range(3)]
    assert model.report.fusions["add_rms_norm"] == 3
