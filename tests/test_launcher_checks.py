"""Issue 53, items 5 and 6: what a run's ranks would refuse on resume is refused by the launcher before any rank
starts, in one line; a rank that fails under --max-restarts is one line on the console, its traceback in
--out/logs/rank-N.log; --resume with nothing to continue, --steps with --epochs and a LoRA target typo say what they
should; `funcpar plan --gpu` plans GPUs (no host process in their peaks), shows small step times, and its usage line
lists its own flags."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from funcpar.cli import options

ROOT = Path(__file__).resolve().parents[1]
RUN = ["--model", "llama-micro", "--seq-len", "32", "--global-batch", "4", "--eval-every", "0", "--log-every", "1",
       "--schedule", "constant"]


def _env(**extra):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", **extra}
    for k in ("RANK", "FUNCPAR_LOGS", "FUNCPAR_LAUNCHER", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_ERROR_FILE"):
        if k not in extra:
            env.pop(k, None)
    return env


def _snapshot(root):
    return {str(p): p.read_bytes() for p in sorted(Path(root).rglob("*")) if p.is_file()}


# ------------------------------------------------------------------------------ item 5: resume checks, launcher


@pytest.fixture(scope="module")
def lora_mix_run(tmp_path_factory):
    """A finished one-process run (--out run) of a LoRA over a 50/50 mix of two sources, seq-len 32, batch 4."""
    from funcpar.cli import main as cli

    d = tmp_path_factory.mktemp("resume")
    for name, k in (("a.jsonl", 1), ("b.jsonl", 3)):
        (d / name).write_text("".join(json.dumps({"text": f"{a}+{k}={a + k}"}) + "\n" for a in range(150)))
    here = os.getcwd()
    os.chdir(d)
    try:
        cli.main(["train", *RUN, "--mesh", "1", "--steps", "2", "--data", "a.jsonl:0.5,b.jsonl:0.5", "--lora",
                  "r=4,alpha=8,targets=q,v", "--out", "run"])
    finally:
        os.chdir(here)
    return d


@pytest.mark.parametrize("args, message", [
    (["--seq-len", "16"], r"--seq-len 16 differs from the checkpoint's 32 \(run/checkpoints\): its data position "
                          r"counts rows of 32 tokens; resume with --seq-len 32, or start a new run"),
    (["--global-batch", "8"], r"--global-batch 8 differs from the checkpoint's 4 \(run/checkpoints\): its data "
                              r"position counts global batches in the order of --global-batch and --seed; resume with "
                              r"--global-batch 4, or start a new run"),
    (["--seed", "1"], r"--seed 1 differs from the checkpoint's 0 \(run/checkpoints\)"),
    (["--data", "a.jsonl:0.7,b.jsonl:0.3"], r"--data a.jsonl:0.7,b.jsonl:0.3 mixes 2 source\(s\) by 0.7, 0.3, the "
                                            r"checkpoint's run 2 by 0.5, 0.5 \(run/checkpoints\): the rows each source "
                                            r"has served follow from the mix; resume with the run's --data, or start a "
                                            r"new run"),
    (["--data", "a.jsonl"], r"--data a.jsonl mixes 1 source\(s\) by 1, the checkpoint's run 2 by 0.5, 0.5"),
    (["--lora", "r=4,alpha=16,targets=q,v"], r"--lora alpha=16.0 \(the checkpoint's: 8.0\) differs from the run being "
                                             r"resumed \(run/checkpoints\)"),
    (["--lora", "r=8,alpha=8,targets=q,v,k"], r"--lora r=8 \(the checkpoint's: 4\), targets=q,v,k \(the checkpoint's: "
                                              r"q,v\) differs"),
    (["--lora", ""], r"--resume: the checkpoint \(run/checkpoints\) holds LoRA adapters \(--lora "
                     r"r=4,alpha=8,targets=q,v\), and this run trains the whole model: resume with the run's --lora, "
                     r"or start a new run"),
])
def test_a_resume_the_checkpoint_cannot_continue_is_refused_before_any_rank_starts(lora_mix_run, monkeypatch, args,
                                                                                   message):
    """Every setting the ranks would refuse on resume (_same_run, Loader.load_state_dict) is read from the
    checkpoint's meta.json by the launcher: one line, no rank started, nothing written."""
    from funcpar.cli import main as cli

    monkeypatch.chdir(lora_mix_run)
    monkeypatch.setattr(cli, "launch_if_needed", lambda *a, **k: pytest.fail("the ranks were started"))
    before = _snapshot(lora_mix_run)
    with pytest.raises(SystemExit) as e:
        cli.main(["train", "--out", "run", "--resume", "--mesh", "dp=2", *args])
    assert isinstance(e.value.code, str) and "\n" not in e.value.code
    assert re.match("funcpar: " + message, e.value.code), e.value.code
    assert _snapshot(lora_mix_run) == before


_STARTED = """
import os
if os.environ.get("RANK") is not None:  # a rank: say that it started
    open(os.path.join(os.environ["MARKS"], "started-" + os.environ["RANK"]), "w").close()
"""


@pytest.mark.subprocess
def test_another_seq_len_or_data_mix_on_resume_is_one_line_and_no_rank_starts(lora_mix_run, tmp_path):
    """As a user meets it: `funcpar train --resume --seq-len 16` (or another mix) on a dp=2 mesh ends in one line on
    stderr within seconds, with nothing on stdout, and no rank process ever started (each would leave a mark)."""
    (tmp_path / "inject").mkdir()
    (tmp_path / "inject" / "sitecustomize.py").write_text(_STARTED)
    env = _env(PYTHONPATH=f"{tmp_path / 'inject'}{os.pathsep}{ROOT}", MARKS=str(tmp_path))
    for args, line in ((["--seq-len", "16"], "funcpar: --seq-len 16 differs from the checkpoint's 32 (run/checkpoints): "
                                             "its data position counts rows of 32 tokens; resume with --seq-len 32, "
                                             "or start a new run"),
                       (["--data", "a.jsonl:0.7,b.jsonl:0.3"],
                        "funcpar: --data a.jsonl:0.7,b.jsonl:0.3 mixes 2 source(s) by 0.7, 0.3, the checkpoint's run 2 "
                        "by 0.5, 0.5 (run/checkpoints): the rows each source has served follow from the mix; resume "
                        "with the run's --data, or start a new run")):
        t0 = time.monotonic()
        p = subprocess.run([sys.executable, "-m", "funcpar", "train", "--out", "run", "--resume", "--mesh", "dp=2",
                            *args], cwd=lora_mix_run, env=env, capture_output=True, text=True, timeout=120)
        assert (p.returncode, p.stdout, p.stderr.splitlines()) == (1, "", [line]), p.stderr
        assert sorted(x.name for x in tmp_path.glob("started-*")) == []
        print(f"{args}: refused in {time.monotonic() - t0:.1f} s")
    assert not (lora_mix_run / "run" / "logs").exists()


# ------------------------------------------------------------------ item 5: a failed rank under --max-restarts

_FAULT = '''
import os, sys
if os.environ.get("RANK") == "1" and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
    import importlib.abc, importlib.machinery

    class _Fault(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != "funcpar.cli.progress":
                return None
            sys.meta_path.remove(self)
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                log = module.Progress.log

                def faulty(self, step, *a, **k):
                    if step == 3:
                        raise RuntimeError("injected fault at step 3")
                    return log(self, step, *a, **k)

                module.Progress.log = faulty

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _Fault())
'''


@pytest.mark.subprocess
def test_a_rank_that_fails_under_max_restarts_is_one_line_and_its_traceback_goes_to_its_log(tmp_path):
    """Rank 1 raises after step 3 (an unexpected error, on the first attempt only); torchrun restarts the ranks,
    which resume from step 2 and finish. The console has that failure's one line, naming rank 1's log, before the
    restart's line, and no traceback (neither rank 1's nor the surviving rank's lost connection); the log has it."""
    (tmp_path / "inject").mkdir()
    (tmp_path / "inject" / "sitecustomize.py").write_text(_FAULT)
    env = _env(PYTHONPATH=f"{tmp_path / 'inject'}{os.pathsep}{ROOT}")
    p = subprocess.run([sys.executable, "-m", "funcpar", "train", *RUN, "--mesh", "dp=2", "--steps", "4",
                        "--save-every", "2", "--warmup", "1", "--max-restarts", "1", "--out", "out"], cwd=tmp_path,
                       env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=180)
    lines = p.stdout.splitlines()
    assert p.returncode == 0, p.stdout
    assert not any("Traceback" in x or x.startswith("[rank") for x in lines), p.stdout
    failed = [x for x in lines if x.startswith("funcpar: rank")]
    assert failed == ["funcpar: rank 1 failed: RuntimeError: injected fault at step 3 (its traceback: "
                      f"{Path('out') / 'logs' / 'rank-1.log'})"], p.stdout
    restart = next(i for i, x in enumerate(lines) if "a rank failed; torchrun restarted the ranks" in x)
    assert lines.index(failed[0]) < restart
    assert "resumed from" in p.stdout and "at step 2" in p.stdout
    log = (tmp_path / "out" / "logs" / "rank-1.log").read_text()
    assert log.startswith("--- ") and "rank 1, attempt 0" in log
    assert "Traceback (most recent call last)" in log and "RuntimeError: injected fault at step 3" in log
    assert [json.loads(x)["step"] for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]


@pytest.mark.subprocess
def test_a_ranks_lost_connection_goes_to_its_log_and_reads_as_a_consequence(tmp_path):
    """The surviving rank's side of a peer's death (gloo: "Connection closed by peer", raised where it posts a
    send): under funcpar's launcher nothing reaches the console, the traceback is in the rank's log, and the
    error file's one line says a peer died, so the job's report names the peer's reason instead."""
    code = ("from funcpar.cli.launch import run_and_exit\n"
            "def step():\n"
            "    raise RuntimeError('[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by '\n"
            "                       'peer [127.0.0.1]:387. This is typically caused by a remote worker crashing.')\n"
            "run_and_exit(step)\n")
    err = tmp_path / "error.json"
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                       env=_env(RANK="0", FUNCPAR_LAUNCHER="1", FUNCPAR_LOGS="out/logs",
                                TORCHELASTIC_ERROR_FILE=str(err), TORCHELASTIC_RESTART_COUNT="0"))
    assert (p.returncode, p.stdout, p.stderr) == (1, "", "")
    said = json.loads(err.read_text())["message"]
    assert said == ("funcpar: rank 0 ended: a peer rank has died or stopped responding (RuntimeError: "
                    "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                    f"[127.0.0.1]:387. This is typically caused by a remote worker crashing.); its traceback: "
                    f"{Path('out') / 'logs' / 'rank-0.log'}")
    assert "Traceback (most recent call last)" in (tmp_path / "out" / "logs" / "rank-0.log").read_text()
    # --debug: the traceback where it was (on stderr), no log
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path / "out", capture_output=True, text=True,
                       timeout=120, env=_env(RANK="0", FUNCPAR_LAUNCHER="1", FUNCPAR_LOGS="elsewhere",
                                             FUNCPAR_DEBUG="1", TORCHELASTIC_ERROR_FILE=str(err)))
    assert p.returncode == 1 and "Traceback" in p.stderr and not (tmp_path / "out" / "elsewhere").exists()


def _failure(exitcode, message=None, when=0):
    data = {"message": message, "timestamp": when} if message else None
    return SimpleNamespace(exitcode=exitcode, timestamp=when, error_file_data=data,
                           signal_name=lambda: signal.Signals(-exitcode).name)


def test_the_report_names_the_cause_and_leaves_out_what_followed_from_it():
    from funcpar.cli.launch import _failure_summary

    peer = ("funcpar: all_reduce over mesh axis 'dp' of Mesh(pp=1, dp=2, tp=1) (rank 0, group ranks [0, 1]) failed: a "
            "peer rank has died or stopped responding (timeout 1800 s). Cause: Connection closed by peer")
    cause = "funcpar: rank 1 failed: RuntimeError: injected fault (its traceback: out/logs/rank-1.log)"
    assert _failure_summary({0: _failure(-15), 1: _failure(1, cause, 5)}, 2) == cause  # (SIGTERM: torchrun's own)
    assert _failure_summary({0: _failure(1, peer, 4), 1: _failure(1, cause, 5)}, 2) == cause
    assert _failure_summary({0: _failure(1, peer), 1: _failure(-9), 2: _failure(-15)}, 4) == (
        "funcpar: rank 1 was killed by SIGKILL")
    # nothing but consequences: all of them, as before
    assert _failure_summary({0: _failure(-15), 1: _failure(-15)}, 2) == (
        "funcpar: rank 0 was killed by SIGTERM\nfuncpar: rank 1 was killed by SIGTERM")


def test_a_runs_logs_folder_is_its_own_and_replaced_with_it(tmp_path):
    from funcpar.cli.preflight import claim_out

    out = tmp_path / "out"
    (out / "logs").mkdir(parents=True)
    (out / "logs" / "rank-1.log").write_text("Traceback ...\n")
    with pytest.raises(SystemExit, match=r"holds an earlier run \(logs\): pass --resume"):
        claim_out(out, False, False)
    claim_out(out, False, True)
    assert not (out / "logs").exists()
    (out / "logs").mkdir()
    (out / "logs" / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit, match=r"holds files funcpar did not write \(logs\)"):
        claim_out(out, False, True)


# ---------------------------------------------------------------------------------------- item 6: the smaller ones


def test_resume_with_no_checkpoint_is_refused_naming_the_folder_but_a_restarted_rank_starts_at_0(tmp_path,
                                                                                               monkeypatch):
    from funcpar.cli import main as cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    monkeypatch.setattr(cli, "launch_if_needed", lambda *a, **k: pytest.fail("the ranks were started"))
    for mesh in ("1", "dp=2"):
        with pytest.raises(SystemExit) as e:
            cli.main(["train", *RUN, "--mesh", mesh, "--steps", "1", "--out", "typo", "--resume"])
        assert e.value.code == ("funcpar: --resume: --out typo holds no checkpoint to continue (no such folder): "
                                "drop --resume to start a new run (or check --out)")
    assert not (tmp_path / "typo").exists()
    (tmp_path / "crashed").mkdir()
    (tmp_path / "crashed" / "metrics.jsonl").write_text("")
    with pytest.raises(SystemExit) as e:
        cli.main(["train", *RUN, "--mesh", "1", "--steps", "1", "--out", "crashed", "--resume"])
    assert e.value.code == ("funcpar: --resume: --out crashed holds no checkpoint to continue (its earlier run saved "
                            "none: metrics.jsonl): drop --resume and pass --overwrite to start a new run there")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # a rank torchrun restarted before the first checkpoint
    assert cli._resume_source({**options.DEFAULTS, "out": "typo", "resume": True}) is None


def test_steps_and_epochs_together_are_refused_saying_which_would_decide(tmp_path):
    def opts(*argv):
        return options.run_options(options.read_options(list(argv), "train"), list(argv))

    told = (r"^funcpar: --steps 5 and --epochs 2{} both set how long the run trains \(--epochs: 2 passes over the "
            r"training rows, whatever --steps says\): give one of them \(--epochs 0 lets --steps decide\)$")
    for argv in (["--steps", "5", "--epochs", "2"], ["--epochs=2", "--ste", "5"]):  # (argparse's abbreviations too)
        with pytest.raises(SystemExit, match=told.format("")):
            opts(*argv)
    assert opts("--epochs", "2")["epochs"] == 2 and opts("--steps", "5")["steps"] == 5
    assert opts("--steps", "5", "--epochs", "0")["steps"] == 5
    (tmp_path / "c.json").write_text(json.dumps({"epochs": 2}))
    with pytest.raises(SystemExit, match=told.format(rf" \(from {tmp_path / 'c.json'}\)")):
        opts("--config", str(tmp_path / "c.json"), "--steps", "5")
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({**options.DEFAULTS, "epochs": 2, "steps": 58, "out": str(run)}))
    assert opts("--out", str(run), "--resume")["steps"] == 58  # (the run's own: --epochs decides, as it did)
    with pytest.raises(SystemExit, match=told.format(rf" \(the run's, from {run / 'config.json'}\)")):
        opts("--out", str(run), "--resume", "--steps", "5")


def test_a_lora_target_typo_names_the_folders_model_type_not_the_spec():
    import funcpar as fp
    from funcpar.train.lora import Lora, LoraConfig, LoraError

    llama = fp.get_model("llama")
    cfg = llama.config({**options.BUILTIN_MODELS["llama-micro"], "model_type": "qwen2"}, fp.Mesh())
    with pytest.raises(LoraError, match=r"^LoRA target 'qq' matches no weight of model 'qwen2'; its modules are: "):
        Lora(llama, cfg, LoraConfig(targets=("qq",)))


def test_plan_for_gpus_leaves_the_host_process_out_and_shows_small_step_times(capsys, monkeypatch):
    from funcpar.cli import main as cli
    from funcpar.cli import planning

    monkeypatch.setattr(planning, "_RUNTIME", [123 * 2**20])  # (the host's resident set, were it counted)
    cli.plan(["--model", "llama-micro", "--mesh", "dp=2", "--global-batch", "4", "--device", "cpu", "--gpu", "h100"])
    out = capsys.readouterr().out
    traced = next(x for x in out.splitlines() if x.startswith("traced step"))
    assert "+ runtime" not in traced and "123.0 MiB" not in traced, traced
    line = next(x for x in out.splitlines() if x.startswith("estimated step: "))
    assert "0.000" not in line and ("µs" in line or "ms" in line), line
    cli.plan(["--model", "llama-micro", "--global-batch", "4", "--devices", "2", "--memory", "4", "--gpu", "h100",
              "--zero", "1", "--no-remat", "--pipeline", "1f1b", "--micro-batches", "1"])
    out = capsys.readouterr().out.splitlines()
    head = next(x for x in out if x.startswith("mesh "))
    assert head.endswith("est. step  samples/s"), head
    timed = [x for x in out if x.startswith(("dp=", "tp=")) and x.split()[-2] in ("s", "ms", "µs")]
    assert timed and not any(" 0.000" in x for x in timed), out
    assert [planning.seconds(s) for s in (2.5, 0.156, 0.0123, 4.56e-5)] == ["2.5 s", "0.156 s", "12.3 ms", "45.6 µs"]


def test_plans_usage_line_lists_its_own_flags(capsys):
    from funcpar.cli import main as cli

    with pytest.raises(SystemExit) as e:
        cli.main(["plan", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    usage = out.split("\n\n")[0]
    for flag in ("--devices N", "--memory GiB", "--gpu", "--links INTRA,INTER", "--gpus-per-node N", "--efficiency F",
                 "--mesh", "--zero"):
        assert flag in usage, usage
    assert "--steps" not in out
    with pytest.raises(SystemExit) as e:  # (an abbreviation is not taken for a plan flag it was not meant for)
        cli.plan(["--model", "llama-micro", "--mem", "4"])
    assert e.value.code == "funcpar: plan takes no option '--mem' (did you mean --memory?)"
