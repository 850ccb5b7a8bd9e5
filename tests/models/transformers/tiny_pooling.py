# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Tiny local pooling checkpoints (embedders, classifiers), their references (Sentence
Transformers, `AutoModelForSequenceClassification`, `CrossEncoder`), and a vLLM
pooling engine runner. Built on `tiny.py`'s vocabulary, cache and process handling.

Every checkpoint is a Transformers model with seeded random weights and every 1-D
parameter (norm weights, biases) perturbed; an embedder also gets the Sentence
Transformers files (`modules.json`, `1_Pooling/config.json`, `2_Normalize`) that
vLLM and Sentence Transformers both read its pooling from. Encoders get a BERT-style
tokenizer (`<s> A </s>`, a pair's second text with token type 1), decoders `tiny`'s.

Command line (the engine runner uses it):
    python tiny_pooling.py engine SPEC.json OUT.json
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tiny  # noqa: E402

RECIPE_VERSION = 3

ENCODER: dict[str, Any] = dict(
    vocab_size=tiny.VOCAB_SIZE,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,  # heads of 32: the CPU attention's smallest
    max_position_embeddings=tiny.MAX_MODEL_LEN,
    pad_token_id=tiny.PAD_ID,
    bos_token_id=tiny.BOS_ID,
    eos_token_id=tiny.EOS_ID,
    initializer_range=0.1,  # 0.02 would leave the logits of a classifier near 0
    hidden_dropout_prob=0.1,  # off at inference: must not change the output
    attention_probs_dropout_prob=0.1,
)


@dataclass(frozen=True)
class Recipe:
    model_type: str
    architecture: str
    """The Transformers class the checkpoint is saved from (and names in its config)."""
    overrides: dict[str, Any]
    pooling: str | None = None
    """Sentence Transformers pooling mode (`mean`, `cls`, `lasttoken`); embedders."""
    normalize: bool = False
    encoder: bool = True
    """BERT-style tokenizer (with token types for a pair) rather than `tiny`'s."""


RECIPES: dict[str, Recipe] = {
    # BERT: absolute positions, token types, LayerNorm, biases, a pooler the
    # embedder does not use; mean pooling, not normalised.
    "bert": Recipe("bert", "BertModel", dict(ENCODER, type_vocab_size=2), "mean"),
    # ModernBERT: rotary, packed Wqkv, gated MLP, no biases; CLS pooling, normalised.
    "modernbert": Recipe(
        "modernbert",
        "ModernBertModel",
        dict(
            ENCODER,
            hidden_dropout_prob=None,
            attention_probs_dropout_prob=None,
            cls_token_id=tiny.BOS_ID,
            sep_token_id=tiny.EOS_ID,
            global_attn_every_n_layers=1,
        ),
        "cls",
        normalize=True,
    ),
    # Qwen3 decoder as an embedder (as Sentence Transformers saves one: the base
    # model), last token, normalised.
    "qwen3": Recipe(
        "qwen3",
        "Qwen3Model",
        dict(tiny.overrides("qwen3"), num_hidden_layers=2),
        "lasttoken",
        normalize=True,
        encoder=False,
    ),
    # Qwen3-MoE decoder as an embedder (its base model), last token, normalised:
    # experts on vLLM's fused MoE, softmax top-k renormalised.
    "qwen3_moe": Recipe(
        "qwen3_moe",
        "Qwen3MoeModel",
        dict(tiny.overrides("qwen3_moe"), num_hidden_layers=2),
        "lasttoken",
        normalize=True,
        encoder=False,
    ),
    # BERT cross-encoder: one logit (a relevance score), the CLS token through the
    # BERT pooler, then `classifier`.
    "bert_classifier": Recipe(
        "bert",
        "BertForSequenceClassification",
        dict(ENCODER, type_vocab_size=2, num_labels=1, id2label={0: "relevant"}),
    ),
    # Qwen3 classifier: `score` on the last token, three named labels.
    "qwen3_classifier": Recipe(
        "qwen3",
        "Qwen3ForSequenceClassification",
        dict(
            tiny.overrides("qwen3"),
            num_hidden_layers=2,
            id2label={0: "negative", 1: "neutral", 2: "positive"},
        ),
        encoder=False,
    ),
    # Qwen2-MoE classifier: top-k not renormalised, a shared expert behind a
    # sigmoid gate; `score` on the last token, three named labels.
    "qwen2_moe_classifier": Recipe(
        "qwen2_moe",
        "Qwen2MoeForSequenceClassification",
        dict(
            tiny.overrides("qwen2_moe"),
            num_hidden_layers=2,
            id2label={0: "negative", 1: "neutral", 2: "positive"},
        ),
        encoder=False,
    ),
}

MULTIMODAL: dict[str, tuple[str, str]] = {
    # LLaVA's base model as an embedder (what Sentence Transformers would save):
    # the CLIP tower and projector, the Llama decoder's last token, normalised.
    "llava": ("llava", "LlavaModel"),
    # Gemma 3's classifier: the SigLIP tower and projector, `score` on the last
    # token of its Gemma 3 decoder.
    "gemma3_classifier": ("gemma3", "Gemma3ForSequenceClassification"),
}
"""Vision-language pooling checkpoints: name -> (`tiny_multimodal` recipe whose
config, tokenizer and processor they take, the Transformers class saved)."""

TEXTS = [
    "the small cat sees a big dog near the river",
    "one two three four five",
    "today the king and the queen walks near the old city with many friend",
    "rain",
]
QUERY = "where is the cat"
DOCUMENTS = [
    "the small cat sees a big dog near the river",
    "the cat is on the bed in the house",
    "one two three four five",
]


def make_tokenizer(encoder: bool):
    """`tiny`'s word-level tokenizer; for an encoder, BERT's layout: `<s> A </s>` and,
    for a pair, `<s> A </s> B </s>` with the second text's token types 1."""
    if not encoder:
        return tiny.make_tokenizer()
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    cls, sep = tiny.BOS, tiny.EOS
    backend = Tokenizer(
        models.WordLevel({w: i for i, w in enumerate(tiny.VOCAB)}, unk_token=tiny.UNK)
    )
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.post_processor = processors.TemplateProcessing(
        single=f"{cls} $A {sep}",
        pair=f"{cls} $A {sep} $B:1 {sep}:1",
        special_tokens=[(cls, tiny.BOS_ID), (sep, tiny.EOS_ID)],
    )
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=cls,
        eos_token=sep,
        cls_token=cls,
        sep_token=sep,
        unk_token=tiny.UNK,
        pad_token=tiny.PAD,
        model_max_length=tiny.MAX_MODEL_LEN,
        model_input_names=["input_ids", "token_type_ids", "attention_mask"],
    )


def fingerprint(name: str) -> str:
    recipe = dict(
        version=RECIPE_VERSION,
        seed=tiny.SEED,
        vocab=tiny.VOCAB,
        **asdict(RECIPES[name]),
    )
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]


def _random_model(recipe: Recipe):
    import torch
    import transformers
    from transformers import AutoConfig

    config = AutoConfig.for_model(recipe.model_type, **recipe.overrides)
    config.architectures = [recipe.architecture]
    torch.manual_seed(tiny.SEED)
    model = getattr(transformers, recipe.architecture)._from_config(
        config, dtype=torch.float32, attn_implementation="eager"
    )
    generator = torch.Generator().manual_seed(tiny.SEED + 1)
    with torch.no_grad():
        for _, param in sorted(model.named_parameters()):
            if param.ndim == 1:
                param.add_(torch.randn(param.shape, generator=generator) * 0.1)
    return model.eval()


def _write_sentence_transformers(folder: Path, recipe: Recipe, hidden: int) -> None:
    kinds = ["Transformer", "Pooling"] + ["Normalize"] * recipe.normalize
    paths = ["", "1_Pooling", "2_Normalize"]
    modules = [
        dict(
            idx=i,
            name=str(i),
            path=paths[i],
            type=f"sentence_transformers.models.{kind}",
        )
        for i, kind in enumerate(kinds)
    ]
    if recipe.normalize:
        (folder / "2_Normalize").mkdir()
    (folder / "modules.json").write_text(json.dumps(modules, indent=2))
    (folder / "sentence_bert_config.json").write_text(
        json.dumps(dict(max_seq_length=tiny.MAX_MODEL_LEN, do_lower_case=False))
    )
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(
        json.dumps(dict(embedding_dimension=hidden, pooling_mode=recipe.pooling))
    )


def build(name: str) -> Path:
    """Build (or reuse) the tiny pooling checkpoint `name` (a key of `RECIPES`)."""
    recipe = RECIPES[name]
    target = tiny.CACHE / f"pooling-{name}"
    stamp = target / "tiny.json"
    want = fingerprint(name)
    if stamp.is_file() and json.loads(stamp.read_text()).get("fingerprint") == want:
        return target
    tiny._quiet_transformers()
    model = _random_model(recipe)
    tiny.CACHE.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".pooling-{name}-", dir=tiny.CACHE))
    try:
        model.save_pretrained(staging, safe_serialization=True)
        make_tokenizer(recipe.encoder).save_pretrained(staging)
        if recipe.pooling is not None:
            _write_sentence_transformers(staging, recipe, model.config.hidden_size)
        stamp_data = dict(fingerprint=want, name=name, **asdict(recipe))
        (staging / "tiny.json").write_text(json.dumps(stamp_data, indent=2))
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def build_multimodal(name: str) -> Path:
    """Build (or reuse) the vision-language pooling checkpoint `name` (a key of
    `MULTIMODAL`), with its processor and, for an embedder, the Sentence
    Transformers pooling (last token, normalised) vLLM reads."""
    import torch
    import transformers

    import tiny_multimodal

    recipe_name, architecture = MULTIMODAL[name]
    recipe = tiny_multimodal.RECIPES[recipe_name]
    target = tiny.CACHE / f"pooling-mm-{name}"
    stamp = target / "tiny.json"
    want = hashlib.sha256(
        json.dumps(
            [RECIPE_VERSION, architecture, tiny_multimodal.fingerprint(recipe_name)]
        ).encode()
    ).hexdigest()[:16]
    if stamp.is_file() and json.loads(stamp.read_text()).get("fingerprint") == want:
        return target
    tiny._quiet_transformers()
    config = tiny_multimodal.config(recipe)
    config.architectures = [architecture]
    torch.manual_seed(tiny.SEED)
    model = getattr(transformers, architecture)._from_config(
        config, dtype=torch.float32, attn_implementation="eager"
    )
    generator = torch.Generator().manual_seed(tiny.SEED + 1)
    with torch.no_grad():
        for _, param in sorted(model.named_parameters()):
            if param.ndim == 1:
                param.add_(torch.randn(param.shape, generator=generator) * 0.1)
    staging = Path(tempfile.mkdtemp(prefix=f".pooling-mm-{name}-", dir=tiny.CACHE))
    try:
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer = tiny_multimodal.make_tokenizer(recipe)
        tiny_multimodal.make_processor(recipe, tokenizer).save_pretrained(staging)
        if not architecture.endswith("ForSequenceClassification"):
            embedder = Recipe(recipe.model_type, architecture, {}, "lasttoken", True)
            _write_sentence_transformers(staging, embedder, config.text_config.hidden_size)
        (staging / "tiny.json").write_text(json.dumps(dict(fingerprint=want)))
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def multimodal_outputs(path: Path, name: str, requests: list):
    """Transformers' output for each `tiny_multimodal.Request` (its processor's
    inputs): the last token's hidden state normalised (an embedder), or the
    classifier's logits."""
    import torch
    import transformers
    from transformers import AutoProcessor

    import tiny_multimodal

    recipe_name, architecture = MULTIMODAL[name]
    recipe = tiny_multimodal.RECIPES[recipe_name]
    processor = AutoProcessor.from_pretrained(str(path))
    model = getattr(transformers, architecture).from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    rows = []
    with torch.no_grad():
        for request in requests:
            images = [i.pil() for i in request.images] or None
            inputs = processor(
                text=request.prompt(recipe), images=images, return_tensors="pt"
            )
            output = model(**inputs)
            if architecture.endswith("ForSequenceClassification"):
                rows.append(output.logits[0])
            else:
                last = output.last_hidden_state[0, -1]
                rows.append(torch.nn.functional.normalize(last, dim=-1))
    return torch.stack(rows)


def encode(path: Path, texts: list[str] = TEXTS) -> list[list[int]]:
    tokenizer = tiny.load_tokenizer(path)
    ids = [tokenizer(t)["input_ids"] for t in texts]
    assert all(tiny.UNK_ID not in row for row in ids), texts
    return ids


# --- references -----------------------------------------------------------------------


def sentence_transformers_embeddings(path: Path, texts: list[str] = TEXTS):
    """Sentence Transformers' embeddings of `texts` (float32), one text at a time, from
    the token ids of the checkpoint's tokenizer as saved (see `tiny.load_tokenizer`)."""
    import torch
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(path), device="cpu").eval()
    rows = []
    with torch.no_grad():
        for ids in encode(path, texts):
            input_ids = torch.tensor([ids])
            features = dict(
                input_ids=input_ids, attention_mask=torch.ones_like(input_ids)
            )
            rows.append(model(features)["sentence_embedding"][0])
    return torch.stack(rows)


def classifier_logits(path: Path, texts: list[str] = TEXTS):
    """`AutoModelForSequenceClassification`'s logits, one text at a time."""
    import torch
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        return torch.cat(
            [model(input_ids=torch.tensor([ids])).logits for ids in encode(path, texts)]
        )


def cross_encoder_scores(path: Path, query: str, documents: list[str]):
    """`CrossEncoder.predict` on (query, document) pairs: its sigmoid of one logit."""
    import torch
    from sentence_transformers import CrossEncoder

    model = CrossEncoder(str(path), device="cpu")
    return torch.as_tensor(
        model.predict([(query, d) for d in documents], convert_to_numpy=True)
    )


def pair_scores(path: Path, query: str, documents: list[str], token_types: bool):
    """The sigmoid of `AutoModelForSequenceClassification`'s one logit for each
    (query, document) pair, with the tokenizer's token types or all of them 0."""
    import torch
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(str(path)).eval()
    tokenizer = tiny.load_tokenizer(path)
    scores = []
    with torch.no_grad():
        for document in documents:
            pair = tokenizer(query, document, return_tensors="pt")
            if not token_types:
                pair["token_type_ids"] = torch.zeros_like(pair["token_type_ids"])
            scores.append(torch.sigmoid(model(**pair).logits[0, 0]))
    return torch.stack(scores)


# --- vLLM pooling engine, in a fresh interpreter -----------------------------------


@dataclass
class PoolingRun:
    """What one pooling engine start produced."""

    outputs: dict[str, Any]
    seconds: float
    log: str
    probe: list[dict[str, Any]] | None = None
    kv_cache: list[dict[str, Any]] | None = None


def run_engine(
    path: Path,
    tasks: dict[str, Any],
    *,
    backend: str = "project",
    llm_kwargs: dict[str, Any] | None = None,
    timeout: float = 600,
) -> PoolingRun:
    """Start `vllm.LLM(runner="pooling")` in a subprocess and run `tasks`: `embed`
    and `classify` (lists of token id lists, or of `multimodal_task` requests),
    `score` (`[query, documents]`).
    Also returns what `tiny._probe` saw and each worker's KV cache spec."""
    spec = dict(model=str(path), tasks=tasks, llm_kwargs=llm_kwargs or {})
    env = dict(os.environ)
    env["VLLM_TRANSFORMERS_BACKEND"] = backend
    env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    env.setdefault("VLLM_LOGGING_LEVEL", "INFO")
    here = str(Path(__file__).resolve().parent)
    env["PYTHONPATH"] = os.pathsep.join([here, *filter(None, [env.get("PYTHONPATH")])])
    env.pop("PYTEST_CURRENT_TEST", None)
    out, seconds, log = tiny.run_engine_script(__file__, spec, env, timeout)
    return PoolingRun(out["outputs"], seconds, log, out["probe"], out["kv_cache"])


def _prompt(item: list[int] | dict[str, Any]) -> dict[str, Any]:
    """An engine prompt: token ids, or a `{"prompt", "images"}` request with images
    (`tiny_multimodal.Image` fields)."""
    if isinstance(item, list):
        return {"prompt_token_ids": item}
    import tiny_multimodal

    prompt: dict[str, Any] = {"prompt": item["prompt"]}
    if item["images"]:
        images = [tiny_multimodal.Image(**i).pil() for i in item["images"]]
        prompt["multi_modal_data"] = {"image": images}
    return prompt


def multimodal_task(name: str, requests: list) -> list[dict[str, Any]]:
    """`requests` (`tiny_multimodal.Request`s) as an engine task's items."""
    import tiny_multimodal

    recipe = tiny_multimodal.RECIPES[MULTIMODAL[name][0]]
    return [
        dict(prompt=r.prompt(recipe), images=[asdict(i) for i in r.images])
        for r in requests
    ]


def _engine_main(spec_file: str, out_file: str) -> None:
    spec = json.loads(Path(spec_file).read_text())
    from vllm import LLM, PoolingParams

    kwargs = dict(
        model=spec["model"],
        runner="pooling",
        model_impl="transformers",
        dtype="float32",
        seed=0,
        max_model_len=tiny.MAX_MODEL_LEN,
        kv_cache_memory_bytes=1 << 30,
        enforce_eager=True,
    )
    kwargs.update(spec["llm_kwargs"])
    llm = LLM(**kwargs)
    tasks, outputs = spec["tasks"], {}
    if "embed" in tasks:
        prompts = [_prompt(item) for item in tasks["embed"]]
        results = llm.embed(prompts, use_tqdm=False)
        outputs["embed"] = [r.outputs.embedding for r in results]
    if "classify" in tasks:
        prompts = [_prompt(item) for item in tasks["classify"]]
        # Raw logits, as `AutoModelForSequenceClassification` returns them.
        params = PoolingParams(use_activation=False)
        results = llm.classify(prompts, pooling_params=params, use_tqdm=False)
        outputs["classify"] = [r.outputs.probs for r in results]
    if "score" in tasks:
        query, documents = tasks["score"]
        results = llm.score(query, documents, use_tqdm=False)
        outputs["score"] = [r.outputs.score for r in results]
    import tiny as probes  # importable in every engine process (PYTHONPATH)

    probe = llm.apply_model(probes._probe)
    kv_cache = llm.collective_rpc(probes._kv_cache_probe)
    Path(out_file).write_text(
        json.dumps(dict(outputs=outputs, probe=probe, kv_cache=kv_cache))
    )
    del llm


if __name__ == "__main__":
    if sys.argv[1:2] != ["engine"]:
        raise SystemExit(__doc__)
    _engine_main(*sys.argv[2:4])
