# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Pooling models (`pooling.py`): embeddings equal Sentence Transformers', class logits
equal `AutoModelForSequenceClassification`'s, scores equal `CrossEncoder`'s, on the
CPU engine and through the OpenAI server, for encoders (BERT, ModernBERT: vLLM's
encoder-only attention, no KV cache) and decoders (Qwen3: causal attention).

`E2E_IMPL=stock` runs the same engine and server cases on vLLM's stock backend."""

import json
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
import transformers
from transformers import AutoConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tiny  # noqa: E402
import tiny_pooling  # noqa: E402

ATOL = 1e-5
"""Per element, float32: two correct implementations differ by ~1e-6 here."""


def _meta_model(architecture: str, model_type: str, **overrides):
    config = AutoConfig.for_model(model_type, num_hidden_layers=1, **overrides)
    with torch.device("meta"):
        return getattr(transformers, architecture)._from_config(config)


# --- construction, no engine ------------------------------------------------------


def _recipe_config(name: str):
    recipe = tiny_pooling.RECIPES[name]
    config = AutoConfig.for_model(recipe.model_type, **recipe.overrides)
    config.architectures = [recipe.architecture]
    return config


@pytest.mark.parametrize(
    ("name", "backend_class", "causal"),
    [
        ("bert", "TransformersEmbeddingModel", False),
        ("modernbert", "TransformersEmbeddingModel", False),
        ("qwen3", "TransformersEmbeddingModel", True),
        ("bert_classifier", "TransformersForSequenceClassification", False),
    ],
)
def test_encoders_get_encoder_only_attention_and_decoders_causal(
    build_backend, name, backend_class, causal
):
    model = build_backend(_recipe_config(name), backend_class=backend_class)
    from vllm.model_executor.layers.attention import Attention

    layers = [m for m in model.modules() if isinstance(m, Attention)]
    assert len(layers) == 2
    expected = "Attention" if causal else "EncoderOnlyAttention"
    assert {type(layer).__name__ for layer in layers} == {expected}
    assert [a.causal for a in model.report.attention] == [causal, causal]


@pytest.mark.parametrize(
    ("name", "backend_class"),
    [
        ("qwen3_moe", "TransformersMoEEmbeddingModel"),
        ("qwen2_moe_classifier", "TransformersMoEForSequenceClassification"),
    ],
)
def test_moe_pooling_models_are_routed_to_their_class_and_fuse_their_experts(
    build_backend, name, backend_class
):
    """vLLM's registry asks for the MoE pooling classes by the config (an MoE whose
    architecture defaults to pooling); each builds with its experts and routers on
    vLLM's fused MoE and router, and its pooler or head."""
    from vllm.config import ModelConfig

    model_config = ModelConfig(
        model=str(tiny_pooling.build(name)),
        model_impl="transformers",
        skip_tokenizer_init=True,
    )
    assert model_config._get_transformers_backend_cls() == backend_class
    model = build_backend(_recipe_config(name), backend_class=backend_class)
    moe = model.report.details["moe"]
    assert len([d for d in moe if "vLLM fused MoE" in d]) == 2, moe
    assert model.report.servable and len(model.report.attention) == 2
    assert model.report.pooler.startswith("LAST pooling")


@pytest.mark.parametrize(
    ("name", "backend_class"),
    [
        ("llava", "TransformersMultiModalEmbeddingModel"),
        ("gemma3_classifier", "TransformersMultiModalForSequenceClassification"),
    ],
)
def test_multimodal_pooling_models_keep_their_tower_and_pool_the_decoder(
    build_backend, name, backend_class
):
    """vLLM's registry asks for the multimodal pooling classes for a vision-language
    config whose architecture defaults to pooling (a base model, a classifier): the
    tower and projector stay Transformers', the decoder is on vLLM attention."""
    from vllm.config import ModelConfig

    path = tiny_pooling.build_multimodal(name)
    model_config = ModelConfig(
        model=str(path), model_impl="transformers", skip_tokenizer_init=True
    )
    assert model_config._get_transformers_backend_cls() == backend_class
    model = build_backend(AutoConfig.from_pretrained(path), backend_class=backend_class)
    assert model.report.servable and len(model.report.attention) == 4
    assert set(model.report.kept) == {"vision_tower", "multi_modal_projector"}
    assert model.report.pooler.startswith("LAST pooling")


@pytest.mark.parametrize(
    ("architecture", "model_type", "overrides", "pooling", "modules"),
    [
        # The BERT pooler (CLS, dense, tanh), then `classifier`.
        ("BertForSequenceClassification", "bert", {}, "CLS", ("bert.pooler", "classifier")),
        # A head that selects the first token itself.
        ("RobertaForSequenceClassification", "roberta", {}, "CLS", ("classifier",)),
        ("XLMRobertaForSequenceClassification", "xlm-roberta", {}, "CLS", ("classifier",)),
        # The config says which tokens; the prediction head runs before `classifier`.
        ("ModernBertForSequenceClassification", "modernbert", dict(classifier_pooling="mean"), "MEAN", ("head", "classifier")),
        ("ModernBertForSequenceClassification", "modernbert", dict(classifier_pooling="cls"), "CLS", ("head", "classifier")),
        # A decoder classifies its last token.
        ("Qwen3ForSequenceClassification", "qwen3", {}, "LAST", ("score",)),
    ],
)  # fmt: skip
def test_classifier_head_is_read_from_the_transformers_model(
    architecture, model_type, overrides, pooling, modules
):
    from vllm.model_executor.models.transformers.pooling import ClassifierHead

    model = _meta_model(architecture, model_type, **overrides)
    head = ClassifierHead.of(model, causal=model_type == "qwen3")
    assert (head.pooling, head.modules) == (pooling, modules)


def test_a_head_whose_tokens_cannot_be_told_is_refused_naming_the_class():
    # DistilBERT selects the first token inline in its forward, before its head.
    from vllm.model_executor.models.transformers.pooling import ClassifierHead

    model = _meta_model("DistilBertForSequenceClassification", "distilbert")
    with pytest.raises(ValueError, match="DistilBertForSequenceClassification: its"):
        ClassifierHead.of(model, causal=False)


def test_roberta_positions_count_from_after_the_padding_index():
    from vllm.model_executor.models.transformers.pooling import position_offset

    roberta = _meta_model("RobertaModel", "roberta", pad_token_id=1)
    bert = _meta_model("BertModel", "bert")
    assert (position_offset(roberta), position_offset(bert)) == (2, 0)


def test_report_names_the_pooler_the_head_and_encoder_only_attention(vllm_runtime):
    from vllm.model_executor.models.transformers import report

    path = tiny_pooling.build("bert_classifier")
    built = report.build_report(report.load_config(str(path)), str(path))
    assert built.servable, built.reason
    assert built.pooler == "CLS pooling (bert.pooler)"
    assert built.head == "bert.pooler -> classifier (Linear, 1 labels)"
    assert not built.causal
    text = report.render(built, report.Style(False))
    assert "(BertSelfAttention) -> EncoderOnlyAttention, scale" in text
    assert "Pooler: CLS pooling (bert.pooler)" in text


def test_a_causal_lm_converted_to_an_embedder_loads_its_checkpoint(build_backend):
    """`--convert embed`: vLLM's adapter drops the LM head, whose checkpoint tensor
    the strict loader must then skip rather than refuse."""
    from vllm.config import LoadConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.models.adapters import as_embedding_model
    from vllm.model_executor.models.transformers import TransformersForCausalLM

    path = tiny.build("qwen3")
    model_config = ModelConfig(
        model=str(path), model_impl="transformers", dtype="float32", convert="embed"
    )
    assert model_config._get_transformers_backend_cls() == "TransformersForCausalLM"
    vllm_config = VllmConfig(model_config=model_config, load_config=LoadConfig())
    with set_current_vllm_config(vllm_config):
        model = as_embedding_model(TransformersForCausalLM)(vllm_config=vllm_config)
        get_model_loader(vllm_config.load_config).load_weights(model, model_config)
    assert type(model.lm_head).__name__ == "StageMissingLayer"


def test_an_embedder_loads_a_bert_checkpoint_without_its_pooler(
    vllm_runtime, tmp_path, caplog
):
    """BERT's pooler, whose output embeddings never pool, may be absent from the
    checkpoint: the model loads, and the log names the tensors it did not find once.
    Any other missing tensor is still refused (`test_loading`)."""
    import logging
    import shutil

    from safetensors.torch import load_file, save_file

    from vllm.config import LoadConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.models.transformers import TransformersEmbeddingModel
    from vllm.model_executor.models.transformers import loading

    folder = tmp_path / "bert"
    shutil.copytree(tiny_pooling.build("bert"), folder)
    tensors = load_file(folder / "model.safetensors")
    kept = {n: t for n, t in tensors.items() if not n.startswith("pooler.")}
    assert len(kept) == len(tensors) - 2  # the pooler's dense weight and bias
    save_file(kept, folder / "model.safetensors", metadata={"format": "pt"})
    model_config = ModelConfig(
        model=str(folder), model_impl="transformers", dtype="float32", runner="pooling"
    )
    vllm_config = VllmConfig(model_config=model_config, load_config=LoadConfig())
    with (
        caplog.at_level(logging.INFO, logger=loading.__name__),
        set_current_vllm_config(vllm_config),
    ):
        model = TransformersEmbeddingModel(vllm_config=vllm_config)
        get_model_loader(vllm_config.load_config).load_weights(model, model_config)
    logged = [r.getMessage() for r in caplog.records]
    assert [line for line in logged if "model.pooler" in line] == [
        "The checkpoint has no tensor for 'model.pooler.dense.bias', "
        "'model.pooler.dense.weight' (the base model's pooler: embeddings pool its "
        "hidden states, not its pooled output): not needed, left at zero."
    ]


# --- the CPU engine ---------------------------------------------------------------


def _impl() -> dict[str, str]:
    return dict(tiny.IMPLS[tiny.e2e_impl()])


@pytest.fixture(scope="module")
def engines():
    """One engine start per checkpoint, shared by the tests (a failed start is raised
    again by every test that needs it)."""
    runs: dict[str, tiny_pooling.PoolingRun | Exception] = {}

    def run(name: str) -> tiny_pooling.PoolingRun:
        if name not in runs:
            path = tiny_pooling.build(name)
            ids = tiny_pooling.encode(path)
            task = "classify" if name.endswith("classifier") else "embed"
            impl = _impl()
            try:
                runs[name] = tiny_pooling.run_engine(
                    path,
                    {task: ids},
                    backend=impl["backend"],
                    llm_kwargs=dict(model_impl=impl["model_impl"]),
                )
            except Exception as error:  # noqa: BLE001 - re-raised per test
                runs[name] = error
        found = runs[name]
        if isinstance(found, Exception):
            raise RuntimeError(f"pooling engine for {name} failed") from found
        return found

    return run


def _gap(actual, expected) -> float:
    actual, expected = torch.as_tensor(actual), torch.as_tensor(expected)
    assert actual.shape == expected.shape
    return (actual - expected).abs().max().item()


@pytest.mark.engine
@pytest.mark.parametrize("name", ["modernbert", "qwen3", "qwen3_moe"])
def test_embeddings_equal_sentence_transformers(engines, name):
    run = engines(name)
    path = tiny_pooling.build(name)
    expected = tiny_pooling.sentence_transformers_embeddings(path)
    gap = _gap(run.outputs["embed"], expected)
    assert gap <= ATOL, f"{name}: largest gap {gap:.3g}"
    # The texts' embeddings are far apart: a wrong pooling or mask cannot pass.
    assert torch.cdist(expected, expected).fill_diagonal_(1).min() > 1000 * ATOL
    print(f"\n[pooling] {name} embeddings: {run.seconds:.0f} s, max gap {gap:.2e}")


@pytest.mark.engine
def test_encoder_only_attention_keeps_no_kv_cache_and_decoders_do(engines):
    if tiny.e2e_impl() != "project":
        pytest.skip("inspects this backend's layers")
    (encoder,), (decoder,) = engines("modernbert").kv_cache, engines("qwen3").kv_cache
    assert encoder == {}
    assert len(decoder) == 2
    (probe,) = engines("modernbert").probe
    assert {a["attn_class"] for a in probe["attached"]} == {"EncoderOnlyAttention"}


@pytest.mark.engine
@pytest.mark.parametrize("name", ["qwen3_classifier", "qwen2_moe_classifier"])
def test_decoder_class_logits_equal_transformers(engines, name):
    """Qwen3, and Qwen2-MoE (experts on vLLM's fused MoE, a gated shared expert)."""
    run = engines(name)
    expected = tiny_pooling.classifier_logits(tiny_pooling.build(name))
    gap = _gap(run.outputs["classify"], expected)
    assert gap <= ATOL, f"largest gap {gap:.3g}"
    # The texts' logits are far apart: a wrong token or expert cannot pass.
    assert torch.cdist(expected, expected).fill_diagonal_(1).min() > 1000 * ATOL
    print(f"\n[pooling] {name}: {run.seconds:.0f} s, max gap {gap:.2e}")


@pytest.mark.engine
@pytest.mark.parametrize("name", ["llava"])
def test_multimodal_pooling_equals_transformers(name):
    """LLaVA's base model as an embedder, on prompts with one image, two and none:
    the engine's embeddings equal the HF model's last token's, normalised. (Gemma 3's
    classifier takes its class from the same mixin, whose images are refused on this
    CPU engine as the causal model's are: `test_image_attention.py`.)"""
    import tiny_multimodal

    path = tiny_pooling.build_multimodal(name)
    requests = list(tiny_multimodal.REQUESTS.values())
    task = "classify" if name.endswith("classifier") else "embed"
    impl = _impl()
    run = tiny_pooling.run_engine(
        path,
        {task: tiny_pooling.multimodal_task(name, requests)},
        backend=impl["backend"],
        llm_kwargs=dict(model_impl=impl["model_impl"]),
    )
    expected = tiny_pooling.multimodal_outputs(path, name, requests)
    gap = _gap(run.outputs[task], expected)
    assert gap <= ATOL, f"{name}: largest gap {gap:.3g}"
    # The requests' outputs are far apart: an image dropped cannot pass.
    assert torch.cdist(expected, expected).fill_diagonal_(1).min() > 1000 * ATOL
    print(f"\n[pooling] {name} with images: {run.seconds:.0f} s, max gap {gap:.2e}")


# --- the OpenAI server ------------------------------------------------------------


def _post(server: tiny.Server, route: str, body: dict) -> dict:
    request = urllib.request.Request(
        server.base_url.removesuffix("/v1") + route,
        data=json.dumps({"model": server.model, **body}).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as error:
        raise AssertionError(f"{route}: {error.code} {error.read().decode()}") from None


def _serve(name: str, tmp_path_factory, *extra_args: str):
    impl = _impl()
    return tiny.serve(
        tiny_pooling.build(name),
        model_impl=impl["model_impl"],
        backend=impl["backend"],
        log_dir=tmp_path_factory.mktemp(f"server-{name}"),
        extra_args=("--runner", "pooling", *extra_args),
    )


@pytest.mark.engine
def test_served_bert_embeddings_answer_openai_as_sentence_transformers(
    tmp_path_factory,
):
    openai = pytest.importorskip("openai")
    path = tiny_pooling.build("bert")
    expected = tiny_pooling.sentence_transformers_embeddings(path)
    with _serve("bert", tmp_path_factory) as server:
        client = openai.OpenAI(
            base_url=server.base_url, api_key="EMPTY", timeout=120, max_retries=0
        )
        response = client.embeddings.create(
            model=server.model, input=tiny_pooling.TEXTS, encoding_format="float"
        )
    actual = [item.embedding for item in sorted(response.data, key=lambda d: d.index)]
    gap = _gap(actual, expected)
    assert gap <= ATOL, f"largest gap {gap:.3g}"
    print(f"\n[pooling] bert embeddings (server): max gap {gap:.2e}")


@pytest.mark.engine
def test_served_bert_cross_encoder_classifies_scores_and_reranks_as_transformers(
    tmp_path_factory,
):
    """Compiled (vLLM's default), so one graph serves texts without token types
    (classify) and pairs with them (score, rerank), in that order."""
    path = tiny_pooling.build("bert_classifier")
    logits = tiny_pooling.classifier_logits(path)
    scores = tiny_pooling.cross_encoder_scores(
        path, tiny_pooling.QUERY, tiny_pooling.DOCUMENTS
    )
    with _serve("bert_classifier", tmp_path_factory, "--no-enforce-eager") as server:
        classified = _post(
            server,
            "/classify",
            {"input": tiny_pooling.TEXTS, "use_activation": False},
        )
        scored = _post(
            server,
            "/score",
            {"queries": tiny_pooling.QUERY, "documents": tiny_pooling.DOCUMENTS},
        )
        reranked = _post(
            server,
            "/rerank",
            {"query": tiny_pooling.QUERY, "documents": tiny_pooling.DOCUMENTS},
        )
        log = server.log()
    rows = sorted(classified["data"], key=lambda d: d["index"])
    scored_rows = sorted(scored["data"], key=lambda d: d["index"])
    reranked_rows = sorted(reranked["results"], key=lambda r: r["index"])
    assert {row["label"] for row in rows} == {"relevant"}  # the config's id2label
    gaps = dict(
        classify=_gap([row["probs"] for row in rows], logits),
        score=_gap([row["score"] for row in scored_rows], scores),
        rerank=_gap([row["relevance_score"] for row in reranked_rows], scores),
    )
    assert max(gaps.values()) <= ATOL, gaps
    # vLLM's CPU engine compiles unless eager (`DYNAMO_TRACE_ONCE`: traced once, run
    # without guards, so the graph must take token types on every call).
    assert "Warming up model for the compilation" in log, tiny._tail(log)
    # The tiny model reads the second text's token types: without them its scores
    # move far beyond the tolerance, so equal scores mean they reached the model.
    untyped = tiny_pooling.pair_scores(
        path, tiny_pooling.QUERY, tiny_pooling.DOCUMENTS, token_types=False
    )
    assert _gap(untyped, scores) > 100 * ATOL
    print(f"\n[pooling] bert cross-encoder (server): {gaps}")
