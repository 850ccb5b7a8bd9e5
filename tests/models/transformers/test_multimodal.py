# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Vision-language models (`multimodal.py`): greedy tokens and log-probabilities
equal Transformers' `generate` on prompts with one image, two images and none, on
the CPU engine and through the OpenAI server (an image as a `data:` URL); the
vision tower stays Transformers' and is not built for a text-only engine; M-RoPE
positions equal the HF model's.

One engine start per case, shared by its tests. `E2E_IMPL=stock` runs the engine
cases on vLLM's stock backend."""

import base64
import functools
import io
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tiny  # noqa: E402
import tiny_multimodal  # noqa: E402

REQUESTS = list(tiny_multimodal.REQUESTS)


@functools.cache
def checkpoint(name: str) -> Path:
    return tiny_multimodal.build(name)


@functools.cache
def reference(name: str) -> dict[str, tiny_multimodal.Completion]:
    requests = tiny_multimodal.requests(tiny_multimodal.RECIPES[name])
    completions = tiny_multimodal.reference(
        checkpoint(name), name, list(requests.values())
    )
    return dict(zip(requests, completions))


COMPILED = "qwen2_vl"
"""Its shared engine runs under vLLM's torch.compile integration (the engine's
default); the other engine cases run eager, to save time."""


@functools.cache
def engine(name: str) -> tiny_multimodal.MultiModalRun:
    """One engine start per model, on all its requests, shared by the tests."""
    requests = tiny_multimodal.requests(tiny_multimodal.RECIPES[name])
    run = tiny_multimodal.run_engine(
        checkpoint(name),
        name,
        list(requests.values()),
        backend=tiny.IMPLS[tiny.e2e_impl()]["backend"],
        llm_kwargs=dict(enforce_eager=False) if name == COMPILED else None,
    )
    assert run.compiled == (name == COMPILED)
    return run


def _compare(
    want: tiny_multimodal.Completion, got: tiny_multimodal.Completion
) -> float:
    assert got.prompt_ids == want.prompt_ids, "the image placeholders differ"
    assert got.token_ids == want.token_ids
    gap = max(abs(a - b) for a, b in zip(want.logprobs, got.logprobs))
    assert gap <= tiny.LOGPROB_ATOL, f"logprob gap {gap:.3g}"
    return gap


@pytest.mark.engine
@pytest.mark.parametrize("request_name", REQUESTS)
@pytest.mark.parametrize("name", ["llava", "emu3", "qwen2_vl", "qwen2_5_vl"])
def test_equals_transformers(name, request_name):
    """LLaVA: CLIP tower and projector (Transformers') and a Llama decoder on vLLM
    attention. Emu3 (one of the models vLLM 0.32 sends to this backend by default):
    a VQ-VAE turns the picture into tokens the decoder embeds. Qwen2-VL and
    Qwen2.5-VL: each picture at its own resolution (the two of the second request
    of different shapes, so their M-RoPE positions differ), the processor built
    without its video processor, which needs torchvision; Qwen2-VL compiled
    (`COMPILED`). Same greedy tokens and log-probabilities as Transformers on one
    image, two and none."""
    run = engine(name)
    got = run.completions[REQUESTS.index(request_name)]
    gap = _compare(reference(name)[request_name], got)
    print(f"\n[e2e] {name}, {request_name}: {run.seconds:.1f} s, gap {gap:.2e}")


@pytest.fixture(scope="module")
def llava() -> Path:
    return checkpoint("llava")


@pytest.fixture(scope="module")
def llava_reference() -> dict[str, tiny_multimodal.Completion]:
    return reference("llava")


@pytest.mark.engine
def test_llava_keeps_the_tower_with_transformers():
    if tiny.e2e_impl() != "project":
        pytest.skip("the fusion report is this backend's")
    report = engine("llava").report
    assert "vLLM attention in 4/4 layers" in report
    assert "kept with Transformers: vision_tower, multi_modal_projector" in report


@pytest.mark.engine
def test_llava_text_only_engine_skips_the_tower(llava, llava_reference):
    """`limit_mm_per_prompt={"image": 0}`: the tower is dropped on `meta`, its
    checkpoint tensors are skipped, and a text prompt is served as Transformers
    does."""
    if tiny.e2e_impl() != "project":
        pytest.skip("the fusion report is this backend's")
    run = tiny_multimodal.run_engine(
        llava,
        "llava",
        [tiny_multimodal.REQUESTS["text only"]],
        llm_kwargs=dict(limit_mm_per_prompt={"image": 0}),
    )
    _compare(llava_reference["text only"], run.completions[0])
    assert "not built: vision_tower, multi_modal_projector" in run.report


@pytest.mark.engine
def test_llava_tensor_parallel_equals_transformers(llava, llava_reference, monkeypatch):
    """TP=2, a worker process per rank bound to its own core: the decoder's fused
    linears split across the ranks, the tower and projector (Transformers') whole on
    each; one image, two and none as Transformers."""
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    run = tiny_multimodal.run_engine(
        llava,
        "llava",
        [tiny_multimodal.REQUESTS[name] for name in REQUESTS],
        backend=tiny.IMPLS[tiny.e2e_impl()]["backend"],
        llm_kwargs=dict(tensor_parallel_size=2),
    )
    gaps = [
        _compare(llava_reference[name], got)
        for name, got in zip(REQUESTS, run.completions)
    ]
    print(f"\n[e2e] llava, TP=2: {run.seconds:.1f} s, gaps {gaps}")


LORA_TARGETS = (
    r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"
)
"""The decoder's projections only: the tower stays Transformers', outside vLLM's
LoRA (the backend class gives vLLM no multimodal mapping, so it wraps only vLLM's
layers, the decoder's)."""


@pytest.fixture(scope="module")
def llava_lora(
    llava, tmp_path_factory
) -> tuple[Path, list[tiny_multimodal.Completion]]:
    """A PEFT adapter on LLaVA's decoder (B drawn at random: PEFT starts it at zero),
    and Transformers + PEFT's completions of every request with it."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForMultimodalLM

    torch.manual_seed(5)  # PEFT's A matrices
    model = get_peft_model(
        AutoModelForMultimodalLM.from_pretrained(str(llava), dtype=torch.float32),
        LoraConfig(r=8, lora_alpha=16, target_modules=LORA_TARGETS),
    )
    generator = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    path = tmp_path_factory.mktemp("llava-lora") / "adapter"
    model.save_pretrained(path)
    requests = [tiny_multimodal.REQUESTS[name] for name in REQUESTS]
    return path, tiny_multimodal.reference(llava, "llava", requests, lora=path)


def test_llava_adapter_changes_the_output_and_stays_well_separated(
    llava_lora, llava_reference
):
    _, with_adapter = llava_lora
    for name, completion in zip(REQUESTS, with_adapter):
        assert completion.token_ids != llava_reference[name].token_ids
        assert min(completion.margins) >= tiny.MIN_MARGIN


@pytest.mark.engine
def test_llava_with_lora_equals_transformers_with_peft(llava, llava_lora):
    """vLLM's LoRA on the decoder's fused linears (q/k/v and gate/up split by the
    packed-modules mapping), images through the tower as without it."""
    adapter, with_adapter = llava_lora
    run = tiny_multimodal.run_engine(
        llava,
        "llava",
        [tiny_multimodal.REQUESTS[name] for name in REQUESTS],
        backend=tiny.IMPLS[tiny.e2e_impl()]["backend"],
        lora=adapter,
    )
    gaps = [_compare(want, got) for want, got in zip(with_adapter, run.completions)]
    print(f"\n[e2e] llava + LoRA: {run.seconds:.1f} s, gaps {gaps}")


def _data_url(image: tiny_multimodal.Image) -> str:
    buffer = io.BytesIO()
    image.pil().save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


@pytest.mark.engine
@pytest.mark.parametrize("name", ["llava", "qwen2_vl"])
def test_served_image_chat(name, tmp_path_factory):
    """The OpenAI server answers a chat request with an image (a `data:` URL) through
    the official client, with Transformers' tokens: the chat template writes the
    placeholder, the server's processor expands it (Qwen2-VL's built without its
    video processor, in the server's process too)."""
    openai = pytest.importorskip("openai")
    request = tiny_multimodal.REQUESTS["one image"]
    before, after = request.text.split("{image}")
    want = reference(name)["one image"]
    with tiny.serve(
        checkpoint(name),
        backend=tiny.IMPLS[tiny.e2e_impl()]["backend"],
        log_dir=tmp_path_factory.mktemp("server"),
        extra_args=("--max-model-len", str(tiny_multimodal.MAX_MODEL_LEN)),
    ) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused")
        reply = client.chat.completions.create(
            model=server.model,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": before.strip()},
                        {
                            "type": "image_url",
                            "image_url": {"url": _data_url(request.images[0])},
                        },
                        {"type": "text", "text": after.strip()},
                    ],
                }
            ],
            max_tokens=tiny_multimodal.MAX_TOKENS,
            temperature=0.0,
            logprobs=True,
            extra_body={"ignore_eos": True},
        )
    tokens = [step.logprob for step in reply.choices[0].logprobs.content]
    assert reply.choices[0].message.content.strip() == want.text.strip()
    assert reply.usage.prompt_tokens == len(want.prompt_ids)
    gap = max(abs(a - b) for a, b in zip(want.logprobs, tokens))
    assert gap <= tiny.LOGPROB_ATOL


# --- Gemma 3 ---------------------------------------------------------------------


@pytest.mark.engine
def test_gemma3_text_only_engine_equals_transformers():
    """Gemma 3's image tokens attend to each other both ways, which vLLM's CPU
    attention cannot compute, so its images are refused on this engine
    (`test_image_attention.py`); a text-only engine (`limit_mm_per_prompt` image 0)
    serves its text: the Gemma 3 decoder (sliding layers, scaled embeddings) with
    Transformers' tokens and log-probabilities, the tower not built."""
    request = tiny_multimodal.REQUESTS["text only"]
    path = checkpoint("gemma3")
    run = tiny_multimodal.run_engine(
        path,
        "gemma3",
        [request],
        backend=tiny.IMPLS[tiny.e2e_impl()]["backend"],
        llm_kwargs=dict(limit_mm_per_prompt={"image": 0}),
    )
    (want,) = tiny_multimodal.reference(path, "gemma3", [request])
    gap = _compare(want, run.completions[0])
    print(f"\n[e2e] gemma3, text only: {run.seconds:.1f} s, gap {gap:.2e}")


# --- Qwen2-VL: the decoder with M-RoPE -----------------------------------------------


@pytest.mark.engine
def test_qwen2_vl_text_equals_transformers():
    """Qwen2-VL's decoder with multimodal rotary positions (three position rows,
    from `get_mrope_input_positions`) on a text-only engine, its vision tower not
    built: Transformers' tokens and log-probabilities."""
    run = tiny_multimodal.run_engine(
        checkpoint("qwen2_vl"),
        "qwen2_vl",
        [tiny_multimodal.REQUESTS["text only"]],
        backend=tiny.IMPLS[tiny.e2e_impl()]["backend"],
        llm_kwargs=dict(limit_mm_per_prompt={"image": 0}),
    )
    gap = _compare(reference("qwen2_vl")["text only"], run.completions[0])
    print(f"\n[e2e] qwen2_vl, text only: {run.seconds:.1f} s, gap {gap:.2e}")


# --- the processor without its video processor, no engine ---------------------------


def _processing_info(path: Path):
    from vllm.config import ModelConfig
    from vllm.multimodal import MULTIMODAL_REGISTRY

    model_config = ModelConfig(
        model=str(path), model_impl="transformers", dtype="float32"
    )
    return MULTIMODAL_REGISTRY.create_processor(model_config).info


def test_processor_without_its_video_processor(tmp_path):
    """Qwen2-VL's processor loads a video processor, which needs torchvision (not
    installed here): the backend builds the same processor class with its
    tokenizer and image processor only, which expands an image as Transformers
    does. A processor that fails for another reason (an image processor that does
    not exist) still fails, with its own error."""
    import shutil

    from transformers import AutoProcessor

    path = checkpoint("qwen2_vl")
    with pytest.raises(ImportError, match="Torchvision"):
        AutoProcessor.from_pretrained(str(path))
    processor = _processing_info(path).get_hf_processor()
    assert type(processor).__name__ == "Qwen2VLProcessor"
    assert type(processor.image_processor).__name__ == "Qwen2VLImageProcessorPil"
    assert getattr(processor, "video_processor", None) is None
    request = tiny_multimodal.REQUESTS["two images"]
    recipe = tiny_multimodal.RECIPES["qwen2_vl"]
    ids = processor(
        text=request.prompt(recipe), images=[i.pil() for i in request.images]
    )["input_ids"][0]
    assert ids == reference("qwen2_vl")["two images"].prompt_ids

    broken = tmp_path / "broken"
    shutil.copytree(path, broken)
    config = broken / "processor_config.json"
    config.write_text(
        config.read_text().replace("Qwen2VLImageProcessor", "NoSuchImageProcessor")
    )
    with pytest.raises(RuntimeError, match="Failed to load the processor") as error:
        _processing_info(broken).get_hf_processor()
    assert "Unrecognized image processor" in str(error.value.__cause__)


def test_an_image_sent_again_is_expanded_from_the_cache():
    """vLLM's processor cache keeps each image's processed inputs and asks the
    backend for the prompt updates of the images it misses only: a prompt whose
    images were all seen before has none missing, and is expanded as the first
    time (it failed, `Modality 'image' not found`). Also an image cached beside a
    new one."""
    from vllm.config import ModelConfig
    from vllm.multimodal import MULTIMODAL_REGISTRY
    from vllm.multimodal.cache.base import MultiModalProcessorOnlyCache

    model_config = ModelConfig(
        model=str(checkpoint("llava")), model_impl="transformers", dtype="float32"
    )
    processor = MULTIMODAL_REGISTRY.create_processor(model_config)
    cache = MultiModalProcessorOnlyCache(model_config)
    old, new = tiny_multimodal.RED, tiny_multimodal.WIDE

    def expand(prompt: str, images: list[tiny_multimodal.Image]) -> list[int]:
        data = {"image": [i.pil() for i in images]}
        items = processor.data_parser.parse_mm_data(data)
        return processor(prompt, items, cache=cache)["prompt_token_ids"]

    first = expand("the cat <image> near", [old])
    assert expand("the cat <image> near", [old]) == first  # every image cached
    both = expand("<image> one <image> two", [new, old])  # one cached, one not
    image = processor.info.image_token_id()
    assert first.count(image) == 16 and both.count(image) == 32
    assert both == expand("<image> one <image> two", [new, old])


TILED = {"internvl": (3, 3), "idefics3": (5, 5)}
"""Tiles of the two pictures of "two images" (48x32 and 32x48 px): InternVL's two
and a thumbnail; Idefics3's 2x2 of its picture resized to 64 px, and a global
view."""


@pytest.mark.parametrize("counted", [True, False], ids=["counted", "not counted"])
@pytest.mark.parametrize("name", list(TILED))
def test_tiles_of_each_image_are_its_own(name, counted, monkeypatch):
    """InternVL's processor (GOT-OCR2's image processor) returns every image's
    tiles one after another, Idefics3's the same under one leading dimension for
    the prompt; vLLM must get each image's own tiles (InternVL's were taken one
    row per image, and the engine died assigning 8 image embeddings to 24 image
    tokens). Each image's rows are its tiles, as the processor makes them for that
    image alone. Idefics3's pictures of up to 64 px a side are profiled at 64x64
    (the backend found no size to profile with and refused the model). A processor
    that does not count each image's tiles (`_get_num_multimodal_tokens`:
    SmolVLM's, Idefics3's layout, has none) gets them counted by its image
    processor, one image at a time (it was refused)."""
    from vllm.config import ModelConfig
    from vllm.multimodal import MULTIMODAL_REGISTRY

    path = checkpoint(name)
    if not counted:
        cls = tiny_multimodal.processor_class(tiny_multimodal.RECIPES[name])
        (owner,) = [c for c in cls.__mro__ if "_get_num_multimodal_tokens" in vars(c)]
        monkeypatch.delattr(owner, "_get_num_multimodal_tokens")
    model_config = ModelConfig(
        model=str(path), model_impl="transformers", dtype="float32"
    )
    processor = MULTIMODAL_REGISTRY.create_processor(model_config)
    request = tiny_multimodal.REQUESTS["two images"]
    pictures = [i.pil() for i in request.images]
    items = processor.data_parser.parse_mm_data({"image": pictures})
    prompt = request.prompt(tiny_multimodal.RECIPES[name])
    out = processor(prompt, items)
    assert out["prompt_token_ids"] == reference(name)["two images"].prompt_ids
    alone = processor.info.get_hf_processor().image_processor
    images = out["mm_kwargs"]["image"]
    assert len(images) == 2
    for picture, item, tiles in zip(pictures, images, TILED[name]):
        want = torch.as_tensor(alone([picture], return_tensors="pt")["pixel_values"])
        want = want[0] if name == "idefics3" else want  # the prompt's dimension
        assert len(want) == tiles
        assert torch.equal(item["pixel_values"].data, want)
    size = processor.info.image_size_with_most_features()
    side = 32 if name == "internvl" else 64
    assert (size.width, size.height) == (side, side)


@pytest.mark.parametrize("name", list(TILED))
def test_tiles_features_are_joined_per_image(build_backend, name):
    """The vision tower gives one embedding per tile; vLLM wants one per image:
    each image's tiles, in order (4 tokens a tile here), the same as for that
    image alone. Idefics3's tower gets the prompt's dimension back."""
    config = tiny_multimodal.config(tiny_multimodal.RECIPES[name])
    config.architectures = [
        type(config).__name__.replace("Config", "ForConditionalGeneration")
    ]
    model = build_backend(config, backend_class="TransformersMultiModalForCausalLM")
    torch.manual_seed(0)
    with torch.no_grad():  # built without weights: seeded ones for the tower
        for child in model.report.kept:
            for param in model.model.get_submodule(child).parameters():
                param.normal_(0, 0.1)
    pixels = [torch.randn(3, 3, 32, 32), torch.randn(2, 3, 32, 32)]
    tiles = torch.tensor([3, 2])
    kwargs = dict(pixel_values=pixels, num_image_tiles=tiles)
    if name == "idefics3":
        kwargs["pixel_attention_mask"] = [torch.ones(len(p), 32, 32) for p in pixels]
        kwargs["image_tiles_in_prompt"] = torch.ones(2, dtype=torch.bool)
    features = model.embed_multimodal(**kwargs)
    assert [f.shape for f in features] == [(12, 128), (8, 128)]
    alone = {k: v[1:] for k, v in kwargs.items()}
    (last,) = model.embed_multimodal(**alone)
    assert torch.allclose(features[1], last, atol=1e-6)


def test_processor_that_refuses_text_without_an_image_is_refused(tmp_path):
    """PaliGemma's processor refuses a text without an image and rewrites the
    text of one; the backend cannot tell what it writes for an image, and says so
    when vLLM's engine first asks (it failed with the processor's bare "`images`
    are expected")."""
    import transformers as t
    from transformers import AutoConfig

    from vllm.config import DeviceConfig, ModelConfig, VllmConfig
    from vllm.multimodal import MULTIMODAL_REGISTRY
    from vllm.multimodal.encoder_budget import MultiModalBudget

    recipe = tiny_multimodal.Recipe("paligemma", ("<image>",), "<image>")
    tokenizer = tiny_multimodal.make_tokenizer(recipe)
    config = AutoConfig.for_model(
        "paligemma",
        architectures=["PaliGemmaForConditionalGeneration"],
        text_config=dict(
            tiny_multimodal.TEXT,
            model_type="gemma",
            vocab_size=tiny.VOCAB_SIZE + 1,
            head_dim=32,
        ),
        vision_config=dict(
            tiny_multimodal.CLIP_32, model_type="siglip_vision_model"
        ),
        image_token_index=tiny.VOCAB_SIZE,
        projection_dim=128,
        hidden_size=128,
    )
    config.save_pretrained(tmp_path)
    images = t.SiglipImageProcessorPil(size={"height": 32, "width": 32})
    images.image_seq_length = 16
    t.PaliGemmaProcessor(image_processor=images, tokenizer=tokenizer).save_pretrained(
        tmp_path
    )
    model_config = ModelConfig(
        model=str(tmp_path), model_impl="transformers", dtype="float32"
    )
    vllm_config = VllmConfig(
        model_config=model_config, device_config=DeviceConfig("cpu")
    )
    with pytest.raises(ValueError) as error:
        MultiModalBudget(vllm_config, MULTIMODAL_REGISTRY)
    assert str(error.value).startswith(
        "PaliGemmaProcessor does not process a text without an image (`images` "
        "are expected"
    )


# --- prompt ids: the processor's own, no engine ----------------------------------


@pytest.fixture(scope="module")
def gemma3_processing():
    """vLLM's processor for the tiny Gemma 3 (this backend's), Transformers' own, and
    the requests with images. Its tokenizer has Gemma's newline tokens, "\\n" to
    "\\n\\n\\n\\n", matched longest first as Gemma's BPE merges them."""
    from transformers import AutoProcessor

    from vllm.config import ModelConfig
    from vllm.multimodal import MULTIMODAL_REGISTRY

    path = checkpoint("gemma3")
    model_config = ModelConfig(
        model=str(path), model_impl="transformers", dtype="float32"
    )
    recipe = tiny_multimodal.RECIPES["gemma3"]
    with_images = {
        name: request
        for name, request in tiny_multimodal.requests(recipe).items()
        if request.images
    }
    return (
        MULTIMODAL_REGISTRY.create_processor(model_config),
        AutoProcessor.from_pretrained(str(path)),
        with_images,
    )


def _vllm_prompt(processor, prompt: str | list[int], request) -> dict:
    items = processor.data_parser.parse_mm_data(
        {"image": [i.pil() for i in request.images]}
    )
    return processor(prompt, items)


def test_prompt_ids_equal_the_processors_where_its_text_merges(gemma3_processing):
    """Gemma 3's processor writes "\\n\\n" around each image, and Gemma's tokenizer
    merges it with a newline of the prompt beside the image ("\\n\\n\\n" before,
    "\\n\\n\\n\\n" after): the prompt vLLM's engine gets is the processor's own for
    the whole prompt (it was the prompt's "\\n" and the image's "\\n\\n" apart, a
    token longer on each side, and the greedy tokens of a tiny Gemma 3 diverged at
    the third step). Each image's embeddings go to its 4 soft tokens. Near miss: no
    newline beside an image (the other requests), nothing merges."""
    processor, hf_processor, with_images = gemma3_processing
    recipe = tiny_multimodal.RECIPES["gemma3"]
    soft = tiny_multimodal.token_id(recipe, "<image_soft_token>")
    prompts = {}
    for name, request in with_images.items():
        text = request.prompt(recipe)
        want = hf_processor(text=text, images=[i.pil() for i in request.images])
        out = _vllm_prompt(processor, text, request)
        ids = prompts[name] = out["prompt_token_ids"]
        assert ids == want["input_ids"][0], name
        for image in out["mm_placeholders"]["image"]:
            span = ids[image.offset : image.offset + image.length]
            embedded = [t for t, e in zip(span, image.is_embed.tolist()) if e]
            assert embedded == [soft] * 4, name
    tokens = hf_processor.tokenizer.convert_ids_to_tokens(prompts["newlines"])
    assert [t for t in tokens if t.startswith("\n")] == ["\n\n\n", "\n\n\n\n"]


def test_prompt_ids_given_apart_stay_apart(gemma3_processing):
    """Near miss: a prompt given as token ids that are not the tokenizer's own for
    their text (two "\\n" tokens where it writes one "\\n\\n") is not the text the
    processor would see; its ids are kept as given, each image's expansion put in
    place of its placeholder."""
    processor, hf_processor, with_images = gemma3_processing
    request = with_images["newlines"]
    tokenizer = hf_processor.tokenizer
    text = request.prompt(tiny_multimodal.RECIPES["gemma3"])
    newline = tokenizer.convert_tokens_to_ids("\n")
    apart = []
    for token in tokenizer.encode(text):
        apart += [newline] * tokenizer.decode([token]).count("\n") or [token]
    out = _vllm_prompt(processor, apart, request)
    (image,) = out["mm_placeholders"]["image"]
    ids = out["prompt_token_ids"]
    expansion = ids[image.offset : image.offset + image.length]
    assert ids[: image.offset] + ids[image.offset + image.length :] == [
        t for t in apart if t != tokenizer.convert_tokens_to_ids("<start_of_image>")
    ]
    assert tokenizer.convert_ids_to_tokens(expansion)[0] == "\n\n"


# --- M-RoPE, no engine -------------------------------------------------------------


def test_mrope_positions_equal_the_hf_model(build_backend):
    """Qwen2-VL: the positions vLLM gets for a prompt with two images of different
    sizes (from the placeholders it found) equal those the HF model computes, and
    are not 1-D ones (text after an image moves on by the image's side, not its
    token count). No engine (`test_equals_transformers` runs them on one)."""
    from vllm.multimodal.inputs import PlaceholderRange

    recipe = tiny_multimodal.RECIPES["qwen2_vl"]
    config = tiny_multimodal.config(recipe)
    config.architectures = ["Qwen2VLForConditionalGeneration"]
    model = build_backend(config, backend_class="TransformersMultiModalForCausalLM")
    image = config.image_token_id
    start, end = config.vision_start_token_id, config.vision_end_token_id
    grids = torch.tensor([[1, 4, 6], [1, 6, 4]])  # 32x48 and 48x32 px, 8 px patches
    counts = [int(g.prod()) // 4 for g in grids]  # merged 2x2
    ids = [tiny.BOS_ID, 7, start, *[image] * counts[0], end, 8, 9, start]
    ids += [*[image] * counts[1], end, 10]
    offsets = [3, 3 + counts[0] + 4]
    features = [
        SimpleNamespace(
            modality="image",
            mm_position=PlaceholderRange(offset=o, length=n),
            data={"image_grid_thw": SimpleNamespace(data=g)},
        )
        for o, n, g in zip(offsets, counts, grids)
    ]
    positions, delta = model.get_mrope_input_positions(ids, features)

    input_ids = torch.tensor([ids])
    want, want_delta = model.model.get_rope_index(
        input_ids, mm_token_type_ids=(input_ids == image).int(), image_grid_thw=grids
    )
    assert torch.equal(positions, want[:, 0])
    assert delta == int(want_delta) < 0
    # After the first image (4 x 6 patches, merged to 2 x 3): text moves on by 3.
    first_after = offsets[0] + counts[0]
    assert positions[0, first_after].item() == positions[0, offsets[0]].item() + 3


def test_mrope_positions_from_a_get_rope_index_without_token_types(
    build_backend, monkeypatch
):
    """Qwen2.5-Omni's and Qwen3-Omni's `get_rope_index` have no `mm_token_type_ids`
    (they find the image tokens in the ids): it is called with the arguments its
    signature takes, and gives the positions of one that takes them."""
    from vllm.multimodal.inputs import PlaceholderRange

    config = tiny_multimodal.config(tiny_multimodal.RECIPES["qwen2_vl"])
    config.architectures = ["Qwen2VLForConditionalGeneration"]
    model = build_backend(config, backend_class="TransformersMultiModalForCausalLM")
    image, grid = config.image_token_id, torch.tensor([1, 4, 6])
    count = int(grid.prod()) // 4
    ids = [tiny.BOS_ID, 7, config.vision_start_token_id, *[image] * count, 8]
    features = [
        SimpleNamespace(
            modality="image",
            mm_position=PlaceholderRange(offset=3, length=count),
            data={"image_grid_thw": SimpleNamespace(data=grid)},
        )
    ]
    with_token_types = model.get_mrope_input_positions(ids, features)
    takes_token_types = model.model.get_rope_index

    def get_rope_index(
        input_ids, image_grid_thw=None, video_grid_thw=None, attention_mask=None
    ):
        token_types = (input_ids == image).int()
        return takes_token_types(input_ids, token_types, image_grid_thw)

    monkeypatch.setattr(model.model, "get_rope_index", get_rope_index)
    positions, delta = model.get_mrope_input_positions(ids, features)
    assert torch.equal(positions, with_token_types[0])
    assert delta == with_token_types[1] < 0


# --- construction, no engine -------------------------------------------------------


def test_moe_decoder_behind_a_vision_tower(build_backend):
    """`TransformersMultiModalMoEForCausalLM`: a LLaVA whose decoder is a Mixtral
    gets its experts on vLLM's fused MoE and its attention on vLLM, while the CLIP
    tower and projector stay plain Transformers modules (no vLLM layer inside)."""
    from transformers import AutoConfig

    from vllm.model_executor.layers.linear import LinearBase

    config = AutoConfig.for_model(
        "llava",
        architectures=["LlavaForConditionalGeneration"],
        text_config=dict(
            tiny_multimodal.TEXT,
            model_type="mixtral",
            vocab_size=tiny.VOCAB_SIZE + 1,
            num_hidden_layers=2,
            num_local_experts=4,
        ),
        vision_config=dict(
            model_type="clip_vision_model",
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,  # as many as the decoder: not taken for its stack
            num_attention_heads=2,
            image_size=32,
            patch_size=8,
        ),
        image_token_id=tiny.VOCAB_SIZE,
    )
    model = build_backend(config, backend_class="TransformersMultiModalMoEForCausalLM")
    report = model.report
    assert report.servable and len(report.attention) == 2
    assert [d.split(":")[0] for d in report.details["moe"]] == [
        f"model.language_model.layers.{i}.mlp.{part}"
        for i in range(2)
        for part in ("gate (MixtralTopKRouter)", "experts (MixtralExperts)")
    ]
    experts = [d for d in report.details["moe"] if ".experts " in d]
    assert all("vLLM fused MoE" in d for d in experts)
    routers = [d for d in report.details["moe"] if ".gate " in d]
    assert all("vLLM's router" in d for d in routers)
    assert set(report.kept) == {"vision_tower", "multi_modal_projector"}
    for name in report.kept:
        tower = model.model.get_submodule(name)
        assert not any(isinstance(m, LinearBase) for m in tower.modules()), name


def test_llava_next_forward_filled_from_its_config_is_read(build_backend):
    """LLaVA-NeXT's `forward` is wrapped by Transformers' `merge_with_config_defaults`,
    which fills `vision_feature_layer` from the config unless it is passed by name
    (it cannot see it among positional arguments through the wrapper under it):
    the backend reads the logits from that forward and builds the model (it
    refused it, `got multiple values for argument 'vision_feature_layer'`)."""
    config = tiny_multimodal.config(tiny_multimodal.RECIPES["llava_next"])
    config.architectures = ["LlavaNextForConditionalGeneration"]
    model = build_backend(config, backend_class="TransformersMultiModalForCausalLM")
    assert model.report.servable and len(model.report.attention) == 4
    assert set(model.report.kept) == {"vision_tower", "multi_modal_projector"}


@pytest.mark.parametrize("name", ["qwen3_vl", "qwen2_vl"])
def test_image_features_beyond_the_embeddings_are_refused(build_backend, name):
    """Qwen3-VL's `get_image_features` also returns `deepstack_features`, which its
    decoder adds to the image tokens' hidden states in its first layers; the
    backend hands the decoder the embeddings only, so it refuses the image (it
    answered without them: other greedy tokens, log-probs off by 1.1). Qwen2-VL's
    tower returns the embeddings only and is served."""
    recipe = tiny_multimodal.RECIPES[name]
    config = tiny_multimodal.config(recipe)
    architecture = type(config).__name__.replace("Config", "ForConditionalGeneration")
    config.architectures = [architecture]
    model = build_backend(config, backend_class="TransformersMultiModalForCausalLM")
    patch = tiny_multimodal.QWEN_VL_PATCHES
    grid = torch.tensor([[1, 4, 4]])  # a 32x32 picture: 4x4 patches of 8 px
    width = 3 * patch["temporal_patch_size"] * patch["patch_size"] ** 2
    pixels = torch.randn(int(grid.prod()), width)
    if name == "qwen3_vl":
        with pytest.raises(NotImplementedError, match="returns `deepstack_features`"):
            model.embed_multimodal(pixel_values=pixels, image_grid_thw=grid)
    else:
        (features,) = model.embed_multimodal(pixel_values=pixels, image_grid_thw=grid)
        assert features.shape == (4, config.text_config.hidden_size)


# --- an audio model: text only, its audio refused clearly ----------------------------


@pytest.mark.engine
def test_audio_model_serves_text_only():
    """VibeVoiceAsr (audio in, text out) with `language_model_only=True`: its audio
    encoders and projector are not built, and a text prompt equals Transformers'.
    Its base model takes positions only in `**kwargs`, which vLLM's compiler cannot
    mark dynamic: with compilation on it runs eager, saying so. (vLLM's stock
    backend cannot load this checkpoint: docs/multimodal.md.)"""
    run = tiny_multimodal.run_engine(
        checkpoint("vibevoice_asr"),
        "vibevoice_asr",
        [tiny_multimodal.AUDIO_REQUESTS["text only"]],
        backend=tiny.IMPLS[tiny.e2e_impl()]["backend"],
        llm_kwargs=dict(language_model_only=True, enforce_eager=False),
    )
    gap = _compare(reference("vibevoice_asr")["text only"], run.completions[0])
    print(f"\n[e2e] vibevoice_asr, text only: {run.seconds:.1f} s, gap {gap:.2e}")
    if tiny.e2e_impl() == "project":
        assert (
            "not built: acoustic_tokenizer_encoder, semantic_tokenizer_encoder, "
            "multi_modal_projector" in run.report
        )
        assert "VibeVoiceAsrModel.forward takes `position_ids` only in" in run.log
        assert "EncoderModel: encodes audio as Transformers does" in run.log


def test_audio_model_is_refused_before_profiling():
    """VibeVoiceAsr (audio in, text out), which vLLM 0.32 sends to this backend by
    default, on a tiny checkpoint with its real processor: this backend serves image
    inputs only. The first thing vLLM's engine builds for a multimodal model, its
    encoder budget, refuses it (on the supported modalities, before any profiling)
    naming what the processor takes and what it lacks, and what serves its text
    (a text-only engine), not with an AttributeError from profiling an image tower
    the model does not have. vLLM's stock backend fails on its audio on the CPU
    engine too (docs/multimodal.md)."""
    from vllm.config import DeviceConfig, ModelConfig, VllmConfig
    from vllm.multimodal import MULTIMODAL_REGISTRY
    from vllm.multimodal.encoder_budget import MultiModalBudget

    model_config = ModelConfig(
        model=str(checkpoint("vibevoice_asr")),
        model_impl="transformers",
        dtype="float32",
    )
    vllm_config = VllmConfig(
        model_config=model_config, device_config=DeviceConfig("cpu")
    )
    with pytest.raises(ValueError) as error:
        MultiModalBudget(vllm_config, MULTIMODAL_REGISTRY)
    message = str(error.value)
    assert message.startswith(
        "VibeVoiceAsrProcessor (inputs: audio) has no image processor and no "
        "`image_token`: this backend serves image inputs only"
    )
    assert "`language_model_only=True`" in message
    assert "VLLM_TRANSFORMERS_BACKEND=stock" in message
