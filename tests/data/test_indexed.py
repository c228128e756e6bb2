"""The indexed dataset against Megatron-LM's own writer and reader, and every corruption."""

import os
import pickle
import struct
import warnings

import numpy as np
import pytest

from composer.data.indexed import DataError, IndexedDataset, IndexedWriter, optimal_dtype

with warnings.catch_warnings():  # megatron warns at import that apex/TE are absent
    warnings.simplefilter("ignore")
    mcore = pytest.importorskip("megatron.core.datasets.indexed_dataset")

# documents as lists of sequences; one empty sequence, ids past uint16 only for int32
DOCS = [[[5, 6, 7], [], [8, 9]], [[1]], [[2, 3, 4, 5], [6, 7]], [[65499, 0, 3]]]
BIG = [[[70000, 1], [2**31 - 1]], [[0]]]
N_SEQ = sum(len(d) for d in DOCS)  # 7
N_TOK = sum(len(s) for d in DOCS for s in d)  # 15


def _flat(doc):
    return [t for seq in doc for t in seq]


def _megatron_write(prefix, docs, dtype):
    builder = mcore.IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for doc in docs:
        builder.add_document(np.array(_flat(doc), np.int64), [len(s) for s in doc])
    builder.finalize(f"{prefix}.idx")


def _ours_write(prefix, docs, dtype):
    with IndexedWriter(prefix, dtype) as writer:
        for doc in docs:
            writer.add_document(np.array(_flat(doc), dtype=np.int64), [len(s) for s in doc])


@pytest.mark.parametrize("dtype,docs", [(np.uint16, DOCS), (np.int32, DOCS + BIG)])
def test_reads_megatron(tmp_path, dtype, docs):
    prefix = tmp_path / "m"
    _megatron_write(prefix, docs, dtype)
    ds = IndexedDataset(prefix)
    seqs = [s for d in docs for s in d]
    assert (ds.dtype, ds.n_documents, ds.n_sequences, len(ds)) == (np.dtype(dtype), len(docs),
                                                                    len(seqs), len(seqs))
    assert ds.n_tokens == sum(map(len, seqs))
    assert [ds.sequence(i).tolist() for i in range(len(seqs))] == seqs
    assert [ds.document(d).tolist() for d in range(len(docs))] == [_flat(d) for d in docs]
    assert ds.tokens(0, ds.n_tokens).tolist() == [t for s in seqs for t in s]
    assert ds.document_indices.tolist() == [0, 3, 4, 6, 7, 9, 10][:len(docs) + 1]
    assert ds.sequence_lengths.tolist() == [len(s) for s in seqs]
    item = np.dtype(dtype).itemsize  # pointers are in bytes
    assert ds.sequence_pointers.tolist() == [0, 3 * item, 3 * item, 5 * item, 6 * item,
                                             10 * item, 12 * item, 15 * item, 17 * item,
                                             18 * item][:len(seqs)]


@pytest.mark.parametrize("dtype,docs", [(np.uint16, DOCS), (np.int32, DOCS + BIG)])
def test_megatron_reads_ours(tmp_path, dtype, docs):
    _ours_write(tmp_path / "o", docs, dtype)
    m = mcore.IndexedDataset(str(tmp_path / "o"))
    seqs = [s for d in docs for s in d]
    assert len(m) == len(seqs)
    assert [m[i].tolist() for i in range(len(m))] == seqs
    assert m.document_indices.tolist() == [0, *np.cumsum([len(d) for d in docs]).tolist()]
    assert m.sequence_lengths.tolist() == [len(s) for s in seqs]
    # and the files are Megatron's, byte for byte
    _megatron_write(tmp_path / "m", docs, dtype)
    for ext in ("bin", "idx"):
        assert (tmp_path / f"o.{ext}").read_bytes() == (tmp_path / f"m.{ext}").read_bytes()


def test_views_and_pickle(tmp_path):
    _ours_write(tmp_path / "o", DOCS, np.uint16)
    ds = IndexedDataset(tmp_path / "o")
    doc = ds.document(2)
    assert not doc.flags.writeable and np.shares_memory(doc, ds.tokens(0, N_TOK))
    blob = pickle.dumps(ds)
    assert len(blob) < 200  # the path, not the memory map
    assert pickle.loads(blob).document(2).tolist() == [2, 3, 4, 5, 6, 7]
    with pytest.raises(IndexError, match=r"^document 4 out of range \[0, 4\)$"):
        ds.document(4)
    with pytest.raises(IndexError, match=r"^tokens \[10, 16\) out of range \[0, 15\]$"):
        ds.tokens(10, 16)


def test_optimal_dtype():
    assert (optimal_dtype(257), optimal_dtype(65499), optimal_dtype(65500),
            optimal_dtype(151_936)) == (np.uint16, np.uint16, np.int32, np.int32)


def test_writer_publishes_only_on_success(tmp_path):
    with pytest.raises(RuntimeError, match="boom"), IndexedWriter(tmp_path / "w", np.int32) as w:
        w.add_document(np.arange(10))
        assert sorted(os.listdir(tmp_path))[0].startswith(".w.")  # hidden temporaries only
        raise RuntimeError("boom")
    assert os.listdir(tmp_path) == []
    w = IndexedWriter(tmp_path / "w", np.uint16)
    w.add_document(np.arange(3))
    assert not (tmp_path / "w.bin").exists()
    w.finalize()
    assert sorted(os.listdir(tmp_path)) == ["w.bin", "w.idx"]
    assert IndexedDataset(tmp_path / "w").n_tokens == 3


def test_writer_errors(tmp_path):
    with IndexedWriter(tmp_path / "w", np.uint16) as w:
        with pytest.raises(DataError, match="^token id 70000 does not fit in uint16$"):
            w.add_document(np.array([1, 70000]))
        with pytest.raises(DataError, match="^token id -1 does not fit in uint16$"):
            w.add_document(np.array([-1, 2]))
        with pytest.raises(DataError, match=r"^sequence lengths \[2, 2\] do not split a document "
                                            r"of 3 tokens$"):
            w.add_document(np.arange(3), [2, 2])
    assert IndexedDataset(tmp_path / "w").n_documents == 0  # rejected documents left no trace
    with pytest.raises(DataError, match="^dtype uint32 has no code in the indexed format "):
        IndexedWriter(tmp_path / "x", np.uint32)
    with pytest.raises(DataError, match=f"^{tmp_path / 'nope'}: no such folder$"):
        IndexedWriter(tmp_path / "nope" / "x", np.uint16)


def _corrupt(prefix, ext, fn):
    path = f"{prefix}.{ext}"
    with open(path, "rb") as f:
        data = bytearray(f.read())
    with open(path, "wb") as f:
        f.write(fn(data))


IDX_DOCS = 34 + 12 * N_SEQ  # byte offset of the document indices
CORRUPTIONS = {
    "bad magic": ("idx", lambda b: b"MMIDXXX\x00\x00" + b[9:],
                  "{idx}: not a Megatron indexed dataset index (magic b'MMIDXXX\\x00\\x00', "
                  "expected b'MMIDIDX\\x00\\x00')"),
    "version 2": ("idx", lambda b: b[:9] + struct.pack("<Q", 2) + b[17:],
                  "{idx}: unsupported index version 2 (only 1 is known)"),
    "dtype code": ("idx", lambda b: b[:17] + bytes([9]) + b[18:],
                   "{idx}: unknown dtype code 9 (known codes are 1-8)"),
    "short header": ("idx", lambda b: b[:20],
                     "{idx}: truncated index: 20 bytes, the header alone is 34"),
    "truncated idx": ("idx", lambda b: b[:-8],
                      f"{{idx}}: truncated index: {IDX_DOCS + 32} bytes, but {N_SEQ} sequences "
                      f"and 5 document indices need {IDX_DOCS + 40}"),
    "truncated bin": ("bin", lambda b: b[:-2], f"{{bin}}: truncated data: {2 * N_TOK - 2} bytes, "
                                               f"but the index needs {2 * N_TOK}"),
    "empty idx": ("idx", lambda b: b"", "{idx}: empty file"),
    "empty bin": ("bin", lambda b: b"",
                  f"{{bin}}: empty file, but the index describes {2 * N_TOK} bytes"),
    "docs start": ("idx", lambda b: b[:IDX_DOCS] + struct.pack("<q", 1) + b[IDX_DOCS + 8:],
                   "{idx}: document indices start at 1, expected 0"),
    "docs decrease": ("idx", lambda b: b[:IDX_DOCS + 16] + struct.pack("<q", 2)
                      + b[IDX_DOCS + 24:],
                      "{idx}: document indices decrease at entry 2 (2 after 3)"),
    "docs end": ("idx", lambda b: b[:-8] + struct.pack("<q", 6),
                 f"{{idx}}: document indices end at 6, expected the sequence count {N_SEQ}"),
}


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_corruption(tmp_path, case):
    prefix = tmp_path / "c"
    _ours_write(prefix, DOCS, np.uint16)
    ext, fn, message = CORRUPTIONS[case]
    _corrupt(prefix, ext, fn)
    expected = message.format(idx=f"{prefix}.idx", bin=f"{prefix}.bin")
    with pytest.raises(DataError) as info:
        IndexedDataset(prefix)
    assert str(info.value) == expected


@pytest.mark.parametrize("ext", ["idx", "bin"])
def test_missing_file(tmp_path, ext):
    _ours_write(tmp_path / "c", DOCS, np.uint16)
    os.unlink(tmp_path / f"c.{ext}")
    with pytest.raises(DataError) as info:
        IndexedDataset(tmp_path / "c")
    assert str(info.value) == (f"{tmp_path}/c.{ext}: no such file (an indexed dataset is "
                               f"PREFIX.idx and PREFIX.bin)")
