"""The registry: it collects one :class:`~composer.blocks.kind.LayerKind` record per pattern
symbol and derives the tables the rest of composer reads (docs/architecture.md).

Each record is declared in its kind's block file (``composer/blocks/mamba2.py`` ends with
``KIND = LayerKind("M", "Mamba-2", Mamba2Mixer, "mamba", MambaConfig, ...)``); this module only
gathers them. From the records come: the symbols the pattern parser accepts
(:func:`composer.pattern.register_symbol`), the config sections (:data:`SECTIONS`, read by
:func:`composer.config.section_table`), the layout rules of a pattern (:func:`layout_rules`),
its convolution halo (:func:`halo`), and what the builder builds (:func:`build_layer`).

Users register new kinds with :func:`register` (``composer.register``): the parser then accepts
the symbol, the config validates and canonicalises its section, the layout checks and the
builder know it, and ``composer build`` counts it, without editing any composer file. ``D`` is
recognised by the parser but has no record, so building it fails with a clear message.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

from torch import nn

from composer.blocks import attention, gdn, kda, mamba1, mamba2, mla, mlp, moe, shortconv, zamba
from composer.blocks.group import ParallelConfig, group_class, group_name, validate_parallel
from composer.blocks.kind import KINDS, LayerKind, halo
from composer.blocks.layer import Layer
from composer.blocks.plan import LayoutRule
from composer.config import SECTIONS, SYMBOL_SECTIONS, ConfigError, ModelConfig, Section
from composer.pattern import MEGATRON_SYMBOLS, SYMBOLS, branches_of, register_symbol

REGISTRY: dict[str, LayerKind] = KINDS
"""Pattern symbol -> its kind's record, in registration order (built-in kinds first)."""
_FIELDS = frozenset(f.name for f in dataclasses.fields(ModelConfig))


def register(kind: LayerKind | str, name: str | None = None, mixer: type[nn.Module] | None = None,
             section: str | None = None, *, config: type | None = None,
             validate: Callable[[Any, ModelConfig], None] | None = None) -> LayerKind:
    """Register a layer kind: its :class:`~composer.blocks.kind.LayerKind` record, or the
    record's first fields (``register("R", "my mix", MyMixer, "mysection", config=MyConfig)``).

    ``mixer`` is called as ``mixer(cfg, layer_idx)`` and declares, next to its code, what
    :class:`composer.blocks.protocol.Mixer` lists (init rules, parallel plan, layout rules,
    FLOPs, decoding state, time-mixing ops). ``section`` names the config section it reads: an
    existing one (``mlp``) or, with ``config`` (its dataclass), a new one.
    """
    if not isinstance(kind, LayerKind):
        if name is None or mixer is None:
            raise TypeError("register(symbol, name, mixer, ...) needs a name and a mixer class")
        kind = LayerKind(kind, name, mixer, section, config, validate)
    _add_section(kind)
    if kind.symbol not in SYMBOLS or kind.symbol not in REGISTRY:
        register_symbol(kind.symbol, kind.name)
    REGISTRY[kind.symbol] = kind
    if kind.section is not None:
        SYMBOL_SECTIONS[kind.symbol] = kind.section
    return kind


def _add_section(kind: LayerKind) -> None:
    name = kind.section
    if name is None:
        if kind.config is not None:
            raise ValueError(f"kind {kind.symbol!r}: config= needs a section name")
        return
    owner = next((k for k in REGISTRY.values() if k.section == name and k.config is not None
                  and k.symbol != kind.symbol), None)
    if kind.config is None:
        if name not in SECTIONS:
            raise ValueError(f"section {name!r} is not a config section; pass config= (its "
                             "dataclass) to create it")
        return
    if owner is not None:
        raise ValueError(f"section {name!r} already exists (kind {owner.symbol!r}); config= "
                         "creates a new one")
    if not dataclasses.is_dataclass(kind.config):
        raise TypeError(f"a config section must be a dataclass, got {kind.config!r}")
    if name in _FIELDS:
        raise ValueError(f"{name!r} is a ModelConfig field, not a section name")
    SECTIONS[name] = Section(kind.config, kind.validator, kind.default, kind.always)


def unregister(symbol: str) -> None:
    """Forget a kind registered with :func:`register` (and the section it created)."""
    kind = REGISTRY.pop(symbol)
    SYMBOL_SECTIONS.pop(symbol, None)
    if symbol not in MEGATRON_SYMBOLS:
        SYMBOLS.pop(symbol, None)
    if kind.config is not None and not any(k.section == kind.section for k in REGISTRY.values()):
        SECTIONS.pop(kind.section, None)


def layer_kind(symbol: str) -> LayerKind:
    """The record of a pattern token: a symbol's, or a parallel group's (``"[M*]"``, made from
    its branches' records)."""
    if symbol.startswith("["):
        return _group_kind(symbol)
    kind = REGISTRY.get(symbol)
    if kind is None:
        what = SYMBOLS.get(symbol, "unknown")
        raise ConfigError(f"pattern symbol {symbol!r} ({what}) is recognised but not built yet; "
                          f"built symbols: {' '.join(REGISTRY)}")
    return kind


@functools.cache
def _group_kind(token: str) -> LayerKind:
    branches = [layer_kind(s) for s in branches_of(token)]

    def widest_halo(cfg: Any) -> int:
        return max(k.halo_width(cfg) for k in branches)

    return LayerKind(token, group_name(token), group_class(token), halo=widest_halo)


def build_layer(cfg: ModelConfig, layer_idx: int, symbol: str) -> Layer:
    """The residual block of ``symbol`` at ``layer_idx`` (its mixer built from the record)."""
    mixer = layer_kind(symbol).mixer(cfg, layer_idx)
    return Layer(cfg, layer_idx, mixer=mixer, symbol=symbol)


def _kinds(cfg: ModelConfig) -> list[LayerKind]:
    """The kinds the pattern uses (its MTP parts too), each once, in order."""
    pattern = cfg.parsed
    return [layer_kind(s) for s in pattern.symbols_used()]


def layout_rules(cfg: ModelConfig) -> list[LayoutRule]:
    """Every divisibility rule of the kinds the pattern uses (its MTP parts too)."""
    return [rule for kind in _kinds(cfg) for rule in kind.layout_rules(cfg)]


__all__ = ["REGISTRY", "SECTIONS", "build_layer", "halo", "layer_kind", "layout_rules", "register",
           "unregister"]

for _kind in (mamba2.KIND, attention.KIND, mlp.KIND, moe.KIND, gdn.KIND, mla.KIND, shortconv.KIND,
              mamba1.KIND, attention.WINDOW_KIND, kda.KIND,
              zamba.KIND):
    register(_kind)
SECTIONS["parallel"] = Section(ParallelConfig, validate_parallel)  # the '[..]' groups' multipliers
