"""Data that does not fit in memory: the keyed permutation that orders rows without an index, mixtures of sources
drawn by weight, and the token cache every later run reads instead of tokenizing again."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest
import torch

import funcpar as fp
from funcpar.cli import options
from funcpar.data import cache as tokencache
from funcpar.data import ByteTokenizer, DataError, Dataset, Loader, Mixture, iter_samples, permute, tokenize

TOK = ByteTokenizer()


@pytest.mark.parametrize("n", [1, 2, 3, 7, 8, 100, 257, 1000, 4097])
def test_permute_is_a_bijection_of_range_n_and_the_key_chooses_it(n):
    orders = [permute(torch.arange(n), n, key) for key in (0, 1, 12345)]
    for o in orders:
        assert sorted(o.tolist()) == list(range(n))
    if n >= 8:
        assert not torch.equal(orders[0], orders[1]) and not torch.equal(orders[1], orders[2])
        assert not torch.equal(orders[0], torch.arange(n))
    # any positions, in any order, map alike: what a batch asks for is all that is computed
    pick = torch.tensor([n - 1, 0, n // 2])
    assert torch.equal(permute(pick, n, 1), orders[1][pick])


def test_permute_spreads_positions_evenly():
    """Over many keys, position 0 lands in each tenth of range(n) about equally often (a usable shuffle)."""
    n = 1000
    firsts = torch.stack([permute(torch.tensor([0]), n, k) for k in range(2000)]).reshape(-1)
    counts = torch.bincount(firsts // 100, minlength=10)
    assert counts.min() > 140 and counts.max() < 260, counts.tolist()


def _numbered(n_rows: int, base: int, seq: int = 4) -> Dataset:
    """Rows whose first token is ``base + row``: which row of which source a batch holds."""
    ids = torch.zeros(n_rows, seq, dtype=torch.long)
    ids[:, 0] = base + torch.arange(n_rows)
    return Dataset.from_rows(ids)


def test_a_mixture_draws_each_sources_share_exactly_and_every_row_once_an_epoch():
    a, b = _numbered(30, 0), _numbered(50, 1000)
    loader = Loader(Mixture([a, b], [0.75, 0.25]), fp.Mesh(), global_batch=8, seed=2)
    firsts = [next(loader)["input_ids"][:, 0] for _ in range(40)]
    drawn = torch.cat(firsts)
    from_a, from_b = drawn[drawn < 1000], drawn[drawn >= 1000]
    assert len(from_a) == 240 and len(from_b) == 80  # 75 % and 25 % of 320 rows, exactly
    # source a (30 rows) served 8 whole epochs: each row 8 times; b (50 rows): 80 draws, rows 0..49 once, then 30
    assert Counter(from_a.tolist()) == {r: 8 for r in range(30)}
    assert sorted(Counter(from_b[:50].tolist())) == list(range(1000, 1050))
    assert all(0 < int((f < 1000).sum()) < 8 for f in firsts)  # every batch mixes them, interleaved
    assert {int((f < 1000).sum()) for f in firsts} == {6}


def test_a_mixture_too_wide_for_the_batch_and_other_weights_on_resume_are_refused():
    parts = [_numbered(40, 100 * k) for k in range(3)]
    with pytest.raises(DataError, match=r"--global-batch 1 is too small to mix 3 sources .*: use 2 or more"):
        Loader(Mixture(parts, [1, 1, 1]), fp.Mesh(), global_batch=1)
    loader = Loader(Mixture(parts, [2, 1, 1]), fp.Mesh(), global_batch=8)
    next(loader)
    state = json.loads(json.dumps(loader.state_dict()))
    assert state["weights"] == [0.5, 0.25, 0.25]
    with pytest.raises(DataError, match=r"saved with data weights \[0.5, 0.25, 0.25\], now \[0.25, 0.5, 0.25\]"):
        Loader(Mixture(parts, [1, 2, 1]), fp.Mesh(), global_batch=8).load_state_dict(state)
    again = Loader(Mixture(parts, [2, 1, 1]), fp.Mesh(), global_batch=8)
    again.load_state_dict(state)
    assert torch.equal(next(again)["input_ids"], next(loader)["input_ids"])


def test_data_weights_parse_and_a_bad_one_is_one_line():
    assert options.data_sources("builtin:arithmetic") == [("builtin:arithmetic", 1.0)]
    assert options.data_sources("a.jsonl:3,/x/b.txt:0.5,c") == [("a.jsonl", 3.0), ("/x/b.txt", 0.5), ("c", 1.0)]
    with pytest.raises(SystemExit, match=r"^funcpar: bad --data 'a.jsonl:0,b': expected FILE or FILE:WEIGHT"):
        options.data_sources("a.jsonl:0,b")


def _corpus(path, docs: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    words = ["alpha", "beta", "gamma", "delta", "épsilon", "zeta", "eta\ttheta"]
    with open(path, "w", encoding="utf-8") as fh:
        for d in range(docs):
            fh.write(" ".join(rng.choice(words, size=int(rng.integers(3, 40)))) + ("\n\n" if d % 3 else "\n\n\n"))


def test_the_token_cache_holds_what_tokenizing_in_memory_gives_and_is_built_once(tmp_path, capfd):
    src = tmp_path / "corpus.txt"
    _corpus(src, 500)
    cache = tmp_path / "cache"
    mem = tokencache.stream(src, TOK, "off")
    disk = tokencache.stream(src, TOK, str(cache))
    assert "tokenizing" in capfd.readouterr().err
    assert isinstance(disk.ids, tokencache.FileArray) and disk.ids.dtype == np.uint16 and disk.mask is None
    assert np.array_equal(np.asarray(disk.ids), mem.ids) and np.array_equal(np.asarray(disk.starts), mem.starts)
    assert (disk.max_id, disk.samples) == (mem.max_id, 500)
    again = tokencache.stream(src, TOK, str(cache))  # the same key: read, not built
    assert "tokenizing" not in capfd.readouterr().err and np.array_equal(np.asarray(again.ids), mem.ids)
    for pack in (True, False):
        a = Loader(Dataset(mem, 32, pack, TOK.pad_id).split(0.1, seed=4)[0], fp.Mesh(), 16, seed=5)
        b = Loader(Dataset(disk, 32, pack, TOK.pad_id).split(0.1, seed=4)[0], fp.Mesh(), 16, seed=5)
        for _ in range(5):
            x, y = next(a), next(b)
            assert torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["labels"], y["labels"])
    os.utime(src, ns=(1, 1))  # an edited source is another entry
    tokencache.stream(src, TOK, str(cache))
    assert "tokenizing" in capfd.readouterr().err
    assert len([p for p in cache.iterdir() if p.is_dir()]) == 2


def test_a_damaged_cache_entry_is_refused_naming_the_folder_to_delete(tmp_path):
    src = tmp_path / "c.jsonl"
    src.write_text("".join(json.dumps({"type": "instruct", "instruct": "q", "output": "a" * k}) + "\n"
                           for k in range(1, 30)))
    entry_stream = tokencache.stream(src, TOK, str(tmp_path / "cache"))
    assert entry_stream.mask is not None and int(np.asarray(entry_stream.mask).sum()) == sum(k + 1 for k in range(1, 30))
    entry = next(p for p in (tmp_path / "cache").iterdir() if p.is_dir())
    with open(entry / "ids.bin", "r+b") as fh:
        fh.truncate(10)
    with pytest.raises(DataError, match=rf"the token cache {entry} is damaged .*ids.bin holds 10 bytes.*delete that "
                                        rf"folder"):
        tokencache.stream(src, TOK, str(tmp_path / "cache"))


def test_a_cache_file_overwritten_with_same_size_garbage_is_refused_and_an_entry_without_meta_rebuilt(tmp_path):
    """Issue 56, WEAK: a token cache was trusted by its files' sizes (ids.bin overwritten with garbage of the same
    size trained on it), and an entry left without its meta.json could never be rebuilt ("Directory not empty")."""
    src = tmp_path / "corpus.txt"
    _corpus(src, 200)
    cache = tmp_path / "cache"
    good = np.asarray(tokencache.stream(src, TOK, str(cache)).ids)
    entry = next(p for p in cache.iterdir() if p.is_dir())
    assert np.array_equal(np.asarray(tokencache.stream(src, TOK, str(cache)).ids), good)  # (checked, then kept)
    size = (entry / "ids.bin").stat().st_size
    (entry / "ids.bin").write_bytes(bytes(size))
    with pytest.raises(DataError, match=rf"the token cache {entry} is damaged \({entry / 'ids.bin'}: its CRC-32 is "
                                        rf"[0-9a-f]{{8}}, not the [0-9a-f]{{8}} its meta.json recorded .*delete that"):
        tokencache.stream(src, TOK, str(cache))
    (entry / "meta.json").unlink()  # (a builder's entry without meta.json: rebuilt in its place)
    assert np.array_equal(np.asarray(tokencache.stream(src, TOK, str(cache)).ids), good)


def test_ranks_that_start_together_build_one_entry(tmp_path):
    """Two processes asking for the same uncached source at once: one tokenizes, the other waits and reads it."""
    src = tmp_path / "corpus.txt"
    _corpus(src, 3000)
    code = ("import sys; from funcpar.data import cache as tokencache; from funcpar.data import ByteTokenizer; "
            f"s = tokencache.stream({str(src)!r}, ByteTokenizer(), {str(tmp_path / 'cache')!r}); print(s.tokens)")
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert outs[0][0] == outs[1][0]
    assert sum("tokenizing" in err for _, err in outs) == 1
    assert [p.name for p in (tmp_path / "cache").iterdir() if p.is_dir()] != [] and not list(
        (tmp_path / "cache").glob("*.tmp-*"))


def test_text_files_stream_by_line_with_their_line_numbers(tmp_path):
    f = tmp_path / "a.txt"
    f.write_bytes(b"one\r\ntwo\r\n\r\nthree\n\n\n\nfour\n")
    got = [(s["text"], where.rsplit(":", 1)[1]) for s, where in iter_samples(f)]
    assert got == [("one\r\ntwo\r", "1"), ("three", "4"), ("four", "8")]
    stream = tokenize(iter_samples(f), TOK)
    assert stream.samples == 3 and stream.mask is None


def test_train_mixes_two_files_by_weight_from_the_cache(tmp_path, monkeypatch, capfd):
    """`--data a:3,b:1 --token-cache DIR`: the run says the mixture, tokenizes each file into the cache once, and a
    second run reads the cache and trains the same."""
    from funcpar.cli import main as cli

    a, b = tmp_path / "a.txt", tmp_path / "b.jsonl"
    _corpus(a, 200)
    b.write_text("".join(json.dumps({"text": f"line {k} " * 5}) + "\n" for k in range(300)))
    args = ["train", "--model", "llama-micro", "--mesh", "1", "--data", f"{a}:3,{b}:1", "--token-cache",
            str(tmp_path / "cache"), "--steps", "2", "--global-batch", "8", "--seq-len", "32", "--eval-every", "2",
            "--save-every", "0"]
    monkeypatch.chdir(tmp_path)
    cli.main([*args, "--out", "r1"])
    first = capfd.readouterr()
    assert f"mixing {a} 75%" in first.out and f"{b} 25%" in first.out
    assert first.err.count("tokenizing") == 2
    cli.main([*args, "--out", "r2"])
    assert "tokenizing" not in capfd.readouterr().err
    rows = [[json.loads(x) for x in (tmp_path / r / "metrics.jsonl").read_text().splitlines()] for r in ("r1", "r2")]
    assert rows[0][-1]["eval_loss"] == rows[1][-1]["eval_loss"] and [r["loss"] for r in rows[0]] == [
        r["loss"] for r in rows[1]]
    last = rows[0][-1]  # each source's held-out loss beside the pooled one, which lies between them
    each = [last["eval_loss/a.txt"], last["eval_loss/b.jsonl"]]
    assert min(each) <= last["eval_loss"] <= max(each) and each[0] != each[1]


def test_a_mask_that_starts_late_is_the_same_in_memory_and_in_the_cache(tmp_path, monkeypatch):
    """In memory the writer keeps no mask while every token is trained on; an instruct sample after some chunks of
    plain text brings it in, all ones before: the same stream the cache's files hold."""
    from funcpar.data import StreamWriter

    monkeypatch.setattr(StreamWriter, "CHUNK", 16)
    src = tmp_path / "mixed.jsonl"
    src.write_text("".join(json.dumps({"text": "plain text " * k}) + "\n" for k in range(1, 12))
                   + "".join(json.dumps({"type": "instruct", "instruct": "q" * k, "output": "a"}) + "\n"
                             for k in range(1, 5)))
    mem, disk = tokencache.stream(src, TOK, "off"), tokencache.stream(src, TOK, str(tmp_path / "c"))
    assert mem.mask is not None and np.array_equal(mem.mask, np.asarray(disk.mask))
    assert np.array_equal(mem.ids, np.asarray(disk.ids)) and int(mem.mask.sum()) < mem.tokens
    assert int(mem.mask[: mem.starts[11]].min()) == 1


def test_a_datasets_folder_is_read_with_that_package_row_by_row(tmp_path, monkeypatch):
    """A folder `datasets` saved (`save_to_disk`) is read through `datasets.load_from_disk` (here a stand-in for
    the package, which funcpar does not depend on): its rows are samples, a DatasetDict's `train` split; without
    the package, one line saying what to do."""
    import sys as _sys
    import types

    saved = tmp_path / "ds"
    saved.mkdir()
    for name in ("state.json", "dataset_info.json", "data-00000-of-00001.arrow"):
        (saved / name).write_text("{}")
    rows = [{"text": "first"}, {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}]

    class Split(list):
        features = {"text": None}

    fake = types.ModuleType("datasets")
    fake.load_from_disk = lambda p: {"train": Split(rows), "test": Split([])} if p == str(saved) else None
    monkeypatch.setitem(_sys.modules, "datasets", fake)
    got = list(iter_samples(saved))
    assert [s for s, _ in got] == rows and [w for _, w in got] == [f"{saved}/train[0]", f"{saved}/train[1]"]
    stream = tokencache.stream(saved, TOK, str(tmp_path / "cache"))  # cached like any source, keyed by its files
    assert stream.samples == 2 and stream.mask is not None
    monkeypatch.setitem(_sys.modules, "datasets", None)
    with pytest.raises(DataError, match=r"is a folder the datasets package saved: reading it needs that package"):
        list(iter_samples(saved))


def test_plain_text_is_encoded_in_bulk_to_the_ids_one_at_a_time_gives(tmp_path):
    """An HF fast tokenizer encodes plain-text samples BULK at a time: the stream equals encoding each sample
    alone, in order, with instruct samples between them (which go one by one)."""
    pytest.importorskip("transformers")  # (and tokenizers with it)
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from funcpar.data import HFTokenizer, encode

    src = tmp_path / "corpus.txt"
    _corpus(src, 300)
    bpe = Tokenizer(models.BPE(unk_token="[UNK]"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.train([str(src)], trainers.BpeTrainer(vocab_size=300, special_tokens=["[UNK]", "</s>", "[PAD]"]))
    PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="</s>", pad_token="[PAD]").save_pretrained(tmp_path / "t")
    hf = HFTokenizer(tmp_path / "t")
    samples = list(iter_samples(src))
    samples.insert(150, ({"type": "instruct", "instruct": "alpha", "output": "beta"}, "x"))
    stream = tokenize(iter(samples), hf)
    want = [encode(s, hf, w) for s, w in samples]
    assert stream.ids.tolist() == [i for ids, _ in want for i in ids]
    assert stream.mask.tolist() == [m for _, mask in want for m in mask]
    assert stream.starts.tolist()[-1] == stream.tokens and stream.samples == 301


def test_edge_cases_the_review_found(tmp_path):
    """A one-row source keeps its row to train on; taking no rows of a masked stream is an empty batch; a weight
    that is not finite is refused in one line; a builder killed mid-way leaves nothing the next build keeps."""
    one = Dataset.from_rows(torch.zeros(1, 4, dtype=torch.long))
    train, held = one.split(0.5)
    assert (len(train), len(held)) == (1, 0)
    masked = Dataset(tokenize(iter([({"type": "instruct", "instruct": "q", "output": "a" * 9}, "x")]), TOK), 4)
    ids, mask = masked.take(torch.zeros(0, dtype=torch.long))
    assert ids.shape == mask.shape == (0, 4)
    with pytest.raises(SystemExit, match=r"^funcpar: bad --data 'a.txt:inf'"):
        options.data_sources("a.txt:inf")
    src = tmp_path / "c.txt"
    _corpus(src, 20)
    cache = tmp_path / "cache"
    cache.mkdir()
    key = tokencache._key([src], TOK)
    (cache / f"{key}.tmp-999999").mkdir()  # what a SIGKILLed builder leaves
    tokencache.stream(src, TOK, str(cache))
    assert sorted(p.name for p in cache.iterdir()) == [key, f"{key}.lock"]
