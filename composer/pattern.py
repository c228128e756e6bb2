"""The layer-pattern language (docs/patterns.md).

One symbol is one residual block: ``M`` Mamba-2, ``*`` self-attention, ``-`` dense MLP, ``E`` MoE;
Megatron-Core's ``G`` (gated delta net), ``+`` (multi-latent attention) and ``D`` (sparse
attention) are recognised so that a pattern written for Megatron parses, and the builder says they
are not built yet. ``|`` separates pipeline stages, ``/`` separates multi-token-prediction parts
(``"main/mtp/mtp"``, every MTP part identical). ``(...)xN`` repeats a group; groups nest.
Whitespace is ignored. Every error is a :class:`PatternError` naming the character and its 1-based
column; no other exception escapes :func:`parse_pattern`, whatever the input.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

MAX_LAYERS = 100_000
"""Cap on the expanded length of a pattern (all parts together)."""

SYMBOLS: dict[str, str] = {
    "M": "Mamba-2",
    "*": "attention",
    "-": "dense MLP",
    "E": "MoE",
    "G": "gated delta net",
    "+": "multi-latent attention",
    "D": "sparse attention",
}
"""Every layer symbol the parser accepts, with a short name. The registry adds to it."""

MEGATRON_SYMBOLS = frozenset(SYMBOLS)
"""The symbols recognised without any registration."""

RESERVED = frozenset("|/()x0123456789")


class PatternError(ValueError):
    """A layer pattern that cannot be parsed; the message names the character and column."""


def register_symbol(symbol: str, description: str) -> None:
    """Make ``symbol`` a valid pattern character (called by the spec registry)."""
    if len(symbol) != 1 or symbol in RESERVED or symbol.isspace():
        raise ValueError(f"cannot use {symbol!r} as a layer symbol: it must be one character "
                         f"outside {''.join(sorted(RESERVED))} and whitespace")
    SYMBOLS[symbol] = description


def _valid_symbols() -> str:
    layers = ", ".join(f"{s} ({name})" for s, name in SYMBOLS.items())
    return f"valid symbols: {layers}; '|' stage boundary, '/' MTP part, '(...)xN' repetition"


@dataclass(frozen=True)
class Pattern:
    """A parsed pattern: the main part split into pipeline segments, plus MTP parts."""

    segments: tuple[str, ...]
    mtp: tuple[str, ...] = ()

    @property
    def layers(self) -> str:
        """The main part's layer symbols, flat (segment boundaries dropped)."""
        return "".join(self.segments)

    @property
    def symbols(self) -> list[str]:
        return list(self.layers)

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    def counts(self) -> Counter[str]:
        """Symbol -> number of layers in the main part."""
        return Counter(self.layers)

    def segment_of(self, layer_idx: int) -> int:
        """Index of the pipeline segment that holds global layer ``layer_idx``."""
        start = 0
        for i, seg in enumerate(self.segments):
            if start <= layer_idx < start + len(seg):
                return i
            start += len(seg)
        raise IndexError(f"layer {layer_idx} out of range for {self.n_layers} layers")

    def format(self) -> str:
        """The flat canonical string; ``parse_pattern(p.format()).format() == p.format()``."""
        return "|".join(self.segments) + "".join("/" + m for m in self.mtp)

    def __str__(self) -> str:
        return self.format()


def _error(text: str, col: int, what: str) -> PatternError:
    ch = text[col - 1] if 0 < col <= len(text) else ""
    where = f"character {ch!r} at column {col}" if ch else f"end of pattern (column {col})"
    return PatternError(f"{what}: {where} in pattern {text!r}; {_valid_symbols()}")


def _tokenize(text: str) -> list[tuple[str, int]]:
    """Non-space characters with their 1-based columns; digits after 'x' are merged."""
    tokens: list[tuple[str, int]] = []
    i = 0
    while i < len(text):
        ch = text[i]
        if ch.isspace():
            i += 1
            continue
        if ch.isdigit() and ch.isascii():
            j = i
            while j < len(text) and (text[j].isdigit() and text[j].isascii() or text[j].isspace()):
                j += 1
            tokens.append(("".join(text[i:j].split()), i + 1))
            i = j
            continue
        tokens.append((ch, i + 1))
        i += 1
    return tokens


def _is_count(tok: str) -> bool:
    return tok.isascii() and tok.isdigit()


def _parse_tokens(text: str, tokens: list[tuple[str, int]]) -> list:
    """Build a nested list tree: items are (symbol, col) or ('group', children, count, col)."""
    stack: list[tuple[list, int]] = [([], 0)]
    i = 0
    while i < len(tokens):
        tok, col = tokens[i]
        top = stack[-1][0]
        if tok == "(":
            stack.append(([], col))
        elif tok == ")":
            if len(stack) == 1:
                raise _error(text, col, "unmatched ')'")
            children, open_col = stack.pop()
            if not children:
                raise _error(text, col, "empty group '()'")
            if i + 1 >= len(tokens) or tokens[i + 1][0] != "x":
                nxt = tokens[i + 1][1] if i + 1 < len(tokens) else len(text) + 1
                raise _error(text, nxt, "expected 'x' and a repeat count after ')'")
            if i + 2 >= len(tokens) or not _is_count(tokens[i + 2][0]):
                nxt = tokens[i + 2][1] if i + 2 < len(tokens) else len(text) + 1
                raise _error(text, nxt, "expected a repeat count after 'x'")
            count = int(tokens[i + 2][0])
            if count < 1:
                raise _error(text, tokens[i + 2][1], "repeat count must be at least 1")
            stack[-1][0].append(("group", children, count, open_col))
            i += 3
            continue
        elif tok in SYMBOLS or tok == "|":
            top.append((tok, col))
        elif tok == "/":
            if len(stack) > 1:
                raise _error(text, col, "'/' (MTP separator) is not allowed inside a group")
            top.append((tok, col))
        elif tok.isdigit():
            raise _error(text, col, "a number must follow '(...)x'")
        elif tok == "x" and len(stack) > 1:  # "(M-x2": the group was left open, not a bad x
            open_col = stack[-1][1]
            raise _error(text, open_col, f"unclosed '(' (a ')' must come before the 'x' at "
                                         f"column {col})")
        else:
            raise _error(text, col, "invalid symbol")
        i += 1
    if len(stack) > 1:
        raise _error(text, stack[-1][1], "unclosed '('")
    return stack[0][0]


def _length(items: list, text: str) -> int:
    """Expanded length, checked against MAX_LAYERS without expanding (iterative, no recursion)."""
    total = 0
    work: list[tuple[list, int]] = [(items, 1)]
    while work:
        group, mult = work.pop()
        for item in group:
            if item[0] == "group":
                inner = mult * item[2]
                if inner > MAX_LAYERS:
                    raise _error(text, item[3], f"pattern expands past {MAX_LAYERS:,} layers")
                work.append((item[1], inner))
            else:
                total += mult
                if total > MAX_LAYERS:
                    raise _error(text, item[1], f"pattern expands past {MAX_LAYERS:,} layers")
    return total


def _expand(items: list) -> list[tuple[str, int]]:
    out: list[tuple[str, int]] = []
    work: list = list(reversed(items))
    while work:
        item = work.pop()
        if item[0] == "group":
            work.extend(reversed(item[1] * item[2]))
        else:
            out.append(item)
    return out


def parse_pattern(text: str) -> Pattern:
    """Parse a layer pattern such as ``"(M-)x4M*-|M*E/*E"`` into a :class:`Pattern`."""
    if not isinstance(text, str):
        raise PatternError(f"a pattern must be a string, got {type(text).__name__}")
    try:
        tree = _parse_tokens(text, _tokenize(text))
        _length(tree, text)
        flat = _expand(tree)
    except PatternError:
        raise
    except (ValueError, MemoryError, RecursionError) as exc:  # pragma: no cover - defensive
        raise PatternError(f"cannot parse pattern {text!r}: {exc}") from None
    parts: list[list[tuple[str, int]]] = [[]]
    for sym, col in flat:
        if sym == "/":
            parts.append([])
        else:
            parts[-1].append((sym, col))
    main, mtps = parts[0], parts[1:]
    segments = tuple("".join(s for s, _ in seg) for seg in _split(main))
    if not "".join(segments):
        col = main[0][1] if main else (flat[0][1] if flat else 1)
        if not text.strip():
            raise PatternError(f"empty pattern {text!r}; {_valid_symbols()}")
        raise _error(text, col, "the main pattern has no layer")
    mtp_parts: list[str] = []
    for part in mtps:
        bars = [col for s, col in part if s == "|"]
        if bars:
            raise _error(text, bars[0], "'|' (stage boundary) is only allowed in the main pattern")
        if not part:
            # point at what follows the opening '/': the next '/' or the end of the pattern
            cols = [c for s, c in flat if s == "/"] + [len(text) + 1]
            raise _error(text, cols[len(mtp_parts) + 1], "empty MTP part after '/'")
        body = "".join(s for s, _ in part)
        if mtp_parts and body != mtp_parts[0]:
            first = mtp_parts[0]
            raise _error(text, part[0][1], f"every MTP part must equal the first ({first!r})")
        mtp_parts.append(body)
    return Pattern(segments=segments, mtp=tuple(mtp_parts))


def _split(main: list[tuple[str, int]]) -> list[list[tuple[str, int]]]:
    segs: list[list[tuple[str, int]]] = [[]]
    for sym, col in main:
        if sym == "|":
            segs.append([])
        else:
            segs[-1].append((sym, col))
    return segs
