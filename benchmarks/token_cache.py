"""A corpus larger than the run's memory: tokenized once into the token cache, then trained from with the memory of a
batch. For each corpus size this makes a plain-text corpus (random words, documents separated by blank lines), runs
``funcpar train`` on dp=2 twice with ``--token-cache DIR`` (the first run tokenizes, the second reads the cache) and
once with ``--token-cache off`` for the smaller sizes (every rank tokenizes into memory, the old way), and samples
each process's memory every 0.2 s from /proc: the peak anonymous resident memory (``RssAnon``: what the process
holds) and the peak resident set (``VmRSS``, which adds file pages mapped in, the cache's among them: page cache
the kernel can drop).

    python benchmarks/token_cache.py                         # 128 MiB and 1 GiB corpora (about 15 min on 2 cores)
    python benchmarks/token_cache.py --sizes 64 --off-up-to 64 --steps 10

A benchmark, not a test: nothing is asserted. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
WORDS = np.array("the of and to in a is that for it as was with be by on not he this are or his from at which but "
                 "have an they you were her she there one all we their been has when who will more no if out so "
                 "said what up its about into than them can only other new some time could these two may then do "
                 "first any my now such like our over man me even most made after also did many before must "
                 "through back years where much your way well down should because each just those people".split())


def make_corpus(path: Path, mib: int, seed: int = 0) -> None:
    """About ``mib`` MiB of documents of 50..600 random words, one line per 12 words, blank lines between."""
    rng = np.random.default_rng(seed)
    target, written = mib << 20, 0
    with open(path, "w") as fh:
        while written < target:
            words = WORDS[rng.integers(0, len(WORDS), 60_000)]
            lengths = rng.integers(50, 600, 200)
            out, at = [], 0
            for n in lengths:
                doc = words[at : at + n]
                at += n
                if len(doc) < n:
                    break
                out.append("\n".join(" ".join(doc[k : k + 12]) for k in range(0, n, 12)) + "\n\n")
            text = "".join(out)
            fh.write(text)
            written += len(text)


def _tree(root: int) -> list[int]:
    """``root`` and its descendants now."""
    parent = {}
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                parent[int(p.name)] = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += [c for c, pp in parent.items() if pp == pid]
    return out


def _memory(pid: int) -> tuple[str, int, int] | None:
    """``(role, RssAnon, VmRSS)`` in bytes of a process: role ``rank N`` (a training rank) or ``launcher``."""
    try:
        status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, ValueError):
        return None
    if b"python" not in cmd:
        return None
    rank = next((e.split(b"=")[1].decode() for e in env if e.startswith(b"RANK=")), None)
    role = f"rank {rank}" if rank is not None else ("launcher" if b"funcpar" in cmd else "")
    kib = lambda key: int(status.get(key, "0 kB").split()[0]) << 10  # noqa: E731
    return (role, kib("RssAnon"), kib("VmRSS")) if role else None


def run(corpus: Path, cache: str, out: Path, steps: int) -> dict:
    """One ``funcpar train`` on dp=2: wall time, first-step time, peak RssAnon / VmRSS per role."""
    args = [sys.executable, "-m", "funcpar", "train", "--model", "llama-micro", "--mesh", "dp=2", "--data",
            str(corpus), "--token-cache", cache, "--steps", str(steps), "--global-batch", "32", "--seq-len", "256",
            "--eval-every", str(steps), "--save-every", "0", "--log-every", "1", "--out", str(out), "--overwrite"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    t0 = time.perf_counter()
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peaks: dict[str, list[int]] = {}
    while proc.poll() is None:
        for pid in _tree(proc.pid):
            m = _memory(pid)
            if m:
                old = peaks.get(m[0], [0, 0])
                peaks[m[0]] = [max(old[0], m[1]), max(old[1], m[2])]
        time.sleep(0.2)
    log = proc.stdout.read()
    if proc.returncode:
        raise SystemExit(f"funcpar train failed:\n{log[-3000:]}")
    rows = [line for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"seconds": time.perf_counter() - t0, "peaks": peaks, "log": log, "steps": len(rows)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="128,1024", help="corpus sizes in MiB")
    ap.add_argument("--off-up-to", type=int, default=128, help="also run --token-cache off up to this size (MiB)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--dir", default="", help="where corpora and caches go (default: a temporary folder)")
    a = ap.parse_args()
    work = Path(a.dir or tempfile.mkdtemp(prefix="funcpar-tokens-"))
    work.mkdir(parents=True, exist_ok=True)
    gib = 2**30
    print("| corpus | --token-cache | run | wall s | peak RssAnon / rank | peak VmRSS / rank | launcher RssAnon |")
    print("|---|---|---|---|---|---|---|")
    for mib in (int(s) for s in a.sizes.split(",")):
        corpus = work / f"corpus-{mib}.txt"
        if not corpus.exists():
            make_corpus(corpus, mib)
        size = corpus.stat().st_size / gib
        cases = [("cache", str(work / "cache"), "first: tokenizes"), ("cache", str(work / "cache"), "second: reads")]
        if mib <= a.off_up_to:
            cases.append(("off", "off", "every rank tokenizes"))
        for _, cache, what in cases:
            r = run(corpus, cache, work / "out", a.steps)
            ranks = [v for k, v in r["peaks"].items() if k.startswith("rank")]
            launcher = r["peaks"].get("launcher", [0, 0])
            print(f"| {size:.2f} GiB | {cache if cache == 'off' else 'DIR'} | {what} | {r['seconds']:.0f} | "
                  f"{max(v[0] for v in ranks) / gib:.2f} GiB | {max(v[1] for v in ranks) / gib:.2f} GiB | "
                  f"{launcher[0] / gib:.2f} GiB |", flush=True)
            tok = [line for line in r["log"].splitlines() if "tokenized" in line]
            if tok:
                print(f"<!-- {tok[-1]} -->", flush=True)


if __name__ == "__main__":
    main()
