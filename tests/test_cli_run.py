"""Issue 13, as a user meets `funcpar train`: a run that cannot finish is refused before step 1, an earlier run in
--out is never clobbered, resumed runs report honestly, the run folder is re-usable and readable, and the help,
version and interval line say what they should."""

import json
import os
import re
import pty
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from funcpar.cli import options
from funcpar.cli.progress import eta_seconds

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--model", "llama-micro", "--schedule", "constant", "--log-every", "1"]
SFT = [{"type": "instruct", "instruct": f"Add {a} and {b}.", "output": str(a + b)}
       for a, b in [(1, 2), (3, 4), (5, 6), (7, 8), (9, 1), (2, 2), (3, 3), (4, 4), (5, 5), (6, 6), (7, 7), (8, 8)]]


def _funcpar(cwd, *args, timeout=300):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    env.pop("RANK", None)
    return subprocess.run([sys.executable, "-m", "funcpar", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def _snapshot(root):
    return {str(p): p.read_bytes() for p in sorted(Path(root).rglob("*")) if p.is_file()}


def _rows(out):
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.subprocess
def test_twelve_samples_are_refused_before_step_1_with_what_to_change_then_train_to_the_end(tmp_path):
    (tmp_path / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in SFT))
    before = _snapshot(tmp_path)
    p = _funcpar(tmp_path, "train", *SMALL, "--mesh", "dp=2", "--data", "sft.jsonl", "--global-batch", "4",
                 "--steps", "20")
    assert p.returncode == 1 and p.stdout == ""
    assert p.stderr == ("funcpar: the training data makes 1 rows of --seq-len 64 (1 more held out), fewer than one "
                        "--global-batch of 4: use --seq-len 37 or less, or bring more data\n")
    assert _snapshot(tmp_path) == before and not (tmp_path / "out").exists()
    # as told: a shorter --seq-len; one held-out row on two dp ranks is evaluated whole on each
    p = _funcpar(tmp_path, "train", *SMALL, "--mesh", "dp=2", "--data", "sft.jsonl", "--global-batch", "4",
                 "--steps", "20", "--seq-len", "37", "--eval-every", "10")
    assert p.returncode == 0, p.stderr
    rows = _rows(tmp_path / "out")
    assert [r["step"] for r in rows if "eval_loss" in r] == [10, 20]
    assert (tmp_path / "out" / "hf" / "model.safetensors").is_file()


@pytest.mark.subprocess
@pytest.mark.parametrize("args, message", [
    (["--global-batch", "6", "--micro-batches", "4"],
     "funcpar: --global-batch 6 does not split over dp=1 x --micro-batches 4: use a multiple of 4 (e.g. 4)"),
    (["--global-batch", "4000"], "funcpar: the training data makes 354 rows of --seq-len 64 (18 more held out), "
                                 "fewer than one --global-batch of 4000: lower --global-batch to 354 or less (a "
                                 "multiple of dp=1 x --micro-batches 1) or use --seq-len 5 or less, or bring more data"),
    (["--eval-fraction", "0"], "funcpar: --eval-every 100 needs held-out rows, and --eval-fraction 0.0 keeps none: "
                               "raise --eval-fraction or pass --eval-every 0"),
])
def test_batch_arithmetic_and_held_out_rows_are_checked_before_step_1(tmp_path, args, message):
    p = _funcpar(tmp_path, "train", *SMALL, "--mesh", "1", "--steps", "1", *args)
    assert (p.returncode, p.stderr) == (1, message + "\n")
    assert not (tmp_path / "out").exists()


def test_warnings_for_warmup_and_positions_and_a_learned_position_table_is_a_limit():
    from funcpar.cli import preflight
    import funcpar as fp
    from funcpar.models import gpt2, llama

    mesh = fp.Mesh.abstract()  # (one rank: every axis of size 1)
    opts = {**options.DEFAULTS, "steps": 10, "warmup": 20, "seq_len": 512}
    cfg = llama.Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
    assert preflight.check_run(opts, cfg, mesh, 100, 5) == [
        "--seq-len 512 exceeds the model's max_position_embeddings 256: positions beyond it were never trained",
        "--warmup 20 is not below --steps 10: the warmup is cut to 9 steps, so the learning rate reaches --lr 0.003 "
        "only at the last step and never decays (use a --warmup below --steps, e.g. 1)"]
    with pytest.raises(SystemExit, match=r"^funcpar: --seq-len 512 exceeds the model's n_positions 128 \(its learned "
                                         r"position table\): use --seq-len 128 or less$"):
        preflight.check_run(opts, gpt2.Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=128), mesh,
                            100, 5)


@pytest.mark.subprocess
def test_an_earlier_run_in_out_is_refused_unless_resumed_or_overwritten(tmp_path):
    args = ["train", *SMALL, "--mesh", "1", "--global-batch", "8", "--seq-len", "32", "--steps", "2",
            "--eval-every", "0"]
    assert _funcpar(tmp_path, *args).returncode == 0
    before = _snapshot(tmp_path)
    p = _funcpar(tmp_path, *args)
    assert (p.returncode, p.stderr) == (1, "funcpar: --out out holds an earlier run (metrics.jsonl, checkpoints, hf, "
                                           "loss.png, config.json, tensorboard): pass --resume to continue it, "
                                           "--overwrite to replace it, or choose another --out\n")
    assert _snapshot(tmp_path) == before
    (tmp_path / "out" / "notes.txt").write_text("mine")
    p = _funcpar(tmp_path, *args[:-4], "--steps", "3", "--eval-every", "0", "--overwrite")
    assert p.returncode == 0, p.stderr
    assert [r["step"] for r in _rows(tmp_path / "out")] == [1, 2, 3]
    assert sorted(x.name for x in (tmp_path / "out" / "checkpoints").iterdir()) == ["latest", "step-3"]
    assert (tmp_path / "out" / "notes.txt").read_text() == "mine"  # not a file a run writes: left alone


def test_a_resumed_run_reports_the_whole_runs_first_loss_and_its_own_pace():
    assert eta_seconds(elapsed=2.0, done_here=1, remaining=99) == 198.0  # resumed at step 100 of 200


@pytest.mark.subprocess
def test_resume_summary_and_a_run_folders_config_is_a_config(tmp_path):
    args = ["train", *SMALL, "--mesh", "1", "--global-batch", "8", "--seq-len", "32", "--eval-every", "0"]
    assert _funcpar(tmp_path, *args, "--steps", "2").returncode == 0
    p = _funcpar(tmp_path, *args, "--steps", "4", "--resume")
    rows = _rows(tmp_path / "out")
    assert f"loss {rows[0]['loss']:.4f} -> {rows[-1]['loss']:.4f};" in p.stdout  # the first step's, not step 3's
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(tmp_path / "out" / "tensorboard"))
    board.Reload()
    logged = {e.step: e.value for e in board.Scalars("train/loss")}
    assert logged == pytest.approx({r["step"]: r["loss"] for r in rows}, rel=1e-6)  # both runs' steps, once each
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["steps"] == 4 and config["resume"] is True
    p = _funcpar(tmp_path, "train", "--config", "out/config.json", "--out", "again", "--no-resume")
    assert p.returncode == 0, p.stderr
    assert [r["loss"] for r in _rows(tmp_path / "again")] == [r["loss"] for r in rows]


@pytest.mark.subprocess
def test_exported_and_checkpoint_files_are_readable_by_others(tmp_path):
    old = os.umask(0o022)
    try:
        p = _funcpar(tmp_path, "train", *SMALL, "--mesh", "1", "--global-batch", "8", "--seq-len", "32", "--steps",
                     "1", "--eval-every", "0")
    finally:
        os.umask(old)
    assert p.returncode == 0, p.stderr
    modes = {str(f.relative_to(tmp_path)): f.stat().st_mode & 0o777 for f in (tmp_path / "out").rglob("*")
             if f.is_file()}
    assert modes and set(modes.values()) == {0o644}, modes


@pytest.mark.subprocess
def test_help_names_every_flag_with_its_default_and_plan_only_its_own():
    p = _funcpar(ROOT, "train", "--help")
    text = " ".join(p.stdout.split()).replace("micro- batches", "micro-batches")  # argparse wraps at hyphens
    assert "--global-batch INT rows per optimizer step, over all dp ranks and micro-batches (default: 32)" in text
    for key in options.DEFAULTS:
        assert "--" + key.replace("_", "-") in p.stdout
    plan = _funcpar(ROOT, "plan", "--help").stdout
    assert "--zero" in plan and "--steps" not in plan and "--resume" not in plan
    version = _funcpar(ROOT, "--version")
    assert version.returncode == 0 and version.stdout.startswith("funcpar 0.1.0 (torch ")


def test_toml_configs_need_tomllib_or_tomli_and_say_so(tmp_path, monkeypatch):
    (tmp_path / "run.toml").write_text("steps = 3\n")
    assert options.read_options(["--config", str(tmp_path / "run.toml")], "train")["steps"] == 3
    monkeypatch.setitem(sys.modules, "tomllib", None)  # Python 3.10: no tomllib
    monkeypatch.setitem(sys.modules, "tomli", None)  # and tomli not installed
    with pytest.raises(SystemExit, match=r"^funcpar: reading a TOML --config needs Python 3.11\+ or the tomli "
                                         r"package \(pip install tomli\); or write the config as JSON$"):
        options.read_options(["--config", str(tmp_path / "run.toml")], "train")
    (tmp_path / "bad.json").write_text("[1, 2]")
    with pytest.raises(SystemExit, match=r"^funcpar: --config .*bad.json must hold a table of options, not a list$"):
        options.read_options(["--config", str(tmp_path / "bad.json")], "train")


@pytest.mark.subprocess
def test_on_a_terminal_the_interval_line_with_eval_shows_above_the_progress_bar(tmp_path):
    master, slave = pty.openpty()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "COLUMNS": "200"}
    proc = subprocess.Popen([sys.executable, "-m", "funcpar", "train", *SMALL, "--mesh", "1", "--global-batch", "8",
                             "--seq-len", "32", "--steps", "4", "--eval-every", "2", "--log-every", "2"],
                            cwd=tmp_path, env=env, stdout=slave, stderr=slave, stdin=slave)
    os.close(slave)
    chunks, deadline = [], time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the other side closed
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    assert proc.wait(timeout=60) == 0
    text = b"".join(chunks).decode(errors="replace")
    assert "train:" in text and "\r" in text  # the bar, redrawn in place
    lines = [ln.split("\r")[-1] for ln in text.splitlines()]
    shown = [ln for ln in lines if ln.startswith("step     2/4  loss ")]
    assert shown and " eval " in shown[0] and " grad_norm " in shown[0] and " lr " in shown[0]
    assert " tok/s  MFU " in shown[0] and " mem " in shown[0] and " eta " in shown[0]


@pytest.mark.subprocess
def test_convert_writes_only_its_destination(tmp_path):
    import hf_fixtures

    hf_fixtures.make_checkpoint("llama", str(tmp_path / "model"))
    before = _snapshot(tmp_path)
    p = _funcpar(tmp_path, "convert", "model", "ckpt")
    assert p.returncode == 0, p.stderr
    after = {k: v for k, v in _snapshot(tmp_path).items() if not k.startswith(str(tmp_path / "ckpt"))}
    assert after == before  # no `latest` beside ckpt (it was written into the parent folder)
    assert (tmp_path / "ckpt" / "meta.json").is_file()


def test_the_byte_tokenizer_exports_as_an_hf_tokenizer_with_the_same_ids(tmp_path):
    transformers = pytest.importorskip("transformers")

    from funcpar.data import ByteTokenizer

    ByteTokenizer().save_pretrained(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    for text in ["7+5=\n", "héllo wörld ✓ 日本", "  two  spaces\tand\ttabs\r\n", "".join(map(chr, range(1, 128)))]:
        assert hf.encode(text) == ByteTokenizer().encode(text) and hf.decode(hf.encode(text)) == text
    assert (hf.pad_token_id, hf.bos_token_id, hf.eos_token_id, len(hf)) == (256, 257, 258, 259)


@pytest.mark.subprocess
def test_transformers_pipeline_answers_a_shipped_arithmetic_prompt_from_the_export(tmp_path):
    transformers = pytest.importorskip("transformers")

    p = _funcpar(tmp_path, "train", "--mesh", "1", "--model", "llama-micro", "--steps", "300", "--eval-every", "0",
                 "--save-every", "0", "--log-every", "100")
    assert p.returncode == 0, p.stderr
    # after 300 steps the run checks its own answers, with funcpar's forward and with transformers
    assert "greedy answers of the exported model: " in p.stdout and "transformers loads out/hf and generates: 7+5= " \
        "-> '12'" in p.stdout, p.stdout
    hf = tmp_path / "out" / "hf"
    assert json.loads((hf / "generation_config.json").read_text()) == {"bos_token_id": 257, "eos_token_id": 258,
                                                                       "pad_token_id": 256}
    generate = transformers.pipeline("text-generation", model=str(hf))
    answers = {q: generate(q, max_new_tokens=4, do_sample=False)[0]["generated_text"] for q in ["7+5=\n", "9+1=\n"]}
    assert answers["7+5=\n"] == "7+5=\n12"
    # transformers' greedy answer is funcpar's own (the run prints its answers to eight sums, 9+1 among them, and how
    # many of 100 it gets right; which one or two of them a 300-step model misses moves with round-off)
    line = next(ln for ln in p.stdout.splitlines() if ln.startswith("greedy answers of the exported model: "))
    own = dict(a.split("=") for a in line.split(": ", 1)[1].split(";")[0].split(", "))
    assert answers["9+1=\n"] == "9+1=\n" + own["9+1"], (answers, line)
    assert int(line.split("; ")[1].split("/")[0]) >= 95, line


@pytest.mark.subprocess
def test_ctrl_c_saves_at_the_current_step_on_every_rank_and_prints_the_resume_command(tmp_path):
    import signal

    from jobs import Job

    args = ["--mesh", "dp=2", "--steps", "100000", "--log-every", "1"]
    job = Job(tmp_path, *args)  # in its own session, as a terminal's foreground job
    try:
        job.wait_for("step     3/", timeout=120)
        os.killpg(job.proc.pid, signal.SIGINT)  # what Ctrl-C does: every process of the job gets SIGINT
        assert job.proc.wait(timeout=120) == 130
        job.wait_for("interrupted", timeout=10)
    finally:
        job.kill_all()
    line = job.seen[-1]
    step = int(line.split("interrupted at step ")[1].split(":")[0])
    out = tmp_path / "out"
    assert line == (f"funcpar: interrupted at step {step}: saved {out / 'checkpoints' / f'step-{step}'}; resume with: "
                    f"funcpar train --model llama-micro --eval-every 0 --save-every 0 --out {out} "
                    f"{' '.join(args)} --resume")
    assert (out / "checkpoints" / "latest").read_text().strip() == f"step-{step}"
    p = _funcpar(tmp_path, "train", "--model", "llama-micro", "--eval-every", "0", "--out", str(out), "--mesh", "dp=2",
                 "--steps", str(step + 1), "--resume")
    assert p.returncode == 0, p.stderr
    assert f"resumed from {out / 'checkpoints' / f'step-{step}'} at step {step}" in p.stdout


CHAT = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.mark.parametrize("sample, segments", [
    ({"type": "conversation", "rounds": [["ask", "2+2?"], ["ans", "4"]]},
     [("<|user|>2+2?</s><|assistant|>", 0), ("4</s>", 1)]),
    ({"type": "conversation", "rounds": [["ask", "a"], ["ans", "b"], ["ask", "c"], ["ans", "d"]]},
     [("<|user|>a</s><|assistant|>", 0), ("b</s>", 1), ("<|user|>c</s><|assistant|>", 0), ("d</s>", 1)]),
    ({"type": "ref_qa", "reference": "R", "rounds": [["ask", "q"], ["ans", "x"], ["ask", "more?"]]},
     [("<|system|>Reference: R</s><|user|>q</s><|assistant|>", 0), ("x</s>", 1), ("<|user|>more?</s>", 0)]),
    ({"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "q"},
                   {"role": "assistant", "content": "a"}]},
     [("<|system|>S</s><|user|>q</s><|assistant|>", 0), ("a</s>", 1)]),
])
def test_conversations_follow_the_tokenizers_chat_template_and_train_only_the_answers(tmp_path, sample, segments):
    from funcpar import data

    data.ByteTokenizer().save_pretrained(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT}))
    tok = data.HFTokenizer(tmp_path)
    ids, mask = data.encode(sample, tok)
    want_ids = [i for text, _ in segments for i in tok.encode(text)]
    want_mask = [m for text, m in segments for _ in tok.encode(text)]
    assert (ids, mask) == (want_ids, want_mask) and 258 in ids  # "</s>" is the eos token, trained after answers
    builtin = data.encode(sample, data.HFTokenizer(tmp_path, chat_template=False))  # --chat-template builtin
    assert builtin == data.encode(sample, data.ByteTokenizer())


@pytest.mark.subprocess
@pytest.mark.parametrize("args, message", [
    (["plan", "--mesh", "tp=3"], "funcpar: num_attention_heads=4 is not divisible by tp=3: tensor parallelism "
                                 "splits attention by whole heads (use tp=1, 2 or 4)"),
    (["convert", "missing", "x"], "funcpar: missing is not a checkpoint (no meta.json) and has no 'latest' file"),
    (["train", "--config", "nope.toml"], "funcpar: --config nope.toml: no such file"),
])
def test_user_errors_of_every_command_are_one_line(tmp_path, args, message):
    p = _funcpar(tmp_path, *args)
    assert p.returncode == 1 and p.stderr == message + "\n" and "Traceback" not in p.stdout


def _readme_quickstart(folder: str, data_file: str, out: str) -> int:
    """The README's Python quickstart as written, on a small model and data (sizes and paths substituted)."""
    text = (ROOT / "README.md").read_text()
    code = text.split("```python\n", 1)[1].split("```", 1)[0]
    for old, new in [('"path/to/hf-llama"', repr(folder)), ('"train.jsonl"', repr(data_file)), ("10_000", "3"),
                     ("warmup=100", "warmup=1"), ("seq_len=1024", "seq_len=16"), ("global_batch=64", "global_batch=8"),
                     ('"out/"', repr(out))]:
        assert old in code, old
        code = code.replace(old, new)
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    return int(scope["state"].step)


def test_the_readme_quickstart_ends_and_exports_a_folder_transformers_and_pipeline_load(tmp_path):
    import harness
    transformers = pytest.importorskip("transformers")

    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=264, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64))
    model.save_pretrained(tmp_path / "hf-llama")
    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"text": f"{a}+{b}={a + b}"}) + "\n"
                                                  for a in range(10) for b in range(10)))
    steps = harness.run(4, _readme_quickstart, str(tmp_path / "hf-llama"), str(tmp_path / "train.jsonl"),
                        str(tmp_path / "out"))
    assert steps == [3, 3, 3, 3]
    generate = transformers.pipeline("text-generation", model=str(tmp_path / "out"))
    assert generate("1+1=", max_new_tokens=2, do_sample=False)[0]["generated_text"].startswith("1+1=")


@pytest.mark.subprocess
def test_context_and_sequence_parallel_runs_train_and_resume_across_cp_sizes(tmp_path):
    """`funcpar train --mesh cp=2,tp=2 --sequence-parallel` trains to the end and exports; its checkpoint resumes at
    cp=4 without tp, in the contiguous layout, and continues from the step it saved."""
    args = ["train", *SMALL, "--global-batch", "8", "--seq-len", "64", "--eval-every", "0", "--save-every", "2"]
    p = _funcpar(tmp_path, *args, "--mesh", "cp=2,tp=2", "--sequence-parallel", "--steps", "2")
    assert p.returncode == 0, p.stderr
    p = _funcpar(tmp_path, *args, "--mesh", "cp=4", "--cp-layout", "contiguous", "--steps", "3", "--resume")
    assert p.returncode == 0, p.stderr
    assert [r["step"] for r in _rows(tmp_path / "out")] == [1, 2, 3]


def test_a_seq_len_cp_does_not_divide_is_refused_in_one_line():
    import funcpar as fp
    from funcpar.cli import options

    llama = fp.get_model("llama")
    mesh = fp.Mesh.abstract(cp=4)
    cfg = llama.config(options.BUILTIN_MODELS["llama-micro"], mesh)
    with pytest.raises(SystemExit, match=r"^funcpar: --mesh cp=4 splits each sequence into 8 pieces \(--cp-layout "
                                         r"zigzag\): --seq-len 68 is not a multiple of 8$"):
        options.build_step({**options.DEFAULTS, "seq_len": 68}, llama, cfg, mesh, llama.specs(cfg, mesh))
    with pytest.raises(SystemExit, match=r"^funcpar: unknown --cp-layout 'ring' \(zigzag, contiguous\)$"):
        options.build_step({**options.DEFAULTS, "cp_layout": "ring"}, llama, cfg, mesh, llama.specs(cfg, mesh))


def test_plan_ranks_cp_meshes_and_names_the_ones_seq_len_rules_out(capsys):
    """`funcpar plan --devices 2` for a model with context parallelism ranks dp x cp x tp meshes; a --seq-len the
    zig-zag layout cannot split over cp=2 (66: not a multiple of 4) is that mesh's reason, not the end of the plan."""
    from funcpar.cli import main as cli

    cli.plan(["--model", "llama-micro", "--seq-len", "66", "--global-batch", "4", "--devices", "2", "--memory", "4",
              "--zero", "1", "--no-remat", "--pipeline", "1f1b", "--micro-batches", "1"])
    out = capsys.readouterr().out
    assert any(line.startswith("dp=2,tp=1 ") for line in out.splitlines()), out
    assert "e.g. dp=1,cp=2,tp=1 zero=1): --mesh cp=2 splits each sequence into 4 pieces" in out, out


def test_plan_estimates_a_steps_time_on_named_gpus_and_says_what_it_assumed(capsys):
    from funcpar.cli import main as cli

    cli.plan(["--model", "llama-micro", "--mesh", "dp=2,tp=2", "--global-batch", "4", "--seq-len", "32",
              "--precision", "bf16", "--gpu", "h100", "--links", "nvlink,ib400"])
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("estimated step: "))
    assert "compute" in line and "dp " in line and "tp " in line, line
    # 4 rows of 32 tokens a step, dp=2 x tp=2: the job's tokens over the step's seconds, a quarter of that per rank
    got = re.search(r"estimated step: ([\d.]+) (µs|ms|s) .*; ([\d.,]+) samples/s, ([\d,]+) tokens/s for the job, "
                    r"([\d,]+) per rank", line)
    step_s = float(got[1]) * {"µs": 1e-6, "ms": 1e-3, "s": 1}[got[2]]
    samples, job, rank = (float(got[i].replace(",", "")) for i in (3, 4, 5))
    assert abs(job - 4 * 32 / step_s) <= 0.01 * job and abs(rank - job / 4) <= 1, line
    assert abs(samples - 4 / step_s) <= 0.01 * samples, line
    assert "NVIDIA H100 SXM: matmuls at 81% of 989 TFLOP/s (half)" in line and "dp over nvlink" in line, line
    with pytest.raises(SystemExit, match=r"^funcpar: --links takes two of nvlink, nvlink3, ib400, ib200, eth100, loopback "
                                         r"\(within a node, between nodes\), not 'nvlink'$"):
        cli.plan(["--model", "llama-micro", "--gpu", "h100", "--links", "nvlink"])


def test_a_tokenizer_folder_without_a_tokenizer_is_refused_naming_what_it_holds(tmp_path):
    """transformers loads a folder with only a model's config as an empty tokenizer that encodes every text to
    nothing: refused, naming the folder and its files, before any data is read."""
    from funcpar import data

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    with pytest.raises(data.DataError, match=r"^--tokenizer .* holds no tokenizer: it would encode every text to nothing "
                                             r"\(the folder has config.json; a tokenizer is tokenizer.json"):
        data.HFTokenizer(tmp_path)
    with pytest.raises(data.DataError, match=r"^--tokenizer .*nowhere: no such folder"):
        data.HFTokenizer(tmp_path / "nowhere")


def _preflight_case(d):
    (d / "bad.jsonl").write_text('{"text": "a"}\n{"text": oops}\n')
    (d / "model").mkdir()
    (d / "model" / "config.json").write_text("{}")
    (d / "prev").mkdir()
    (d / "prev" / "metrics.jsonl").write_text("")


@pytest.mark.parametrize("args, message", [
    (["--precision", "bfloat16"], "funcpar: unknown --precision 'bfloat16' (fp32, bf16, fp16)"),
    (["--mesh", "tp=8"], "funcpar: num_attention_heads=4 is not divisible by tp=8: tensor parallelism splits "
                         "attention by whole heads (use tp=1, 2 or 4)"),
    (["--data", "missing.jsonl"], "funcpar: data file missing.jsonl does not exist"),
    (["--data", "bad.jsonl"], "funcpar: bad.jsonl:2: not valid JSON (Expecting value at column 10)"),
    (["--tokenizer", "model"], "funcpar: --tokenizer model holds no tokenizer: it would encode every text to nothing "
                               "(the folder has config.json; a tokenizer is tokenizer.json, or tokenizer.model or "
                               "vocab files, beside tokenizer_config.json). Give the folder the tokenizer was saved to"),
    (["--out", "prev"], "funcpar: --out prev holds an earlier run (metrics.jsonl): pass --resume to continue it, "
                        "--overwrite to replace it, or choose another --out"),
])
def test_a_multi_rank_runs_mistakes_are_refused_before_any_rank_starts(tmp_path, monkeypatch, capsys, args, message):
    """`funcpar train --mesh dp=2,...` checks in the launching process what every rank would check before its
    first step: the ranks are never started (the launcher would fail this test), one line on stderr, nothing
    written."""
    from funcpar.cli import main as cli

    _preflight_case(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli, "launch_if_needed", lambda *a: pytest.fail("the ranks were started"))
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    mesh = [] if "--mesh" in args else ["--mesh", "dp=2"]
    with pytest.raises(SystemExit) as e:
        cli.main(["train", "--model", "llama-micro", *mesh, "--steps", "2", *args])
    out, err = capsys.readouterr()
    # (a string SystemExit is the interpreter's to print, to stderr with status 1; a ValueError is printed here)
    assert (e.value.code, err) in ((message, ""), (1, message + "\n")) and out == ""
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before


@pytest.mark.subprocess
def test_resume_is_the_runs_own_options_from_its_newest_checkpoint_and_says_what_changed(tmp_path):
    """`--resume` alone continues the run in --out with its own options (config.json, its paths absolute), from
    the newest complete checkpoint when `latest` is missing, says that a new --steps reshapes the schedule, and
    into a folder with no checkpoint is refused (a rank torchrun restarted starts such a run at step 0)."""
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": f"{a}+{a}={2 * a}"}) + "\n" for a in range(200)))
    first = ["train", *SMALL, "--mesh", "1", "--seq-len", "32", "--global-batch", "4", "--lr", "0.01",
             "--data", "d.jsonl", "--eval-every", "0", "--save-every", "2", "--steps", "2", "--out", "run"]
    p = _funcpar(tmp_path, *first)
    assert p.returncode == 0, p.stderr
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["data"] == str(tmp_path / "d.jsonl") and saved["out"] == str(tmp_path / "run")
    (tmp_path / "run" / "checkpoints" / "latest").unlink()  # (a crash between the save's two renames)
    (tmp_path / "elsewhere").mkdir()
    p = _funcpar(tmp_path / "elsewhere", "train", "--out", str(tmp_path / "run"), "--resume", "--steps", "3")
    assert p.returncode == 0, p.stderr
    assert f"resumed from {tmp_path / 'run' / 'checkpoints' / 'step-2'} at step 2" in p.stdout
    assert "funcpar: --resume (its 'latest' was missing: step-2 is the newest complete checkpoint)" in p.stdout
    assert "funcpar: warning: --steps 3 differs from the run's 2" in p.stdout
    rows = _rows(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2, 3]
    times = [r["time"] for r in rows]  # (issue 45: each row says when its step ended)
    assert times == sorted(times) and time.time() - 600 < times[0] <= time.time()
    assert json.loads((tmp_path / "run" / "config.json").read_text())["lr"] == 0.01
    p = _funcpar(tmp_path, *first[:-2], "--out", "fresh", "--steps", "1", "--resume")  # (issue 53: a typo'd --out)
    assert (p.returncode, p.stdout) == (1, ""), p.stderr
    assert p.stderr == ("funcpar: --resume: --out fresh holds no checkpoint to continue (no such folder): drop --resume "
                        "to start a new run (or check --out)\n")
    assert not (tmp_path / "fresh").exists()


def test_an_out_of_someone_elses_files_is_refused_whatever_the_flags_and_left_untouched(tmp_path):
    """A model folder or a folder of notes as --out: refused with and without --resume/--overwrite, nothing
    removed or written; a run's own folder (its options in config.json) is still claimed as before."""
    from funcpar.cli.preflight import claim_out

    model = tmp_path / "mymodel"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    (model / "model.safetensors").write_bytes(b"x")
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("mine")
    before = _snapshot(tmp_path)
    for folder, listed in ((model, "config.json, model.safetensors"), (notes, "todo.txt")):
        for resume, overwrite in ((False, False), (True, False), (False, True)):
            with pytest.raises(SystemExit, match=rf"^funcpar: --out {folder} holds files funcpar did not write "
                                                 rf"\({listed}\): funcpar writes only into a new or empty folder"):
                claim_out(folder, resume, overwrite)
    assert _snapshot(tmp_path) == before
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"steps": 3, "lr": 0.1}))
    (run / "notes.txt").write_text("kept")
    claim_out(run, False, True)
    assert sorted(p.name for p in run.iterdir()) == ["notes.txt"]


def test_a_mistyped_flag_is_one_line_with_the_flag_meant():
    for argv, message in ((["--global-bach", "4"], "funcpar: train takes no option '--global-bach' (did you mean "
                                                   "--global-batch?)"),
                          (["--zzz"], "funcpar: train takes no option '--zzz' (funcpar train --help lists its options)"),
                          (["stray"], "funcpar: train takes no argument 'stray' (funcpar train --help lists its "
                                      "options)")):
        with pytest.raises(SystemExit) as e:
            options.read_options(argv, "train")
        assert e.value.code == message
    with pytest.raises(SystemExit) as e:
        options.read_options(["--resume"], "plan")  # (a train flag: plan takes only what shapes the step)
    assert e.value.code == "funcpar: plan takes no option '--resume' (funcpar plan --help lists its options)"


def test_a_run_folder_in_use_is_refused_naming_the_run_that_holds_it(tmp_path, monkeypatch):
    """Issue 46, BAD 6: the run writing into --out holds a lock on it (flock, released with its process); a second
    run there is refused before its ranks start, naming the first's pid; once the first ends, it may go on."""
    import os

    from funcpar.cli import main as cli
    from funcpar.cli.preflight import lock_out

    out = tmp_path / "out"
    out.mkdir()
    held = lock_out(out)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli, "launch_if_needed", lambda *a: pytest.fail("the ranks were started"))
    with pytest.raises(SystemExit) as e:
        cli.main(["train", "--model", "llama-micro", "--mesh", "dp=2", "--steps", "1", "--out", "out", "--resume"])
    assert e.value.code == (f"funcpar: --out out is in use by another funcpar run (pid {os.getpid()}): wait for it to "
                            f"end, or choose another --out")
    os.close(held)  # (the first run ended)
    assert lock_out(out, hold=False) is None


def test_what_resume_would_misread_is_refused_and_a_cut_metrics_line_dropped(tmp_path, capsys):
    """Issue 46, WEAK: another --seq-len, LoRA alpha or dropout on resume is refused (the state would mean something
    else); a heartbeat that would kill a healthy job is refused; a loader state without a position is named."""
    import torch

    import funcpar as fp
    from funcpar import data
    from funcpar.cli import main as cli

    src = tmp_path / "ck"
    opts = {**options.DEFAULTS, "seq_len": 64, "lora": "r=4,alpha=8,targets=q,v"}
    cli._same_run(opts, {"seq_len": 64, "lora": cli._lora_fields(opts)}, src)  # the same: resumes
    cli._same_run(opts, {}, src)  # a checkpoint from before these were recorded: not checked
    with pytest.raises(SystemExit, match=r"^funcpar: --seq-len 64 differs from the checkpoint's 32 \(.*ck\): its "
                                         r"data position counts rows of 32 tokens"):
        cli._same_run(opts, {"seq_len": 32}, src)
    saved = cli._lora_fields({**opts, "lora": "r=4,alpha=16,targets=q,v,dropout=0.1"})
    with pytest.raises(SystemExit, match=r"^funcpar: --lora alpha=8.0 \(the checkpoint's: 16.0\), dropout=0.0 \(the "
                                         r"checkpoint's: 0.1\) differs from the run being resumed"):
        cli._same_run(opts, {"lora": saved}, src)
    with pytest.raises(SystemExit, match=r"^funcpar: --heartbeat 0.001: .* use 0 \(off\) or at least 2"):
        options.read_options(["--heartbeat", "0.001"], "train")
    loader = data.Loader(data.Dataset.from_rows(torch.zeros(8, 4, dtype=torch.long)), fp.Mesh(), 4)
    for bad in ({}, {"position": -1}):
        with pytest.raises(data.DataError, match=r"cannot resume data order: the saved loader state .* has no "
                                                 r"position"):
            loader.load_state_dict(bad)
    m = tmp_path / "metrics.jsonl"
    assert cli._parsed_row('{"step": 3, "lo', m) == {"step": float("inf")}
    assert "dropped a line that is not a whole row" in capsys.readouterr().out



def test_eval_data_holds_out_its_own_file_and_epochs_set_the_steps(tmp_path):
    """`--eval-data FILE`: every row of --data trains, the held-out rows are FILE's; `--epochs N`: --steps becomes
    N passes of whole global batches over the training rows (and the schedule is laid over them)."""
    import funcpar as fp

    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"text": "a" * 60}) + "\n" for _ in range(40)))
    (tmp_path / "held.jsonl").write_text("".join(json.dumps({"text": "b" * 60}) + "\n" for _ in range(5)))
    llama = fp.get_model("llama")
    cfg = llama.config(options.BUILTIN_MODELS["llama-micro"], fp.Mesh())
    opts = {**options.DEFAULTS, "data": str(tmp_path / "train.jsonl"), "eval_data": str(tmp_path / "held.jsonl"),
            "seq_len": 32, "global_batch": 8, "epochs": 3}
    data, train, held = options.datasets(opts, cfg)
    assert len(train) == len(data) == 40 * 61 // 32 and len(held) == 5 * 61 // 32
    rows = {k: d.take_range(0, len(d))["input_ids"] for k, d in (("held", held), ("train", train))}
    assert bool((rows["held"] == ord("b")).any()) and not bool((rows["train"] == ord("b")).any())
    assert options.with_epochs(opts, len(train))["steps"] == 3 * (len(train) // 8)
    assert options.with_epochs({**opts, "epochs": 0}, len(train))["steps"] == options.DEFAULTS["steps"]


def test_export_dtype_fp32_writes_a_bf16_runs_float32_masters(tmp_path, monkeypatch, capsys):
    """`--precision bf16` exports bf16 by default (the training dtype); `--export-dtype fp32` exports the float32
    masters, of which the bf16 export is the rounding."""
    from safetensors.torch import load_file

    from funcpar.cli import main as cli

    monkeypatch.chdir(tmp_path)
    run = ["train", "--model", "llama-micro", "--mesh", "1", "--steps", "3", "--precision", "bf16", "--lr", "1e-2",
           "--eval-every", "0", "--save-every", "0", "--global-batch", "8"]
    cli.main([*run, "--out", "auto"])
    assert "vocabulary: the tokenizer's 259 tokens use 259 of the model's vocab_size 264" in capsys.readouterr().out
    cli.main([*run, "--out", "fp32", "--export-dtype", "fp32"])
    low, full = (load_file(tmp_path / o / "hf" / "model.safetensors") for o in ("auto", "fp32"))
    assert {x.dtype for x in low.values()} == {torch.bfloat16} and {x.dtype for x in full.values()} == {torch.float32}
    assert low.keys() == full.keys() and all(torch.equal(full[k].to(torch.bfloat16), low[k]) for k in low)
    assert any(not torch.equal(full[k], low[k].float()) for k in low)  # finer than bf16: the masters
    assert json.loads((tmp_path / "fp32" / "hf" / "config.json").read_text())["dtype"] == "float32"
    with pytest.raises(SystemExit, match=r"^funcpar: --export-dtype 'f32': expected one of auto, fp32, bf16, fp16"):
        options.read_options(["--export-dtype", "f32"], "train")


def test_offload_compile_and_final_lr_switches_reach_the_step(tmp_path, monkeypatch):
    """`--offload`, `--compile on|off|auto` and `--final-lr` set what `compile_step` and the schedule already had;
    an offloaded run trains, and its last step's rate is --final-lr of the peak."""
    import funcpar as fp
    from funcpar.cli import main as cli

    llama = fp.get_model("llama")
    cfg = llama.config(options.BUILTIN_MODELS["llama-micro"], fp.Mesh())
    opts = options.read_options(["--mesh", "1", "--offload", "--compile", "off", "--final-lr", "0.25"], "train")
    step = options.build_step(opts, llama, cfg, fp.Mesh(), llama.specs(cfg))
    assert (step.options.parallel.offload, step.options.compile) == ("cpu", False)
    on = options.build_step({**opts, "offload": False, "compile": "on"}, llama, cfg, fp.Mesh(), llama.specs(cfg))
    assert (on.options.parallel.offload, on.options.compile) == (None, True)
    monkeypatch.chdir(tmp_path)
    cli.main(["train", "--model", "llama-micro", "--mesh", "1", "--steps", "4", "--warmup", "1", "--offload",
              "--compile", "off", "--final-lr", "0.25", "--lr", "1e-3", "--eval-every", "0", "--save-every", "0",
              "--global-batch", "8", "--log-every", "1"])
    lrs = [r["lr"] for r in _rows(tmp_path / "out")]
    sched = fp.optim.warmup_cosine(1e-3, 1, 4, end=0.25e-3)
    assert lrs == pytest.approx([sched(k) for k in range(4)], rel=1e-6) and lrs[-1] > 0.25e-3
    with pytest.raises(SystemExit, match=r"^funcpar: --final-lr sets where warmup_cosine ends; --schedule constant "
                                         r"keeps --lr throughout"):
        options.build_optimizer({**opts, "schedule": "constant"})


def test_convert_of_a_lora_checkpoint_says_it_holds_adapters_and_where_the_model_is(tmp_path, monkeypatch, capsys):
    from funcpar.cli import main as cli

    monkeypatch.chdir(tmp_path)
    cli.main(["train", "--model", "llama-micro", "--mesh", "1", "--steps", "1", "--lora", "r=4,alpha=8,targets=q,v",
              "--eval-every", "0", "--global-batch", "8"])
    # q: 64 -> 64, v: 64 -> 32 (2 kv heads of 16), 2 layers: r x (in + out) each
    assert (f"LoRA r=4,alpha=8,targets=q,v: {2 * 4 * (128 + 96):,} trainable parameters"
            in capsys.readouterr().out)
    with pytest.raises(SystemExit, match=r"^funcpar: out/checkpoints holds LoRA adapters \(r=4, alpha=8.0, targets "
                                         r"q,v\), not a model: funcpar convert exports whole models\. Its run wrote "
                                         r"the model with the adapters merged to out/hf and the adapters alone \(a "
                                         r"PEFT folder\) to out/adapter"):
        cli.main(["convert", "out", "exported"])
    assert not (tmp_path / "exported").exists()


def test_the_interval_line_averages_its_steps_and_the_time_left_follows_the_recent_pace(tmp_path, monkeypatch,
                                                                                         capsys):
    """A first step of 100 s (start-up) then 1 s steps: at step 20 of 100 the time left is 80 s, not 19 minutes;
    steps at 100 and 900 tokens/s read 180 tokens/s (all tokens over all the time) and MFU 18%, not 90%."""
    import torch

    from funcpar.cli import progress

    clock = [0.0]
    monkeypatch.setattr(progress.time, "time", lambda: clock[0])
    p = progress.Progress(True, tmp_path / "metrics.jsonl", 100, 10, 0, 1.0, 1000.0, torch.device("cpu"))
    p.board = None
    for step in range(1, 21):
        clock[0] += 100.0 if step == 1 else 1.0
        p.log(step, {"step": step, "loss": 1.0, "grad_norm": 1.0, "lr": 1e-3,
                     "tokens_per_s": 100.0 if step % 2 else 900.0})
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("step    20/100") and last.endswith("tok/s  MFU 18%  mem " + last.split("mem ")[1])
    assert " 180 tok/s " in last and last.endswith("eta 80s")
    assert progress.interval_rate([100.0, 900.0]) == 180.0


def test_a_vocabulary_padded_for_tp_is_said_under_the_table():
    import funcpar as fp
    from funcpar.cli.planning import vocab_note

    llama = fp.get_model("llama")
    raw = {**options.BUILTIN_MODELS["llama-micro"], "vocab_size": 259}
    cfg = llama.config(raw, fp.Mesh.abstract(tp=2))
    assert vocab_note(cfg) == ("vocabulary: vocab_size 259 padded to 384 rows, a multiple of 128 and of tp (the 125 "
                               "extra rows are never predicted and are not exported)")
    assert vocab_note(llama.config({**raw, "vocab_size": 264}, fp.Mesh.abstract(tp=2))) is None


def _sample_tp(prompts, tp):
    import harness

    import funcpar as fp
    from funcpar.data import ByteTokenizer
    from funcpar.cli.generate import sample_on_mesh

    mesh = harness.mesh(tp=tp)
    llama = fp.get_model("llama")
    cfg = llama.config({**options.BUILTIN_MODELS["llama-micro"], "vocab_size": 259}, mesh)  # blocks of 192 and 67
    params = fp.shard(llama.init(cfg, seed=3), llama.specs(cfg, mesh), mesh)
    return sample_on_mesh(llama, params, cfg, mesh, ByteTokenizer(), prompts, 12)


@pytest.mark.parametrize("tp", [2, 4])
def test_samples_on_a_tp_mesh_are_the_single_process_greedy_continuations(tp):
    """The argmax over a vocabulary split unevenly over tp picks what one process picks: tp=2 holds 192 and 67
    columns, tp=4 96, 96, 67 and none (a rank whose block is all padding)."""
    import harness

    import funcpar as fp
    from funcpar.data import ByteTokenizer
    from funcpar.cli.generate import greedy

    prompts = ["7+5=\n", "hello", "a"]
    llama = fp.get_model("llama")
    cfg = llama.config({**options.BUILTIN_MODELS["llama-micro"], "vocab_size": 259}, fp.Mesh())
    params, tok = llama.init(cfg, seed=3), ByteTokenizer()
    want = [tok.decode(n) for n in greedy(lambda x: llama.forward(params, x, cfg, fp.Mesh()),
                                          [tok.encode(p) for p in prompts], tok.eos_id, 12)]
    got = harness.run(tp, _sample_tp, prompts, tp)
    assert got == [want] * tp and any(want)


def test_sample_prompts_are_shown_at_each_evaluation_and_kept_per_step(tmp_path, monkeypatch, capsys):
    import funcpar as fp
    from funcpar.cli import main as cli

    def fp_mesh():
        return fp.Mesh()

    monkeypatch.chdir(tmp_path)
    (tmp_path / "prompts.txt").write_text("7+5=\\n\n2+2=\\n\n")
    run = ["train", "--model", "llama-micro", "--mesh", "1", "--global-batch", "8", "--eval-every", "2",
           "--sample-prompts", "prompts.txt", "--sample-tokens", "3", "--save-every", "2"]
    cli.main([*run, "--steps", "4"])
    out = capsys.readouterr().out
    assert "sample at step 2: '7+5=\\n' -> '" in out and "sample at step 4: '2+2=\\n' -> '" in out
    rows = [json.loads(x) for x in (tmp_path / "out" / "samples.jsonl").read_text().splitlines()]
    assert [(r["step"], r["prompt"]) for r in rows] == [(s, p) for s in (2, 4) for p in ("7+5=\n", "2+2=\n")]
    assert all(len(r["completion"].encode()) <= 3 for r in rows)
    (tmp_path / "out" / "checkpoints" / "latest").write_text("step-2\n")  # resume from step 2: step 4 again
    cli.main([*run, "--steps", "4", "--resume"])
    again = [json.loads(x) for x in (tmp_path / "out" / "samples.jsonl").read_text().splitlines()]
    assert again == rows  # the same samples, step 4's written once
    with pytest.raises(SystemExit, match=r"^funcpar: --sample-prompts decodes with the model where it trains, which "
                                         r"a pp axis splits"):
        cli.main(["train", "--mesh", "pp=2", "--sample-prompts", "prompts.txt", "--out", "x"])
    from funcpar.cli import preflight
    from funcpar.models import gpt2

    cfg = gpt2.Config(vocab_size=264, n_embd=32, n_layer=2, n_head=2, n_positions=8)
    opts = {**options.DEFAULTS, "sample_prompts": "prompts.txt", "sample_tokens": 4, "seq_len": 8}
    with pytest.raises(SystemExit, match=r"^funcpar: --sample-prompts prompts.txt: the prompt '7\+5=\\n' and "
                                         r"--sample-tokens 4 need 9 positions, beyond the model's n_positions 8"):
        preflight.check_run(opts, cfg, fp_mesh(), 100, 5)


class _FakeTracker:
    """What a tracker package was asked: the calls of ``wandb`` or ``mlflow`` as funcpar makes them."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        import types

        def call(*args, **kwargs):
            self.calls.append((name, args, kwargs))
            if name == "start_run":
                return types.SimpleNamespace(info=types.SimpleNamespace(run_id=kwargs.get("run_id") or "mlf-1"))
            return None
        return call


def test_track_sends_each_row_to_wandb_and_mlflow_and_a_resumed_run_continues_the_same_runs(tmp_path, monkeypatch):
    import sys as _sys

    from funcpar.cli import main as cli

    wandb, mlflow = _FakeTracker(), _FakeTracker()
    monkeypatch.setitem(_sys.modules, "wandb", wandb)
    monkeypatch.setitem(_sys.modules, "mlflow", mlflow)
    monkeypatch.chdir(tmp_path)
    run = ["train", "--model", "llama-micro", "--mesh", "1", "--global-batch", "8", "--eval-every", "2",
           "--save-every", "2", "--track", "wandb,mlflow", "--project", "arith"]
    cli.main([*run, "--steps", "2"])
    init = next(kw for name, _, kw in wandb.calls if name == "init")
    assert (init["project"], init["resume"], init["config"]["lr"]) == ("arith", "allow", 3e-3)
    logged = [(kw["step"], a[0]) for name, a, kw in wandb.calls if name == "log"]
    assert [s for s, _ in logged] == [1, 2] and "eval_loss" in logged[1][1] and "loss" in logged[0][1]
    assert [n for n, _, _ in wandb.calls][-1] == "finish"
    assert [kw["step"] for name, _, kw in mlflow.calls if name == "log_metrics"] == [1, 2]
    assert ("set_experiment", ("arith",), {}) in mlflow.calls
    assert sum(name == "log_params" for name, _, _ in mlflow.calls) == 1
    ids = json.loads((tmp_path / "out" / "trackers.json").read_text())
    assert init["id"] == ids["run_id"] and ids["mlflow_run_id"] == "mlf-1"
    wandb.calls.clear()
    mlflow.calls.clear()
    cli.main([*run, "--steps", "4", "--resume"])  # the same tracked runs, continued; parameters not logged again
    assert next(kw for name, _, kw in wandb.calls if name == "init")["id"] == ids["run_id"]
    assert next(kw for name, _, kw in mlflow.calls if name == "start_run")["run_id"] == "mlf-1"
    assert not any(name == "log_params" for name, _, _ in mlflow.calls)
    assert [kw["step"] for name, _, kw in mlflow.calls if name == "log_metrics"] == [3, 4]
    monkeypatch.setitem(_sys.modules, "mlflow", None)  # not installed
    with pytest.raises(SystemExit, match=r"^funcpar: --track mlflow needs the mlflow package, which is not "
                                         r"installed: pip install mlflow"):
        cli.main([*run, "--steps", "2", "--out", "other"])


def test_plan_for_cuda_on_a_machine_without_a_gpu(capsys):
    """`funcpar plan --device cuda` (or `--gpu`) plans a GPU's memory on a machine without one: meta tensors stand
    for the GPU's, the step's host tensors too, and no host process is added to the peak (issue 57: it was refused,
    "no GPU is visible here")."""
    from funcpar.cli import main as cli

    args = ["--model", "llama-micro", "--mesh", "dp=2,tp=2", "--global-batch", "4", "--seq-len", "32"]
    cli.plan(args + ["--device", "cpu"])
    cpu = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("traced step"))
    assert "+ runtime" in cpu, cpu
    cli.plan(args + ["--device", "cuda"])
    cuda = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("traced step"))
    assert "+ runtime" not in cuda and "peak" in cuda, cuda
    cli.plan(args + ["--gpu", "a100", "--precision", "bf16"])  # (--device auto: the plan is for the GPUs named)
    out = capsys.readouterr().out
    assert "+ runtime" not in next(x for x in out.splitlines() if x.startswith("traced step"))
    assert "NVIDIA A100 SXM" in next(x for x in out.splitlines() if x.startswith("estimated step: "))
