# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The backend core: build the HF model on `meta`, fuse it, attach vLLM attention.

Construction happens in this order, each step owned by one place:

1. patch the text config to dispatch attention into vLLM, build the HF model with
   its parameters on `meta` (`build_hf_model`);
2. drop the layers another pipeline stage owns (`parallel.py`);
3. plan the fusions: class analysis, then what each instance takes (`plan.py`);
   apply the plan and swap HF layers for vLLM's tensor-parallel ones (`Base.apply`);
4. attach a vLLM `Attention` to each module that dispatches it (`attention_bridge.py`);
5. allocate what is still on `meta`; weights load later (`loading.py`).
"""

import functools
import hashlib
import inspect
import linecache
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import transformers
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedModel
from transformers.initialization import no_init_weights

from vllm.compilation.decorators import support_torch_compile
from vllm.distributed import get_pp_group
from vllm.logger import init_logger
from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
from vllm.model_executor.models.interfaces import (
    SupportsLoRA,
    SupportsPP,
    SupportsQuant,
)
from vllm.model_executor.models.interfaces_base import VllmModel
from vllm.model_executor.models.transformers.attention_bridge import (
    AttentionSite,
    attach_attention,
    attention_sites,
    refuse_state_beyond_keys_and_values,
)
from vllm.model_executor.models.transformers.experts_layer import VLLM_EXPERTS
from vllm.model_executor.models.transformers.loading import (
    BASE,
    CheckpointLayout,
    base_model_of,
)
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    LinearBase,
    RowParallelLinear,
)
from vllm.model_executor.models.transformers import fusion_report
from vllm.model_executor.models.transformers.fusion_report import LinearReport
from vllm.model_executor.models.transformers.plan import FusionPlan
from vllm.model_executor.models.transformers.rewriting import sources_read_by_build
from vllm.model_executor.models.transformers.masks import read_layer_masks
from vllm.model_executor.models.transformers.linears import HF_LINEARS
from vllm.model_executor.models.transformers.parallel import (
    decoder_layers,
    drop_other_stages,
    stage_layer_range,
)
from vllm.model_executor.models.transformers.utils import (
    materialize,
    parameters_on_meta,
    replace_linear_class,
    tokens_as_rows,
    tp_style,
)
from vllm.model_executor.models.utils import make_empty_intermediate_tensors_factory
from vllm.sequence import IntermediateTensors

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(__name__)

VLLM_ATTENTION = "vllm"
VLLM_MLA_ATTENTION = "vllm_mla"


def log_active_implementation() -> None:
    """Say once, at start, which implementation of this package is serving."""
    try:
        from vllm_transformers_overlay import describe
    except ImportError:
        logger.info_once("Transformers modeling backend: in-tree")
        return
    logger.info_once(describe())


def build_hf_model(vllm_config: "VllmConfig") -> PreTrainedModel:
    """The HF causal LM for the model's config, parameters on `meta`, attention
    dispatching into vLLM (its latent attention when vLLM uses MLA for the model)."""
    model_config = vllm_config.model_config
    config = model_config.hf_config
    # Only the text config dispatches into vLLM: a vision tower keeps its own.
    text_config = model_config.hf_text_config
    text_config._attn_implementation = (
        VLLM_MLA_ATTENTION if model_config.use_mla else VLLM_ATTENTION
    )
    # Experts behind Transformers' experts interface run on vLLM's fused MoE.
    text_config._experts_implementation = VLLM_EXPERTS
    architectures = getattr(config, "architectures", None) or []
    hf_class = next(
        (getattr(transformers, a) for a in architectures if hasattr(transformers, a)),
        None,
    )
    remote = {
        auto: code
        for auto, code in (getattr(config, "auto_map", None) or {}).items()
        if auto.startswith("AutoModel")
    }
    if hf_class is None and remote and not model_config.trust_remote_code:
        # Transformers would quietly build its own class for the config's
        # `model_type` in place of the repository's.
        raise ValueError(
            f"The config's architectures {architectures} are not Transformers "
            f"classes but repository code (auto_map: {remote}), which runs only "
            "with trust_remote_code=True; it is not trusted, so the model is not "
            "built."
        )
    name = hf_class.__name__ if hf_class is not None else "AutoModelForCausalLM"
    try:
        with parameters_on_meta(), no_init_weights():
            if hf_class is not None:
                return hf_class._from_config(config, dtype=model_config.dtype)
            return AutoModelForCausalLM.from_config(
                config,
                dtype=model_config.dtype,
                trust_remote_code=model_config.trust_remote_code,
            )
    except Exception as error:  # noqa: BLE001 - whatever the model's code raises
        raise ValueError(
            f"Transformers cannot build {name} from its config (model_type "
            f"{config.model_type!r}): {type(error).__name__}: {error}. The config is "
            "inconsistent, or asks for something this version of Transformers lacks."
        ) from error


def style_of(linear: LinearBase) -> str:
    """The tensor-parallel style a vLLM linear implements."""
    if linear.disable_tp:  # a merged linear kept whole on every rank
        return "replicate"
    if isinstance(linear, ColumnParallelLinear):
        return "colwise"
    if isinstance(linear, RowParallelLinear):
        return "rowwise"
    return "replicate"


def describe_layer(qualname: str, layer: nn.Module) -> str:
    """`qualname (Class)`, and the modules in it that look like its attention."""
    attention = [
        f"{qualname}.{name} ({type(m).__name__})"
        for name, m in layer.named_modules()
        if name and "attention" in type(m).__name__.lower()
    ]
    found = f"; its attention: {', '.join(attention)}" if attention else ""
    return f"{qualname} ({type(layer).__name__}){found}"


def _no_dynamic_rope(vllm_config: "VllmConfig") -> bool:
    """Dynamic rope scaling recomputes frequencies per call, which compiles badly."""
    rope = (
        getattr(vllm_config.model_config.hf_text_config, "rope_parameters", None) or {}
    )
    parameters = (
        rope.values() if all(isinstance(v, dict) for v in rope.values()) else [rope]
    )
    return all(p.get("rope_type") != "dynamic" for p in parameters)


def _eager(name: str, vllm_config: "VllmConfig") -> bool:
    logger.warning_once(
        "%s.forward takes `position_ids` only in `**kwargs`, which vLLM's compiler "
        "cannot mark dynamic: it runs eager.",
        name,
    )
    return False


@functools.cache
def source_digest() -> str:
    """A digest of this subpackage's source: what the fusers rewrite is not in the
    files vLLM's compile cache checks (the HF modeling files), so a cached graph
    must also be keyed on the code that rewrote them."""
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).parent.rglob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def compiled_entry(cls: type[nn.Module]) -> Callable:
    """The forward vLLM compiles for `cls`: a call of HF's (decorated) forward,
    `hf_forward`, through a function of its own with the same parameters, so that
    vLLM's compile cache can save the compiled model and a second start load it.

    Compiling HF's forward itself fails to save ("Can't pickle LlamaModel.forward:
    it's not the same object as ...LlamaModel.forward"): it is a decorator's wrapper
    whose closure holds the undecorated forward under the same qualified name, which
    pickle can only save by name. This function has no closure; its parameters are
    HF's (Dynamo binds the call to the code's own parameter names); its qualified
    name carries the class and `source_digest()`, which vLLM keys its cache on; and
    each class gets its own code object, so Dynamo never shares an entry between
    two classes."""
    signature = inspect.signature(cls.forward)
    parameters = list(signature.parameters.values())[1:]  # after `self`
    kind = inspect.Parameter
    # Passed on by keyword wherever the signature allows, as the backend calls HF's
    # forward: HF's decorators read a default from the config when an argument is
    # in neither place they look, and then pass it twice if it came positionally.
    positional = {kind.POSITIONAL_ONLY}
    if any(p.kind is kind.VAR_POSITIONAL for p in parameters):
        positional.add(kind.POSITIONAL_OR_KEYWORD)
    listed, passed = ["self"], []
    for parameter in parameters:
        name = parameter.name
        if parameter.kind is kind.VAR_POSITIONAL:
            listed.append(f"*{name}")
            passed.append(f"*{name}")
        elif parameter.kind is kind.VAR_KEYWORD:
            listed.append(f"**{name}")
            passed.append(f"**{name}")
        else:
            if parameter.kind is kind.KEYWORD_ONLY and not any(
                p.startswith("*") for p in listed
            ):
                listed.append("*")
            listed.append(name)
            passed.append(name if parameter.kind in positional else f"{name}={name}")
    qualname = f"{cls.__qualname__}.forward[{source_digest()}]"
    source = (
        f"def forward({', '.join(listed)}):\n"
        f"    return self.hf_forward({', '.join(passed)})\n"
    )
    # Its source is where `inspect` finds it: Dynamo wraps a method whose source it
    # cannot find in a closure, which holds the model and cannot be saved.
    filename = f"<compiled entry of {qualname}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    namespace: dict[str, Any] = {}
    exec(compile(source, filename, "exec"), namespace)
    forward = namespace["forward"]
    forward.__qualname__ = qualname
    forward.__code__ = forward.__code__.replace(co_qualname=qualname)
    forward.__defaults__ = tuple(
        p.default
        for p in parameters
        if p.kind in (kind.POSITIONAL_ONLY, kind.POSITIONAL_OR_KEYWORD)
        and p.default is not p.empty
    ) or None
    forward.__kwdefaults__ = {
        p.name: p.default
        for p in parameters
        if p.kind is kind.KEYWORD_ONLY and p.default is not p.empty
    } or None
    return forward


@functools.cache
def _compilable(cls: type[nn.Module]) -> type[nn.Module]:
    """`cls` under vLLM's `support_torch_compile`, as a subclass whose `__init__`
    builds nothing: it only sets the compile state on an instance already built.
    Its `forward` is `compiled_entry(cls)`; HF's stays reachable as `hf_forward`.

    The subclass is an attribute of this module under the name it is pickled by:
    Dynamo saves a guard on the model's type with the compiled model, by name."""

    def __init__(self, *, vllm_config: "VllmConfig", prefix: str = "") -> None:
        pass

    name = f"{cls.__module__}.{cls.__qualname__}".replace(".", "_")
    subclass = type(
        cls.__name__,
        (cls,),
        {
            "__init__": __init__,
            "forward": compiled_entry(cls),
            "hf_forward": cls.forward,
            "__module__": __name__,
            "__qualname__": name,
        },
    )
    # HF models take a batch dimension: [1, tokens] ids, [1, tokens, hidden]
    # embeddings, positions [1, tokens] (or [3, 1, tokens] for M-RoPE), and, for
    # BERT-style models, token types [1, tokens].
    dims = {"input_ids": 1, "inputs_embeds": 1, "position_ids": -1}
    named = inspect.signature(cls.forward).parameters
    if "token_type_ids" in named:
        dims["token_type_ids"] = 1
    enable_if = _no_dynamic_rope
    if "position_ids" not in named:
        # VibeVoiceAsr's base model passes positions on in `**kwargs`, where vLLM's
        # compiler cannot mark them dynamic: a graph would be specialised to one
        # length, so that model runs eager.
        del dims["position_ids"]
        enable_if = functools.partial(_eager, cls.__name__)
    compilable = support_torch_compile(dynamic_arg_dims=dims, enable_if=enable_if)(
        subclass
    )
    globals()[name] = compilable
    return compilable


def enable_compile(base_model: nn.Module, vllm_config: "VllmConfig") -> None:
    """Let vLLM compile the HF base model as it compiles its own models.

    The decorator wants a class before it is built; the HF model already is, so the
    instance moves to a decorated subclass of its own class (HF's class stays
    untouched) and runs that subclass's `__init__` once."""
    compilable = _compilable(type(base_model))
    base_model.__class__ = compilable
    compilable.__init__(base_model, vllm_config=vllm_config)


class Base(nn.Module, VllmModel, SupportsQuant, SupportsLoRA, SupportsPP):
    """A HF model made vLLM-native: fused, tensor-parallel, with vLLM attention.

    LoRA: vLLM's manager wraps every vLLM linear (and the modules `embedding_modules`
    names), expands merged ones through `packed_modules_mapping` to the names an
    adapter uses, and renames adapter tensors with `hf_to_vllm_mapper`."""

    def __init__(self, *, vllm_config: "VllmConfig", prefix: str = ""):
        super().__init__()
        log_active_implementation()
        self.vllm_config = vllm_config
        self.config = vllm_config.model_config.hf_config
        self.text_config = vllm_config.model_config.hf_text_config
        self.quant_config = vllm_config.quant_config
        self.pp_group = get_pp_group()

        self.report = fusion_report.active()
        self.report.model = vllm_config.model_config.model
        try:
            with sources_read_by_build():
                self.build(vllm_config, prefix)
        except ValueError as error:
            self.report.fail(str(error))
            raise
        finally:
            logger.info(self.report.short())

        materialize(self, vllm_config.model_config.dtype)
        tokens_as_rows(self)
        enable_compile(self.model, vllm_config)
        self.make_empty_intermediate_tensors = make_empty_intermediate_tensors_factory(
            ["hidden_states"], self.text_config.hidden_size
        )

    def build(self, vllm_config: "VllmConfig", prefix: str) -> PreTrainedModel:
        """Build the HF model, then fuse it and attach attention (module docstring).
        Returns the whole HF model, whose head the base does not keep."""
        hf_model = build_hf_model(vllm_config)
        self.model: PreTrainedModel = base_model_of(hf_model)[1]
        self.layout = CheckpointLayout.of(hf_model)
        self.tie_word_embeddings = bool(
            getattr(self.text_config, "tie_word_embeddings", False)
            or getattr(self.config, "tie_word_embeddings", False)
        )

        self.kept = self.kept_with_transformers(vllm_config)
        self.report.kept = dict(self.kept)
        layers_name, layers = decoder_layers(self.model, self.text_config, self.kept)
        self.layout.decoder_layers = (layers_name, len(layers))
        self.layer_range = stage_layer_range(self.text_config, self.pp_group)
        self.report.num_layers = len(self.layer_range)
        drop_other_stages(
            self.model,
            layers_name,
            self.layer_range,
            self.pp_group,
            self.tie_word_embeddings,
            everywhere=self.kept,
        )
        # Read while the model is still Transformers' own: the masks it would apply.
        owner = self.model.get_submodule(layers_name.rpartition(".")[0])
        layer_masks = {
            f"{BASE}.{layers_name}.{index}": mask
            for index, mask in read_layer_masks(owner, layers).items()
        }

        # Stages 1 and 2: what each module class matches, what each instance takes.
        self.plan = FusionPlan(
            self.model,
            vllm_config,
            prefix=BASE,
            kept=[f"{BASE}.{name}" for name in self.kept],
        )
        self.report.record_plan(self.plan)
        # Known before any layer is built, so quantisation and LoRA read them in time.
        self.packed_modules_mapping = self.plan.packed_modules_mapping
        if self.quant_config is not None:
            self.quant_config.packed_modules_mapping.update(self.packed_modules_mapping)
            self.quant_config.apply_vllm_mapper(self.layout.mapper().get_rename_mapper())

        self.weight_copies: dict[str, str] = {}
        """Parameter name -> another parameter that loads the same checkpoint tensor."""
        sites = self.apply(getattr(self.model, "_tp_plan", None))
        # After fusing: a mixer a fuser put on vLLM's state layers keeps no state
        # in Transformers' cache any more; any other module that does is refused.
        refuse_state_beyond_keys_and_values(self.model, BASE, self.plan.why_not)
        self.hf_to_vllm_mapper = self.layout.mapper()
        self.embedding_modules = self.input_embedding_modules()
        layer_names = {
            i: describe_layer(f"{BASE}.{layers_name}.{i}", layers[i])
            for i in self.layer_range
        }
        attach_attention(
            attention_sites(sites),
            self.attention_layers(attention_sites(sites)),
            vllm_config,
            prefix,
            layer_names,
            self.report,
            {site.qualname: self.plan.why_not(site.module) for site in sites},
            layer_masks,
        )
        return hf_model

    def attention_layers(self, sites: dict[int, AttentionSite]) -> Sequence[int]:
        """The decoder layers that must dispatch attention to vLLM (`sites`: the
        layers that do): every layer here; a hybrid model's attention layers."""
        return self.layer_range

    def kept_with_transformers(self, vllm_config: "VllmConfig") -> dict[str, str]:
        """Modules of the base model left to Transformers whole (by name, with why):
        not fused, their linears not swapped, replicated on every rank. None here; a
        multimodal model keeps its vision tower."""
        return {}

    def apply(self, tp_plan: dict[str, str] | None) -> list[AttentionSite]:
        """Stage 3: apply each module's planned fusers through the fuser contract,
        then swap the remaining HF linears and the vocab embedding for vLLM's.
        Returns the modules that dispatch attention, with what each needs."""
        plan = tp_plan or {}
        sites: list[AttentionSite] = []

        def replace(module: nn.Module, relative: str) -> None:
            for name, child in list(module.named_children()):
                rel = f"{relative}{name}"
                if rel in self.kept:
                    continue
                new, site = self.apply_fusers(child, f"{BASE}.{rel}")
                if site is not None:
                    sites.append(site)
                layer = self.vllm_layer(new, rel, plan)
                if layer is None:
                    replace(new, f"{rel}.")
                else:
                    new = layer
                if new is not child:
                    setattr(module, name, new)

        replace(self.model, "")
        return sites

    def apply_fusers(
        self, module: nn.Module, qualname: str
    ) -> tuple[nn.Module, AttentionSite | None]:
        """`module` with its planned fusers applied in order, each logged and
        reported, and where it dispatches attention, what its `attn` needs."""
        fusers = self.plan[module]
        self.report.record_module(
            type(module).__name__,
            matched=[type(f).__name__ for f in self.plan.matched(module)],
            applied=[type(f).__name__ for f in fusers],
        )
        # Read before fusing: the fusers may rename the module's children.
        needs = next(
            (
                found
                for fuser in fusers
                if (found := fuser.attention_needs(module, self.vllm_config))
                is not None
            ),
            None,
        )
        new = module
        for fuser in fusers:
            new = fuser.fuse(new, qualname, self.vllm_config)
            logger.info(fuser.info(qualname, new))
            self.report.record_fusion(fuser, fuser.report_detail(qualname, new))
            self.layout.add_stacked(fuser.stacked_weights(qualname))
            self.layout.add_renamed(fuser.renamed_weights(qualname))
        if needs is None:
            return new, None
        for fuser in fusers:
            needs = fuser.adjust_attention(needs, new, self.vllm_config)
        packed = {
            original: merged
            for fuser in fusers
            for merged, originals in fuser.packed_modules_mapping.items()
            for original in originals
        }
        return new, AttentionSite(qualname, new, needs, packed)

    def vllm_layer(
        self, module: nn.Module, relative: str, plan: dict[str, str]
    ) -> nn.Module | None:
        """vLLM's layer for an HF linear (in the style the HF tensor-parallel plan
        gives it, replicated where it gives none) or for the vocab embedding; a vLLM
        linear a fuser built, as it is; None for anything else, whose children are
        visited in turn. Every linear is reported."""
        qualname = f"{BASE}.{relative}"
        if type(module) in HF_LINEARS:
            style = tp_style(relative, plan)
            linear = replace_linear_class(
                module, style or "replicate", self.quant_config, prefix=qualname
            )
            self.report.linears.append(
                LinearReport(
                    qualname,
                    type(linear).__name__,
                    style or "replicate",
                    style is not None,
                )
            )
            return linear
        if isinstance(module, LinearBase):
            # Built by a fuser, which owns its style.
            self.report.linears.append(
                LinearReport(qualname, type(module).__name__, style_of(module), True)
            )
            return module
        if (
            type(module) is nn.Embedding
            and module.num_embeddings == self.text_config.vocab_size
        ):
            return VocabParallelEmbedding(
                module.num_embeddings,
                module.embedding_dim,
                quant_config=self.quant_config,
                prefix=qualname,
            )
        return None

    def input_embedding_modules(self) -> dict[str, str]:
        """The input embedding for LoRA's `embedding_modules`, by the last part of its
        name (how vLLM matches modules), where this stage holds vLLM's vocab embedding:
        the only kind vLLM's LoRA layers can wrap (Gemma's scaled one stays HF's)."""
        embedding = self.model.get_input_embeddings()
        if not isinstance(embedding, VocabParallelEmbedding):
            return {}
        name = next(n for n, m in self.model.named_modules() if m is embedding)
        return {name.rpartition(".")[2]: "input_embeddings"}

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """vLLM's embedding step (multimodal runners merge image features into it)."""
        embed_tokens: nn.Module = self.model.get_input_embeddings()
        return embed_tokens(input_ids)

    def forward(
        self, input_ids: torch.Tensor | None, positions: torch.Tensor, **step: Any
    ) -> torch.Tensor | IntermediateTensors:
        """One engine step over vLLM's flat sequence of tokens, run as a batch of one
        through the HF base model. `step` holds the runner's other inputs, all by
        keyword: `intermediate_tensors` (the hidden states a later pipeline stage
        starts from), `inputs_embeds` (tokens already embedded), and whatever else
        the HF forward takes (token types, multimodal positions)."""
        carried = step.pop("intermediate_tensors", None)
        embedded = step.pop("inputs_embeds", None)
        if carried is not None:
            embedded = carried["hidden_states"]
        batch: dict[str, torch.Tensor | None] = (
            {"input_ids": None, "inputs_embeds": embedded[None]}
            if embedded is not None
            else {"input_ids": input_ids[None], "inputs_embeds": None}
        )
        # M-RoPE positions come as [3, tokens]; HF wants [3, batch, tokens].
        batch["position_ids"] = positions.unsqueeze(-2)
        outputs = self.model(**batch, **step, use_cache=False, return_dict=False)
        hidden_states = outputs[0][0]
        if self.pp_group.is_last_rank:
            return hidden_states
        return IntermediateTensors({"hidden_states": hidden_states})

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return self.layout.load(
            self,
            weights,
            copies=self.weight_copies,
            every_parameter=self.quant_config is None,
            source=self.vllm_config.model_config.model,
        )
