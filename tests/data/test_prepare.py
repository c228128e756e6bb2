"""Text to indexed dataset: exact counts, worker-independent bytes, HF tokenizers, clean failure."""

import gzip
import json
import os
import sys

import pytest

from composer.data.indexed import DataError, IndexedDataset
from composer.data.prepare import inspect, prepare
from composer.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

JSONL = ["hello world", "héllo wörld ✓", "", "line\nbreaks\tand tabs"]
GZ = ["compressed 1", "compressed ✓✓"]
TXT = "a whole file\nis one document\n"
SENTENCES = ["the cat sat on the mat", "the dog sat on the log", "a cat and a dog",
             "hybrid models mix mamba and attention", "tokens are ids"]


def _jsonl(path, texts, key="text", blank_every=2):
    lines = []
    for i, t in enumerate(texts):
        lines.append(json.dumps({key: t, "id": i}))
        if i % blank_every == 0:
            lines.append("   ")  # blank lines are skipped
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


def _inputs(tmp_path):
    jsonl = _jsonl(tmp_path / "a.jsonl", JSONL)
    with gzip.open(tmp_path / "b.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write("".join(json.dumps({"text": t}) + "\n" for t in GZ))
    (tmp_path / "c.txt").write_text(TXT, encoding="utf-8")
    return [jsonl, str(tmp_path / "b.jsonl.gz"), str(tmp_path / "c.txt")]


def test_byte_counts(tmp_path):
    calls = []
    stats = prepare(_inputs(tmp_path), str(tmp_path / "out" / "ds"), "byte", append_eod=True,
                    progress=calls.append)
    texts = [*JSONL, *GZ, TXT]
    n_bytes = sum(len(t.encode()) for t in texts)
    assert {k: stats[k] for k in ("n_documents", "n_sequences", "n_tokens", "n_bytes", "dtype")} \
        == {"n_documents": 7, "n_sequences": 7, "n_tokens": n_bytes + 7, "n_bytes": n_bytes,
            "dtype": "uint16"}
    assert sum(calls) == n_bytes
    prefix = str(tmp_path / "out" / "ds")
    assert inspect(prefix) == {"n_documents": 7, "n_sequences": 7, "n_tokens": n_bytes + 7,
                               "dtype": "uint16", "tokenizer": "byte",
                               "bin_bytes": 2 * (n_bytes + 7)}
    ds = IndexedDataset(prefix)
    assert [ds.document(d).tolist() for d in range(7)] == [[*t.encode(), 256] for t in texts]
    tok = load_tokenizer(prefix)  # finds PREFIX.tokenizer/
    assert isinstance(tok, ByteTokenizer)
    assert [tok.decode(ds.document(d)) for d in range(7)] == texts
    assert sorted(os.listdir(tmp_path / "out")) == ["ds.bin", "ds.idx", "ds.tokenizer"]


def test_without_eod(tmp_path):
    stats = prepare([_jsonl(tmp_path / "a.jsonl", JSONL)], str(tmp_path / "ds"), "byte")
    assert stats["n_tokens"] == sum(len(t.encode()) for t in JSONL)
    assert IndexedDataset(tmp_path / "ds").document(1).tolist() == list("héllo wörld ✓".encode())


@pytest.mark.slow
def test_workers_give_identical_files(tmp_path, monkeypatch):
    texts = [f"document {i} " + "ü✓x"[i % 3] * (i % 17) for i in range(2000)]
    inputs = [_jsonl(tmp_path / "a.jsonl", texts, blank_every=7)]
    one = prepare(inputs, str(tmp_path / "w1" / "ds"), "byte", append_eod=True, workers=1)
    # chunks are cut in this process: small ones make 2000 documents 11 windows of 12 chunks
    monkeypatch.setattr("composer.data.prepare.CHUNKSIZE", 16)
    three = prepare(inputs, str(tmp_path / "w3" / "ds"), "byte", append_eod=True, workers=3)
    assert one["n_documents"] == three["n_documents"] == 2000
    for ext in ("bin", "idx"):
        assert (tmp_path / "w1" / f"ds.{ext}").read_bytes() == \
            (tmp_path / "w3" / f"ds.{ext}").read_bytes()


def _hf_folder(tmp_path, config):
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<pad>", "<|endoftext|>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(SENTENCES, trainer)
    folder = tmp_path / "tiny"
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    if config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder, tok


@pytest.mark.slow
def test_hf_tokenizer(tmp_path):
    folder, ref = _hf_folder(tmp_path, {"eos_token": "<|endoftext|>", "name_or_path": "tiny-bpe"})
    texts = [*SENTENCES, "unseen wörds ✓ too"]
    inputs = [_jsonl(tmp_path / "a.jsonl", texts)]
    stats = prepare(inputs, str(tmp_path / "ds"), str(folder), append_eod=True, workers=2)
    eod = ref.token_to_id("<|endoftext|>")
    ids = [ref.encode(t, add_special_tokens=False).ids + [eod] for t in texts]
    assert (stats["n_documents"], stats["n_tokens"]) == (6, sum(map(len, ids)))
    assert inspect(str(tmp_path / "ds"))["tokenizer"] == "tiny-bpe"
    ds = IndexedDataset(tmp_path / "ds")
    assert [ds.document(d).tolist() for d in range(6)] == ids
    tok = load_tokenizer(str(tmp_path / "ds"))
    assert isinstance(tok, HFTokenizer) and (tok.eod, tok.vocab_size) == (eod, ref.get_vocab_size())
    assert [tok.decode(ds.document(d)) for d in range(6)] == texts
    assert sorted(os.listdir(tmp_path / "ds.tokenizer")) == ["tokenizer.json",
                                                             "tokenizer_config.json"]


def test_hf_eos_by_name_and_missing(tmp_path, monkeypatch):
    folder, ref = _hf_folder(tmp_path, None)
    assert HFTokenizer(folder).eod == ref.token_to_id("<|endoftext|>")
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<nope>"}))
    with pytest.raises(DataError) as info:
        HFTokenizer(folder)
    assert str(info.value) == (f"tokenizer {folder}: eos_token '<nope>' from "
                               f"tokenizer_config.json is not in the vocabulary")
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(DataError, match=r"^Hugging Face tokenizers need the tokenizers library "
                                        r"\(pip install tokenizers\)$"):
        HFTokenizer(folder)


def test_tokenizer_folder_errors(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0, "b": 1, "[UNK]": 2},
                                                           unk_token="[UNK]"))
    tok.save(str(tmp_path / "tokenizer.json"))
    assert load_tokenizer(str(tmp_path)).eod is None  # loads (generation runs to its limit)
    (tmp_path / "a.txt").write_text("a b")
    with pytest.raises(DataError) as info:  # but cannot end documents
        prepare([str(tmp_path / "a.txt")], str(tmp_path / "ds"), str(tmp_path), append_eod=True)
    assert str(info.value) == (f"--append-eod: tokenizer {tmp_path}: no end-of-document token "
                               f"(set eos_token in tokenizer_config.json, or have one of </s>, "
                               f"<|endoftext|>, <|end_of_text|>, <eos>)")
    assert not (tmp_path / "ds.bin").exists()
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError) as info:
        load_tokenizer(str(tmp_path / "empty"))
    assert str(info.value) == (f"tokenizer {tmp_path}/empty: the folder {tmp_path}/empty has "
                               f"no tokenizer.json")


def test_hub_download_asks_only_for_tokenizer_files(tmp_path, monkeypatch):
    folder, _ = _hf_folder(tmp_path, None)
    calls = []

    def fake(repo_id, allow_patterns):
        calls.append((repo_id, allow_patterns))
        return str(folder)

    monkeypatch.setattr("huggingface_hub.snapshot_download", fake)
    tok = load_tokenizer("org/tiny")
    assert (tok.name, calls) == ("org/tiny", [("org/tiny", ["tokenizer.json",
                                                            "tokenizer_config.json",
                                                            "special_tokens_map.json",
                                                            "chat_template.jinja"])])


def _offline(*args, **kwargs):
    raise OSError("offline\nsecond line")


BAD = {
    "missing file": (lambda d: [str(d / "nope.jsonl")], "byte",
                     "input {d}/nope.jsonl: no such file"),
    "empty file": (lambda d: [str(d / "e.jsonl")], "byte", "input {d}/e.jsonl: empty file"),
    "blank lines only": (lambda d: [str(d / "blank.jsonl")], "byte",
                         "input {d}/blank.jsonl: no documents (only blank lines)"),
    "no key": (lambda d: [str(d / "k.jsonl")], "byte", "{d}/k.jsonl:3: no key 'text'"),
    "bad json": (lambda d: [str(d / "j.jsonl")], "byte",
                 "{d}/j.jsonl:2: invalid JSON (Expecting value: line 1 column 1 (char 0))"),
    "unknown extension": (lambda d: [str(d / "a.csv")], "byte",
                          "input {d}/a.csv: unknown extension (expected .jsonl.gz, .jsonl, "
                          ".txt, .parquet)"),
    "no tokenizer": (lambda d: [str(d / "k.jsonl")], "no-such/tokenizer",
                     "tokenizer no-such/tokenizer: not a local folder with tokenizer.json and "
                     "not downloadable (OSError: offline)"),
    "no pyarrow": (lambda d: [str(d / "a.parquet")], "byte",
                   "input {d}/a.parquet: reading .parquet needs pyarrow (pip install pyarrow)"),
}


# errors found while tokenising are raised in a worker when there is a pool
@pytest.mark.parametrize("case,workers", [(c, 1) for c in sorted(BAD)]
                         + [pytest.param(c, 2, marks=pytest.mark.slow)  # a pool: seconds
                            for c in ("no key", "bad json")])
def test_bad_inputs_leave_nothing(tmp_path, monkeypatch, case, workers):
    src = tmp_path / "src"
    src.mkdir()
    (src / "e.jsonl").write_text("")
    (src / "blank.jsonl").write_text("\n  \n")
    (src / "k.jsonl").write_text('{"text": "a"}\n\n{"body": "b"}\n{"text": "c"}\n')
    (src / "j.jsonl").write_text('{"text": "a"}\nnot json\n')
    (src / "a.csv").write_text("text\nx\n")
    (src / "a.parquet").write_bytes(b"PAR1")
    monkeypatch.setattr("huggingface_hub.snapshot_download", _offline)
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    out = tmp_path / "out"
    out.mkdir()
    inputs, tokenizer, message = BAD[case]
    with pytest.raises(DataError) as info:
        prepare(inputs(src), str(out / "ds"), tokenizer, workers=workers)
    assert str(info.value) == message.format(d=src)
    assert os.listdir(out) == []
    # a folder that prepare created is removed again
    with pytest.raises(DataError):
        prepare(inputs(src), str(tmp_path / "new" / "ds"), tokenizer, workers=1)
    assert not (tmp_path / "new").exists()


def test_refuses_to_overwrite(tmp_path):
    inputs = [_jsonl(tmp_path / "a.jsonl", JSONL)]
    prefix = str(tmp_path / "ds")
    prepare(inputs, prefix, "byte")
    with pytest.raises(DataError) as info:
        prepare(inputs, prefix, "byte", append_eod=True)
    assert str(info.value) == f"{prefix}.bin already exists (--force replaces it)"
    assert inspect(prefix)["n_tokens"] == sum(len(t.encode()) for t in JSONL)
    prepare(inputs, prefix, "byte", append_eod=True, force=True)
    assert inspect(prefix)["n_tokens"] == sum(len(t.encode()) + 1 for t in JSONL)
    assert sorted(os.listdir(tmp_path)) == ["a.jsonl", "ds.bin", "ds.idx", "ds.tokenizer"]
