"""Issue 56, the run folder: its files written as checkpoints are (whole or not at all), ``--overwrite`` deleting only
what funcpar wrote, after the lock, and never what the run reads; a resume without the run's options refused."""

import errno
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from funcpar.cli import main as cli
from funcpar.cli import options
from funcpar.cli.preflight import claim_out, lock_out, mark_run, read_paths, run_files
from funcpar.io.atomic import write_file

ROOT = Path(__file__).resolve().parents[1]
OPTIONS = {"steps": 3, "lr": 0.0001}


def _snapshot(root):
    return {str(p): p.read_bytes() for p in sorted(Path(root).rglob("*")) if p.is_file()}


def _run_folder(out: Path, marked: bool = True) -> Path:
    """A finished run's folder as funcpar writes it (its options, rows, a checkpoint, an export, a plot)."""
    (out / "checkpoints" / "step-2").mkdir(parents=True)
    (out / "checkpoints" / "step-2" / ".funcpar").write_text('{"kind": "checkpoint"}\n')
    (out / "checkpoints" / "latest").write_text("step-2")
    (out / "hf").mkdir()
    (out / "hf" / ".funcpar").write_text('{"kind": "hf"}\n')
    (out / "hf" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (out / "config.json").write_text(json.dumps(OPTIONS))
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 5.5}\n{"step": 2, "loss": 5.4}\n')
    (out / "loss.png").write_bytes(b"\x89PNG")
    (out / "tensorboard").mkdir()
    if marked:
        mark_run(out)
    return out


# ------------------------------------------------------------------- --overwrite: only funcpar's, never what is read


def test_overwrite_refuses_to_delete_the_model_or_tokenizer_the_run_reads(tmp_path, monkeypatch):
    """BAD 1: `--model o5/hf --tokenizer o5/hf --out o5 --overwrite` removed hf/ and then failed to load it."""
    out = _run_folder(tmp_path / "o5")
    monkeypatch.chdir(tmp_path)
    before = _snapshot(tmp_path)
    for flag in ("model", "tokenizer"):
        opts = {**options.DEFAULTS, flag: "o5/hf", "out": "o5", "overwrite": True}
        for check_only in (True, False):
            with pytest.raises(SystemExit) as e:
                claim_out(Path("o5"), False, True, check_only=check_only, reads=read_paths(opts))
            assert e.value.code == (f"funcpar: --overwrite would delete o5/hf, which this run reads (--{flag} o5/hf): "
                                    f"copy it out of --out first, or choose another --out")
    data = out / "checkpoints" / "step-2" / "rows.jsonl"  # (data inside what would go, as a mixture's second part)
    data.write_text('{"text": "x"}\n')
    opts = {**options.DEFAULTS, "data": f"a.jsonl:1,{data}:2", "out": str(out)}
    with pytest.raises(SystemExit, match=r"would delete .*o5/checkpoints, which this run reads \(--data "):
        claim_out(out, False, True, reads=read_paths(opts))
    data.unlink()
    assert _snapshot(tmp_path) == before
    claim_out(out, False, True, reads=read_paths({**options.DEFAULTS, "model": "elsewhere"}))
    assert sorted(p.name for p in out.iterdir()) == [".funcpar"]  # (every entry the run wrote, none other)


@pytest.mark.parametrize("layout", ["lightning", "metrics and wandb", "checkpoints in a marked run"])
def test_a_folder_is_a_runs_by_its_content_not_its_names(tmp_path, layout):
    """BAD 2: `checkpoints/epoch=1.ckpt` (Lightning), or `metrics.jsonl` beside `wandb/run-1/`, was "an earlier run"
    by its names, and --overwrite deleted the user's files: refused whatever the flags, untouched."""
    out = tmp_path / "out"
    if layout == "checkpoints in a marked run":
        _run_folder(out)
        (out / "checkpoints" / "epoch=1.ckpt").write_bytes(b"lightning")
        message = (rf"^funcpar: --out {out}: its checkpoints holds files funcpar did not write \(a run writes its own "
                   rf"checkpoints there\): move it away or choose another --out$")
    else:
        if layout == "lightning":
            (out / "checkpoints").mkdir(parents=True)
            (out / "checkpoints" / "epoch=1.ckpt").write_bytes(b"lightning")
            listed = "checkpoints"
        else:
            (out / "wandb" / "run-1").mkdir(parents=True)
            (out / "metrics.jsonl").write_text('{"epoch": 1, "val_loss": 0.3}\n')
            listed = "metrics.jsonl, wandb"
        message = rf"^funcpar: --out {out} holds files funcpar did not write \({listed}\)"
    before = _snapshot(tmp_path)
    for resume, overwrite in ((False, False), (True, False), (False, True)):
        for check_only in (True, False):
            with pytest.raises(SystemExit, match=message):
                claim_out(out, resume, overwrite, check_only=check_only)
    assert _snapshot(tmp_path) == before


def test_a_run_from_before_the_marker_is_known_by_its_options(tmp_path):
    """A run folder written before runs marked theirs: its config.json holds a run's options, so its plot and
    tensorboard/ are the run's too and --overwrite replaces them; a user's notes stay."""
    out = _run_folder(tmp_path / "old", marked=False)
    (out / "notes.txt").write_text("mine")
    assert run_files(out) == ["metrics.jsonl", "checkpoints", "hf", "loss.png", "config.json", "tensorboard"]
    (out / "config.json").write_text("{}")  # (not a run's options: the folder's plot and tensorboard/ are no one's)
    with pytest.raises(SystemExit, match="its loss.png holds files funcpar did not write"):
        claim_out(out, False, True)
    (out / "config.json").write_text(json.dumps(OPTIONS))
    claim_out(out, False, True)
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


def test_overwrite_into_a_folder_a_live_run_holds_deletes_nothing(tmp_path, monkeypatch):
    """BAD 3: a one-process second run with --overwrite deleted the live run's checkpoints/, config.json and
    tensorboard/, then found its lock; now the lock is taken before anything is removed."""
    out = _run_folder(tmp_path / "out")
    held = lock_out(out)  # (the live run)
    monkeypatch.chdir(tmp_path)
    before = _snapshot(tmp_path)
    try:
        with pytest.raises(SystemExit) as e:
            cli.main(["train", "--model", "llama-micro", "--mesh", "1", "--steps", "1", "--seq-len", "32",
                      "--global-batch", "4", "--eval-every", "0", "--out", "out", "--overwrite"])
        assert e.value.code == (f"funcpar: --out out is in use by another funcpar run (pid {os.getpid()}): wait for "
                                f"it to end, or choose another --out")
    finally:
        os.close(held)
    after = _snapshot(tmp_path)
    assert after == before


# ---------------------------------------------------------------------------------- files whole or not at all


def _enospc_on(monkeypatch, name: str):
    """Fail every write to a file whose name holds ``name`` with ENOSPC (a full disk at exactly that write, as
    `strace -e inject=write:error=ENOSPC` does)."""
    real = os.write

    def write(fd, data):
        if name in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data)
    monkeypatch.setattr(os, "write", write)


def test_a_full_disk_at_config_json_or_the_metrics_trim_leaves_them_as_they_were(tmp_path, monkeypatch):
    """BAD 4 and 5: config.json rewritten in place was left empty by ENOSPC on resume; metrics.jsonl trimmed in
    place was left empty (the run's loss history lost). Written aside and renamed, each is as it was."""
    out = _run_folder(tmp_path / "out")
    before = _snapshot(out)
    snapshot = tmp_path / "metrics-snapshot.jsonl"
    os.link(out / "metrics.jsonl", snapshot)  # (a hard-linked snapshot of the folder)
    for name in ("config.json", "metrics.jsonl"):
        with monkeypatch.context() as m:
            _enospc_on(m, f".{name}.tmp")
            with pytest.raises(OSError) as e:
                write_file(out / name, "{}\n")
            assert e.value.errno == errno.ENOSPC
        assert not (out / f".{name}.tmp").exists()
    assert _snapshot(out) == before
    write_file(out / "metrics.jsonl", '{"step": 1, "loss": 5.5}\n')  # (the trim, done)
    assert snapshot.read_text() == '{"step": 1, "loss": 5.5}\n{"step": 2, "loss": 5.4}\n'  # the snapshot kept
    (out / "elsewhere.txt").write_text("theirs")
    (out / "link.json").symlink_to(out / "elsewhere.txt")
    write_file(out / "link.json", "{}")  # (a link where funcpar writes is replaced, not written through)
    assert (out / "elsewhere.txt").read_text() == "theirs" and not (out / "link.json").is_symlink()


def test_a_kill_in_the_middle_of_the_write_leaves_the_file_whole(tmp_path):
    """SIGKILL after half of config.json's bytes reached the disk: the file is the old one, whole."""
    target = tmp_path / "config.json"
    target.write_text(json.dumps(OPTIONS))
    code = f"""
import os, signal
from funcpar.io import atomic
real = os.write
def write(fd, data):
    real(fd, bytes(data)[: len(data) // 2])
    os.kill(os.getpid(), signal.SIGKILL)
os.write = write
atomic.write_file({str(target)!r}, '{{"steps": 9, "lr": 0.5}}' * 1000)
"""
    p = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert p.returncode == -signal.SIGKILL
    assert json.loads(target.read_text()) == OPTIONS
    write_file(target, "{}")  # (the next write replaces the stale .config.json.tmp)
    assert target.read_text() == "{}" and sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]


@pytest.mark.parametrize("state, what", [("missing", "is missing"), ("empty", "is empty"),
                                         ("torn", "is unreadable (JSONDecodeError)"),
                                         ("other", "does not hold a run's options")])
def test_resume_without_the_runs_options_is_refused_naming_the_file(tmp_path, state, what):
    """BAD 4: an empty or unreadable config.json made --resume continue the checkpoint on the defaults (built-in data,
    another learning rate, the data position replayed over other rows) without a word."""
    out = _run_folder(tmp_path / "out")
    cfg = out / "config.json"
    {"missing": cfg.unlink, "empty": lambda: cfg.write_text(""), "torn": lambda: cfg.write_text('{"steps": 3, "l'),
     "other": lambda: cfg.write_text('{"model_type": "llama"}')}[state]()
    opts = {**options.DEFAULTS, "out": str(out), "resume": True}
    with pytest.raises(SystemExit) as e:
        options.run_options(opts, ["--resume", "--out", str(out)])
    assert e.value.code == (f"funcpar: --resume: {cfg} {what}: the run's options (data, learning rate, schedule, ...) "
                            f"are not known, and the defaults would continue it as another run; restore the file, or "
                            f"give the run's options with --config FILE")
    given = tmp_path / "mine.json"
    given.write_text(json.dumps(OPTIONS))
    assert options.run_options({**opts, "lr": 1e-4}, ["--resume", "--config", str(given)])["lr"] == 1e-4


# --------------------------------------------------------------------------------------- a resume knows its data


def _data(path: Path, n: int) -> Path:
    path.write_text("".join(json.dumps({"text": f"{i} plus {i} is {2 * i}."}) + "\n" for i in range(n)))
    return path


def test_a_resume_refuses_data_that_changed_and_data_changed_starts_its_order_afresh(tmp_path, monkeypatch, capsys):
    """BAD 6: the data file grew between the save and --resume (rows trained on became held-out, the position
    replayed over another permutation), and --data other, --eval-fraction and --no-pack were taken silently."""
    monkeypatch.chdir(tmp_path)
    data = _data(tmp_path / "rows.jsonl", 200)
    run = ["train", "--model", "llama-micro", "--mesh", "1", "--seq-len", "32", "--global-batch", "4",
           "--eval-every", "0", "--log-every", "1", "--data", str(data), "--out", "out"]
    cli.main([*run, "--steps", "2"])
    extra = json.loads((tmp_path / "out" / "checkpoints" / "step-2" / "meta.json").read_text())["extra"]
    assert extra["data_record"]["sources"][0]["size"] == data.stat().st_size
    src = Path("out") / "checkpoints"
    cases = {"grown": (lambda: _data(data, 400), [], rf"{data} is \d+ bytes, \d+ at the checkpoint"),
             "edited": (lambda: data.write_text(data.read_text().replace("plus", "PLUS")), [],
                        rf"{data} has other contents than at the checkpoint \(the same size\)"),
             "another file": (lambda: None, ["--data", str(_data(tmp_path / "b.jsonl", 200))],
                              rf"--data is {tmp_path / 'b.jsonl'}, the checkpoint's {data}"),
             "eval fraction": (lambda: None, ["--eval-fraction", "0.3"], "--eval-fraction is 0.3, the checkpoint's 0.05"),
             "no pack": (lambda: None, ["--no-pack"], r"--no-pack is on \(at the checkpoint off\)")}
    original = data.read_bytes()
    for name, (change, flags, why) in cases.items():
        change()
        with pytest.raises(SystemExit, match=rf"^funcpar: --resume: the data differs from the checkpoint's \({src}\): "
                                             rf"{why}; its saved position would continue over other rows"):
            cli.main([*run, "--steps", "4", "--resume", *flags])
        data.write_bytes(original)
    os.utime(data, ns=(1, 1))  # (touched, the same bytes: the same data)
    opts = {**options.DEFAULTS, "data": str(data), "seq_len": 32}
    cli._same_run(opts, extra, src)
    _data(data, 400)
    capsys.readouterr()
    cli.main([*run, "--steps", "4", "--resume", "--data-changed"])
    out = capsys.readouterr().out
    assert "funcpar: --data-changed: the data differs from the checkpoint's; the data order starts afresh on it at " \
           "step 2" in out
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "data_changed" not in saved  # (said for that resume only: the next one checks again)
    extra = json.loads((tmp_path / "out" / "checkpoints" / "step-4" / "meta.json").read_text())["extra"]
    assert extra["data_record"]["sources"][0]["size"] == data.stat().st_size  # (the new data, recorded)


# ------------------------------------------------------------------------------ saves through the API take turns

_SAVER = """
import sys
sys.path.insert(0, {tests!r})
import funcpar as fp
from fixtures import tiny_step
step, state = tiny_step(fp.Mesh())
for i in range({n}):
    step.save({path!r}, state, overwrite=True)
print("saved")
"""


def test_two_processes_saving_into_one_folder_take_turns_and_every_save_loads(tmp_path):
    """WEAK: two jobs saving through the API into one folder wrote one temporary folder together, and checkpoints
    that save() reported as written failed their CRCs at load. Every write into a folder holds its lock."""
    import funcpar as fp
    from fixtures import tiny_step

    path = tmp_path / "ckpt" / "step-1"
    code = _SAVER.format(tests=str(ROOT / "tests"), n=12, path=str(path))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    step, state = tiny_step(fp.Mesh())
    loaded, _ = step.load(path)  # (its CRCs checked)
    assert int(loaded.step) == int(state.step)


def test_a_save_waits_for_a_write_in_progress_then_names_the_folder(tmp_path, monkeypatch):
    import funcpar as fp
    from fixtures import tiny_step
    from funcpar.io import atomic

    step, state = tiny_step(fp.Mesh())
    (tmp_path / "ckpt").mkdir()
    held = atomic.lock_folder(tmp_path / "ckpt")  # (another process's save, in progress)
    monkeypatch.setattr(atomic, "LOCK_WAIT", 0.3)
    try:
        with pytest.raises(Exception, match=rf"{tmp_path / 'ckpt'}: another process has been writing into it for "
                                             rf"0.3 s \(a save or an export of another job\); nothing was written"):
            step.save(tmp_path / "ckpt" / "step-0", state)
        assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == []
    finally:
        os.close(held)
    step.save(tmp_path / "ckpt" / "step-0", state)
    assert (tmp_path / "ckpt" / "step-0" / "meta.json").is_file()
