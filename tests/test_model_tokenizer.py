"""Issue 53, item 2: `--model FOLDER` trains with the folder's own tokenizer unless told otherwise.

It once trained with the byte tokenizer, and the export shipped a 260-token tokenizer without the chat template, so
`pipeline(...)(messages)` on it failed. HF Trainer, TRL, axolotl and torchtune take the model's tokenizer.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import hf_fixtures

ROOT = Path(__file__).resolve().parents[1]
SUMS = [(3, 4), (2, 5), (6, 1), (8, 0)]


def _chat(a: int, b: int, answer: bool = True) -> list[dict]:
    turns = [{"role": "system", "content": "You add."}, {"role": "user", "content": f"What is {a} plus {b}?"}]
    return turns + ([{"role": "assistant", "content": f"It is {a + b}."}] if answer else [])


def _qwen2_folder(folder: Path, with_tokenizer: bool = True) -> None:
    import transformers as tf

    texts = [json.dumps(_chat(a, b)) for a in range(10) for b in range(10)]
    vocab = len(hf_fixtures.chatml_tokenizer(folder, texts)) if with_tokenizer else 320
    tf.Qwen2ForCausalLM(tf.Qwen2Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                       tie_word_embeddings=True)).save_pretrained(folder)


def _funcpar(cwd, *args):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    env.pop("RANK", None)
    return subprocess.run([sys.executable, "-m", "funcpar", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600)


@pytest.mark.subprocess
def test_a_qwen2_folder_trains_with_its_own_tokenizer_and_its_export_answers_chat_messages(tmp_path):
    import transformers

    model = tmp_path / "qwen2"
    _qwen2_folder(model)
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps({"messages": _chat(a, b)}) + "\n" for a, b in SUMS * 8))
    p = _funcpar(tmp_path, "train", "--model", str(model), "--data", "chat.jsonl", "--mesh", "1", "--steps", "60",
                 "--seq-len", "64", "--global-batch", "8", "--lr", "3e-3", "--warmup", "5", "--eval-every", "0",
                 "--save-every", "0", "--log-every", "30", "--eval-fraction", "0")
    assert p.returncode == 0, p.stderr
    hf = tmp_path / "out" / "hf"
    ours, exported = (transformers.AutoTokenizer.from_pretrained(str(f)) for f in (model, hf))
    assert f"funcpar train: the tokenizer of --model {model} ({len(ours)} ids, its chat template)" in p.stdout
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert saved["tokenizer"] == str(model)  # (a resume or convert reads the tokenizer the run used)
    assert exported.chat_template == ours.chat_template and exported.get_vocab() == ours.get_vocab()
    assert (exported.eos_token, exported.pad_token, len(exported)) == ("<|im_end|>", "<|endoftext|>", len(ours))
    generate = transformers.pipeline("text-generation", model=str(hf))
    for a, b in SUMS[:2]:
        reply = generate(_chat(a, b, answer=False), max_new_tokens=8, do_sample=False)[0]["generated_text"][-1]
        assert reply == {"role": "assistant", "content": f"It is {a + b}."}, reply


def test_a_folder_without_a_tokenizer_is_refused_unless_a_tokenizer_is_named(tmp_path, monkeypatch):
    from funcpar.cli import main as cli

    model = tmp_path / "bare"
    _qwen2_folder(model, with_tokenizer=False)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        cli.main(["train", "--model", str(model), "--mesh", "1", "--steps", "1"])
    assert e.value.code == (f"funcpar: --model {model} holds no tokenizer (no tokenizer.json, tokenizer.model or "
                            f"vocab files): give --tokenizer FOLDER (the one the model was trained with), or "
                            f"--tokenizer byte (funcpar's 259 byte ids, for a model trained on them)")
    assert not (tmp_path / "out").exists()
    cli.main(["train", "--model", str(model), "--mesh", "1", "--steps", "1", "--tokenizer", "byte", "--eval-every",
              "0", "--seq-len", "32"])
    assert json.loads((tmp_path / "out" / "config.json").read_text())["tokenizer"] == "byte"
