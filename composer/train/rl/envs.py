"""GRPO environments: the prompts to sample completions for, and a reward for each completion.

``--env`` names one (:func:`make_env`):

- ``arith``: integer arithmetic, ``"3+4="`` answered ``"7"``. The completion is read up to the
  first character that cannot continue the answer (leading spaces skipped); reward 1.0 when
  that is exactly the answer's decimal text (``"07"`` is not ``"7"``), else 0.0. Operators
  bind as in Python (``*`` before ``+``/``-``).
- ``countdown``: reach a target with given numbers, ``"3,5,7>15="`` (the numbers, comma
  separated, ``>`` the target, ``=`` where the answer starts) answered by an expression such as
  ``"3+5+7"`` or ``"(7-5)*3+9"`` that uses each given number at most once (exactly once with
  ``use_all=true``), the allowed operators and parentheses. It is checked by the safe
  evaluator :func:`composer.train.rl.tasks.evaluate_expression` (``ast``, never ``eval``):
  reward 1.0 when it equals the target, ``format_reward`` when it is a valid expression of
  another value, 0.0 otherwise. Every instance is solvable: its target is the value of a random
  expression over its numbers (``meta["solution"]``).
- ``MODULE:FUNCTION``: a Python callable ``(prompt: str, completion: str, meta: dict) -> float``
  (importable, or a module in the working directory), with prompts from ``--env-arg
  prompts=FILE.jsonl``: one JSON object a line, ``{"prompt": str, ...}``, its other keys the
  ``meta`` the function receives. Such an env has no tokenizer (``tokenizer`` is None: the
  caller uses the model's) and no notion of correctness (``Score.correct`` is None).

Knobs are ``--env-arg KEY=VALUE`` strings, parsed and validated here (:data:`ARITH_KNOBS`,
:data:`COUNTDOWN_KNOBS`); every error is one line (:class:`RewardError`).

Prompts are deterministic in ``(n, seed, split)`` and a prefix of a longer list: each split
draws from its own seeded stream (``random.Random`` on a string, stable across runs and
Python's hash seed), so ``eval`` is an independent sample from the task's distribution. With
``holdout=F`` the built-in tasks also split the prompt texts themselves: a stable hash sends a
fraction F of them to ``eval`` only, so eval accuracy measures prompts never trained on.
"""

from __future__ import annotations

import importlib
import json
import math
import numbers
import os
import random
import sys
import zlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from composer.train.rl.vocab import TasksTokenizer

SPLITS = ("train", "eval")


class RewardError(ValueError):
    """A one-line error of an environment: its name or knobs, a prompts file, a reward
    function's failure (naming the prompt's index)."""


@dataclass(frozen=True)
class Prompt:
    index: int
    """Its position in the list :meth:`Env.prompts` returned."""
    text: str
    meta: dict[str, Any] = field(default_factory=dict)
    """What scoring needs (the answer, the numbers, a prompts row's other keys)."""
    source: str = ""
    """Where it came from (``FILE:LINE`` of a prompts file); empty for generated tasks."""


@dataclass(frozen=True)
class Score:
    reward: float
    correct: bool | None
    """Whether the answer is right (built-in tasks); None where the env cannot tell."""


class Env(ABC):
    """An environment: ``prompts`` to complete and ``score`` for each completion (each
    environment implements both: :class:`~composer.train.rl.tasks.Arith`,
    :class:`~composer.train.rl.tasks.Countdown`, :class:`RewardFunction`)."""

    name: str
    tokenizer: TasksTokenizer | None
    """The tokenizer prompts and completions are written in; None: the model's."""
    args: dict[str, Any]
    """The knobs, parsed (defaults filled in)."""
    eval_size: int | None = None
    """How many distinct eval prompts there are (a prompts file's rows); None: unlimited."""

    @abstractmethod
    def prompts(self, n: int, seed: int, split: str = "train") -> list[Prompt]:
        """``n`` prompts of ``split`` (``train`` or ``eval``), deterministic in
        ``(n, seed, split)``; a shorter list is a prefix of a longer one."""

    @abstractmethod
    def score(self, prompt: Prompt, completion: str) -> Score:
        """The reward of ``completion`` (the decoded text, without its eos) for ``prompt``."""


@dataclass(frozen=True)
class Knob:
    default: Any
    parse: Callable[[str], Any]
    """The value of the text; raises ValueError saying what it expected."""


def integer_knob(lo: int | None = None, hi: int | None = None,
             optional: bool = False) -> Callable[[str], int | None]:
    bounds = (f" >= {lo}" if hi is None else f" in [{lo}, {hi}]") if lo is not None else ""

    def parse(text: str) -> int | None:
        if optional and text.lower() in ("none", ""):
            return None
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or (lo is not None and value < lo) or (hi is not None and value > hi):
            raise ValueError(f"expected an integer{bounds}" + (" or none" if optional else ""))
        return value

    return parse


def fraction_knob(lo: float, hi: float) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not lo <= value < hi:
            raise ValueError(f"expected a number in [{lo:g}, {hi:g})")
        return value

    return parse


def boolean_knob(text: str) -> bool:
    if text.lower() in ("true", "1", "yes", "on"):
        return True
    if text.lower() in ("false", "0", "no", "off"):
        return False
    raise ValueError("expected true or false")


def operators_knob(allowed: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if not text or any(c not in allowed for c in text) or len(set(text)) != len(text):
            raise ValueError(f"expected some of {allowed!r}, each at most once")
        return "".join(c for c in allowed if c in text)  # one canonical order

    return parse


def choice_knob(*choices: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in choices:
            raise ValueError(f"expected one of {', '.join(choices)}")
        return text
    return parse


def path_knob(text: str) -> str:
    if not text:
        raise ValueError("expected a file name")
    return text


def parse_knobs(env: str, args: list[str], knobs: dict[str, Knob]) -> dict[str, Any]:
    """``KEY=VALUE`` strings as a dict over every knob (the defaults filled in)."""
    values: dict[str, Any] = {}
    for arg in args:
        key, sep, text = arg.partition("=")
        key = key.strip()
        if not sep or not key:
            raise RewardError(f"env {env}: --env-arg {arg!r} is not KEY=VALUE")
        if key not in knobs:
            raise RewardError(f"env {env}: unknown --env-arg {key!r} "
                              f"(valid: {', '.join(knobs)})")
        if key in values:
            raise RewardError(f"env {env}: --env-arg {key} is given twice")
        try:
            values[key] = knobs[key].parse(text.strip())
        except ValueError as e:
            raise RewardError(f"env {env}: --env-arg {key}={text}: {e}") from None
    return {key: values.get(key, knob.default) for key, knob in knobs.items()}


def prompt_stream(name: str, split: str, seed: int) -> random.Random:
    """The seeded stream of one split (a string seed: stable across runs and hash seeds)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, not {split!r}")
    return random.Random(f"composer.rl/{name}/{split}/{int(seed)}")


def in_split(text: str, split: str, holdout: float) -> bool:
    """With ``holdout`` > 0 a stable hash of the prompt text sends that fraction of all texts
    to ``eval`` and the rest to ``train``; with 0 every text is in both."""
    if holdout == 0:
        return True
    return (zlib.crc32(text.encode()) % 10_000 < round(holdout * 10_000)) == (split == "eval")


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def _import_function(spec: str) -> Callable[..., Any]:
    """``MODULE:FUNCTION`` (``FUNCTION`` may be dotted, ``Class.method``) imported. A module
    not found is looked for in the working directory too: ``composer`` is a console script,
    whose ``sys.path`` does not hold it (it is appended, so it shadows no installed module)."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise RewardError(f"unknown env {spec!r} (a reward function is MODULE:FUNCTION)")
    try:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name != module_name.split(".")[0] or os.getcwd() in sys.path:
                raise
            sys.path.append(os.getcwd())
            module = importlib.import_module(module_name)
    except Exception as e:
        raise RewardError(f"env {spec}: cannot import {module_name} ({_one_line(e)})") from e
    fn: Any = module
    for part in attr.split("."):
        if not hasattr(fn, part):
            raise RewardError(f"env {spec}: {module_name} has no {attr}")
        fn = getattr(fn, part)
    if not callable(fn):
        raise RewardError(f"env {spec}: {attr} is a {type(fn).__name__}, not a function")
    return fn


def read_prompts(path: str) -> list[Prompt]:
    """The rows of a prompts file, one JSON object a line (blank lines skipped): its
    ``"prompt"`` the text, its other keys the meta; ``index`` is the row's position."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise RewardError(f"prompts file {path}: cannot read it ({_one_line(e)})") from None
    rows: list[Prompt] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            row = json.loads(line)
        except ValueError as e:
            raise RewardError(f"{where}: not a JSON row ({e})") from None
        if not isinstance(row, dict):
            raise RewardError(f"{where}: a row must be a JSON object, not {type(row).__name__}")
        if "prompt" not in row:
            raise RewardError(f'{where}: the row has no "prompt" field')
        if not isinstance(row["prompt"], str):
            raise RewardError(f'{where}: "prompt" must be a string, not '
                              f"{type(row['prompt']).__name__}")
        meta = {key: value for key, value in row.items() if key != "prompt"}
        rows.append(Prompt(len(rows), row["prompt"], meta, where))
    if not rows:
        raise RewardError(f"prompts file {path}: no rows")
    return rows


FUNCTION_KNOBS = {
    "prompts": Knob(None, path_knob),        # FILE.jsonl: the training prompts (required)
    "eval_prompts": Knob(None, path_knob),   # FILE.jsonl: the eval prompts (default: prompts')
}


class RewardFunction(Env):
    """``MODULE:FUNCTION``: a Python reward ``(prompt, completion, meta) -> float`` over the
    rows of a prompts file. Training prompts cycle through the rows, each pass in its own
    seeded order; eval prompts are the eval file's rows in order (cycled past its end)."""

    tokenizer = None

    def __init__(self, spec: str, args: list[str]) -> None:
        self.name = spec
        self.args = k = parse_knobs(spec, args, FUNCTION_KNOBS)
        if k["prompts"] is None:
            raise RewardError(f"env {spec}: needs --env-arg prompts=FILE.jsonl "
                              '(one {"prompt": ...} a line)')
        self.fn = _import_function(spec)
        self._rows = {"train": read_prompts(k["prompts"])}
        self._rows["eval"] = (read_prompts(k["eval_prompts"]) if k["eval_prompts"]
                              else self._rows["train"])
        self.eval_size = len(self._rows["eval"])

    def prompts(self, n: int, seed: int, split: str = "train") -> list[Prompt]:
        rng, rows = prompt_stream(self.name, split, seed), self._rows.get(split, [])
        order: list[int] = []
        while len(order) < n:
            one_pass = list(range(len(rows)))
            if split == "train":
                rng.shuffle(one_pass)
            order += one_pass
        return [Prompt(i, rows[r].text, dict(rows[r].meta), rows[r].source)
                for i, r in enumerate(order[:n])]

    def score(self, prompt: Prompt, completion: str) -> Score:
        where = f"prompt {prompt.index}"
        try:
            value = self.fn(prompt.text, completion, dict(prompt.meta))
        except Exception as e:
            raise RewardError(f"reward function {self.name} raised on {where}: {_one_line(e)} "
                              f"(row {prompt.source})") from e
        if isinstance(value, bool) or not isinstance(value, numbers.Real) \
                or not math.isfinite(float(value)):
            shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
            raise RewardError(f"reward function {self.name} returned {type(value).__name__} "
                              f"{shown} on {where}, not a finite number (row {prompt.source})")
        return Score(float(value), None)


BUILTIN_ENVS = ("arith", "countdown")


def make_env(name: str, args: list[str] | None = None) -> Env:
    """The env ``--env NAME`` with its ``--env-arg KEY=VALUE`` knobs: a built-in task
    (:data:`BUILTIN_ENVS`) or ``MODULE:FUNCTION``."""
    from composer.train.rl import tasks  # tasks builds on this module

    args = list(args or [])
    if name == "arith":
        return tasks.Arith(args)
    if name == "countdown":
        return tasks.Countdown(args)
    if ":" in name:
        return RewardFunction(name, args)
    raise RewardError(f"unknown env {name!r} (built-in: {', '.join(BUILTIN_ENVS)}; or "
                      "MODULE:FUNCTION, a Python callable (prompt, completion, meta) -> float)")
