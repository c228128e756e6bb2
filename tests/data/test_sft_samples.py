"""Packed SFT samples (composer.data.sft): truncation, best-fit decreasing (every document once,
rows within seq_len, the bin choice rule), padding, the per-epoch row order, determinism."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from composer.data.indexed import DataError
from composer.data.masked import MaskedDataset, MaskedWriter
from composer.data.sft import SFTSamples, best_fit_decreasing, truncate


def write_masked(prefix: Path, lengths: list[int], vocab: int = 61, seed: int = 0,
                 p: float = 0.5) -> Path:
    """A masked dataset of random tokens (1..vocab-1) and random masks, one document per
    length."""
    rng = np.random.default_rng(seed)
    with MaskedWriter(prefix, np.uint16) as w:
        for n in lengths:
            w.add_document(rng.integers(1, vocab, n), (rng.random(n) < p).astype(np.uint8))
    return prefix


def brute_bfd(lengths: list[int], cap: int) -> list[list[int]]:
    """Best-fit decreasing, the O(n * rows) way."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    rows: list[list[int]] = []
    room: list[int] = []
    for i in order:
        fits = [r for r in range(len(rows)) if room[r] >= lengths[i]]
        if fits:
            r = min(fits, key=lambda r: (room[r], r))
        else:
            r = len(rows)
            rows.append([])
            room.append(cap)
        rows[r].append(i)
        room[r] -= lengths[i]
    return rows


def test_truncate_sides() -> None:
    ids, mask = np.arange(10), np.arange(10) % 2
    assert truncate(ids, mask, 4, "right")[0].tolist() == [0, 1, 2, 3]
    assert truncate(ids, mask, 4, "left")[0].tolist() == [6, 7, 8, 9]
    assert truncate(ids, mask, 4, "left")[1].tolist() == [0, 1, 0, 1]
    assert truncate(ids, mask, 10, "error")[0] is ids
    with pytest.raises(DataError, match="doc 3: 10 tokens, longer than --seq-len 4"):
        truncate(ids, mask, 4, "error", "doc 3")


@pytest.mark.parametrize("seed", range(5))
def test_bfd_matches_the_rule(seed: int) -> None:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 33, 300).tolist()
    rows = best_fit_decreasing(np.array(lengths), 32)
    assert rows == brute_bfd(lengths, 32)
    assert sorted(i for r in rows for i in r) == list(range(300))
    assert all(sum(lengths[i] for i in r) <= 32 for r in rows)


def test_bfd_best_fit_not_first_fit() -> None:
    # 6 opens row 0 (room 4), 5 opens row 1 (room 5), 4 goes to row 0 (least room that fits)
    assert best_fit_decreasing(np.array([5, 6, 4]), 10) == [[1, 2], [0]]


def test_samples_pack_every_document_once(tmp_path: Path) -> None:
    lengths = [3, 17, 9, 24, 1, 12, 40, 8, 5, 16]
    ds = MaskedDataset(write_masked(tmp_path / "c", lengths))
    s = SFTSamples(ds, 16, seed=3, truncate_side="right", pad_id=7)
    assert s.truncated == 3 and s.n_tokens == sum(min(n, 16) for n in lengths)
    seen = []
    for r in range(s.n_rows):
        tokens, docs, mask = s.row(r)
        assert tokens.shape == docs.shape == mask.shape == (16,) and tokens.dtype == np.int64
        assert docs[0] == 0 and np.all(np.diff(docs) >= 0) and np.all(np.diff(docs) <= 1)
        members = s.row_docs[s.row_start[r]:s.row_start[r + 1]].tolist()
        pos = 0
        for j, d in enumerate(members):
            ids, m = ds.document(d)
            n = min(len(ids), 16)
            assert tokens[pos:pos + n].tolist() == ids[:n].tolist()
            assert mask[pos:pos + n].tolist() == m[:n].tolist()
            assert (docs[pos:pos + n] == j).all()
            pos += n
        assert (tokens[pos:] == 7).all() and (mask[pos:] == 0).all()
        assert (docs[pos:] == len(members)).all()
        seen += members
    assert sorted(seen) == list(range(len(lengths)))
    # the per-epoch order visits every row once
    firsts = {tuple(s[k][0].tolist()) for k in range(s.n_rows)}
    assert len(firsts) == s.n_rows or s.n_rows < 2


def test_split_left_truncation_and_error(tmp_path: Path) -> None:
    ds = MaskedDataset(write_masked(tmp_path / "c", [4, 30, 5, 6]))
    s = SFTSamples(ds, 8, 0, documents=range(1, 3), truncate_side="left")
    assert sorted(s.row_docs.tolist()) == [1, 2]
    tokens = s.row(0)[0]
    assert tokens[:8].tolist() == ds.document(1)[0][-8:].tolist()
    with pytest.raises(DataError, match="document 1 has 30 tokens, longer than --seq-len 8"):
        SFTSamples(ds, 8, 0, truncate_side="error")


def test_packing_is_deterministic(tmp_path: Path) -> None:
    ds = MaskedDataset(write_masked(tmp_path / "c", list(range(1, 40))))
    a, b = SFTSamples(ds, 32, 5), SFTSamples(ds, 32, 5)
    assert a.row_docs.tolist() == b.row_docs.tolist()
    for k in range(3 * a.n_rows):
        for x, y in zip(a[k], b[k], strict=True):
            assert np.array_equal(x, y)
    other = SFTSamples(ds, 32, 6)
    assert other.row_docs.tolist() == a.row_docs.tolist()  # the seed orders rows only
