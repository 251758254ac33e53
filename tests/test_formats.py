"""Sample formats beyond the original ones: TRL's prompt-completion rows (plain and conversational) trained on the
completion only, errors that name the formats a row could have been and every malformed line of a file at once,
and ``--sample-prompts`` files of conversations rendered as training renders them."""

import json

import pytest

from funcpar import data
from funcpar.data import ByteTokenizer, DataError, Dataset, encode, iter_samples, load_samples
from funcpar.cli.generate import read_prompts

TOK = ByteTokenizer()
EOS = TOK.eos_id
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
PROMPT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
          {"role": "assistant", "content": "hello"}, {"role": "user", "content": "2+2?"}]
ANSWER = [{"role": "assistant", "content": "4"}]


def toks(s):
    return list(s.encode())


def trained(ids, mask):
    return [i for i, m in zip(ids, mask, strict=True) if m]


@pytest.fixture
def chatml(tmp_path):
    """An HF tokenizer (the byte tokenizer's export: ids as bytes, ``</s>`` its EOS) with a ChatML-like template."""
    TOK.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHATML}))
    return data.HFTokenizer(tmp_path)


def test_plain_prompt_completion_trains_on_the_completion_only(chatml):
    for tok in (TOK, chatml):  # (plain text: no chat template, whatever the tokenizer has)
        ids, mask = encode({"prompt": "2+2=", "completion": "4"}, tok)
        assert ids == toks("2+2=4") + [EOS] and mask == [0, 0, 0, 0, 1, 1]


def test_conversational_prompt_completion_trains_on_the_completion_only(chatml):
    sample = {"prompt": PROMPT, "completion": ANSWER}
    ids, mask = encode(sample, TOK)  # funcpar's builtin template: the prompt's earlier reply is not trained on
    assert ids == toks("System: Be brief.\nUser: hi\nAssistant: hello") + [EOS] + toks("User: 2+2?\nAssistant: 4") + [EOS]
    assert trained(ids, mask) == toks("4") + [EOS]
    assert ids == encode({"messages": PROMPT + ANSWER}, TOK)[0]  # the same text as the whole conversation
    ids, mask = encode(sample, chatml)
    prompt = ("<|im_start|>system\nBe brief.</s>\n<|im_start|>user\nhi</s>\n<|im_start|>assistant\nhello</s>\n"
              "<|im_start|>user\n2+2?</s>\n<|im_start|>assistant\n")
    assert ids == chatml.encode(prompt + "4</s>\n") and EOS in ids[:-3]
    assert mask == [0] * len(chatml.encode(prompt)) + [1] * len(chatml.encode("4</s>\n"))
    assert ids == encode({"messages": PROMPT + ANSWER}, chatml)[0]


def test_a_prompt_completion_file_trains_on_the_completions_only(tmp_path):
    f = tmp_path / "pc.jsonl"
    f.write_text(json.dumps({"prompt": "Q1 ", "completion": "A1"}) + "\n"
                 + json.dumps({"prompt": [{"role": "user", "content": "Q2"}], "completion": ANSWER}) + "\n")
    ds = Dataset.from_samples(load_samples(f), TOK, seq_len=40, pack=False)
    rows = [(ds.ids[k].tolist(), ds.mask[k].tolist()) for k in range(2)]
    assert [trained(ids, mask) for ids, mask in rows] == [toks("A1") + [EOS], toks("4") + [EOS]]
    assert rows[1][0][: len("User: Q2\nAssistant: 4") + 1] == toks("User: Q2\nAssistant: 4") + [EOS]


@pytest.mark.parametrize("row, message", [
    ({"prompt": "2+2="}, "a prompt-completion sample needs field 'completion'"),
    ({"prompt": "2+2=", "completion": 4}, "field 'completion' must be a str, got int"),
    ({"prompt": PROMPT, "completion": "4"}, "field 'completion' must be a list, got str"),
    ({"prompt": PROMPT, "completion": [{"role": "user", "content": "x"}]},
     "a completion with no assistant message has nothing to train on"),
    ({"prompt": [{"role": "bot", "content": "x"}], "completion": ANSWER},
     'prompt message 0 must be {"role": "system"|"user"|"assistant", "content": text}, got {"role": "bot", '
     '"content": "x"}'),
])
def test_malformed_prompt_completion_rows_say_what_is_wrong(row, message):
    with pytest.raises(DataError) as e:
        encode(row, TOK, "d.jsonl:3")
    assert str(e.value) == f"d.jsonl:3: {message}"


def test_a_row_of_no_known_format_names_the_formats():
    with pytest.raises(DataError) as e:
        encode({"instruction": "Add", "output": "5"}, TOK, "d.jsonl:1")
    assert str(e.value) == (
        "d.jsonl:1: not a sample format funcpar knows (its fields: 'instruction', 'output'); expected one of: "
        '{"text"}, {"messages"}, {"prompt", "completion"}, {"type": "instruct", "instruct", "output"}, '
        '{"type": "conversation", "rounds"}, {"type": "ref_qa", "reference", "rounds"}')
    assert "pretrain" not in str(e.value)
    with pytest.raises(DataError, match=r"^d.jsonl:1: a 'pretrain' sample needs field 'text'$"):  # (it said so)
        encode({"type": "pretrain", "body": "x"}, TOK, "d.jsonl:1")


def test_every_malformed_line_of_a_file_is_named_in_one_error(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text('{"text": "ok"}\n{"text": }\n{"txt": "x"}\n\n{"prompt": "q", "completion": 5}\n{"text": "fine"}\n')
    with pytest.raises(DataError) as e:
        load_samples(f)
    assert str(e.value) == (
        f"3 malformed samples (fix them all, then run again):\n"
        f"{f}:2: not valid JSON (Expecting value at column 10)\n"
        f"{f}:3: not a sample format funcpar knows (its fields: 'txt'); expected one of: {', '.join(data.FORMATS)}\n"
        f"{f}:5: field 'completion' must be a str, got int")


def test_many_malformed_lines_show_twenty_and_count_the_rest(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text("".join("not json\n" if k % 2 else f'{{"text": "ok {k}"}}\n' for k in range(50)))
    got = iter_samples(f)
    assert next(got) == ({"text": "ok 0"}, f"{f}:1")  # (streams: a sample before the first bad line is yielded)
    with pytest.raises(DataError) as e:
        list(got)
    lines = str(e.value).splitlines()
    assert lines[0] == "25 malformed samples (fix them all, then run again):" and lines[-1] == "and 5 more"
    assert lines[1:-1] == [f"{f}:{n}: not valid JSON (Expecting value at column 1)" for n in range(2, 42, 2)]


def test_sample_prompts_of_conversations_are_what_training_renders_before_the_reply(tmp_path, chatml):
    f = tmp_path / "prompts.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in [{"messages": PROMPT}, {"prompt": "7+5=\n"}, {"prompt": PROMPT},
                                                   {"prompt": PROMPT, "completion": ANSWER}]) + "\n")
    got = read_prompts(f, chatml)
    want = ("<|im_start|>system\nBe brief.</s>\n<|im_start|>user\nhi</s>\n<|im_start|>assistant\nhello</s>\n"
            "<|im_start|>user\n2+2?</s>\n<|im_start|>assistant\n")
    assert got == [want, "7+5=\n", want, want]
    for tok in (chatml, TOK):  # the prompt's tokens are the sample's up to its first trained one
        ids, mask = encode({"prompt": PROMPT, "completion": ANSWER}, tok)
        prompt = read_prompts(f, tok)[0]
        assert tok.encode(prompt) == [i for i in ids[: mask.index(1)] if tok is chatml or i != EOS]
    assert read_prompts(f)[0] == "System: Be brief.\nUser: hi\nAssistant: helloUser: 2+2?\nAssistant: "
    (tmp_path / "p.txt").write_text('plain\\nline\n{"messages": [{"role": "user", "content": "hi"}]}\n')
    assert read_prompts(tmp_path / "p.txt", chatml) == ["plain\nline", "<|im_start|>user\nhi</s>\n<|im_start|>assistant\n"]


@pytest.mark.parametrize("line, message", [
    ('{"text": "x"}', "not a prompt (its fields: 'text'); expected {\"prompt\": text}, {\"prompt\": [messages]} or "
                      "{\"messages\": [messages]}"),
    ('{"messages": []}', "a conversation with no messages: nothing to prompt with"),
    ("just text", 'expected a JSON object: {"prompt": text}, {"prompt": [messages]} or {"messages": [messages]}'),
])
def test_bad_sample_prompts_are_named_by_line(tmp_path, line, message):
    f = tmp_path / "prompts.jsonl"
    f.write_text('{"prompt": "ok"}\n\n' + line + "\n")
    with pytest.raises(ValueError) as e:
        read_prompts(f)
    assert str(e.value) == f"{f}:3: {message}"
