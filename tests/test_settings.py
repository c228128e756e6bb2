"""The typed-settings engine (composer.settings): coercion, plain round trips, dotted overrides
with nearest-key errors, help and choices in field metadata, flags made from fields; and the
recipe that nests the parallel layout through it."""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
from dataclasses import dataclass
from typing import Literal

import pytest
import yaml

from composer import settings
from composer.settings import ConfigError, setting


@dataclass
class Inner:
    width: int = setting(4, "inner width")
    scale: float | None = setting(None, "optional scale")


@dataclass
class Outer:
    name: str = setting("x", "a name")
    mode: Literal["fast", "slow"] = setting("fast", "how to run")
    steps: int | None = setting(None, "steps to take")
    on: bool = setting(False, "switch it on")
    keep: bool = setting(True, "turn keeping off")
    pair: tuple[float, float] = setting((0.0, 1.0), "a range")
    tags: list[str] = setting(factory=list, help="tags", action="append", metavar="TAG")
    inner: Inner = setting(factory=Inner, title="inner things", help="the inner part")
    maybe: Inner | None = setting(None, cli=False)


@pytest.mark.parametrize("value, tp, expected", [
    (3, int, 3), (1e6, int, 1000000), ("1e6", int, 1000000), (2, float, 2.0),
    ("3e-4", float, 3e-4), (True, bool, True), ("fast", Literal["fast", "slow"], "fast"),
    (None, int | None, None), ([1, 2], tuple[float, float], (1.0, 2.0)),
    ([1, 2, 3], tuple[int, ...], (1, 2, 3)), (["a"], list[str], ["a"]),
    ({"width": 8}, Inner, Inner(width=8)),
])
def test_coerce_accepts_lossless_values(value, tp, expected):
    assert settings.coerce(value, tp, "k") == expected


@pytest.mark.parametrize("value, tp, message", [
    ("abc", int, "k expects int, got 'abc'"), (1.5, int, "k expects int, got 1.5"),
    (True, int, "k expects int, got True"), (3, bool, "k expects bool, got 3"),
    ("medium", Literal["fast", "slow"], "k must be one of fast, slow; got 'medium'"),
    (3, tuple[float, float], "k expects a list of 2 numbers, got 3"),
    ("a", list[str], "k expects a list, got 'a'"),
    ({"widht": 8}, Inner, "unknown config key 'k.widht'; did you mean 'k.width'?"),
])
def test_coerce_refuses_with_one_line(value, tp, message):
    with pytest.raises(ConfigError) as info:
        settings.coerce(value, tp, "k")
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


def test_plain_round_trip_and_overrides():
    out = settings.from_plain(Outer, {"mode": "slow", "pair": [1, 2], "inner": {"width": 2}})
    assert out == Outer(mode="slow", pair=(1.0, 2.0), inner=Inner(width=2))
    plain = settings.to_plain(out)
    assert plain["pair"] == [1.0, 2.0] and plain["inner"] == {"width": 2, "scale": None}
    assert settings.from_plain(Outer, yaml.safe_load(yaml.safe_dump(plain))) == out
    settings.apply_overrides(out, ["inner.scale=0.5", "steps=null", "maybe.width=3", "on=true"])
    assert out.inner.scale == 0.5 and out.steps is None and out.on is True
    assert out.maybe == Inner(width=3)  # a nested setting that is None starts from its defaults


def test_override_errors_name_the_nearest_key():
    with pytest.raises(ConfigError, match=r"unknown config key 'inner.widht'; did you mean "
                                          r"'inner.width'\? \(valid: width, scale\)"):
        settings.apply_overrides(Outer(), ["inner.widht=3"])
    with pytest.raises(ConfigError, match="override 'mode' must look like key=value"):
        settings.apply_overrides(Outer(), ["mode"])
    with pytest.raises(ConfigError, match="name is not a section; set it as name=VALUE"):
        settings.set_field(Outer(), "name.x", 1)


def test_check_catches_values_set_in_code():
    bad = Outer()
    bad.mode = "medium"
    with pytest.raises(ConfigError, match="mode must be one of fast, slow"):
        settings.check(bad)
    assert settings.check(Outer()) == Outer()


def _parser(defaults: bool = False) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    settings.add_flags(p, Outer, defaults=defaults)
    return p


def test_flags_are_made_from_fields():
    p = _parser()
    flags = {a.dest: a for a in p._actions if a.dest != "help"}
    assert set(flags) == {"name", "mode", "steps", "on", "keep", "pair", "tags", "width",
                          "scale"}  # `maybe` has cli=False; `inner`'s fields are flat
    assert flags["mode"].choices == ("fast", "slow") and flags["mode"].help == "how to run"
    assert flags["keep"].option_strings == ["--no-keep"]  # a bool that defaults to True
    assert flags["tags"].metavar == "TAG"
    assert "inner things" in p.format_help() and "the inner part" in p.format_help()
    args = p.parse_args(["--mode", "slow", "--steps", "1e3", "--on", "--no-keep", "--width", "2",
                         "--tags", "a", "--tags", "b"])
    assert vars(args) == {"mode": "slow", "steps": 1000, "on": True, "keep": False,
                          "width": 2, "tags": ["a", "b"]}  # only the flags given
    assert vars(_parser(defaults=True).parse_args([]))["width"] == 4


def test_flag_values_are_coerced_by_the_engine(capsys):
    with pytest.raises(SystemExit):
        _parser().parse_args(["--steps", "x"])
    assert "argument --steps: invalid int value: 'x'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _parser().parse_args(["--mode", "medium"])
    assert "invalid choice: 'medium'" in capsys.readouterr().err


# ---------------------------------------------------------------- the recipe


def test_recipe_nests_the_layout_and_reads_flat_keys():
    from composer.parallel.layout import ParallelConfig
    from composer.train.recipe import Recipe, merge

    r = merge(Recipe(), {"parallel": {"tp": 2, "cp-adaptive": True}, "ep": 2, "lr": "1e-3"}, "x")
    assert r.parallel == ParallelConfig(tp=2, ep=2, cp_adaptive=True) and r.lr == 1e-3
    assert Recipe().parallel == ParallelConfig()  # merge copies, never shares
    assert r.to_dict()["parallel"]["tp"] == 2 and "tp" not in r.to_dict()
    again = merge(Recipe(), yaml.safe_load(yaml.safe_dump(r.to_dict())), "saved")
    assert again == r


@pytest.mark.parametrize("values, message", [
    ({"learning_rate": 1}, "x: unknown recipe key 'learning_rate'"),
    ({"parallel": {"tpp": 2}}, "x: unknown config key 'parallel.tpp'; did you mean "
                               "'parallel.tp'?"),
    ({"tp": "two"}, "x: parallel.tp expects int, got 'two'"),
    ({"ac": "some"}, "x: parallel.ac must be one of none, full, selective; got 'some'"),
    ({"schedule": "step"}, "x: schedule must be one of constant, cosine, linear, wsd"),
    ({"parallel": 2}, "x: parallel must be a mapping of layout keys"),
])
def test_recipe_errors(values, message):
    from composer.train.recipe import Recipe, merge

    with pytest.raises(ConfigError) as info:
        merge(Recipe(), values, "x")
    assert str(info.value).startswith(message)


def test_every_recipe_and_layout_field_has_a_flag_with_help():
    from composer.parallel.layout import ParallelConfig
    from composer.train.recipe import Recipe, add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    by_dest = {a.dest: a for a in p._actions}
    for cls in (Recipe, ParallelConfig):
        for f in dataclasses.fields(cls):
            if f.metadata.get("cli") is False or f.name == "parallel":
                continue
            assert f.name in by_dest and by_dest[f.name].help == f.metadata["help"], f.name
    assert by_dest["sequence_parallel"].option_strings == ["--no-sequence-parallel"]
    assert by_dest["global_batch_size"].option_strings == ["--global-batch-size", "--batch-size"]


def test_shipped_recipes_read():
    from composer.train.recipe import Recipe, merge, read_recipe, recipe_path, shipped_recipes

    for name in shipped_recipes():
        merge(Recipe(), read_recipe(recipe_path(name)), name)
    assert merge(Recipe(), read_recipe(recipe_path("qwen3-30b-a3b")), "q").parallel.ep == 8


def test_settings_and_layout_import_no_torch():
    code = ("import sys, composer.settings, composer.parallel.layout, composer.train.recipe; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


def test_a_flag_value_none_stays_a_string():
    from composer.train.recipe import Recipe, merge

    assert merge(Recipe(), {"save": "none"}, "command line").save == "none"
    assert merge(Recipe(), {"save": None}, "saved").save is None
