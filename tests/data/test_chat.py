"""Chat rows to tokens and loss masks: the tokens are ``transformers``' ``apply_chat_template``
ids; the supervised tokens decode to each assistant content plus its end-of-turn token for
ChatML (with and without ``{% generation %}``), Llama-3.1's and Qwen3's real templates; with
generation markers the mask is ``return_assistant_tokens_mask``'s exactly."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from composer.data.chat import ChatEncoder, RowError, parse_row, token_mask, truncate
from composer.data.indexed import DataError
from composer.data.tokenizer import ByteTokenizer, HFTokenizer

TEMPLATES = Path(__file__).parent / "templates"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>",
            "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
            "<|eom_id|>", "<|python_tag|>"]
CORPUS = ["Hello there, how are you?", "I am fine, thank you. And you?", "What is two plus two?",
          "Two plus two is four.", "You are a helpful assistant.", "system user assistant tool",
          "<think> </think> reasoning", "Cutting Knowledge Date: December 2023 Today Date"]
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
          "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|im_start|>assistant\\n' }}{% endif %}")
CHATML_GENERATION = (
    "{% for message in messages %}{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\\n' }}{% generation %}{{ message['content'] + '<|im_end|>' }}"
    "{% endgeneration %}{{ '\\n' }}{% else %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
# TRL-style: the generation block holds the role header too; we must follow it, not our rule
LLAMA_GENERATION = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' + "
    "message['content'] | trim + '<|eot_id|>' }}{% endgeneration %}{% else %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + "
    "message['content'] | trim + '<|eot_id|>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}")
KINDS = {  # template, eos, bos, end-of-turn
    "chatml": (CHATML, "<|im_end|>", None, "<|im_end|>"),
    "chatml-generation": (CHATML_GENERATION, "<|im_end|>", None, "<|im_end|>"),
    "llama3.1": ((TEMPLATES / "llama3.1.jinja").read_text(), "<|eot_id|>", "<|begin_of_text|>",
                 "<|eot_id|>"),
    "qwen3": ((TEMPLATES / "qwen3.jinja").read_text(), "<|im_end|>", None, "<|im_end|>"),
    "llama-generation": (LLAMA_GENERATION, "<|eot_id|>", "<|begin_of_text|>", "<|eot_id|>"),
}
CONVERSATION = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "What is two plus two?"},
                {"role": "assistant", "content": "Two plus two is four."},
                {"role": "user", "content": "And you?"},
                {"role": "assistant", "content": "I am fine, thank you."}]
ANSWERS = [m["content"] for m in CONVERSATION if m["role"] == "assistant"]


def write_tokenizer(folder: Path, template: str, eos: str, bos: str | None) -> Path:
    """A byte-level BPE with the chat special tokens, loadable by HFTokenizer and by
    transformers' AutoTokenizer."""
    import tokenizers

    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos,
              "chat_template": template, **({"bos_token": bos} if bos else {})}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="session")
def tokenizers_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("chat-tokenizers")
    for name, (template, eos, bos, _) in KINDS.items():
        write_tokenizer(root / name, template, eos, bos)
    return root


def reference(folder: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def supervised_runs(tok: HFTokenizer, ids: np.ndarray, mask: np.ndarray) -> list[str]:
    """The decoded maximal runs of supervised tokens."""
    runs, current = [], []
    for i, m in zip(ids.tolist(), mask.tolist(), strict=True):
        if m:
            current.append(i)
        elif current:
            runs.append(current)
            current = []
    runs += [current] if current else []
    return [tok._tok.decode(r, skip_special_tokens=False) for r in runs]


@pytest.mark.parametrize("kind", ["chatml", "chatml-generation", "llama3.1", "qwen3"])
def test_supervised_tokens_are_each_answer_and_its_end_of_turn(tokenizers_dir, kind):
    folder, eot = tokenizers_dir / kind, KINDS[kind][3]
    tok, ref = HFTokenizer(folder), reference(folder)
    expected_ids = ref.apply_chat_template(CONVERSATION, tokenize=True, return_dict=True)
    for mode, answers in (("assistant", ANSWERS), ("last-turn", ANSWERS[-1:]),
                          ("completion", ANSWERS[-1:])):
        ids, mask = ChatEncoder(tok, mode=mode).encode(CONVERSATION)
        assert ids.tolist() == list(expected_ids["input_ids"])  # one tokenisation, theirs
        assert supervised_runs(tok, ids, mask) == [a + eot for a in answers], (kind, mode)
    ids, mask = ChatEncoder(tok, mode="none").encode(CONVERSATION)
    assert mask.all() and len(mask) == len(ids)


@pytest.mark.parametrize("kind", ["chatml-generation", "llama-generation"])
def test_generation_markers_give_transformers_assistant_mask(tokenizers_dir, kind):
    folder = tokenizers_dir / kind
    out = reference(folder).apply_chat_template(
        CONVERSATION, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = ChatEncoder(HFTokenizer(folder)).encode(CONVERSATION)
    assert ids.tolist() == list(out["input_ids"])
    assert mask.tolist() == list(out["assistant_masks"])
    # last-turn keeps only the spans of the last assistant turn
    _, last = ChatEncoder(HFTokenizer(folder), mode="last-turn").encode(CONVERSATION)
    first_end = int(np.flatnonzero(np.diff(np.asarray(out["assistant_masks"])) == -1)[0]) + 1
    assert not last[:first_end].any() and last[first_end:].tolist() == mask[first_end:].tolist()
    # a prompt/completion row: the completion's spans only
    messages, start = parse_row({"prompt": CONVERSATION[:4], "completion": CONVERSATION[4:]})
    _, completion = ChatEncoder(HFTokenizer(folder), mode="completion").encode(messages, start)
    assert completion.tolist() == last.tolist()


def test_qwen3_rules(tokenizers_dir):
    """Qwen3 writes ``<think>\\n\\n</think>\\n\\n`` into the last turn only: not supervised
    (earlier turns lack it, and it is no part of the content); a turn with reasoning is
    supervised whole, reasoning included, as the template rewrote it."""
    tok = HFTokenizer(tokenizers_dir / "qwen3")
    text = tok.apply_chat_template(CONVERSATION, add_generation_prompt=False)
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\nI am fine, thank you."
                         "<|im_end|>\n")
    reasoning = [*CONVERSATION[:4], {"role": "assistant", "content": "I am fine.",
                                     "reasoning_content": "Be polite."}]
    ids, mask = ChatEncoder(tok, mode="last-turn").encode(reasoning)
    assert supervised_runs(tok, ids, mask) == ["<think>\nBe polite.\n</think>\n\nI am fine."
                                               "<|im_end|>"]


TOOL_CONVERSATION = [
    {"role": "user", "content": "What is two plus two?"},
    {"role": "assistant", "tool_calls": [{"type": "function", "function": {
        "name": "add", "arguments": {"a": 2, "b": 2}}}]},
    {"role": "tool", "content": "4"},
    {"role": "assistant", "content": "Two plus two is four.", "reasoning_content": "Say it."},
    {"role": "user", "content": "And you?"},
    {"role": "assistant", "content": "I am fine, thank you."}]


@pytest.mark.parametrize("kind, calls", [
    ("llama3.1", '{"name": "add", "parameters": {"a": 2, "b": 2}}<|eot_id|>'),
    ("qwen3", '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 2}}\n</tool_call>'
              '<|im_end|>')])
def test_tool_calls_and_earlier_reasoning(tokenizers_dir, kind, calls):
    """A tool call turn is supervised whole; the reasoning Qwen3 leaves out of turns before
    the last user message is not in the tokens, so their answers are what is supervised."""
    folder, eot = tokenizers_dir / kind, KINDS[kind][3]
    tok = HFTokenizer(folder)
    ids, mask = ChatEncoder(tok).encode(*parse_row({"messages": TOOL_CONVERSATION}))
    expected = reference(folder).apply_chat_template(TOOL_CONVERSATION, tokenize=True,
                                                     return_dict=True)["input_ids"]
    assert ids.tolist() == list(expected)
    assert supervised_runs(tok, ids, mask) == [calls, *(a + eot for a in ANSWERS)]


def test_prompt_completion_rows(tokenizers_dir):
    tok = HFTokenizer(tokenizers_dir / "chatml")
    messages, start = parse_row({"prompt": "What is two plus two?",
                                 "completion": "Two plus two is four."})
    assert messages == [{"role": "user", "content": "What is two plus two?"},
                        {"role": "assistant", "content": "Two plus two is four."}]
    assert start == 1
    ids, mask = ChatEncoder(tok, mode="completion").encode(messages, start)
    assert supervised_runs(tok, ids, mask) == ["Two plus two is four.<|im_end|>"]
    # a list prompt with an assistant turn in it: completion supervises only the completion
    messages, start = parse_row({"prompt": CONVERSATION[:4], "completion": [CONVERSATION[4]]})
    ids, mask = ChatEncoder(tok, mode="completion").encode(messages, start)
    assert supervised_runs(tok, ids, mask) == [ANSWERS[1] + "<|im_end|>"]
    ids, mask = ChatEncoder(tok, mode="assistant").encode(messages, start)
    assert supervised_runs(tok, ids, mask) == [a + "<|im_end|>" for a in ANSWERS]


@pytest.mark.parametrize("record, message", [
    ([1, 2], "not list"),
    ({"text": "hi"}, "no 'messages'"),
    ({"messages": "hi"}, "not a list"),
    ({"messages": []}, "no messages"),
    ({"messages": [{"content": "hi"}]}, "no role"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "unknown role 'robot'"),
    ({"messages": [{"role": "user"}]}, "no content"),
    ({"messages": [{"role": "user", "content": 3}]}, "not a string"),
    ({"prompt": 3, "completion": "x"}, "not a string or a list"),
])
def test_malformed_rows(record, message):
    with pytest.raises(RowError, match=message):
        parse_row(record)


def test_no_supervised_token_and_byte_tokenizer(tokenizers_dir):
    tok = HFTokenizer(tokenizers_dir / "chatml")
    with pytest.raises(RowError, match="no supervised token"):
        ChatEncoder(tok).encode(CONVERSATION[:2])
    with pytest.raises(DataError, match="byte tokenizer has none"):
        ChatEncoder(ByteTokenizer())
    with pytest.raises(DataError, match="does not compile"):
        ChatEncoder(tok, "{% for %}")


def test_token_mask_and_truncate():
    offsets = [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert token_mask(offsets, [(3, 5)]).tolist() == [0, 1, 1, 0]  # overlap, as transformers
    assert token_mask(offsets, [(0, 2), (6, 8)]).tolist() == [1, 0, 0, 1]
    ids, mask = np.arange(5), np.array([0, 0, 1, 1, 1], dtype=np.uint8)
    assert [x.tolist() for x in truncate(ids, mask, 3, "right")] == [[0, 1, 2], [0, 0, 1]]
    assert [x.tolist() for x in truncate(ids, mask, 3, "left")] == [[2, 3, 4], [1, 1, 1]]
    assert truncate(ids, mask, 5, "error")[0] is ids
    with pytest.raises(RowError, match="5 tokens, longer than --seq-len 3"):
        truncate(ids, mask, 3, "error")
