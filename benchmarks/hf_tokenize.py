"""Tokenizing a corpus with an HF fast tokenizer: every sample alone against ``encode_many`` (BULK plain-text
samples a call), in memory, on ``benchmarks/token_cache.py``'s corpus of random words with a BPE of 8,000 tokens trained
on it.

    python benchmarks/hf_tokenize.py 32      # MiB of text

A benchmark, not a test: nothing is asserted. Prints markdown rows.
"""
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from token_cache import make_corpus  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers, trainers  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

from funcpar.data import HFTokenizer, iter_samples, tokenize  # noqa: E402

w = Path(tempfile.mkdtemp(prefix="funcpar-hf-tokenize-"))
src = w / "corpus.txt"
if not src.exists():
    make_corpus(src, int(sys.argv[1]))
bpe = Tokenizer(models.BPE(unk_token="[UNK]")); bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
bpe.train([str(src)], trainers.BpeTrainer(vocab_size=8000, special_tokens=["[UNK]", "</s>", "[PAD]"]))
PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="</s>", pad_token="[PAD]").save_pretrained(w / "t")
hf = HFTokenizer(w / "t")

class OneByOne:  # the same tokenizer without encode_many: every sample alone (the path before)
    def __init__(self, t): self.t = t
    def __getattr__(self, k):
        if k == "encode_many": raise AttributeError(k)
        return getattr(self.t, k)

for name, tok in (("one by one", OneByOne(hf)), ("encode_many", hf)):
    t0 = time.perf_counter(); s = tokenize(iter_samples(src), tok); dt = time.perf_counter() - t0
    print(f"| {src.stat().st_size / 2**20:.0f} MiB | {name} | {s.tokens:,} tokens | {dt:.1f} s | {s.tokens / dt / 1e6:.2f} M tokens/s |")
