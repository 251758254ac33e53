"""The model contract: what a model provides to funcpar, and the registry ``hf``, ``checkpoint`` and the CLI consult.

A model is a :class:`ModelSpec`: plain functions over a parameter pytree plus data. Nothing else in funcpar looks
inside a model module; everything it needs is named here:

=================  =====================================================================================
``name``           a short name (``"llama"``), used in messages
``init``           ``init(cfg, seed=0, dtype=float32, device=None) -> params`` (global shapes; ``device="meta"``
                   gives shapes only)
``specs``          ``specs(cfg, mesh=None) -> tree of P`` matching ``init``'s tree
``forward``        ``forward(params, tokens, cfg, mesh) -> logits`` (this rank's shards in and out)
``loss``           ``loss(params, batch, cfg, mesh, reduction="mean", **capabilities) -> scalar``
``Config``         its config class (``cfg.with_mesh(mesh) -> cfg``, where it has one, pads a vocabulary tp does
                   not divide: :class:`funcpar.nn.layers.VocabPadding` provides it; without, the config is the same
                   on every mesh)
``hf``             optional, the HF form: an :class:`HFNames` table (HF tensor names <-> pytree paths, as data); a
                   model with one has ``model_types`` (the HF ``config.json`` ``model_type`` values it implements,
                   ``("llama", "mistral")``), and a ``Config`` with ``from_hf(dict) -> cfg``, ``cfg.to_hf() ->
                   dict``, ``cfg.with_mesh(mesh)`` and ``cfg.model_type``. ``funcpar.hf`` and the command line refuse
                   a model without one by name (train it with ``compile_step``; ``step.save`` checkpoints it)
``config_types``   the JSON types of the ``config.json`` keys ``Config.from_hf`` reads, ``{key: (type, ...)}``
                   (``None`` for null; an integer is a number): a key of another type is refused by name before
                   ``from_hf`` runs. :data:`DECODER_CONFIG_TYPES` holds the keys transformers' decoders share
``batch_weight``   ``batch_weight(micro_batch) -> number``: a micro-batch's weight in the step's global mean
                   (:func:`funcpar.nn.layers.count_targets` for a token-mean loss); ``None`` weighs rows
``remat``          capability: ``loss(..., remat=True)`` recomputes each block in the backward pass
``stages``         capability: the staged form pipeline stages need (:class:`Stages`), or ``None``
``check_batch``    ``check_batch(batch, cfg) -> [messages]``: what is wrong with a batch (out-of-range token ids:
                   :func:`funcpar.nn.layers.token_range_errors`); the step checks every batch with it
``sequence_parallel`` capability: its layers keep the hidden state split along the sequence over tp where the mesh
                   says so (:meth:`funcpar.Mesh.with_sequence_parallel`, the ``funcpar.nn.layers`` sequence helpers)
``context_parallel`` capability: on a mesh with a ``cp`` axis each rank runs a chunk of every sequence
                   (``funcpar.nn.layers.context_chunk``; attention over every chunk's keys), and ``batch_weight``
                   takes ``mesh=`` to count that chunk's targets
``check_run``      optional, ``check_run(cfg, mesh, staged) -> None``: raise a :class:`ModelError` naming what the model
                   cannot run exactly on ``mesh`` (``staged``: pipeline stages, ZeRO-3 or remat run its staged
                   form); ``loss_fn`` and ``compile_step`` call it before step 1 (the generic transformers model's
                   refusals)
``documents``      capability: a batch's ``position_ids`` mark packed samples, each attending only to itself at
                   its own positions (:mod:`funcpar.nn.documents`; ``mesh.documents`` in the layers)
``data_axes``      the mesh axes its batch is split over, each rank of them its own rows (default ``("dp",)``;
                   Mixtral's ``("dp", "ep")``): what ``compile_step(..., data_axes=...)`` takes for it
``frozen``         optional, ``frozen(cfg) -> tree of bool`` (or ``None``): the leaves the model's forward never
                   gives a gradient (a module run under ``torch.no_grad``); ``compile_step`` leaves them alone, as
                   torch's optimizers skip a parameter whose ``grad`` is ``None`` (no update, no weight decay)
=================  =====================================================================================

A model module builds one ``ModelSpec`` and calls :func:`register_model` on it. The built-in models are registered
by module name and imported on first lookup, so ``funcpar`` never imports ``funcpar.models`` (which imports
``funcpar``): the import graph has no cycle.

A model of one's own needs none of this to train: :class:`Loss` takes its staged form and ``init`` directly
(``fp.Loss(stages=fp.Stages(...), init=init, mesh=mesh)``), which is all ZeRO-3 and pipeline stages read
(``examples/custom_pipeline.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import types
from typing import Any, Callable, Mapping, Sequence

from funcpar.nn.documents import documents_of
from funcpar.nn.remat import remat as remat_fn

__all__ = ["ModelSpec", "HFNames", "Stages", "Loss", "ModelError", "register_model", "get_model", "known_models",
           "generic_types", "DECODER_CONFIG_TYPES"]


class ModelError(ValueError):
    """A model that does not meet the contract, or a name the registry does not know."""


@dataclasses.dataclass(frozen=True)
class HFNames:
    """How a model's pytree paths map to the tensors of a Hugging Face checkpoint (the mapping is data, not code).

    ``table``: ``(path pattern, HF name pattern)`` pairs, ``{i}`` standing for a layer index and ``{*}`` for the rest
    of a name, copied as it is (the generic transformers models' paths hold HF names: ``("head.{*}", "{*}")``). An
    HF pattern with
    ``{j}`` names one tensor per index along the leaf's first dimension, and the leaf is their stack (Mixtral's
    per-expert ``block_sparse_moe.experts.{j}.w1.weight``, each (I, d), for the stacked ``w_gate`` (E, I, d)); each
    such tensor is mapped as a leaf of the stack's other dimensions would be (``transposed``, ``splits``), a rank
    reads only the tensors of its block of the first dimension (an ep rank its own experts), and of each only its
    block.
    ``transposed``: path patterns of leaves stored transposed in the checkpoint (GPT-2's Conv1D).
    ``splits``: path pattern -> ``(dim, k, n)``: the leaf is part ``k`` of ``n`` of a fused HF tensor along ``dim``
    (the parts one after another, each as large as its leaf: equal for GPT-2's ``c_attn``, not for ChatGLM's
    ``query_key_value``); a negative ``dim`` counts from the end, at least 0 (``-2``: a weight's rows, a bias's only
    dim, the rows of a stack of experts' weights).
    ``vocab_padded``: path patterns of vocab tables whose rows beyond ``cfg.vocab_size`` are padding.
    ``ignored``: regular expressions of checkpoint tensors that hold nothing to load; ``ignored_if_tied`` more of
    them when ``cfg.tie_word_embeddings`` (a tied checkpoint's copy of the head).
    ``export_as``: the registered model whose table ``save`` writes instead, for a layout funcpar reads but does not
    write (ChatGLM's folders, written as transformers' GLM; the config's ``to_hf`` must give that model's keys).
    ``alternates``: other layouts of the same leaves that ``load`` reads too and ``save`` never writes, each an
    ``HFNames`` of its own (Mixtral's experts fused as transformers 5 holds them in memory, beside the per-expert
    tensors of the Hub and of ``save_pretrained``). A folder is read in the layout its tensor names fit (the one
    with the fewest missing and unexpected names; the first on a tie); ``save`` writes this table's.
    """

    table: Sequence[tuple[str, str]]
    transposed: Sequence[str] = ()
    splits: Mapping[str, tuple[int, int, int]] = dataclasses.field(default_factory=dict)
    vocab_padded: Sequence[str] = ()
    ignored: Sequence[str] = ()
    ignored_if_tied: Sequence[str] = ()
    export_as: str | None = None
    alternates: Sequence["HFNames"] = ()

    def layouts(self) -> list["HFNames"]:
        """Every layout ``load`` reads: this table first (the one ``save`` writes), then ``alternates``."""
        return [self, *self.alternates]

    def ignored_for(self, cfg: Any) -> list[str]:
        return list(self.ignored) + (list(self.ignored_if_tied) if getattr(cfg, "tie_word_embeddings", False) else [])


@dataclasses.dataclass(frozen=True)
class Stages:
    """The staged form of a model, ``loss = head(blocks(embed(batch)))``, that pipeline stages split.

    ``embed(params, batch, cfg, mesh) -> carry``; ``block(layer_params, carry, index, cfg, mesh) -> carry`` for
    each entry of ``params[layers]``; ``head(params, carry, batch, cfg, mesh, reduction="mean") -> loss``. The carry
    is a tensor (the hidden states). ``embed_leaves`` and ``head_leaves`` name the top-level leaves each end uses
    (a tied embedding appears in both).

    ``halves`` (optional): ``(first, second)``, each with ``block``'s signature, ``block`` being ``second`` after
    ``first`` (a decoder layer's attention with its residual, then its MLP with its residual); ``first_leaves(cfg)``
    names the layer leaves ``first`` uses, the rest being ``second``'s, and ``half_names`` says what each half is.
    A pipeline may then cut a layer between its halves, which balances stages that whole layers cannot (the last
    stage's LM head weighs about half a layer or more).
    """

    embed: Callable
    block: Callable
    head: Callable
    embed_leaves: Callable[[Any], Sequence[str]]
    head_leaves: Callable[[Any], Sequence[str]]
    layers: str = "layers"
    halves: tuple[Callable, Callable] | None = None
    first_leaves: Callable[[Any], Sequence[str]] | None = None
    half_names: tuple[str, str] = ("attention", "mlp")

    def __post_init__(self):
        if (self.halves is None) != (self.first_leaves is None):
            raise ModelError("Stages: give halves and first_leaves together (the two half-blocks and the layer "
                             "leaves the first one uses), or neither")

    def hidden(self, params, batch, cfg, mesh, remat: bool = False):
        """The carry after the last block: ``embed``, then each block in turn. ``remat``: keep only each block's
        input, and recompute the block in the backward pass (activation checkpointing)."""
        mesh = documents_of(mesh, batch)  # (packed samples: each attends to itself)
        x = self.embed(params, batch, cfg, mesh)
        block = remat_fn(self.block) if remat else self.block
        for i, lp in enumerate(params[self.layers]):
            x = block(lp, x, i, cfg, mesh)
        return x

    def loss(self, params, batch, cfg, mesh, reduction: str = "mean", remat: bool = False):
        """The model's loss on one process, composed from the stages (a staged model's ``loss`` is this)."""
        return self.head(params, self.hidden(params, batch, cfg, mesh, remat), batch, cfg, mesh, reduction)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A model as funcpar sees it (see the module docstring for each field). Its HF form (``hf``, ``model_types``,
    ``Config.from_hf`` / ``to_hf``, ``config_types``) is optional: without it the model trains and checkpoints as
    any other, and only HF import and export refuse it (:meth:`check_hf`)."""

    name: str
    init: Callable
    specs: Callable
    forward: Callable
    loss: Callable
    Config: type | None = None
    model_types: tuple[str, ...] = ()
    hf: HFNames | None = None
    config_types: Mapping[str, tuple] = dataclasses.field(default_factory=dict)
    batch_weight: Callable[[Any], float] | None = None
    remat: bool = False
    stages: Stages | None = None
    check_batch: Callable[[Any, Any], list] | None = None
    sequence_parallel: bool = False
    context_parallel: bool = False
    documents: bool = False
    check_run: Callable | None = None
    frozen: Callable | None = None
    data_axes: tuple[str, ...] = ("dp",)

    def __post_init__(self):
        if isinstance(self.model_types, str):
            raise ModelError(f"model '{self.name}': model_types must be a tuple of HF model_type names")
        for key, kinds in self.config_types.items():
            if not isinstance(kinds, tuple) or not kinds or any(k is not None and k not in _WANT for k in kinds):
                raise ModelError(f"model '{self.name}': config_types['{key}'] must be a tuple of JSON types "
                                 f"(bool, int, float, str, list, dict, None), got {kinds!r}")
        if self.hf is None:
            return
        for attr in ("from_hf",):
            if not callable(getattr(self.Config, attr, None)):
                raise ModelError(f"model '{self.name}': its Config has no {attr}() (see funcpar.model)")
        for attr in ("to_hf", "with_mesh"):
            if not callable(getattr(self.Config, attr, None)):
                raise ModelError(f"model '{self.name}': its Config has no method {attr}() (see funcpar.model)")
        if not self.model_types:
            raise ModelError(f"model '{self.name}': model_types must be a non-empty tuple of HF model_type names")

    def check_hf(self, doing: str, error: type[Exception] = ModelError) -> None:
        """Raise ``error`` naming the model unless it has an HF form (``hf``; ``doing``: what needs it)."""
        if self.hf is None:
            raise error(f"model '{self.name}' has no HF form: {doing} needs its HF name table and config "
                        f"(ModelSpec.hf, model_types, Config.from_hf / to_hf); train it with compile_step and "
                        f"checkpoint it with step.save / step.load instead")

    def config(self, hf_config: Mapping[str, Any], mesh=None) -> Any:
        """The config from an HF ``config.json`` dict, padded for ``mesh`` when one is given. A key of the wrong
        JSON type (``config_types``), or one ``from_hf`` needs and the dict lacks, is refused by name."""
        if not callable(getattr(self.Config, "from_hf", None)):  # (a model with an HF form has it)
            self.check_hf("reading a config.json")
        check_config_types(hf_config, self.config_types)
        try:
            cfg = self.Config.from_hf(dict(hf_config))
        except KeyError as e:
            key = e.args[0] if e.args else None
            if not isinstance(key, str) or key in hf_config:
                raise
            raise ModelError(f"config key '{key}' is missing, and model '{self.name}' cannot do without it") from None
        return cfg if mesh is None or not hasattr(cfg, "with_mesh") else cfg.with_mesh(mesh)

    def batch_checks(self, cfg: Any) -> Callable[[Any], list] | None:
        """``check(batch) -> [messages]`` for the step: ``check_batch`` on ``cfg``, and ``position_ids`` refused by
        name where the model does not take packed documents."""
        own = functools.partial(self.check_batch, cfg=cfg) if self.check_batch else None
        if self.documents:
            return own

        def check(batch):
            bad = ([f"batch['position_ids']: model '{self.name}' does not take packed documents (samples that each "
                    f"attend only to themselves) yet; leave position_ids out (funcpar train: --cross-document)"]
                   if isinstance(batch, dict) and "position_ids" in batch else [])
            return bad + (own(batch) if own else [])
        return check

    def loss_fn(self, cfg: Any, mesh, *, remat: bool = False, sequence_parallel: bool = False) -> "Loss":
        """The :class:`Loss` of this model for :func:`funcpar.compile_step`: ``loss(params, batch) -> scalar`` on
        ``cfg`` and ``mesh``, carrying the model's batch weight and batch check, and the model for its staged form.
        ``sequence_parallel``: between tp regions each tp rank keeps its block of the sequence
        (:meth:`funcpar.Mesh.with_sequence_parallel`; the batch's sequence length a multiple of tp)."""
        if remat and not self.remat:
            raise ModelError(f"model '{self.name}' does not support remat (activation checkpointing)")
        if sequence_parallel and not self.sequence_parallel:
            raise ModelError(f"model '{self.name}' does not support sequence parallelism yet (its layers are not "
                             f"written with funcpar.nn.layers' sequence helpers)")
        mesh = mesh.with_sequence_parallel() if sequence_parallel else mesh
        weight = self.batch_weight
        if "cp" in mesh.axis_names and mesh.axis_size("cp") > 1:  # a chunk of every sequence per cp rank
            if not self.context_parallel:
                raise ModelError(f"model '{self.name}' does not support context parallelism (a cp axis) yet")
            weight = functools.partial(weight, mesh=mesh) if weight is not None else None  # this chunk's targets
        if self.check_run is not None:
            self.check_run(cfg, mesh, staged=remat or mesh.axis_size("pp") > 1)
        kw = {"remat": True} if remat else {}
        check = self.batch_checks(cfg)
        return Loss(fn=functools.partial(self.loss, cfg=cfg, mesh=mesh, **kw), model=self, cfg=cfg, mesh=mesh,
                    remat=remat, batch_weight=weight, check_batch=check,
                    frozen=self.frozen(cfg) if self.frozen is not None else None)


# The JSON types of the config.json keys transformers' decoders share, as transformers writes them: the models built
# on them (llama, mixtral, glm, baichuan) declare ``config_types={**DECODER_CONFIG_TYPES, <their own keys>}``. Checked
# before Config.from_hf runs, so that "64" for hidden_size, or "false" for a flag (which bool() would take for True),
# is named by its key instead of failing later or silently meaning something else.
DECODER_CONFIG_TYPES: Mapping[str, tuple] = types.MappingProxyType({
    **dict.fromkeys(("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "max_position_embeddings"), (int,)),
    **dict.fromkeys(("num_key_value_heads", "head_dim"), (int, None)),
    **dict.fromkeys(("rms_norm_eps", "rope_theta"), (float,)),
    "tie_word_embeddings": (bool,),
    **dict.fromkeys(("rope_scaling", "rope_parameters"), (dict, None)),
    **dict.fromkeys(("model_type", "hidden_act"), (str,)),
})
_KINDS = ((bool, "a boolean"), (int, "an integer"), (float, "a number"), (str, "a string"), (list, "an array"),
          (dict, "an object"))
_WANT = {**dict(_KINDS), bool: "true or false", None: "null"}


def json_kind(v: Any) -> str:
    """What a JSON value is, in JSON's words (``"64"`` is a string, ``true`` a boolean)."""
    return "null" if v is None else next((name for k, name in _KINDS if isinstance(v, k)), type(v).__name__)


def _is(v: Any, kind: type | None) -> bool:
    if kind is None or isinstance(v, bool):
        return v is None if kind is None else kind is bool
    return isinstance(v, kind) or kind is float and isinstance(v, int)  # a JSON integer is a number


def check_config_types(hf_config: Any, config_types: Mapping[str, tuple]) -> None:
    """Raise a :class:`ModelError` naming the key, its value and the type expected, unless ``hf_config`` is a
    mapping whose keys in ``config_types`` (a model's :attr:`ModelSpec.config_types`) have their JSON type."""
    if not isinstance(hf_config, Mapping):
        raise ModelError(f"a model config is an object of keys (a config.json), not {json_kind(hf_config)}")
    for key, kinds in config_types.items():
        v = hf_config.get(key)
        if key in hf_config and not any(_is(v, k) for k in kinds):
            shown = repr(v) if len(repr(v)) <= 60 else repr(v)[:57] + "..."
            raise ModelError(f"config key '{key}' is {shown} ({json_kind(v)}), expected "
                             f"{' or '.join(_WANT[k] for k in kinds)}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Loss:
    """A loss for :func:`funcpar.compile_step`, ``loss(params, batch) -> scalar``, with what it carries as fields.

    ``fn``: the function. ``model``, ``cfg``, ``mesh``: the registered model, config and mesh it computes (``None``
    for a loss that is not a registered model's). ``stages``, ``init``: the staged form ZeRO-3 and pipeline stages
    run (:class:`Stages`, on ``cfg`` and ``mesh``) and ``init(cfg, device="meta") -> params`` giving the parameters'
    shapes the pipeline's stage plan cuts; both default to the model's. ``name``: what messages call the model
    (default the model's). ``remat``: it recomputes each block in the backward pass. ``batch_weight``:
    ``weight(micro_batch) -> number``, a micro-batch's weight in the step's mean (``None``: rows). ``check_batch``:
    ``check(batch) -> [messages]``, what is wrong with a batch, run by the step on every batch (``None``: nothing
    checked). ``frozen``: a tree of bool over the parameters, True where the loss never gives a gradient (the
    step leaves those leaves alone, as torch's optimizers skip a parameter whose ``grad`` is ``None``; ``None``:
    every leaf trains).

    A model of one's own needs no :class:`ModelSpec` and no registry: ``fp.Loss(stages=fp.Stages(...), init=init,
    mesh=mesh)`` (``cfg=`` where its functions take one) is a loss for every mode, ``zero=3`` and pipeline stages
    included; without ``fn``, the function is ``stages.loss`` on ``cfg`` and ``mesh`` (with ``remat``).
    """

    fn: Callable | None = None
    model: ModelSpec | None = None
    cfg: Any = None
    mesh: Any = None
    remat: bool = False
    batch_weight: Callable[[Any], float] | None = None
    check_batch: Callable[[Any], list] | None = None
    stages: Stages | None = None
    init: Callable | None = None
    name: str | None = None
    frozen: Any = None

    def __post_init__(self):
        if self.model is not None:  # what the model has and the loss does not say
            for field in ("stages", "init", "name"):
                if getattr(self, field) is None:
                    object.__setattr__(self, field, getattr(self.model, field))
        if self.stages is not None and not isinstance(self.stages, Stages):
            raise ModelError(f"Loss: stages must be a funcpar.Stages, got {type(self.stages).__name__}")
        if self.fn is None:
            if self.stages is None or self.mesh is None:
                raise ModelError("Loss: give fn (loss(params, batch) -> scalar), or stages= and mesh= to compose "
                                 "it from (stages.loss on cfg and mesh)")
            kw = {"remat": True} if self.remat else {}
            object.__setattr__(self, "fn", functools.partial(self.stages.loss, cfg=self.cfg, mesh=self.mesh, **kw))

    def __call__(self, params, batch):
        return self.fn(params, batch)

    def shapes(self) -> Any:
        """The global parameter tree on meta, ``init(cfg, device="meta")`` (``None`` without ``init``): what a
        pipeline's stage plan cuts."""
        return None if self.init is None else self.init(self.cfg, device="meta")

    @staticmethod
    def of(fn: Callable) -> "Loss":
        """``fn`` as a :class:`Loss`: a ``Loss`` as it is; ``functools.partial(model.loss, cfg=..., mesh=...)`` of a
        registered model as ``model.loss_fn(cfg, mesh)`` would build it (the ``remat`` keyword included), so the two
        ways of naming a model's loss weigh and check batches alike; any other callable carries nothing."""
        if isinstance(fn, Loss):
            return fn
        kw = getattr(fn, "keywords", None) if isinstance(fn, functools.partial) else None
        owner = _owner(fn.func) if kw is not None else None
        if owner is None:
            return Loss(fn=fn)
        cfg = kw.get("cfg")
        check = owner.batch_checks(cfg) if "cfg" in kw else None
        known = "cfg" in kw and "mesh" in kw
        return Loss(fn=fn, model=owner if known else None, cfg=cfg if known else None,
                    mesh=kw["mesh"] if known else None, remat=bool(kw.get("remat", False)),
                    batch_weight=owner.batch_weight, check_batch=check)


def _owner(fn: Any) -> ModelSpec | None:
    """The registered model whose ``loss`` is ``fn``, if any."""
    return next((m for m in _REGISTRY.values() if m.loss is fn), None)


# -------------------------------------------------------------------------------------------------- registry

_BUILTIN = {
    "llama": "funcpar.models.llama",
    "mistral": "funcpar.models.llama",
    "qwen2": "funcpar.models.llama",
    "baichuan": "funcpar.models.baichuan",
    "gpt2": "funcpar.models.gpt2",
    "bloom": "funcpar.models.bloom",
    "glm": "funcpar.models.glm",
    "chatglm": "funcpar.models.chatglm",
    "mixtral": "funcpar.models.mixtral",
}
_REGISTRY: dict[str, ModelSpec] = {}


def register_model(spec: ModelSpec, *, replace: bool = False) -> ModelSpec:
    """Make ``spec`` known under each of its ``model_types`` (and its ``name``); returns it.

    Registering a different model under a taken name raises unless ``replace=True``.
    """
    if not isinstance(spec, ModelSpec):
        raise ModelError(f"register_model takes a funcpar.ModelSpec, got {type(spec).__name__}")
    for key in dict.fromkeys((*spec.model_types, spec.name)):
        old = _REGISTRY.get(key)
        if old is not None and old is not spec and not replace and old.name != spec.name:
            raise ModelError(f"model_type '{key}' is already registered to model '{old.name}' (pass replace=True)")
        _REGISTRY[key] = spec
    return spec


def known_models() -> dict[str, ModelSpec]:
    """``{model_type: ModelSpec}`` for every registered model, the built-in ones included."""
    for module in dict.fromkeys(_BUILTIN.values()):
        importlib.import_module(module)
    return {k: v for k, v in _REGISTRY.items() if k in v.model_types}


def get_model(model: "ModelSpec | types.ModuleType | str", *, generic: bool = False) -> ModelSpec:
    """The :class:`ModelSpec` for a spec, a model module (its ``MODEL``) or a registered name / ``model_type``.

    A ``model_type`` no model registers, which the installed transformers defines as a causal LM, gets the generic
    model (``funcpar.models.transformers_auto``: transformers' own module run as a pure function of its parameters,
    split by its config's tp plan). ``generic=True`` gives it for a registered type too (for comparison)."""
    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, types.ModuleType):
        spec = getattr(model, "MODEL", None)
        if not isinstance(spec, ModelSpec):
            raise ModelError(f"module {model.__name__} defines no MODEL = funcpar.ModelSpec(...)")
        return spec
    if isinstance(model, str):
        if generic:
            return generic_module().spec_for(model)
        if model not in _REGISTRY and model in _BUILTIN:
            importlib.import_module(_BUILTIN[model])
        if model in _REGISTRY:
            return _REGISTRY[model]
        if generic_types(model):
            return generic_module().spec_for(model)
        names = ", ".join(sorted(known_models()))
        raise ModelError(f"no model is registered for '{model}', and the installed transformers defines no causal LM "
                         f"of that type; funcpar knows: {names} and transformers' causal LMs (see "
                         f"funcpar.register_model)")
    raise ModelError(f"expected a ModelSpec, a model module or a model_type name, got {type(model).__name__}")


_GENERIC = "funcpar.models.transformers_auto"


def generic_module() -> types.ModuleType:
    """The generic transformers model's module (imported on first use, as the built-in models are)."""
    return importlib.import_module(_GENERIC)


def generic_types(model_type: str | None = None):
    """The causal-LM ``model_type``s the installed transformers defines (the generic model's), or whether
    ``model_type`` is one; empty without transformers."""
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as names
    except ImportError:
        names = {}
    return model_type in names if model_type is not None else sorted(names)
