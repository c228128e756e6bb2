"""GRPO environments (composer.train.rl.envs, .tasks): the shipped tasks tokenizer (byte-identical
regeneration, the same ids as load_tokenizer's, round trips), arith and countdown prompts
(deterministic, prefix-stable, splits, knobs, balanced answers, holdout disjoint), their scoring
of right, wrong and garbage completions, countdown's solvable instances and safe evaluator, a
MODULE:FUNCTION reward over a prompts file, and every one-line error."""

from __future__ import annotations

import builtins
import collections
import itertools
import json
import sys
from pathlib import Path

import pytest

from composer.data.tokenizer import load_tokenizer, save_tokenizer
from composer.train.rl import RewardError, make_env
from composer.train.rl.envs import Prompt
from composer.train.rl.tasks import evaluate_expression
from composer.train.rl.vocab import (
    CHARS,
    EOS,
    PAD,
    TASKS_TOKENIZER,
    tasks_tokenizer,
    write_tokenizer,
)

DEBUG = ["digits=1", "ops=+", "max_answer=9", "balanced=true"]  # the grpo-debug task


def test_the_shipped_tokenizer_regenerates_byte_identically(tmp_path: Path) -> None:
    pytest.importorskip("tokenizers")
    write_tokenizer(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / name).read_bytes() == (TASKS_TOKENIZER / name).read_bytes(), name


def test_the_tasks_tokenizer_is_what_load_tokenizer_reads(tmp_path: Path) -> None:
    pytest.importorskip("tokenizers")
    save_tokenizer(tasks_tokenizer(), tmp_path / "tokenizer")  # as a run saves its tokenizer
    ours, theirs = tasks_tokenizer(), load_tokenizer(str(tmp_path / "tokenizer"))
    assert (ours.vocab_size, ours.eod, ours.pad) == (22, EOS, PAD) == (theirs.vocab_size,
                                                                       theirs.eod, PAD)
    assert theirs.eos_token == ours.eos_token == "<eos>"
    text = "12 + (3*4)=,>5/6-7" + CHARS
    assert ours.encode(text) == theirs.encode(text) == [CHARS.index(c) for c in text]
    assert ours.encode("0123456789") == list(range(10))  # one id per digit, id = digit
    ids = ours.encode("3+4=") + [EOS, PAD, 7]
    assert ours.decode(ids) == theirs.decode(ids) == "3+4=<pad>7"
    assert ours.decode(ours.encode(text)) == text


def test_tasks_tokenizer_refusals() -> None:
    tok = tasks_tokenizer()
    with pytest.raises(ValueError, match=r"^tokenizer composer-builtin-tasks: character 'x' is "
                                         r"not in its vocabulary"):
        tok.encode("3x")
    with pytest.raises(ValueError, match=r"id 22 is out of range \[0, 22\)"):
        tok.decode([1, 22])


def test_arith_prompts_are_deterministic_and_split() -> None:
    env = make_env("arith", DEBUG)
    assert env.tokenizer is not None and env.name == "arith"
    first = env.prompts(50, seed=3)
    assert first == make_env("arith", DEBUG).prompts(50, seed=3)
    assert env.prompts(20, seed=3) == first[:20]  # a prefix of a longer list
    assert [p.index for p in first] == list(range(50))
    assert [p.text for p in env.prompts(50, seed=4)] != [p.text for p in first]
    assert [p.text for p in env.prompts(50, 3, "eval")] != [p.text for p in first]
    for p in first:
        a, b = p.text[:-1].split("+")
        assert p.text.endswith("=") and len(p.text) == 4
        assert p.meta["answer"] == int(a) + int(b) <= 9
    with pytest.raises(ValueError, match="split must be one of"):
        env.prompts(1, 0, "test")


def test_arith_knobs() -> None:
    env = make_env("arith", ["digits=2", "terms=3", "ops=*-", "negative=true"])
    for p in env.prompts(200, 0):
        operands = p.text[:-1].replace("*", " ").replace("-", " ").split()
        assert len(operands) == 3 and all(10 <= int(x) <= 99 for x in operands)
        assert set(p.text) <= set("0123456789*-=")
        assert p.meta["answer"] == eval(p.meta["expression"])  # Python's precedence
    assert min(p.meta["answer"] for p in env.prompts(200, 0)) < 0
    assert min(p.meta["answer"] for p in make_env("arith", ["ops=-"]).prompts(200, 0)) == 0
    bounded = make_env("arith", ["ops=+-", "min_answer=3", "max_answer=5"]).prompts(200, 0)
    assert {p.meta["answer"] for p in bounded} == {3, 4, 5}


def test_balanced_arith_answers_are_uniform() -> None:
    prompts = make_env("arith", DEBUG).prompts(4000, 0)
    counts = collections.Counter(p.meta["answer"] for p in prompts)
    assert sorted(counts) == list(range(10))
    assert all(340 <= c <= 460 for c in counts.values()), counts  # 400 each; sd ~19
    assert max(counts.values()) / 4000 < 0.12  # a constant guess scores ~0.1
    # unbalanced, a+b <= 9 has s+1 expressions of answer s: 9 is ten times as frequent as 0
    plain = collections.Counter(p.meta["answer"] for p in
                                make_env("arith", DEBUG[:3]).prompts(4000, 0))
    assert plain[9] > 5 * plain[0]


def test_holdout_splits_the_prompt_texts() -> None:
    for name, args in (("arith", ["digits=2", "holdout=0.3"]), ("countdown", ["holdout=0.3"])):
        env = make_env(name, args)
        train = {p.text for p in env.prompts(500, 0)}
        held = {p.text for p in env.prompts(200, 0, "eval")}
        assert train and held and not train & held, name
    with pytest.raises(RewardError, match="no eval expression has an answer"):
        make_env("arith", ["ops=+", "max_answer=0", "holdout=0.01"]).prompts(1, 0, "eval")


def test_arith_scoring() -> None:
    env = make_env("arith", ["negative=true", "ops=-"])
    p = Prompt(0, "3+4=", {"answer": 7})
    n = Prompt(1, "2-5=", {"answer": -3})
    cases = [(p, "7", 1.0), (p, " 7", 1.0), (p, "7=", 1.0), (p, "7 8", 1.0), (p, "8", 0.0),
             (p, "07", 0.0), (p, "72", 0.0), (p, "", 0.0), (p, "=7", 0.0), (p, "<pad>", 0.0),
             (p, "-7", 0.0), (n, "-3", 1.0), (n, "3", 0.0), (n, "- 3", 0.0)]
    for prompt, completion, reward in cases:
        score = env.score(prompt, completion)
        assert (score.reward, score.correct) == (reward, reward == 1.0), completion
    right = env.prompts(30, 1)
    assert all(env.score(q, str(q.meta["answer"])).correct for q in right)


def test_countdown_instances_are_solvable() -> None:
    env = make_env("countdown", ["numbers=4", "max_number=12", "ops=+-*/"])
    for p in env.prompts(300, 0):
        numbers, target = p.text[:-1].split(">")
        given = [int(x) for x in numbers.split(",")]
        assert given == p.meta["numbers"] and int(target) == p.meta["target"]
        assert len(given) == 4 and all(1 <= x <= 12 for x in given)
        assert 1 <= p.meta["target"] <= 99
        assert env.score(p, p.meta["solution"]).reward == 1.0, p
        assert evaluate_expression(p.meta["solution"], given) == p.meta["target"]
    every = make_env("countdown", ["use_all=true", "numbers=3"])
    for p in every.prompts(100, 0):
        used = sorted(int(t) for t in p.meta["solution"].replace("(", " ").replace(")", " ")
                      .replace("+", " ").replace("-", " ").replace("*", " ").split())
        assert used == sorted(p.meta["numbers"]) and every.score(p, p.meta["solution"]).correct
    assert env.prompts(40, 2) == make_env("countdown", ["numbers=4", "max_number=12",
                                                        "ops=+-*/"]).prompts(40, 2)


def test_countdown_scoring_and_a_safe_evaluator(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("eval/exec called")

    monkeypatch.setattr(builtins, "eval", refuse)
    monkeypatch.setattr(builtins, "exec", refuse)
    env = make_env("countdown", ["format_reward=0.1"])
    p = Prompt(0, "3,5,7>15=", {"numbers": [3, 5, 7], "target": 15})
    cases = {"3+5+7": 1.0, " (7-5)*3+ 9": 0.0, "7+5+3=15": 1.0, "(7+5)+3<pad>": 1.0,
             "3*5": 1.0, "3*5*7": 0.1, "7-5": 0.1, "3+3+9": 0.0, "15": 0.0, "5*3*1": 0.0,
             "3**5": 0.0, "3//5": 0.0, "-3+18": 0.0, "(3+5": 0.0, "": 0.0, "3 5": 0.0,
             "__import__('os').system('x')": 0.0, "(lambda: 15)()": 0.0, "3+5+7" * 100: 0.0,
             "15.0": 0.0, "0x0f": 0.0, "1_5": 0.0}
    for completion, reward in cases.items():
        score = env.score(p, completion)
        assert (score.reward, score.correct) == (reward, reward == 1.0), completion
    # the evaluator alone: names, calls, attributes, powers are refused without running them
    for text in ("__import__('os')", "open('x')", "(1).real", "2**3", "[1]", "1 if 1 else 2",
                 "7/0", "3*" * 200 + "3"):
        assert evaluate_expression(text, [1, 2, 3, 7, 0] * 100) is None, text
    assert evaluate_expression("7/2", [7, 2]) == 3.5
    assert evaluate_expression("7/2", [7, 2], ops="+-*") is None
    assert evaluate_expression("3+5", [3, 5, 7], use_all=True) is None


MODULES = itertools.count()


def write_module(folder: Path, body: str) -> str:
    """A reward module under a fresh name (imports are cached by name)."""
    name = f"rl_reward_{next(MODULES)}"
    (folder / f"{name}.py").write_text(body)
    return name


@pytest.fixture
def rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.syspath_prepend(str(tmp_path))
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"say {i}", "want": str(i)}) + "\n"
                            + ("\n" if i == 2 else "") for i in range(5)))
    return path


def test_a_reward_function_over_a_prompts_file(tmp_path: Path, rows: Path) -> None:
    module = write_module(tmp_path, "def reward(prompt, completion, meta):\n"
                                    "    meta['seen'] = True\n"
                                    "    return float(completion == meta['want'])\n")
    env = make_env(f"{module}:reward", [f"prompts={rows}"])
    assert env.tokenizer is None and env.eval_size == 5
    train = env.prompts(12, seed=0)
    texts = [p.text for p in train]
    assert sorted(texts[:5]) == sorted(texts[5:10]) == [f"say {i}" for i in range(5)]
    assert train == env.prompts(12, seed=0) and texts != [p.text for p in env.prompts(12, 1)]
    assert [p.text for p in env.prompts(7, 0, "eval")] == [f"say {i % 5}" for i in range(7)]
    p = env.prompts(1, 0, "eval")[0]
    assert (p.meta, p.source) == ({"want": "0"}, f"{rows}:1")
    assert env.score(p, "0").reward == 1.0 and env.score(p, "1").reward == 0.0
    assert env.score(p, "0").correct is None and "seen" not in p.meta  # meta is a copy
    assert env.prompts(5, 0, "eval")[3].source == f"{rows}:5"  # the blank line counted
    held = tmp_path / "held.jsonl"
    held.write_text('{"prompt": "held", "want": "9"}\n')
    env = make_env(f"{module}:reward", [f"prompts={rows}", f"eval_prompts={held}"])
    assert [p.text for p in env.prompts(2, 0, "eval")] == ["held", "held"]


def one_line_error(name: str, args: list[str], pattern: str) -> None:
    with pytest.raises(RewardError, match=pattern) as info:
        make_env(name, args)
    assert "\n" not in str(info.value)


def test_env_and_knob_errors() -> None:
    one_line_error("math", [], r"^unknown env 'math' \(built-in: arith, countdown; or "
                               r"MODULE:FUNCTION")
    one_line_error("arith", ["digit=2"], r"^env arith: unknown --env-arg 'digit' \(valid: "
                   r"digits, ops, terms, min_answer, max_answer, balanced, negative, holdout, "
                   r"style\)$")
    one_line_error("countdown", ["target=3"], r"^env countdown: unknown --env-arg 'target' "
                   r"\(valid: numbers, min_number, max_number, min_target, max_target, ops, ")
    one_line_error("arith", ["digits"], r"^env arith: --env-arg 'digits' is not KEY=VALUE$")
    one_line_error("arith", ["digits=1", "digits=2"], r"^env arith: --env-arg digits is given "
                                                      r"twice$")
    bad = {"digits=x": r"digits=x: expected an integer in \[1, 6\]$",
           "digits=7": r"digits=7: expected an integer in \[1, 6\]$",
           "ops=/": r"ops=/: expected some of '\+-\*', each at most once$",
           "ops=++": r"ops=\+\+: expected some of",
           "balanced=maybe": r"balanced=maybe: expected true or false$",
           "max_answer=ten": r"max_answer=ten: expected an integer or none$",
           "holdout=1": r"holdout=1: expected a number in \[0, 1\)$",
           "style=fancy": r"style=fancy: expected one of plain, chat$"}
    for arg, pattern in bad.items():
        one_line_error("arith", [arg], r"^env arith: --env-arg " + pattern)
    one_line_error("arith", ["min_answer=-2"], r"^env arith: min_answer=-2 needs negative=true$")
    one_line_error("arith", ["min_answer=5", "max_answer=4"], r"max_answer=4 is below "
                                                               r"min_answer=5$")
    one_line_error("arith", ["digits=3", "terms=3", "ops=+-*", "balanced=true"],
                   r"^env arith: balanced=true enumerates the expressions, at most 200000 "
                   r"\(digits=3, terms=3, ops=\+-\* make 6561000000\)")
    one_line_error("arith", ["ops=-", "max_answer=-1", "negative=false"], r"no expression has "
                   r"an answer in \[0, -1\]|max_answer=-1 is below min_answer=0")
    one_line_error("countdown", ["min_number=5", "max_number=3"], r"max_number=3 is below "
                                                                   r"min_number=5$")
    one_line_error("countdown", ["format_reward=1.5"], r"format_reward=1.5: expected a number")
    env = make_env("countdown", ["numbers=2", "max_number=1", "min_target=50"])
    with pytest.raises(RewardError, match=r"^env countdown: 10000 draws reached no target in "
                                          r"\[50, 99\]$"):
        env.prompts(1, 0)


def test_prompts_file_errors(tmp_path: Path, rows: Path) -> None:
    module = write_module(tmp_path, "def reward(prompt, completion, meta):\n    return 1.0\n")
    spec = f"{module}:reward"
    one_line_error(spec, [], rf"^env {spec}: needs --env-arg prompts=FILE.jsonl")
    one_line_error(spec, ["prompts=/nonexistent.jsonl"],
                   r"^prompts file /nonexistent.jsonl: cannot read it \(FileNotFoundError")
    cases = [('{"prompt": "a"}\n{"text": "b"}\n', ':2: the row has no "prompt" field$'),
             ('{"prompt": "a"}\n\n{"prompt": 3}\n', ':3: "prompt" must be a string, not int$'),
             ('["a"]\n', r":1: a row must be a JSON object, not list$"),
             ('{"prompt": "a"}\n{"prompt": \n', r":2: not a JSON row \(Expecting value"),
             ("\n \n", r": no rows$")]
    for i, (text, pattern) in enumerate(cases):
        path = tmp_path / f"bad{i}.jsonl"
        path.write_text(text)
        where = f"prompts file {path}" if pattern == r": no rows$" else str(path)
        one_line_error(spec, [f"prompts={path}"], "^" + where + pattern)
    one_line_error("no_such_module_xyz:f", [f"prompts={rows}"], r"^env no_such_module_xyz:f: "
                   r"cannot import no_such_module_xyz \(ModuleNotFoundError: No module named")
    one_line_error(f"{module}:nope", [f"prompts={rows}"], rf"^env {module}:nope: {module} has "
                                                          r"no nope$")
    (tmp_path / "rl_not_fn.py").write_text("value = 3\n")
    one_line_error("rl_not_fn:value", [f"prompts={rows}"], r"value is a int, not a function$")
    one_line_error(spec, [f"prompts={rows}", "seed=3"], rf"^env {spec}: unknown --env-arg "
                                                        r"'seed' \(valid: prompts, eval_prompts\)$")


@pytest.mark.parametrize("body,pattern", [
    ("raise ValueError('bad completion\\nsecond line')",
     r"raised on prompt 3: ValueError: bad completion \(row {rows}:5\)$"),
    ("return 'high'", r"returned str 'high' on prompt 3, not a finite number \(row {rows}:5\)$"),
    ("return True", r"returned bool True on prompt 3, not a finite number"),
    ("return None", r"returned NoneType None on prompt 3, not a finite number"),
    ("return float('nan')", r"returned float nan on prompt 3, not a finite number"),
    ("return -float('inf')", r"returned float -inf on prompt 3, not a finite number"),
])
def test_reward_function_failures_name_the_prompt(tmp_path: Path, rows: Path, body: str,
                                                  pattern: str) -> None:
    module = write_module(tmp_path, f"def reward(prompt, completion, meta):\n    {body}\n")
    env = make_env(f"{module}:reward", [f"prompts={rows}"])
    prompt = env.prompts(4, 0, "eval")[3]
    with pytest.raises(RewardError, match=rf"^reward function {module}:reward "
                                          + pattern.format(rows=rows)) as info:
        env.score(prompt, "x")
    assert "\n" not in str(info.value)


def test_a_module_in_the_working_directory_is_found(tmp_path: Path, rows: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    here = tmp_path / "cwd"
    here.mkdir()
    (here / "rl_cwd_reward.py").write_text("def score(p, c, m):\n    return 0.5\n")
    monkeypatch.chdir(here)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(here))])
    env = make_env("rl_cwd_reward:score", [f"prompts={rows}"])
    assert env.score(env.prompts(1, 0)[0], "").reward == 0.5
    assert sys.path[-1] == str(here)
