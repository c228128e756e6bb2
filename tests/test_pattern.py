"""The layer-pattern language: round trip, repetition, segments, MTP, parallel groups, shared
layers, every error, fuzz."""

import random
import re

import pytest

from composer import Pattern, PatternError, parse_pattern
from composer import pattern as pattern_mod


@pytest.mark.parametrize(
    "text, flat",
    [
        ("M-M*-ME", "M-M*-ME"),
        ("(M-)x4M*-", "M-M-M-M-M*-"),
        ("((M-)x2*)x2", "M-M-*M-M-*"),
        ("  M - M *\t-\nE ", "M-M*-E"),
        ("(M)x1", "M"),
        ("(ME)x3|(M*)x2", "MEMEME|M*M*"),
        ("M*|M*|M*/*E/*E", "M*|M*|M*/*E/*E"),
        ("(M|)x3M", "M|M|M|M"),
        ("M||M", "M||M"),
        ("G+D", "G+D"),
        ("(M)x 1 2", "MMMMMMMMMMMM"),
        ("([M*]-)x2", "[M*]-[M*]-"),
        ("[ M * ]-|[*-]", "[M*]-|[*-]"),
        ("({a:[M*]}-)x2", "{a:[M*]}-{a}-"),
        ("(MM{a:*}MM{b:*})x2", "MM{a:*}MM{b:*}MM{a}MM{b}"),
        ("{ a1_x : * }M{a1_x}|{ a1_x }", "{a1_x:*}M{a1_x}|{a1_x}"),
        ("[M*]-/*-", "[M*]-/*-"),
    ],
)
def test_parse_and_format(text, flat):
    p = parse_pattern(text)
    assert p.format() == flat
    assert parse_pattern(p.format()).format() == flat
    assert parse_pattern(p.format()) == p


def test_structure():
    p = parse_pattern("(M-)x2*|E-/*E/*E")
    assert p.segments == (tuple("M-M-*"), tuple("E-"))
    assert p.mtp == (tuple("*E"), tuple("*E"))
    assert p.layers == tuple("M-M-*E-")
    assert p.symbols == list("M-M-*E-")
    assert p.shared == (None,) * 7 and p.shared_uses() == {}
    assert p.n_layers == 7
    assert dict(p.counts()) == {"M": 2, "-": 3, "*": 1, "E": 1}
    assert [p.segment_of(i) for i in range(7)] == [0, 0, 0, 0, 0, 1, 1]
    assert isinstance(p, Pattern)
    with pytest.raises(IndexError):
        p.segment_of(7)


def test_groups_and_shared_layers():
    p = parse_pattern("({a:[M*]}-)x2 M{b:*}|{a}{b}/[*-]")
    assert p.segments == (("[M*]", "-", "[M*]", "-", "M", "*"), ("[M*]", "*"))
    assert p.layers[0] == "[M*]" and p.n_layers == 8 and p.mtp == (("[*-]",),)
    assert p.shared == ("a", None, "a", None, None, "b", "a", "b")
    assert p.shared_uses() == {"a": [0, 2, 6], "b": [5, 7]}
    assert dict(p.counts()) == {"[M*]": 3, "-": 2, "M": 1, "*": 2}
    assert p.tokens_used() == ("[M*]", "-", "M", "*", "[*-]")
    assert p.symbols_used() == ("M", "*", "-")
    assert pattern_mod.branches_of("[M*]") == ("M", "*") and pattern_mod.branches_of("M") == ("M",)
    assert p.format() == "{a:[M*]}-{a}-M{b:*}|{a}{b}/[*-]"
    assert parse_pattern(p.format()) == p


def test_cap_on_expansion():
    assert parse_pattern("(M)x100000").n_layers == 100_000
    with pytest.raises(PatternError, match="expands past 100,000 layers"):
        parse_pattern("(M)x100001")
    with pytest.raises(PatternError, match="expands past"):
        parse_pattern("((((M)x1000)x1000)x1000)x1000")
    with pytest.raises(PatternError, match="expands past"):
        parse_pattern("(M)x" + "9" * 400)


@pytest.mark.parametrize(
    "text, message, char, col",
    [
        ("M-Q*", "invalid symbol", "Q", 3),
        ("M- x", "invalid symbol", "x", 4),
        ("M-)", "unmatched ')'", ")", 3),
        ("(M-", "unclosed '('", "(", 1),
        ("M(M-", "unclosed '('", "(", 2),
        ("(M-)", "expected 'x' and a repeat count after ')'", None, 5),
        ("(M-)M", "expected 'x' and a repeat count after ')'", "M", 5),
        ("(M-)x", "expected a repeat count after 'x'", None, 6),
        ("(M-)xM", "expected a repeat count after 'x'", "M", 6),
        ("(M-)x0", "repeat count must be at least 1", "0", 6),
        ("()x3", "empty group '()'", ")", 2),
        ("M3", "a number must follow '(...)x'", "3", 2),
        ("(M/E)x2", "'/' (MTP separator) is not allowed inside a group", "/", 3),
        ("M/*|E", "'|' (stage boundary) is only allowed in the main pattern", "|", 4),
        ("M/", "empty MTP part after '/'", None, 3),
        ("M//E", "empty MTP part after '/'", "/", 3),
        ("M/*E/*-", "every MTP part must equal the first", "*", 6),
        ("/*E", "the main pattern has no layer", "/", 1),
        ("||", "the main pattern has no layer", "|", 1),
        ("M[M]", "a parallel group '[..]' needs at least two layer symbols", "[", 2),
        ("[]", "a parallel group '[..]' needs at least two layer symbols", "[", 1),
        ("[MM]", "'M' appears twice in one parallel group", "M", 3),
        ("[M(*)x2]", "a parallel group holds layer symbols only", "(", 3),
        ("[M[*-]]", "a parallel group holds layer symbols only", "[", 3),
        ("[M|*]", "a parallel group holds layer symbols only", "|", 3),
        ("[MQ]", "invalid symbol", "Q", 3),
        ("-[M*", "unclosed '['", "[", 2),
        ("M*]", "unmatched ']'", "]", 3),
        ("M}", "unmatched '}'", "}", 2),
        ("M:*", "':' is only allowed in a shared layer", ":", 2),
        ("M{a:*", "unclosed '{'", "{", 2),
        ("{a:*{b}}", "unclosed '{'", "{", 1),
        ("M{a}{a:*}", "shared layer {a} is used before its definition", "{", 2),
        ("{a:*}{a:M}", "shared layer 'a' is defined as '*' at column 1", "{", 6),
        ("{A:*}", "a shared layer is '{a:T}'", "A", 2),
        ("{1a:*}", "a shared layer is '{a:T}'", "1", 2),
        ("{a b:*}", "a shared layer is '{a:T}'", "b", 4),
        ("{a:}", "shared layer 'a' has no layer after ':'", "}", 4),
        ("{a:Q}", "invalid symbol", "Q", 4),
        ("{a:*-}", "a shared layer holds one layer symbol or one '[..]' group", "-", 5),
        ("{a:[M*] *}", "a shared layer holds one layer symbol or one '[..]' group", "*", 9),
        ("{a:*}/{a}", "shared layers are only allowed in the main pattern", "{", 7),
    ],
)
def test_errors_name_character_and_column(text, message, char, col):
    with pytest.raises(PatternError) as info:
        parse_pattern(text)
    msg = str(info.value)
    assert msg.startswith(message)
    if char is None:
        assert f"end of pattern (column {col})" in msg
    else:
        assert f"character {char!r} at column {col}" in msg
    assert "valid symbols: M (Mamba-2), * (attention), - (dense MLP), E (MoE)" in msg
    assert "\n" not in msg


@pytest.mark.parametrize("text", ["", "   ", "\n\t"])
def test_empty(text):
    with pytest.raises(PatternError, match="empty pattern"):
        parse_pattern(text)


def test_not_a_string():
    with pytest.raises(PatternError, match="must be a string"):
        parse_pattern(None)  # type: ignore[arg-type]


def test_pattern_error_is_value_error():
    assert issubclass(PatternError, ValueError)


def test_fuzz_only_pattern_error_escapes():
    rng = random.Random(1234)
    alphabet = list("M*-EGD+|/()x0123456789 \tQ²٣[]{}:ab") + [
        "x10", "(M)x", "((", "))", "x99999", "[M*]", "{a:", "{b}", "{a:[*-]}"]
    n_ok = 0
    for _ in range(8000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        try:
            p = parse_pattern(text)
        except PatternError as exc:
            assert re.search(r"column \d+|empty pattern", str(exc)), (text, str(exc))
            continue
        n_ok += 1
        assert parse_pattern(p.format()) == p
    assert n_ok > 50  # the fuzz reaches valid patterns too


def test_deep_nesting_has_no_recursion_error():
    depth = 5000
    p = parse_pattern("(" * depth + "M" + ")x1" * depth)
    assert p.format() == "M"
    with pytest.raises(PatternError, match="unclosed"):
        parse_pattern("(" * depth + "M")


def test_register_symbol_rejects_reserved():
    for bad in ("x", "|", "(", "7", " ", "MM"):
        with pytest.raises(ValueError):
            pattern_mod.register_symbol(bad, "nope")


def test_an_open_group_before_x_is_an_unclosed_group():
    # issue 21: "(M-x2" was reported as a bad 'x' at column 4
    with pytest.raises(PatternError) as info:
        parse_pattern("(M-x2")
    assert str(info.value).split("; valid symbols")[0] == (
        "unclosed '(' (a ')' must come before the 'x' at column 4): character '(' at column 1 "
        "in pattern '(M-x2'")
    with pytest.raises(PatternError) as info:
        parse_pattern("M ( (M-)x2 -x3")  # the inner group closed, the outer one open
    assert str(info.value).startswith(
        "unclosed '(' (a ')' must come before the 'x' at column 13): character '(' at column 3")
