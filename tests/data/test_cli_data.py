"""The data commands end to end: prepare, inspect, train and evaluate on the result, bad input
as one-line errors that leave nothing behind."""

import json

import pytest

from composer.cli import main


def test_prepare_inspect_train_eval(tmp_path, capsys):
    docs = ["To be, or not to be: that is the question.", "Whether 'tis nobler in the mind",
            "to suffer the slings and arrows of outrageous fortune"] * 20
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"body": d}) + "\n" for d in docs))
    prefix = str(tmp_path / "ds" / "hamlet")
    assert main(["data", "prepare", str(src), "--out", prefix, "--tokenizer", "byte",
                 "--json-key", "body", "--append-eod", "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    n_tokens = sum(len(d.encode()) + 1 for d in docs)
    assert stats["n_documents"] == 60 and stats["n_tokens"] == n_tokens
    assert main(["data", "inspect", prefix, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert (info["n_documents"], info["n_sequences"], info["n_tokens"], info["dtype"],
            info["tokenizer"]) == (60, 60, n_tokens, "uint16", "byte")
    run = tmp_path / "run"
    assert main(["train", "llama-debug", "--set", "vocab_size=257", "--data", prefix,
                 "--seq-len", "16", "--steps", "3", "--global-batch-size", "4",
                 "--document-isolation", "--save", str(run), "--json"]) == 0
    trained = json.loads(capsys.readouterr().out)
    assert (trained["steps"], trained["tokens"]) == (3, 3 * 4 * 16)  # seq_len predicted a sample
    assert main(["eval", str(run), "--data", prefix, "--seq-len", "16", "--max-samples", "6",
                 "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert plain["n_tokens"] == 6 * 16
    assert main(["eval", str(run), "--data", prefix, "--seq-len", "16", "--max-samples", "6",
                 "--document-isolation", "--json"]) == 0
    isolated = json.loads(capsys.readouterr().out)
    assert isolated["n_tokens"] < plain["n_tokens"]  # nothing predicted across a boundary


def test_bad_inputs_are_one_line_errors_and_leave_nothing(tmp_path, capsys):
    good = tmp_path / "good.jsonl"
    good.write_text('{"text": "hello"}\n')
    nokey = tmp_path / "nokey.jsonl"
    nokey.write_text('{"text": "a"}\n{"body": "b"}\n')
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    out = tmp_path / "out"
    cases = [([str(tmp_path / "missing.jsonl")], "byte", "no such file"),
             ([str(empty)], "byte", "empty file"),
             ([str(good), str(nokey)], "byte", "no key 'text'"),
             ([str(good)], str(tmp_path / "no-tokenizer-here"), "tokenizer")]
    for inputs, tok, msg in cases:
        code = main(["data", "prepare", *inputs, "--out", str(out / "p"), "--tokenizer", tok])
        err = capsys.readouterr().err.strip()
        assert code == 2 and msg in err and len(err.splitlines()) == 1, err
        assert not out.exists() or not list(out.iterdir())
    blank = tmp_path / "blank.jsonl"  # documents, every one of them empty
    blank.write_text('{"text": ""}\n{"text": ""}\n')
    assert main(["data", "prepare", str(blank), "--out", str(out / "p"), "--tokenizer",
                 "byte"]) == 2
    assert capsys.readouterr().err == ("composer: error: no tokens: the 2 documents of the "
                                       "inputs are all empty (nothing written)\n")
    assert not out.exists() or not list(out.iterdir())
    bad = tmp_path / "bad"
    (tmp_path / "bad.idx").write_bytes(b"NOTMAGIC!" + bytes(40))
    (tmp_path / "bad.bin").write_bytes(bytes(8))
    assert main(["data", "inspect", str(bad)]) == 2
    assert "not a Megatron indexed dataset" in capsys.readouterr().err


@pytest.mark.slow
def test_the_shakespeare_recipe_beats_a_bigram_model(tmp_path, capsys):
    """The README's real-text run on the built-in corpus, shortened: the recipe's model, data,
    optimizer and schedule, but 160 steps instead of its 480 (the cosine schedule spans the 160;
    validation every 40), reach a validation loss below 2.2 nats per byte (a bigram model of the
    same bytes: 2.50). The full recipe reaches 1.58 (README); this is a third of its cost.
    Margin: at step 160 seeds 0-3 (initialisation and data order) measured 1.871, 1.865, 1.933
    and 1.873 (2026-12-03), 0.26 or more below the threshold against a spread of 0.07."""
    assert main(["train", "--config", "shakespeare", "--steps", "160", "--eval-every", "40",
                 "--log-dir", str(tmp_path), "--json"]) == 0
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    val = [r["val_loss"] for r in rows if "val_loss" in r]
    assert len(val) == 4 and val[-1] < 2.2 and val[-1] < val[0], val


@pytest.mark.slow
def test_parquet_input(tmp_path, capsys):
    import pytest

    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["one", "two two", "three"], "n": [1, 2, 3]}),
                   tmp_path / "x.parquet")
    assert main(["data", "prepare", str(tmp_path / "x.parquet"), "--out", str(tmp_path / "p"),
                 "--tokenizer", "byte", "--json-key", "body", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["n_tokens"] == 3 + 7 + 5
    assert main(["data", "prepare", str(tmp_path / "x.parquet"), "--out", str(tmp_path / "q"),
                 "--tokenizer", "byte"]) == 2
    assert "no column 'text' (columns: body, n)" in capsys.readouterr().err
