"""Tokenizers for data and generation: a built-in byte tokenizer and Hugging Face ``tokenizers``.

Data needs ``encode`` (no special tokens), ``decode``, the vocabulary size (it picks the token
dtype) and the end-of-document id. Generation also needs ``encode_prompt`` (the tokenizer's
post-processor applied, e.g. Llama-3's BOS, as ``transformers`` encodes a prompt) and
``apply_chat_template`` (the ``chat_template`` rendered as ``transformers`` renders it); chat
data (:mod:`composer.data.chat`) ``render_chat`` (the same rendering, with the spans of its
``{% generation %}`` blocks) and ``encode_offsets`` (tokens with their character spans).
``tokenizers`` is optional and imported on first use, so the byte tokenizer, and reading
datasets, work without it; ``jinja2`` likewise, for chat templates only.

A prepared dataset carries its tokenizer's files in ``PREFIX.tokenizer/`` (:func:`save_tokenizer`),
so ``load_tokenizer(PREFIX)`` later decodes it with exactly the vocabulary it was made with; a
training run and its export carry them in ``tokenizer/`` (:data:`TOKENIZER_DIR`).
"""

from __future__ import annotations

import contextvars
import functools
import json
import os
import shutil
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

from composer.data.indexed import DataError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja")
TOKENIZER_DIR = "tokenizer"
"""The subfolder of a training run (``composer train --save``) and of its export that holds the
tokenizer of the data it was trained on."""
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                       "cls_token", "mask_token")
"""The special tokens a chat template sees by name (``transformers``' ``special_tokens_map``)."""
EOS_NAMES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>")
BYTE_MARKER = {"composer_tokenizer": "byte"}


class Tokenizer(Protocol):
    """What :mod:`composer.data.prepare` needs of a tokenizer."""

    name: str
    vocab_size: int
    eod: int | None
    """The end-of-document id; None for a tokenizer without one (generation then runs to its
    length limit; ``prepare --append-eod`` refuses it)."""

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

    def encode_prompt(self, text: str) -> list[int]:
        """A generation prompt: the bytes (there are no special tokens to add)."""
        return self.encode(text)

    def apply_chat_template(self, messages: list[dict[str, str]],
                            add_generation_prompt: bool = True) -> str:
        raise DataError("tokenizer byte: the byte tokenizer has no chat template")

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


def _eos_token(folder: Path, vocab: dict[str, int]) -> str | None:
    """The end-of-document token: the config's ``eos_token``, else a conventionally named one,
    else None (transformers loads such a tokenizer too: many base models' have none)."""
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
    return None


def no_eod_message(name: str) -> str:
    """What to do about a tokenizer without an end-of-document token."""
    return (f"tokenizer {name}: no end-of-document token (set eos_token in "
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
        self.eod = None if self.eos_token is None else vocab[self.eos_token]
        # added tokens may sit past the model's vocabulary: the dtype must hold every id
        self.vocab_size = max(self._tok.get_vocab_size(with_added_tokens=True),
                              max(vocab.values()) + 1)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def token_id(self, token: str) -> int | None:
        """The id of ``token`` (a special token such as ``<|image_pad|>``), None without it."""
        return self._tok.token_to_id(token)

    def encode_prompt(self, text: str) -> list[int]:
        """A generation prompt: the post-processor adds what the model expects around it (the
        BOS of Llama-3), as ``transformers``' ``tokenizer(text)`` does."""
        return self._tok.encode(text, add_special_tokens=True).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids if int(i) != self.eod],
                                skip_special_tokens=False)

    def _config(self) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        for name in ("special_tokens_map.json", "tokenizer_config.json"):  # the config wins
            path = self.folder / name
            if path.is_file():
                loaded = json.loads(path.read_text(encoding="utf-8"))
                merged.update(loaded if isinstance(loaded, dict) else {})
        return merged

    def chat_template(self) -> str:
        """``chat_template.jinja``, else ``tokenizer_config.json``'s ``chat_template`` (a string,
        or a list of named templates of which ``default`` is taken)."""
        if (self.folder / "chat_template.jinja").is_file():
            return (self.folder / "chat_template.jinja").read_text(encoding="utf-8")
        template = self._config().get("chat_template")
        if isinstance(template, list):
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        if not isinstance(template, str) or not template:
            raise DataError(f"tokenizer {self.name}: no chat template (neither "
                            "chat_template.jinja nor a chat_template in tokenizer_config.json)")
        return template

    def encode_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """:meth:`encode` with each token's character span in ``text`` (``tokenizers``'
        ``Encoding.offsets``, what ``transformers`` maps a chat's generation spans with)."""
        encoding = self._tok.encode(text, add_special_tokens=False)
        return encoding.ids, [tuple(o) for o in encoding.offsets]

    def _special_tokens(self) -> dict[str, str]:
        config, tokens = self._config(), {}
        for key in SPECIAL_TOKEN_NAMES:
            value = config.get(key)
            if isinstance(value, dict):  # an AddedToken saved as a dict
                value = value.get("content")
            if isinstance(value, str):
                tokens[key] = value
        return tokens

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False,
                    template: str | None = None,
                    **kwargs: Any) -> tuple[str, list[tuple[int, int]]]:
        """The chat template (or ``template``) rendered over ``messages``, and the character
        spans its ``{% generation %}`` blocks rendered, as ``transformers``'
        ``apply_chat_template(..., return_assistant_tokens_mask=True)`` tracks them (empty
        for a template without the tag). ``kwargs`` reach the template (``enable_thinking``)."""
        source = self.chat_template() if template is None else template
        variables = {**self._special_tokens(), **kwargs}
        blocks: list[str] = []
        spans: list[tuple[int, int]] = []
        token = _TRACKER.set((blocks, spans))
        try:
            for block in _compile(source).generate(messages=messages,
                                           add_generation_prompt=add_generation_prompt,
                                           **variables):
                blocks.append(block)
        except DataError:
            raise
        except Exception as e:  # a template's raise_exception, or a broken template
            raise DataError(f"tokenizer {self.name}: the chat template failed "
                            f"({_one_line(e)})") from None
        finally:
            _TRACKER.reset(token)
        return "".join(blocks), spans

    def apply_chat_template(self, messages: list[dict[str, str]],
                            add_generation_prompt: bool = True) -> str:
        """The chat template rendered over ``messages`` as ``transformers``'
        ``apply_chat_template(messages, tokenize=False)`` renders it: a sandboxed Jinja2
        environment with ``trim_blocks``/``lstrip_blocks``, ``raise_exception``, ``tojson``,
        ``strftime_now``, and the special tokens by name. Encode the result with
        :meth:`encode` (the template already holds the special tokens)."""
        return self.render_chat(messages, add_generation_prompt)[0]


_TRACKER: Any = contextvars.ContextVar("generation_spans", default=None)
"""While :meth:`HFTokenizer.render_chat` renders: the blocks rendered so far and the spans of
the ``{% generation %}`` blocks (a ContextVar, as in ``transformers``, so threads don't mix)."""


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> Any:
    """A template compiled once: incremental masks render a conversation many times."""
    return _jinja_environment().from_string(template)


def _jinja_environment() -> Any:
    """The sandbox ``transformers`` renders chat templates in (``chat_template_utils``), with
    the ``{% generation %}`` tag rendering its body unchanged (and recording its span)."""
    try:
        import jinja2
        from jinja2.ext import Extension
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise DataError("chat templates need jinja2 (pip install jinja2)") from None

    class GenerationTag(Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            call = self.call_method("_body")
            return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            # where the body starts is what was rendered before it: the blocks generate()
            # yielded so far (the mechanism, and so the spans, of transformers' tracker)
            rendered = caller()
            tracking = _TRACKER.get()
            if tracking is not None:
                blocks, spans = tracking
                start = len("".join(blocks))
                spans.append((start, start + len(rendered)))
            return rendered

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


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


def has_tokenizer(folder: str | os.PathLike[str]) -> bool:
    """Whether ``folder`` holds a Hugging Face tokenizer (``tokenizer.json`` or
    ``tokenizer_config.json``), as a checkpoint's ``tokenizer/`` or a Hub folder does."""
    folder = Path(folder)
    return (folder / "tokenizer.json").is_file() or (folder / "tokenizer_config.json").is_file()


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
