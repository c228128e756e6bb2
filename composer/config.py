"""Typed model configuration: nested dataclasses, YAML round trip, dotted overrides, validation.

A model is a layer pattern (docs/patterns.md) plus one sub-config per block kind the pattern
uses. Sizes are ``d_*``, counts ``n_*``. Every error is a one-line :class:`ConfigError` (a
``ValueError``).

Each layer kind's section (its dataclass, validator and defaults) is declared in the kind's own
block file, in its :class:`~composer.blocks.kind.LayerKind` record; this module knows no kind by
name. Which section a symbol needs (:func:`symbol_sections`) and how a section validates
(:func:`section_table`) are derived from the records that ``composer/build/registry.py`` collects,
so a user-registered kind's section loads, saves, takes ``--set`` overrides and validates like the
built-in ones (at the top level of the YAML, beside ``attention`` and ``mamba``). The section
dataclasses are importable from here too (``from composer.config import MambaConfig``), loaded on
first use from their block files.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from composer import settings
from composer.pattern import Pattern, PatternError, parse_pattern
from composer.settings import ConfigError, set_field
from composer.settings import coerce as _coerce
from composer.settings import from_plain as _from_plain
from composer.settings import hints as _hints
from composer.settings import to_plain as _to_plain


@dataclass
class MTPConfig:
    """Multi-token prediction (the pattern's ``/`` parts; :mod:`composer.blocks.mtp`)."""

    loss_weight: float = 0.1
    """``w`` in ``loss = ce + aux + (w / D) * sum_k ce_k`` over the ``D`` depths (DeepSeek-V3's
    lambda; Megatron's ``mtp_loss_scaling_factor``, default 0.1)."""


@dataclass
class VisionConfig:
    """The ``vision:`` section: the vision tower's sizes (transformers' names in brackets) and
    the placeholder token ids (:mod:`composer.vision.tower`); ``ModelConfig.vision`` is None for
    a text-only model."""

    depth: int = 2
    """Blocks (``depth``); the tower's pattern is ``"B-" * depth``: ``2 * depth`` layers."""
    d_model: int = 64
    """Tower width (``hidden_size``)."""
    n_heads: int = 4
    """Attention heads (``num_heads``); the head width ``d_model / n_heads`` divides by 4."""
    d_ff: int = 128
    """MLP width (``intermediate_size``)."""
    activation: str = "gelu_tanh"
    """The MLP's activation (``hidden_act``; ``gelu_pytorch_tanh`` is ``gelu_tanh``)."""
    patch_size: int = 16
    temporal_patch_size: int = 2
    in_channels: int = 3
    merge_size: int = 2
    """Side of the square block of patches the merger folds into one token
    (``spatial_merge_size``)."""
    d_out: int = 256
    """The merger's output width, the language model's ``d_model`` (``out_hidden_size``)."""
    n_position_embeddings: int = 256
    """Learned positions (``num_position_embeddings``), a square ``G x G`` grid."""
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    init_std: float = 0.02
    image_token_id: int | None = None
    """The ``<|image_pad|>`` placeholder id (``image_token_id``; 248056 in Qwen3.5): the
    prompt carries ``t * h * w / merge^2`` of them per image, replaced by its features."""
    vision_start_token_id: int | None = None
    """``<|vision_start|>`` (``vision_start_token_id``), right before each placeholder run."""
    vision_end_token_id: int | None = None
    """``<|vision_end|>`` (``vision_end_token_id``), right after it (prompt building only)."""

    @property
    def pattern(self) -> str:
        """``B`` bidirectional attention, ``-`` MLP, one pair per block."""
        return "B-" * self.depth

    @property
    def d_head(self) -> int:
        return self.d_model // self.n_heads

    @property
    def d_patch(self) -> int:
        """Width of one ``pixel_values`` row, ``C * Tp * P * P``."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def grid_side(self) -> int:
        return math.isqrt(self.n_position_embeddings)


def validate_vision(v: VisionConfig, cfg: ModelConfig | None = None) -> None:
    """One-line :class:`ConfigError` for an inconsistent section (with ``cfg``: also against
    the language model: ``d_out == d_model``, the token ids given and in the vocabulary)."""
    positive(v, "vision.", ("depth", "d_model", "n_heads", "d_ff", "patch_size",
                            "temporal_patch_size", "in_channels", "merge_size", "d_out",
                            "n_position_embeddings", "rope_theta", "norm_eps"))
    if v.d_model % v.n_heads or (v.d_model // v.n_heads) % 4:
        raise ConfigError(f"vision.d_model ({v.d_model}) must be vision.n_heads ({v.n_heads}) "
                          "heads whose width divides by 4 (2-D rotary: row and column halves)")
    if v.grid_side**2 != v.n_position_embeddings:
        raise ConfigError(f"vision.n_position_embeddings ({v.n_position_embeddings}) must be a "
                          "square (a G x G grid of learned positions)")
    mlp = importlib.import_module("composer.blocks.mlp")  # by name: the blocks sit above
    if v.activation not in mlp.ACTIVATIONS or mlp.is_gated(v.activation):
        raise ConfigError(f"vision.activation {v.activation!r} must be a plain activation: "
                          f"{', '.join(a for a in mlp.ACTIVATIONS if not mlp.is_gated(a))}")


    if cfg is None:
        return
    if v.d_out != cfg.d_model:
        raise ConfigError(f"vision.d_out ({v.d_out}) must equal d_model ({cfg.d_model}): the "
                          "merger's output replaces token embeddings")
    for name in ("image_token_id", "vision_start_token_id", "vision_end_token_id"):
        value = getattr(v, name)
        if name != "vision_end_token_id" and value is None:
            raise ConfigError(f"vision.{name} must be given (a token id in [0, "
                              f"{cfg.vocab_size}))")
        if value is not None and not 0 <= value < cfg.vocab_size:
            raise ConfigError(f"vision.{name} ({value}) must be in [0, {cfg.vocab_size})")
    if v.image_token_id == v.vision_start_token_id:
        raise ConfigError("vision.image_token_id and vision.vision_start_token_id must differ")


@dataclass
class _ModelFields:
    """The fields of :class:`ModelConfig` (its own ``__init__`` adds the section keywords)."""

    pattern: str = "M-M*-ME"
    d_model: int = 256
    vocab_size: int = 32000
    tie_embeddings: bool = False
    norm_eps: float = 1e-5
    init_std: float = 0.02
    embedding_multiplier: float = 1.0
    embedding_multiplier_in_dtype: bool = False
    """Round ``embedding_multiplier`` to the embedding's dtype before multiplying (Gemma's
    ``sqrt(d_model)``: 55.4256 is 55.5 in bf16, as transformers computes it); False: the exact
    multiplier (Granite)."""
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    """Logits are divided by this (Granite)."""
    norm_zero_centered: bool = False
    """Every :class:`~composer.blocks.norm.RMSNorm` of the model (layer norms, final norm,
    qk-norms) computes ``rms(x) * (1 + w)`` and stores ``w`` (initialised to 0), as Qwen3-Next /
    Qwen3.5 checkpoints do. Gated mixer norms (Mamba-2, GDN) are not affected."""
    post_norm_layers: tuple[int, ...] = ()
    """0-based indices of the layers that normalise their mixer's *output* before the residual
    add, ``x + norm(mixer(x))`` (OLMo 2/3, OLMo-Hybrid's attention layers); every other layer is
    pre-norm, ``x + mixer(norm(x))``. Empty (the default) means all pre-norm."""
    sandwich_norm: bool = False
    """Every layer normalises both its input and its mixer's output, ``x + out_norm(mixer(
    norm(x)))`` (Gemma 2/3: ``input_layernorm`` / ``post_attention_layernorm`` around attention,
    ``pre_feedforward_layernorm`` / ``post_feedforward_layernorm`` around the MLP); the second
    norm is ``layers.i.out_norm.weight``. Exclusive with ``post_norm_layers``."""
    mtp: MTPConfig | None = field(default_factory=MTPConfig)
    """Read only when the pattern has multi-token-prediction parts (``"main/mtp"``)."""
    vision: VisionConfig | None = None
    """The vision tower of a vision-language model (:class:`VisionConfig`); None for text."""
    sections: dict[str, Any] = field(default_factory=dict, repr=False)
    """Each layer kind's section by name (``attention``, ``mamba``, ... and registered kinds'),
    also reachable as attributes (``cfg.mamba``) and given as keywords
    (``ModelConfig(mamba=MambaConfig(...))``). Which sections exist, their dataclasses, defaults
    and validation come from the kinds' records (:class:`composer.blocks.kind.LayerKind`): a
    section is present when its kind says ``always`` or the pattern uses it, None otherwise."""


class ModelConfig(_ModelFields):
    """A model: its pattern, widths and options, and one section per layer kind it uses."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        given = {k: kwargs.pop(k) for k in list(kwargs) if k not in _FIELDS}
        unknown = [k for k in given if k not in section_table()]
        if unknown:
            raise TypeError(f"ModelConfig got an unexpected keyword argument {unknown[0]!r}")
        kwargs["sections"] = {**kwargs.get("sections", {}), **given}
        super().__init__(*args, **kwargs)
        self._fill_sections()

    def _fill_sections(self) -> None:
        used = _used_sections(self.pattern)
        for name, sec in section_table().items():
            if name not in self.sections:
                present = sec.always or name in used
                self.sections[name] = default_section(name, self.d_model) if present else None

    def __getattr__(self, name: str) -> Any:
        sections = self.__dict__.get("sections")
        if sections is not None and (name in sections or name in section_table()):
            return sections.get(name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in _FIELDS and name in section_table():
            self.sections[name] = value
        else:
            object.__setattr__(self, name, value)

    def section(self, name: str) -> Any:
        """The section called ``name`` (``attention``, ``mamba``, ... or a registered one)."""
        return getattr(self, name)

    def set_section(self, name: str, value: Any) -> None:
        setattr(self, name, value)

    @property
    def parsed(self) -> Pattern:
        return parse_pattern(self.pattern)

    def validate(self) -> ModelConfig:
        """Raise :class:`ConfigError` on the first problem; return ``self``."""
        validate(self)
        return self

    def to_dict(self) -> dict[str, Any]:
        return _to_plain(self)

    def canonical(self) -> ModelConfig:
        """A copy with the flat pattern and the sections the pattern does not use set to None,
        so that two configs that build the same model compare equal."""
        pattern = self.parsed
        used = _used_sections(self.pattern)
        out = ModelConfig.from_dict(self.to_dict())
        out.pattern = pattern.format()
        for name in out.sections:
            if name not in used:
                out.sections[name] = None
        if not pattern.mtp:
            out.mtp = None
        return out

    def save(self, path: str | Path) -> None:
        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        return _from_plain(cls, data, "")

    @classmethod
    def load(cls, path: str | Path) -> ModelConfig:
        try:
            data = yaml.safe_load(Path(path).read_text())
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML ({str(exc).splitlines()[0]})") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a mapping of config fields")
        return cls.from_dict(data)


_FIELDS = frozenset(f.name for f in dataclasses.fields(ModelConfig))


@dataclass(frozen=True)
class Section:
    """A config section: its dataclass, its validation, its default for a width, and whether it
    exists in a config whose pattern does not use it (from the kind's record)."""

    cls: type
    validate: Callable[[Any, ModelConfig], None] | None = None
    """Raises :class:`ConfigError` for a bad section; gets the section and the whole config."""
    default: Callable[[int], Any] | None = None
    always: bool = False


SECTIONS: dict[str, Section] = {}
"""Config sections by name, in the order the kinds were registered (built-in kinds first);
filled from the kinds' records by the registry (``composer/build/registry.py``)."""
SYMBOL_SECTIONS: dict[str, str] = {}
"""Pattern symbol -> the config section its kind reads (filled by the registry)."""


def _load_kinds() -> None:
    """Load the registry once, which registers the built-in kinds. It sits above this module
    (it imports the block files, and torch), so it is found by name, as a plugin table is: the
    config stays importable without torch and below the kinds."""
    if not SECTIONS:
        importlib.import_module("composer.build.registry")


def section_table() -> dict[str, Section]:
    """Config sections by name (:data:`SECTIONS`, the built-in kinds loaded first)."""
    _load_kinds()
    return SECTIONS


def symbol_sections() -> dict[str, str]:
    """Pattern symbol -> the config section its kind reads."""
    _load_kinds()
    return SYMBOL_SECTIONS


def default_section(name: str, d_model: int) -> Any:
    """The section ``name`` with its defaults for a model ``d_model`` wide (the kind's
    ``default``, else its dataclass's defaults); None for a section whose dataclass has required
    fields."""
    sec = section_table()[name]
    if sec.default is not None:
        return sec.default(d_model)
    try:
        return sec.cls()
    except TypeError:
        return None


def _used_sections(pattern: Any) -> set[str]:
    """The sections a pattern's symbols read; empty for a pattern that does not parse (the
    validation reports it)."""
    try:
        parsed = parse_pattern(pattern)
    except PatternError:
        return set()
    needs = symbol_sections()
    used = {needs[s] for s in parsed.symbols_used() if s in needs}
    if any(t.startswith("[") for t in parsed.tokens_used()):
        used.add("parallel")
    return used | ({"mtp"} if parsed.mtp else set())


# ---------------------------------------------------------------- plain <-> dataclass


# The engine is composer.settings; a ModelConfig also takes its kinds' sections as keys.


def _model_keys(found: dict[str, Any]) -> dict[str, Any]:
    found.pop("sections")
    found.update({name: sec.cls | None for name, sec in section_table().items()})
    return found


def _model_plain(obj: ModelConfig) -> dict[str, Any]:
    out = {f.name: _to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)
           if f.name not in ("mtp", "sections")}
    out.update({k: _to_plain(v) for k, v in obj.sections.items()})
    out["mtp"] = _to_plain(obj.mtp)
    return out


def _model_child(cfg: ModelConfig, name: str) -> Any:
    """A section set by ``--set moe.top_k=2`` while it is None starts from its defaults."""
    if name in section_table():
        return default_section(name, cfg.d_model)
    sub = settings.subconfig(_hints(ModelConfig)[name])
    return sub() if sub is not None else None


settings.customize(ModelConfig, keys=_model_keys, build=lambda kwargs: ModelConfig(**kwargs),
                   plain=_model_plain, child=_model_child, assign=setattr)


# ---------------------------------------------------------------- overrides


def apply_overrides(config: ModelConfig, overrides: list[str]) -> ModelConfig:
    """Apply ``key=value`` strings such as ``attention.n_heads=8`` (values parsed as YAML).

    Setting a field of a sub-config that is ``None`` creates it with its defaults first
    (:func:`default_section`); ``moe=null`` removes one. A new ``pattern`` gets the sections its
    symbols read (unless nulled here); sections whose kind sizes them by ``d_model`` (``mla``,
    ``gdn``), still at their defaults and
    not touched here follow a new ``d_model``. Unknown keys are rejected with the nearest valid
    key.
    """
    d_model = config.d_model
    derived = {n for n, sec in section_table().items()
               if sec.default is not None and config.section(n) == default_section(n, d_model)}
    touched = set()
    for item in overrides:
        key, value = settings.parse_override(item)
        set_field(config, key, value)
        touched.add(key.partition(".")[0])
    if config.d_model != d_model:
        for name in derived - touched:
            config.set_section(name, default_section(name, config.d_model))
    if "pattern" in touched:
        for name in _used_sections(config.pattern) - touched:
            if config.section(name) is None:
                config.set_section(name, default_section(name, config.d_model))
    return config


# ---------------------------------------------------------------- validation


def positive(obj: Any, prefix: str, names: tuple[str, ...]) -> None:
    """Each named field of ``obj`` that is not None must be > 0 (``prefix``: the error's dotted
    path, e.g. ``mamba.``)."""
    for name in names:
        value = getattr(obj, name)
        if value is not None and value <= 0:
            raise ConfigError(f"{prefix}{name} must be positive, got {value}")


def validate(cfg: ModelConfig) -> None:
    """Check a config for consistency; raises :class:`ConfigError` with a one-line reason."""
    hints = _hints(ModelConfig)
    for name, hint in hints.items():  # catches wrong types set by hand
        _coerce(_to_plain(getattr(cfg, name)), hint, name)
    table = section_table()
    for name in cfg.sections:
        if name not in table:
            raise ConfigError(f"unknown config section {name!r}")
    try:
        pattern = parse_pattern(cfg.pattern)
    except PatternError as exc:
        raise ConfigError(str(exc)) from None
    positive(cfg, "", ("d_model", "vocab_size", "norm_eps", "init_std"))
    n_layers = len(pattern.layers)
    post = list(cfg.post_norm_layers)
    if post != sorted(set(post)) or any(not 0 <= i < n_layers for i in post):
        raise ConfigError(f"post_norm_layers {post} must be increasing layer indices in "
                          f"[0, {n_layers})")
    if post and cfg.sandwich_norm:
        raise ConfigError("post_norm_layers and sandwich_norm exclude each other (a sandwich "
                          "layer has both norms already)")
    for sym in sorted(pattern.symbols_used()):
        section = symbol_sections().get(sym)
        if section and getattr(cfg, section) is None:
            raise ConfigError(f"pattern symbol {sym!r} needs the '{section}' section, which is "
                              f"None; {_how_to_give(section, cfg.d_model)}")
    if pattern.mtp and cfg.mtp is None:
        part = "".join(pattern.mtp[0])
        raise ConfigError(f"the multi-token-prediction parts ('/{part}') need the 'mtp' section, "
                          "which is None")
    if cfg.mtp is not None:
        _validate_mtp(cfg.mtp, cfg)
    if cfg.vision is not None:
        validate_vision(cfg.vision, cfg)
    for name, section in table.items():
        value = cfg.section(name)
        if value is not None and section.validate is not None:
            section.validate(value, cfg)


def _how_to_give(section: str, d_model: int) -> str:
    """The ``--set`` that creates a missing section (any of its keys does, with the rest at
    :func:`default_section`'s values)."""
    default = default_section(section, d_model)
    if default is None:
        return f"give it with --set {section}.KEY=VALUE for each of its fields"
    first = dataclasses.fields(default)[0].name
    return (f"give it one, e.g. --set {section}.{first}={getattr(default, first)} (its other "
            f"keys then take their defaults for d_model {d_model})")














def _validate_mtp(m: MTPConfig, cfg: ModelConfig) -> None:
    if not m.loss_weight >= 0:
        raise ConfigError(f"mtp.loss_weight must be >= 0, got {m.loss_weight}")






def config_diff(a: ModelConfig, b: ModelConfig) -> str | None:
    """The first dotted field where two configs differ, as ``field: a != b``; None if equal."""
    def walk(x: Any, y: Any, prefix: str) -> str | None:
        if isinstance(x, dict) and isinstance(y, dict):
            for key in x:
                found = walk(x[key], y.get(key), f"{prefix}{key}.")
                if found:
                    return found
            return None
        return None if x == y else f"{prefix.rstrip('.')}: {x!r} != {y!r}"

    return walk(a.to_dict(), b.to_dict(), "")


# ---------------------------------------------------------------- derived sizes










_MOVED = {"AttentionConfig": "attention", "RopeScaling": "attention", "d_head_of": "attention",
          "MambaConfig": "mamba2", "d_inner_of": "mamba2", "MLPConfig": "mlp",
          "Activation": "mlp", "GATED_ACTIVATIONS": "mlp", "is_gated": "mlp",
          "MoEConfig": "moe", "d_ff_shared_of": "moe", "MOE_TRAINING_ONLY": "moe",
          "MLAConfig": "mla", "YarnScaling": "mla", "GDNConfig": "gdn",
          "ShortConvConfig": "shortconv", "KDAConfig": "kda",
          "ParallelConfig": "group", "BranchScale": "group",
          "ZambaConfig": "zamba"}
"""The built-in kinds' sections and size helpers, which live in their block files."""


def __getattr__(name: str) -> Any:  # PEP 562: loaded on first use (their modules import torch)
    module = _MOVED.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"composer.blocks.{module}"), name)
