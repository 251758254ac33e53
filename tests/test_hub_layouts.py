"""Hub layouts read and written as they are: for every built-in model transformers implements, the folder its
``save_pretrained`` writes with its defaults (the layout of the Hub's checkpoints) loads with ``fp.hf.load`` at
Mesh(), gives transformers' logits, and ``fp.hf.save`` writes it back under the same names, bit for bit. Baichuan
and ChatGLM are not here: transformers has no class for them (their Hub folders carry remote code), and their own
tests read hand-written folders. A folder whose names fit none of a model's layouts is refused in one line."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from safetensors.torch import save_file

import funcpar as fp
from hf_fixtures import CONFIGS, GLM_CONFIGS, batch, folder_tensors

tf = pytest.importorskip("transformers")
CONFIGS = {
    **{kind: CONFIGS[kind] for kind in ("llama", "mistral", "qwen2", "llama_tied", "gpt2", "bloom", "mixtral")},
    "glm": GLM_CONFIGS["glm"],  # partial rotary, fused gate_up_proj
}


def _tensors(folder):
    return folder_tensors(folder)


def _saved(kind, folder):
    """A transformers model of ``kind`` saved by ``save_pretrained`` with its defaults."""
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(CONFIGS[kind]()).eval()
    with torch.no_grad():  # non-trivial norms and biases, so that a mix-up would show
        for name, p in model.named_parameters():
            if "norm" in name or "ln_" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(folder)
    return model


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_a_folder_save_pretrained_writes_by_default_loads_and_is_written_back_as_it_was(kind, tmp_path):
    model = _saved(kind, tmp_path / "hf")
    b = batch()
    with torch.no_grad():
        ref = model(input_ids=b["input_ids"]).logits
    params, cfg = fp.hf.load(tmp_path / "hf")
    spec = fp.get_model(cfg.model_type)
    logits = spec.forward(params, b["input_ids"], cfg, fp.Mesh())
    assert (logits - ref).abs().max().item() <= 1e-5 * max(ref.abs().max().item(), 1.0), kind
    fp.hf.save(tmp_path / "out", params, spec, cfg)
    want, got = _tensors(tmp_path / "hf"), _tensors(tmp_path / "out")
    assert sorted(got) == sorted(want), (kind, sorted(set(got) ^ set(want)))
    for name, t in want.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), (kind, name)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_a_folder_that_does_not_fit_is_refused_in_one_line_with_counts_and_names(kind, tmp_path):
    _saved(kind, tmp_path / "hf")
    t = _tensors(tmp_path / "hf")
    layer1 = sorted(n for n in t if ".1." in n)  # the second layer's tensors
    shown = ", ".join(f"{n} {list(t[n].shape)}" for n in layer1[:3])
    for n in layer1:
        del t[n]
    t["model.extra.weight"] = torch.zeros(3)
    save_file(t, str(tmp_path / "hf" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(fp.hf.HFError) as e:
        fp.hf.load(tmp_path / "hf")
    msg = str(e.value)
    assert "\n" not in msg, msg
    assert f"does not match model '{fp.get_model(kind).name}' built from its config.json: missing ({len(layer1)}): " \
           f"{shown} and {len(layer1) - 3} more; unexpected (1): model.extra.weight [3] in model.safetensors: " \
           f"check that config.json is the one saved with these weights" in msg, msg

