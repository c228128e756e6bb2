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

RESERVED = frozenset("|/()x0123456789[]{}:")


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
    return (f"valid symbols: {layers}; '|' stage boundary, '/' MTP part, '(...)xN' repetition, "
            f"'[..]' parallel group, '{{a:..}}' / '{{a}}' shared layer")


def branches_of(token: str) -> tuple[str, ...]:
    """The layer symbols of one pattern token: ``"M"`` -> ``("M",)``, ``"[M*]"`` -> ``("M",
    "*")``."""
    return tuple(token[1:-1]) if token.startswith("[") else (token,)


@dataclass(frozen=True)
class Pattern:
    """A parsed pattern: the main part split into pipeline segments, plus MTP parts.

    Every layer is one *token*: a symbol (``"M"``) or a parallel group (``"[M*]"``, whose
    branches read the same normed input and add their outputs into one residual).
    ``shared[i]`` is the label of main layer ``i`` when it is a use of a shared layer
    (``{a:Z}`` defines ``a``, ``{a}`` reuses it: one set of weights), else None.
    """

    segments: tuple[tuple[str, ...], ...]
    mtp: tuple[tuple[str, ...], ...] = ()
    shared: tuple[str | None, ...] = ()

    def __post_init__(self) -> None:
        if not self.shared:
            object.__setattr__(self, "shared", (None,) * self.n_layers)

    @property
    def layers(self) -> tuple[str, ...]:
        """The main part's layer tokens, flat (segment boundaries dropped)."""
        return tuple(t for seg in self.segments for t in seg)

    @property
    def symbols(self) -> list[str]:
        return list(self.layers)

    @property
    def n_layers(self) -> int:
        return sum(len(seg) for seg in self.segments)

    def counts(self) -> Counter[str]:
        """Token -> number of layers in the main part (a shared layer counts at each use)."""
        return Counter(self.layers)

    def tokens_used(self) -> tuple[str, ...]:
        """The distinct tokens of the main part and the MTP parts, in order of appearance."""
        return tuple(dict.fromkeys(self.layers + tuple(t for part in self.mtp for t in part)))

    def symbols_used(self) -> tuple[str, ...]:
        """The distinct layer symbols, parallel groups' branches expanded, in order."""
        return tuple(dict.fromkeys(s for t in self.tokens_used() for s in branches_of(t)))

    def shared_uses(self) -> dict[str, list[int]]:
        """Shared label -> the main layers that use it (the first one defines it)."""
        out: dict[str, list[int]] = {}
        for i, label in enumerate(self.shared):
            if label is not None:
                out.setdefault(label, []).append(i)
        return out

    def segment_of(self, layer_idx: int) -> int:
        """Index of the pipeline segment that holds global layer ``layer_idx``."""
        start = 0
        for i, seg in enumerate(self.segments):
            if start <= layer_idx < start + len(seg):
                return i
            start += len(seg)
        raise IndexError(f"layer {layer_idx} out of range for {self.n_layers} layers")

    def format(self) -> str:
        """The flat canonical string; ``parse_pattern(p.format()).format() == p.format()``.

        A shared layer is written ``{a:T}`` at its first use and ``{a}`` after."""
        seen: set[str] = set()
        out: list[str] = []
        i = 0
        for k, seg in enumerate(self.segments):
            if k:
                out.append("|")
            for tok in seg:
                label = self.shared[i]
                if label is None:
                    out.append(tok)
                elif label in seen:
                    out.append("{" + label + "}")
                else:
                    seen.add(label)
                    out.append("{" + label + ":" + tok + "}")
                i += 1
        return "".join(out) + "".join("/" + "".join(m) for m in self.mtp)

    def __str__(self) -> str:
        return self.format()


def _error(text: str, col: int, what: str) -> PatternError:
    ch = text[col - 1] if 0 < col <= len(text) else ""
    where = f"character {ch!r} at column {col}" if ch else f"end of pattern (column {col})"
    return PatternError(f"{what}: {where} in pattern {text!r}; {_valid_symbols()}")


def _tokenize(text: str) -> list[tuple]:
    """Non-space characters with their 1-based columns as ``(char, col)``; digits after 'x' are
    merged; a parallel group is one ``(token, col)`` (``"[M*]"``) and a shared layer one
    ``("{", col, label, token or None)``."""
    tokens: list[tuple] = []
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
        if ch == "[":
            tok, j = _group(text, i)
            tokens.append((tok, i + 1))
            i = j
            continue
        if ch == "{":
            j = i + 1
            while j < len(text) and text[j] not in "{}":
                j += 1
            if j == len(text) or text[j] == "{":
                raise _error(text, i + 1, "unclosed '{' (a shared layer is '{a:T}' or '{a}')")
            tokens.append(("{", i + 1, *_shared(text, i, j)))
            i = j + 1
            continue
        if ch == "]":
            raise _error(text, i + 1, "unmatched ']'")
        if ch == "}":
            raise _error(text, i + 1, "unmatched '}'")
        if ch == ":":
            raise _error(text, i + 1, "':' is only allowed in a shared layer '{a:T}'")
        tokens.append((ch, i + 1))
        i += 1
    return tokens
def _group(text: str, i: int) -> tuple[str, int]:
    """The parallel group opening at ``text[i] == '['``: its token and the index after ``]``."""
    members: list[str] = []
    j = i + 1
    while j < len(text) and text[j] != "]":
        ch = text[j]
        if ch.isspace():
            j += 1
            continue
        if ch not in SYMBOLS:
            what = ("a parallel group holds layer symbols only (no nesting, repetition, "
                    "'|', '/' or shared layers)" if ch in RESERVED else "invalid symbol")
            raise _error(text, j + 1, what)
        if ch in members:
            raise _error(text, j + 1, f"{ch!r} appears twice in one parallel group")
        members.append(ch)
        j += 1
    if j == len(text):
        raise _error(text, i + 1, "unclosed '['")
    if len(members) < 2:
        raise _error(text, i + 1, "a parallel group '[..]' needs at least two layer symbols")
    return "[" + "".join(members) + "]", j + 1


def _skip_space(text: str, k: int, end: int) -> int:
    while k < end and text[k].isspace():
        k += 1
    return k


def _shared(text: str, i: int, j: int) -> tuple[str, str | None]:
    """The shared layer ``text[i:j + 1]`` (``{a:T}`` or ``{a}``): its label and token (None for a
    use)."""
    k = start = _skip_space(text, i + 1, j)
    while k < j and text[k].isascii() and (text[k].islower() or k > start and (
            text[k].isdigit() or text[k] == "_")):
        k += 1
    label = text[start:k]
    k = _skip_space(text, k, j)
    if not label or k < j and text[k] != ":":
        raise _error(text, k + 1, "a shared layer is '{a:T}' (define label 'a' as layer T) or "
                                  "'{a}' (reuse it), a label being a lowercase name")
    if k == j:
        return label, None
    k = _skip_space(text, k + 1, j)
    if k == j:
        raise _error(text, j + 1, f"shared layer {label!r} has no layer after ':'")
    if text[k] == "[":
        tok, k = _group(text, k)
    elif text[k] in SYMBOLS:
        tok, k = text[k], k + 1
    else:
        raise _error(text, k + 1, "invalid symbol")
    k = _skip_space(text, k, j)
    if k < j:
        raise _error(text, k + 1, "a shared layer holds one layer symbol or one '[..]' group")
    return label, tok


def _is_count(tok: str) -> bool:
    return tok.isascii() and tok.isdigit()


def _parse_tokens(text: str, tokens: list[tuple]) -> list:
    """Build a nested list tree: items are ``(token, col, shared label)`` (the token None for a
    shared layer's reuse ``{a}``) or ``('group', children, count, col)``."""
    stack: list[tuple[list, int]] = [([], 0)]
    i = 0
    while i < len(tokens):
        tok, col = tokens[i][:2]
        top = stack[-1][0]
        if tok == "{":
            top.append((tokens[i][3], col, tokens[i][2]))
        elif tok.startswith("["):
            top.append((tok, col, None))
        elif tok == "(":
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
            top.append((tok, col, None))
        elif tok == "/":
            if len(stack) > 1:
                raise _error(text, col, "'/' (MTP separator) is not allowed inside a group")
            top.append((tok, col, None))
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


def _expand(items: list) -> list[tuple]:
    out: list[tuple] = []
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
    parts: list[list[tuple]] = [[]]
    for item in flat:
        if item[0] == "/":
            parts.append([])
        else:
            parts[-1].append(item)
    main, mtps = parts[0], parts[1:]
    main = _resolve_shared(text, main)
    split = _split(main)
    segments = tuple(tuple(tok for tok, _, _ in seg) for seg in split)
    if not any(segments):
        col = main[0][1] if main else (flat[0][1] if flat else 1)
        if not text.strip():
            raise PatternError(f"empty pattern {text!r}; {_valid_symbols()}")
        raise _error(text, col, "the main pattern has no layer")
    mtp_parts: list[tuple[str, ...]] = []
    for part in mtps:
        bars = [col for s, col, _ in part if s == "|"]
        if bars:
            raise _error(text, bars[0], "'|' (stage boundary) is only allowed in the main pattern")
        labels = [col for _, col, label in part if label is not None]
        if labels:
            raise _error(text, labels[0], "shared layers are only allowed in the main pattern")
        if not part:
            # point at what follows the opening '/': the next '/' or the end of the pattern
            cols = [c for s, c, _ in flat if s == "/"] + [len(text) + 1]
            raise _error(text, cols[len(mtp_parts) + 1], "empty MTP part after '/'")
        body = tuple(s for s, _, _ in part)
        if mtp_parts and body != mtp_parts[0]:
            first = "".join(mtp_parts[0])
            raise _error(text, part[0][1], f"every MTP part must equal the first ({first!r})")
        mtp_parts.append(body)
    shared = tuple(label for seg in split for _, _, label in seg)
    return Pattern(segments=segments, mtp=tuple(mtp_parts), shared=shared)


def _resolve_shared(text: str, main: list[tuple]) -> list[tuple]:
    """Fill each reuse ``{a}`` with its definition's token; a definition repeated (by ``(..)xN``
    or by hand) must name the same layer."""
    defined: dict[str, tuple[str, int]] = {}
    out: list[tuple] = []
    for tok, col, label in main:
        if label is not None:
            if label not in defined:
                if tok is None:
                    raise _error(text, col, f"shared layer {{{label}}} is used before its "
                                            f"definition {{{label}:..}}")
                defined[label] = (tok, col)
            elif tok is not None and tok != defined[label][0]:
                first, at = defined[label]
                raise _error(text, col, f"shared layer {label!r} is defined as {first!r} at "
                                        f"column {at}")
            tok = defined[label][0]
        out.append((tok, col, label))
    return out


def _split(main: list[tuple]) -> list[list[tuple]]:
    segs: list[list[tuple]] = [[]]
    for item in main:
        if item[0] == "|":
            segs.append([])
        else:
            segs[-1].append(item)
    return segs
