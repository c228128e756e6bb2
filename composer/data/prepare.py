"""Text files to an indexed dataset: ``prepare`` (what ``composer data prepare`` runs) and
``inspect``.

Inputs are ``.jsonl`` / ``.jsonl.gz`` (one document per line, its text under ``json_key``),
``.txt`` (one document per file) and ``.parquet`` (one document per row of column
``json_key``; needs pyarrow). Each document becomes one sequence, plus the end-of-document
token when ``append_eod`` is set (Megatron's ``--append-eod``; without it, documents run into
each other once packed into samples).

Tokenising is the slow part, so it runs in a pool of ``workers`` processes, while this process
reads the files and writes the output in input order: the same inputs give byte-identical
files whatever the number of workers. The pool spawns (forking a process that holds a
tokenizer's threads or a CUDA context can deadlock), so a script calling ``prepare`` with
``workers > 1`` needs the usual ``if __name__ == "__main__":`` guard. It is a
``ProcessPoolExecutor`` rather than a ``multiprocessing.Pool``: when a worker dies (killed for
memory, say) the executor raises ``BrokenProcessPool``, where a Pool waits forever for the
lost task.

Inputs whose documents are all empty (no tokens at all) are refused. The output is published
whole or not at all: ``PREFIX.bin``/``.idx`` and ``PREFIX.tokenizer/``
are written under hidden temporary names and renamed at the end; on any error they are deleted.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import multiprocessing
import os
import shutil
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from itertools import chain, islice
from pathlib import Path
from typing import Any

import numpy as np

from composer.data.indexed import DataError, IndexedDataset, IndexedWriter, optimal_dtype
from composer.data.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    describe_tokenizer,
    load_tokenizer,
    no_eod_message,
    save_tokenizer,
)

EXTENSIONS = (".jsonl.gz", ".jsonl", ".txt", ".parquet")
CHUNKSIZE = 256  # documents per task sent to a worker: amortises the pickling round trip
PROGRESS_EVERY = 1 << 20  # bytes of text between progress calls

# (where, payload): where names the document in errors ("file:line"); the payload is a raw
# JSON line (bytes: parsed in the worker, where the time goes) or the text itself (str).
Item = tuple[str, bytes | str]


def _kind(path: str) -> str:
    name = path.lower()
    for ext in EXTENSIONS:
        if name.endswith(ext):
            return ext
    raise DataError(f"input {path}: unknown extension (expected {', '.join(EXTENSIONS)})")


def _check_inputs(inputs: list[str]) -> list[tuple[str, str]]:
    """Fail before any work on a missing, empty or unreadable input: (path, extension)."""
    if not inputs:
        raise DataError("no input files")
    sources = []
    for path in map(str, inputs):
        if not os.path.exists(path):
            raise DataError(f"input {path}: no such file")
        if not os.path.isfile(path):
            raise DataError(f"input {path}: not a file")
        kind = _kind(path)
        if os.path.getsize(path) == 0:
            raise DataError(f"input {path}: empty file")
        if kind == ".parquet":
            try:
                import pyarrow.parquet  # noqa: F401
            except ImportError:
                raise DataError(f"input {path}: reading .parquet needs pyarrow "
                                f"(pip install pyarrow)") from None
        sources.append((path, kind))
    return sources


def _jsonl_items(path: str, gz: bool) -> Iterator[Item]:
    found = False
    try:
        with (gzip.open(path, "rb") if gz else open(path, "rb")) as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    found = True
                    yield f"{path}:{n}", line
    except (OSError, EOFError) as e:
        raise DataError(f"input {path}: cannot read ({type(e).__name__}: {e})") from None
    if not found:
        raise DataError(f"input {path}: no documents (only blank lines)")


def _txt_items(path: str) -> Iterator[Item]:
    data = Path(path).read_bytes()
    try:
        yield path, data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"input {path}: not UTF-8 text (byte {e.start})") from None


def _parquet_items(path: str, key: str) -> Iterator[Item]:
    import pyarrow.parquet as pq

    file = pq.ParquetFile(path)
    if key not in file.schema_arrow.names:
        raise DataError(f"input {path}: no column {key!r} (columns: "
                        f"{', '.join(file.schema_arrow.names)})")
    row = 0
    for batch in file.iter_batches(columns=[key]):
        for value in batch.column(0).to_pylist():
            row += 1
            if not isinstance(value, str):
                raise DataError(f"input {path}: row {row}: {key!r} is "
                                f"{type(value).__name__}, not text")
            yield f"{path}:row {row}", value
    if row == 0:
        raise DataError(f"input {path}: no documents (no rows)")


def _items(sources: list[tuple[str, str]], key: str) -> Iterator[Item]:
    for path, kind in sources:
        if kind in (".jsonl", ".jsonl.gz"):
            yield from _jsonl_items(path, gz=kind == ".jsonl.gz")
        elif kind == ".txt":
            yield from _txt_items(path)
        else:
            yield from _parquet_items(path, key)


def _text(where: str, line: bytes, key: str) -> str:
    try:
        record = json.loads(line)
    except ValueError as e:
        raise DataError(f"{where}: invalid JSON ({e})") from None
    if not isinstance(record, dict) or key not in record:
        raise DataError(f"{where}: no key {key!r}")
    text = record[key]
    if not isinstance(text, str):
        raise DataError(f"{where}: {key!r} is {type(text).__name__}, not a string")
    return text


Encoded = tuple[np.ndarray, np.ndarray, int]  # a chunk's tokens, its documents' lengths, bytes


class _Encoder:
    """A chunk of documents to their tokens, back to back in the output dtype, and their
    lengths: one array each per chunk, because pickling an array per document costs more
    than the byte tokenizer's whole work. Runs in the workers."""

    def __init__(self, tok: ByteTokenizer | HFTokenizer, key: str, append_eod: bool,
                 dtype: str) -> None:
        self.tok, self.key, self.append_eod, self.dtype = tok, key, append_eod, np.dtype(dtype)

    def __call__(self, chunk: list[Item]) -> Encoded:
        docs, n_bytes = [], 0
        for where, payload in chunk:
            text = _text(where, payload, self.key) if isinstance(payload, bytes) else payload
            ids = self.tok.encode(text)
            if self.append_eod:
                ids.append(self.tok.eod)
            docs.append(ids)
            n_bytes += len(text.encode("utf-8"))
        lengths = np.array([len(ids) for ids in docs], dtype=np.int64)
        tokens = np.fromiter(chain.from_iterable(docs), dtype=self.dtype, count=int(lengths.sum()))
        return tokens, lengths, n_bytes


_WORKER: _Encoder | BaseException | None = None


def _init_worker(spec: str, key: str, append_eod: bool, dtype: str) -> None:
    # An initializer that raises breaks the pool with a message that names nothing: keep the
    # error and raise it from the task instead.
    global _WORKER
    try:
        _WORKER = _Encoder(load_tokenizer(spec), key, append_eod, dtype)
    except BaseException as e:
        _WORKER = e


def _encode_in_worker(chunk: list[Item]) -> Encoded:
    if not isinstance(_WORKER, _Encoder):
        raise _WORKER if _WORKER is not None else RuntimeError("worker not initialised")
    return _WORKER(chunk)


def _encoded(items: Iterator[Item], encoder: Callable[[list[Item]], Any],
             pool: ProcessPoolExecutor | None, workers: int,
             task: Callable[[list[Item]], Any] = _encode_in_worker) -> Iterator[Any]:
    """The encoded chunks in input order (``encoder`` here, ``task`` in the pool's workers;
    chat preparation passes its own). ``map`` submits its whole input at once, so it is fed one
    window of chunks at a time, the next queued while the previous is drained."""
    chunks = iter(lambda: list(islice(items, CHUNKSIZE)), [])
    if pool is None:
        yield from map(encoder, chunks)
        return
    pending: deque[Iterable[Any]] = deque()
    while window := list(islice(chunks, 4 * workers)):
        pending.append(pool.map(task, window))
        if len(pending) > 1:
            yield from pending.popleft()
    while pending:
        yield from pending.popleft()


@contextlib.contextmanager
def _pool(tok: ByteTokenizer | HFTokenizer, key: str, append_eod: bool, dtype: str,
          workers: int) -> Iterator[ProcessPoolExecutor | None]:
    if workers == 1:  # no pool: the same encoder, in this process, the same bytes out
        yield None
        return
    spec = "byte" if isinstance(tok, ByteTokenizer) else str(tok.folder)
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_init_worker,
                               initargs=(spec, key, append_eod, dtype))
    try:
        yield pool
    finally:  # on an error, drop the queued chunks rather than tokenise them for nothing
        pool.shutdown(wait=True, cancel_futures=True)


def _write(writer: IndexedWriter, chunks: Iterator[Encoded],
           progress: Callable[[int], Any] | None) -> tuple[int, int]:
    """Add every document: (tokens, bytes of text)."""
    n_tokens = n_bytes = pending = 0
    for tokens, lengths, size in chunks:
        ends = np.cumsum(lengths)
        for lo, hi in zip((ends - lengths).tolist(), ends.tolist(), strict=True):
            writer.add_document(tokens[lo:hi])
        n_tokens += len(tokens)
        n_bytes += size
        pending += size
        if progress is not None and pending >= PROGRESS_EVERY:
            progress(pending)
            pending = 0
    if progress is not None and pending:
        progress(pending)
    return n_tokens, n_bytes


def _remove(*paths: str | Path) -> None:
    for path in map(Path, paths):
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        elif path.exists():
            path.unlink()


def prepare(inputs: list[str], out_prefix: str, tokenizer: str, json_key: str = "text",
            append_eod: bool = False, workers: int = 1,
            progress: Callable[[int], Any] | None = None, force: bool = False) -> dict[str, Any]:
    """Tokenise ``inputs`` into ``out_prefix.bin``/``.idx`` plus ``out_prefix.tokenizer/``.

    ``progress``, if given, is called with the bytes of text processed since its last call.
    Returns the counts and throughput (see the module docstring for the rules).
    """
    start = time.perf_counter()
    if workers < 1:
        raise DataError(f"workers must be >= 1, got {workers}")
    sources = _check_inputs(inputs)
    outputs = {ext: Path(f"{out_prefix}.{ext}") for ext in ("bin", "idx", "tokenizer")}
    existing = [p for p in outputs.values() if p.exists()]
    if existing and not force:
        raise DataError(f"{existing[0]} already exists (--force replaces it)")
    tok = load_tokenizer(tokenizer)
    if append_eod and tok.eod is None:
        raise DataError(f"--append-eod: {no_eod_message(tok.name)}")
    dtype = np.dtype(optimal_dtype(tok.vocab_size)).name
    folder = Path(os.path.abspath(out_prefix)).parent
    created = not folder.exists()
    folder.mkdir(parents=True, exist_ok=True)
    tmp_tok, published = None, False
    try:
        tmp_tok = tempfile.mkdtemp(dir=folder, prefix=f".{outputs['tokenizer'].name}.",
                                   suffix=".tmp")
        save_tokenizer(tok, tmp_tok)
        encoder = _Encoder(tok, json_key, append_eod, dtype)
        with IndexedWriter(out_prefix, dtype) as writer, \
                _pool(tok, json_key, append_eod, dtype, workers) as pool:
            chunks = _encoded(_items(sources, json_key), encoder, pool, workers)
            n_tokens, n_bytes = _write(writer, chunks, progress)
            n_documents = writer.n_documents
            if n_tokens == 0:  # a dataset no sample can be cut from: say so, write nothing
                raise DataError(f"no tokens: the {n_documents:,} documents of the inputs are "
                                "all empty (nothing written)")
        published = True
        _remove(outputs["tokenizer"])
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp_tok, 0o777 & ~umask)  # mkdtemp makes it 0700
        os.replace(tmp_tok, outputs["tokenizer"])
    except BaseException:
        _remove(*([tmp_tok] if tmp_tok else []),
                *([outputs["bin"], outputs["idx"]] if published else []))
        if created and not any(folder.iterdir()):
            folder.rmdir()
        raise
    seconds = time.perf_counter() - start
    return {"n_documents": n_documents, "n_sequences": n_documents, "n_tokens": n_tokens,
            "n_bytes": n_bytes, "seconds": seconds, "tokens_per_s": n_tokens / seconds,
            "mb_per_s": n_bytes / 1e6 / seconds, "dtype": dtype, "tokenizer": tok.name}


def inspect(prefix: str) -> dict[str, Any]:
    """Counts, dtype, tokenizer and size of the indexed dataset at ``prefix``."""
    ds = IndexedDataset(prefix)
    return {"n_documents": ds.n_documents, "n_sequences": ds.n_sequences,
            "n_tokens": ds.n_tokens, "dtype": ds.dtype.name,
            "tokenizer": describe_tokenizer(f"{prefix}.tokenizer"),
            "bin_bytes": os.path.getsize(f"{prefix}.bin")}
