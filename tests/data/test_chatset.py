"""The built-in chat set (composer/data/chatset.py): the shipped files are what the script
generates, every row is a valid conversation whose answer is right, the tokenizer loads in composer
and in transformers and renders and masks as transformers does, and the sft-debug recipe trains on
it."""

import fnmatch
import json
import re
from pathlib import Path

import pytest
import tomllib

from composer.data import chatset
from composer.data.blend import parse_blend
from composer.data.tokenizer import HFTokenizer, load_tokenizer

ROWS = [json.loads(line) for line in chatset.JSONL.read_text(encoding="utf-8").splitlines()]


def test_the_shipped_files_are_what_the_script_generates(tmp_path):
    report = chatset.build(tmp_path)
    assert (tmp_path / "chat.jsonl").read_bytes() == chatset.JSONL.read_bytes()
    assert report["conversations"] == len(ROWS) == chatset.N_CONVERSATIONS
    assert (tmp_path / "tokenizer" / "tokenizer_config.json").read_bytes() == \
        (chatset.TOKENIZER / "tokenizer_config.json").read_bytes()
    # tokenizer.json as parsed: a newer `tokenizers` may lay the same tokenizer out differently
    new = json.loads((tmp_path / "tokenizer" / "tokenizer.json").read_text())
    shipped = json.loads((chatset.TOKENIZER / "tokenizer.json").read_text())
    for key in ("added_tokens", "pre_tokenizer", "decoder"):
        assert new[key] == shipped[key], key
    assert (new["model"]["vocab"], new["model"]["merges"]) == \
        (shipped["model"]["vocab"], shipped["model"]["merges"])


def test_the_set_is_small_and_written_for_the_project():
    assert chatset.JSONL.stat().st_size < 300_000
    assert "written for this project" in chatset.__doc__ and "Apache-2.0" in chatset.__doc__


def test_every_row_is_a_valid_conversation():
    for n, row in enumerate(ROWS, 1):
        assert list(row) == ["messages"], n
        messages = row["messages"]
        roles = [m["role"] for m in messages]
        turns = roles[1:] if roles[0] == "system" else roles
        assert turns and turns == ["user", "assistant"] * (len(turns) // 2), n
        assert all(set(m) == {"role", "content"} and isinstance(m["content"], str)
                   and m["content"].strip() and m["content"].isascii() for m in messages), n
        assert chatset.n_tokens(messages) <= chatset.MAX_TOKENS, n
    kinds = [[m["role"] for m in r["messages"]] for r in ROWS]
    assert sum("system" in k for k in kinds) > 100  # some with a system prompt
    assert sum(k.count("assistant") > 1 for k in kinds) > 200  # some multi-turn


def _pairs():
    for row in ROWS:
        messages = [m for m in row["messages"] if m["role"] != "system"]
        yield from zip(messages[::2], messages[1::2], strict=True)


def test_the_answers_are_right():
    checked = 0
    for user, assistant in _pairs():
        q, a = user["content"], assistant["content"]
        if m := re.fullmatch(r"(\d+) ([+-]) (\d+) = (-?\d+)\.", a):
            x, op, y, value = int(m[1]), m[2], int(m[3]), int(m[4])
            assert f"{x} {op} {y}" in q and value == (x + y if op == "+" else x - y) >= 0, a
        elif m := re.fullmatch(r"The capital of (\w+) is (\w+)\.", a):
            assert m[1] in q and chatset.CAPITALS[m[1]] == m[2], a
        elif m := re.fullmatch(r"'(\w+)' has (\d+) letters\.", a):
            assert m[1] in q and len(m[1]) == int(m[2]), a
        elif a.isupper():
            assert a.lower() in q, a
        else:
            assert a in q or a[::-1] in q or a.split()[0] in q, a
        checked += 1
    assert checked == sum(m["role"] == "assistant" for r in ROWS for m in r["messages"])


def test_the_tokenizer_loads_in_composer():
    tok = load_tokenizer(str(chatset.TOKENIZER))
    assert isinstance(tok, HFTokenizer)
    assert tok.vocab_size == 259 and tok.eos_token == "<|im_end|>" and tok.eod == 258
    assert tok.encode("héllo ✓") == list("héllo ✓".encode())  # ids 0-255 are the bytes
    assert tok.encode("<|im_start|>user") == [257, *b"user"]
    text = tok.apply_chat_template(ROWS[0]["messages"], add_generation_prompt=False)
    assert len(tok.encode(text)) == chatset.n_tokens(ROWS[0]["messages"])


def test_transformers_renders_and_masks_as_the_template_says():
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(chatset.TOKENIZER))
    ours = load_tokenizer(str(chatset.TOKENIZER))
    assert len(hf) == ours.vocab_size and hf.eos_token_id == ours.eod
    for row in ROWS[:60]:
        messages = row["messages"]
        for prompt in (False, True):
            text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
            assert text == ours.apply_chat_template(messages, add_generation_prompt=prompt)
        out = hf.apply_chat_template(messages, tokenize=True, return_dict=True,
                                     return_assistant_tokens_mask=True)
        ids, mask = out["input_ids"], out["assistant_masks"]
        assert ids == ours.encode(text.removesuffix("<|im_start|>assistant\n"))
        # the supervised tokens are exactly each answer and its end-of-turn token
        spans, span = [], []
        for i, m in zip(ids, mask, strict=True):
            if m:
                span.append(i)
            elif span:
                spans, span = [*spans, span], []
        answers = [m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant"]
        assert [hf.decode(s) for s in spans + ([span] if span else [])] == answers


def test_the_recipe_trains_a_tiny_model_on_the_set():
    from composer.config import ModelConfig, apply_overrides
    from composer.train.recipe import Recipe, merge, model_source, read_recipe, recipe_path

    recipe = merge(Recipe(), read_recipe(recipe_path("sft-debug")), "sft-debug")
    assert recipe.objective == "sft" and recipe.lora_rank == 0 and recipe.eval_every
    assert recipe.seq_len >= chatset.MAX_TOKENS and recipe.split
    assert parse_blend(recipe.data) == [(1.0, str(chatset.PREFIX))]
    assert parse_blend("data/web") == [(1.0, "data/web")]  # any other prefix is as given
    _, pattern, overrides = model_source(recipe.model)
    cfg = apply_overrides(ModelConfig(pattern=pattern), overrides)
    assert cfg.vocab_size == load_tokenizer(str(chatset.TOKENIZER)).vocab_size


def test_the_shipped_prepared_set_is_what_prepare_writes(tmp_path):
    """``python -m composer.data.chatset --prepare`` rebuilds the shipped files byte for byte."""
    import shutil

    shutil.copyfile(chatset.BUILTIN_CHAT / chatset.JSONL.name, tmp_path / chatset.JSONL.name)
    shutil.copytree(chatset.TOKENIZER, tmp_path / chatset.TOKENIZER.name)
    chatset.prepare(tmp_path)
    for suffix in (".bin", ".idx", ".mask.bin", ".mask.idx", ".chat.json"):
        name = chatset.PREFIX.name + suffix
        assert (tmp_path / name).read_bytes() == (chatset.BUILTIN_CHAT / name).read_bytes(), name


def test_the_prepared_set_masks_the_answers():
    from composer.data.masked import MaskedDataset

    ds = MaskedDataset(parse_blend("builtin:chat")[0][1])
    tok = load_tokenizer(str(chatset.PREFIX))
    assert ds.n_documents == len(ROWS)
    assert ds.supervised_tokens() == sum(len(m["content"]) + 1 for r in ROWS
                                         for m in r["messages"] if m["role"] == "assistant")
    for d in (0, 1, len(ROWS) - 1):
        ids, mask = ds.document(d)
        answers = [m["content"] for m in ROWS[d]["messages"] if m["role"] == "assistant"]
        supervised = ids[mask == 1]
        # each answer's bytes and its <|im_end|> (the eod, which decode leaves out)
        assert int((supervised == tok.eod).sum()) == len(answers)
        assert tok.decode(supervised) == "".join(answers)
        assert len(ids) == chatset.n_tokens(ROWS[d]["messages"])


@pytest.mark.slow
def test_the_sft_debug_recipe_lowers_the_masked_loss(tmp_path):
    """The issue's acceptance, masked validation loss down >= 30%, on a shortened run: the
    recipe's model, data and optimizer for 120 steps instead of its 240 (the cosine schedule
    spans the 120), for half the cost. Measured (2026-12-03) from step 40 to step 120: 1.998 to
    1.050 on seed 0, 1.977 to 1.023 on seed 1 (0.53x, 0.52x against the 0.7x bound); the full
    recipe goes from 1.975 to 0.522."""
    from composer.cli import main

    assert main(["train", "--config", "sft-debug", "--steps", "120", "--log-dir", str(tmp_path),
                 "--json"]) == 0
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    val = [r["val_loss"] for r in rows if "val_loss" in r]
    assert len(val) >= 2 and val[-1] <= 0.7 * val[0], val
    assert all(r["supervised_tokens"] > 0 for r in rows if "loss" in r)


def test_the_package_ships_every_file_of_the_set():
    root = Path(chatset.__file__).parent
    config = tomllib.loads((root.parents[1] / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["package-data"]["composer.data"]
    files = [p.relative_to(root).as_posix() for p in chatset.BUILTIN_CHAT.rglob("*")
             if p.is_file()]
    assert files and [f for f in files if not any(fnmatch.fnmatch(f, pat) for pat in patterns)
                      ] == []
