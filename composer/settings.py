"""Typed settings: dataclasses read from plain data (YAML), written back, set by dotted
``key=value`` overrides and by command-line flags, with one coercion rule for all of them.

A setting is a dataclass field, declared once: its annotation is its type (bool, int, float, str,
``Literal`` choices, ``X | None``, tuples, lists, nested dataclasses) and its metadata carries its
help text (:func:`setting`), from which :func:`add_flags` makes its flag. The model config
(:mod:`composer.config`), the training recipe and the parallel layout use this engine, so YAML,
``--set`` and flags accept and refuse the same values with the same one-line
:class:`ConfigError`. Unknown keys are refused with the nearest valid key
(:func:`composer.suggest.closest`).

A dataclass whose keys are not just its fields (the model config's registered sections) says so
once with :func:`customize`. This module imports no torch: the CLI reads it before anything heavy.
"""

from __future__ import annotations

import argparse
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


class DataError(ValueError):
    """A dataset, input file or tokenizer that cannot be used; the message is one line
    (:mod:`composer.data.indexed` re-exports it; it lives here so that
    :mod:`composer.vision.preprocess`, which :mod:`composer.data` calls, imports nothing of
    ``composer.data``)."""


def setting(default: Any = dataclasses.MISSING, help: str = "", *,  # noqa: A002
            factory: Any = dataclasses.MISSING, **extra: Any) -> Any:
    """A dataclass field with its help text: ``tp: int = setting(1, "tensor-parallel size")``.

    ``extra`` goes into the field's metadata for :func:`add_flags`: ``flags`` (the flag names,
    default ``--kebab-case`` of the field, ``--no-...`` for a bool that defaults to True),
    ``metavar``, ``nargs``, ``action``, ``cli=False`` (no flag), ``title`` (the argument group
    of a nested settings dataclass)."""
    return dataclasses.field(default=default, default_factory=factory,
                             metadata={"help": help, **extra})


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
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{name} expects a list, got {value!r}")
        return [coerce(v, args[0] if args else Any, f"{name}[{i}]") for i, v in enumerate(value)]
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
        whole = _integral(value)  # 1e6 (a string in YAML 1.1) or 8.0: lossless
        if whole is not None:
            return whole
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


def _integral(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, (float, str)):
        return None
    try:
        number = float(value)
    except ValueError:
        return None
    return int(number) if number.is_integer() else None


def check(obj: Any, where: str = "") -> Any:
    """Check every field of a settings dataclass built in code (not read) against its type;
    returns ``obj``. Reading (YAML, overrides, flags) checks as it goes."""
    for name, tp in hints(type(obj)).items():
        coerce(to_plain(getattr(obj, name)), tp, where + name)
    return obj


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
    """The plain (YAML-ready) form of a settings dataclass or value; tuples become lists, and
    lists of dataclasses (the ``parallel`` section's branches) lists of mappings."""
    custom = _CUSTOM.get(type(obj))
    if custom and custom.plain:
        return custom.plain(obj)
    if dataclasses.is_dataclass(obj):
        return {f.name: to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (tuple, list)):
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


def set_field(obj: Any, dotted: str, value: Any, nulls: bool = True) -> None:
    """Set one dotted field with type checking; a nested setting that is None is created first
    (with its defaults) so that ``rope_scaling.factor=4`` works from nothing. ``nulls``: the
    strings ``none`` / ``null`` mean None for a field that is not a string (``--set`` text);
    off for values already typed (a flag's ``--save none`` is a folder)."""
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
    if nulls and isinstance(value, str) and keys[leaf] is not str \
            and value.lower() in ("none", "null") \
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


# ---------------------------------------------------------------- flags


def add_flags(parser: Any, cls: type, only: tuple[str, ...] | None = None,
              defaults: bool = False) -> dict[str, Any]:
    """One argparse flag per field of ``cls``, from its annotation and metadata: the name is
    ``--kebab-case``, a bool is ``store_true`` (``--no-...`` / ``store_false`` when it defaults
    to True), a ``Literal`` gives the choices, the help is the metadata's. A nested settings
    dataclass adds its fields in an argument group. ``only``: these fields alone (in the order
    declared). ``defaults``: the fields' defaults; otherwise only flags given reach the
    namespace (``argparse.SUPPRESS``), to be laid over a recipe. Returns the argument groups
    made, by field name (for flags that are no field, e.g. an alias)."""
    keys = hints(cls)
    groups: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.metadata.get("cli") is False or f.name not in keys:
            continue
        sub = subconfig(keys[f.name])
        if sub is not None and typing.get_origin(keys[f.name]) is None:
            group = parser.add_argument_group(f.metadata.get("title", f.name),
                                              f.metadata.get("help") or None)
            groups[f.name] = group
            groups.update(add_flags(group, sub, only, defaults))
        elif only is None or f.name in only:
            parser.add_argument(*flag_names(f), **_flag_options(f, keys[f.name], defaults))
    return groups


def flag_names(f: dataclasses.Field) -> tuple[str, ...]:
    """The flags of field ``f``: its metadata's ``flags``, or ``--kebab-case`` of its name."""
    if "flags" in f.metadata:
        return tuple(f.metadata["flags"])
    kebab = f.name.replace("_", "-")
    return (f"--no-{kebab}",) if f.default is True else (f"--{kebab}",)


def _flag_options(f: dataclasses.Field, tp: Any, defaults: bool) -> dict[str, Any]:
    meta = f.metadata
    out: dict[str, Any] = {"dest": f.name, "help": meta.get("help") or None}
    if defaults:
        out["default"] = f.default_factory() if f.default_factory is not dataclasses.MISSING \
            else f.default
    else:
        out["default"] = argparse.SUPPRESS
    if tp is bool:
        out["action"] = "store_false" if f.default is True else "store_true"
        return out
    out.update({k: meta[k] for k in ("metavar", "nargs", "action") if k in meta})
    item = _scalar(tp)
    out["type"] = _FlagType(item, f.name)
    if choices(tp):
        out["choices"] = choices(tp)
    return out


def _scalar(tp: Any) -> Any:
    """What one flag value is: ``int`` for ``int | None``, ``str`` for a ``Literal`` of strings,
    the item of a ``list[...]``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        return _scalar(rest[0]) if len(rest) == 1 else Any
    if origin is Literal:
        return type(args[0])
    if origin is list:
        return _scalar(args[0]) if args else Any
    return tp


class _FlagType:
    """argparse's ``type=``: a flag's text coerced as YAML's value would be (``1e6`` is an int,
    ``3e-4`` a float). Named after the type, so that argparse says ``invalid int value: 'x'``."""

    def __init__(self, tp: Any, name: str) -> None:
        self.tp, self.name = tp, name
        self.__name__ = "str" if tp is Any else type_name(tp)

    def __call__(self, text: str) -> Any:
        if self.tp is str or self.tp is Any:
            return text
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError:
            value = text
        return coerce(value, self.tp, self.name)
