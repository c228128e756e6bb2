"""Chat files to a masked dataset (``composer data prepare --format chat``; ``--format
preference``: pairs of conversations, :mod:`composer.data.preference`); reading one back
(``composer data inspect``) is :mod:`composer.data.masked`'s.

Inputs are ``.jsonl`` / ``.jsonl.gz`` (one row per line, :mod:`composer.data.chat` says which
rows) and ``.parquet`` (one row per table row, its columns the row's keys; needs pyarrow). The
output is :mod:`composer.data.masked`'s format: ``PREFIX.bin/.idx`` (tokens),
``PREFIX.mask.bin/.idx`` (the mask), ``PREFIX.tokenizer/`` (with ``chat_template.jinja`` when
``--chat-template`` overrode the tokenizer's) and ``PREFIX.chat.json`` (what made it and the
counts). Rows with ``"images"`` (:mod:`composer.data.chat_images`) add the resized pixels
(``PREFIX.pixels.bin/.idx``, ``PREFIX.images.npy``), resized by the tokenizer folder's
``preprocessor_config.json`` (else Qwen3.5's settings) within ``min_pixels``/``max_pixels``
when given; relative image paths resolve against ``image_root``, else their input's folder.

Rendering and tokenising run in a pool of ``workers`` spawned processes, fed in windows of
chunks and drained in input order as :mod:`composer.data.prepare` does, so any number of
workers writes the same bytes. A bad row (invalid JSON, a missing or unknown role, a message
without content, a template that fails, no supervised token, too long under
``truncate="error"``, an image that cannot be read, image parts that do not match the images)
is a one-line :class:`DataError` naming ``file:line``, and nothing is
written; with ``skip_bad_rows`` it is counted and left out. ``seq_len`` cuts (``right``:
the first tokens, ``left``: the last) or refuses (``error``) a longer conversation.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import multiprocessing
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from composer.data.chat import MASK_MODES, TRUNCATE_SIDES, ChatEncoder, RowError, parse_row
from composer.data.chat_images import (
    Image,
    ImageRows,
    place_images,
    row_images,
    truncate_blocks,
)
from composer.data.indexed import DataError, optimal_dtype
from composer.data.masked import (
    IMAGE_FILES,
    MASK_SUFFIX,
    META_SUFFIX,
    MaskedWriter,
)
from composer.data.preference import KIND, encode_pair
from composer.data.prepare import _check_inputs, _encoded, _jsonl_items, _remove
from composer.data.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    load_tokenizer,
    save_tokenizer,
)

Item = tuple[str, str, Any]
"""(file:line, the folder relative image paths resolve against, the raw JSON line as bytes or a
parquet row's dict)."""
Doc = tuple[np.ndarray, np.ndarray, list[Image]]


@dataclass(frozen=True)
class Settings:
    """What every worker needs to encode rows the same way."""

    tokenizer: str
    template: str | None
    mode: str
    seq_len: int | None
    truncate: str
    kind: str = "chat"
    """``chat`` (a document per row) or ``preference`` (two per row: chosen, rejected)."""
    min_pixels: int | None = None
    max_pixels: int | None = None


@dataclass
class Chunk:
    """A chunk's kept documents back to back (tokens in the output dtype, mask uint8), their
    lengths, the bad rows as (file:line, reason), how many documents were truncated and how
    many rows were kept (a preference row is two documents), and each document's images."""

    tokens: np.ndarray
    masks: np.ndarray
    lengths: np.ndarray
    bad: list[tuple[str, str]]
    truncated: int
    rows: int
    images: list[list[Image]]


class _Encoder:
    """A chunk of rows to a :class:`Chunk`; runs in the workers (or here, for one worker)."""

    def __init__(self, settings: Settings, dtype: str, tok: HFTokenizer | None = None) -> None:
        self.settings, self.dtype = settings, np.dtype(dtype)
        tok = load_tokenizer(settings.tokenizer) if tok is None else tok
        mode = "completion" if settings.kind == KIND else settings.mode
        self.chat = ChatEncoder(tok, settings.template, mode)
        self.images = ImageRows(self.chat.tok, settings.min_pixels, settings.max_pixels)

    def row(self, payload: Any, root: str) -> tuple[list[Doc], int]:
        """A row's documents (ids, mask, images) and how many of them were truncated."""
        if isinstance(payload, bytes):
            try:
                payload = json.loads(payload)
            except ValueError as e:
                raise RowError(f"invalid JSON ({e})") from None
        s = self.settings
        if s.kind == KIND:
            chosen, rejected, cut = encode_pair(self.chat, payload, s.seq_len, s.truncate)
            return [(*chosen, []), (*rejected, [])], cut
        messages, start = parse_row(payload)
        paths = row_images(payload)
        messages = place_images(messages, len(paths))
        if paths:
            ids, mask, images, blocks = self.images.encode(self.chat, messages, start, paths,
                                                           root)
        else:
            (ids, mask), images, blocks = self.chat.encode(messages, start), [], []
        cut = 0
        if s.seq_len is not None and len(ids) > s.seq_len:
            ids, mask, kept = truncate_blocks(ids, mask, s.seq_len, s.truncate, blocks)
            images = [images[k] for k in kept]
            cut = 1
            if not mask.any():
                raise RowError(f"no supervised token in the {len(ids)} tokens --truncate "
                               f"{s.truncate} keeps")
        return [(ids, mask, images)], cut

    def __call__(self, chunk: list[Item]) -> Chunk:
        docs: list[Doc] = []
        bad, truncated, rows = [], 0, 0
        for where, root, payload in chunk:
            try:
                row_docs, cut = self.row(payload, root)
            except RowError as e:
                bad.append((where, str(e)))
                continue
            docs += row_docs
            truncated += cut
            rows += 1
        lengths = np.array([len(ids) for ids, _, _ in docs], dtype=np.int64)
        return Chunk(_cat([d[0] for d in docs], self.dtype),
                     _cat([d[1] for d in docs], np.dtype(np.uint8)), lengths, bad, truncated,
                     rows, [d[2] for d in docs])


def _cat(arrays: list[np.ndarray], dtype: np.dtype) -> np.ndarray:
    return np.concatenate(arrays).astype(dtype) if arrays else np.zeros(0, dtype)


_WORKER: _Encoder | BaseException | None = None


def _init_worker(settings: Settings, dtype: str) -> None:
    global _WORKER  # an initializer that raises breaks the pool anonymously: raise it later
    try:
        _WORKER = _Encoder(settings, dtype)
    except BaseException as e:
        _WORKER = e


def _encode_in_worker(chunk: list[Item]) -> Chunk:
    if not isinstance(_WORKER, _Encoder):
        raise _WORKER if _WORKER is not None else RuntimeError("worker not initialised")
    return _WORKER(chunk)


@contextlib.contextmanager
def _pool(settings: Settings, dtype: str, workers: int) -> Iterator[ProcessPoolExecutor | None]:
    if workers == 1:
        yield None
        return
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_init_worker, initargs=(settings, dtype))
    try:
        yield pool
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _parquet_rows(path: str) -> Iterator[tuple[str, Any]]:
    import pyarrow.parquet as pq

    row = 0
    for batch in pq.ParquetFile(path).iter_batches():
        for record in batch.to_pylist():
            row += 1
            yield f"{path}:row {row}", record
    if row == 0:
        raise DataError(f"input {path}: no rows")


def _items(sources: list[tuple[str, str]], what: str = "chat",
           image_root: str | None = None) -> Iterator[Item]:
    for path, kind in sources:
        root = image_root if image_root is not None else os.path.dirname(os.path.abspath(path))
        if kind in (".jsonl", ".jsonl.gz"):
            rows = _jsonl_items(path, gz=kind == ".jsonl.gz")
        elif kind == ".parquet":
            rows = _parquet_rows(path)
        else:
            raise DataError(f"input {path}: --format {what} reads .jsonl, .jsonl.gz and "
                            f".parquet rows, not {kind}")
        yield from ((where, root, payload) for where, payload in rows)


def _write(writer: MaskedWriter, chunks: Iterator[Chunk], skip_bad_rows: bool,
           progress: Callable[[int], Any] | None) -> dict[str, int]:
    counts = {"rows": 0, "skipped_rows": 0, "truncated": 0, "tokens": 0, "supervised": 0}
    for chunk in chunks:
        if chunk.bad and not skip_bad_rows:
            where, why = chunk.bad[0]
            raise DataError(f"{where}: {why} (--skip-bad-rows skips such rows; nothing "
                            "written)")
        ends = np.cumsum(chunk.lengths)
        for lo, hi, images in zip((ends - chunk.lengths).tolist(), ends.tolist(), chunk.images,
                                  strict=True):
            writer.add_document(chunk.tokens[lo:hi], chunk.masks[lo:hi], images)
        n = chunk.rows + len(chunk.bad)
        counts["rows"] += n
        counts["skipped_rows"] += len(chunk.bad)
        counts["truncated"] += chunk.truncated
        counts["tokens"] += len(chunk.tokens)
        counts["supervised"] += int(chunk.masks.sum(dtype=np.int64))
        if progress is not None:
            progress(n)
    return counts


def _outputs(prefix: str) -> list[Path]:
    """Every file a dataset has, the tokenizer folder last."""
    return [Path(f"{prefix}{ext}") for ext in (".bin", ".idx", f"{MASK_SUFFIX}.bin",
                                               f"{MASK_SUFFIX}.idx", *IMAGE_FILES, META_SUFFIX,
                                               ".tokenizer")]


def _check_options(kind: str, mask: str, truncate_side: str, seq_len: int | None,
                   workers: int) -> None:
    if kind not in ("chat", KIND):
        raise DataError(f"kind {kind!r}: expected chat or {KIND}")
    if kind == KIND and mask != "completion":
        raise DataError(f"--format {KIND} masks the completion (chosen, rejected), not "
                        f"--mask {mask}")
    if mask not in MASK_MODES:
        raise DataError(f"--mask {mask}: expected one of {', '.join(MASK_MODES)}")
    if truncate_side not in TRUNCATE_SIDES:
        raise DataError(f"--truncate {truncate_side}: expected one of "
                        f"{', '.join(TRUNCATE_SIDES)}")
    if seq_len is not None and seq_len < 1:
        raise DataError(f"--seq-len must be >= 1, got {seq_len}")
    if workers < 1:
        raise DataError(f"workers must be >= 1, got {workers}")


def _template(path: str | None) -> str | None:
    if path is None:
        return None
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"--chat-template {path}: cannot read ({type(e).__name__})") from None


def _meta(settings: Settings, counts: dict[str, int], documents: int) -> dict[str, Any]:
    """What ``PREFIX.chat.json`` records: how the data was made, and its counts."""
    pairs = {"kind": KIND, "pairs": documents // 2} if settings.kind == KIND else {}
    return {"format": settings.kind, **pairs, "mask": settings.mode, "documents": documents,
            "tokens": counts["tokens"], "supervised_tokens": counts["supervised"],
            "rows": counts["rows"], "skipped_rows": counts["skipped_rows"],
            "truncated": counts["truncated"], "seq_len": settings.seq_len,
            "truncate": settings.truncate if settings.seq_len is not None else None,
            "chat_template": "override" if settings.template is not None else "tokenizer"}


def _images_meta(rows: ImageRows, count: int) -> dict[str, Any]:
    """``meta["images"]`` (:mod:`composer.data.masked`), for a dataset with images."""
    if not count:
        return {}
    v = rows.vision
    return {"images": {"count": count, "settings": dataclasses.asdict(rows.settings),
                       "image_token_id": v.pad, "vision_start_token_id": v.start,
                       "vision_end_token_id": v.end}}


def _check_images(kind: str, tok: HFTokenizer, image_root: str | None,
                  min_pixels: int | None, max_pixels: int | None) -> None:
    """Refuse image options that cannot work before any row is read (the settings are built,
    Pillow imported, only when a flag is given)."""
    flags = [f for f, v in (("--image-root", image_root), ("--min-pixels", min_pixels),
                            ("--max-pixels", max_pixels)) if v is not None]
    if flags and kind != "chat":
        raise DataError(f"{flags[0]} is for --format chat (rows with images)")
    if image_root is not None and not Path(image_root).is_dir():
        raise DataError(f"--image-root {image_root}: no such folder")
    if min_pixels is not None or max_pixels is not None:
        ImageRows(tok, min_pixels, max_pixels).settings  # noqa: B018 (validates)


def _publish_tokenizer(tmp_tok: str, out_prefix: str) -> None:
    _remove(f"{out_prefix}.tokenizer")
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp_tok, 0o777 & ~umask)
    os.replace(tmp_tok, f"{out_prefix}.tokenizer")


def prepare_chat(inputs: list[str], out_prefix: str, tokenizer: str,
                 chat_template: str | None = None, mask: str = "assistant",
                 skip_bad_rows: bool = False, workers: int = 1, seq_len: int | None = None,
                 truncate_side: str = "right", progress: Callable[[int], Any] | None = None,
                 force: bool = False, kind: str = "chat", image_root: str | None = None,
                 min_pixels: int | None = None, max_pixels: int | None = None
                 ) -> dict[str, Any]:
    """Render, tokenise and mask the chat rows of ``inputs`` into ``out_prefix`` (see the
    module docstring); ``progress`` is called with the rows done since its last call.
    ``kind="preference"``: preference rows, two documents each, the completion masked
    (:mod:`composer.data.preference`; ``mask`` must be ``completion``). Returns the counts."""
    start = time.perf_counter()
    _check_options(kind, mask, truncate_side, seq_len, workers)
    sources = _check_inputs(inputs)
    existing = [p for p in _outputs(out_prefix) if p.exists()]
    if existing and not force:
        raise DataError(f"{existing[0]} already exists (--force replaces it)")
    template = _template(chat_template)
    tok = load_tokenizer(tokenizer)
    if isinstance(tok, ByteTokenizer):
        raise DataError(f"--format {kind} needs a tokenizer with a chat template; the byte "
                        "tokenizer has none")
    _check_images(kind, tok, image_root, min_pixels, max_pixels)
    settings = Settings(str(tok.folder), template, mask, seq_len, truncate_side, kind,
                        min_pixels, max_pixels)
    dtype = np.dtype(optimal_dtype(tok.vocab_size)).name
    encoder = _Encoder(settings, dtype, tok)  # a template that does not compile fails here
    folder = Path(os.path.abspath(out_prefix)).parent
    created = not folder.exists()
    folder.mkdir(parents=True, exist_ok=True)
    tmp_tok, published = None, False
    try:
        tmp_tok = tempfile.mkdtemp(dir=folder, prefix=f".{Path(out_prefix).name}.tokenizer.",
                                   suffix=".tmp")
        save_tokenizer(tok, tmp_tok)
        if template is not None:  # the dataset records what rendered it
            Path(tmp_tok, "chat_template.jinja").write_text(template, encoding="utf-8")
        with MaskedWriter(out_prefix, dtype) as writer, \
                _pool(settings, dtype, workers) as pool:
            items = _items(sources, kind, image_root)
            chunks = _encoded(items, encoder, pool, workers, _encode_in_worker)
            counts = _write(writer, chunks, skip_bad_rows, progress)
            if writer.n_documents == 0:
                raise DataError(f"no {'pairs' if kind == KIND else 'conversations'}: all "
                                f"{counts['rows']:,} rows were bad "
                                "(nothing written)")
            meta = {**_meta(settings, counts, writer.n_documents), "tokenizer": tok.name,
                    "inputs": [str(p) for p in inputs],
                    **_images_meta(encoder.images, writer.n_images)}
            writer.finalize(meta)
        published = True
        _publish_tokenizer(tmp_tok, out_prefix)
    except BaseException:
        _remove(*([tmp_tok] if tmp_tok else []),
                *(_outputs(out_prefix)[:-1] if published else []))
        if created and not any(folder.iterdir()):
            folder.rmdir()
        raise
    seconds = time.perf_counter() - start
    return {**meta, "n_documents": meta["documents"], "n_tokens": meta["tokens"],
            "dtype": dtype, "seconds": seconds, "tokens_per_s": meta["tokens"] / seconds}
