"""The runner's bookkeeping, free of processes: a worker's output parsed into a job record, the jobs of a size
summarised per (mesh, implementation), the equal-work check, RESULTS.md's text and the bar chart.

A job record: ``{"mesh", "impl", "size", ...}`` plus either the worker's ``RESULT`` (``times``, ``losses``,
``rss_mb``, on CUDA ``gpu_mb``) or ``error`` (one line) or ``missing`` (why the job was not run: the peer's package is
not installed, or the machine has fewer GPUs than the mesh has ranks).
"""

from __future__ import annotations

import json
import math

from benchmarks import common as C

LOSSES_CHECKED = 2  # the first losses every implementation must share with funcpar on the same mesh


def parse_job(stdout: str, stderr: str, rc: int, **fields) -> dict:
    """A worker's output as a job record: its ``RESULT`` line, else the reason it failed in one line."""
    rec = dict(fields)
    results = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
    if results:
        rec.update(json.loads(results[-1][len("RESULT "):]))
        return rec
    errors = [ln for ln in stdout.splitlines() if ln.startswith("ERROR ")]
    if errors:
        rec["error"] = json.loads(errors[0][len("ERROR "):])["error"]
    else:
        lines = [ln.strip() for ln in (stderr or stdout or "").splitlines() if ln.strip()]
        why = next((ln for ln in reversed(lines) if "Error" in ln or "error" in ln), lines[-1] if lines else "")
        rec["error"] = f"exit {rc}: {why}"[:400]
    rec["stderr_tail"] = (stderr or "")[-3000:]
    return rec


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def summarize(records: list[dict], size: str, flops: float, peak_flops: float, tol: float) -> list[dict]:
    """One row per (mesh, implementation) of ``size``, in the order of ``common.MESHES``: median s/step over every
    timed step of every repeat, the ratio to funcpar, MFU, the largest per-rank peak RSS, the first losses and the
    equal-work verdict against funcpar's on the same mesh (relative difference of each of the first losses at most
    ``tol``; a job whose losses differ from another repeat's of the same implementation is flagged too)."""
    rows = []
    meshes = [m for m in C.MESHES if any(r["mesh"] == m and r["size"] == size for r in records)]
    for mesh in meshes:
        for impl in C.MESHES[mesh]["impls"]:
            jobs = [r for r in records if r["size"] == size and r["mesh"] == mesh and r["impl"] == impl]
            if jobs:
                rows.append(_row(size, mesh, impl, jobs, flops, peak_flops))
    for mesh in meshes:
        _compare(size, [r for r in rows if r["mesh"] == mesh], tol)
    return rows


def _row(size, mesh, impl, jobs, flops, peak_flops) -> dict:
    row = {"size": size, "mesh": mesh, "impl": impl, "label": C.impl_label(mesh, impl), "jobs": len(jobs)}
    ok = [j for j in jobs if "times" in j]
    if not ok:
        bad = next((j for j in jobs if "missing" in j), jobs[0])
        row["status"] = "missing" if "missing" in bad else "failed"
        row["error"] = bad.get("missing") or bad.get("error", "no result")
        return row
    times = [t for j in ok for t in j["times"]]
    s = C.median(times)
    row |= {"status": "ok", "s_per_step": s, "job_medians": [C.median(j["times"]) for j in ok],
            "mfu": flops / (s * peak_flops) if peak_flops > 0 else math.nan,
            "rss_mb": max(max(j["rss_mb"]) for j in ok), "rss_ranks_mb": [max(v) for v in zip(*(j["rss_mb"] for j in ok))],
            "losses": ok[0]["losses"][:LOSSES_CHECKED], "all_losses": ok[0]["losses"],
            "repeat_spread": max(_rel(a, b) for j in ok for a, b in zip(j["losses"][:LOSSES_CHECKED],
                                                                         ok[0]["losses"][:LOSSES_CHECKED])),
            "failed_jobs": len(jobs) - len(ok), "loads": [j["load"] for j in ok if "load" in j]}
    if all(j.get("gpu_mb") for j in ok):  # CUDA: each rank's peak of allocated device memory
        row["gpu_mb"] = max(max(j["gpu_mb"]) for j in ok)
    if ok[0].get("traffic"):  # per axis, the most any rank sent per step
        per_rank = ok[0]["traffic"]
        row["traffic"] = {a: max(t.get(a, 0) for t in per_rank) for a in set().union(*per_rank)}
    if row["failed_jobs"]:
        row["error"] = next(j["error"] for j in jobs if "error" in j)
    return row


def _compare(size, rows, tol) -> None:
    ref = next((r for r in rows if r["impl"] == "funcpar" and r["status"] == "ok"), None)
    peers = [r for r in rows if r["impl"] != "funcpar" and r["status"] == "ok"]
    for r in rows:
        if r["status"] != "ok":
            r["agree"] = None
            continue
        if ref is None:
            r["agree"], r["loss_diff"] = None, math.nan
            continue
        n = min(len(r["losses"]), len(ref["losses"]), LOSSES_CHECKED)
        r["loss_diff"] = max(_rel(r["losses"][i], ref["losses"][i]) for i in range(n)) if n else math.nan
        r["agree"] = n == LOSSES_CHECKED and r["loss_diff"] <= tol and r["repeat_spread"] <= tol
        r["ratio"] = r["s_per_step"] / ref["s_per_step"]
    if ref is not None and peers:
        best = min(peers, key=lambda r: r["s_per_step"])
        ref["best_peer"], ref["funcpar_over_best"] = best["label"], ref["s_per_step"] / best["s_per_step"]


# ------------------------------------------------------------------------------------------------ the text


def mfu_targets(rows: list[dict], size: str, flops: float, peaks: list[float], precision: str = "fp32") -> list[str]:
    """A line per MFU target of ``size`` (``common.MFU_TARGETS``, fp32 only) whose funcpar row ran: its MFU over the
    peak used (the largest reading) against the target, and, where the run read the peak more than once and the
    readings differ, the same step over the lowest reading (the machine's own matmul rate moved during the run)
    and the per-job medians' range over the peak used."""
    out = []
    for (name, mesh), target in C.MFU_TARGETS.items():
        if name != size or precision != "fp32" or not peaks:
            continue
        r = next((r for r in rows if r["mesh"] == mesh and r["impl"] == "funcpar" and r.get("status") == "ok"), None)
        if r is None:
            continue
        hi, lo = max(peaks), min(peaks)
        line = (f"- MFU target, funcpar {C.mesh_label(mesh)}: {r['mfu']:.1%} of the peak used ({hi / 1e9:.1f} "
                f"GFLOP/s), target >= {target:.0%} {'met' if r['mfu'] >= target else 'not met'}")
        jobs = sorted(flops / (t * hi) for t in r.get("job_medians", []))
        if jobs:
            line += f"; the per-job medians {jobs[0]:.1%}-{jobs[-1]:.1%}"
        if lo < hi:
            line += (f"; over the lowest peak reading ({lo / 1e9:.1f} GFLOP/s, {1 - lo / hi:.0%} below: the "
                     f"machine's own matmul rate moved during the run) {flops / (r['s_per_step'] * lo):.1%}")
        out.append(line + ".")
    return out


def _agree_cell(r: dict, tol: float) -> str:
    if r["status"] != "ok":
        return "-"
    if r["impl"] == "funcpar":
        return "reference" + ("" if r["repeat_spread"] <= tol else f" (repeats differ: {r['repeat_spread']:.1e})")
    if r["agree"] is None:
        return "no funcpar reference"
    if r["agree"]:
        return f"yes ({r['loss_diff']:.1e})"
    why = f"repeats differ {r['repeat_spread']:.1e}" if r["repeat_spread"] > tol else f"{r['loss_diff']:.1e}"
    return f"**NO** ({why} > {tol:.0e})"


def table(rows: list[dict], tol: float) -> str:
    """The markdown table of one size."""
    gpu = any("gpu_mb" in r for r in rows)
    memory = "peak RSS / GPU memory per rank (MB, max)" if gpu else "peak RSS per rank (MB, max)"
    out = [f"| mesh | implementation | median s/step | ratio to funcpar | MFU | {memory} | "
           "first losses | agree with funcpar (max rel. diff) |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mesh = C.mesh_label(r["mesh"])
        if r["status"] != "ok":
            word = "not run" if r["status"] == "missing" else "FAILED"
            out.append(f"| {mesh} | {r['label']} | {word}: {_cell(r['error'])} | | | | | |")
            continue
        if r["impl"] == "funcpar":
            ratio = "1.00" + (f" (funcpar/best peer {r['funcpar_over_best']:.2f})" if "funcpar_over_best" in r else "")
        else:
            ratio = f"{r['ratio']:.2f}" if "ratio" in r else "-"
        spread = ""
        if len(r["job_medians"]) > 1:
            spread = f" ({min(r['job_medians']):.3f}-{max(r['job_medians']):.3f})"
        note = f" [{r['failed_jobs']} job(s) failed: {_cell(r['error'])}]" if r.get("failed_jobs") else ""
        out.append(f"| {mesh} | {r['label']}{note} | {r['s_per_step']:.3f}{spread} | {ratio} | {r['mfu']:.1%} | "
                   f"{r['rss_mb']:.0f}{' / %.0f' % r['gpu_mb'] if 'gpu_mb' in r else ''} | {' / '.join(f'{x:.5f}' for x in r['losses'])} | {_agree_cell(r, tol)} |")
    return "\n".join(out)


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")[:300]


def summary(rows: list[dict]) -> str:
    """funcpar against its fastest peer, per mesh."""
    out = ["| mesh | funcpar s/step | fastest peer | its s/step | funcpar / best peer |", "|---|---|---|---|---|"]
    for r in rows:
        if r["impl"] == "funcpar" and r["status"] == "ok":
            if "funcpar_over_best" in r:
                best = next(p for p in rows if p["mesh"] == r["mesh"] and p["label"] == r["best_peer"])
                out.append(f"| {C.mesh_label(r['mesh'])} | {r['s_per_step']:.3f} | {r['best_peer']} | "
                           f"{best['s_per_step']:.3f} | {r['funcpar_over_best']:.2f} |")
            else:
                out.append(f"| {C.mesh_label(r['mesh'])} | {r['s_per_step']:.3f} | (no peer ran) | | |")
    return "\n".join(out)


def traffic_table(size: dict, meshes: list[str], planned: dict[str, dict], rows: list[dict] = ()) -> str:
    """Bytes one rank sends per step, by axis: the textbook count next to what ``funcpar plan`` traces and what
    funcpar's run counted (``rows``: the funcpar rows that carry ``traffic``)."""
    out = ["| mesh | axis | analytic (Megatron TP / ZeRO-1, ring) | what it counts | `funcpar plan` traced | "
           "funcpar run, counted |", "|---|---|---|---|---|---|"]
    for mesh in meshes:
        ana = C.analytic_traffic(size, mesh)
        plan = planned.get(mesh) or {}
        ran = next((r.get("traffic") or {} for r in rows if r["mesh"] == mesh and r["impl"] == "funcpar"), {})
        for ax in sorted(set(ana) | set(k for k in plan if k != "error") | set(ran)):
            a = ana.get(ax)
            traced = C.fmt_bytes(plan[ax]) if ax in plan else (f"({plan['error']})" if "error" in plan else "-")
            counted = C.fmt_bytes(ran[ax]) + (f" ({ran[ax] / a['bytes']:.4f}x analytic)" if a else "") \
                if ax in ran else "-"
            out.append(f"| {C.mesh_label(mesh)} | {ax} | {C.fmt_bytes(a['bytes']) if a else '-'} | "
                       f"{a['formula'] if a else '-'} | {traced} | {counted} |")
    return "\n".join(out)


def parse_plan(stdout: str) -> dict:
    """The per-axis bytes of ``funcpar plan``'s line ``... sends dp 12.3 MiB, tp 4.5 MiB per step``."""
    for ln in stdout.splitlines():
        if " sends " in ln and ln.rstrip().endswith("per step"):
            part = ln.rsplit(" sends ", 1)[1].rsplit(" per step", 1)[0]
            out = {}
            for item in part.split(", "):
                bits = item.split()
                if len(bits) == 3:
                    scale = {"MiB": 2**20, "GiB": 2**30, "KiB": 2**10}[bits[2]]
                    out[bits[0]] = float(bits[1].replace(",", "")) * scale
            return out
    return {"error": "no 'sends ... per step' line"}


# ------------------------------------------------------------------------------------------------ the plot


def plot(rows: list[dict], path: str) -> None:
    """Bar chart of s/step per mesh and implementation, one panel per size; a failed job is a labelled gap."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = list(dict.fromkeys(r["size"] for r in rows))
    fig, axes = plt.subplots(len(sizes), 1, figsize=(11, 4.2 * len(sizes)), squeeze=False)
    colors = {"funcpar": "#1f77b4", "hf": "#7f7f7f", "ds": "#d62728", "torch": "#2ca02c"}
    for ax, size in zip(axes[:, 0], sizes):
        these = [r for r in rows if r["size"] == size]
        x, ticks, labels = 0.0, [], []
        for mesh in dict.fromkeys(r["mesh"] for r in these):
            group = [r for r in these if r["mesh"] == mesh]
            start = x
            for r in group:
                family = r["impl"].split("-")[0]
                if r["status"] == "ok":
                    ax.bar(x, r["s_per_step"], width=0.8, color=colors.get(family, "#9467bd"))
                    ax.text(x, r["s_per_step"], f"{r['s_per_step']:.2f}", ha="center", va="bottom", fontsize=7)
                else:
                    ax.text(x, 0, "failed" if r["status"] == "failed" else "not run", rotation=90, ha="center",
                            va="bottom", fontsize=7, color="#d62728")
                ticks.append(x)
                labels.append(r["label"].replace(f"funcpar {C.mesh_label(mesh)}", "funcpar"))
                x += 1
            ax.text((start + x - 1) / 2, 1.02, C.mesh_label(mesh), transform=ax.get_xaxis_transform(),
                    ha="center", fontsize=9, weight="bold")
            x += 0.8
        ax.set_xticks(ticks, labels, rotation=30, ha="right", fontsize=7)
        ax.set_ylabel("s / step (median)")
        ax.set_title(f"{size}", loc="left", fontsize=10, pad=16)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------------------------ RESULTS.md


PHASES = ("forward+backward", "forward", "backward", "bucket copies", "reduce", "norm+stats", "optimizer", "gather",
          "rest")
KINDS = ("matmul", "attention", "collectives", "copies", "other ops", "python")


def profile_tables(profiles: list[dict], rows: list[dict]) -> str:
    """Where the step's time goes (``profile_step.py``'s records): ms per phase, then the whole step by kind, and
    the compute floor: the ratio to the best peer funcpar would have if all but its matmuls and attention took no
    time (the profiled shares applied to the timed median)."""
    ok = [p for p in profiles if "phases" in p]
    if not ok:
        return "\n".join(f"- profile of {C.mesh_label(p['mesh'])} {p['impl']} failed: {p['error']}" for p in profiles)
    phases = [ph for ph in PHASES if any(ph in p["phases"] for p in ok)]
    head = ["| mesh | implementation | profiled ms/step | " + " | ".join(phases) + " |",
            "|---" * (3 + len(phases)) + "|"]
    kinds = ["| mesh | implementation | " + " | ".join(KINDS) + " | compute floor: funcpar / best peer |",
             "|---" * (3 + len(KINDS)) + "|"]
    verdicts: list[str] = []
    for p in ok:
        label = C.impl_label(p["mesh"], p["impl"])
        cells = [f"{p['phases'][ph]['wall_ms']:.0f}" if ph in p["phases"] else "" for ph in phases]
        head.append(f"| {C.mesh_label(p['mesh'])} | {label} | {p['step_ms']:.0f} | " + " | ".join(cells) + " |")
        total = {k: sum(d.get(k, 0.0) for d in p["phases"].values()) for k in KINDS}
        whole = sum(total.values()) or 1.0
        floor = ""
        timed = [r for r in rows if r["mesh"] == p["mesh"] and r.get("s_per_step")]
        mine = [r["s_per_step"] for r in timed if r["impl"] == "funcpar"]
        peers = [r["s_per_step"] for r in timed if r["impl"] != "funcpar"]
        if p["impl"] == "funcpar" and mine and peers:
            share = (total["matmul"] + total["attention"]) / whole
            floor = f"{share * mine[0] / min(peers):.2f} ({share:.0%} of the step)"
        kinds.append(f"| {C.mesh_label(p['mesh'])} | {label} | "
                     + " | ".join(f"{total[k]:.0f} ({total[k] / whole:.0%})" for k in KINDS) + f" | {floor} |")
        if floor:
            verdicts.append(_verdict(p["mesh"], mine[0], min(peers), share, total["collectives"] / whole))
    return "\n".join(head + [""] + kinds + [""] + verdicts)


def _verdict(mesh: str, mine: float, best: float, share: float, comm: float = 0.0) -> str:
    """One line per mesh: the ratio, the target (0.8; 1.0 against the eager loop on one process), the compute floor
    and, with funcpar's collectives as profiled (waits included), the time the target leaves for everything else
    against what that takes now (the profiled shares applied to the timed median ``mine``)."""
    target = 1.0 if mesh == "1" else 0.8
    ratio, floor, with_comm = mine / best, share * mine / best, (share + comm) * mine / best
    if ratio <= target:
        return f"- {C.mesh_label(mesh)}: funcpar / best peer {ratio:.2f}, target <= {target:g} met."
    need = (1 - target * best / mine) * 100  # the share of funcpar's step that would have to go
    left, now = (target * best - (share + comm) * mine) * 1e3, (1 - share - comm) * mine * 1e3
    rest = "element-wise ops, optimizer, copies, Python"
    if floor > target:
        how = "unreachable here: the matmuls and attention kernels alone take longer than the target allows"
    elif with_comm > target:
        how = (f"with its collectives as profiled {with_comm:.2f}: the matmuls, attention and communication alone "
               f"exceed the target, so closing it needs communication that takes no time from these cores (on a "
               f"free core or a device's copy engine) besides all of the {rest} ({now:.0f} ms a step now)")
    else:
        how = (f"with its collectives as profiled {with_comm:.2f}: it needs {need:.0f}% of funcpar's step removed; "
               f"the target leaves {left:.0f} ms a step for the {rest}, which take {now:.0f} ms now")
    return f"- {C.mesh_label(mesh)}: funcpar / best peer {ratio:.2f}, target <= {target:g} not met; compute floor " \
           f"{floor:.2f}, {how}."


def document(meta: dict, sizes: dict[str, dict], tol: float) -> str:
    """RESULTS.md: the machine, the versions, the measured peak, then per size the table, funcpar against its fastest
    peer, and the bytes sent per step. ``sizes``: name -> {"rows", "planned" (mesh -> axis -> bytes)}."""
    m, v = meta["machine"], meta["versions"]
    on_gpu = m.get("device") == "cuda"
    out = ["# funcpar against its peers", "",
           f"Generated by `{meta['command']}` on {meta['date']} ({meta['wall_s'] / 60:.1f} min of wall time).", "",
           f"- machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']:.1f} GiB memory"
           + (f"; the jobs on CUDA (NCCL, one GPU per rank): {', '.join(m['gpus'])}" if on_gpu else
              "; the jobs on host tensors (gloo)"),
           "- versions: " + ", ".join(f"{k} {val}" for k, val in v.items()),
           f"- matmul peak (measured, {meta.get('precision', 'fp32')}, {'cuda:0' if on_gpu else str(meta['peak_threads']) + ' threads'}, "
           f"{meta['peak_n']}x{meta['peak_n']} "
           f"matmuls, the fastest one in {meta['peak_seconds']:g} s"
           + (" at the start and at the end of the run: " + " and ".join(f"{p / 1e9:.1f}" for p in meta["peaks"])
              + ", the larger used" if len(meta.get("peaks", [])) > 1 and not meta.get("peak_note") else "")
           + f"): **{meta['peak_flops'] / 1e9:.1f} GFLOP/s**; MFU = (6·N·T + 12·L·h·s·T) / (s/step · that peak)"
           + (f" ({meta['peak_note']})" if meta.get("peak_note") else ""),
           f"- each job: {meta['warmup']} untimed warm-up steps then {meta['steps']} timed steps; {meta['repeats']} "
           "repeats, the order of the jobs reversed every other repeat; median over every timed step of every "
           "repeat (in parentheses: the range of the per-job medians)",
           "- first losses: step 1's (the initial weights on batch 0) and step 2's (after one update, on batch 1), "
           "the global batch's token mean; *agree*: both within a relative "
           f"{tol:.0e} of funcpar's on the same mesh, and the same in every repeat", ""]
    if meta.get("missing"):
        out += [f"Not run (a package missing: `pip install -e \".[bench]\"`; or fewer GPUs than ranks): "
                f"{', '.join(meta['missing'])}.", ""]
    for name, s in sizes.items():
        size = C.SIZES[name]
        p = C.param_count(size)
        tokens = size["global_batch"] * size["seq"]
        targets = mfu_targets(s["rows"], name, C.flops_per_step(size), meta.get("peaks") or [meta["peak_flops"]],
                              meta.get("precision", "fp32"))
        out += [f"## {name}: Llama hidden {size['hidden']}, {size['layers']} layers, {size['heads']} heads / "
                f"{size['kv_heads']} kv heads, vocab {size['vocab']}, seq {size['seq']}, global batch "
                f"{size['global_batch']}", "",
                f"{p['total'] / 1e6:.2f}M parameters, {tokens} tokens per step, "
                f"{C.flops_per_step(size) / 1e9:.1f} GFLOP per step.", "",
                table(s["rows"], tol), "", summary(s["rows"]), "",
                *targets, *([""] if targets else []),
                "Bytes one rank sends per step (the most of any rank). *Analytic*: the textbook schemes (formula "
                "in the row; ring algorithms: an all-reduce of B bytes over n ranks sends 2(n-1)/n·B per rank, a "
                "reduce-scatter or an all-gather (n-1)/n·B). *Traced*: `funcpar plan --model <the weights> --mesh "
                "... --zero 1` runs funcpar's step over a simulated mesh, without processes, and counts what each of "
                "its collectives would send (same ring convention). *Counted*: the run above, funcpar's collectives "
                "counting what they sent (`mesh.traffic`, same convention; the scalar all-reduces of the loss and "
                "the gradient norm, and the vocab-parallel cross-entropy's per-token statistics, included), per timed step. The peers' traffic is not counted: DeepSpeed ZeRO-1/2 "
                "send about what ZeRO-1's row says, FSDP2 (ZeRO-3) about 1.5x it (parameters gathered for the "
                "forward and again for the backward).", "",
                traffic_table(size, [m_ for m_ in C.MESHES if C.analytic_traffic(size, m_)
                                    and any(r["mesh"] == m_ for r in s["rows"])],
                              s.get("planned", {}), s["rows"]), ""]
        if s.get("profiles"):
            out += ["### Where the time goes", "",
                    "`benchmarks/profile_step.py`: a few steps of each job under `torch.profiler` (after the timed "
                    "jobs; the profiler slows a step, so the shares matter, not the totals). First the phases of the "
                    "step in ms (funcpar: the `torch.func` gradient, the gradients copied into their buckets, their "
                    "reduce-scatter, the norm and loss all-reduce, AdamW, the parameters' all-gather; the eager "
                    "loop: forward, backward, clipping, AdamW), then the whole step by kind of work, from every "
                    "op's self time: *python* is time in a phase outside every op (Python, `torch.func`'s "
                    "transforms, the dispatcher). The *compute floor* is funcpar's ratio to its fastest peer if "
                    "everything but the matmuls and the attention kernels took no time: a target below it cannot "
                    "be met on this machine with these kernels, by any implementation doing the same arithmetic.",
                    "", profile_tables(s["profiles"], s["rows"]), ""]
    if meta.get("notes"):
        out += ["## Notes", ""] + [f"- {n}" for n in meta["notes"]] + [""]
    return "\n".join(out)
