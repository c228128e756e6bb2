"""Tokenizers for data preparation: a built-in byte tokenizer and Hugging Face ``tokenizers``.

Only what turning text into a dataset needs: ``encode``, ``decode``, the vocabulary size (it
picks the token dtype) and the end-of-document id. ``tokenizers`` is optional and imported on
first use, so the byte tokenizer, and reading datasets, work without it.

A prepared dataset carries its tokenizer's files in ``PREFIX.tokenizer/`` (:func:`save_tokenizer`),
so ``load_tokenizer(PREFIX)`` later decodes it with exactly the vocabulary it was made with.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from composer.data.indexed import DataError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
EOS_NAMES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>")
BYTE_MARKER = {"composer_tokenizer": "byte"}


class Tokenizer(Protocol):
    """What :mod:`composer.data.prepare` needs of a tokenizer."""

    name: str
    vocab_size: int
    eod: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes are ids 0-255 and 256 ends a document: no files, no vocabulary to train,
    every text round-trips; what tests and tiny debug runs use."""

    name = "byte"
    vocab_size = 257
    eod = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        ids = [int(i) for i in ids if int(i) != self.eod]
        bad = [i for i in ids if not 0 <= i < 256]
        if bad:
            raise DataError(f"byte tokenizer: id {bad[0]} is out of range [0, {self.vocab_size})")
        return bytes(ids).decode("utf-8", errors="replace")


def _tokenizers() -> Any:
    try:
        import tokenizers
    except ImportError:
        raise DataError("Hugging Face tokenizers need the tokenizers library "
                        "(pip install tokenizers)") from None
    return tokenizers


def _eos_token(folder: Path, vocab: dict[str, int]) -> str:
    """The end-of-document token: the config's ``eos_token``, else a conventionally named one."""
    config_path = folder / "tokenizer_config.json"
    if config_path.is_file():
        eos = json.loads(config_path.read_text(encoding="utf-8")).get("eos_token")
        if isinstance(eos, dict):  # older configs hold an AddedToken as a dict
            eos = eos.get("content")
        if isinstance(eos, str):
            if eos not in vocab:
                raise DataError(f"tokenizer {folder}: eos_token {eos!r} from "
                                f"tokenizer_config.json is not in the vocabulary")
            return eos
    for name in EOS_NAMES:
        if name in vocab:
            return name
    raise DataError(f"tokenizer {folder}: no end-of-document token (set eos_token in "
                    f"tokenizer_config.json, or have one of {', '.join(EOS_NAMES)})")


class HFTokenizer:
    """A ``tokenizer.json`` (Hugging Face ``tokenizers``) in ``folder``; ``name`` says where it
    came from (a hub id or the folder).

    Encoding adds no special tokens (no BOS): a document is its text's tokens, and the end of
    a document is marked by ``eod`` when preparation asks for it.
    """

    def __init__(self, folder: str | os.PathLike[str], name: str | None = None) -> None:
        self.folder = Path(folder)
        self.name = name or str(folder)
        try:
            self._tok = _tokenizers().Tokenizer.from_file(str(self.folder / "tokenizer.json"))
        except DataError:
            raise
        except Exception as e:
            raise DataError(f"tokenizer {self.name}: cannot read tokenizer.json "
                            f"({_one_line(e)})") from None
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self.eos_token = _eos_token(self.folder, vocab)
        self.eod = vocab[self.eos_token]
        # added tokens may sit past the model's vocabulary: the dtype must hold every id
        self.vocab_size = max(self._tok.get_vocab_size(with_added_tokens=True),
                              max(vocab.values()) + 1)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids if int(i) != self.eod],
                                skip_special_tokens=False)


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def _from_folder(folder: Path, name: str) -> ByteTokenizer | HFTokenizer | None:
    if (folder / "tokenizer.json").is_file():
        return HFTokenizer(folder, name)
    config = folder / "tokenizer_config.json"
    if config.is_file():
        try:
            marker = json.loads(config.read_text(encoding="utf-8")).get("composer_tokenizer")
        except (ValueError, AttributeError):
            marker = None
        if marker == "byte":
            return ByteTokenizer()
    return None


def load_tokenizer(spec: str) -> ByteTokenizer | HFTokenizer:
    """``"byte"``; a folder with ``tokenizer.json`` (or one written by :func:`save_tokenizer`);
    a dataset prefix whose ``PREFIX.tokenizer/`` exists; or a Hugging Face hub id, of which only
    the tokenizer files are downloaded."""
    if spec == "byte":
        return ByteTokenizer()
    for folder in (Path(spec), Path(f"{spec}.tokenizer")):
        if folder.is_dir():
            tok = _from_folder(folder, spec)
            if tok is None:
                raise DataError(f"tokenizer {spec}: the folder {folder} has no tokenizer.json")
            return tok
    try:
        import huggingface_hub

        folder = Path(huggingface_hub.snapshot_download(repo_id=spec,
                                                        allow_patterns=list(TOKENIZER_FILES)))
    except Exception as e:
        raise DataError(f"tokenizer {spec}: not a local folder with tokenizer.json and not "
                        f"downloadable ({_one_line(e)})") from None
    if not (folder / "tokenizer.json").is_file():
        raise DataError(f"tokenizer {spec}: the hub repo has no tokenizer.json")
    return HFTokenizer(folder, spec)


def save_tokenizer(tok: ByteTokenizer | HFTokenizer, folder: str | os.PathLike[str]) -> None:
    """Write what :func:`load_tokenizer` needs to find ``tok`` again in ``folder``."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    if isinstance(tok, ByteTokenizer):
        (out / "tokenizer_config.json").write_text(json.dumps(BYTE_MARKER) + "\n",
                                                   encoding="utf-8")
        return
    for name in TOKENIZER_FILES:
        if (tok.folder / name).is_file():
            shutil.copyfile(tok.folder / name, out / name)


def describe_tokenizer(folder: str | os.PathLike[str]) -> str | None:
    """A short name for the tokenizer saved in ``folder`` without loading it: ``"byte"``, the
    config's ``name_or_path``, else the folder; None when there is no such folder."""
    path = Path(folder)
    if not path.is_dir():
        return None
    config: dict[str, Any] = {}
    if (path / "tokenizer_config.json").is_file():
        try:
            loaded = json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8"))
            config = loaded if isinstance(loaded, dict) else {}
        except ValueError:
            config = {}
    if config.get("composer_tokenizer") == "byte":
        return "byte"
    name = config.get("name_or_path")
    return name if isinstance(name, str) and name else str(path)
