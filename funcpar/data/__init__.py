"""Data: local datasets (plain text, JSONL pretraining, and the supervised formats of DeepSpeed pipeline
fine-tuning repos), tokenizers, packing/padding to a sequence length, and dp-sharded, resumable batches.

Sample formats, one JSON object per line (``.jsonl``/``.json``), or plain text (``.txt``, documents separated
by blank lines):

- ``{"type": "pretrain", "text": ...}`` (also a bare ``{"text": ...}``): loss on every token;
- ``{"type": "instruct", "instruct": ..., "input": ... (optional), "output": ...}``: loss on the output only;
- ``{"messages": [{"role": "system"|"user"|"assistant", "content": ...}, ...]}`` (TRL's, axolotl's, torchtune's) or
  ``{"type": "conversation", "rounds": [["ask"|"user", ...], ["ans"|"assistant", ...], ...]}``: loss on the
  assistant turns only, through the tokenizer's chat template when it has one (``System:``/``User:``/``Assistant:``
  lines otherwise);
- ``{"type": "ref_qa", "reference": ..., "rounds": [...]}``: a reference text, then a conversation;
- ``{"prompt": ..., "completion": ...}`` (TRL's prompt-completion): loss on the completion only; text, or lists of
  messages (the conversational form, through the chat template as above).

A file's malformed lines are reported together, in one error.

A sample becomes token ids and a loss mask; ids end with EOS. Batches are ``{"input_ids", "labels"}`` with
``labels = -100`` where the mask is 0. Every rank computes the same global batch from the same seed and takes its
dp block, so tp and pp peers receive identical batches by construction and dp ranks disjoint ones. The loader's
position is a small dict that goes into the checkpoint, so a resumed run sees exactly the batches it would have.
"""

from __future__ import annotations

from funcpar.data.tokenizers import ByteTokenizer as ByteTokenizer
from funcpar.data.tokenizers import HFTokenizer as HFTokenizer
from funcpar.data.samples import load_samples as load_samples
from funcpar.data.samples import iter_samples as iter_samples
from funcpar.data.samples import data_files as data_files
from funcpar.data.samples import encode as encode
from funcpar.data.streams import tokenize as tokenize
from funcpar.data.streams import Stream as Stream
from funcpar.data.datasets import Dataset as Dataset
from funcpar.data.datasets import Mixture as Mixture
from funcpar.data.loader import Loader as Loader
from funcpar.data.loader import batches as batches
from funcpar.data.order import permute as permute
from funcpar.data.tokenizers import DataError as DataError
from funcpar.data.samples import render as render
from funcpar.data.tokenizers import has_tokenizer as has_tokenizer
from funcpar.data.streams import StreamWriter as StreamWriter
from funcpar.data.datasets import as_batch as as_batch
from funcpar.data.samples import prompt_text as prompt_text
from funcpar.data.samples import is_hf_dataset as is_hf_dataset
from funcpar.data.streams import id_dtype as id_dtype
from funcpar.data.datasets import HELD_OUT_MAX as HELD_OUT_MAX
from funcpar.data.samples import FORMATS as FORMATS

__all__ = ["ByteTokenizer", "HFTokenizer", "load_samples", "iter_samples", "data_files", "encode", "tokenize", "Stream",
           "Dataset", "Mixture", "Loader", "batches", "permute", "DataError", "render", "has_tokenizer"]
