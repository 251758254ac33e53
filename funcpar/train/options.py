"""What ``compile_step``'s options build before any step runs: their validation, the model behind a ``zero=3``
loss, and the pipeline executor of a ``pp`` mesh; and the policy for a step that is not finite (``nonfinite``,
``max_skips``). Private to :mod:`funcpar.train.step`."""

from __future__ import annotations

import math
import warnings
from typing import Any, Callable

import torch

from funcpar.parallel.mesh import Mesh
from funcpar.model import Loss
from funcpar.nn.remat import grad_and_value
from funcpar.optim import GradientTransformation, chain, clip_by_global_norm
from funcpar.optim.loss_scale import apply_if_finite
from funcpar.pipeline.executor import Executor, StagePlan
from funcpar.pipeline.schedule import PipelineError, make_schedule
from funcpar.state import StepError
from funcpar.train.config import Guards, Pipelining, Precision


_STAGED = ("build the loss with model.loss_fn(cfg, mesh) of a model that has `stages` (llama, gpt2 do), or, for a "
           "model of your own, fp.Loss(stages=fp.Stages(embed, block, head, ...), init=init, cfg=cfg, mesh=mesh) "
           "(examples/custom_pipeline.py)")


def check_zero3(loss: Loss, zero: int) -> None:
    """Refuse ``zero=3`` for a loss without a staged form, or without the mesh it runs on (it gathers the model
    block by block through it)."""
    if zero != 3:
        return
    if loss.stages is None or loss.mesh is None:
        what = "its staged form" if loss.stages is None else "its staged form on the loss's mesh (it has none)"
        raise StepError(f"zero=3 gathers the model block by block through {what}: {_STAGED}")


def pipeline_executor(loss: Loss, mesh: Mesh, zero, accum_steps, has_aux, compile, pipelining: Pipelining):
    """The executor of this rank's pipeline stage when ``mesh`` has ``pp > 1`` (else ``None``)."""
    pp = mesh.axis_size("pp")
    if pp == 1:
        return None
    if loss.stages is None:
        raise StepError(f"{mesh!r}: pipeline stages cut the model through its staged form: {_STAGED}")
    if loss.init is None:
        raise StepError(f"{mesh!r}: pipeline stages cut the model by its parameters' shapes: give the loss "
                        f"init= (init(cfg, device='meta') -> the parameter tree on meta): {_STAGED}")
    for bad, what in ((has_aux, "has_aux"), (compile, "compile=True")):
        if bad:
            raise StepError(f"{mesh!r}: pipeline stages do not support {what} yet")
    remat, name, chunks = loss.remat, pipelining.schedule, pipelining.chunks
    if zero == 3 and name == "zb":
        raise StepError(f"{mesh!r}: pipeline='zb' splits each backward into the input's gradient and the weights', "
                        "but zero=3 recomputes each block to gather its weights again and forms both in one pass: "
                        "use pipeline='1f1b' or 'interleaved' with zero=3, or zero=1/2 with 'zb'")
    if remat and name == "zb":
        raise StepError(f"{mesh!r}: pipeline='zb' splits each backward into the input's gradient and the weights', "
                        "but remat recomputes a block and forms both in one pass: use remat=False with 'zb', or "
                        "pipeline='1f1b' / 'interleaved' with remat")
    try:
        chunks = chunks if chunks is not None else (2 if name == "interleaved" else 1)
        sched = make_schedule(name, pp, accum_steps, chunks)
        plan = StagePlan(loss.stages, loss.shapes(), loss.cfg, mesh, sched.validate(), pipelining.parts,
                         name=loss.name)
    except PipelineError as e:
        raise StepError(f"{mesh!r}, accum_steps={accum_steps} micro-batches: {e}") from None
    return Executor(plan, remat_blocks=remat)


def wrapped_optimizer(optimizer: GradientTransformation, clip_norm: float | None, precision: Precision) \
        -> GradientTransformation:
    """``optimizer`` as the step runs it: after clipping by the global norm (``clip_norm``), and under loss scaling
    skipping the update where the gradients overflow (``precision.scaling``: ``"dynamic"`` adapts the scale)."""
    opt = chain(clip_by_global_norm(clip_norm), optimizer) if clip_norm else optimizer
    scaling = precision.scaling
    if scaling is not None:
        dynamic = scaling == "dynamic"
        opt = apply_if_finite(opt, 2.0**16 if dynamic else float(scaling), dynamic, precision.growth_interval)
    return opt


def check_data_axes(mesh: Mesh, data_axes: tuple[str, ...]) -> None:
    """Refuse a ``data_axes`` name that is not a data axis of ``mesh`` (the other checks need no mesh:
    :mod:`funcpar.train.config`)."""
    for a in data_axes:
        if a not in mesh.axis_names or a == "pp":
            raise StepError(f"data_axes names '{a}', which is not a data axis of {mesh!r}")
    if "cp" in mesh.axis_names and mesh.axis_size("cp") > 1 and "cp" not in data_axes:
        raise StepError(f"{mesh!r}: each cp rank holds a chunk of every sequence, so its loss and gradients are "
                        f"partial and summed over cp as over a data axis: pass data_axes={(*data_axes, 'cp')!r}")


class NonfinitePolicy:
    """What a step does when its loss or gradient norm is not finite, decided alike on every rank (the values are
    global): it updates nothing, and by default (``nonfinite="error"``) raises, the state before it kept as the
    error's ``.state``; ``"skip"`` skips it, and so does loss scaling (``scaled``) when it overflows, up to
    ``max_skips`` in a row. ``skips`` counts the steps skipped in a row (:meth:`updated` resets it)."""

    def __init__(self, guards: Guards, scaled: bool):
        self.mode, self.max_skips, self.scaled, self.skips = guards.nonfinite, guards.max_skips, scaled, 0

    def updated(self) -> None:
        """A step updated the weights: the skips in a row start again from 0."""
        self.skips = 0

    def check(self, step: int, lr, loss: float, norm: float, finite: bool, kept: Callable[[], Any],
              scale: Callable[[], float]):
        """Step ``step`` (0-based), about to update with learning rate ``lr``, its global ``loss`` and gradient
        ``norm``, ``finite`` False where the gradients overflow: ``(state, metrics)`` of a skipped step, or ``None``
        to go on; raises where training must stop. ``kept()``: the state before the step; ``scale()``: the loss
        scale (for the message)."""
        if not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr >= 0):  # before the update touches anything
            e = StepError(f"step {step + 1}: the learning rate schedule gives {lr!r}, not a finite number >= 0; "
                          f"nothing was updated")
            e.state = kept()
            raise e
        bad = "loss" if not math.isfinite(loss) else "gradient norm" if not math.isfinite(norm) else None
        if bad is None and finite:
            return None
        self.skips += 1
        state = kept()
        what = f"the {bad} is {loss if bad == 'loss' else norm}" if bad else "the gradients overflow"
        if not self.scaled and self.mode == "error" or self.skips > self.max_skips:
            why = (f"{self.skips} steps in a row skipped (max_skips={self.max_skips}"
                   + (f", loss scale now {scale():g})" if self.scaled else ")")
                   if self.skips > 1 or self.mode == "skip" else "nonfinite='error'")
            e = StepError(f"step {step + 1}: {what}; nothing was updated and training stops ({why}): lower "
                          f"the learning rate, check the data and the weights, or resume from the last checkpoint")
            e.state = state
            raise e
        if self.scaled:
            return None  # the loss-scaling wrapper skips the update and adapts the scale
        return state, {"loss": loss, "step": step, "grad_norm": norm, "lr": float("nan"), "tokens": 0,
                       "tokens_per_s": 0.0, "skipped": True}


def resolve_compile(compile, mesh: Mesh, zero, offload, loss: Loss, data_axes=("dp",)) -> tuple:
    """``compile_step``'s ``compile`` as the step uses it, and why: ``True`` or ``False`` as given; ``"auto"`` (the
    default) stays ``"auto"`` (compile, falling back to the eager gradient on a compiler failure) where it was
    measured to pay and nothing is given up: a CUDA mesh whose only axes of size > 1 split the batch (its collectives
    run outside the compiled gradient), without pipeline stages, ZeRO-3, offload or remat (one GPU:
    benchmarks/GPU.md). Elsewhere eager: on host tensors it did not pay (docs/MEASUREMENTS.md); on a tp axis the
    compiled gradient, differentiated through ``torch.func``, gives up ``column_parallel``'s all-reduce beside the
    weight gradients, unmeasured on GPUs."""
    if compile is True or compile is False:
        return compile, f"compile={compile}"
    if compile != "auto":
        raise StepError(f"compile must be True, False or 'auto', got {compile!r}")
    model_axes = [a for a in mesh.axis_names if a != "pp" and a not in data_axes and mesh.axis_size(a) > 1]
    off = [(mesh.device.type != "cuda", f"{mesh.device.type} tensors: measured not to pay on the host"),
           (mesh.axis_size("pp") > 1, "pipeline stages"), (zero == 3, "zero=3"), (offload is not None, "offload"),
           (bool(model_axes), f"a model axis ({', '.join(model_axes)})"),
           (loss.remat, "remat")]
    why = next((w for bad, w in off if bad), None)
    return (False, f"auto: eager ({why})") if why else ("auto", "auto: compiled (a CUDA mesh)")


class Gradient:
    """The per-micro-batch gradient of ``objective`` a step runs, ``grad(params, batch, scale) -> (grads, (loss,
    aux))``: the eager one (:func:`funcpar.nn.remat.grad_and_value`: each activation freed once the backward used
    it) when ``compile`` is False; else ``torch.func.grad_and_value(objective)`` through ``torch.compile`` (one graph
    for forward and backward; collectives stay custom Functions). Under ``"auto"`` the compiled gradient is built
    with ``fullgraph=True`` at its first call (a graph break is a compiler failure, found while tracing, before any
    of the call's work or collectives run), and a compiler failure (no C++ compiler, a lowering error, the recompile
    limit, an unsupported construct: :func:`funcpar.nn.pointwise.compile_error`) warns once, sets :attr:`compiled`
    to False and :attr:`reason` to what failed, and the eager gradient runs that call and every later one. Any
    other error is raised."""

    def __init__(self, compile, whole: Callable | None, eager: Callable, reason: str = ""):
        """``whole``: the gradient to compile (``None`` where ``compile`` is False); ``eager``: the one to run
        otherwise."""
        self.compiled, self.reason, self.eager = compile, reason, eager  # what runs now, and why
        self._compiled = (None if not compile else torch.compile(whole, fullgraph=True) if compile == "auto"
                          else torch.compile(whole))

    @classmethod
    def of(cls, compile, objective: Callable) -> "Gradient":
        """The gradient of ``objective(params, batch, scale) -> (loss, (value, aux))``."""
        whole = torch.func.grad_and_value(objective, has_aux=True) if compile else None
        return cls(compile, whole, grad_and_value(objective))

    def __call__(self, *args):
        if self.compiled is False:
            return self.eager(*args)
        if self.compiled is True:
            return self._compiled(*args)
        from funcpar.nn.pointwise import compile_error, compile_error_text

        try:
            return self._compiled(*args)
        except Exception as e:
            cause = compile_error(e)
            if cause is None:
                raise
            what = compile_error_text(cause)
            self.compiled, self.reason = False, f"auto: eager after a compiler failure ({what})"
            warnings.warn(f"compile_step(compile='auto'): torch.compile of the gradient failed ({what}); running "
                          "the eager gradient from now on (compile=False skips the attempt)", stacklevel=3)
            return self.eager(*args)
