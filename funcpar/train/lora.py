"""LoRA: low-rank adapters as a pytree of their own, the base weights frozen outside the train state.

    lora = fp.lora.Lora(model, cfg, fp.lora.LoraConfig.parse("r=16,alpha=32,targets=q,v"), mesh)
    adapters = lora.init(seed=0)                                   # this rank's shards of every A and B
    step = fp.compile_step(lora.loss_fn(model.loss_fn(cfg, mesh), params), lora.specs(), mesh=mesh, zero=1)
    state = step.init(adapters)                                    # optimizer state for the adapters only
    ...
    fp.hf.save(out, lora.merge(params, state.params), model, cfg, mesh)   # W + (alpha/r)·B·A, for transformers
    lora.save_peft(out_adapter, state.params)                              # adapter_config.json + safetensors

A targeted weight ``W`` (out, in) gets ``A`` (r, in) and ``B`` (out, r): the layer computes ``x Wᵀ + s·(x Aᵀ) Bᵀ``
with ``s = alpha / r``, never forming ``B·A`` nor a gradient for ``W``. The base parameters are not part of what
``compile_step`` differentiates: the step's state is the adapters' tree, so ``torch.func.grad`` runs over them
alone, and no gradient buffer, ZeRO part or optimizer moment exists for a base weight. (Freezing through an
optimizer mask would still compute every base gradient and hold its buffers; leaving the base out of the state
costs nothing.)

Sharding follows the base weight: for ``W`` with spec ``P(o, i)``, ``A`` is ``P(None, i)`` and ``B`` is ``P(o, None)``.
A factor replicated over an axis its weight is split over (``A`` over a column-parallel weight's ``o``, ``B`` over
a row-parallel weight's ``i``) enters through ``copy_to_region`` on that axis, whose backward sums the partial
gradients the ranks of the axis hold, so every rank's adapter gradient is whole.

Targets name Hugging Face modules: ``q`` or ``q_proj`` matches every ``*.q_proj.weight`` of the model's HF table;
a name with a regex character is matched against the pytree path instead (``layers\\.0\\.wq``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
from pathlib import Path
from typing import Any, Callable

import optree
import torch
import torch.nn.functional as F

from funcpar.parallel import collectives as C
from funcpar.io.atomic import write_folder
from funcpar.io.hf import name_plan
from funcpar.parallel.mesh import Mesh
from funcpar.parallel.layout import ZeroLayout
from funcpar.model import Loss, get_model
from funcpar.nn.documents import documents_of
from funcpar.nn.remat import remat
from funcpar.parallel.sharding import gathered_leaves
from funcpar.spec import P, block_index, broadcast_specs, local_slice
from funcpar.train.zero3 import Zero3Loss, gather_params, units_of

__all__ = ["LoraConfig", "Lora", "LoraError", "LoraWeight", "ShardedBase"]


_REGEX = re.compile(r"[\\^$*+?\[\](){}|]")  # a target with any of these is a path regex, else a module name


class LoraError(ValueError):
    """A LoRA configuration that cannot apply to the model (names the target or the key)."""


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """``r`` (rank), ``alpha`` (the update is scaled by ``alpha / r``), ``targets`` (HF module names or path
    regexes), ``dropout`` (on the adapters' input, in training)."""

    r: int = 8
    alpha: float = 16.0
    targets: tuple[str, ...] = ("q", "v")
    dropout: float = 0.0

    def __post_init__(self):
        if not isinstance(self.r, int) or isinstance(self.r, bool) or self.r < 1:
            raise LoraError(f"LoRA r={self.r!r}: the rank must be an integer >= 1")
        if not (isinstance(self.alpha, (int, float)) and math.isfinite(self.alpha) and self.alpha > 0):
            raise LoraError(f"LoRA alpha={self.alpha!r}: must be a positive number")
        if not 0.0 <= self.dropout < 1.0:
            raise LoraError(f"LoRA dropout={self.dropout!r}: must be in [0, 1)")
        if not self.targets or not all(isinstance(t, str) and t for t in self.targets):
            raise LoraError(f"LoRA targets={self.targets!r}: name at least one module (q, v, q_proj, ...)")
        for t in self.targets:  # (a regex that does not compile: said here, not as re's traceback at the match)
            if _REGEX.search(t):
                try:
                    re.compile(t)
                except re.error as e:
                    raise LoraError(f"LoRA target {t!r} is not a valid regular expression ({e}): name a module "
                                    f"(q, v, q_proj, ...) or give a path regex such as 'layers\\.\\d+\\.wq'") from None

    @property
    def scale(self) -> float:
        return self.alpha / self.r

    @classmethod
    def parse(cls, text: str) -> "LoraConfig":
        """``"r=16,alpha=32,targets=q,v,dropout=0.05"``: a bare word continues the previous key's list."""
        fields: dict[str, Any] = {}
        key = None
        for item in (t.strip() for t in text.split(",")):
            if "=" in item:
                key, _, value = item.partition("=")
                key = key.strip()
                if key not in ("r", "alpha", "targets", "dropout"):
                    raise LoraError(f"--lora {text!r}: unknown key '{key}' (r, alpha, targets, dropout)")
                if key in fields:  # (the last one would silently win)
                    how = "list the modules after one targets=, e.g. targets=q,v" if key == "targets" else (
                        "give it once")
                    raise LoraError(f"--lora {text!r}: '{key}' is given twice: {how}")
                fields[key] = [value.strip()] if key == "targets" else value.strip()
            elif key == "targets" and item:
                fields["targets"].append(item)
            elif item:
                raise LoraError(f"--lora {text!r}: '{item}' is not key=value (r=16,alpha=32,targets=q,v)")
        try:
            return cls(r=int(fields.get("r", cls.r)), alpha=float(fields.get("alpha", cls.alpha)),
                       targets=tuple(fields.get("targets", cls.targets)),
                       dropout=float(fields.get("dropout", cls.dropout)))
        except ValueError as e:
            raise LoraError(f"--lora {text!r}: {e}") from None


class LoraWeight:
    """A frozen weight with its adapters, standing where the weight stands in the model's parameter tree.
    ``F.linear(x, w)`` computes ``x Wᵀ + s·(drop(x) Aᵀ) Bᵀ``; any other torch function sees the merged weight
    ``W + s·B·A``. ``shape``, ``dtype`` and ``device`` are the base weight's."""

    def __init__(self, base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float, dropout=None):
        self.base, self.a, self.b, self.scale, self.dropout = base, a, b, scale, dropout

    shape = property(lambda self: self.base.shape)
    dtype = property(lambda self: self.base.dtype)
    device = property(lambda self: self.base.device)
    ndim = property(lambda self: self.base.ndim)

    def size(self, dim=None):
        return self.base.size() if dim is None else self.base.size(dim)

    def merged(self) -> torch.Tensor:
        return self.base + (self.b @ self.a) * self.scale

    def __getitem__(self, index):  # e.g. the kv heads a rank picks from a replicated weight
        return self.merged()[index]

    def __getattr__(self, name: str):  # any other tensor method or attribute: the merged weight's
        if name in ("base", "a", "b", "scale", "dropout"):
            raise AttributeError(name)
        return getattr(self.merged(), name)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and len(args) >= 2 and isinstance(args[1], LoraWeight) and torch.is_tensor(args[0]):
            x, w = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            y = F.linear(x, w.base, bias)
            xd = w.dropout(x) if w.dropout is not None else x
            return y + F.linear(F.linear(xd, w.a), w.b) * w.scale
        args, kwargs = optree.tree_map(lambda v: v.merged() if isinstance(v, LoraWeight) else v, (args, kwargs),
                                       is_leaf=lambda v: isinstance(v, LoraWeight))
        return func(*args, **kwargs)


def _module_of(hf_name: str) -> str:
    """``model.layers.3.self_attn.q_proj.weight`` -> ``q_proj``."""
    parts = hf_name.split(".")
    return parts[-2] if len(parts) >= 2 and parts[-1] == "weight" else ""


def _matches(target: str, path: str, module: str) -> bool:
    if _REGEX.search(target):
        return re.fullmatch(target, path) is not None
    return module in (target, target + "_proj")


class Lora:
    """The adapters of a model: which weights (``targets``), their specs, init, the frozen-base loss, merging and
    the PEFT folder.

    Each targeted weight ``W`` (out, in) gets ``A`` (r, in) and ``B`` (out, r), sharded as ``W`` is (see
    :mod:`funcpar.train.lora`). The targets are resolved here, once, against the model's Hugging Face names: a target
    matching no weight is refused with the model's modules listed.

    Args:
        model: a :class:`funcpar.ModelSpec`, a model module or a registered name; its Hugging Face names table
            says which leaf is which module.
        cfg: the model's config (as :func:`funcpar.io.hf.load` returns it); padded here for ``mesh``'s tp.
        config: the :class:`LoraConfig`: rank ``r``, ``alpha``, ``targets`` and ``dropout``.
        mesh: the mesh the model's parameters are sharded over; default ``Mesh()``, a one-process mesh, not the mesh
            in scope.
        specs: the base parameters' specs; default ``model.specs(cfg, mesh)``. The adapters' follow them
            (:meth:`specs`).

    Raises:
        LoraError: a target that matches no weight of the model, or matches a leaf that is not a 2-D weight.
        ModelError: ``model`` is not a model spec, a model module or a registered name.
    """

    def __init__(self, model: Any, cfg: Any, config: LoraConfig, mesh: Mesh | None = None, specs: Any = None):
        self.model, self.config, self.mesh = get_model(model), config, mesh or Mesh()
        self.cfg = cfg.with_mesh(self.mesh)
        meta = self.model.init(self.cfg, device="meta")
        self.base_specs = self.model.specs(self.cfg, self.mesh) if specs is None else specs
        entries = broadcast_specs(self.base_specs, meta)
        paths = [p for p, _, _ in entries]
        hf_names = {p: m for p, m in zip(paths, name_plan(self.model, paths, self.cfg), strict=True)}
        self.targets: dict[str, tuple[P, tuple[int, int], Any]] = {}
        for target in config.targets:
            hit = [(p, s, x) for p, s, x in entries if _matches(target, p, _module_of(hf_names[p].hf))]
            if not hit:
                mods = sorted({_module_of(hf_names[p].hf) for p, _, x in entries if x.ndim == 2} - {""})
                kind = getattr(self.cfg, "model_type", None) or self.model.name  # (qwen2, not its spec 'llama')
                raise LoraError(f"LoRA target '{target}' matches no weight of model '{kind}'; its "
                                f"modules are: {', '.join(mods)}")
            for p, s, x in hit:
                if x.ndim != 2:
                    raise LoraError(f"LoRA target '{target}' matches leaf '{p}' of shape {tuple(x.shape)}, not a "
                                    f"2-D weight")
                self.targets[p] = (s, tuple(x.shape), hf_names[p])
        self._step = 0

    # ------------------------------------------------------------------------------------------- the tree
    def _tree(self, fn: Callable[[str, P, tuple[int, int]], Any]) -> Any:
        """The adapters' tree: nested dicts along each targeted leaf's path (``layers.3.wq`` ->
        ``{"layers": {"3": {"wq": fn(...)}}}``), so its leaves' paths are ``layers.3.wq.lora_A`` and ``...lora_B``."""
        tree: dict = {}
        for p, (s, shape, _) in self.targets.items():
            node = tree
            *head, last = p.split(".")
            for k in head:
                node = node.setdefault(k, {})
            node[last] = fn(p, s, shape)
        return tree

    def _by_path(self, adapters: Any) -> dict[str, dict]:
        """``{leaf path: {"lora_A": A, "lora_B": B}}`` from an adapters' tree (or a part of one: a block's)."""
        out = {}
        for p in self.targets:
            node = adapters
            for k in p.split("."):
                node = node.get(k) if isinstance(node, dict) else None
            if node is not None:
                out[p] = node
        return out

    def _over(self, params: Any, adapters: Any, fn: Callable) -> Any:
        """``params`` with ``fn(path, weight, {"lora_A", "lora_B"})`` at the targeted leaves."""
        by = self._by_path(adapters)

        def at(path, w):
            p = ".".join(str(k) for k in path)
            return fn(p, w, by[p]) if p in by and w is not None else w  # (None: a leaf this tree leaves out)
        return optree.tree_map_with_path(at, params, none_is_leaf=True)

    def specs(self) -> Any:
        """The adapters' specs: ``{"lora_A": P(None, i), "lora_B": P(o, None)}`` at each targeted ``P(o, i)``."""
        return self._tree(lambda p, s, shape: self.specs_of(p))

    def init(self, seed: int = 0, dtype: torch.dtype = torch.float32, device=None) -> Any:
        """This rank's shards: ``A`` uniform in ±1/sqrt(in) (PEFT's default, Kaiming-uniform with a=sqrt(5)), drawn
        whole from ``seed`` and the leaf's index, so every mesh gets the same adapters; ``B`` zeros. On ``device``,
        by default the mesh's (where ``fp.hf.load`` puts the base weights: ``cuda:$LOCAL_RANK`` on a GPU)."""
        order = {p: k for k, p in enumerate(self.targets)}
        device = self.mesh.device if device is None else device
        r = self.config.r

        def one(p, s, shape):
            g = torch.Generator().manual_seed(seed * 100003 + order[p])
            a = (torch.rand(r, shape[1], generator=g, dtype=torch.float64) * 2 - 1) / math.sqrt(shape[1])
            spec = self.specs_of(p)
            a = a.to(dtype)[local_slice(spec["lora_A"], (r, shape[1]), self.mesh, path=p + ".lora_A")]
            b_shape = [shape[0], r]
            b_local = torch.zeros(*b_shape, dtype=dtype)[local_slice(spec["lora_B"], b_shape, self.mesh)]
            return {"lora_A": a.contiguous().to(device), "lora_B": b_local.contiguous().to(device)}
        return self._tree(one)

    def trainable(self) -> int:
        """How many numbers the adapters hold, over every rank (``r x (in + out)`` per targeted weight)."""
        return sum(self.config.r * (shape[0] + shape[1]) for _, shape, _ in self.targets.values())

    def specs_of(self, path: str) -> dict[str, P]:
        """The specs of the adapters of the targeted leaf at ``path``."""
        s = self.targets[path][0]
        return {"lora_A": P(None, _one(s.axes_of(1))), "lora_B": P(_one(s.axes_of(0)), None)}

    # ------------------------------------------------------------------------------------------- compute
    def apply(self, params: Any, adapters: Any, training: bool = True, merged: bool = False) -> Any:
        """``params`` with every targeted weight a :class:`LoraWeight` (for the model's forward and loss), or with
        ``merged`` the tensor ``W + s·B·A`` (differentiable in ``A`` and ``B``: what a model under ``remat`` needs,
        whose recomputed blocks take tensors only)."""
        drop = self._dropout() if training and self.config.dropout > 0 else None

        def one(p, w, ad):
            s = self.targets[p][0]
            a, b = ad["lora_A"], ad["lora_B"]
            for ax in s.axes_of(0):  # A is whole over the axes W's rows are split over: its gradient sums them
                a = C.copy_to_region(a, self.mesh, ax)
            for ax in s.axes_of(1):
                b = C.copy_to_region(b, self.mesh, ax)
            lw = LoraWeight(w, a, b, self.config.scale,
                            None if drop is None else _Dropout(drop, self.config.dropout, s, self.mesh))
            return lw.merged() if merged else lw
        return self._over(params, adapters, one)

    def _dropout(self) -> torch.Generator:
        """One generator per call of the loss: the same masks on every rank of a model-parallel group (seeded by
        the coordinates along the axes no weight is split over), new ones at every call."""
        self._step += 1
        model_axes = {a for s, _, _ in self.targets.values() for a in s.axes}
        data = [self.mesh.coord(a) for a in self.mesh.axis_names if a not in model_axes]
        return torch.Generator().manual_seed(self._step * 1000003 + sum(c * 7919 ** k for k, c in enumerate(data)))

    def merge(self, params: Any, adapters: Any) -> Any:
        """Plain tensors ``W + s·B·A`` (this rank's shards, the product in float64) at the targeted leaves: for
        ``fp.hf.save``. The adapters must be sharded as :meth:`specs` says on this mesh."""
        def one(p, w, ad):
            a, b = ad["lora_A"], ad["lora_B"]
            if (b.shape[0], a.shape[1]) != tuple(w.shape):
                raise LoraError(f"merge: leaf '{p}' is {tuple(w.shape)} here but its adapters make "
                                f"{(b.shape[0], a.shape[1])}: shard them as lora.specs() says on this mesh")
            with torch.no_grad():
                return (w.double() + (b.double() @ a.double()) * self.config.scale).to(w.dtype)
        return self._over(params, adapters, one)

    def loss_fn(self, loss_fn: Callable, params: Any, *, shard_base: bool = False,
                data_axes: tuple[str, ...] = ("dp",)) -> Loss:
        """The :class:`funcpar.Loss` ``loss(adapters, batch)`` for ``compile_step``: ``loss_fn`` on the frozen
        ``params`` (this rank's shards, never differentiated) with the adapters applied, carrying the base loss's
        remat, batch weight and batch check (not its model: its staged form trains the base weights, not adapters).

        ``shard_base``: the base as ZeRO-3 holds parameters, each rank keeping 1/(size of ``data_axes``) of every
        block (:class:`ShardedBase`), gathered block by block as the loss runs and again for the backward; it
        needs a base loss with a staged model (``model.loss_fn(cfg, mesh)`` of llama, gpt2, ...) and no dropout.
        The adapters, small, train at whatever ZeRO stage the step has (``zero=2`` shards their state too).
        Without it every rank of a data group holds the base whole, by reference."""
        base = Loss.of(loss_fn)
        if self.config.dropout > 0 and (base.remat or shard_base):
            raise LoraError(f"LoRA dropout={self.config.dropout} with {'remat' if base.remat else 'shard_base'}: "
                            f"the recomputed forward would draw other masks than the first; train with dropout=0")
        if shard_base:
            fn = ShardedBase(self, base, params, data_axes)
            return Loss(fn=fn, remat=True, batch_weight=base.batch_weight, check_batch=base.check_batch)
        fn = _LoraLoss(self, base.fn, optree.tree_map(lambda t: t.detach(), params), merged=base.remat)
        return Loss(fn=fn, remat=base.remat, batch_weight=base.batch_weight, check_batch=base.check_batch)

    # ---------------------------------------------------------------------------------------------- PEFT
    def save_peft(self, path, adapters: Any, base_model: str | None = None, overwrite: bool = False) -> None:
        """A PEFT adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``) that
        ``peft.PeftModel.from_pretrained(base, path)`` loads; collective (rank 0 writes)."""
        from safetensors.torch import save_file

        for p, (_, _, mp) in self.targets.items():
            if mp.split or mp.transposed or not mp.hf.endswith(".weight"):
                raise LoraError(f"save_peft: leaf '{p}' is stored as part of '{mp.hf}' (fused or transposed) in "
                                f"the model's checkpoint; PEFT cannot hold its adapter: export merged weights "
                                f"(lora.merge) instead")
        tensors = {}
        for p, _, g in gathered_leaves(adapters, self.specs(), self.mesh, dst=0):
            leaf, _, which = p.rpartition(".")
            if g is not None:
                module = self.targets[leaf][2].hf.removesuffix(".weight")
                tensors[f"base_model.model.{module}.{which}.weight"] = g.detach().cpu().contiguous()
        config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": self.config.r,
                  "lora_alpha": self.config.alpha, "lora_dropout": self.config.dropout, "bias": "none",
                  "target_modules": sorted({_module_of(m.hf) for _, _, m in self.targets.values()}),
                  "fan_in_fan_out": False, "inference_mode": True, "base_model_name_or_path": base_model,
                  "modules_to_save": None, "init_lora_weights": True}

        def write(tmp: Path) -> None:
            if self.mesh.rank == 0:
                save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
                (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

        write_folder(path, self.mesh, write, error=LoraError, overwrite=overwrite, kind="adapter")


def _one(axes: tuple[str, ...]):
    """A spec entry from a dimension's axes: ``None``, one name or a tuple of names."""
    return None if not axes else axes[0] if len(axes) == 1 else tuple(axes)


class _Dropout:
    """Dropout on an adapter's input, the mask drawn whole and cut like the input (row-parallel: its columns)."""

    def __init__(self, gen: torch.Generator, p: float, spec: P, mesh: Mesh):
        self.gen, self.p, self.spec, self.mesh = gen, p, spec, mesh

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        axes = self.spec.axes_of(1)
        n = math.prod(self.mesh.axis_size(a) for a in axes)
        whole = (*x.shape[:-1], x.shape[-1] * n)
        keep = torch.rand(whole, generator=self.gen, dtype=torch.float32) >= self.p
        if n > 1:
            k = block_index(self.spec, 1, self.mesh)
            keep = keep[..., k * x.shape[-1] : (k + 1) * x.shape[-1]]
        return x * keep.to(device=x.device, dtype=x.dtype) / (1 - self.p)


class ShardedBase:
    """The adapters' loss with the frozen base held as ZeRO-3 holds parameters: per unit of the model's staged form
    (embedding, each block, head) this rank's 1/dp part, gathered without autograd as the loss reaches the unit;
    each block runs under remat with its adapters merged into the gathered weights, so its backward gathers the block
    again instead of keeping it (:mod:`funcpar.train.zero3`)."""

    def __init__(self, lora: Lora, base: Loss, params: Any, data_axes: tuple[str, ...]):
        if base.stages is None:
            raise LoraError("shard_base gathers the base block by block through the model's staged form: give the "
                            "loss of model.loss_fn(cfg, mesh) of a model that has `stages` (llama, gpt2 do)")
        self.lora, self.stages, self.cfg, self.mesh = lora, base.stages, base.cfg, base.mesh
        paths = [p for p, _, _ in broadcast_specs(lora.base_specs, params)]
        units, self.n_blocks = units_of(paths, self.stages, self.cfg)
        self.layout = ZeroLayout.build(params, lora.base_specs, self.mesh, zero=3, data_axes=data_axes,
                                       bucket_bytes=0, units=units)
        self.parts = self.layout.param_slices(self.layout.treedef.flatten_up_to(params))  # the caller's may go
        self.units = Zero3Loss(self.layout, self.stages, self.cfg, self.mesh, data_axes, self.n_blocks)

    def gather_base(self) -> Any:
        """The base whole (this rank's local shards), gathered from the parts: collective; for export
        (``lora.merge(base.gather_base(), adapters)``)."""
        return gather_params(self.layout, self.parts)

    def _tree(self, adapters: Any, ks: list[int]) -> Any:
        tree = self.units.tree({k: self.units.gather(k, self.parts[k]) for k in ks})
        return self.lora.apply(tree, adapters, merged=True)

    def __call__(self, adapters: Any, batch: Any) -> torch.Tensor:
        st, cfg = self.stages, self.cfg
        mesh = documents_of(self.mesh, batch)  # (packed samples: each attends to itself)
        x = st.embed(self._tree(adapters, [0]), batch, cfg, mesh)
        layers = adapters.get(st.layers, {}) if isinstance(adapters, dict) else {}
        for i in range(self.n_blocks):
            x = remat(functools.partial(self._block, i, mesh))(layers.get(str(i), {}), x)
        head = ([0] if self.units.tied else []) + ([len(self.parts) - 1] if len(self.parts) > self.n_blocks + 1
                                                   else [])
        return st.head(self._tree(adapters, head), x, batch, cfg, mesh)

    def _block(self, i: int, mesh, layer_adapters: Any, x: torch.Tensor) -> torch.Tensor:
        tree = self._tree({self.stages.layers: {str(i): layer_adapters}}, [i + 1])
        return self.stages.block(tree[self.stages.layers][i], x, i, self.cfg, mesh)


class _LoraLoss:
    """The loss of the adapters, the base frozen; dropout only where gradients are formed (an evaluation under
    ``torch.no_grad``, :meth:`funcpar.Step.held_out`, sees the model without it and draws no masks)."""

    def __init__(self, lora: Lora, fn: Callable, base: Any, merged: bool):
        self.lora, self.fn, self.base, self.merged = lora, fn, base, merged

    def __call__(self, adapters, batch):
        training = torch.is_grad_enabled()
        return self.fn(self.lora.apply(self.base, adapters, training=training, merged=self.merged), batch)
