"""Megatron-LM's indexed dataset: a token file (``PREFIX.bin``) and its index (``PREFIX.idx``).

Written from the format, so that datasets made by Megatron-LM's ``preprocess_data.py`` train
here and ours train there, byte for byte. The index, all little-endian:

    magic       9 bytes   b"MMIDIDX\\x00\\x00"
    version     <Q        1
    dtype code  <B        1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16
    n_seq       <Q        number of sequences
    n_doc       <Q        number of document indices (= documents + 1)
    lengths     int32[n_seq]   tokens per sequence
    pointers    int64[n_seq]   byte offset of each sequence in the .bin
    doc_index   int64[n_doc]   0, then the number of sequences after each document

(Megatron's multimodal variant appends one int8 mode per sequence; we read past it and never
write it.) The ``.bin`` holds the tokens of every sequence back to back in that dtype.

Both files are memory-mapped and every accessor returns a read-only view, so opening a
dataset of any size costs only its index pages, and DataLoader workers share the page cache.
Validation runs once at open, so a truncated download or a half-written file fails with one
line naming the file, not with a numpy error deep inside a training step.
"""

from __future__ import annotations

import os
import struct
import tempfile
from array import array
from types import TracebackType
from typing import Any

import numpy as np

from composer.settings import DataError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, n_seq, n_doc: 34 bytes
DTYPES: dict[int, type[np.number]] = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32,
                                      5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16}
CODES: dict[type[np.number], int] = {t: c for c, t in DTYPES.items()}


def optimal_dtype(vocab_size: int) -> type[np.number]:
    """The token dtype Megatron picks for a vocabulary: uint16 below 65500, else int32."""
    return np.uint16 if vocab_size < 65500 else np.int32


def _mmap(path: str, size: int) -> np.ndarray:
    # numpy cannot map an empty file; an empty buffer reads the same
    return np.memmap(path, dtype=np.uint8, mode="r") if size else np.zeros(0, np.uint8)


def _read_header(idx: str) -> tuple[type[np.number], int, int, int]:
    """Validate the index header and size: (dtype, n_seq, n_doc, file size)."""
    size = os.path.getsize(idx)
    if size == 0:
        raise DataError(f"{idx}: empty file")
    with open(idx, "rb") as f:
        head = f.read(_HEADER.size)
    if head[:9] != MAGIC:
        raise DataError(f"{idx}: not a Megatron indexed dataset index "
                        f"(magic {head[:9]!r}, expected {MAGIC!r})")
    if len(head) < _HEADER.size:
        raise DataError(f"{idx}: truncated index: {size} bytes, the header alone is "
                        f"{_HEADER.size}")
    _, version, code, n_seq, n_doc = _HEADER.unpack(head)
    if version != VERSION:
        raise DataError(f"{idx}: unsupported index version {version} (only {VERSION} is known)")
    if code not in DTYPES:
        raise DataError(f"{idx}: unknown dtype code {code} (known codes are 1-8)")
    need = _HEADER.size + 12 * n_seq + 8 * n_doc
    if size < need:
        raise DataError(f"{idx}: truncated index: {size} bytes, but {n_seq} sequences and "
                        f"{n_doc} document indices need {need}")
    return DTYPES[code], n_seq, n_doc, size


def _check_documents(idx: str, doc_index: np.ndarray, n_seq: int) -> None:
    if len(doc_index) == 0 or doc_index[0] != 0:
        first = int(doc_index[0]) if len(doc_index) else "nothing"
        raise DataError(f"{idx}: document indices start at {first}, expected 0")
    steps = np.diff(doc_index)
    if len(steps) and steps.min() < 0:
        k = int(np.argmax(steps < 0)) + 1
        raise DataError(f"{idx}: document indices decrease at entry {k} "
                        f"({int(doc_index[k])} after {int(doc_index[k - 1])})")
    if doc_index[-1] != n_seq:
        raise DataError(f"{idx}: document indices end at {int(doc_index[-1])}, expected the "
                        f"sequence count {n_seq}")


class IndexedDataset:
    """A read-only, memory-mapped ``PREFIX.bin`` + ``PREFIX.idx`` pair (see the module doc)."""

    def __init__(self, prefix: str | os.PathLike[str]) -> None:
        self.prefix = str(prefix)
        idx, bin_ = f"{self.prefix}.idx", f"{self.prefix}.bin"
        for path in (idx, bin_):
            if not os.path.isfile(path):
                raise DataError(f"{path}: no such file (an indexed dataset is PREFIX.idx and "
                                f"PREFIX.bin)")
        dtype, n_seq, n_doc, idx_size = _read_header(idx)
        self._idx = _mmap(idx, idx_size)
        offset = _HEADER.size
        self._lengths = np.frombuffer(self._idx, np.int32, n_seq, offset)
        self._pointers = np.frombuffer(self._idx, np.int64, n_seq, offset + 4 * n_seq)
        self._doc_index = np.frombuffer(self._idx, np.int64, n_doc, offset + 12 * n_seq)
        _check_documents(idx, self._doc_index, n_seq)
        self._dtype = np.dtype(dtype)
        item = self._dtype.itemsize
        need = int(self._pointers[-1]) + int(self._lengths[-1]) * item if n_seq else 0
        bin_size = os.path.getsize(bin_)
        if bin_size < need:
            if bin_size == 0:
                raise DataError(f"{bin_}: empty file, but the index describes {need} bytes")
            raise DataError(f"{bin_}: truncated data: {bin_size} bytes, but the index needs {need}")
        self._bin = _mmap(bin_, bin_size)
        self._stream = np.frombuffer(self._bin, self._dtype, need // item)
        self._n_tokens = int(self._lengths.sum(dtype=np.int64))

    # Pickling a memmap would copy the whole file into the pickle: reopen by path instead.
    def __getstate__(self) -> dict[str, Any]:
        return {"prefix": self.prefix}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["prefix"])  # type: ignore[misc]

    def __repr__(self) -> str:
        return (f"IndexedDataset({self.prefix!r}: {self.n_documents} documents, "
                f"{self.n_sequences} sequences, {self.n_tokens} tokens, {self._dtype.name})")

    def __len__(self) -> int:
        return self.n_sequences

    @property
    def dtype(self) -> np.dtype:
        return self._dtype

    @property
    def sequence_lengths(self) -> np.ndarray:
        """int32, tokens per sequence."""
        return self._lengths

    @property
    def sequence_pointers(self) -> np.ndarray:
        """int64, byte offset of each sequence in the .bin."""
        return self._pointers

    @property
    def document_indices(self) -> np.ndarray:
        """int64, ``n_documents + 1`` entries: document d is sequences [di[d], di[d + 1])."""
        return self._doc_index

    @property
    def n_sequences(self) -> int:
        return len(self._lengths)

    @property
    def n_documents(self) -> int:
        return len(self._doc_index) - 1

    @property
    def n_tokens(self) -> int:
        return self._n_tokens

    def sequence(self, i: int) -> np.ndarray:
        """The tokens of sequence ``i`` (a view)."""
        if not 0 <= i < self.n_sequences:
            raise IndexError(f"sequence {i} out of range [0, {self.n_sequences})")
        length = int(self._lengths[i])
        if length == 0:
            return self._stream[:0]
        return np.frombuffer(self._bin, self._dtype, length, int(self._pointers[i]))

    def tokens(self, start: int, end: int) -> np.ndarray:
        """Tokens ``[start, end)`` of the stream of all sequences back to back (a view)."""
        if not 0 <= start <= end <= len(self._stream):
            raise IndexError(f"tokens [{start}, {end}) out of range [0, {len(self._stream)}]")
        return self._stream[start:end]

    def document(self, d: int) -> np.ndarray:
        """The tokens of document ``d``, its sequences concatenated (a view when contiguous)."""
        if not 0 <= d < self.n_documents:
            raise IndexError(f"document {d} out of range [0, {self.n_documents})")
        s0, s1 = int(self._doc_index[d]), int(self._doc_index[d + 1])
        if s0 == s1:
            return self._stream[:0]
        item = self._dtype.itemsize
        lo = int(self._pointers[s0])
        hi = int(self._pointers[s1 - 1]) + int(self._lengths[s1 - 1]) * item
        if lo % item == 0 and hi - lo == int(self._lengths[s0:s1].sum(dtype=np.int64)) * item:
            return self._stream[lo // item:hi // item]
        return np.concatenate([self.sequence(s) for s in range(s0, s1)])


class IndexedWriter:
    """Writes ``PREFIX.bin`` + ``PREFIX.idx``; nothing appears under those names until
    :meth:`finalize`, so a reader never sees a half-written dataset and a failed run leaves no
    files (the data goes to hidden temporaries in the same folder, renamed at the end).

    As a context manager it finalizes on a clean exit and deletes the temporaries on an error.
    """

    def __init__(self, prefix: str | os.PathLike[str], dtype: type[np.number] | np.dtype) -> None:
        self.prefix = str(prefix)
        self.dtype = np.dtype(dtype)
        if self.dtype.type not in CODES:
            names = ", ".join(np.dtype(t).name for t in CODES)
            raise DataError(f"dtype {self.dtype.name} has no code in the indexed format "
                            f"(one of {names})")
        folder, name = os.path.split(os.path.abspath(self.prefix))
        if not os.path.isdir(folder):
            raise DataError(f"{folder}: no such folder")
        self._tmp: dict[str, str] = {}
        for ext in ("bin", "idx"):
            fd, self._tmp[ext] = tempfile.mkstemp(dir=folder, prefix=f".{name}.",
                                                  suffix=f".{ext}.tmp")
            os.close(fd)
        self._bin = open(self._tmp["bin"], "wb")  # closed in finalize or abort
        self._lengths = array("i")  # int32 per sequence: 4 bytes, not a Python int's 28
        self._doc_index = array("q", [0])
        self._open = True

    def __enter__(self) -> IndexedWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is not None:
            self.abort()
        elif self._open:
            self.finalize()

    @property
    def n_documents(self) -> int:
        return len(self._doc_index) - 1

    def add_document(self, tokens: np.ndarray, lengths: list[int] | None = None) -> None:
        """Append one document: ``tokens`` (1-D), split into sequences of ``lengths`` tokens
        (default: one sequence)."""
        if not self._open:
            raise DataError(f"{self.prefix}: the writer is already finalized or aborted")
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            raise DataError(f"a document is a 1-D token array, got shape {arr.shape}")
        lengths = [arr.size] if lengths is None else [int(n) for n in lengths]
        if any(n < 0 for n in lengths) or sum(lengths) != arr.size:
            raise DataError(f"sequence lengths {lengths} do not split a document of "
                            f"{arr.size} tokens")
        if any(n > np.iinfo(np.int32).max for n in lengths):
            raise DataError(f"a sequence of {max(lengths)} tokens does not fit the index's int32")
        self._bin.write(self._cast(arr).tobytes())
        self._lengths.extend(lengths)
        self._doc_index.append(len(self._lengths))

    def _cast(self, arr: np.ndarray) -> np.ndarray:
        # A silent wrap-around (70000 -> 4464 in uint16) would corrupt the data unnoticed.
        if arr.dtype == self.dtype or arr.size == 0 or self.dtype.kind == "f":
            return arr.astype(self.dtype, copy=False)
        if arr.dtype.kind not in "iub":
            raise DataError(f"tokens of dtype {arr.dtype.name} cannot be stored as "
                            f"{self.dtype.name}")
        info = np.iinfo(self.dtype)
        lo, hi = int(arr.min()), int(arr.max())
        if lo < info.min or hi > info.max:
            bad = lo if lo < info.min else hi
            raise DataError(f"token id {bad} does not fit in {self.dtype.name}")
        return arr.astype(self.dtype)

    def finalize(self) -> None:
        """Write the index and move both files into place."""
        if not self._open:
            raise DataError(f"{self.prefix}: the writer is already finalized or aborted")
        try:
            self._bin.close()
            self._write_index(self._tmp["idx"])
            umask = os.umask(0)
            os.umask(umask)
            for tmp in self._tmp.values():  # mkstemp makes them 0600: as a plain open would
                os.chmod(tmp, 0o666 & ~umask)
            os.replace(self._tmp["bin"], f"{self.prefix}.bin")
            try:
                os.replace(self._tmp["idx"], f"{self.prefix}.idx")
            except BaseException:
                os.unlink(f"{self.prefix}.bin")  # never a .bin without its .idx
                raise
        except BaseException:
            self.abort()
            raise
        self._open = False

    def _write_index(self, path: str) -> None:
        lengths = np.frombuffer(self._lengths, dtype=np.int32) if self._lengths else \
            np.zeros(0, np.int32)
        pointers = np.zeros(len(lengths), np.int64)
        np.cumsum(lengths[:-1], dtype=np.int64, out=pointers[1:])
        pointers *= self.dtype.itemsize
        with open(path, "wb") as f:
            f.write(_HEADER.pack(MAGIC, VERSION, CODES[self.dtype.type], len(lengths),
                                 len(self._doc_index)))
            lengths.tofile(f)
            pointers.tofile(f)
            np.frombuffer(self._doc_index, dtype=np.int64).tofile(f)

    def abort(self) -> None:
        """Close and delete the temporaries; nothing is written under PREFIX."""
        self._bin.close()
        for path in self._tmp.values():
            if os.path.exists(path):
                os.unlink(path)
        self._open = False
