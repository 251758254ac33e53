"""Issue 56, the WEAK list: bad input the CLI and the API took badly (a traceback, a silent choice, a run that
fails late or retries in vain) is refused in one line naming the file, flag or leaf and what to do, or works.

Each test is one item of the list, in-process: ``funcpar plan``'s own numbers and ``--parts``; a Mixtral planned on
meta tensors; ``--lora`` regexes and repeated keys; an empty ``--out``; an empty data source, held-out file or
binary ``--sample-prompts`` named; a sharded index whose ``weight_map`` is not an object; integer or non-finite
weights; a stored head beside ``tie_word_embeddings``; a user error not restarted; ``--resume`` over a run whose
checkpoints are gone; ``convert RUN`` with the run's tokenizer; an ``--out`` that cannot be written.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import funcpar as fp
from funcpar.cli import launch
from funcpar.cli import main as cli
from funcpar.cli import options
from funcpar.cli.options import BUILTIN_MODELS, read_options

SMALL = ["--model", "llama-micro", "--mesh", "1", "--global-batch", "8", "--eval-every", "0"]


def _hf_folder(folder: Path, max_shard_size="2GB") -> Path:
    """llama-micro as an HF folder (funcpar's own export: float32, untied)."""
    model, mesh = fp.get_model("llama"), fp.Mesh()
    cfg = model.config(BUILTIN_MODELS["llama-micro"], mesh)
    fp.hf.save(folder, model.init(cfg, seed=0), model, cfg, mesh, max_shard_size=max_shard_size)
    return folder


def _rewrite(folder: Path, change, config=None) -> Path:
    """``folder``'s model.safetensors with ``change(tensors)`` applied, and config.json updated by ``config``."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    change(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    if config:
        raw = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**raw, **config}))
    return folder


# ------------------------------------------------------------------------------- 1. plan's own numbers, --parts


@pytest.mark.parametrize("args, message", [
    (["--devices", "0"], "funcpar: --devices 0: expected the number of devices to rank meshes of (1 or more)"),
    (["--devices", "-4"], "funcpar: --devices -4: expected the number of devices to rank meshes of (1 or more)"),
    (["--devices", "2", "--memory", "-5"],
     "funcpar: --memory -5: expected each device's memory in GiB, a positive number (e.g. 80)"),
    (["--devices", "2", "--memory", "nan"],
     "funcpar: --memory nan: expected each device's memory in GiB, a positive number (e.g. 80)"),
    (["--devices", "2", "--gpu", "h100", "--efficiency", "0"],
     "funcpar: --efficiency 0: expected the share of the datasheet's matmul rate a large matmul reaches, above 0 and "
     "at most 1 (default 0.81, measured)"),
    (["--threads", "0"], "funcpar: --threads 0: expected threads a rank, 1 or more"),
    (["--devices", "2", "--gpu", "h100", "--gpus-per-node", "0"], "funcpar: --gpus-per-node 0: expected 1 or more"),
    (["--mesh", "pp=2", "--parts", "1e308,-1e308"],
     "funcpar: bad --parts entry '1e308': expected layer counts such as 3,5 or 2.5,1.5"),
    (["--mesh", "pp=2", "--parts", "nan,2"], "funcpar: bad --parts entry 'nan': expected layer counts such as 3,5 or "
                                             "2.5,1.5"),
])
def test_plan_refuses_a_device_count_memory_or_parts_out_of_range(args, message):
    with pytest.raises(SystemExit) as e:
        cli.main(["plan", "--model", "llama-micro", *args])
    assert e.value.code == message


# --------------------------------------------------------------------------------- 2. a Mixtral planned on meta


def test_a_mixtral_folder_is_planned_on_meta_tensors(tmp_path, monkeypatch, capsys):
    """Its router counts assignments with ``torch.bincount``, which has no meta kernel: the trace gives its shape."""
    from transformers import MixtralConfig

    from funcpar.cli import planning

    with planning.MemoryTrace():
        counts = torch.bincount(torch.zeros(6, dtype=torch.long, device="meta"), minlength=4)
        weighted = torch.bincount(torch.zeros(6, dtype=torch.long, device="meta"),
                                  torch.zeros(6, device="meta"), minlength=3)
    assert (counts.shape, counts.dtype, counts.is_meta, weighted.shape, weighted.dtype) == (
        (4,), torch.int64, True, (3,), torch.float32)
    MixtralConfig(vocab_size=264, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                  max_position_embeddings=256).save_pretrained(tmp_path)
    monkeypatch.setattr(planning, "runtime_bytes", lambda: 0)  # (the host's own: a subprocess, not the point here)
    cli.main(["plan", "--model", str(tmp_path), "--mesh", "1", "--global-batch", "4", "--seq-len", "16"])
    out = capsys.readouterr().out
    assert out.startswith("mixtral on Mesh(pp=1, dp=1, tp=1): ")
    assert "traced step, 4 x 16 tokens per rank in 1 micro-batch(es): activations " in out


# -------------------------------------------------------------------------------------------------- 3. --lora


@pytest.mark.parametrize("lora, message", [
    ("targets=(", "funcpar: --lora 'targets=(': LoRA target '(' is not a valid regular expression (missing ), "
                  "unterminated subpattern at position 0): name a module (q, v, q_proj, ...) or give a path regex such "
                  "as 'layers\\.\\d+\\.wq'"),
    ("r=4,targets=q,targets=v", "funcpar: --lora 'r=4,targets=q,targets=v': 'targets' is given twice: list the "
                                "modules after one targets=, e.g. targets=q,v"),
    ("r=4,alpha=8,r=8", "funcpar: --lora 'r=4,alpha=8,r=8': 'r' is given twice: give it once"),
])
def test_lora_refuses_a_bad_regex_and_a_repeated_key_with_the_options(lora, message):
    with pytest.raises(SystemExit) as e:
        read_options(["--lora", lora], "train")
    assert e.value.code == message
    with pytest.raises(fp.lora.LoraError):
        fp.lora.LoraConfig(targets=("layers\\.(\\d+",))
    assert fp.lora.LoraConfig.parse("r=4,targets=q,v,layers\\.\\d+\\.wo").targets == ("q", "v", "layers\\.\\d+\\.wo")


# --------------------------------------------------------------------------------------------------- 4. --out ''


@pytest.mark.parametrize("out", ["", "  "])
def test_an_empty_out_is_refused(out):
    with pytest.raises(SystemExit) as e:
        read_options(["--out", out], "train")
    assert e.value.code == (f"funcpar: --out {out!r}: name the run folder (an empty --out would write the run into "
                            f"the working directory)")


# ------------------------------------------------------------------------------------ 5. data errors name the file


def _data(tmp_path) -> tuple[Path, Path]:
    good, empty = tmp_path / "a.jsonl", tmp_path / "empty.jsonl"
    good.write_text("".join(json.dumps({"text": f"{k}+{k}={2 * k}"}) + "\n" for k in range(300)))
    empty.write_text("")
    return good, empty


@pytest.mark.parametrize("flags, message", [
    (lambda a, e: ["--data", f"{a}:1,{e}:1"], "--data {e}: the data holds 0 tokens, not enough for one row of "
                                              "seq_len=64"),
    (lambda a, e: ["--data", str(a), "--eval-data", str(e)], "--eval-data {e}: the data holds 0 tokens, not enough "
                                                             "for one row of seq_len=64"),
])
def test_an_empty_data_source_or_held_out_file_is_named(tmp_path, flags, message):
    good, empty = _data(tmp_path)
    opts = read_options(["--model", "llama-micro", *flags(good, empty)], "train")
    cfg = options.model_config("llama-micro", fp.Mesh.abstract())[1]
    with pytest.raises(fp.data.DataError) as e:
        options.datasets(opts, cfg)
    assert str(e.value) == message.format(e=empty)


def test_undecodable_sample_prompts_are_named(tmp_path):
    from funcpar.cli import preflight

    prompts = tmp_path / "prompts.txt"
    prompts.write_bytes(b"\x88\xff\x00binary")
    opts = read_options(["--model", "llama-micro", "--sample-prompts", str(prompts)], "train")
    cfg = options.model_config("llama-micro", fp.Mesh.abstract())[1]
    with pytest.raises(SystemExit) as e:
        preflight.check_run(opts, cfg, fp.Mesh.abstract(), 100, 10)
    assert e.value.code == (f"funcpar: --sample-prompts {prompts}: not UTF-8 text (byte 0: invalid start byte): give "
                            f"a .txt or .jsonl file of prompts")


# ----------------------------------------------------------------------------------- 6. a weight_map of a wrong type


@pytest.mark.parametrize("index, what", [
    ({"metadata": {}, "weight_map": ["model.norm.weight"]}, "it has a 'weight_map' that is an array"),
    ({"metadata": {}, "weight_map": "model-00001-of-00005.safetensors"}, "it has a 'weight_map' that is a string"),
    ({"metadata": {}}, "it has no 'weight_map'"),
    ([1, 2], "it holds an array"),
])
def test_an_index_whose_weight_map_is_not_an_object_is_named(tmp_path, index, what):
    folder = _hf_folder(tmp_path / "model", max_shard_size="100KB")
    path = folder / "model.safetensors.index.json"
    path.write_text(json.dumps(index))
    with pytest.raises(fp.hf.HFError) as e:
        fp.hf.load(folder)
    assert str(e.value) == (f"corrupt index {path}: {what}, expected an object whose 'weight_map' maps each tensor "
                            f"name to its .safetensors file: restore the file from the model's source")


# ------------------------------------------------------------------------------- 7. integer or non-finite weights


@pytest.mark.parametrize("dtype", [None, torch.float32])
def test_integer_weights_are_refused_naming_the_tensor_and_file(tmp_path, dtype):
    def to_int(t):
        t.update({k: (v * 1000).long() for k, v in t.items()})

    folder = _rewrite(_hf_folder(tmp_path / "model"), to_int)
    with pytest.raises(fp.hf.HFError) as e:
        fp.hf.load(folder, dtype=dtype)
    assert str(e.value) == (f"{folder / 'model.safetensors'}: tensor 'model.embed_tokens.weight' is int64, not a "
                            f"floating-point dtype: a model's weights are float32, bfloat16 or float16 (a quantized or "
                            f"converted file?); load the model's original weights")


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_non_finite_weight_is_refused_by_load_and_by_convert(tmp_path, value, capsys):
    def poison(t):
        t["model.layers.1.mlp.down_proj.weight"][3, 5] = value

    folder = _rewrite(_hf_folder(tmp_path / "model"), poison)
    message = (f"{folder / 'model.safetensors'}: tensor 'model.layers.1.mlp.down_proj.weight' holds {value} at "
               f"[3, 5]: a weight that is not finite would make every loss NaN; load the model's original weights")
    for dtype in (None, torch.bfloat16):
        with pytest.raises(fp.hf.HFError) as e:
            fp.hf.load(folder, dtype=dtype)
        assert str(e.value) == message
    with pytest.raises(SystemExit) as e:
        cli.main(["convert", str(folder), str(tmp_path / "ckpt")])
    assert e.value.code == 1 and capsys.readouterr().err == f"funcpar: {message}\n"
    assert not (tmp_path / "ckpt").exists()


# --------------------------------------------------------------------------- 8. a stored head beside tied embeddings


def test_a_stored_head_beside_tie_word_embeddings_is_refused_unless_equal(tmp_path):
    folder = _rewrite(_hf_folder(tmp_path / "model"), lambda t: None, {"tie_word_embeddings": True})
    with pytest.raises(fp.hf.HFError) as e:
        fp.hf.load(folder)
    assert str(e.value) == (f"{folder / 'config.json'} says tie_word_embeddings: true, so the head is "
                            f"'model.embed_tokens.weight', but the folder also stores a different 'lm_head.weight' "
                            f"(model.safetensors) that would be dropped: set tie_word_embeddings to false to train with "
                            f"that head, or remove the tensor to tie them")

    def same(t):
        t["lm_head.weight"] = t["model.embed_tokens.weight"].clone()

    params, cfg = fp.hf.load(_rewrite(folder, same))  # (a copy of the embedding: nothing is lost)
    assert cfg.tie_word_embeddings and "lm_head" not in params


# -------------------------------------------------------------------------------- 9. a user error is not restarted


def test_a_user_error_is_reported_as_not_worth_a_restart(tmp_path, monkeypatch):
    """A refusal (SystemExit) or funcpar's own error (a ValueError: a NaN loss, a bad file) is reported with
    ``retry: false``; a system error (OSError: a full disk, a lost file system) may pass on a restart."""
    err = tmp_path / "error.json"
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("FUNCPAR_LAUNCHER", "1")
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(err))
    with pytest.raises(SystemExit):
        cli.main(["train", "--lr", "inf"])
    said = json.loads(err.read_text())
    assert (said["message"], said["retry"]) == ("funcpar: --lr inf: must be a finite number", False)
    for error, retry in ((fp.StepError("step 3: the loss is nan"), False), (OSError("No space left on device"), True)):
        def failing(argv, error=error):
            raise error

        monkeypatch.setattr(cli, "plan", failing)
        with pytest.raises(SystemExit):
            cli.main(["plan"])
        said = json.loads(err.read_text())
        assert (said["message"], said["retry"]) == (f"funcpar: {error}", retry)


def test_the_launcher_spends_no_restart_on_a_failure_that_would_repeat(monkeypatch, capsys):
    from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    def failure(message, retry):
        return SimpleNamespace(exitcode=1, timestamp=0, signal_name=lambda: "",
                               error_file_data={"message": message, "timestamp": 0, "printed": False, "retry": retry})

    for retry, left in ((False, 0), (True, 2)):
        result = RunResult(state=WorkerState.FAILED, failures={
            0: failure("funcpar: step 3: the loss is nan", retry),
            1: failure(f"funcpar: rank 1 ended: {launch.PEER_LOST}", True)})
        monkeypatch.setattr(LocalElasticAgent, "_monitor_workers", lambda agent, group, result=result: result)
        agent = SimpleNamespace(_remaining_restarts=2)
        with launch._restarts_said(2):
            assert LocalElasticAgent._monitor_workers(agent, None) is result
        assert agent._remaining_restarts == left
        # a restart says why before it happens; without one the job's summary says it, once
        assert capsys.readouterr().err == ("funcpar: step 3: the loss is nan (rank 0)\n" if retry else "")


def test_an_infinite_float_option_is_refused():
    for flag in ("--lr", "--clip", "--weight-decay"):
        with pytest.raises(SystemExit) as e:
            read_options([flag, "inf"], "train")
        assert e.value.code == f"funcpar: {flag} inf: must be a finite number"
    assert read_options(["--lr", "1e308"], "train")["lr"] == 1e308  # (finite: its NaN loss is not retried)


# ------------------------------------------------------- 10, 11. a run's checkpoints gone; convert RUN's tokenizer


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A finished one-step run of llama-micro (checkpoints/, hf/ with the byte tokenizer's files)."""
    out = tmp_path_factory.mktemp("finished") / "run"
    cli.main(["train", *SMALL, "--steps", "1", "--save-every", "0", "--out", str(out)])
    assert (out / "hf" / "tokenizer.json").is_file()
    return out


@pytest.mark.parametrize("restart", ["0", "1"])
def test_resume_of_a_run_whose_checkpoints_are_gone_keeps_its_export(tmp_path, finished_run, monkeypatch, restart):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    shutil.rmtree(run / "checkpoints")
    export = {p.name: p.read_bytes() for p in (run / "hf").iterdir()}
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", restart)  # (1: a restarted rank, which resumes by itself)
    with pytest.raises(SystemExit) as e:
        cli.main(["train", *SMALL, "--steps", "2", "--out", str(run), *(["--resume"] if restart == "0" else [])])
    assert e.value.code == (f"funcpar: --resume: the run in {run} exported {run / 'hf'}, but its {run / 'checkpoints'} "
                            f"is gone: there is nothing to continue, and training from step 0 would replace that "
                            f"export; restore the checkpoints, or pass --overwrite (without --resume) to start a new "
                            f"run there")
    assert {p.name: p.read_bytes() for p in (run / "hf").iterdir()} == export


def test_convert_of_a_run_writes_its_tokenizer(tmp_path, finished_run):
    cli.main(["convert", str(finished_run), str(tmp_path / "exported")])
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "config.json"):
        assert (tmp_path / "exported" / name).read_bytes() == (finished_run / "hf" / name).read_bytes(), name


# --------------------------------------------------------------------------------------- 12. an unwritable --out


@pytest.mark.parametrize("blocked, out, what", [
    ("parent", "parent/run", "the folder {blocked} it is to be made in"),
    ("parent", "parent/a/b", "the folder {blocked} it is to be made in"),
    ("out", "out", "it"),
])
def test_an_unwritable_out_is_refused_before_anything_is_built(tmp_path, monkeypatch, blocked, out, what):
    """As if ``chmod a-w`` (the tests may run as root, whom the mode does not stop): ``os.access`` says no."""
    blocked, out = tmp_path / blocked, tmp_path / out
    blocked.mkdir()
    access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: Path(p) != blocked and access(p, mode, **kw))
    monkeypatch.setattr(cli, "_setup_run", lambda *a: pytest.fail("built the run"))
    with pytest.raises(SystemExit) as e:
        cli.main(["train", *SMALL, "--steps", "1", "--out", str(out)])
    assert e.value.code == (f"funcpar: --out {out}: {what.format(blocked=blocked)} is not writable by this user: make "
                            f"it writable, or choose another --out")
    assert list(blocked.iterdir()) == []
