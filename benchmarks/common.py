"""What the runner and the workers share: the model sizes, the meshes and their implementations, the data, the
optimizer's settings, and the arithmetic (FLOPs per step, analytic bytes sent per step).

No torch at import time: the runner's parsing and report code (and ``tests/test_benchmarks.py``) import this module
without starting anything.
"""

from __future__ import annotations

import math

# AdamW as torch.optim.AdamW computes it (betas 0.9/0.999, eps 1e-8, decoupled decay on every parameter), fp32,
# then clipping of the global gradient norm (over every parameter of the model, once each) at CLIP.
LR, WD, CLIP = 1e-3, 0.01, 1.0
DATA_BATCHES = 4  # distinct global batches, cycled; batch 0 is every implementation's first step

# "small" is issue 14's; "large" doubles the width, the heads and the vocabulary (about 4x the FLOPs per step)
SIZES = {
    "small": dict(hidden=512, layers=4, heads=8, kv_heads=4, vocab=4096, seq=256, global_batch=8),
    "large": dict(hidden=1024, layers=4, heads=16, kv_heads=8, vocab=8192, seq=256, global_batch=8),
    # one GPU's worth (0.87B parameters, 8192 tokens a step): too slow for the 2-core CPU, for --device cuda
    "gpu": dict(hidden=2048, layers=16, heads=16, kv_heads=8, vocab=32000, seq=2048, global_batch=4),
}
CPU_SIZES = ("small", "large")  # --size both
MFU_TARGETS = {("small", "dp2"): 0.65}  # the (#14): funcpar's MFU at dp=2 on the small Llama, fp32 on the CPU

# --precision: fp32 everywhere, or bf16 compute with fp32 master weights and optimizer state (funcpar's
# param_dtype=torch.bfloat16; the eager loop's forward under torch.autocast), for the implementations listed
PRECISIONS = ("fp32", "bf16")
BF16_IMPLS = ("funcpar", "funcpar-generic", "hf-eager")
# --compile: funcpar's compile_step(compile=...) (auto: its default)
COMPILE = {"auto": "auto", "on": True, "off": False}


def precision_short(impl: str, precision: str) -> str | None:
    """Why ``impl`` does not run at ``precision`` here (bf16 is wired for funcpar and the eager loop), or None."""
    if precision != "fp32" and impl.removesuffix("-lora") not in BF16_IMPLS:
        return f"--precision {precision} is wired for {', '.join(BF16_IMPLS[:-1])} and {BF16_IMPLS[-1]} only"
    return None

# implementation id -> what it is (the table's wording)
IMPLS = {
    "funcpar": "funcpar",
    "funcpar-generic": "funcpar, generic path (transformers' LlamaForCausalLM split by its tp plan)",
    "hf-eager": "transformers eager + torch.optim.AdamW",
    "ds-zero1": "DeepSpeed ZeRO-1",
    "ds-zero2": "DeepSpeed ZeRO-2",
    "torch-fsdp2": "torch FSDP2 (fully_shard)",
    "ds-autotp": "DeepSpeed AutoTP",
    "torch-tp": "torch TP (parallelize_module)",
    "ds-autotp-zero1": "DeepSpeed AutoTP + ZeRO-1",
    "torch-tp-fsdp2": "torch TP + FSDP2",
    "ds-pipe": "DeepSpeed PipelineModule (2 stages)",
}
# the adapters benchmarks/lora.py trains against full fine-tuning (funcpar --lora syntax)
LORA = "r=16,alpha=32,targets=q,v"
# which peers need which optional package (missing -> reported, not run)
NEEDS = {"ds-zero1": "deepspeed", "ds-zero2": "deepspeed", "ds-autotp": "deepspeed", "ds-autotp-zero1": "deepspeed",
         "ds-pipe": "deepspeed"}

# mesh name -> its axes, its local processes, threads per process, the implementations run on it (funcpar first) and
# the micro-batches a step's global batch is cut into (a pipeline's; 1 elsewhere)
MESHES = {
    "1": dict(axes={}, nproc=1, threads=2, impls=["funcpar", "funcpar-generic", "hf-eager"]),
    "dp2": dict(axes={"dp": 2}, nproc=2, threads=1, impls=["funcpar", "ds-zero1", "ds-zero2", "torch-fsdp2"]),
    "tp2": dict(axes={"tp": 2}, nproc=2, threads=1, impls=["funcpar", "ds-autotp", "torch-tp"]),
    "tp2dp2": dict(axes={"tp": 2, "dp": 2}, nproc=4, threads=1,
                   impls=["funcpar", "funcpar-generic", "ds-autotp-zero1", "torch-tp-fsdp2"]),
    "pp2": dict(axes={"pp": 2}, nproc=2, threads=1, impls=["funcpar", "ds-pipe"], micro=4,
                pipeline={"pipeline": "zb"}),
}


DEVICES = ("auto", "cpu", "cuda")  # every script's --device: auto is CUDA wherever torch sees one


def backend(device: str) -> str:
    """torch.distributed's backend for the kind of device the jobs run on: NCCL on CUDA, gloo on host tensors."""
    return "nccl" if device == "cuda" else "gloo"


def devices_short(mesh: str, device: str, gpus: int) -> str | None:
    """Why ``mesh`` cannot run on this machine's ``gpus`` CUDA devices (one per rank: NCCL refuses two ranks on one
    device), or None (always None on host tensors, where ranks share the cores)."""
    n = MESHES[mesh]["nproc"]
    if device == "cuda" and n > gpus:
        return f"needs {n} GPUs (one per rank), this machine has {gpus}"
    return None


def mesh_label(mesh: str) -> str:
    axes = MESHES[mesh]["axes"]
    return "Mesh(" + ", ".join(f"{a}={n}" for a, n in axes.items()) + ")"


def micro_batches(mesh: str) -> int:
    return MESHES[mesh].get("micro", 1)


def pipeline(mesh: str) -> dict:
    """funcpar's schedule on a pipeline mesh (``compile_step``'s ``pipeline``/``chunks``): zero-bubble 1F1B, each
    backward split into the input's gradient and the weights', the latter filling the bubble. Measured here against
    interleaved 1F1B (2 chunks a stage), steps alternating in one job (a slow day): small 2.06 against 2.30 s a step
    (paired median -5%), measured bubble 0.10 against 0.18; hidden-1024 6.97 against 7.70 (-9.5%); zero-bubble
    interleaved (2 chunks) 2.07 at small. DeepSpeed's engine has 1F1B only. The same micro-batches either way."""
    return dict(MESHES[mesh].get("pipeline", {}))


def funcpar_label(mesh: str) -> str:
    axes = MESHES[mesh]["axes"]
    sched = {"interleaved": "interleaved 1F1B ({chunks} chunks a stage)", "1f1b": "1F1B", "gpipe": "GPipe",
             "zb": "zero-bubble 1F1B"}
    how = pipeline(mesh)
    pipe = (f" {sched[how.get('pipeline', '1f1b')].format(**how)}, {micro_batches(mesh)} micro-batches"
            if axes.get("pp", 1) > 1 else "")
    return f"funcpar {mesh_label(mesh)}" + (" zero=1" if axes.get("dp", 1) > 1 else "") + pipe


def impl_label(mesh: str, impl: str) -> str:
    return funcpar_label(mesh) if impl == "funcpar" else IMPLS[impl]


def axis(mesh: str, name: str) -> int:
    return MESHES[mesh]["axes"].get(name, 1)


def hf_config(size: dict) -> dict:
    """transformers.LlamaConfig keywords of a size (untied head, fp32)."""
    h = size["hidden"]
    return dict(vocab_size=size["vocab"], hidden_size=h, intermediate_size=(h * 8 // 3 + 63) // 64 * 64,
                num_hidden_layers=size["layers"], num_attention_heads=size["heads"],
                num_key_value_heads=size["kv_heads"], max_position_embeddings=max(2048, size["seq"]),
                rms_norm_eps=1e-6, tie_word_embeddings=False)


def param_count(size: dict) -> dict:
    """Parameters of the Llama of ``size``: ``total``, ``norms`` (replicated under tp) and ``sharded`` (the rest)."""
    c = hf_config(size)
    h, inter, L, V = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
    kv = h // c["num_attention_heads"] * c["num_key_value_heads"]
    layer = h * h * 2 + h * kv * 2 + 3 * h * inter
    norms = (2 * L + 1) * h
    sharded = 2 * V * h + L * layer
    return {"total": sharded + norms, "norms": norms, "sharded": sharded}


def flops_per_step(size: dict) -> float:
    """6·N·T + 12·L·h·s·T: the matmuls of forward and backward, attention included (T tokens per step)."""
    n = param_count(size)["total"]
    tokens = size["global_batch"] * size["seq"]
    return 6.0 * n * tokens + 12.0 * size["layers"] * size["hidden"] * size["seq"] * tokens


def analytic_traffic(size: dict, mesh: str) -> dict[str, dict]:
    """Bytes one rank sends per step by mesh axis, from the textbook schemes, ring algorithms (an all-reduce of B bytes
    over n ranks sends 2(n-1)/n·B per rank, a reduce-scatter or an all-gather (n-1)/n·B), fp32.

    tp (Megatron): per layer 2 all-reduces of the b·s·h activations forward (after attention, after the MLP) and 2
    backward (before q/k/v, before gate/up), plus 2 for the vocab-parallel embedding (forward) and the head's input
    (backward); the cross-entropy's per-token statistics (b·s values) are left out. dp (ZeRO-1): a reduce-scatter of
    this rank's gradients and an all-gather of its parameters (those it holds: sharded ones / tp, norms whole)."""
    tp, dp = axis(mesh, "tp"), axis(mesh, "dp")
    out = {}
    if tp > 1:
        b = size["global_batch"] // dp
        act = b * size["seq"] * size["hidden"] * 4
        count = 4 * size["layers"] + 2
        out["tp"] = {"bytes": count * act * 2 * (tp - 1) / tp,
                     "formula": f"{count} all-reduces (4 per layer x {size['layers']} + 2) of b·s·h = "
                                f"{b}·{size['seq']}·{size['hidden']} fp32"}
    if dp > 1:
        p = param_count(size)
        local = p["sharded"] / tp + p["norms"]
        out["dp"] = {"bytes": 2 * local * 4 * (dp - 1) / dp,
                     "formula": f"reduce-scatter of {local / 1e6:.2f}M gradients + all-gather of as many parameters"}
    return out


def global_batch(size: dict, i: int):
    """Step ``i``'s global batch of token ids (labels = input ids), the same for every implementation."""
    import torch

    g = torch.Generator().manual_seed(1000 + i % DATA_BATCHES)
    return torch.randint(0, size["vocab"], (size["global_batch"], size["seq"]), generator=g)


def local_rows(ids, mesh: str, rank: int):
    """This rank's rows: its dp coordinate's share (ranks are laid out dp-major, tp innermost, in every
    implementation: funcpar's Mesh, torch's init_device_mesh(("dp", "tp")), DeepSpeed's AutoTP groups)."""
    dp, tp = axis(mesh, "dp"), axis(mesh, "tp")
    return ids.chunk(dp)[rank // tp] if dp > 1 else ids


def fmt_bytes(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def median(xs):
    xs = sorted(xs)
    if not xs:
        return math.nan
    m = len(xs) // 2
    return xs[m] if len(xs) % 2 else (xs[m - 1] + xs[m]) / 2
