"""Issue 12, class by class: bad input gets a clear error and nothing trains silently."""

import pytest
import torch

import funcpar as fp
from funcpar.models import gpt2, llama

SMALL = {
    "llama": lambda **kw: llama.Config(**{**dict(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                 num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                                                 head_dim=16), **kw}),
    "gpt2": lambda **kw: gpt2.Config(**{**dict(vocab_size=64, n_embd=32, n_layer=2, n_head=2), **kw}),
}


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_every_layer_of_a_config_built_in_python_changes_the_loss(name):
    cfg = SMALL[name]()  # every required field, nothing per layer: completed at construction
    model = fp.get_model(name)
    params = model.init(cfg, seed=0)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    base = model.loss(params, {"input_ids": ids}, cfg, fp.Mesh()).item()
    for i in range(len(params["layers"])):
        scaled = {**params, "layers": [{k: v * 100 if j == i else v for k, v in lp.items()}
                                       for j, lp in enumerate(params["layers"])]}
        assert model.loss(scaled, {"input_ids": ids}, cfg, fp.Mesh()).item() != pytest.approx(base, rel=1e-3), i


@pytest.mark.parametrize("name, kw, message", [
    ("llama", {"vocab_size": 0}, "llama.Config: vocab_size=0, expected a positive int"),
    ("llama", {"num_hidden_layers": 2.0}, "llama.Config: num_hidden_layers=2.0, expected a positive int"),
    ("llama", {"num_attention_heads": 3}, "num_attention_heads=3 is not a multiple of num_key_value_heads=2"),
    ("llama", {"sliding_windows": (None,)}, "sliding_windows=(None,) must give each of the 2 layers a window"),
    ("llama", {"rms_norm_eps": -1.0}, "rms_norm_eps=-1.0 and rope_theta=10000.0 must be positive"),
    ("gpt2", {"n_head": 3}, "gpt2.Config: n_embd=32 is not a multiple of n_head=3"),
    ("gpt2", {"n_positions": -4}, "gpt2.Config: n_positions=-4, expected a positive int"),
    ("gpt2", {"layer_norm_epsilon": 0.0}, "gpt2.Config: layer_norm_epsilon=0.0 must be positive"),
])
def test_a_config_no_model_has_is_refused_at_construction(name, kw, message):
    with pytest.raises(ValueError) as e:
        SMALL[name](**kw)
    assert message in str(e.value)
