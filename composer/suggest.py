""""Did you mean ...?": the one rule every suggestion of the package follows.

Edit distance alone picks badly among names that share a stem: for ``qwen3-30b`` it prefers
``qwen3-0.6b`` (one deletion away) to ``qwen3-30b-a3b``, the preset meant. People shorten
names and misspell words, so a prefix match wins, then the most shared words (split on ``-``,
``_`` and ``.``; a word also matches a word it begins, ``stat`` ~ ``state``), then edit
distance; ties go to the closer spelling.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable

_WORD = re.compile(r"[-_.]+")


def _words(name: str) -> list[str]:
    return [w for w in _WORD.split(name.lower()) if w]


def _shared(a: list[str], b: list[str]) -> int:
    """Words of ``a`` that equal, or (3 characters or more) begin or are begun by, one of
    ``b``."""
    def match(x: str, y: str) -> bool:
        return x == y or (min(len(x), len(y)) >= 3 and (x.startswith(y) or y.startswith(x)))

    return sum(any(match(x, y) for y in b) for x in a)


def closest(name: str, choices: Iterable[str]) -> str | None:
    """The choice ``name`` most likely meant, or None when nothing is close."""
    options = [c for c in dict.fromkeys(choices) if c != name]
    if not options or not name:
        return None
    low = name.lower()

    def ratio(c: str) -> float:
        return difflib.SequenceMatcher(None, low, c.lower()).ratio()

    prefixed = [c for c in options if c.lower().startswith(low) or low.startswith(c.lower())]
    if prefixed:
        return max(prefixed, key=ratio)
    words = _words(name)
    scored = [(_shared(words, _words(c)), ratio(c), c) for c in options]
    best = max(scored)
    if best[0] > 0 and best[1] >= 0.4:
        return best[2]
    close = difflib.get_close_matches(name, options, n=1)
    return close[0] if close else None
