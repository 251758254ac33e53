"""Tiny transformers checkpoints made from configs (no hub), shared by the HF/model tests."""

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

# transformers is in the test extra: without it, the tests that import this module skip. (pytest only then:
# benchmarks/stress_jobs.py imports this module too, where pytest need not be installed.)
try:
    import transformers as tf
except ImportError:
    import pytest

    pytest.skip("needs transformers (pip install -e '.[test]')", allow_module_level=True)

CONFIGS = {
    # GQA (8 query heads, 4 kv heads) and llama3 rope scaling: tp = 2 and 4
    "llama": lambda: tf.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=4, rope_theta=500.0, max_position_embeddings=64,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8},
    ),
    # sliding window shorter than the test sequence; 2 kv heads, so tp=4 replicates k/v (beyond what peers do)
    "mistral": lambda: tf.MistralConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=5, max_position_embeddings=64,
    ),
    # q/k/v bias
    "qwen2": lambda: tf.Qwen2Config(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=64,
    ),
    "llama_tied": lambda: tf.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, tie_word_embeddings=True, max_position_embeddings=64,
    ),
    "gpt2": lambda: tf.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=32),
    # ALiBi, fused query_key_value, tied head (tests/test_cuda.py; test_bloom.py has its own, with padded vocabularies)
    "bloom": lambda: tf.BloomConfig(vocab_size=128, hidden_size=64, n_layer=2, n_head=4),
    # 4 experts, top-2, GQA, a sliding window (tests/test_cuda.py; test_mixtral.py has its own)
    "mixtral": lambda: tf.MixtralConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.02,
        output_router_logits=True, sliding_window=8, max_position_embeddings=64,
    ),
    # room for funcpar's byte tokenizer (ids up to 258)
    "llama_bytes": lambda: tf.LlamaConfig(
        vocab_size=264, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    ),
}
MAX_TP = {"llama": 4, "mistral": 4, "qwen2": 4, "llama_tied": 4, "gpt2": 4}

# transformers' GlmForCausalLM (tests/test_glm.py, test_chatglm3.py, test_documents.py)
GLM_PAD = 3  # the padding token of the untied checkpoint: its embedding row learns nothing from lookups
GLM_CONFIGS = {
    # GQA with 8 query / 2 kv heads, head_dim 16 (q wider than the hidden size), half of each head rotated,
    # q/k/v bias and a padding token
    "glm": lambda: tf.GlmConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, pad_token_id=GLM_PAD,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.5},
    ),
    # a tied head without bias, all of each head rotated, on a vocabulary tp does not divide
    "glm_tied": lambda: tf.GlmConfig(
        vocab_size=100, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, head_dim=8, max_position_embeddings=64, pad_token_id=None, attention_bias=False,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0},
    ),
}


def make_checkpoint(kind: str, folder: str, seed: int = 0, **save_kwargs):
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(CONFIGS[kind]()).eval()
    with torch.no_grad():  # non-trivial norms and biases, so that a mix-up would show
        for name, p in model.named_parameters():
            if "norm" in name or "ln_" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(folder, **save_kwargs)
    return model


def batch(seed: int = 0, B: int = 2, T: int = 12, V: int = 128):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, T), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100  # some ignored positions
    return {"input_ids": ids, "labels": labels}


def folder_tensors(folder) -> dict:
    """Every tensor of a checkpoint folder's safetensors files, by name (one file or a sharded set)."""
    from safetensors.torch import load_file

    out = {}
    for f in sorted(os.listdir(folder)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(folder, f)))
    return out


def checkpoint_tensors(folder) -> dict:
    """Every tensor of a checkpoint, by name: the files its ``model.safetensors.index.json`` names, else its
    ``model.safetensors`` (unlike :func:`folder_tensors`, other ``.safetensors`` files in the folder are not read)."""
    from safetensors.torch import load_file

    folder = str(folder)
    idx = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(idx):
        with open(idx) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        out = {}
        for name in files:
            out.update(load_file(os.path.join(folder, name)))
        return out
    return load_file(os.path.join(folder, "model.safetensors"))


def assert_identical(a: dict, b: dict, ignore=()):
    """Two name -> tensor dicts hold the same names, dtypes, shapes and bytes (floats compared bit for bit)."""
    a = {k: v for k, v in a.items() if k not in ignore}
    b = {k: v for k, v in b.items() if k not in ignore}
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k].view(torch.uint8) if a[k].dtype.is_floating_point else a[k],
                           b[k].view(torch.uint8) if b[k].dtype.is_floating_point else b[k]), k


def config_dict(name: str) -> dict:
    """A test-sized ``config.json`` dict of a model: :data:`CONFIGS`' through transformers, and GLM's and
    Baichuan2's (:data:`GLM_CONFIGS`, tests/fixtures.py's ``baichuan_config``)."""
    if name == "glm":
        return GLM_CONFIGS["glm"]().to_dict()
    if name == "baichuan":
        from fixtures import baichuan_config

        return baichuan_config()
    return CONFIGS[name]().to_dict()


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def chatml_tokenizer(folder, texts, vocab_size: int = 320):
    """A byte-level BPE trained on ``texts`` (offline, with ``tokenizers``) with Qwen's ChatML special tokens and
    chat template, saved to ``folder`` as transformers saves a Hub tokenizer; returns it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    bpe.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = tf.PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                     chat_template=CHATML)
    tok.save_pretrained(folder)
    return tok
