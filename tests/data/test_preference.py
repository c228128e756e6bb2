"""``composer data prepare --format preference`` and the pairs DPO reads: each pair is two
documents (2i chosen, 2i + 1 rejected) equal to ``--format chat --mask completion``'s rendering of
prompt + side; string and message forms give the same tokens; any --workers the same bytes;
``inspect`` reports pairs; every bad row is one line naming file:line, exit 2, nothing written;
the pair order per epoch and the truncation of :class:`PreferencePairs`."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from composer.data.chat import ChatEncoder, parse_row
from composer.data.chatset import TOKENIZER
from composer.data.indexed import DataError
from composer.data.masked import MaskedDataset
from composer.data.preference import PreferencePairs, is_preference
from composer.data.tokenizer import load_tokenizer
from tests.data.test_cli_chat import jsonl, run

SYSTEM = {"role": "system", "content": "Answer in one word."}
ROWS = [{"prompt": "What is two plus two?", "chosen": "Four.", "rejected": "Five."},
        {"prompt": [SYSTEM, {"role": "user", "content": "Name a colour."}],
         "chosen": {"role": "assistant", "content": "Blue."},
         "rejected": [{"role": "assistant", "content": "Seven."}]},
        {"prompt": "Spell cat.", "chosen": "c a t", "rejected": "d o g"}] * 2


def as_chat(row: dict, side: str) -> tuple[np.ndarray, np.ndarray]:
    """What ``--format chat --mask completion`` makes of prompt + side."""
    value = row[side]
    completion = [value] if isinstance(value, dict) else value
    enc = ChatEncoder(load_tokenizer(str(TOKENIZER)), mode="completion")
    return enc.encode(*parse_row({"prompt": row["prompt"], "completion": completion}))


def prepare(capsys, tmp_path: Path, rows: list, *extra) -> tuple[int, str, str, Path]:
    tmp_path.mkdir(exist_ok=True)
    src = jsonl(tmp_path / "prefs.jsonl", rows)
    prefix = tmp_path / "out" / "prefs"
    code, out, err = run(capsys, "prepare", src, "--format", "preference", "--tokenizer",
                         TOKENIZER, "--out", prefix, *extra)
    return code, out, err, prefix


def test_pairs_are_the_chat_renderings_of_each_side(tmp_path, capsys):
    code, out, err, prefix = prepare(capsys, tmp_path, ROWS, "--json")
    assert code == 0, err
    stats = json.loads(out)
    expected = [as_chat(r, side) for r in ROWS for side in ("chosen", "rejected")]
    assert (stats["pairs"], stats["documents"], stats["rows"], stats["skipped_rows"]) == \
        (6, 12, 6, 0)
    assert stats["tokens"] == sum(len(ids) for ids, _ in expected)
    assert stats["supervised_tokens"] == sum(int(m.sum()) for _, m in expected)
    ds = MaskedDataset(prefix)
    assert ds.meta["kind"] == "preference" and is_preference(prefix)
    for d, (ids, mask) in enumerate(expected):
        got_ids, got_mask = ds.document(d)
        assert got_ids.tolist() == ids.tolist() and got_mask.tolist() == mask.tolist(), d
    tok = load_tokenizer(str(TOKENIZER))  # the mask is the answer and its end of turn
    ids, mask = ds.document(3)
    assert tok.decode([int(i) for i, m in zip(ids, mask, strict=True) if m]) == "Seven."
    assert int(ids[mask == 1][-1]) == tok.encode("<|im_end|>")[0]
    # a string side and its one-message forms are the same conversation
    same = {"prompt": [{"role": "user", "content": "What is two plus two?"}],
            "chosen": [{"role": "assistant", "content": "Four."}],
            "rejected": {"role": "assistant", "content": "Five."}}
    assert [a.tolist() for a in as_chat(same, "chosen")] == \
        [a.tolist() for a in ds.document(0)]
    info = json.loads(run(capsys, "inspect", prefix, "--json")[1])
    assert (info["format"], info["pairs"], info["documents"], info["mask"]) == \
        ("preference", 6, 12, "completion")
    row = json.loads(run(capsys, "inspect", prefix, "--row", 1, "--json")[1])
    assert row == {"token_ids": expected[1][0].tolist(), "loss_mask": expected[1][1].tolist()}


def test_workers_write_the_same_bytes(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("composer.data.prepare.CHUNKSIZE", 2)  # chunks over both workers
    prefixes = []
    for workers in (1, 2):
        code, _, err, prefix = prepare(capsys, tmp_path / str(workers), ROWS + ["bad"],
                                       "--workers", workers, "--skip-bad-rows")
        assert code == 0, err
        prefixes.append(prefix)
    for suffix in (".bin", ".idx", ".mask.bin", ".mask.idx"):
        assert Path(f"{prefixes[0]}{suffix}").read_bytes() == \
            Path(f"{prefixes[1]}{suffix}").read_bytes()
    meta = MaskedDataset(prefixes[1]).meta
    assert (meta["pairs"], meta["rows"], meta["skipped_rows"]) == (6, 7, 1)


BAD = [({"prompt": "Hi", "chosen": "Hello.", "rejected": "Hello."},
        "'chosen' and 'rejected' are identical"),
       ({"prompt": "Hi", "chosen": "Hello.",
         "rejected": [{"role": "assistant", "content": "Hello."}]},
        "'chosen' and 'rejected' are identical"),
       ({"prompt": "Hi", "chosen": "Hello."}, "no 'rejected' key"),
       ({"chosen": "a", "rejected": "b"}, "no 'prompt' key"),
       ({"prompt": "Hi", "chosen": 3, "rejected": "b"}, "'chosen' is int"),
       ({"prompt": "Hi", "chosen": [], "rejected": "b"}, "'chosen' has no messages"),
       ({"prompt": [{"role": "user"}], "chosen": "a", "rejected": "b"},
        "prompt: message 1 (user) has no content"),
       ({"prompt": "Hi", "chosen": "a", "rejected": [{"role": "user", "content": "b"}]},
        "rejected: no supervised token"),
       ("[1, 2]", "a row is a JSON object"),
       ("{", "invalid JSON")]


@pytest.mark.parametrize("line, message", BAD, ids=range(len(BAD)))
def test_bad_rows_are_one_line_naming_file_and_line(tmp_path, capsys, line, message):
    code, _, err, prefix = prepare(capsys, tmp_path, [ROWS[0], line])
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"prefs.jsonl:2: {message}" in err and "nothing written" in err, err
    assert not prefix.parent.exists()


def test_refusals_and_truncation(tmp_path, capsys):
    code, _, err, prefix = prepare(capsys, tmp_path, ROWS, "--mask", "assistant")
    assert code == 2 and "--mask is for --format chat" in err and not prefix.parent.exists()
    n = len(as_chat(ROWS[0], "chosen")[0])
    code, _, err, _ = prepare(capsys, tmp_path, ROWS, "--seq-len", n - 1, "--truncate", "error")
    assert code == 2 and f"prefs.jsonl:1: chosen: {n} tokens, longer than --seq-len" in err
    # a prompt longer than the cut leaves no supervised token: bad, skipped
    long = {"prompt": "x " * 40, "chosen": "a", "rejected": "b"}
    cap = max(len(as_chat(r, side)[0]) for r in ROWS for side in ("chosen", "rejected"))
    code, out, err, prefix = prepare(capsys, tmp_path, [*ROWS, long], "--seq-len", cap,
                                     "--skip-bad-rows", "--json")
    assert code == 0, err
    stats = json.loads(out)
    assert stats["skipped_rows"] == 1 and stats["pairs"] == 6 and stats["truncated"] == 0
    assert max(MaskedDataset(prefix).lengths) == cap


def test_pairs_order_split_and_truncation(tmp_path, capsys):
    code, _, err, prefix = prepare(capsys, tmp_path, ROWS)
    assert code == 0, err
    ds = MaskedDataset(prefix)
    pairs = PreferencePairs(ds, seed=3, pairs=range(1, 5))
    order = np.random.default_rng([3, 1]).permutation(4)
    for k in range(4, 8):  # epoch 1
        ids_w, mask_w, ids_l, mask_l = pairs[k]
        i = 1 + int(order[k - 4])
        assert ids_w.tolist() == ds.document(2 * i)[0].tolist()
        assert mask_l.tolist() == ds.document(2 * i + 1)[1].tolist()
    assert pairs.longest == int(ds.lengths[2:10].max())
    cut = PreferencePairs(ds, seed=3, seq_len=20, truncate_side="left")
    assert cut.truncated == 6
    ids_w, _, ids_l, _ = cut.pair(0)
    assert ids_w.tolist() == ds.document(0)[0][-20:].tolist() and len(ids_l) == 20
    with pytest.raises(DataError, match="pair 0 has .* longer than --seq-len 20"):
        PreferencePairs(ds, seed=3, seq_len=20, truncate_side="error")
    code, _, err = run(capsys, "prepare", jsonl(tmp_path / "c.jsonl", [
        {"prompt": "a", "completion": "b"}]), "--format", "chat", "--tokenizer", TOKENIZER,
        "--out", tmp_path / "chat")
    assert code == 0, err
    assert not is_preference(tmp_path / "chat")
    with pytest.raises(DataError, match="not a dataset of preference pairs"):
        PreferencePairs(MaskedDataset(tmp_path / "chat"), seed=0)
