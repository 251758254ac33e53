"""A config's ``pad_token_id`` in the Llama family (Llama, Mistral, Qwen2) and Mixtral: transformers builds the
embedding as ``nn.Embedding(vocab, hidden, padding_idx=pad_token_id)``, so the padding row is looked up like any
other but learns nothing from those lookups (a tied head still trains it), and starts at zero. funcpar's gradients
equal transformers' on batches holding the padding token; a negative id counts from the vocabulary's end as there;
one that is no row is refused by name."""

import pytest
import torch

import funcpar as fp
from funcpar.models import llama, mixtral
from hf_fixtures import checkpoint_tensors

tf = pytest.importorskip("transformers")

V, PAD = 96, 5
SMALL = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
CASES = {  # name: (transformers model class, config, funcpar module)
    "llama": (tf.LlamaForCausalLM, tf.LlamaConfig(**SMALL, pad_token_id=PAD), llama),
    "llama_tied_last_row": (tf.LlamaForCausalLM, tf.LlamaConfig(**SMALL, pad_token_id=-1, tie_word_embeddings=True),
                            llama),
    "mistral": (tf.MistralForCausalLM, tf.MistralConfig(**SMALL, pad_token_id=PAD, sliding_window=None), llama),
    "qwen2": (tf.Qwen2ForCausalLM, tf.Qwen2Config(**SMALL, pad_token_id=PAD), llama),
    "mixtral": (tf.MixtralForCausalLM, tf.MixtralConfig(**SMALL, pad_token_id=PAD, num_local_experts=4,
                                                        num_experts_per_tok=2), mixtral),
}


def _batch(pad):
    ids = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(1))
    ids[0, 3] = ids[0, 8] = ids[1, 0] = pad  # looked up in the middle, so later positions see the row
    return {"input_ids": ids, "labels": ids.clone()}


@pytest.mark.parametrize("name", sorted(CASES))
def test_padding_row_gets_no_gradient_from_lookups_as_in_transformers(name, tmp_path):
    cls, config, module = CASES[name]
    torch.manual_seed(0)
    model = cls(config).eval()
    row = config.pad_token_id % V
    assert model.model.embed_tokens.weight[row].abs().max() == 0  # transformers starts the row at zero
    with torch.no_grad():  # a row that is not zero, so that lookups of it change the loss
        model.model.embed_tokens.weight[row] = torch.randn(config.hidden_size) * 0.5
    model.save_pretrained(tmp_path / "ckpt")  # (Mixtral's experts one tensor each, as transformers writes them)
    batch = _batch(row)
    out = model(**batch)
    out.loss.backward()
    with torch.no_grad():  # the gradients under the names transformers writes (its save converts the layout)
        for p in model.parameters():
            p.copy_(p.grad)
    model.save_pretrained(tmp_path / "ref")
    ref = checkpoint_tensors(tmp_path / "ref")

    params, cfg = fp.hf.load(tmp_path / "ckpt")
    assert cfg.pad_token_id == row and fp.get_model(cfg.model_type) is module.MODEL
    mesh = fp.Mesh()
    grads, loss = torch.func.grad_and_value(lambda p: module.loss(p, batch, cfg, mesh))(params)
    assert abs(loss.item() - out.loss.item()) <= 1e-5 * out.loss.item(), name
    fp.hf.save(tmp_path / "grads", grads, module.MODEL, cfg)  # the gradients under transformers' names
    got = checkpoint_tensors(tmp_path / "grads")
    assert sorted(got) == sorted(ref), name
    for n, r in ref.items():
        assert (got[n] - r).abs().max().item() <= 1e-5 * r.abs().max().item() + 1e-9, (name, n)
    table = got["model.embed_tokens.weight"]
    if config.tie_word_embeddings:  # the head's use of the row still trains it, in both
        assert table[row].abs().max() > 0
    else:
        assert table[row].abs().max() == 0 and table[batch["input_ids"][0, 0]].abs().max() > 0
    # a model started in funcpar has the row at zero, as transformers' does; the export says which row it is
    assert module.init(cfg)["embed"][row].abs().max() == 0 and cfg.to_hf()["pad_token_id"] == row


@pytest.mark.parametrize("module", [llama, mixtral])
@pytest.mark.parametrize("pad", [V, -V - 1, 2.0, True])
def test_a_pad_token_id_that_is_no_row_is_refused_by_name(module, pad):
    d = (tf.LlamaConfig if module is llama else tf.MixtralConfig)(**SMALL).to_dict() | {"pad_token_id": pad}
    with pytest.raises(ValueError, match=rf"pad_token_id={pad!r}, not in \[-{V}, {V}\)"):
        module.Config.from_hf(d)
