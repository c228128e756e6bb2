"""The built-in corpus: Tiny Shakespeare, prepared with the byte tokenizer, shipped in the package.

Source: ``data/tinyshakespeare/input.txt`` of github.com/karpathy/char-rnn (commit 6f9487a;
1,115,394 bytes, md5 6fb458f1232090904fb40fe944165e91), about 40,000 lines from Shakespeare's
plays. Shakespeare's works are in the public domain; the file is distributed in that repository
under its MIT licence. Documents are the speeches (blocks separated by blank lines: 7,222 of
them), each followed by the byte tokenizer's EOD (256), so a model of ``vocab_size >= 257``
trains on it. ``composer train`` with neither ``--data`` nor ``--tokens`` uses it, split
``98,2,0`` (train/valid/test by documents).

``python -m composer.data.corpus INPUT.txt`` rebuilds the shipped files from the source text.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

BUILTIN = Path(__file__).parent / "builtin" / "tinyshakespeare"
"""The dataset PREFIX (``.bin``, ``.idx``, ``.tokenizer/``)."""
BUILTIN_SPLIT = "98,2,0"


def speeches(text: str) -> list[str]:
    """The documents of the corpus: blank-line-separated blocks, stripped of newlines at
    their ends."""
    return [block.strip("\n") for block in text.split("\n\n") if block.strip()]


def build(source: str | Path, prefix: str | Path = BUILTIN) -> dict:
    """Prepare the corpus at ``prefix`` from the source text (replacing what is there)."""
    from composer.data.prepare import prepare

    docs = speeches(Path(source).read_text(encoding="utf-8"))
    with tempfile.TemporaryDirectory() as tmp:
        jsonl = Path(tmp) / "speeches.jsonl"
        jsonl.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
        return prepare([str(jsonl)], str(prefix), "byte", append_eod=True, force=True)


if __name__ == "__main__":
    print(json.dumps(build(sys.argv[1])))
