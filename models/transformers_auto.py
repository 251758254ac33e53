"""Any causal LM transformers defines, trained as transformers writes it: its own module run as a pure function of
its parameters, split over tp by the tensor-parallel plan its config carries (``config.base_model_tp_plan``).

What it is
    For a config whose ``model_type`` no built-in model registers, :func:`spec_for` builds a :class:`funcpar.ModelSpec`
    from the transformers class itself (``AutoModelForCausalLM``), built once per config on the meta device:

    - the parameter tree is the module's named parameters under four top-level groups, ``embed_tokens`` (the input
      embedding), ``embed`` (other parameters used before the layers), ``layers`` (one dict per decoder layer, keyed
      by the name inside the layer) and ``head`` (the final norm, the LM head, whatever comes after the layers).
      Inside a group the keys are transformers' names, so import and export are the identity (``HFNames`` with
      ``{*}`` patterns): each rank reads only its slices, every Hub layout and sharded index as it is;
    - the specs come from the tp plan (:data:`STYLES`): a style this path does not run yet is refused by name, with
      the model type, before any rank starts (:func:`check_mesh`);
    - the loss is ``torch.func.functional_call`` of the base model with funcpar's differentiable collectives at the
      plan's boundaries (each planned module's ``forward`` replaced once, as transformers' own tensor parallelism
      does, reading the mesh of the call in progress), then the LM head and the cross-entropy through funcpar's
      vocab-parallel fused head loss on the module's last hidden states (the logits never gathered), with the
      head's scalings transformers applies (Cohere's ``logit_scale``, Granite's ``logits_scaling``, Inkling's
      ``logits_mup_width_multiplier``, Gemma's ``final_logit_softcapping``); an LM head with a forward of its own
      (Dory's per-token logit scale) runs as the plain head its forward on the identity gives.

    The input embedding and the LM head are always vocab-parallel over tp (exact whatever the plan says of them:
    each id's row is on one rank). The staged form (pipelines, ZeRO-3, remat) runs the base model's forward with
    every decoder layer's ``forward`` routed: the embedding stage stops at the first layer's input, a block runs
    only its layer on the carried state, the head injects the state after the last layer; the base model's own
    code between the layers (rotary tables, masks per layer type, scalings) runs unchanged.

Why
    The plans are data transformers keeps for 116 causal-LM types; running the module itself keeps every model's
    numerics exactly its own (soft-capping, sliding windows, parallel residuals, multipliers), with nothing written
    again per model.

What it refuses, by name and before step 1
    A tp plan style not in :data:`STYLES`; a size tp does not divide; dropout (funcpar's steps are deterministic); an
    LM head with a bias; sequence and context parallelism and packed documents; a model whose staged form the config
    does not describe (no ``base_model_pp_plan``, or no list of decoder layers where it says: HRM's stacks run in
    cycles, which runs whole) at ``zero=3`` or on pipeline stages. :func:`probe` holds the path
    to transformers' own loss and gradients on a small copy of the config before a run starts (``funcpar train``
    runs it), so a model whose forward does something this path does not know is refused rather than trained wrong.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import dataclasses
import functools
import json
import re
from typing import Any

import torch
import torch.nn.functional as F

import funcpar as fp
from funcpar import collectives as C
from funcpar import decoder as D
from funcpar import layers as L

__all__ = ["spec_for", "Config", "STYLES", "check_mesh", "tree_of", "named_of", "small_config", "probe",
           "GenericError"]


class GenericError(fp.ModelError):
    """A model the generic path cannot run exactly, named with its model type and the reason."""


# tp plan styles this path runs, on a module (its forward replaced) or on a parameter inside a module that runs them
COLUMN = {"colwise", "colwise_gather_output", "colwise_rep", "packed_colwise"}  # output rows split
ROW = {"rowwise", "rowwise_split_input", "rowwise_rep"}  # input columns split, the outputs summed
STYLES = COLUMN | ROW | {
    "replicated_with_grad_allreduce",  # leaves replicated, each rank's gradient partial: summed over tp
    "replicate",
    "embedding_rowwise", "embedding_colwise",  # the input embedding: vocab-parallel here in any case
    "moe_tp_experts",  # every expert split over tp (its weights by their own entries), the outputs summed
    "mla_kv_a_proj",  # latent attention's rotary key, used on this rank's heads: its gradient summed
    "local_params",  # a module whose bare parameters are split by their own entries (functional_call gives it them)
    "all_reduce",  # a module whose output is partial: summed over tp
    "packed_rowwise",  # a fused gate|up stack stored transposed: each half split along its last dim (the outputs)
    "moe_identity_expert",  # an identity expert inside a tp-split expert layer: counted on one rank of the sum
}
# module styles whose bare parameters may carry entries of their own (split inside the module, which runs on them)
LOCAL = {"moe_tp_experts", "local_params", "all_reduce"}
_WHY = {
    "sequence_parallel": "sequence-parallel norms",
}


# ------------------------------------------------------------------------------------------------ the config


@dataclasses.dataclass(frozen=True, eq=False)
class Config:
    """A transformers config as funcpar reads it: the ``config.json`` dict (``hf``) and, built from it once,
    transformers' config object (``hf_config``); any other attribute (``vocab_size``, ``tie_word_embeddings``,
    ``hidden_size``, ...) is the config object's."""

    hf: dict
    generic: bool = True  # (the generic path: what `funcpar train` says it takes)

    @classmethod
    def from_hf(cls, d: dict) -> "Config":
        return cls(hf=dict(d))

    def to_hf(self) -> dict:
        return dict(self.hf)

    def with_mesh(self, mesh) -> "Config":
        return self

    @functools.cached_property
    def hf_config(self):
        from transformers import CONFIG_MAPPING

        mt = self.hf.get("model_type")
        if mt not in CONFIG_MAPPING:
            raise GenericError(f"model_type '{mt}': the installed transformers defines no such model")
        try:
            return CONFIG_MAPPING[mt].from_dict({k: v for k, v in self.hf.items() if k != "model_type"})
        except Exception as e:  # noqa: BLE001 - (an AttributeError here would read as a missing attribute)
            raise GenericError(f"model_type '{mt}': transformers' {CONFIG_MAPPING[mt].__name__} does not take this "
                               f"config.json ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''})"
                               ) from None

    @property
    def model_type(self) -> str:
        return self.hf["model_type"]

    @property
    def rows(self) -> int:
        return self.vocab_size

    @property
    def key(self) -> str:
        return json.dumps(self.hf, sort_keys=True, default=str)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name in ("hf", "hf_config"):
            raise AttributeError(name)
        cfg = self.hf_config
        text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        return getattr(text, name)


# ------------------------------------------------------------------------------------------------ the module


class _Stop(Exception):
    """Raised by a routed decoder layer to end the base model's forward there, carrying the state."""

    def __init__(self, x):
        super().__init__()
        self.x = x


@dataclasses.dataclass
class _Call:
    """The call in progress: its mesh, a memo of inputs already routed through ``copy_to_region`` (q, k and v share
    one: their gradients are summed locally, then all-reduced once, as the built-in models' fused column does), and
    how the decoder layers are routed (``None``: all run)."""

    mesh: Any
    copies: dict = dataclasses.field(default_factory=dict)
    weights: dict = dataclasses.field(default_factory=dict)  # module name -> a weight that is not a tensor (LoRA's)
    route: tuple | None = None  # ("embed",) | ("block", i, carry) | ("head", carry)

    def copy(self, x):
        if self.mesh.axis_size("tp") == 1:
            return x
        hit = self.copies.get(id(x))
        if hit is None or hit[0] is not x:
            hit = self.copies[id(x)] = (x, C.copy_to_region(x, self.mesh, "tp"))
        return hit[1]


def _weight(module):
    """The weight a Linear computes with: the module's, or what stands for it in the call (a LoRA weight, whose
    ``F.linear`` adds its adapters' product)."""
    hit = _call().weights.get(getattr(module, "funcpar_name", None))
    return module.weight if hit is None else hit


_CALL: contextvars.ContextVar[_Call] = contextvars.ContextVar("funcpar_generic_call")


def _call() -> _Call:
    try:
        return _CALL.get()
    except LookupError:
        raise GenericError("a generic model's module was called outside funcpar's loss (use the ModelSpec's loss, "
                           "forward or stages)") from None


def _linear_only(module, name: str, style: str, mt: str) -> None:
    if not isinstance(module, torch.nn.Linear) or type(module).forward is not torch.nn.Linear.forward:
        raise GenericError(f"model_type '{mt}': tp plan style '{style}' on '{name}', a {type(module).__name__}: "
                           f"the generic path splits plain nn.Linear modules only")


def _install_colwise(module, gather: bool) -> None:
    def forward(x):
        call = _call()
        y = F.linear(call.copy(x), _weight(module), module.bias)
        return C.gather_from_region(y, call.mesh, "tp", -1) if gather else y
    module.forward = forward


def _install_linear(module) -> None:
    def forward(x):
        return F.linear(x, _weight(module), module.bias)
    module.forward = forward


def _install_rowwise(module, split: bool) -> None:
    def forward(x):
        mesh = _call().mesh
        if split:
            x = C.scatter_to_region(x, mesh, "tp", -1)
        y = C.reduce_from_region(F.linear(x, _weight(module)), mesh, "tp")
        return y if module.bias is None else y + module.bias
    module.forward = forward


def _install_embedding(module) -> None:
    """The input embedding, vocab-parallel: each rank looks up the ids it holds with the module's own forward (its
    scaling, a norm of its own, its padding row shifted to this rank's rows), zeros elsewhere, summed over tp."""
    own = module.forward

    def forward(ids):
        mesh = _call().mesh
        if mesh.axis_size("tp") == 1:
            return own(ids)
        n = module.weight.shape[0]
        off = mesh.coord("tp") * n
        local = ids - off
        inside = (local >= 0) & (local < n)
        pad = module.padding_idx
        module.padding_idx = pad - off if pad is not None and 0 <= pad - off < n else None
        try:
            rows = own(local.clamp(0, n - 1))
        finally:
            module.padding_idx = pad
        rows = torch.where(inside[..., None], rows, torch.zeros((), dtype=rows.dtype, device=rows.device))
        return C.reduce_from_region(rows, mesh, "tp")
    module.forward = forward


def _install_layer(layer, i: int) -> None:
    """Route decoder layer ``i`` by the call's ``route`` (see :class:`_Call`)."""
    own = layer.forward

    def forward(*args, **kwargs):
        route = _call().route
        if route is None:
            return own(*args, **kwargs)
        h = args[0] if args else kwargs["hidden_states"]
        kind = route[0]
        if kind == "embed":
            raise _Stop(h)
        if kind == "head":
            return route[1] if i == route[2] else h
        if i != route[1]:
            return h
        if args:
            args = (route[2], *args[1:])
        else:
            kwargs = {**kwargs, "hidden_states": route[2]}
        raise _Stop(own(*args, **kwargs))
    layer.forward = forward


def _plan_regex(key: str) -> re.Pattern:
    return re.compile("^" + re.escape(key).replace(r"\*", r"\d+") + "$")


@dataclasses.dataclass
class Built:
    """The transformers module of one config, on meta, with its plan resolved and its forwards installed."""

    cfg: Config
    module: Any
    base: Any
    prefix: str  # the base model's name in the root, with its dot ("model.")
    layers: str  # the decoder layers' ModuleList inside the base ("layers")
    n_layers: int
    embed_module: str  # root names
    head_module: str | None
    tied: bool
    groups: dict  # root param name -> (group, key) with group in embed_tokens/embed/layers/head
    styles: dict  # root param name -> (style, "weight" | "bias" | "param"): how its spec splits it
    grad_allreduce: set  # root param names whose gradients are summed over tp
    planned: set  # root module names the tp plan names
    packed: dict  # root param name of fused halves (gate and up) -> whether along its last dim: two leaves (":0",
    # ":1" along the rows; ":0r", ":1r" along the last dim), each split over tp
    staged: bool  # the config has a pp plan and the base model the list of layers it names: the staged form is known
    refusals: list  # (style, module) pairs the plan uses that this path does not run
    head_forward: bool  # the LM head has a forward of its own (Dory's per-token logit scale): see _head_affine

    def root_params(self, params, mesh) -> dict:
        """The tree as ``{root name: tensor}`` for functional_call of the base model (names relative to it)."""
        out = {}
        for group in ("embed_tokens", "embed", "head"):
            for k, v in (params.get(group) or {}).items():
                if v is not None:
                    out[k] = v
        for i, lp in enumerate(params.get("layers") or []):
            if lp is None:
                continue
            for k, v in lp.items():
                if v is not None:
                    out[f"{self.prefix}{self.layers}.{i}.{k}"] = v
        # functional_call takes tensors: a LoRA weight stands in the call for its Linear (its base in the module), a
        # ZeRO-3 embedding left in its parts (funcpar.train.zero3.ZeroRows) is gathered for the module's own lookup
        weights = {}
        for k, v in list(out.items()):
            if isinstance(v, torch.Tensor):
                continue
            if hasattr(v, "base") and k.endswith(".weight"):
                weights[k[: -len(".weight")]], out[k] = v, v.base
            else:
                out[k] = v.whole()
        _call().weights.update(weights)
        out = join_packed(out)
        tp = mesh.axis_size("tp") > 1
        return {k[len(self.prefix):]: (C.copy_to_region(v, mesh, "tp") if tp and k in self.grad_allreduce else v)
                for k, v in out.items() if k.startswith(self.prefix)}

    @contextlib.contextmanager
    def running(self, mesh, route=None):
        token = _CALL.set(_Call(mesh, route=route))
        try:
            yield
        finally:
            _CALL.reset(token)

    def base_forward(self, params, mesh, route=None, **inputs):
        """The base model's forward on ``params`` (what it holds of them); with a route, the state a layer stops
        with, else the last hidden states."""
        with self.running(mesh, route):
            try:
                out = torch.func.functional_call(self.base, self.root_params(params, mesh), (),
                                                 {**inputs, "use_cache": False}, strict=False)
            except _Stop as stop:
                return stop.x
        return out[0] if isinstance(out, tuple) else out.last_hidden_state


_BUILT: dict[str, Built] = {}


def built(cfg: Config) -> Built:
    """The module of ``cfg``, built once (on meta) and kept."""
    b = _BUILT.get(cfg.key)
    if b is None:
        b = _BUILT[cfg.key] = _build(cfg)
    return b


class _EmptyOnMeta(torch.overrides.TorchFunctionMode):
    """``torch.empty`` without a device allocates on meta: the storage ``nn.Linear``/``nn.Embedding`` create for
    their weights is never allocated on the host. Why: a host tensor of the weight's size allocated and freed at
    build raises glibc's dynamic mmap threshold to that size, and every later tensor below it (the loaded weights,
    the optimizer state, the activations) then comes from the heap, which fragments: measured +120 MB of peak
    resident set on the benchmarks' small Llama (docs/MEASUREMENTS.md, "The generic path's memory, fragmentation
    found")."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.empty and kwargs.get("device") is None:
            kwargs = {**kwargs, "device": "meta"}
        return func(*args, **kwargs)


def _host_tensors_on_meta(module) -> bool:
    """Whether a buffer or a plain tensor attribute of ``module`` was left on meta by :class:`_EmptyOnMeta` (a
    table ``__init__`` fills in place): such a module is built again with every tensor on the host first."""
    for m in module.modules():
        own = set(m._parameters)
        for k, v in list(m._buffers.items()) + list(vars(m).items()):
            if k not in own and isinstance(v, torch.Tensor) and not isinstance(v, torch.nn.Parameter) \
                    and v.device.type == "meta":
                return True
    return False


@contextlib.contextmanager
def _parameters_on_meta(empty_on_meta: bool = True):
    """Build a module with its parameters on meta (each moved there as it is registered, uninitialised; with
    ``empty_on_meta`` those made by ``torch.empty`` never allocated on the host) and its buffers real: the rotary
    tables and masks a forward reads are computed from the config in ``__init__``."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # (transformers 4)
        from transformers.modeling_utils import no_init_weights

    own = torch.nn.Module.register_parameter

    def register(self, name, param):
        if param is not None and param.device.type != "meta":
            param = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        own(self, name, param)
    torch.nn.Module.register_parameter = register
    try:
        with no_init_weights(), (_EmptyOnMeta() if empty_on_meta else contextlib.nullcontext()):
            yield
    finally:
        torch.nn.Module.register_parameter = own


def _attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """transformers' attention interface, as funcpar computes plain causal attention (:func:`funcpar.attention.causal`:
    block-causal on the CPU, GQA without repeated keys); anything else (a mask, dropout, soft-capping, another
    scale, a position bias) is transformers' sdpa function, as before."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    attention_mask = _heads_of_rank(attention_mask, query.shape[1])
    t, d = query.shape[2], query.shape[-1]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    plain = (attention_mask is None and not dropout and causal and t > 1 and key.shape[2] == t
             and kwargs.get("softcap") is None and kwargs.get("position_bias") is None
             and query.shape[1] % key.shape[1] == 0
             and (scaling is None or abs(scaling * d ** 0.5 - 1) <= 1e-7))
    if not plain:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    return fp.attention.causal(query, key, value).transpose(1, 2), None  # (B, T, H, D), as sdpa's


def _heads_of_rank(mask, heads: int):
    """An attention mask with a slice per head of the whole model (Doge's dynamic mask, from its ``dt_proj``, a
    rowwise projection: the same on every rank) where the query holds this rank's ``heads`` of them: this rank's
    block of heads (q's colwise split gives each rank a contiguous block), its gradient summed over tp (each rank's
    covers its heads)."""
    if not isinstance(mask, torch.Tensor) or mask.ndim != 4 or mask.shape[1] in (1, heads):
        return mask
    mesh = _call().mesh
    tp = mesh.axis_size("tp")
    if tp == 1 or mask.shape[1] != heads * tp:
        return mask
    if mask.requires_grad:
        mask = C.copy_to_region(mask, mesh, "tp")
    return mask.narrow(1, mesh.coord("tp") * heads, heads)


def _source(fn) -> str | None:
    import inspect
    import textwrap

    try:
        return textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
        return None


@functools.cache
def _reference_sources() -> dict:
    """The forwards funcpar has kernels for, by their source text: transformers' Llama RMSNorm and MLP (dozens of
    models carry them copied, word for word)."""
    from transformers.models.llama import modeling_llama as ml

    return {_source(ml.LlamaRMSNorm.forward): "rms_norm", _source(ml.LlamaMLP.forward): "mlp",
            _source(ml.apply_rotary_pos_emb): "rotary", _source(ml.rotate_half): "rotate_half"}


def _rotary_pair(q, k, cos, sin, unsqueeze_dim=1):
    """transformers' Llama ``apply_rotary_pos_emb`` through :func:`funcpar.layers.rotary`: the values and gradients
    bit for bit, two ``q``-sized tensors made each way where the composition makes five."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return L.rotary(q, cos, sin), L.rotary(k, cos, sin)


def _rebound(fn, names: dict):
    """``fn`` (a module's forward, through any ``functools.wraps`` decorators that hold it in their closure) with the
    globals ``names`` replaced, or None where a decorator does not hold the function it wraps."""
    import types

    inner = getattr(fn, "__wrapped__", None)
    if inner is None:
        cells, globs = fn.__closure__, {**fn.__globals__, **names}
    else:
        new_inner = _rebound(inner, names)
        held = [c for c in fn.__closure__ or () if _cell(c) is inner]
        if new_inner is None or not held:
            return None
        cells = tuple(types.CellType(new_inner) if _cell(c) is inner else c for c in fn.__closure__)
        globs = fn.__globals__
    new = types.FunctionType(fn.__code__, globs, fn.__name__, fn.__defaults__, cells)
    new.__kwdefaults__, new.__qualname__ = fn.__kwdefaults__, fn.__qualname__
    new.__dict__.update(fn.__dict__)
    if inner is not None:
        new.__wrapped__ = new_inner
    return new


def _cell(c):
    try:
        return c.cell_contents
    except ValueError:  # (an empty cell)
        return None


def _install_rotary(module, refs: dict) -> None:
    """Where ``module``'s forward applies rotary embeddings with a word-for-word copy of transformers' Llama
    ``apply_rotary_pos_emb`` (and ``rotate_half``), its forward calls :func:`_rotary_pair` instead: the rotation's
    five transient tensors per call were the generic path's largest extra allocation on the benchmarks' Llama."""
    import inspect
    import types

    fwd = type(module).forward
    raw = inspect.unwrap(fwd)
    rope, half = raw.__globals__.get("apply_rotary_pos_emb"), raw.__globals__.get("rotate_half")
    if "apply_rotary_pos_emb" not in raw.__code__.co_names or rope is None or half is None:
        return
    if refs.get(_source(rope)) != "rotary" or refs.get(_source(half)) != "rotate_half":
        return
    new = _rebound(fwd, {"apply_rotary_pos_emb": _rotary_pair})
    if new is not None:
        module.forward = types.MethodType(new, module)


def _use_funcpar_kernels(module) -> None:
    """Where a module's forward is word for word transformers' Llama RMSNorm or SwiGLU MLP, run it through funcpar's
    Functions of the same formulas (:func:`funcpar.layers.rms_norm`: the values bit for bit, the gradients to
    round-off, one ``x``-sized tensor kept instead of two; :func:`funcpar.layers.swiglu`: bit for bit, ``silu(gate)``
    not kept): the generic path's activations then weigh what the built-in models' do."""
    refs = _reference_sources()
    for m in module.modules():
        kind = refs.get(_source(type(m).forward))
        if kind == "rms_norm":
            _install_rms_norm(m)
        elif kind == "mlp" and getattr(m.config, "hidden_act", None) == "silu":
            _install_swiglu(m)
        elif callable(getattr(type(m), "forward", None)) and hasattr(type(m).forward, "__code__"):
            _install_rotary(m, refs)


def _install_rms_norm(module) -> None:
    own = module.forward

    def forward(x):
        if x.dtype != torch.float32 or module.weight.dtype != torch.float32:
            return own(x)
        return L.rms_norm(x, module.weight, module.variance_epsilon)
    module.forward = forward


def _install_swiglu(module) -> None:
    def forward(x):
        return module.down_proj(L.swiglu(module.gate_proj(x), module.up_proj(x)))
    module.forward = forward


def _use_funcpar_attention(module) -> None:
    """Where the model attends through transformers' sdpa function, attend through :func:`_attention` (registered
    as ``"funcpar"``, its masks sdpa's); a model on eager attention (soft-capping) keeps it, and so does one whose
    code reads the implementation's name (:func:`_reads_attention_name`)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if getattr(module.config, "_attn_implementation", None) != "sdpa" or _reads_attention_name(module):
        return
    AttentionInterface.register("funcpar", _attention)
    AttentionMaskInterface.register("funcpar", sdpa_mask)
    for m in module.modules():
        c = getattr(m, "config", None)
        if c is not None and getattr(c, "_attn_implementation", None) == "sdpa":
            c._attn_implementation = "funcpar"


_NAMES_SDPA = re.compile(r"""_attn_implementation[^\n]*["']sdpa["']|["']sdpa["'][^\n]*_attn_implementation""")


def _reads_attention_name(module) -> bool:
    """Whether a module of the model comes from a file whose code compares ``_attn_implementation`` with
    ``"sdpa"``: under another name it would take another branch (DeepSeek-V3.2's sparse indexer mask is applied
    only ``if _attn_implementation in ("eager", "sdpa")``)."""
    import sys

    files = {type(m).__module__ for m in module.modules()}
    return any(_NAMES_SDPA.search(_source(sys.modules.get(f)) or "") for f in files)


def _build(cfg: Config) -> Built:
    from transformers import AutoModelForCausalLM

    mt = cfg.model_type
    hc = copy.deepcopy(cfg.hf_config)  # (its attention implementation is switched below: the module's own copy)
    module = None
    try:
        with _parameters_on_meta():
            module = AutoModelForCausalLM.from_config(hc)
    except Exception:  # (an __init__ that computes with the storage it made by torch.empty: built again below)
        pass
    if module is None or _host_tensors_on_meta(module):
        hc = copy.deepcopy(cfg.hf_config)
        with _parameters_on_meta(empty_on_meta=False):
            module = AutoModelForCausalLM.from_config(hc)
    module.tie_weights()  # (transformers ties as it initialises, which no_init_weights skips)
    _use_funcpar_attention(module)
    _use_funcpar_kernels(module)
    module.eval()  # (dropout is refused by check_mesh, so train and eval modes compute alike)
    prefix = _base_name(module)
    base = getattr(module, prefix, None)
    if base is None or base is module:
        raise GenericError(f"model_type '{mt}': its causal LM has no base model under '{prefix}'")
    pp_plan = getattr(hc, "base_model_pp_plan", None) or {}
    layers = _names(mt)[1]
    stack = getattr(base, layers, None)
    if not isinstance(stack, torch.nn.ModuleList):  # (HRM's two stacks, run in cycles): run whole, never staged
        stack, pp_plan = [], {}
    emb = module.get_input_embeddings()
    head = module.get_output_embeddings()
    names = {id(m): n for n, m in module.named_modules()}
    embed_module, head_module = names[id(emb)], names.get(id(head)) if head is not None else None
    if not isinstance(head, torch.nn.Linear):
        raise GenericError(f"model_type '{mt}': its LM head is not a linear layer")
    tied = head.weight is emb.weight
    children = [n for n, _ in base.named_children()]
    after = set(children[children.index(layers) + 1:]) if stack else set()
    groups = {}
    pre = f"{prefix}.{layers}."
    for n, _ in module.named_parameters():
        if n.startswith(pre):
            i, _, rest = n[len(pre):].partition(".")
            groups[n] = ("layers", (int(i), rest))
        elif n.startswith(embed_module + "."):
            groups[n] = ("embed_tokens", n)
        elif head_module and n.startswith(head_module + "."):
            groups[n] = ("head", n)
        elif n.startswith(prefix + ".") and n[len(prefix) + 1:].partition(".")[0] not in after:
            groups[n] = ("embed", n)
        else:
            groups[n] = ("head", n)
    b = Built(cfg, module, base, prefix + ".", layers, len(stack), embed_module, head_module, tied,
              groups, {}, set(), set(), {}, bool(pp_plan), [], type(head).forward is not torch.nn.Linear.forward)
    _install(b, hc)
    return b


def _install(b: Built, hc) -> None:
    """Resolve the tp plan over the module's names: each planned module's forward installed, each parameter's
    style recorded for its spec; what this path does not run is kept in ``refusals`` (refused where tp > 1)."""
    plan = dict(getattr(hc, "base_model_tp_plan", None) or {})
    rules = [(_plan_regex(b.prefix + k), style) for k, style in plan.items()]
    modules, params = dict(b.module.named_modules()), dict(b.module.named_parameters())
    local = {}  # module name -> its style, for those whose bare parameters may have entries (LOCAL)
    for name, m in modules.items():
        if name == b.embed_module:
            _install_embedding(m)
            # the embedding's other parameters (Inkling's norm of the rows) see this rank's ids only: summed over tp
            b.grad_allreduce.update(f"{name}.{p}" for p, _ in m.named_parameters() if p != "weight")
            continue
        style = next((s for rx, s in rules if rx.match(name)), None)
        if style is None or name == b.head_module:
            continue
        b.planned.add(name)
        _install_module(b, name, m, style, hc)
        if style in LOCAL:
            local[name] = style
        for p, _ in m.named_parameters(recurse=False):
            b.styles.setdefault(f"{name}.{p}", (style, "bias" if p == "bias" else "weight"))
    for name, m in modules.items():  # every Linear computes with what stands for its weight in the call
        m.funcpar_name = name
        if name not in b.planned and type(m) is torch.nn.Linear and name != b.head_module:
            _install_linear(m)
    split = set()
    for name in params:  # plan entries naming a parameter: an expert stack's weights, split inside its owner
        style = next((s for rx, s in rules if rx.match(name)), None)
        if style is None:
            continue
        owner, _, leaf = name.rpartition(".")
        if owner not in local or style not in COLUMN | ROW | {"packed_rowwise"}:
            b.refusals.append((style, name))
            continue
        if style == "colwise" and _fused_gate_up(modules[owner], leaf):
            style = "packed_colwise"
        b.styles[name] = (style, "param")
        split.add(owner)
        if style == "packed_colwise" or (style == "packed_rowwise" and params[name].ndim > 1):
            b.packed[name] = style == "packed_rowwise"
    for name, style in local.items():  # a summed module computing on split parameters of its own: its inputs too
        if style == "all_reduce" and name in split:
            _install_sum(modules[name], copy_inputs=True)
    for i, layer in enumerate(getattr(b.base, b.layers) if b.n_layers else []):
        _install_layer(layer, i)
    if b.head_forward:  # a head parameter not split with the vocabulary works on this rank's rows: summed over tp
        head = modules[b.head_module]
        b.grad_allreduce.update(f"{b.head_module}.{p}" for p, t in head.named_parameters()
                                if not _vocab_rows(head, t))


def _install_module(b: Built, name: str, m, style: str, hc) -> None:
    """Install ``style`` on module ``name`` (a ``local_params`` module runs as it is: its parameters' own entries
    split them, functional_call gives it the local tensors)."""
    mt = b.cfg.model_type
    if style not in STYLES or style == "packed_rowwise":  # (packed_rowwise names parameters, not modules)
        b.refusals.append((style, name))
    elif style in COLUMN:
        _linear_only(m, name, style, mt)
        _install_colwise(m, gather=style in ("colwise_gather_output", "colwise_rep"))
        if style == "packed_colwise":
            b.packed.update({f"{name}.{p}": False for p, _ in m.named_parameters(recurse=False)})
    elif style in ROW:
        _linear_only(m, name, style, mt)
        _install_rowwise(m, split=style != "rowwise")
    elif style == "replicated_with_grad_allreduce":
        b.grad_allreduce.update(f"{name}.{p}" for p, _ in m.named_parameters(recurse=False))
    elif style == "moe_tp_experts":
        _install_experts(m)
    elif style == "all_reduce":
        _install_sum(m)
    elif style == "moe_identity_expert":
        _install_identity_expert(m)
    elif style == "mla_kv_a_proj":
        text = hc.get_text_config() if hasattr(hc, "get_text_config") else hc
        _install_mla(m, text.qk_rope_head_dim)
    elif style.startswith("embedding"):
        raise GenericError(f"model_type '{mt}': tp plan style '{style}' on '{name}', which is not the input "
                           f"embedding")


def _fused_gate_up(module, leaf: str) -> bool:
    """Whether ``leaf`` of an expert layer is its gate and up stacked one after the other along the output rows
    (transformers' experts interface marks such layers ``has_gate`` and ``is_concatenated``): a plain ``colwise``
    entry on it is then split per half (Inkling's plans say ``colwise`` of a checkpoint tensor stored interleaved,
    which transformers' loader cuts before de-interleaving it: per half in memory)."""
    return (leaf == "gate_up_proj" and getattr(module, "has_gate", False) and getattr(module, "is_concatenated", False)
            and not getattr(module, "is_transposed", False))


def _install_experts(module) -> None:
    """An expert layer whose every expert is split over tp (its stacks' own plan entries): the states and the
    routing weights enter through ``copy_to_region`` (each rank's gradient of them is partial), the outputs are
    summed."""
    own = module.forward

    def forward(hidden_states, *args, **kwargs):
        call = _call()
        mesh = call.mesh
        if mesh.axis_size("tp") == 1:
            return own(hidden_states, *args, **kwargs)
        if len(args) >= 2:
            args = (args[0], C.copy_to_region(args[1], mesh, "tp"), *args[2:])
        elif "top_k_weights" in kwargs:
            kwargs = {**kwargs, "top_k_weights": C.copy_to_region(kwargs["top_k_weights"], mesh, "tp")}
        return C.reduce_from_region(own(call.copy(hidden_states), *args, **kwargs), mesh, "tp")
    module.forward = forward


def _install_sum(module, copy_inputs: bool = False) -> None:
    """A module whose output is this rank's part of a sum (``all_reduce``): summed over tp. ``copy_inputs``: the
    module computes on split parameters of its own (Inkling's shared experts), so each rank's gradient of its
    floating inputs is partial: they enter through ``copy_to_region``."""
    own = getattr(module, "funcpar_own_forward", module.forward)
    module.funcpar_own_forward = own

    def forward(*args, **kwargs):
        mesh = _call().mesh
        if copy_inputs and mesh.axis_size("tp") > 1:
            args = tuple(_copied(a) for a in args)
            kwargs = {k: _copied(v) for k, v in kwargs.items()}
        out = own(*args, **kwargs)
        return None if out is None else C.reduce_from_region(out, mesh, "tp")
    module.forward = forward


def _copied(x):
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return _call().copy(x)
    return x


def _install_identity_expert(module) -> None:
    """An identity expert inside an expert layer whose output is summed over tp (``moe_identity_expert``): its
    output counted on tp rank 0 only, zeros elsewhere, so the sum holds it once (transformers divides its input by
    tp instead; this is exact for any tp)."""
    own = module.forward

    def forward(x, *args, **kwargs):
        mesh = _call().mesh
        out = own(x, *args, **kwargs)
        return out if mesh.axis_size("tp") == 1 or mesh.coord("tp") == 0 else torch.zeros_like(out)
    module.forward = forward


def _install_mla(module, rope_dim: int) -> None:
    """Latent attention's ``kv_a_proj_with_mqa``: its rotary part goes to this rank's heads unsplit, so that part's
    gradient is partial: routed through ``copy_to_region``."""
    own = module.forward

    def forward(x):
        out = own(x)
        mesh = _call().mesh
        if mesh.axis_size("tp") == 1:
            return out
        a, r = out.split([out.shape[-1] - rope_dim, rope_dim], dim=-1)
        return torch.cat([a, C.copy_to_region(r, mesh, "tp")], dim=-1)
    module.forward = forward


_HALVES = {False: (":0", ":1"), True: (":0r", ":1r")}  # a fused pair's leaves: along the rows | the last dim


def _packed_dim(ndim: int, last: bool = False) -> int:
    if last:
        return ndim - 1  # (packed_rowwise: a transposed expert stack's output columns)
    return max(0, ndim - 2)  # a weight's rows, a bias's only dim, an expert stack's rows


def join_packed(named: dict) -> dict:
    """``{name: tensor}`` with each fused pair of halves (``name:0``, ``name:1``; ``name:0r``, ``name:1r``)
    joined back into ``name``."""
    out = {}
    for k, v in named.items():
        last = k.endswith(":0r")
        if k.endswith((":1", ":1r")):
            continue
        if k.endswith((":0", ":0r")):
            base = k[: -len(_HALVES[last][0])]
            out[base] = torch.cat([v, named[base + _HALVES[last][1]]], dim=_packed_dim(v.ndim, last))
        else:
            out[k] = v
    return out


# ------------------------------------------------------------------------------------------ tree and specs


def init(cfg: Config, seed: int = 0, dtype: torch.dtype = torch.float32, device=None):
    """The global parameter tree: transformers' own initialisation of the class (seeded), or shapes on meta."""
    b = built(cfg)
    if device is not None and torch.device(device).type == "meta":
        named = {n: torch.empty(p.shape, dtype=dtype, device="meta") for n, p in b.module.named_parameters()}
    else:
        from transformers import AutoModelForCausalLM

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            m = AutoModelForCausalLM.from_config(cfg.hf_config, dtype=dtype)
        named = {n: p.detach().to(device=device or "cpu") for n, p in m.named_parameters()}
    return _tree(b, named)


def tree_of(cfg: Config, named: dict) -> dict:
    """The parameter tree of ``named``, ``{transformers name: tensor}`` (``model.named_parameters()``'s names)."""
    return _tree(built(cfg), named)


def named_of(cfg: Config, params: dict) -> dict:
    """``{transformers name: tensor}`` of a parameter tree (the inverse of :func:`tree_of`)."""
    b, out = built(cfg), {}
    for group in ("embed_tokens", "embed", "head"):
        out.update(params.get(group) or {})
    for i, lp in enumerate(params["layers"]):
        out.update({f"{b.prefix}{b.layers}.{i}.{k}": v for k, v in lp.items()})
    return join_packed(out)


def _tree(b: Built, named: dict) -> dict:
    out: dict = {"embed_tokens": {}, "embed": {}, "layers": [{} for _ in range(b.n_layers)], "head": {}}
    for n, t in named.items():
        group, key = b.groups[n]
        parts = None
        if n in b.packed:  # a fused gate/up: its halves, each split over tp (a strided shard of the fused one)
            parts = list(zip(_HALVES[b.packed[n]], _halves(t, b.packed[n]), strict=True))
        for suffix, x in parts or [("", t)]:
            if group == "layers":
                out["layers"][key[0]][key[1] + suffix] = x
            else:
                out[group][key + suffix] = x
    return {k: v for k, v in out.items() if v or k == "layers"}


def _halves(t, last: bool = False):
    if isinstance(t, torch.Tensor):
        return t.chunk(2, dim=_packed_dim(t.ndim, last))
    return (t, t)  # (a spec: both halves alike)


def specs(cfg: Config, mesh=None):
    """The tree of ``P``: the input embedding and LM head split over the vocabulary, each planned leaf as its style
    says (column styles their output rows, row styles their input columns, a row style's bias replicated),
    everything else replicated."""
    b = built(cfg)
    return _tree(b, {n: _spec_of(b, n, p) for n, p in b.module.named_parameters()})


def _spec_of(b: Built, n: str, p) -> Any:
    """The ``P`` of parameter ``n`` (a transformers name) of shape ``p.shape``."""
    if n.startswith(b.embed_module + "."):
        return fp.P("tp", None) if p.ndim == 2 else fp.P()
    if b.head_module and n.startswith(b.head_module + "."):  # (the weight, a bias, a per-token scale: by vocab rows)
        head = b.module.get_submodule(b.head_module)
        return fp.P("tp", *[None] * (p.ndim - 1)) if _vocab_rows(head, p) else fp.P()
    style, role = b.styles.get(n, (None, None))
    dim = (_packed_dim(p.ndim) if style in COLUMN else
           p.ndim - 1 if (style in ROW and role != "bias") or (style == "packed_rowwise" and p.ndim > 1) else None)
    return fp.P(*("tp" if d == dim else None for d in range(p.ndim))) if dim is not None else fp.P()


def check_mesh(cfg: Config, mesh, staged: bool = False) -> None:
    """Refuse, in one line naming the model type, what the generic path cannot run exactly on ``mesh``
    (``staged``: the run needs the staged form: pipeline stages, ZeRO-3 or remat)."""
    b = built(cfg)
    mt, tp = cfg.model_type, mesh.axis_size("tp")
    staged = staged or mesh.axis_size("pp") > 1
    if staged and not b.n_layers:
        spec = fp.known_models().get(mt)  # (funcpar's own model of that type: what of these it runs)
        runs = [w for w, ok in (("pipeline stages", spec and spec.stages), ("ZeRO-3", spec and spec.stages),
                                ("remat", spec and spec.remat)) if ok]
        own = f" (funcpar's own {mt}, without --generic, runs {', '.join(runs)})" if runs else ""
        why = (f"no list of decoder layers '{b.layers}' in its base model"
               if getattr(cfg.hf_config, "base_model_pp_plan", None) else
               "the installed transformers gives it no pipeline plan (base_model_pp_plan), which names its list "
               "of decoder layers")
        raise GenericError(f"model_type '{mt}': {why}; pipeline stages, ZeRO-3 and remat run those layers one at a "
                           f"time: they are refused (tp and dp run the model whole){own}")
    if tp > 1 and isinstance(mesh, fp.Mesh):
        probe_mesh(cfg, mesh)
    try:  # (the forward, and the staged form where the run needs it, against transformers' own: once per config)
        probe(cfg, staged=staged)
    except GenericError as e:
        if not staged or "staged form" not in str(e):
            raise
        raise GenericError(f"{e}; pipeline stages, ZeRO-3 and remat, which run its layers one at a time, are "
                           f"refused") from None
    drop = sorted(k for k, v in cfg.hf.items() if ("dropout" in k or "jitter" in k) and isinstance(v, (int, float))
                  and v and not isinstance(v, bool))
    if drop:
        raise GenericError(f"model_type '{mt}': config key '{drop[0]}' is {cfg.hf[drop[0]]}: the generic path runs "
                           f"without random noise in the forward (dropout, router jitter); set it to 0 in "
                           f"config.json")
    if tp > 1 and b.refusals:
        style, name = b.refusals[0]
        why = _WHY.get(style, "a style transformers added after this path was written")
        raise GenericError(f"model_type '{mt}': tp plan style '{style}' ({name}): {why}; the generic path does "
                           f"not split it over tp yet (run it with tp=1)")
    if tp > 1 and not getattr(cfg.hf_config, "base_model_tp_plan", None):
        raise GenericError(f"model_type '{mt}': its config carries no tensor-parallel plan (base_model_tp_plan); "
                           f"run it with tp=1")
    for axis in ("cp", "ep", "sp"):
        if axis in mesh.axis_names and mesh.axis_size(axis) > 1:
            raise GenericError(f"model_type '{mt}': the generic path has no '{axis}' axis yet")
    if tp > 1 and any(st in COLUMN - {"colwise_gather_output", "colwise_rep"} and ("attn" in n or "attention" in n)
                      for n, (st, _) in b.styles.items()):  # (attention split by heads: whole heads per rank)
        text = cfg.hf_config.get_text_config() if hasattr(cfg.hf_config, "get_text_config") else cfg.hf_config
        for key in ("num_attention_heads", "num_key_value_heads"):
            v = getattr(text, key, None)
            if isinstance(v, int) and v % tp:
                raise GenericError(f"model_type '{mt}': config key '{key}' is {v}, which tp={tp} does not divide "
                                   f"(its tp plan splits attention by heads, whole heads to a rank)")
    if tp > 1:
        for (path, s), (_, p) in zip(fp.tree.leaves_with_path(specs(cfg)),
                                     fp.tree.leaves_with_path(init(cfg, device="meta")), strict=True):
            for d, ax in enumerate(s):
                if ax == "tp" and p.shape[d] % tp:
                    raise GenericError(f"model_type '{mt}': leaf '{path}' {list(p.shape)} does not split over "
                                       f"tp={tp} along dim {d}")


# -------------------------------------------------------------------------------------------- the loss


def _vocab_rows(head, p) -> bool:
    """Whether LM head parameter ``p`` has a row per token of the vocabulary (split with the weight's rows)."""
    return p.ndim >= 1 and p.shape[0] == head.weight.shape[0]


def _head_weight(b: Built, params):
    if b.tied:
        return params["embed_tokens"][b.embed_module + ".weight"]
    return params["head"][b.head_module + ".weight"]


def _head_bias(b: Built, params):
    """The LM head's bias (this rank's vocab block), where it has one (Phi's, GPT-J's)."""
    return (params.get("head") or {}).get(b.head_module + ".bias")


def _head_affine(b: Built, params, mesh):
    """The LM head as ``(weight, bias)`` of this rank's vocab block. A head with a forward of its own (Dory's
    per-token logit scale) is taken to be affine in the states, as the probe checks: its weight is its forward on
    the identity (less its value at 0, the bias, where it has a bias), each row exact, so the fused head loss
    runs it as a plain head."""
    weight, bias = _head_weight(b, params), _head_bias(b, params)
    if not b.head_forward:
        return weight, bias
    pre, tp = b.head_module + ".", mesh.axis_size("tp") > 1
    own = {k[len(pre):]: (C.copy_to_region(v, mesh, "tp") if tp and k in b.grad_allreduce else v)
           for k, v in (params.get("head") or {}).items() if k.startswith(pre)}
    own["weight"] = weight
    head = b.module.get_submodule(b.head_module)

    def run(x):
        return torch.func.functional_call(head, own, (x,), strict=False)
    eye = torch.eye(weight.shape[1], dtype=weight.dtype, device=weight.device)
    if bias is None:
        return run(eye).t().to(weight.dtype), None
    at0 = run(torch.zeros_like(eye[:1]))
    return (run(eye) - at0).t().to(weight.dtype), at0[0].to(weight.dtype)


def _scaled(x, cfg: Config):
    """The hidden states as the head's logits need them: Cohere's ``logit_scale`` and Granite's ``logits_scaling``
    are scalings of the logits, applied to the states (the same product); Inkling's ``logits_mup_width_multiplier``
    divides the states before its head. (Config keys the causal LMs' own forwards read, between the base model
    and the head: the loss runs the base model only.)"""
    scale = getattr(cfg.hf_config, "logit_scale", None)
    if isinstance(scale, (int, float)) and scale != 1:
        x = x * scale
    for key in ("logits_scaling", "logits_mup_width_multiplier"):
        div = getattr(cfg.hf_config, key, None)
        if isinstance(div, (int, float)) and div != 1:
            x = x / div
    return x


def _softcap(cfg: Config):
    cap = getattr(cfg.hf_config, "final_logit_softcapping", None)
    return cap if isinstance(cap, (int, float)) and cap else None


def _head(params, x, batch, cfg, mesh, reduction: str = "mean"):
    """The LM head's loss on the last hidden states: funcpar's vocab-parallel fused head (logits never held)."""
    weight, bias = _head_affine(built(cfg), params, mesh)
    return D.head_loss(_scaled(x, cfg), weight, batch, cfg, mesh, reduction, softcap=_softcap(cfg), bias=bias)


def _embed(params, batch, cfg, mesh):
    return built(cfg).base_forward(params, mesh, ("embed",), input_ids=batch["input_ids"])


def _block(lp, x, i, cfg, mesh):
    b = built(cfg)
    return b.base_forward({"layers": [None] * i + [lp]}, mesh, ("block", i, x), inputs_embeds=torch.zeros_like(x))


def _stage_head(params, x, batch, cfg, mesh, reduction: str = "mean"):
    b = built(cfg)
    h = b.base_forward(params, mesh, ("head", x, b.n_layers - 1), inputs_embeds=torch.zeros_like(x))
    return _head(params, h, batch, cfg, mesh, reduction)


STAGES = fp.Stages(_embed, _block, _stage_head, embed_leaves=lambda cfg: ["embed_tokens", "embed"],
                   head_leaves=lambda cfg: ["head"] + (["embed_tokens"] if built(cfg).tied else []))


def loss(params, batch, cfg, mesh, reduction: str = "mean", remat: bool = False):
    """transformers' ``labels=`` loss of the model: its base model's forward in one call (with ``remat``: the
    staged form, each layer recomputed in the backward pass), then :func:`_head`."""
    if remat:
        return STAGES.loss(params, batch, cfg, mesh, reduction, remat=True)
    h = built(cfg).base_forward(params, mesh, input_ids=batch["input_ids"])
    return _head(params, h, batch, cfg, mesh, reduction)


def forward(params, tokens, cfg, mesh):
    """This rank's vocab block of the logits, (B, T, V/tp), with the head's scalings and soft-capping."""
    b = built(cfg)
    h = _scaled(b.base_forward(params, mesh, input_ids=tokens), cfg)
    logits = F.linear(C.copy_to_region(h, mesh, "tp"), *_head_affine(b, params, mesh))
    cap = _softcap(cfg)
    return logits if cap is None else torch.tanh(logits / cap) * cap


# ---------------------------------------------------------------------------------------------- the probe

# the sizes a small copy of a config gets, where its type has the key (names as transformers spells them)
SMALL = dict(
    vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=64, sliding_window=8, window_size=8,
    num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
    shared_expert_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=32,
    kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, n_group=1, topk_group=1,
    pad_token_id=0, bos_token_id=1, eos_token_id=2, use_cache=False, decoder_sparse_step=1,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    num_nextn_predict_layers=0, num_shared_experts=1, attention_chunk_size=8, router_aux_loss_coef=0.0,
    rotary_dim=8, index_n_heads=4, index_head_dim=16, index_topk=8, qk_head_dim=16, num_experts_per_token=2,
    linear_head_dim=16, linear_num_heads=4, swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=16,
    sliding_window_size=8, unpadded_vocab_size=128, ffn_hidden_size=96, expert_ffn_hidden_size=32, zero_expert_num=2,
    keep_window_size=8, mamba_n_heads=4, mamba_d_head=32, mamba_expand=2, mamba_d_state=16, mamba_n_groups=1,
    mamba_chunk_size=16, vocab_size_per_layer_input=128, hidden_size_per_layer_input=16,
    # (mamba_d_ssm: mamba_n_heads x mamba_d_head, as Falcon-H1's validator checks)
    mamba_d_ssm=128, num_dense_layers=1, hc_lowrank=32, intermediate_size_mlp=96,
    # a sparse-attention indexer whose type's default leaves it unset (None) though its layers build one (Qwen4-Exp)
    indexer_n_heads=4, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8, indexer_compress_ratio=4,
)

# what a type's default config lacks but its modeling reads (its checkpoints carry it): filled in where unset, for
# the few types no general rule can derive it for
MISSING = {
    # no rope at all (its default has no rope_theta), read per layer kind
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
    # layer_types None, indexed by every layer: LFM2's convolution layers between attention ones
    "lfm2_moe": {"layer_types": lambda full: ["conv", "full_attention"] * (full["num_hidden_layers"] // 2)
                 + ["conv"] * (full["num_hidden_layers"] % 2)},
    # DbrxAttention reads attn_config.rope_theta (stored, unused), a field DbrxAttentionConfig does not have, and
    # clamps by clip_qkv, which fails at its default None (DBRX's checkpoints clip at 8)
    "dbrx.attn_config": {"rope_theta": 10000.0, "clip_qkv": 8.0},
}


def small_config(hf: dict) -> dict:
    """A small copy of a ``config.json`` dict: its flags kept, its sizes those of :data:`SMALL` where its type has
    the keys, per-layer lists cut to the layer count, dropout off; its sub-configs (a multimodal model's
    ``text_config``, ...) shrunk alike, so that the causal LM inside is small too."""
    from transformers import CONFIG_MAPPING

    mt = hf["model_type"]
    cls = CONFIG_MAPPING[mt]
    d = _shrunk(cls, {k: v for k, v in hf.items() if k != "architectures"}, mt)
    out = cls.from_dict({k: v for k, v in d.items() if k != "model_type"}).to_dict()  # (as a config.json is read)
    out["model_type"] = mt
    return out


def _shrunk(cls, hf: dict, name: str) -> dict:
    """The small form of ``hf`` (a dict of config class ``cls``, ``name`` its type or ``type.sub_config_key``) as
    the dict :func:`small_config` builds it from, sub-configs included."""
    from transformers import CONFIG_MAPPING, PreTrainedConfig

    full = {**cls().to_dict(), **hf}
    for k, v in MISSING.get(name, {}).items():
        if not full.get(k):
            full[k] = v(full) if callable(v) else v
    amap = getattr(cls, "attribute_map", {}) or {}
    keys = set(full) | set(amap)
    over = {k: v for k, v in SMALL.items() if k in keys}
    if full.get("num_key_value_heads") == full.get("num_attention_heads") and "num_key_value_heads" in over:
        over["num_key_value_heads"] = over["num_attention_heads"]  # (a type without GQA stays without)
    if "qk_rope_head_dim" in keys and (full.get("head_dim") in (None, full.get("qk_rope_head_dim"))
                                       or not full.get("qk_nope_head_dim")):
        over["head_dim"] = over["qk_rope_head_dim"]  # (latent attention whose head_dim is the rotary part's; a
        # head_dim of another size stays SMALL's, the two parts' sum: Dots3's sliding layers check that)
    if {"n_input_layers", "n_recurrent_layers", "n_output_layers"} <= keys:  # (a looped model: one of each; Dory
        over.update(n_input_layers=2, n_recurrent_layers=2, n_output_layers=2, num_hidden_layers=6)  # writes 2x)
    over.update(_per_layer(full, over.get("num_hidden_layers", 2), over))
    over.update({k: 0.0 for k, v in full.items() if ("dropout" in k or "jitter" in k) and isinstance(v, float)})
    # (an alias as the name to_dict writes: where both were given, the field's value would win over the alias's)
    over = {**{k: v for k, v in over.items() if k not in amap}, **{amap[k]: v for k, v in over.items() if k in amap}}
    for key, sub_cls in cls.sub_configs.items():  # (a sub-config left None stays None: the type's default)
        if isinstance(full.get(key), dict):
            if not (isinstance(sub_cls, type) and issubclass(sub_cls, PreTrainedConfig)):  # (AutoConfig)
                sub_cls = CONFIG_MAPPING[full[key]["model_type"]]
            over[key] = _shrunk(sub_cls, full[key], f"{name}.{key}")
    return {**full, **over}


_PROBED: dict[tuple, str] = {}  # (config, staged) -> "" (it reproduces transformers) or why not


def _per_layer(full: dict, n: int, over: dict) -> dict:
    """The per-layer keys of a config cut to ``n`` layers: lists as long as its layer count, at the first layers
    that show each distinct combination of their values (a hybrid keeps a layer of each kind), per-layer head counts
    and sizes (a list per layer of a :data:`SMALL` key) the small ones; lists of layer indices (``moe_layers``) those
    of the layers kept (being in one is a kind too), ``per_layer_config`` their overrides (sizes as ``over`` has
    them). Where the last layers reuse earlier ones' caches (``num_kv_shared_layers``), one of those is kept too."""
    layers = full.get("num_hidden_layers")
    if not isinstance(layers, int):
        return {}
    index = {k: v for k, v in full.items() if k.endswith(("layers", "layer_ids")) and isinstance(v, list) and v
             and all(type(i) is int for i in v) and v == sorted(set(v)) and v[-1] < layers}  # (MoE layers, ...)
    lists = {k: v for k, v in full.items() if isinstance(v, list) and v and len(v) == layers
             and k not in index and k != "architectures"}
    kinds = {**lists, **{k: [i in v for i in range(layers)] for k, v in index.items()}}  # (in a list: a kind)
    shared = full.get("num_kv_shared_layers")
    if isinstance(shared, int) and 0 < shared < layers:  # (every kind kept unshared, then one sharing layer)
        picked = _picks(kinds, range(layers - shared), n) + _picks(kinds, range(layers - shared, layers), 1)
        out = {"num_hidden_layers": n + 1, "num_kv_shared_layers": 1}
    else:
        picked, out = _picks(kinds, range(layers), n), {}
    out.update({k: [j for j, i in enumerate(picked) if i in v] for k, v in index.items()})
    size = {k: SMALL["num_attention_heads"] if "heads" in k else SMALL.get(k) for k in lists}
    out.update({k: [size[k] if size[k] and isinstance(v[i], int) else v[i] for i in picked] for k, v in lists.items()})
    plc = full.get("per_layer_config")
    if isinstance(plc, dict) and plc:
        plc = {int(k): v for k, v in plc.items()}
        out["per_layer_config"] = {j: {k: over.get(k, v) for k, v in plc[i].items()}
                                   for j, i in enumerate(picked) if i in plc}
    return out


def _picks(lists: dict, among: range, n: int) -> list[int]:
    """``n`` of the layers ``among``, in order: each attention kind's first, then each combination of the lists'
    values first seen, then the first layers."""
    picked, seen = [], set()
    kinds = lists.get("layer_types") or []
    for i in among if lists else ():
        if kinds and kinds[i] not in {kinds[j] for j in picked}:
            picked.append(i)
    for i in among if lists else ():
        combo = tuple(str(v[i]) for v in lists.values())
        if combo not in seen and i not in picked:
            seen.add(combo)
            picked.append(i)
    return sorted((picked + [i for i in among if i not in picked])[:n])


def probe(cfg: Config, seed: int = 0, staged: bool = False) -> None:
    """Hold the generic path to transformers' own forward on a small copy of ``cfg`` (:func:`small_config`): the
    loss and every gradient, in one process and through the staged form; a model whose causal LM does something
    this path does not know (a loss term, a head of its own) is refused here, naming what differed, rather than
    trained wrong. Cheap: two layers of 64 wide; once per config. ``staged``: the staged form too, even where the
    config carries no pipeline plan."""
    key = (cfg.key, staged)
    if key not in _PROBED:
        _PROBED[key] = _probe(cfg, seed, staged)
    if _PROBED[key]:
        raise GenericError(_PROBED[key])


_REFERENCES: dict[tuple, tuple] = {}  # (config, seed) -> _reference's result: the probes and frozen share one run


def _reference(cfg: Config, seed: int):
    """transformers' own run of the small copy of ``cfg``: the copy, its parameters, a batch, the loss, the
    gradients by name. Run once per config and seed (the one-process probe, the mesh probe and :func:`frozen` each
    read it)."""
    key = (cfg.key, seed)
    if key not in _REFERENCES:
        _REFERENCES[key] = _reference_run(cfg, seed)
    return _REFERENCES[key]


def _reference_run(cfg: Config, seed: int):
    from transformers import AutoModelForCausalLM

    small = Config.from_hf(small_config(cfg.hf))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        m = AutoModelForCausalLM.from_config(small.hf_config, dtype=torch.float32)
        ids = torch.randint(0, SMALL["vocab_size"], (2, 16))
    m.train()
    ref = m(input_ids=ids, labels=ids).loss
    ref.backward()
    return small, m, {"input_ids": ids}, ref, {n: p.grad for n, p in m.named_parameters()}


def probe_mesh(cfg: Config, mesh, seed: int = 0) -> None:
    """:func:`probe` on ``mesh``'s tp groups (collective: every rank calls it): the small copy's loss and gradients
    split as the tp plan splits them, gathered, against transformers' own in one process. What only a split shows
    (a module that counts all heads on its shard, a norm over a split dimension the plan does not name) is refused
    here, before step 1. Once per config and mesh."""
    key = (cfg.key, "mesh", id(mesh))
    if key not in _PROBED:
        _PROBED[key] = _probe_mesh(cfg, mesh, seed)
    if _PROBED[key]:
        raise GenericError(_PROBED[key])


def _probe_mesh(cfg: Config, mesh, seed: int) -> str:
    small, m, batch, ref, want = _reference(cfg, seed)
    tp = mesh.axis_size("tp")
    for attempt in range(2):
        got = _split_gradients(small, m, batch, mesh)
        if isinstance(got, str):
            return (f"model_type '{cfg.model_type}': the generic path fails on a small copy of the config split over "
                    f"tp={tp} ({got})")
        value, grads = got
        bad = _differs(value, ref, {n: _Grad(g) for n, g in grads.items()}, want)
        if not bad:
            return ""
        partial = _partial_leaves(small, grads, want, mesh) if attempt == 0 else []
        if not partial:
            break
        _sum_gradients(built(small), partial)
        _sum_gradients(built(cfg), partial)
    return (f"model_type '{cfg.model_type}': split over tp={tp} the generic path does not reproduce transformers' "
            f"own on a small copy of the config ({bad}), so it is not run")


def _split_gradients(small: Config, m, batch, mesh):
    """The small copy's loss and gradients on ``mesh`` (split as the plan says), gathered, by name; or the error."""
    import optree

    sp = specs(small, mesh)
    whole = tree_of(small, {n: p.detach().clone() for n, p in m.named_parameters()})
    local = fp.tree.map_with_path(lambda _, x: x.requires_grad_(), fp.shard(whole, sp, mesh))
    leaves = [x for _, x in fp.tree.leaves_with_path(local)]
    try:
        value = loss(local, batch, small, mesh)
        grads = torch.autograd.grad(value, leaves, allow_unused=True)
    except Exception as e:  # noqa: BLE001 - what the path cannot run is refused, with the error
        return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    tree = optree.tree_unflatten(optree.tree_structure(local), [torch.zeros_like(x) if g is None else g
                                                               for g, x in zip(grads, leaves, strict=True)])
    return value.detach(), named_of(small, fp.gather(tree, sp, mesh))


def _partial_leaves(small: Config, grads: dict, want: dict, mesh) -> list[str]:
    """The replicated leaves whose gradient is partial on each tp rank (their sum over tp is transformers' own): a
    norm or a scale the plan leaves replicated that works on this rank's heads or columns (the plan should name it
    ``replicated_with_grad_allreduce``). Collective over tp, every replicated leaf in the same order."""
    b = built(small)
    params = dict(b.module.named_parameters())
    out = []
    for n, g in grads.items():
        if "tp" in tuple(_spec_of(b, n, params[n])) or want.get(n) is None:
            continue
        total = C.all_reduce(g.clone(), mesh, "tp")
        w = want[n]
        scale = max(w.abs().max().item(), 1e-8)
        if (total - w).abs().max().item() <= 1e-4 * scale and not (g - w).abs().max().item() <= 1e-4 * scale:
            out.append(n)
    return out


def _sum_gradients(b: Built, names: list[str]) -> None:
    """Route ``names`` (a small copy's; a layer's name stands for that leaf of every layer) through
    ``copy_to_region``, so their gradients are summed over tp."""
    pre = b.prefix + b.layers + "."
    rel = {n[len(pre):].partition(".")[2] for n in names if n.startswith(pre)}
    for n, _ in b.module.named_parameters():
        if n in names or (n.startswith(pre) and n[len(pre):].partition(".")[2] in rel):
            b.grad_allreduce.add(n)


@dataclasses.dataclass
class _Grad:
    grad: Any


def _probe(cfg: Config, seed: int, staged: bool) -> str:
    small, m, batch, ref, want = _reference(cfg, seed)
    mt = cfg.model_type
    forms = [("its forward", loss)] + ([("its staged form", STAGES.loss)] if staged else [])
    for what, fn in forms:
        named = {n: p.detach().clone().requires_grad_() for n, p in m.named_parameters()}
        try:
            value = fn(tree_of(small, named), batch, small, fp.Mesh.abstract())  # (joins no job)
            value.backward()
        except Exception as e:  # noqa: BLE001 - what the path cannot run is refused, with the error
            return (f"model_type '{mt}': the generic path ({what}) fails on a small copy of the config "
                    f"({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''})")
        bad = _differs(value, ref, named, want)
        if bad:
            return (f"model_type '{mt}': the generic path ({what}) does not reproduce transformers' own on a small "
                    f"copy of the config ({bad}), so it is not run")
    return ""


def _differs(value, ref, named: dict, want: dict) -> str:
    """What differs: the loss beyond 1e-5, a gradient beyond 1e-4 of its leaf's largest element (or, for a leaf
    whose gradient is tiny, 1e-6 of the largest of any leaf: round-off in a sum over tp)."""
    if not abs(value.item() - ref.item()) <= 1e-5 * abs(ref.item()):
        return f"loss {value.item():.7g} vs {ref.item():.7g}"
    floor = 1e-6 * max((w.abs().max().item() for w in want.values() if w is not None and w.numel()), default=0.0)
    for n, p in named.items():
        g, w = p.grad, want.get(n)
        if g is None and w is None:
            continue
        g, w = (torch.zeros_like(w) if g is None else g), (torch.zeros_like(g) if w is None else w)  # (unused: 0)
        if not (g - w).abs().max().item() <= max(1e-4 * w.abs().max().item(), floor, 1e-12):
            return f"gradient of '{n}' off by {(g - w).abs().max().item():.3g}"
    return ""


def frozen(cfg: Config):
    """The leaves transformers' own forward gives no gradient (a sparse-attention indexer run under
    ``torch.no_grad``; a compressor whose output goes nowhere), as a tree of bool, or ``None``: torch's optimizers
    skip a parameter whose ``grad`` is ``None`` (no update, no weight decay), and ``compile_step`` does as they do.
    Read from the probe's small copy (:func:`_reference`): where the copy keeps every layer (as many as the config
    has), layer by layer; else a layer's parameter is frozen in every layer if it has no gradient in every layer
    of the copy that has it (a layer kind the copy left out trains as usual). Once per config."""
    names = _FROZEN.get(cfg.key)
    if names is None:
        names = _FROZEN[cfg.key] = _no_gradient(cfg)
    if not names:
        return None
    b = built(cfg)
    pre = b.prefix + b.layers + "."

    def off(n: str) -> bool:
        return n in names or (n.startswith(pre) and n[len(pre):].partition(".")[2] in names)
    return _tree(b, {n: off(n) for n, _ in b.module.named_parameters()})


_FROZEN: dict[str, frozenset] = {}


def _no_gradient(cfg: Config) -> frozenset:
    """The names (inside a layer: the name after its index) of the parameters without a gradient in transformers'
    own run of the small copy of ``cfg``."""
    small, _, _, _, want = _reference(cfg, 0)
    pre = built(small).prefix + built(small).layers + "."
    whole = built(small).n_layers == built(cfg).n_layers  # (the copy's layers are the config's, in order)
    inside: dict[str, bool] = {}
    out = set()
    for n, g in want.items():
        if n.startswith(pre) and not whole:
            rel = n[len(pre):].partition(".")[2]
            inside[rel] = inside.get(rel, True) and g is None
        elif g is None:
            out.add(n)
    return frozenset(out | {k for k, none in inside.items() if none})


# ------------------------------------------------------------------------------------------------ the spec


def _init_attributes(cls) -> set:
    """The attributes ``cls.__init__`` assigns (``self.model = ...``), read from its source."""
    return set(re.findall(r"self\.(\w+)\s*=", _source(cls.__init__) or ""))


def _base_name(module) -> str:
    """The base model's attribute in a causal LM: ``base_model_prefix``, else ``model``."""
    prefix = module.base_model_prefix
    return prefix if isinstance(getattr(module, prefix, None), torch.nn.Module) else "model"


def _names(model_type: str) -> tuple[str, str]:
    """The base model's name in the causal LM (``"model"``) and its decoder layers' (``"layers"``), from the class
    and the default config's pp plan: what the HF names of the layers start with."""
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    config_class = CONFIG_MAPPING[model_type]
    cls = MODEL_FOR_CAUSAL_LM_MAPPING[config_class]
    prefix = cls.base_model_prefix
    if prefix not in _init_attributes(cls) and "model" in _init_attributes(cls):
        prefix = "model"  # (a text model split from a multimodal one keeps the latter's prefix: Llama-4's)
    try:
        plan = getattr(config_class(), "base_model_pp_plan", None) or {}
    except Exception:  # noqa: BLE001 - a default config that does not build: fall back on the common name
        plan = {}
    layers = next((k for k, (ins, _) in plan.items() if "hidden_states" in ins and k != "norm"), "layers")
    return prefix, layers

_SPECS: dict[tuple, fp.ModelSpec] = {}


def spec_for(model_type: str) -> fp.ModelSpec:
    """The generic :class:`funcpar.ModelSpec` of ``model_type`` (one per type, kept)."""
    hit = _SPECS.get(model_type)
    if hit is not None:
        return hit
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if model_type not in CONFIG_MAPPING or model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise GenericError(f"model_type '{model_type}': the installed transformers defines no causal LM of that "
                           f"type")
    prefix, layers = _names(model_type)
    pre = prefix + "." + layers + ".{i}."
    rest = [("layers.{i}.{*}", pre + "{*}"), ("embed_tokens.{*}", "{*}"), ("embed.{*}", "{*}"), ("head.{*}", "{*}")]
    tied = [r"^lm_head\.weight$"]
    # the experts as save_pretrained and the Hub write them, one tensor per expert (transformers 5 fuses them in
    # memory): read too, never written (the fused layout is the export's, which from_pretrained loads as well)
    per_expert = fp.HFNames(table=[("layers.{i}.{*}.experts.gate_up_proj:0", pre + "{*}.experts.{j}.gate_proj.weight"),
                                   ("layers.{i}.{*}.experts.gate_up_proj:1", pre + "{*}.experts.{j}.up_proj.weight"),
                                   ("layers.{i}.{*}.experts.down_proj", pre + "{*}.experts.{j}.down_proj.weight"),
                                   *rest], ignored_if_tied=tied)
    hf = fp.HFNames(table=[("layers.{i}.{*}:0", pre + "{*}"), ("layers.{i}.{*}:1", pre + "{*}"),
                           ("layers.{i}.{*}:0r", pre + "{*}"), ("layers.{i}.{*}:1r", pre + "{*}"), *rest],
                    splits={"layers.{i}.{*}:0": (-2, 0, 2), "layers.{i}.{*}:1": (-2, 1, 2),
                            "layers.{i}.{*}:0r": (-1, 0, 2), "layers.{i}.{*}:1r": (-1, 1, 2)},
                    ignored_if_tied=tied, alternates=[per_expert])
    spec = fp.ModelSpec(name=f"{model_type} (transformers)", init=init, specs=specs, forward=forward, loss=loss,
                        Config=Config, model_types=(model_type,), hf=hf, config_types={"model_type": (str,)},
                        batch_weight=L.count_targets, check_batch=L.token_range_errors, remat=True, stages=STAGES,
                        check_run=check_mesh, frozen=frozen)
    _SPECS[model_type] = spec
    return spec
