"""The built-in tasks' tokenizer.

The tokenizer is character-level over exactly what the tasks write: the digits (id ``d`` is the
digit ``d``), the operators, parentheses, ``=``, ``,``, ``>`` and the space, then ``<eos>`` and
``<pad>``: 22 ids, so a debug model's vocabulary is tiny and an answer is one token per digit
(``arith`` with single-digit answers is then a one-token decision). It ships as a Hugging Face
``tokenizer.json`` folder (``composer/data/builtin/tasks.tokenizer/``), so
``composer.data.tokenizer.load_tokenizer`` reads it, a training run saves it next to its
checkpoint like any other, and ``composer generate`` decodes with it. :class:`TasksTokenizer`
reads the same file without the optional ``tokenizers`` library, so ``composer train --config
grpo-debug`` runs on a bare install; a test checks the two agree. Regenerate the folder (it is
byte-identical each time) with::

    python -m composer.train.rl.vocab
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

from composer.data.indexed import DataError

TASKS_TOKENIZER = Path(__file__).resolve().parents[2] / "data" / "builtin" / "tasks.tokenizer"
CHARS = "0123456789 +-*/()=,>"
EOS_TOKEN = "<eos>"
PAD_TOKEN = "<pad>"
EOS = len(CHARS)
PAD = len(CHARS) + 1


def tokenizer_config() -> dict[str, object]:
    """``tokenizer_config.json``: the eos token (generation stops there) and the pad token."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "name_or_path": "composer-builtin-tasks",
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "model_max_length": 256,
        "clean_up_tokenization_spaces": False,
    }


def write_tokenizer(folder: str | os.PathLike[str] = TASKS_TOKENIZER) -> Path:
    """The character tokenizer in ``folder``: a BPE model with single-character tokens and no
    merges (so every character is its own id), no pre-tokenizer (the space is a token like any
    other), the ``Fuse`` decoder (tokens are concatenated, not space-joined) and the two special
    tokens. Needs ``tokenizers``; loading does not."""
    from tokenizers import AddedToken, Tokenizer, decoders, models

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(CHARS)}, merges=[]))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in (EOS_TOKEN, PAD_TOKEN)])
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=1) + "\n",
                                               encoding="utf-8")
    return out


class TasksTokenizer:
    """The shipped character tokenizer read from its ``tokenizer.json`` without ``tokenizers``:
    the same ids, the same ``eod``, the same decoding (``<eos>`` dropped, ``<pad>`` written out)
    as ``load_tokenizer`` gives. A character outside the vocabulary is an error, not dropped."""

    name = "composer-builtin-tasks"

    def __init__(self, folder: str | os.PathLike[str] = TASKS_TOKENIZER) -> None:
        self.folder = Path(folder)  # save_tokenizer copies this folder's files
        try:
            spec = json.loads((self.folder / "tokenizer.json").read_text(encoding="utf-8"))
            config = json.loads((self.folder / "tokenizer_config.json").read_text("utf-8"))
            vocab = {str(k): int(v) for k, v in spec["model"]["vocab"].items()}
            vocab.update({t["content"]: int(t["id"]) for t in spec["added_tokens"]})
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise DataError(f"tokenizer {self.folder}: cannot read it ({e})") from None
        self._ids = vocab
        self._tokens = {i: t for t, i in vocab.items()}
        self.vocab_size = max(vocab.values()) + 1
        self.eos_token = config.get("eos_token")
        self.eod = vocab.get(self.eos_token) if isinstance(self.eos_token, str) else None
        self.pad = vocab.get(config.get("pad_token", ""))

    def encode(self, text: str) -> list[int]:
        try:
            return [self._ids[c] for c in text]
        except KeyError as e:
            raise DataError(f"tokenizer {self.name}: character {e.args[0]!r} is not in its "
                            f"vocabulary ({CHARS!r})") from None

    def encode_prompt(self, text: str) -> list[int]:
        """A generation prompt: the characters (there is no BOS to add)."""
        return self.encode(text)

    def encode_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        return self.encode(text), [(i, i + 1) for i in range(len(text))]

    def decode(self, ids: Sequence[int]) -> str:
        try:
            return "".join(self._tokens[int(i)] for i in ids if int(i) != self.eod)
        except KeyError as e:
            raise DataError(f"tokenizer {self.name}: id {e.args[0]} is out of range "
                            f"[0, {self.vocab_size})") from None

    def apply_chat_template(self, messages: list[dict[str, str]],
                            add_generation_prompt: bool = True) -> str:
        raise DataError(f"tokenizer {self.name}: the tasks tokenizer has no chat template")


def tasks_tokenizer() -> TasksTokenizer:
    """The built-in tasks' tokenizer (what ``arith`` and ``countdown`` expose as ``tokenizer``)."""
    return TasksTokenizer(TASKS_TOKENIZER)


if __name__ == "__main__":
    print(write_tokenizer())
