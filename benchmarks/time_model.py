"""`funcpar plan`'s step-time model (:mod:`funcpar.cli.timing`) against every measured step it can be held to:
this machine's CPU steps of the benchmarks' small Llama (every mesh of benchmarks/run.py), funcpar's GPU steps in the
repository (benchmarks/gpu/RESULTS-*.md, issue 44), and published tables kept as data in benchmarks/published/
(the seed's DeepSpeed table, torchtitan's, Megatron-LM's).

    python benchmarks/time_model.py --part cpu --results benchmarks/results.json   # this machine (a run.py JSON)
    python benchmarks/time_model.py --part gpu                                      # the repository's GPU steps
    python benchmarks/time_model.py --part seed [--lengths 256,512]                 # the seed's table
    python benchmarks/time_model.py --part torchtitan [--titan 8b,70b]              # torchtitan's Llama 3 table
    python benchmarks/time_model.py --part megatron [--megatron 1.7,3.6]            # Megatron-LM's GPT table
    python benchmarks/time_model.py --part all --json benchmarks/results/time_model.json

Every figure is `funcpar plan`'s own: the same command line a user would type (printed with each row), traced on meta
tensors and priced by :func:`funcpar.cli.timing.step_seconds`. A benchmark, not a test: it prints predicted against
measured or published, and the error; tests/test_time_model.py holds the rankings.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import common as C  # noqa: E402
from funcpar.cli import main as cli  # noqa: E402
from funcpar.cli import timing  # noqa: E402
from funcpar.cli.search import trace_layout  # noqa: E402

PUBLISHED = ROOT / "benchmarks" / "published"
FOLDERS: dict[str, str] = {}


def model_folder(name: str, config: dict) -> str:
    """A folder holding only ``config.json`` (what `funcpar plan --model` reads), made once per run."""
    if name not in FOLDERS:
        d = Path(tempfile.mkdtemp(prefix=f"funcpar-{name}-"))
        (d / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"],
                                                   **config}))
        FOLDERS[name] = str(d)
    return FOLDERS[name]


def predict(argv: list[str]) -> dict:
    """`funcpar plan ARGV` (one mesh): its traced row and estimate, and the trace's own seconds here."""
    t0 = time.time()
    ranking, opts, build, estimate = cli.planner(argv)
    axes = cli.parse_mesh(opts["mesh"])
    row = trace_layout(build, axes, opts["zero"], ranking.gpu is not None)
    step = row.pop("step")
    e = estimate(row, axes, step)
    samples = row["rows"] * axes.get("dp", 1) / e["step"]
    return {"argv": argv, "step": e["step"], "compute": e["compute"], "comm": e["comm"], "samples_per_s": samples,
            "peak_gib": (row["peak"] + row["runtime"]) / 2**30, "step_peak_gib": row["step_peak"] / 2**30,
            "parts": e["parts"], "trace_s": time.time() - t0}


def cpu_points(results: str) -> list[dict]:
    """This machine: funcpar's median step of the small Llama on each mesh of a run.py JSON, against the plan of
    the same step (zero 1, its micro-batches and schedule, the threads run.py gives each rank)."""
    saved = json.load(open(results))
    meta = saved["meta"]
    if meta.get("peak_flops") and meta.get("peak_threads"):  # (the run's own matmul peak, measured beside its steps)
        timing.pin_host(meta["peak_flops"] / meta["peak_threads"], meta.get("bandwidth"))
    size = C.SIZES["small"]
    folder = model_folder("small", C.hf_config(size))
    out = []
    for mesh, spec in C.MESHES.items():
        times = [t for r in saved["records"] if r["impl"] == "funcpar" and r["size"] == "small" and r["mesh"] == mesh
                 for t in r["times"]]
        if not times:
            continue
        axes = ",".join(f"{a}={n}" for a, n in spec["axes"].items()) or "1"
        argv = ["--model", folder, "--mesh", axes, "--zero", "1", "--seq-len", str(size["seq"]), "--global-batch",
                str(size["global_batch"]), "--micro-batches", str(C.micro_batches(mesh)), "--device", "cpu",
                "--threads", str(spec["threads"])]
        if C.pipeline(mesh):
            argv += ["--pipeline", C.pipeline(mesh)["pipeline"]]
        p = predict(argv)
        out.append({"point": f"CPU, small Llama, {mesh}", "measured": statistics.median(times),
                    "source": f"{results} ({saved['meta']['versions']['funcpar']}, {saved['meta']['date']})", **p})
    return out


GPU_SHAPES = {
    "small": C.hf_config(C.SIZES["small"]), "large": C.hf_config(C.SIZES["large"]), "gpu": C.hf_config(C.SIZES["gpu"]),
    "1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True,
               max_position_embeddings=2048),
}


def gpu_points() -> list[dict]:
    """funcpar's own GPU steps in the repository, one GPU each (the eager step: the model prices the eager trace)."""
    cases = [  # (shape, gpu, precision, rows, seq, measured s, source)
        ("small", "h200", "fp32", 8, 256, 0.023, "benchmarks/gpu/RESULTS-fp32.md (ba7be80, 2026-11-26)"),
        ("large", "h200", "fp32", 8, 256, 0.034, "benchmarks/gpu/RESULTS-fp32.md (ba7be80, 2026-11-26)"),
        ("gpu", "h200", "bf16", 4, 2048, 0.136, "benchmarks/gpu/RESULTS-bf16-gpu.md (ba7be80, 2026-11-26)"),
        ("1b", "h100", "bf16", 4, 2048, 0.156, "issue 44: the compiled step (priced here as its eager trace)"),
    ]
    out = []
    for shape, gpu, precision, rows, seq, measured, source in cases:
        argv = ["--model", model_folder(shape, GPU_SHAPES[shape]), "--mesh", "1", "--zero", "1", "--seq-len",
                str(seq), "--global-batch", str(rows), "--gpu", gpu, "--precision", precision]
        out.append({"point": f"{gpu}, {shape} Llama, {precision}", "measured": measured, "source": source,
                    **predict(argv)})
    return out


def seed_points(lengths: list[int] | None) -> list[dict]:
    """The seed's table (benchmarks/published/seed_deepspeed_llama7b.json): Llama-1-7B on 8 A100-40GB, fp16,
    micro-batch 1, global batch 128: DeepSpeed's pipeline (pp=8, 1F1B, 128 micro-batches) and ZeRO-3 (dp=8, 16
    micro-batches a rank), at each sequence length; funcpar's plan of each layout (predicted samples/s and whether it
    fits in 40 GiB)."""
    table = json.load(open(PUBLISHED / "seed_deepspeed_llama7b.json"))
    folder = model_folder("llama1-7b", table["model"])
    out = []
    for row in table["rows"]:
        if lengths and row["seq_len"] not in lengths:
            continue
        for layout, argv_mesh in (("pipeline", ["--mesh", "pp=8", "--pipeline", "1f1b", "--micro-batches", "128"]),
                                  ("zero3", ["--mesh", "dp=8", "--zero", "3", "--micro-batches", "16"])):
            argv = ["--model", folder, *argv_mesh, "--seq-len", str(row["seq_len"]), "--global-batch", "128",
                    "--precision", "fp16", "--gpu", "a100-40g"]
            p = predict(argv)
            p["fits"] = p["peak_gib"] <= table["memory_gib"]
            out.append({"point": f"seed, {layout}, seq {row['seq_len']}", "layout": layout, "seq_len": row["seq_len"],
                        "published": row[layout], "published_flash": row.get("pipeline_flash"),
                        "source": table["source"], **p})
    return out


def torchtitan_points(models: list[str]) -> list[dict]:
    """torchtitan's Llama 3 figures (benchmarks/published/torchtitan_llama3_a100.json): FSDP2 over 64 A100-80GB, one
    row of 8192 tokens a GPU, bf16; funcpar's plan of the same layout (dp=64 at ZeRO-3 with every layer recomputed:
    funcpar's ZeRO-3 recomputes each block, as full activation checkpointing does), 8 GPUs a node, 400 Gb/s between
    nodes (not stated by the source: an assumption)."""
    table = json.load(open(PUBLISHED / "torchtitan_llama3_a100.json"))
    out, seen = [], set()
    for row in table["rows"]:
        if row["model"] not in models or row["model"] in seen:
            continue
        seen.add(row["model"])
        folder = model_folder(f"llama3-{row['model']}", table["models"][row["model"]])
        argv = ["--model", folder, "--mesh", "dp=64", "--zero", "3", "--remat", "--seq-len", str(row["seq_len"]),
                "--global-batch", str(64 * row["local_batch"]), "--precision", "bf16", "--gpu", "a100",
                "--links", "nvlink3,ib400"]
        p = predict(argv)
        per_gpu = p["samples_per_s"] * row["seq_len"] / 64
        out.append({"point": f"torchtitan, Llama 3 {row['model']}, dp=64 ZeRO-3", "published_tps": [
            r["tokens_per_s_per_gpu"] for r in table["rows"] if r["model"] == row["model"]], "tokens_per_s_per_gpu":
            per_gpu, "source": table["source"], **p})
    return out


def megatron_points(sizes: list[str]) -> list[dict]:
    """Megatron-LM's weak-scaling table (benchmarks/published/megatron_gpt_weak_scaling.json: Narayanan et al. 2021,
    Table 1): GPT models on A100-80GB, sequence 2048, vocabulary 51,200, interleaved 1F1B, activation recomputation,
    mixed precision. funcpar's plan of each row's own mesh (tp, pp, dp from the table; funcpar's GPT-2, which
    Megatron's GPT is; the interleaved schedule on pipelines; 2 rows a micro-batch, an assumption: the paper does not
    give them) *without* recomputation: funcpar's GPT-2 has no remat (nor does transformers' module through
    ``--generic``: its layers are not named ``layers``). So the comparison is of step times: Megatron's, from its
    teraFLOP/s by the paper's count (eq. 3: the layers' and the logit layer's GEMMs, the recomputation's forward
    included), against funcpar's predicted step without that forward; an equally efficient step would take about
    3/4 of Megatron's (``expected``)."""
    table = json.load(open(PUBLISHED / "megatron_gpt_weak_scaling.json"))
    out = []
    for row in table["rows"]:
        if f"{row['params_b']:g}" not in sizes:
            continue
        h, l, B, s, V = row["hidden_size"], row["num_hidden_layers"], row["global_batch"], 2048, 51200
        folder = model_folder(f"megatron-{row['params_b']:g}b", {
            "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": h, "n_layer": l,
            "n_head": row["heads"], "n_positions": s, "vocab_size": V})
        mesh = ",".join(f"{a}={row[a]}" for a in ("pp", "dp", "tp") if row[a] > 1 or a == "dp")
        argv = ["--model", folder, "--mesh", mesh, "--seq-len", str(s), "--global-batch", str(B),
                "--micro-batch-size", "2", "--precision", "bf16", "--gpu", "a100", "--zero", "0",
                *(["--pipeline", "interleaved"] if row["pp"] > 1 else [])]
        p = predict(argv)
        layers, logits = 96 * B * s * l * h * h * (1 + s / (6 * h)), 6 * B * s * h * V
        published_step = (layers + logits) / (row["tflops_per_gpu"] * 1e12 * row["gpus"])
        expected = (0.75 * layers + logits) / (layers + logits)  # (without the recomputation's forward)
        out.append({"point": f"Megatron-LM, GPT {row['params_b']:g}B on {row['gpus']} GPUs ({mesh})",
                    "published_step": published_step, "expected": expected, "source": table["source"], **p})
    return out


def report(points: list[dict]) -> None:
    for p in points:
        ref = p.get("measured", p.get("published"))
        if "published_step" in p:
            said = (f"Megatron's step {p['published_step']:.2f} s (from its TFLOP/s, with recomputation), funcpar's "
                    f"planned {p['step']:.2f} s without it: {p['step'] / p['published_step']:.2f}x (equally "
                    f"efficient: {p['expected']:.2f}x); fits: {p['peak_gib'] <= 80}")
        elif "published_tps" in p:
            said = (f"published {p['published_tps']} tokens/s a GPU, predicted {p['tokens_per_s_per_gpu']:,.0f} "
                    f"({p['tokens_per_s_per_gpu'] / max(p['published_tps']) - 1:+.0%} of the best)")
        elif "measured" in p:
            said = f"measured {p['measured']:.3g} s, predicted {p['step']:.3g} s ({p['step'] / p['measured'] - 1:+.0%})"
        elif isinstance(ref, (int, float)):
            said = (f"published {ref:.2f} samples/s, predicted {p['samples_per_s']:.2f} "
                    f"({p['samples_per_s'] / ref - 1:+.0%}); fits: {p['fits']}")
        else:
            said = f"published {ref}, predicted {p['samples_per_s']:.2f} samples/s; fits: {p['fits']}"
        print(f"{p['point']}: {said}; peak {p['peak_gib']:.2f} GiB (in the steps {p['step_peak_gib']:.2f}); traced "
              f"in {p['trace_s']:.0f} s")
        print("   funcpar plan " + " ".join(p["argv"]))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", default="all", choices=("cpu", "gpu", "seed", "torchtitan", "megatron", "all"))
    ap.add_argument("--megatron", default="1.7,3.6,7.5,18.4,39.1,76.1,145.6",
                    help="Megatron-LM's GPT sizes (billions) to plan (the rows with at most 8 pipeline stages)")
    ap.add_argument("--titan", default="8b", help="torchtitan's models to plan (8b,70b; 70b traces for minutes)")
    ap.add_argument("--results", default=str(ROOT / "benchmarks" / "results.json"), help="run.py's JSON (CPU)")
    ap.add_argument("--lengths", help="the seed's sequence lengths to plan (default: all)")
    ap.add_argument("--json", help="write every point here")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    lengths = [int(x) for x in args.lengths.split(",")] if args.lengths else None
    points = []
    for part, fn in (("cpu", lambda: cpu_points(args.results)), ("gpu", gpu_points),
                     ("seed", lambda: seed_points(lengths)),
                     ("torchtitan", lambda: torchtitan_points(args.titan.split(","))),
                     ("megatron", lambda: megatron_points(args.megatron.split(",")))):
        if args.part in (part, "all"):
            got = fn()
            report(got)
            points += got
    if args.json:
        clean = [{k: v for k, v in p.items() if k != "sequence"} for p in points]
        Path(args.json).write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M"), "points": clean}, indent=1,
                                              default=str))


if __name__ == "__main__":
    main()
