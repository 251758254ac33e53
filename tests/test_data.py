"""The data pipeline: formats -> tokens and loss masks, errors naming file and line, truncation counted,
tp peers identical and dp ranks disjoint, and an exactly resumable order."""

import json

import pytest
import torch

import funcpar as fp
import harness
from funcpar.data import ByteTokenizer, DataError, Dataset, Loader, encode, load_samples

TOK = ByteTokenizer()
EOS = TOK.eos_id


def toks(s):
    return list(s.encode())


def test_pretrain_text_trains_every_token():
    ids, mask = encode({"type": "pretrain", "text": "hi"}, TOK)
    assert ids == toks("hi") + [EOS] and mask == [1, 1, 1]
    assert encode({"text": "hi"}, TOK) == (ids, mask)  # bare {"text"} is pretraining


def test_instruct_with_and_without_input():
    ids, mask = encode({"type": "instruct", "instruct": "Add", "input": "2 3", "output": "5"}, TOK)
    assert ids == toks("Add\n2 3\n5") + [EOS]
    assert mask == [0] * len("Add\n2 3\n") + [1, 1]
    ids, mask = encode({"type": "instruct", "instruct": "Say yes", "output": "yes"}, TOK)
    assert ids == toks("Say yes\nyes") + [EOS] and mask == [0] * 8 + [1] * 4


def test_conversation_and_ref_qa_train_on_answers_only():
    conv = {"type": "conversation", "rounds": [["ask", "2+2?"], ["ans", "4"], ["ask", "and 3+3?"], ["ans", "6"]]}
    ids, mask = encode(conv, TOK)
    text = "User: 2+2?\nAssistant: 4"
    expect = toks(text) + [EOS] + toks("User: and 3+3?\nAssistant: 6") + [EOS]
    assert ids == expect
    trained = [i for i, m in zip(ids, mask, strict=True) if m]
    assert trained == toks("4") + [EOS] + toks("6") + [EOS]
    ids, mask = encode({"type": "ref_qa", "reference": "Paris is in France.", "rounds": [["ask", "Where?"], ["ans", "France"]]}, TOK)
    assert bytes(i for i in ids if i < 256).decode().startswith("Reference: Paris is in France.\nUser: Where?\n")
    assert [i for i, m in zip(ids, mask, strict=True) if m] == toks("France") + [EOS]


def test_messages_and_role_named_rounds_train_on_the_assistant_turns():
    """TRL's ``messages`` (a system turn included) and rounds with user/assistant role names are conversations:
    funcpar's template, the assistant turns (and their EOS) trained on, nothing else."""
    msgs = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                         {"role": "assistant", "content": "hello"}, {"role": "user", "content": "2+2?"},
                         {"role": "assistant", "content": "4"}]}
    ids, mask = encode(msgs, TOK)
    assert ids == toks("System: Be brief.\nUser: hi\nAssistant: hello") + [EOS] + toks("User: 2+2?\nAssistant: 4") + [EOS]
    assert [i for i, m in zip(ids, mask, strict=True) if m] == toks("hello") + [EOS] + toks("4") + [EOS]
    rounds = {"type": "conversation", "rounds": [["system", "Be brief."], ["user", "hi"], ["assistant", "hello"],
                                                  ["user", "2+2?"], ["assistant", "4"]]}
    assert encode(rounds, TOK) == (ids, mask)


@pytest.mark.parametrize(
    "line, pattern",
    [
        ('{"type": "instruct", "output": "x"}', r"data.jsonl:2: a 'instruct' sample needs field 'instruct'"),
        ('{"type": "poem", "text": "x"}', r"data.jsonl:2: unknown sample type 'poem' \(known: pretrain, instruct, conversation, ref_qa\)"),
        ('{"type": "pretrain", "text": ', r"data.jsonl:2: not valid JSON"),
        ('{"type": "conversation", "rounds": [["say", "x"]]}',
         r"data.jsonl:2: round 0 must be \[role, text\] with role user, assistant or system \(or ask, ans\), got "
         r"\[\"say\", \"x\"\]"),
        ('{"messages": [{"role": "user", "content": "hi"}]}',
         r"data.jsonl:2: a conversation with no assistant turn has nothing to train on"),
        ('{"messages": [{"role": "bot", "content": "hi"}]}',
         r"data.jsonl:2: message 0 must be \{\"role\": \"system\"\|\"user\"\|\"assistant\", \"content\": text\}, got "
         r"\{\"role\": \"bot\", \"content\": \"hi\"\}"),
        ('{"type": "instruct", "instruct": "a", "output": 3}', r"data.jsonl:2: field 'output' must be a str, got int"),
        ('[1, 2]', r"data.jsonl:2: a sample must be a JSON object, got list"),
    ],
)
def test_malformed_samples_name_file_and_line(tmp_path, line, pattern):
    f = tmp_path / "data.jsonl"
    f.write_text('{"type": "pretrain", "text": "ok"}\n' + line + "\n")
    with pytest.raises(DataError, match=pattern):
        Dataset.from_samples(load_samples(f), TOK, seq_len=8)


def test_truncation_is_counted_and_padding_not_trained(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text("\n".join(json.dumps({"type": "instruct", "instruct": "q" * n, "output": "a"}) for n in (2, 20, 3, 30)) + "\n")
    ds = Dataset.from_samples(load_samples(f), TOK, seq_len=10, pack=False)
    assert ds.truncated == 2 and ds.samples == 4 and ds.ids.shape == (4, 10)
    assert ds.ids[0].tolist() == toks("qq\na") + [EOS] + [TOK.pad_id] * 5
    assert ds.mask[0].tolist() == [False] * 3 + [True, True] + [False] * 5


def test_packing_and_text_files(tmp_path):
    (tmp_path / "a.txt").write_text("first doc\n\nsecond doc\n")
    s = load_samples(tmp_path)
    assert [x["text"] for x, _ in s] == ["first doc", "second doc"] and s[1][1].endswith("a.txt:3")
    ds = Dataset.from_samples(s, TOK, seq_len=5, pack=True)
    stream = toks("first doc") + [EOS] + toks("second doc") + [EOS]
    assert ds.ids.reshape(-1).tolist() == stream[: len(stream) // 5 * 5] and bool(ds.mask.all())


def _dataset():
    samples = [({"type": "instruct", "instruct": f"{a}+{b}=", "output": str(a + b)}, "x") for a in range(10) for b in range(10)]
    return Dataset.from_samples(samples, TOK, seq_len=16)


def _rank_batches(sizes, n):
    mesh = harness.mesh(**sizes)
    loader = Loader(_dataset(), mesh, global_batch=8, seed=3)
    return mesh.coords, [next(loader) for _ in range(n)]


def test_tp_peers_identical_dp_ranks_disjoint():
    results = harness.run(4, _rank_batches, {"tp": 2, "dp": 2}, 3)
    by = {(c["dp"], c["tp"]): b for c, b in results}
    ref = Loader(_dataset(), fp.Mesh(), global_batch=8, seed=3)
    for k in range(3):
        for d in range(2):
            assert torch.equal(by[(d, 0)][k]["input_ids"], by[(d, 1)][k]["input_ids"])  # tp peers: the same batch
            assert torch.equal(by[(d, 0)][k]["labels"], by[(d, 1)][k]["labels"])
        g = next(ref)
        # dp ranks hold the two disjoint halves of the global batch, which is the same whatever the mesh
        assert torch.equal(torch.cat([by[(0, 0)][k]["input_ids"], by[(1, 0)][k]["input_ids"]]), g["input_ids"])
        assert by[(0, 0)][k]["input_ids"].shape[0] == 4 and not torch.equal(by[(0, 0)][k]["input_ids"], by[(1, 0)][k]["input_ids"])


def test_resume_continues_the_exact_order():
    ds = _dataset()
    a = Loader(ds, fp.Mesh(), global_batch=8, seed=1)
    first = [next(a) for _ in range(20)]  # crosses an epoch boundary (100 rows / 8 = 12 batches per epoch)
    b = Loader(ds, fp.Mesh(), global_batch=8, seed=1)
    for _ in range(7):
        next(b)
    state = json.loads(json.dumps(b.state_dict()))  # as it travels through a checkpoint
    c = Loader(ds, fp.Mesh(), global_batch=8, seed=1)
    c.load_state_dict(state)
    assert all(torch.equal(next(c)["input_ids"], first[k]["input_ids"]) for k in range(7, 20))
    with pytest.raises(DataError, match="cannot resume data order: saved with global_batch=8 seed=1, now global_batch=4"):
        Loader(ds, fp.Mesh(), global_batch=4, seed=1).load_state_dict(state)


def test_local_hf_tokenizer_folder(tmp_path):
    pytest.importorskip("transformers")  # (and tokenizers with it)
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from funcpar.data import HFTokenizer

    vocab = {"[PAD]": 0, "</s>": 1, "[UNK]": 2, "Add": 3, "2": 4, "3": 5, "5": 6, "\n": 7}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split("\n", behavior="isolated")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", pad_token="[PAD]", unk_token="[UNK]")
    fast.save_pretrained(tmp_path / "tok")
    hf = HFTokenizer(tmp_path / "tok")
    assert (hf.eos_id, hf.pad_id, hf.vocab_size) == (1, 0, 8)
    ids, mask = encode({"type": "instruct", "instruct": "Add", "output": "5"}, hf)
    assert ids == [3, 7, 6, 1] and mask == [0, 0, 1, 1]  # "Add\n" prompt, "5" + EOS trained
    ds = Dataset.from_samples([({"type": "instruct", "instruct": "Add", "output": "5"}, "x")], hf, seq_len=6, pack=False)
    assert ds.ids[0].tolist() == [3, 7, 6, 1, 0, 0]
