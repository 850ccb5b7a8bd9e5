"""The one function of vLLM the overlay replaces: how vLLM names this backend's class.

vLLM 0.32 picks the Transformers modeling backend's class by name from the config,
in `ModelConfig._get_transformers_backend_cls` (`Transformers` + `MultiModal` + `MoE` +
`ForCausalLM` / `EmbeddingModel` / `ForSequenceClassification`), and has no name for
a hybrid model: one whose decoder keeps a recurrent or convolution state beside (or
instead of) attention keys and values. Such a model needs a class that tells vLLM's
cache manager about that state (`IsHybrid`, `HasInnerState`), which the plain causal
LM class must not claim.

The in-tree change this stands for, in `vllm/config/model.py`:

    cls += "MoE" if self.is_moe else ""
  + cls += "Hybrid" if keeps_recurrent_state(self.hf_text_config) and <causal LM> else ""

with `keeps_recurrent_state` as below, and in `vllm/model_executor/models/registry.py`
the two names beside the others of `_TRANSFORMERS_BACKEND_MODELS`:

  + "TransformersHybridForCausalLM": ("transformers", "TransformersHybridForCausalLM"),
  + "TransformersHybridMoEForCausalLM": ("transformers", "TransformersHybridMoEForCausalLM"),

Out of tree, `install_routing` wraps the original function once `vllm.config.model`
is imported (the overlay's finder calls it), and the replacement adds those two
entries (to that table, and to `ModelRegistry` through its public `register_model`)
the first time it hands one of the names out, in whichever process asks: data, not
code, the same entries the in-tree change writes. On another vLLM version than `WRITTEN_FOR` the
original stays and a warning says that hybrid models are not routed.
"""

import functools
import logging
from collections.abc import Callable
from types import ModuleType

WRITTEN_FOR = "0.32."
"""The vLLM release line whose `_get_transformers_backend_cls` this replaces."""
HYBRID = "Hybrid"
HYBRID_CLASSES = ("TransformersHybridForCausalLM", "TransformersHybridMoEForCausalLM")
PACKAGE = "vllm.model_executor.models.transformers"
RECURRENT_LAYER_TYPES = frozenset({"linear_attention", "conv", "hybrid", "hybrid_sliding"})
"""Transformers' layer types (`config.layer_types`) whose cache layer keeps a
convolution or recurrent state: the backend's `hybrid.RECURRENT_LAYER_TYPES`, kept
here so that routing imports nothing of the backend (a test checks they agree)."""

logger = logging.getLogger("vllm.transformers_overlay")


def keeps_recurrent_state(text_config: object) -> bool:
    """Whether the decoder declares a layer that keeps a recurrent or convolution
    state in Transformers' cache."""
    layer_types = getattr(text_config, "layer_types", None) or ()
    return any(t in RECURRENT_LAYER_TYPES for t in layer_types)


def _register_hybrid_classes() -> None:
    """The registry entries the in-tree change adds: in `_TRANSFORMERS_BACKEND_MODELS`
    (which vLLM's registry asks whether a name is this backend's) and, through
    `ModelRegistry.register_model`, in the registry's table of classes."""
    from vllm.model_executor.models import registry

    for name in HYBRID_CLASSES:
        registry._TRANSFORMERS_BACKEND_MODELS.setdefault(name, ("transformers", name))
        if name not in registry.ModelRegistry.models:
            registry.ModelRegistry.register_model(name, f"{PACKAGE}:{name}")


def hybrid_aware(original: Callable[..., str]) -> Callable[..., str]:
    """`original`, naming the hybrid class for a causal LM whose decoder keeps
    recurrent state; every other answer is the original's."""

    @functools.wraps(original)
    def _get_transformers_backend_cls(self) -> str:
        name = original(self)
        prefix, suffix = "Transformers", "ForCausalLM"
        if (
            name.endswith(suffix)
            and "MultiModal" not in name
            and keeps_recurrent_state(self.hf_text_config)
        ):
            _register_hybrid_classes()
            return f"{prefix}{HYBRID}{name[len(prefix) :]}"
        return name

    _get_transformers_backend_cls.replaced = original
    return _get_transformers_backend_cls


def install_routing(module: ModuleType) -> None:
    """Replace `ModelConfig._get_transformers_backend_cls` in the freshly imported
    `vllm.config.model`, if vLLM is the version it was written for."""
    from vllm import __version__ as version

    model_config = module.ModelConfig
    current = model_config.__dict__.get("_get_transformers_backend_cls")
    if current is None or hasattr(current, "replaced"):
        return
    if not version.startswith(WRITTEN_FOR):
        logger.warning(
            "Transformers modeling backend: vLLM %s is not %sx, for which the "
            "overlay's routing of hybrid models was written; "
            "ModelConfig._get_transformers_backend_cls is left as it is, so hybrid "
            "models (state-space or linear-attention mixers) get the plain causal LM "
            "class, which refuses them.",
            version,
            WRITTEN_FOR,
        )
        return
    model_config._get_transformers_backend_cls = hybrid_aware(current)
