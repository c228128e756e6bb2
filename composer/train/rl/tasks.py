"""The built-in tasks (``arith``, ``countdown``: see :mod:`composer.train.rl.envs` for their
rules) and the safe expression checker; their tokenizer is :mod:`composer.train.rl.vocab`.

:func:`evaluate_expression` is how ``countdown`` checks an answer: the text is parsed with
``ast`` (parsing runs nothing), the tree is checked node by node against a whitelist (integer
literals and the allowed binary operators; no names, calls, attributes, unary signs or powers),
the literals against the numbers given, and only then is the tree evaluated in exact
``Fraction`` arithmetic. ``eval`` is never called.
"""

from __future__ import annotations

import ast
import itertools
import random
import re
from collections import Counter
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

from composer.train.rl.envs import (
    Env,
    Knob,
    Prompt,
    RewardError,
    Score,
    boolean_knob,
    choice_knob,
    fraction_knob,
    in_split,
    integer_knob,
    operators_knob,
    parse_knobs,
    prompt_stream,
)
from composer.train.rl.vocab import tasks_tokenizer

MAX_EXPRESSION_CHARS = 256
"""Longer completions are not parsed: no task's answer is anywhere near this long."""
MAX_DRAWS = 10_000
"""Rejection sampling gives up after this many draws (the knobs leave (almost) nothing)."""
TABLE_LIMIT = 200_000
"""``arith`` enumerates its expressions when there are at most this many: sampling is then exact
(uniform over the expressions the knobs allow) and ``balanced`` possible."""


_OPERATORS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}


def _literals(node: ast.AST, ops: str) -> list[int] | None:
    """The integer literals of a whitelisted expression tree, left to right; None for any other
    node (a name, call, attribute, unary sign, power, float, string ...)."""
    if isinstance(node, ast.Constant):
        value = node.value
        return [value] if type(value) is int else None
    symbol = _OPERATORS.get(type(node.op)) if isinstance(node, ast.BinOp) else None
    if isinstance(node, ast.BinOp) and symbol is not None and symbol in ops:
        left, right = _literals(node.left, ops), _literals(node.right, ops)
        return None if left is None or right is None else left + right
    return None


def _value(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant):
        return Fraction(node.value)
    assert isinstance(node, ast.BinOp)  # _literals admitted nothing else
    left, right = _value(node.left), _value(node.right)
    op = type(node.op)
    if op is ast.Add:
        return left + right
    if op is ast.Sub:
        return left - right
    if op is ast.Mult:
        return left * right
    return left / right  # ZeroDivisionError is the caller's


def evaluate_expression(text: str, numbers: Sequence[int], ops: str = "+-*/",
                        use_all: bool = False) -> Fraction | None:
    """The exact value of ``text``, an expression over ``numbers`` with the operators ``ops``
    and parentheses, each number used at most once (exactly once with ``use_all``); None when it
    is not such an expression (a syntax error, another node, a number not given or used too
    often, a division by zero, longer than :data:`MAX_EXPRESSION_CHARS`)."""
    if len(text) > MAX_EXPRESSION_CHARS or not text.strip():
        return None
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    used = _literals(tree.body, ops)
    if used is None:
        return None
    given, counted = Counter(int(n) for n in numbers), Counter(used)
    if any(counted[n] > given[n] for n in counted) or (use_all and counted != given):
        return None
    try:
        return _value(tree.body)
    except ZeroDivisionError:
        return None


ARITH_KNOBS = {
    "digits": Knob(1, integer_knob(1, 6)),
    "ops": Knob("+-", operators_knob("+-*")),
    "terms": Knob(2, integer_knob(2, 6)),
    "min_answer": Knob(None, integer_knob(optional=True)),
    "max_answer": Knob(None, integer_knob(optional=True)),
    "balanced": Knob(False, boolean_knob),
    "negative": Knob(False, boolean_knob),
    "holdout": Knob(0.0, fraction_knob(0.0, 1.0)),
    "style": Knob("plain", choice_knob("plain", "chat")),
}
"""``arith``'s knobs. ``digits``: of each operand (1: 0-9; d > 1: exactly d digits). ``ops``:
the operators drawn from. ``terms``: operands per expression. ``min_answer``/``max_answer``:
expressions whose answer falls outside are drawn again (default min 0, or unbounded with
``negative``; max unbounded; ``none`` says unbounded). ``balanced``: draw the answer uniformly
among those reachable, then an expression with that answer uniformly, so that a constant guess
scores about 1/(number of answers). ``negative``: allow answers below 0. ``holdout``: the
fraction of prompt texts kept for eval only. ``style``: ``plain`` (``"3+4="`` in the tasks
tokenizer, the answer the completion's leading integer) or ``chat`` (a user message
``"What is 3 + 4?"`` in ``meta["messages"]``, rendered with the chat template of the model's own
tokenizer, the environment bringing none: for a model fine-tuned on chat data, e.g. the built-in
chat set's arithmetic; the answer is the completion's last integer, so ``"3 + 4 = 7."``
counts)."""


Table = tuple[dict[int, list[str]], list[tuple[str, int]]]


def _arith_value(operands: tuple[int, ...], ops: tuple[str, ...]) -> int:
    """The value with ``*`` binding tighter than ``+`` and ``-`` (as written in the prompt)."""
    total, sign, product = 0, 1, operands[0]
    for op, x in zip(ops, operands[1:], strict=True):
        if op == "*":
            product *= x
        else:
            total, sign, product = total + sign * product, (1 if op == "+" else -1), x
    return total + sign * product


def _expression(operands: tuple[int, ...], ops: tuple[str, ...]) -> str:
    return "".join(f"{x}{op}" for x, op in zip(operands, (*ops, ""), strict=True))


class Arith(Env):
    """Integer arithmetic: the prompt ``"3+4="``, the answer ``"7"`` (see the module doc)."""

    name = "arith"

    def __init__(self, args: list[str]) -> None:
        self.args = k = parse_knobs("arith", args, ARITH_KNOBS)
        self.tokenizer = tasks_tokenizer() if k["style"] == "plain" else None
        if k["min_answer"] is None:
            k["min_answer"] = None if k["negative"] else 0
        if not k["negative"] and k["min_answer"] < 0:
            raise RewardError(f"env arith: min_answer={k['min_answer']} needs negative=true")
        if None not in (k["min_answer"], k["max_answer"]) and k["max_answer"] < k["min_answer"]:
            raise RewardError(f"env arith: max_answer={k['max_answer']} is below "
                              f"min_answer={k['min_answer']}")
        digits, terms = k["digits"], k["terms"]
        self._operand = (0 if digits == 1 else 10 ** (digits - 1), 10 ** digits - 1)
        size = (self._operand[1] - self._operand[0] + 1) ** terms * len(k["ops"]) ** (terms - 1)
        if k["balanced"] and size > TABLE_LIMIT:
            raise RewardError(f"env arith: balanced=true enumerates the expressions, at most "
                              f"{TABLE_LIMIT} (digits={digits}, terms={terms}, ops={k['ops']} "
                              f"make {size}); lower digits or terms")
        self._tables: dict[str, Table] | None = {} if size <= TABLE_LIMIT else None
        if self._tables is not None and not self._table("all")[1]:
            raise RewardError(f"env arith: no expression has an answer in {self._range()}")

    def _range(self) -> str:
        lo, hi = self.args["min_answer"], self.args["max_answer"]
        return f"[{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}]"

    def _allowed(self, value: int) -> bool:
        lo, hi = self.args["min_answer"], self.args["max_answer"]
        return (lo is None or value >= lo) and (hi is None or value <= hi)

    def _table(self, split: str) -> Table:
        """Every allowed expression of ``split`` (``"all"``: ignoring holdout) by its answer,
        and all of them as one list (both in a fixed order, so draws are stable)."""
        assert self._tables is not None
        if split not in self._tables:
            by_answer: dict[int, list[str]] = {}
            lo, hi = self._operand
            holdout = 0.0 if split == "all" else self.args["holdout"]
            for operands in itertools.product(range(lo, hi + 1), repeat=self.args["terms"]):
                for ops in itertools.product(self.args["ops"], repeat=self.args["terms"] - 1):
                    value, text = _arith_value(operands, ops), _expression(operands, ops) + "="
                    if self._allowed(value) and in_split(text, split, holdout):
                        by_answer.setdefault(value, []).append(text)
            by_answer = dict(sorted(by_answer.items()))
            flat = [(text, answer) for answer, texts in by_answer.items() for text in texts]
            self._tables[split] = (by_answer, flat)
        return self._tables[split]

    def _draw(self, rng: random.Random, split: str) -> tuple[str, int]:
        """A prompt text and its answer: uniform over the allowed expressions, or (balanced)
        over the answers, then over the expressions of the answer drawn."""
        if self._tables is not None:
            by_answer, flat = self._table(split)
            if not flat:
                raise RewardError(f"env arith: no {split} expression has an answer in "
                                  f"{self._range()} (holdout={self.args['holdout']:g})")
            if self.args["balanced"]:
                answer = rng.choice(list(by_answer))
                return rng.choice(by_answer[answer]), answer
            return rng.choice(flat)
        lo, hi, terms = *self._operand, self.args["terms"]
        for _ in range(MAX_DRAWS):
            operands = tuple(rng.randint(lo, hi) for _ in range(terms))
            ops = tuple(rng.choice(self.args["ops"]) for _ in range(terms - 1))
            value, text = _arith_value(operands, ops), _expression(operands, ops) + "="
            if self._allowed(value) and in_split(text, split, self.args["holdout"]):
                return text, value
        raise RewardError(f"env arith: {MAX_DRAWS} draws found no {split} expression with an "
                          f"answer in {self._range()}")

    def prompts(self, n: int, seed: int, split: str = "train") -> list[Prompt]:
        rng = prompt_stream(self.name, split, seed)
        out = []
        for index in range(n):
            text, answer = self._draw(rng, split)
            meta: dict[str, Any] = {"answer": answer, "expression": text[:-1]}
            if self.args["style"] == "chat":
                text = "What is " + re.sub(r"(?<=[0-9])([-+*])", r" \1 ", text[:-1]) + "?"
                meta["messages"] = [{"role": "user", "content": text}]
            out.append(Prompt(index, text, meta))
        return out

    def score(self, prompt: Prompt, completion: str) -> Score:
        if self.args["style"] == "chat":
            numbers = re.findall(r"-?[0-9]+", completion)
            correct = bool(numbers) and numbers[-1] == str(prompt.meta["answer"])
        else:
            match = re.match(r" *(-?[0-9]+)", completion)
            correct = match is not None and match.group(1) == str(prompt.meta["answer"])
        return Score(1.0 if correct else 0.0, correct)


COUNTDOWN_KNOBS = {
    "numbers": Knob(3, integer_knob(2, 6)),
    "min_number": Knob(1, integer_knob(0, 999)),
    "max_number": Knob(9, integer_knob(0, 999)),
    "min_target": Knob(1, integer_knob()),
    "max_target": Knob(99, integer_knob()),
    "ops": Knob("+-*", operators_knob("+-*/")),
    "use_all": Knob(False, boolean_knob),
    "format_reward": Knob(0.0, fraction_knob(0.0, 1.0)),
    "holdout": Knob(0.0, fraction_knob(0.0, 1.0)),
}
"""``countdown``'s knobs. ``numbers``: how many are given, each drawn from ``[min_number,
max_number]``. ``min_target``/``max_target``: the targets' range. ``ops``: the operators
allowed (``/``: exact division only). ``use_all``: each number exactly once (TinyZero's rule),
else at most once. ``format_reward``: the reward of a valid expression of the wrong value.
``holdout``: the fraction of prompt texts kept for eval only."""


class Countdown(Env):
    """Reach a target with given numbers: ``"3,5,7>15="`` (see the module doc)."""

    name = "countdown"

    def __init__(self, args: list[str]) -> None:
        self.args = k = parse_knobs("countdown", args, COUNTDOWN_KNOBS)
        self.tokenizer = tasks_tokenizer()
        for low, high in (("min_number", "max_number"), ("min_target", "max_target")):
            if k[high] < k[low]:
                raise RewardError(f"env countdown: {high}={k[high]} is below {low}={k[low]}")

    def _instance(self, rng: random.Random) -> tuple[list[int], int, str]:
        """Numbers, and a target built from a random expression over (some of) them."""
        k = self.args
        for _ in range(MAX_DRAWS):
            given = [rng.randint(k["min_number"], k["max_number"]) for _ in range(k["numbers"])]
            used = given if k["use_all"] else rng.sample(given, rng.randint(2, len(given)))
            items = [(Fraction(x), str(x)) for x in used]
            rng.shuffle(items)
            while len(items) > 1:
                (a, a_text), (b, b_text) = items.pop(), items.pop()
                op = rng.choice(k["ops"])
                if op == "/" and (b == 0 or (a / b).denominator != 1):
                    break  # only exact divisions: draw again
                value = {"+": a + b, "-": a - b, "*": a * b, "/": a / b if b else a}[op]
                wrap = [t if t.isdigit() else f"({t})" for t in (a_text, b_text)]
                items.insert(rng.randint(0, len(items)), (value, f"{wrap[0]}{op}{wrap[1]}"))
            if len(items) == 1 and k["min_target"] <= items[0][0] <= k["max_target"]:
                return given, int(items[0][0]), items[0][1]
        raise RewardError(f"env countdown: {MAX_DRAWS} draws reached no target in "
                          f"[{k['min_target']}, {k['max_target']}]")

    def prompts(self, n: int, seed: int, split: str = "train") -> list[Prompt]:
        rng, out, misses = prompt_stream(self.name, split, seed), [], 0
        while len(out) < n:
            given, target, solution = self._instance(rng)
            text = f"{','.join(map(str, given))}>{target}="
            if in_split(text, split, self.args["holdout"]):
                meta = {"numbers": given, "target": target, "solution": solution}
                out.append(Prompt(len(out), text, meta))
                misses = 0
            elif (misses := misses + 1) >= MAX_DRAWS:
                raise RewardError(f"env countdown: {MAX_DRAWS} draws found no {split} prompt "
                                  f"(holdout={self.args['holdout']:g}; change it)")
        return out

    def score(self, prompt: Prompt, completion: str) -> Score:
        # the expression runs to the first character none can hold ('=', '<pad>', ...)
        text = re.match(r"[0-9+\-*/() ]*", completion).group(0)  # type: ignore[union-attr]
        value = evaluate_expression(text, prompt.meta["numbers"], self.args["ops"],
                                    self.args["use_all"])
        if value is None:
            return Score(0.0, False)
        if value == prompt.meta["target"]:
            return Score(1.0, True)
        return Score(self.args["format_reward"], False)
