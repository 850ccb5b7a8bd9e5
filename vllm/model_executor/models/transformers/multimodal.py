# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Vision-language models: the text decoder made vLLM-native as a causal LM's is,
the vision tower and projector left to Transformers.

Three stages, each on the model's own Transformers code:

1. *Processing* (`MultiModalProcessor`, in vLLM's API server): the model's own
   Transformers processor turns each image into the tower's inputs (`pixel_values`,
   `image_grid_thw`...). The prompt keeps the placeholder the processor expands
   (`processor.image_token`: `<image>`, `<|image_pad|>`, Gemma 3's
   `<start_of_image>`); vLLM replaces each with what the processor writes for an
   image of that size, which is asked of the processor itself, once per size. Only
   the model's image token there receives an embedding (Gemma 3's begin/end tokens
   stay text). A processor that cannot be built whole here (Qwen2-VL's video
   processor needs torchvision) is built with its tokenizer and image processor
   only (`images_only`).
2. *Encoding* (`embed_multimodal`): the HF model's own `get_image_features` (tower
   and projector) on the engine's pixel inputs, one embedding row per image token.
3. *Decoding*: the image embeddings are scattered over the image tokens' text
   embeddings and the HF text model runs on vLLM attention with the fusers applied;
   models with multimodal rotary positions (M-RoPE) get them from the HF model's
   own `get_rope_index`.

Every child of the HF base model other than its text model (the tower, the
projector) is kept with Transformers: not fused, attention not dispatched to vLLM
(its config is not the text config the backend patches), replicated on every rank.
With `limit_mm_per_prompt={"image": 0}` they are dropped while still on `meta`
(never allocated, their checkpoint tensors skipped).
"""

import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from PIL import Image
from transformers import BatchFeature, PreTrainedModel, ProcessorMixin
from transformers.image_utils import get_image_size, to_numpy_array
from transformers.models.auto.processing_auto import (
    PROCESSOR_MAPPING,
    processor_class_from_name,
)

from vllm.config.multimodal import MultiModalDummyOptions
from vllm.logger import init_logger
from vllm.model_executor.models.interfaces import SupportsMRoPE, SupportsMultiModal
from vllm.model_executor.models.transformers.base import Base
from vllm.model_executor.models.transformers.image_attention import (
    check_image_attention,
)
from vllm.model_executor.models.transformers.loading import BASE
from vllm.model_executor.models.utils import (
    StageMissingLayer,
    _merge_multimodal_embeddings,
)
from vllm.multimodal import MULTIMODAL_REGISTRY, processing
from vllm.inputs import MultiModalDataDict
from vllm.multimodal.inputs import (
    MultiModalFeatureSpec,
    MultiModalFieldConfig,
    MultiModalKwargsItems,
)
from vllm.multimodal.parse import ImageProcessorItems, ImageSize, MultiModalDataItems
from vllm.multimodal.processing.processor import (
    MultiModalPromptUpdates,
    PlaceholderFeaturesInfo,
)
from vllm.transformers_utils.processor import get_processor_cls_name_from_config

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(__name__)

IMAGE = "image"

PROBE_WORD = "a"
"""A text the processor is given alone, to see what it adds around any text."""

TEXT_FIELDS = frozenset(
    {"input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids"}
)
"""What a processor returns about the text, which vLLM tokenizes itself."""


TILES = "num_image_tiles"
"""The backend's own processor output: how many rows of `pixel_values` (tiles)
each image has, where a processor returns every image's tiles one after another."""

TILES_IN_PROMPT = "image_tiles_in_prompt"
"""The backend's own processor output, per image: the model takes its tiles under
a leading dimension for the prompt, which the backend removed (Idefics3)."""

IMAGE_SUB_PROCESSORS = ("tokenizer", "image_processor")
"""The sub-processors an image request needs."""

MODALITY_INPUTS = {"image": "images", "video": "videos", "audio": "audio"}
"""vLLM's modality names, as the inputs they name are written in messages."""

SUB_PROCESSOR_INPUTS = {
    "image_processor": "images",
    "video_processor": "videos",
    "feature_extractor": "audio",
    "audio_processor": "audio",
}
"""What each sub-processor of a Transformers processor takes (named in a refusal)."""

_IMAGES_ONLY: dict[tuple[str, str | None], type[ProcessorMixin]] = {}
"""Checkpoints (path, revision) whose whole processor cannot be built here, with
the processor class built for them instead (`images_only`)."""


@functools.cache
def images_only(cls: type[ProcessorMixin]) -> type[ProcessorMixin]:
    """`cls` that takes and loads only a tokenizer and an image processor.

    A processor's other sub-processors (video, audio) may need libraries an image
    request never uses: Qwen2-VL's processor always loads a video processor, and
    Transformers' video processors need torchvision. Transformers reads a
    processor's sub-processors from `get_attributes()` (what `__init__` takes, what
    `from_pretrained` loads), so narrowing it leaves the rest of the class as it is:
    the same image processor, tokenizer and text expansion."""
    attributes = [a for a in cls.get_attributes() if a in IMAGE_SUB_PROCESSORS]
    # Same name and module: vLLM finds the processor's kwargs types by its module.
    return type(
        cls.__name__,
        (cls,),
        {
            "__module__": cls.__module__,
            "__doc__": f"{cls.__name__} with its image sub-processors only.",
            "get_attributes": classmethod(lambda _: list(attributes)),
        },
    )


class MultiModalProcessingInfo(processing.BaseProcessingInfo):
    """What vLLM asks about the model's inputs, answered by its Transformers
    processor."""

    def get_hf_processor(self, **kwargs: object) -> ProcessorMixin:
        """The model's Transformers processor; where it cannot be built whole
        here (a video processor without torchvision), the same class with only
        its tokenizer and image processor, which is all an image request uses."""
        model_config = self.ctx.model_config
        key = (model_config.model, model_config.revision)
        if key in _IMAGES_ONLY:
            return self.ctx.get_hf_processor(_IMAGES_ONLY[key], **kwargs)
        try:
            return self.ctx.get_hf_processor(**kwargs)
        except Exception as error:
            cls = self._processor_class()
            narrowed = None if cls is None else images_only(cls)
            if narrowed is None or narrowed.get_attributes() == cls.get_attributes():
                raise
            try:
                processor = self.ctx.get_hf_processor(narrowed, **kwargs)
            except Exception:
                raise error  # the whole processor's error says what is wrong
            _IMAGES_ONLY[key] = narrowed
            logger.warning(
                "%s cannot be built whole here (%s: %s); images are processed with "
                "its tokenizer and image processor only.",
                cls.__name__,
                type(error).__name__,
                " ".join(str(error).split()),
            )
            return processor

    def _processor_class(self) -> type[ProcessorMixin] | None:
        """The processor class Transformers' `AutoProcessor` builds: the one the
        checkpoint's processor files name, else the model type's."""
        model_config = self.ctx.model_config
        name = get_processor_cls_name_from_config(
            model_config.model, revision=model_config.revision
        )
        config_type = type(self.get_hf_config())
        if name is not None:
            cls = processor_class_from_name(name)
        elif config_type in PROCESSOR_MAPPING:
            cls = PROCESSOR_MAPPING[config_type]
        else:
            return None
        # A class whose library is missing comes as a placeholder, not a processor.
        if isinstance(cls, type) and issubclass(cls, ProcessorMixin):
            return cls
        return None

    def get_supported_mm_limits(self) -> Mapping[str, int | None]:
        return {IMAGE: None}

    def placeholder(self) -> str:
        """The token a prompt holds for an image, which the processor expands.
        A processor without an image processor and an `image_token` (an audio
        model's) is refused: this backend serves image inputs only."""
        processor = self.get_hf_processor()
        token = getattr(processor, "image_token", None)
        has_images = getattr(processor, "image_processor", None) is not None
        if isinstance(token, str) and has_images:
            return token
        inputs = sorted(
            {
                SUB_PROCESSOR_INPUTS[name]
                for name in processor.get_attributes()
                if name in SUB_PROCESSOR_INPUTS
            }
        )
        missing = [
            what
            for what, present in (
                ("image processor", has_images),
                ("`image_token`", isinstance(token, str)),
            )
            if not present
        ]
        raise ValueError(
            f"{type(processor).__name__} (inputs: {', '.join(inputs) or 'text'}) has "
            f"no {' and no '.join(missing)}: this backend serves image inputs only, "
            "not audio or video yet. A text-only engine (`language_model_only=True`, "
            "`--language-model-only`) serves the model's text prompts. vLLM's stock "
            "Transformers backend (VLLM_TRANSFORMERS_BACKEND=stock) takes audio and "
            "video too, though not for every such model (docs/multimodal.md, "
            "'Audio inputs')."
        )

    def image_token_id(self) -> int:
        """The token that receives an image embedding: the model config's, else the
        processor's (Emu3 keeps it in its vocabulary map). The config's comes first:
        Gemma 3's processor names its begin-of-image token so."""
        config = self.get_hf_config()
        processor = self.get_hf_processor()
        for owner in (config, processor):
            token_id = getattr(owner, "image_token_id", None)
            if isinstance(token_id, int):
                return token_id
        raise ValueError(
            f"Neither {type(config).__name__} nor {type(processor).__name__} has an "
            "`image_token_id`: the backend cannot tell which tokens receive image "
            "embeddings."
        )

    @functools.lru_cache(maxsize=64)  # noqa: B019 - one info per processor
    def expansion(self, width: int, height: int) -> tuple[int, ...]:
        """The tokens the processor writes in place of one placeholder for an image
        of this size (what it would insert into the prompt's text), without what it
        adds around any text (Emu3's processor writes its `<s>` first)."""
        processor = self.get_hf_processor()
        ids = processor(
            text=self.placeholder(),
            images=[Image.new("RGB", (width, height))],
            add_special_tokens=False,
        )["input_ids"][0]
        prefix, suffix = self._added_around_text()
        ids = ids[len(prefix) : len(ids) - len(suffix)]
        if self.image_token_id() not in ids:
            raise ValueError(
                f"{type(processor).__name__} writes no image token "
                f"({self.image_token_id()}) for an image of {width}x{height}: {ids}"
            )
        return tuple(ids)

    def _added_around_text(self) -> tuple[list[int], list[int]]:
        """What the processor adds before and after a text without images."""
        processor = self.get_hf_processor()
        word = self.get_tokenizer().encode(PROBE_WORD, add_special_tokens=False)
        try:
            outputs = processor(text=PROBE_WORD, add_special_tokens=False)
        except ValueError as error:
            # PaliGemma's processor refuses a text without an image, and rewrites
            # the text of one (a `<s>` after the images, a newline after the
            # text), which vLLM's own tokenization of the prompt would not do.
            raise ValueError(
                f"{type(processor).__name__} does not process a text without an "
                f"image ({error}), so the backend cannot tell what it writes "
                "around a prompt's text and what for an image: this backend "
                "expands each image placeholder in the prompt as the processor "
                "does and tokenizes the rest itself, and serves only models whose "
                "processor does no more."
            ) from error
        ids = list(outputs["input_ids"][0])
        start = next(
            (i for i in range(len(ids)) if ids[i : i + len(word)] == word), None
        )
        if start is None:
            raise ValueError(
                f"{type(processor).__name__} does not keep the text it is given "
                f"({PROBE_WORD!r} became {ids}), so the backend cannot tell what it "
                "writes for an image."
            )
        return ids[:start], ids[start + len(word) :]

    @functools.lru_cache(maxsize=1)  # noqa: B019 - one info per processor
    def tiles_under_prompt(self) -> bool:
        """Whether the image processor puts all of a prompt's images (their tiles)
        under one leading dimension for the prompt, as Idefics3's does: asked with
        two pictures, which it then returns under a dimension of one."""
        images = self.get_hf_processor().image_processor
        size = self.image_size_with_most_features()
        pictures = [Image.new("RGB", (size.width, size.height))] * 2
        pixel_values = images(pictures, return_tensors="pt")["pixel_values"]
        return torch.as_tensor(pixel_values).ndim >= 5 and len(pixel_values) == 1

    def image_size_with_most_features(self) -> ImageSize:
        """The largest image the processor keeps as it is: its fixed size (a crop
        or a resize), or the square filling its pixel budget (dynamic resolution)."""
        images = self.get_hf_processor().image_processor
        sizes = [
            getattr(images, "crop_size", None) or {},
            getattr(images, "size", None) or {},
        ]
        for size in sizes:
            if "height" in size and "width" in size:
                return ImageSize(width=size["width"], height=size["height"])
        for size in sizes:
            # A pixel budget: Qwen2-VL's (edges in pixels), Emu3's.
            budget = size.get("max_pixels") or (
                size.get("longest_edge") if "shortest_edge" in size else None
            )
            if budget is not None:
                side = int(budget**0.5)
                return ImageSize(width=side, height=side)
            if "shortest_edge" in size:
                return ImageSize(
                    width=size["shortest_edge"], height=size["shortest_edge"]
                )
            if "longest_edge" in size:
                # Pictures up to this side (Idefics3's, split into tiles): the
                # square of that side has the most pixels, so the most tiles.
                side = size["longest_edge"]
                return ImageSize(width=side, height=side)
        side = getattr(images, "max_image_size", None)
        if isinstance(side, int):
            # Every picture resized into a square of this side (Aria's).
            return ImageSize(width=side, height=side)
        raise ValueError(
            f"{type(images).__name__}: no size to profile the vision tower with "
            f"(size={getattr(images, 'size', None)})."
        )

    def get_mm_max_tokens_per_item(
        self, seq_len: int, mm_counts: Mapping[str, int]
    ) -> Mapping[str, int]:
        # The first question of vLLM's engine that needs the processor: one that
        # takes no images is refused here, with the reason.
        self.placeholder()
        size = self.image_size_with_most_features()
        return {IMAGE: len(self.expansion(size.width, size.height))}


class MultiModalDummyInputsBuilder(
    processing.BaseDummyInputsBuilder[MultiModalProcessingInfo]
):
    """Profiling inputs: as many placeholders as images, each image of the size that
    gives the most image tokens."""

    def get_dummy_text(self, mm_counts: Mapping[str, int]) -> str:
        return " ".join([self.info.placeholder()] * mm_counts.get(IMAGE, 0))

    def get_dummy_mm_data(
        self,
        seq_len: int,
        mm_counts: Mapping[str, int],
        mm_options: MultiModalDummyOptions,
    ) -> MultiModalDataDict:
        size = self.info.image_size_with_most_features()
        return {
            IMAGE: self._get_dummy_images(
                width=size.width,
                height=size.height,
                num_images=mm_counts.get(IMAGE, 0),
                overrides=mm_options.get(IMAGE),
            )
        }


class MultiModalProcessor(
    processing.BaseMultiModalProcessor[MultiModalProcessingInfo]
):
    """The model's Transformers processor on the images; vLLM's own tokenization of
    the prompt, whose placeholders become what the processor writes for them."""

    def _get_hf_mm_text(self, mm_counts: Mapping[str, int]) -> str:
        # Processors count the placeholders of the text against the images.
        return " ".join([self.info.placeholder()] * mm_counts.get(IMAGE, 0))

    def _call_hf_processor(
        self, hf_data: Mapping[str, object], hf_kwargs: Mapping[str, object]
    ) -> BatchFeature:
        """The processor's outputs; where it returns the pictures' tiles one after
        another (`pixel_values` [tiles of every image, ...]: GOT-OCR2's image
        processor, for InternVL and Aya Vision), also how many tiles each image
        has (`TILES`), which the processor says only when asked (Transformers'
        `_get_num_multimodal_tokens`)."""
        outputs = super()._call_hf_processor(hf_data, hf_kwargs)
        images = hf_data.get("images") or []
        if isinstance(images, Image.Image):
            images = [images]
        pixel_values = outputs.get("pixel_values")
        if (
            not images
            or not isinstance(pixel_values, torch.Tensor)
            or any(k.endswith("_grid_thw") for k in outputs)
        ):
            return outputs
        processor = self.info.get_hf_processor(**hf_kwargs)
        in_prompt = (
            pixel_values.ndim >= 5
            and len(pixel_values) == 1
            and self.info.tiles_under_prompt()
        )
        if not in_prompt and len(pixel_values) == len(images):
            return outputs
        sizes = [_height_width(image) for image in images]
        counts = None
        if hasattr(processor, "_get_num_multimodal_tokens"):
            counts = getattr(
                processor._get_num_multimodal_tokens(image_sizes=sizes),
                "num_image_patches",
                None,
            )
        if counts is None:
            # A processor that does not say (SmolVLM's): each image's rows
            # when its image processor is given that image alone.
            counts = [_rows_alone(processor, i, in_prompt) for i in images]
        if in_prompt and pixel_values.shape[1] == sum(counts):
            # The prompt's tiles, all images', under one leading dimension for
            # the prompt (Idefics3's [prompts, tiles, channels, height, width]):
            # without it, each image's tiles are rows as above, and the model
            # gets the dimension back (`TILES_IN_PROMPT`).
            for key, value in list(outputs.items()):
                if isinstance(value, torch.Tensor) and value.shape[:2] == (
                    1,
                    sum(counts),
                ):
                    outputs[key] = value[0]
            outputs[TILES_IN_PROMPT] = torch.ones(len(images), dtype=torch.bool)
            pixel_values = outputs["pixel_values"]
        elif len(pixel_values) == len(images):
            return outputs
        if sum(counts) != len(pixel_values):
            raise ValueError(
                f"{type(processor).__name__} returns {len(pixel_values)} rows of "
                f"`pixel_values` ({tuple(outputs['pixel_values'].shape)}) for "
                f"{len(images)} images, not as many as their tiles ({counts}): the "
                "backend cannot tell which tiles are which image's."
            )
        outputs[TILES] = torch.tensor(counts)
        return outputs

    def _get_mm_fields_config(
        self,
        hf_inputs: BatchFeature,
        hf_processor_mm_kwargs: Mapping[str, object],
    ) -> Mapping[str, MultiModalFieldConfig]:
        """One entry per image (`pixel_values` [images, ...]), except where the
        processor returns a grid per image (`image_grid_thw`, dynamic resolution)
        or tiles per image (`TILES`): then a field with one row per patch or tile
        is split by each image's count."""
        fields = [k for k in hf_inputs if k not in TEXT_FIELDS]
        grids = [k for k in fields if k.endswith("_grid_thw")]
        if grids:
            (grid,) = grids
            rows = torch.as_tensor(hf_inputs[grid]).prod(-1)
        elif TILES in hf_inputs:
            grid, rows = TILES, torch.as_tensor(hf_inputs[TILES])
        else:
            return {k: MultiModalFieldConfig.batched(IMAGE) for k in fields}
        total = int(rows.sum())
        config = {}
        for key in fields:
            value = hf_inputs[key]
            if key != grid and isinstance(value, torch.Tensor) and len(value) == total:
                config[key] = MultiModalFieldConfig.flat_from_sizes(IMAGE, rows)
            else:
                config[key] = MultiModalFieldConfig.batched(IMAGE)
        return config

    def _get_prompt_updates(
        self,
        mm_items: MultiModalDataItems,
        hf_processor_mm_kwargs: Mapping[str, object],
        out_mm_kwargs: MultiModalKwargsItems,
    ) -> Sequence[processing.PromptUpdate]:
        placeholder = self.info.placeholder()
        target = self.info.get_tokenizer().convert_tokens_to_ids(placeholder)
        image_token_id = self.info.image_token_id()

        def replacement(item: int) -> processing.PromptUpdateDetails:
            # Asked only for items of `mm_items`, which may hold none: vLLM asks
            # for the updates of the images its cache misses, and a prompt whose
            # images are all cached (an image sent again) has none missing.
            size = mm_items.get_items(IMAGE, ImageProcessorItems).get_image_size(item)
            tokens = list(self.info.expansion(size.width, size.height))
            return processing.PromptUpdateDetails.select_token_id(
                tokens, image_token_id
            )

        return [processing.PromptReplacement(IMAGE, [target], replacement)]

    def _apply_prompt_updates(
        self,
        token_ids: list[int],
        mm_prompt_updates: MultiModalPromptUpdates,
    ) -> tuple[list[int], Mapping[str, list[PlaceholderFeaturesInfo]]]:
        """Each placeholder replaced by what the processor writes for its image,
        then the prompt tokenized as one text, as the processor tokenizes it: the
        text it writes around an image (Gemma 3's "\\n\\n") merges with the
        prompt's beside it where the tokenizer has a token for both ("\\n\\n\\n").
        Each image's placeholder is then its tokens from the first special token to
        the last, which a tokenizer splits out of any text first. Prompt ids that
        are not the tokenizer's own for their text (given as ids) are kept."""
        new_ids, placeholders = super()._apply_prompt_updates(
            token_ids, mm_prompt_updates
        )
        tokenizer = self.info.get_tokenizer()

        def as_text(ids: list[int]) -> list[int]:
            text = tokenizer.decode(ids, skip_special_tokens=False)
            return tokenizer.encode(text, add_special_tokens=False)

        if as_text(token_ids) != token_ids:
            return new_ids, placeholders
        merged = as_text(new_ids)
        if merged == new_ids:
            return new_ids, placeholders
        special = set(tokenizer.all_special_ids) | {self.info.image_token_id()}
        found: dict[str, list[PlaceholderFeaturesInfo]] = {}
        start = 0
        for placeholder in sorted(
            (p for ps in placeholders.values() for p in ps), key=lambda p: p.start_idx
        ):
            kept = [i for i, t in enumerate(placeholder.tokens) if t in special]
            first, last = kept[0], kept[-1] + 1
            tokens = placeholder.tokens[first:last]
            start = _find(merged, tokens, start)
            is_embed = placeholder.is_embed
            found.setdefault(placeholder.modality, []).append(
                PlaceholderFeaturesInfo(
                    modality=placeholder.modality,
                    item_idx=placeholder.item_idx,
                    start_idx=start,
                    tokens=tokens,
                    is_embed=None if is_embed is None else is_embed[first:last],
                )
            )
            start += len(tokens)
        return merged, found


def _find(ids: list[int], tokens: list[int], start: int) -> int:
    """Where `tokens` first stand in `ids` from `start` on."""
    for i in range(start, len(ids) - len(tokens) + 1):
        if ids[i : i + len(tokens)] == tokens:
            return i
    raise ValueError(
        f"The tokens of an image ({tokens}) are not in the prompt tokenized as one "
        f"text ({ids})."
    )


def _rows_alone(processor: ProcessorMixin, image: object, in_prompt: bool) -> int:
    """How many rows of `pixel_values` the processor's image processor gives
    `image` alone: its tiles (under a leading dimension for the prompt where
    `in_prompt`)."""
    alone = processor.image_processor([image], return_tensors="pt")["pixel_values"]
    alone = torch.as_tensor(alone)
    return int(alone.shape[1] if in_prompt else len(alone))


def _height_width(image: object) -> tuple[int, int]:
    """An image's (height, width), as Transformers' processors take sizes."""
    if isinstance(image, Image.Image):
        return image.height, image.width
    return tuple(get_image_size(to_numpy_array(image)))


def _image_features(model: PreTrainedModel, **inputs: Any) -> list[torch.Tensor]:
    """The HF model's `get_image_features` on processor outputs: one `[tokens,
    hidden]` tensor per image, in order."""
    get_image_features = getattr(model, "get_image_features", None)
    if get_image_features is None:
        raise ValueError(
            f"{type(model).__name__} has no `get_image_features`, which the backend "
            "runs the vision tower (and projector) through."
        )
    accepted = inspect.signature(get_image_features).parameters
    kwargs = {k: v for k, v in inputs.items() if k in accepted and v is not None}
    output = get_image_features(**kwargs, return_dict=True)
    features = output.pooler_output
    width = features[0].shape[-1]
    for name, value in output.items():
        if name in _ENCODER_OUTPUTS or not any(
            t.is_floating_point() and t.ndim > 0 and t.shape[-1] == width
            for t in _tensors(value)
        ):
            continue
        raise NotImplementedError(
            f"{type(model).__name__}.get_image_features returns `{name}` beside the "
            "image tokens' embeddings (`pooler_output`): features of the decoder's "
            f"width ({width}) that its forward uses besides the embeddings (Qwen3-VL "
            "adds its `deepstack_features` to the image tokens' hidden states in its "
            "first decoder layers). This backend hands the decoder the embeddings "
            "only, so it refuses the image rather than answer without them."
        )
    return [f.reshape(-1, f.shape[-1]) for f in features]


_ENCODER_OUTPUTS = frozenset(
    {"pooler_output", "last_hidden_state", "hidden_states", "attentions"}
)
"""What any vision tower's output holds (the embeddings and the tower's own states)."""


def _tensors(value: object) -> list[torch.Tensor]:
    """The tensors in `value`, inside lists and tuples (not inside another model
    output: a tower's or a Q-Former's own, kept whole beside the embeddings)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, list | tuple):
        return [t for item in value for t in _tensors(item)]
    return []


class MultiModalMixin(Base, SupportsMultiModal, SupportsMRoPE):
    """A vision-language model: `embed_multimodal` runs the HF vision tower and
    projector, `embed_input_ids` scatters their embeddings over the image tokens,
    the decoder runs as the mixin beside it says (`CausalMixin`, or a pooling one).

    `Base` first: the interfaces are protocols, whose `__init__` takes nothing, so
    a backend class takes the `__init__` of the mixin beside this one."""

    @classmethod
    def get_placeholder_str(cls, modality: str, i: int) -> str | None:
        # The model's chat template writes its own placeholder for an image part.
        return None

    def kept_with_transformers(self, vllm_config: "VllmConfig") -> dict[str, str]:
        language_model = self.model.get_decoder()
        # What the HF model takes besides text (VibeVoiceAsr's encoders take audio);
        # a base model may declare only Transformers' default, the string "text"
        # (Aria's), where its wrapper declares the images.
        modalities = getattr(self.model, "input_modalities", ())
        modalities = (modalities,) if isinstance(modalities, str) else modalities
        inputs = " and ".join(
            MODALITY_INPUTS.get(m, m) for m in modalities if m != "text"
        ) or MODALITY_INPUTS[IMAGE]
        return {
            name: (
                f"{type(child).__name__}: encodes {inputs} as Transformers does (its "
                "config is not the text config, so its attention is not "
                "dispatched to vLLM); not fused, replicated on every rank"
            )
            for name, child in self.model.named_children()
            if child is not language_model
            and next(child.parameters(), None) is not None
        }

    def build(self, vllm_config: "VllmConfig", prefix: str) -> PreTrainedModel:
        hf_model = super().build(vllm_config, prefix)
        mm_config = vllm_config.model_config.multimodal_config
        self.text_only = mm_config is not None and mm_config.get_limit_per_prompt(
            IMAGE
        ) == 0
        for name, why in self.kept.items():
            logger.info("Kept with Transformers: %s.%s (%s)", BASE, name, why)
        if self.text_only:
            # Dropped while still on `meta`: never allocated, and their checkpoint
            # tensors are skipped at load.
            for name in self.kept:
                module = self.model.get_submodule(name)
                setattr(self.model, name, StageMissingLayer("vision tower", module))
                self.report.not_built[name] = "text only: limit_mm_per_prompt image 0"
                logger.info("Not built: %s.%s (text only)", BASE, name)
        else:
            check_image_attention(hf_model, self.model, BASE)
        return hf_model

    def embed_multimodal(self, **kwargs: object) -> list[torch.Tensor]:
        if not any(v is not None for v in kwargs.values()):
            return []
        tiles = kwargs.pop(TILES, None)
        in_prompt = kwargs.pop(TILES_IN_PROMPT, None) is not None
        counts: list[int] = []
        if tiles is not None:
            tiles = tiles if isinstance(tiles, list) else tiles.flatten()
            counts = [int(n) for n in tiles]
            # Each image's tiles, one after another (and under one prompt).
            for key, value in kwargs.items():
                if isinstance(value, list) and value:
                    value = torch.cat(value)
                if (
                    in_prompt
                    and isinstance(value, torch.Tensor)
                    and len(value) == sum(counts)
                ):
                    value = value[None]
                kwargs[key] = value
        elif isinstance(kwargs.get("pixel_values"), list):
            # Images of one size come stacked.
            kwargs["pixel_values"] = torch.stack(kwargs["pixel_values"])
        with torch.no_grad():
            features = _image_features(self.model, **kwargs)
        if tiles is None:
            return features
        # One embedding per tile: each image's tiles in order, as it writes them.
        if len(features) != sum(counts):
            raise ValueError(
                f"{len(features)} tiles' features for images of {counts} tiles"
            )
        starts = [sum(counts[:i]) for i in range(len(counts))]
        return [torch.cat(features[a : a + n]) for a, n in zip(starts, counts)]

    def get_language_model(self) -> "MultiModalMixin":
        # One model: the decoder is not a separate vLLM model here.
        return self

    def embed_text(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The text embeddings of `input_ids` (Gemma's scaled ones included)."""
        return Base.embed_input_ids(self, input_ids)

    def embed_input_ids(
        self,
        input_ids: torch.Tensor,
        multimodal_embeddings: list[torch.Tensor] | None = None,
        *,
        is_multimodal: torch.Tensor | None = None,
    ) -> torch.Tensor:
        embeddings = self._embed_text_input_ids(
            input_ids, self.embed_text, is_multimodal=is_multimodal
        )
        if not multimodal_embeddings:
            return embeddings
        return _merge_multimodal_embeddings(
            embeddings, multimodal_embeddings, is_multimodal
        )

    def get_mrope_input_positions(
        self, input_tokens: list[int], mm_features: list[MultiModalFeatureSpec]
    ) -> tuple[torch.Tensor, int]:
        """Rotary positions over (time, height, width), from the HF model's own
        `get_rope_index`: the image tokens (vLLM's placeholders) marked as images."""
        get_rope_index = getattr(self.model, "get_rope_index", None)
        if get_rope_index is None:
            raise ValueError(
                f"{type(self.model).__name__} has no `get_rope_index`, from which the "
                "backend takes multimodal rotary (M-RoPE) positions."
            )
        input_ids = torch.tensor([input_tokens])
        token_types = torch.zeros_like(input_ids, dtype=torch.int)
        grids = []
        for feature in sorted(mm_features, key=lambda f: f.mm_position.offset):
            if feature.modality != IMAGE:
                raise ValueError(f"M-RoPE positions for {feature.modality} items")
            placeholder = feature.mm_position
            span = slice(placeholder.offset, placeholder.offset + placeholder.length)
            is_embed = placeholder.is_embed
            token_types[0, span] = 1 if is_embed is None else is_embed.int()
            grids.append(feature.data["image_grid_thw"].data)
        positions, deltas = get_rope_index(
            input_ids,
            **taken_by(
                get_rope_index,
                mm_token_type_ids=token_types,
                image_grid_thw=torch.stack(grids) if grids else None,
            ),
        )
        return positions[:, 0], int(deltas[0, 0])


def taken_by(function: Callable, **arguments: Any) -> dict[str, Any]:
    """The `arguments` `function`'s signature takes (all, where it takes
    `**kwargs`): Qwen2-VL's `get_rope_index` reads the image tokens from
    `mm_token_type_ids`, Qwen2.5-Omni's finds them in the ids and has no such
    parameter."""
    parameters = inspect.signature(function).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return arguments
    names = {p.name for p in parameters}
    return {name: value for name, value in arguments.items() if name in names}


register_processor = MULTIMODAL_REGISTRY.register_processor(
    MultiModalProcessor,
    info=MultiModalProcessingInfo,
    dummy_inputs=MultiModalDummyInputsBuilder,
)
"""Decorates a backend class with the processing above (vLLM's registry finds it
on the class)."""
