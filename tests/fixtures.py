"""Small models, batches and train steps shared by several test modules, none of which needs transformers
(tests/hf_fixtures.py holds the ones made through transformers).

A test module imports what it shares from here, never from another test module (tests/test_architecture.py checks
this); gloo workers import this module by name when a function of it crosses to them.
"""

import torch

import funcpar as fp
from funcpar.models import gpt2, llama

# ------------------------------------------------ the Llama of tests/test_step.py, and the batches it trains on

STEPS, B, T, V = 5, 8, 16, 64
CLIP, LR, WD = 0.5, 1e-2, 0.1


def config(layers=2):
    # 4 query heads, 2 kv heads: at tp=4 the k/v projections are replicated (more tp ranks than kv heads)
    return llama.Config(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_windows=(None,) * layers)


def batches():
    out = []
    for s in range(STEPS):
        g = torch.Generator().manual_seed(100 + s)
        ids = torch.randint(0, V, (B, T), generator=g)
        labels = ids.clone()
        labels[s % B, : 3 + s] = -100  # micro-batches and dp ranks hold different numbers of targets
        labels[(s + 3) % B, 10:] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


# ------------------------------------------------------- the configs and step of tests/test_reliability.py

SMALL = {
    "llama": lambda **kw: llama.Config(**{**dict(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                 num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                                                 head_dim=16), **kw}),
    "gpt2": lambda **kw: gpt2.Config(**{**dict(vocab_size=64, n_embd=32, n_layer=2, n_head=2), **kw}),
}


def tiny_step(mesh, **kw):
    """A compiled step of ``SMALL["llama"]`` on ``mesh`` (AdamW at 1e-3 unless ``optimizer`` is given) and its
    initial state."""
    cfg = SMALL["llama"]()
    model = fp.get_model("llama")
    specs = model.specs(cfg, mesh)
    kw.setdefault("optimizer", fp.optim.adamw(1e-3))
    step = fp.compile_step(model.loss_fn(cfg, mesh), specs, mesh=mesh, **kw)
    return step, step.init(fp.shard(model.init(cfg, seed=0), specs, mesh))


# ---------------------------------------------------------------------------------------------- Baichuan2


def baichuan_config(**edits) -> dict:
    """A Baichuan2-7B config.json, every published key, at test sizes (tests/test_baichuan.py; transformers has no
    class for it)."""
    d = {
        "_from_model_config": True,
        "architectures": ["BaichuanForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_baichuan.BaichuanConfig",
                     "AutoModelForCausalLM": "modeling_baichuan.BaichuanForCausalLM"},
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
        "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 96,
        "max_position_embeddings": 64, "model_max_length": 64, "model_type": "baichuan",
        "num_attention_heads": 4, "num_hidden_layers": 2, "rms_norm_eps": 1e-06,
        "tie_word_embeddings": False, "torch_dtype": "float32", "transformers_version": "4.29.2",
        "use_cache": True, "vocab_size": 128, "z_loss_weight": 0,
    }
    d.update(edits)
    return d
