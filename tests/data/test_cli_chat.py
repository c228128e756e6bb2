"""``composer data prepare --format chat`` and ``data inspect`` end to end: counts and rows
match the encoder, any --workers writes the same bytes, a template override is recorded, and
every bad input is one line, exit code 2, nothing written."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from composer.cli import main
from composer.data.chat import ChatEncoder, parse_row
from composer.data.masked import MaskedDataset
from composer.data.tokenizer import HFTokenizer
from tests.data.test_chat import CHATML, CHATML_GENERATION, CONVERSATION, write_tokenizer

ROWS = [{"messages": CONVERSATION},
        {"prompt": "What is two plus two?", "completion": "Two plus two is four."},
        {"messages": [{"role": "user", "content": "Hello there, how are you?"},
                      {"role": "assistant", "content": "I am fine, thank you."}]}] * 3


@pytest.fixture(scope="module")
def chatml(tmp_path_factory) -> Path:
    return write_tokenizer(tmp_path_factory.mktemp("tok") / "chatml", CHATML, "<|im_end|>",
                           None)


def jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def run(capsys, *args) -> tuple[int, str, str]:
    code = main(["data", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


def test_prepare_inspect_and_rows(tmp_path, capsys, chatml):
    src = jsonl(tmp_path / "chat.jsonl", ROWS[:3])
    gz = tmp_path / "more.jsonl.gz"
    gz.write_bytes(gzip.compress(jsonl(tmp_path / "x.jsonl", ROWS[3:]).read_bytes()))
    prefix = tmp_path / "out" / "chat"
    code, out, err = run(capsys, "prepare", src, gz, "--format", "chat", "--tokenizer", chatml,
                         "--out", prefix, "--json")
    assert code == 0, err
    stats = json.loads(out)
    enc = ChatEncoder(HFTokenizer(chatml))
    expected = [enc.encode(*parse_row(r)) for r in ROWS]
    n_tokens = sum(len(ids) for ids, _ in expected)
    supervised = sum(int(m.sum()) for _, m in expected)
    assert (stats["documents"], stats["tokens"], stats["supervised_tokens"],
            stats["skipped_rows"]) == (9, n_tokens, supervised, 0)
    code, out, _ = run(capsys, "inspect", prefix, "--json")
    info = json.loads(out)
    assert code == 0 and (info["documents"], info["tokens"], info["supervised_tokens"],
                          info["n_documents"], info["mask"]) == (9, n_tokens, supervised, 9,
                                                                 "assistant")
    for i in (0, 1, 8):
        code, out, _ = run(capsys, "inspect", prefix, "--row", i, "--json")
        assert json.loads(out) == {"token_ids": expected[i][0].tolist(),
                                   "loss_mask": expected[i][1].tolist()}
    assert MaskedDataset(prefix).meta["chat_template"] == "tokenizer"
    code, _, err = run(capsys, "inspect", prefix, "--row", 9)
    assert code == 2 and "9 documents" in err


def test_text_datasets_report_documents_and_rows(tmp_path, capsys):
    src = jsonl(tmp_path / "t.jsonl", [{"text": "hello"}, {"text": "hi"}])
    prefix = tmp_path / "text"
    assert run(capsys, "prepare", src, "--tokenizer", "byte", "--out", prefix)[0] == 0
    info = json.loads(run(capsys, "inspect", prefix, "--json")[1])
    assert (info["documents"], info["tokens"], info["n_documents"]) == (2, 7, 2)
    row = json.loads(run(capsys, "inspect", prefix, "--row", 1, "--json")[1])
    assert row == {"token_ids": list(b"hi"), "loss_mask": [1, 1]}
    code, _, err = run(capsys, "prepare", src, "--tokenizer", "byte", "--out", prefix / "x",
                       "--mask", "none")
    assert code == 2 and "--mask needs --format chat" in err


def test_workers_override_truncate_and_skip(tmp_path, capsys, chatml, monkeypatch):
    monkeypatch.setattr("composer.data.prepare.CHUNKSIZE", 4)  # chunks over both workers
    src = jsonl(tmp_path / "chat.jsonl", ROWS * 3 + ['{"messages": [{"role": "user"}]}'])
    template = tmp_path / "gen.jinja"
    template.write_text(CHATML_GENERATION)
    outs = []
    for workers in (1, 2):
        prefix = tmp_path / f"w{workers}"
        code, out, err = run(capsys, "prepare", src, "--format", "chat", "--tokenizer", chatml,
                             "--out", prefix, "--chat-template", template, "--workers",
                             workers, "--skip-bad-rows", "--seq-len", 20, "--truncate", "left",
                             "--json")
        assert code == 0, err
        stats = json.loads(out)
        assert stats["skipped_rows"] == 1 and stats["documents"] == 27 and stats["truncated"]
        outs.append(prefix)
    for suffix in (".bin", ".idx", ".mask.bin", ".mask.idx"):
        assert Path(f"{outs[0]}{suffix}").read_bytes() == Path(f"{outs[1]}{suffix}").read_bytes()
    saved = Path(f"{outs[0]}.tokenizer") / "chat_template.jinja"
    assert saved.read_text() == CHATML_GENERATION
    ds = MaskedDataset(outs[0])
    assert ds.meta["skipped_rows"] == 1 and ds.meta["chat_template"] == "override"
    assert max(ds.lengths) == 20


BAD_ROWS = [("not json", "invalid JSON"),
            ('{"messages": [{"content": "hi"}]}', "no role"),
            ('{"messages": [{"role": "robot", "content": "hi"}]}', "unknown role"),
            ('{"messages": [{"role": "user"}]}', "no content"),
            ('{"messages": [{"role": "user", "content": "hi"}]}', "no supervised token"),
            ('{"text": "hi"}', "no 'messages'")]


@pytest.mark.parametrize("line, message", BAD_ROWS)
def test_bad_rows_are_one_line_naming_file_and_line(tmp_path, capsys, chatml, line, message):
    src = jsonl(tmp_path / "bad.jsonl", [ROWS[0], line])
    out = tmp_path / "out"
    code, _, err = run(capsys, "prepare", src, "--format", "chat", "--tokenizer", chatml,
                       "--out", out / "p")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"{src}:2: " in err and message in err, err
    assert not out.exists() or not list(out.iterdir())


def test_bad_inputs_are_one_line_and_leave_nothing(tmp_path, capsys, chatml):
    good = jsonl(tmp_path / "good.jsonl", ROWS[:2])
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    failing = tmp_path / "failing.jinja"  # a template that raises on a row
    failing.write_text("{% for m in messages %}{% if m['role'] == 'system' %}"
                       "{{ raise_exception('no system messages') }}{% endif %}"
                       "{{ m['content'] }}{% endfor %}")
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}")
    out = tmp_path / "out"
    n = len(ChatEncoder(HFTokenizer(chatml)).encode(*parse_row(ROWS[0]))[0])
    cases = [([empty], [], "empty file"),
             ([good], ["--chat-template", failing], f"{good}:1: the chat template failed"),
             ([good], ["--chat-template", broken], "does not compile"),
             ([good], ["--seq-len", 8, "--truncate", "error"],
              f"{good}:1: {n} tokens, longer than --seq-len 8"),
             ([good], ["--tokenizer", "byte"], "byte tokenizer has none")]
    for inputs, extra, message in cases:
        tok = [] if "--tokenizer" in extra else ["--tokenizer", chatml]
        code, _, err = run(capsys, "prepare", *inputs, "--format", "chat", *tok, *extra,
                           "--out", out / "p")
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert message in err, err
        assert not out.exists() or not list(out.iterdir())
    # every row bad, skipped: nothing left to write
    bad = jsonl(tmp_path / "allbad.jsonl", ["nope", "nope"])
    code, _, err = run(capsys, "prepare", bad, "--format", "chat", "--tokenizer", chatml,
                       "--out", out / "p", "--skip-bad-rows")
    assert code == 2 and "all 2 rows were bad" in err
    assert not out.exists() or not list(out.iterdir())


def test_parquet_rows(tmp_path, capsys, chatml):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = [{"prompt": "What is two plus two?", "completion": "Two plus two is four."}] * 2
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "rows.parquet")
    prefix = tmp_path / "pq"
    code, out, err = run(capsys, "prepare", tmp_path / "rows.parquet", "--format", "chat",
                         "--tokenizer", chatml, "--out", prefix, "--mask", "completion",
                         "--json")
    assert code == 0, err
    ids, mask = ChatEncoder(HFTokenizer(chatml), mode="completion").encode(*parse_row(rows[0]))
    assert json.loads(out)["supervised_tokens"] == 2 * int(mask.sum())
    assert json.loads(run(capsys, "inspect", prefix, "--row", 1, "--json")[1]) == {
        "token_ids": ids.tolist(), "loss_mask": mask.tolist()}
