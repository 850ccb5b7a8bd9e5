# SPDX-License-Identifier: Apache-2.0
"""Repository code (`trust_remote_code=True`) on the CPU engine: a Baichuan-style
attention that computes q, k and v with one packed `W_pack` and views each third
with the module's own head count (`self.num_heads`), written by the test beside a
random checkpoint.

At one rank `W_pack` is fused into vLLM's `QKVParallelLinear` and the model answers
as Transformers does. Under tensor parallelism a rank would hold a share of the
heads `self.num_heads` names, so the fusion is declined there and `W_pack` stays
whole on every rank, while `o_proj` is split: the model is refused when it is built,
naming the module, the layer and the mismatch, never at its first request (as it
once failed, `shape '[1, 4, 4, 32]' is invalid for input of size 256`)."""

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest
import tiny
import torch

pytestmark = pytest.mark.engine

MODELING = '''
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import (
    ALL_ATTENTION_FUNCTIONS,
    apply_rotary_pos_emb,
    eager_attention_forward,
)


class PackedConfig(LlamaConfig):
    model_type = "packed_llama"


class PackedAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.num_key_value_groups = 1
        self.scaling = self.head_dim**-0.5
        self.is_causal = True
        self.W_pack = nn.Linear(self.hidden_size, 3 * self.hidden_size, bias=False)
        self.o_proj = nn.Linear(self.hidden_size, self.hidden_size, bias=False)

    def forward(
        self, hidden_states, position_embeddings, attention_mask=None,
        past_key_values=None, **kwargs,
    ):
        batch, tokens, _ = hidden_states.size()
        q, k, v = (
            part.view(batch, tokens, self.num_heads, self.head_dim).transpose(1, 2)
            for part in self.W_pack(hidden_states).chunk(3, -1)
        )
        cos, sin = position_embeddings
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.layer_idx)
        attend = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        out, weights = attend(
            self, q, k, v, attention_mask, dropout=0.0, scaling=self.scaling, **kwargs
        )
        return self.o_proj(out.reshape(batch, tokens, self.hidden_size)), weights


class PackedForCausalLM(LlamaForCausalLM):
    config_class = PackedConfig

    def __init__(self, config):
        super().__init__(config)
        for index, layer in enumerate(self.model.layers):
            layer.self_attn = PackedAttention(config, index)
        self.post_init()
'''


def _random_checkpoint(folder: Path, modeling: Path) -> Path:
    """The first seed whose greedy paths keep `tiny.MIN_MARGIN`, every 1-D
    parameter perturbed, saved with the repository code beside it."""
    spec = importlib.util.spec_from_file_location("modeling_packed", modeling)
    code = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(code)
    config = code.PackedConfig(
        **{**tiny.COMMON, "num_key_value_heads": tiny.COMMON["num_attention_heads"]},
        initializer_range=0.1,
        architectures=["PackedForCausalLM"],
        auto_map={
            "AutoConfig": "modeling_packed.PackedConfig",
            "AutoModelForCausalLM": "modeling_packed.PackedForCausalLM",
        },
    )
    prompt_ids = tiny.encode(None, tiny.PROMPTS)
    for seed in range(tiny.MAX_SEED_TRIES):
        torch.manual_seed(seed)
        model = code.PackedForCausalLM(config).eval()
        with torch.no_grad():
            for parameter in model.parameters():
                if parameter.dim() == 1:
                    parameter.add_(0.1 * torch.randn_like(parameter))
            model.lm_head.weight.mul_(2.0)
        paths = tiny.greedy(model, prompt_ids, tiny.MAX_TOKENS)
        if min(min(c.margins) for c in paths) >= tiny.MIN_MARGIN:
            break
    else:
        raise AssertionError("no seed gives the packed model well-separated logits")
    model.save_pretrained(folder)
    shutil.copy(modeling, folder / "modeling_packed.py")
    tiny.make_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("packed")
    modeling = root / "modeling_packed.py"
    modeling.write_text(MODELING)
    try:
        return _random_checkpoint(root / "checkpoint", modeling)
    finally:
        sys.modules.pop("modeling_packed", None)


def _engine(path: Path, tensor_parallel_size: int) -> tiny.EngineRun:
    return tiny.run_engine(
        path,
        tensor_parallel_size=tensor_parallel_size,
        llm_kwargs=dict(trust_remote_code=True),
        **tiny.IMPLS["project"],
    )


def test_a_packed_projection_equals_transformers_at_one_rank(packed):
    run = _engine(packed, 1)
    gap = tiny.compare(tiny.reference(packed, trust_remote_code=True), run.completions)
    tiny.report("packed remote code (project) vs Transformers", run, gap)
    assert "vLLM attention in 4/4 layers" in run.log
    for layer in range(4):
        assert (
            f"Fused: packed W_pack (model.layers.{layer}.self_attn: PackedAttention) "
            "-> QKVParallelLinear"
        ) in run.log


def test_heads_viewed_with_the_modules_own_count_are_refused_at_two_ranks(packed):
    with pytest.raises(RuntimeError) as refused:
        _engine(packed, 2)
    message = str(refused.value)
    assert "model.layers.0.self_attn (PackedAttention, layer 0)" in message
    assert "under tensor parallelism (2 ranks)" in message
    assert "o_proj reads 1/2 of the attention output on each rank" in message
    assert "tensor_parallel_size=1" in message
