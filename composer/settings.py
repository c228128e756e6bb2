"""Typed settings: dataclasses read from plain data (YAML), written back, and set by dotted
``key=value`` overrides, with one coercion rule for all three.

A setting is a dataclass field, declared once: its annotation is its type (bool, int, float, str,
``Literal`` choices, ``X | None``, tuples, nested dataclasses) and ``field(metadata=...)`` carries
its help text (``help(...)``). The model config (:mod:`composer.config`), the training recipe and
the parallel layout all use this engine, so YAML, ``--set`` and command-line flags accept and
refuse the same values with the same one-line :class:`ConfigError`. Unknown keys are refused with
the nearest valid key (:func:`composer.suggest.closest`).

A dataclass whose keys are not just its fields (the model config's registered sections) says so
once with :func:`customize`. This module imports no torch: the CLI reads it before anything heavy.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import yaml

from composer.suggest import closest


class ConfigError(ValueError):
    """An invalid configuration value or override; the message is one line."""


def help(text: str, **extra: Any) -> dict[str, Any]:  # noqa: A001 - reads as field(metadata=help(...))
    """Field metadata with help text: ``tp: int = field(default=1, metadata=help("..."))``.
    ``extra`` may give ``flag`` (the flag's name, default ``--kebab-case`` of the field),
    ``metavar``, ``aliases`` (other YAML keys read as this one) or ``cli=False``."""
    return {"help": text, **extra}


@dataclass(frozen=True)
class Custom:
    """How one dataclass departs from "one key per field" (see :func:`customize`)."""

    keys: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    """The field hints -> the keys it takes and their types."""
    build: Callable[[dict[str, Any]], Any] | None = None
    """Coerced keyword values -> the instance."""
    plain: Callable[[Any], dict[str, Any]] | None = None
    """The instance -> its plain mapping."""
    child: Callable[[Any, str], Any] | None = None
    """A fresh value for the sub-setting ``name`` that is None (by ``set_field``; None refuses
    it). Without this hook: the annotation's dataclass with its defaults."""
    assign: Callable[[Any, str, Any], None] | None = None
    """Stores one coerced value; None: ``setattr``."""


_CUSTOM: dict[type, Custom] = {}


def customize(cls: type, **hooks: Any) -> None:
    """Give ``cls`` the :class:`Custom` hooks ``hooks`` (keys, build, plain, child, assign)."""
    _CUSTOM[cls] = Custom(**hooks)


# ---------------------------------------------------------------- types


def hints(cls: type) -> dict[str, Any]:
    """The keys a settings dataclass takes, with their resolved annotations."""
    out = typing.get_type_hints(cls)
    custom = _CUSTOM.get(cls)
    return custom.keys(out) if custom and custom.keys else out


def type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp).replace("typing.", ""))


def subconfig(tp: Any) -> type | None:
    """The dataclass a field annotated ``tp`` (e.g. ``YarnScaling | None``) holds, if any."""
    if dataclasses.is_dataclass(tp):
        return tp
    return next((a for a in typing.get_args(tp) if dataclasses.is_dataclass(a)), None)


def literals(tp: Any) -> set:
    """Every ``Literal`` choice inside the annotation ``tp``."""
    if typing.get_origin(tp) is Literal:
        return set(typing.get_args(tp))
    return set().union(*(literals(a) for a in typing.get_args(tp))) if typing.get_args(tp) \
        else set()


def choices(tp: Any) -> tuple | None:
    """The choices of a ``Literal[...]`` (or ``Literal[...] | None``) annotation, in order."""
    if typing.get_origin(tp) is Literal:
        return typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        found = [choices(a) for a in typing.get_args(tp) if a is not type(None)]
        return found[0] if len(found) == 1 else None
    return None


def coerce(value: Any, tp: Any, name: str) -> Any:
    """Check ``value`` against the annotation ``tp``; convert where lossless (int -> float)."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return coerce(value, arg, name)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if errors else f"{name} cannot be {value!r}")
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{name} must be one of {', '.join(map(str, args))}; got {value!r}")
        return value
    if origin is tuple:
        return _coerce_tuple(value, args, name)
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        return from_plain(tp, value, f"{name}.")
    return _coerce_scalar(value, tp, name)


def _coerce_tuple(value: Any, args: tuple, name: str) -> tuple:
    if len(args) == 2 and args[1] is Ellipsis:  # tuple[int, ...]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{name} expects a list, got {value!r}")
        return tuple(coerce(v, args[0], f"{name}[{i}]") for i, v in enumerate(value))
    if not isinstance(value, (list, tuple)) or len(value) != len(args):
        raise ConfigError(f"{name} expects a list of {len(args)} numbers, got {value!r}")
    pairs = enumerate(zip(value, args, strict=True))
    return tuple(coerce(v, a, f"{name}[{i}]") for i, (v, a) in pairs)


def _coerce_scalar(value: Any, tp: Any, name: str) -> Any:
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "1e-6" and "inf" as strings
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
    elif tp is Any:
        return value
    raise ConfigError(f"{name} expects {type_name(tp)}, got {value!r}")


# ---------------------------------------------------------------- plain <-> dataclass


def unknown(key: str, valid: list[str], where: str) -> ConfigError:
    """The error for an unknown key, naming the nearest valid one."""
    close = closest(key, valid)
    hint = f"; did you mean '{where}{close}'?" if close else ""
    return ConfigError(f"unknown config key '{where}{key}'{hint} (valid: {', '.join(valid)})")


def from_plain(cls: type, data: Any, where: str = "") -> Any:
    """A ``cls`` from a plain mapping (parsed YAML), every value coerced to its field's type."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where.rstrip('.') or 'config'} must be a mapping, got {data!r}")
    keys = hints(cls)
    kwargs = {}
    for key, value in data.items():
        if key not in keys:
            raise unknown(str(key), list(keys), where)
        kwargs[key] = coerce(value, keys[key], f"{where}{key}")
    custom = _CUSTOM.get(cls)
    return custom.build(kwargs) if custom and custom.build else cls(**kwargs)


def to_plain(obj: Any) -> Any:
    """The plain (YAML-ready) form of a settings dataclass or value; tuples become lists."""
    custom = _CUSTOM.get(type(obj))
    if custom and custom.plain:
        return custom.plain(obj)
    if dataclasses.is_dataclass(obj):
        return {f.name: to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, tuple):
        return [to_plain(v) for v in obj]
    return obj


# ---------------------------------------------------------------- overrides


def parse_override(item: str, example: str = "d_model=512") -> tuple[str, Any]:
    """``key=value`` -> (key, value parsed as YAML; the raw text if it does not parse)."""
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"override {item!r} must look like key=value, e.g. {example}")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key, value


def apply_overrides(obj: Any, overrides: list[str], example: str = "d_model=512") -> Any:
    """Apply ``key=value`` strings (dotted keys reach nested settings) to ``obj``; returns it."""
    for item in overrides:
        set_field(obj, *parse_override(item, example))
    return obj


def set_field(obj: Any, dotted: str, value: Any) -> None:
    """Set one dotted field with type checking; a nested setting that is None is created first
    (with its defaults) so that ``rope_scaling.factor=4`` works from nothing."""
    target = obj
    parts = dotted.split(".")
    where = ""
    for part in parts[:-1]:
        keys = hints(type(target))
        if part not in keys:
            raise unknown(part, list(keys), where)
        child = getattr(target, part)
        if not dataclasses.is_dataclass(child):
            child = _fresh_child(target, part, keys[part])
            if child is None:
                raise ConfigError(f"{where}{part} is not a section; set it as {where}{part}=VALUE")
            _assign(target, part, child)
        target = child
        where += part + "."
    leaf = parts[-1]
    keys = hints(type(target))
    if leaf not in keys:
        raise unknown(leaf, list(keys), where)
    if isinstance(value, str) and keys[leaf] is not str and value.lower() in ("none", "null") \
            and value not in literals(keys[leaf]):  # position=none is a choice, not null
        value = None
    _assign(target, leaf, coerce(value, keys[leaf], where + leaf))


def _fresh_child(target: Any, name: str, tp: Any) -> Any:
    custom = _CUSTOM.get(type(target))
    if custom and custom.child:
        return custom.child(target, name)
    sub = subconfig(tp)
    return sub() if sub is not None else None


def _assign(target: Any, name: str, value: Any) -> None:
    custom = _CUSTOM.get(type(target))
    if custom and custom.assign:
        custom.assign(target, name, value)
    else:
        setattr(target, name, value)
