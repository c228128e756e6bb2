"""The one table from pattern symbol to everything about its layer kind (docs/architecture.md).

A symbol maps to a :class:`LayerKind`: its name, the config section it reads (and that
section's dataclass and validation), its mixer class and a :class:`ModuleSpec` per backend
(``torch`` always; optional kernel backends may add their own with the same parameters and keys).
From the record one reaches the kind's parallel plan (the mixer's ``parallel_plan()``), its
layout rules (``layout_rules(cfg)``), its FLOPs (``flops_per_token(cfg, seq_len)``) and its
initialisation (``init_rules()``), all declared next to the mixer's code.

Users register new kinds with :func:`register`; the pattern parser then accepts the symbol, the
config validates and canonicalises its section, the layout checks and the builder know it, and
``composer build`` counts it, without editing any composer file. ``D`` is
recognised by the parser but has no entry here, so building it fails with a clear message.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from composer.blocks.attention import Attention
from composer.blocks.gdn import GatedDeltaNet
from composer.blocks.layer import Layer
from composer.blocks.mamba2 import Mamba2Mixer
from composer.blocks.mla import MLA
from composer.blocks.mlp import MLP
from composer.blocks.moe import MoE
from composer.blocks.plan import LayoutRule, ParallelPlan
from composer.config import (
    BUILTIN_SECTIONS,
    SECTIONS,
    SYMBOL_NEEDS,
    ConfigError,
    ModelConfig,
    register_section,
)
from composer.pattern import MEGATRON_SYMBOLS, SYMBOLS, register_symbol
from composer.specs.module_spec import ModuleSpec, build_module


@dataclass
class LayerKind:
    symbol: str
    name: str
    section: str | None
    """The ``ModelConfig`` section this kind reads (``mamba``, ``attention``, ...), if any."""
    backends: dict[str, ModuleSpec] = field(default_factory=dict)

    @property
    def mixer(self) -> type[nn.Module]:
        return self.backends["torch"].submodules["mixer"].module

    @property
    def section_type(self) -> type | None:
        return SECTIONS[self.section].cls if self.section else None

    def flops_per_token(self, cfg: ModelConfig, seq_len: int) -> int:
        return self.mixer.flops_per_token(cfg, seq_len)

    def layout_rules(self, cfg: ModelConfig) -> list[LayoutRule]:
        rules = getattr(self.mixer, "layout_rules", None)
        return list(rules(cfg)) if rules is not None else []

    def validate(self, cfg: ModelConfig) -> None:
        """Check the kind's config section (one-line :class:`ConfigError`)."""
        if self.section is None:
            return
        value = cfg.section(self.section)
        if value is None:
            raise ConfigError(f"pattern symbol {self.symbol!r} needs the '{self.section}' "
                              "section, which is None")
        check = SECTIONS[self.section].validate
        if check is not None:
            check(value, cfg)

    def parallel_plan(self, cfg: ModelConfig) -> ParallelPlan | None:
        """The plan the mixer declares for ``cfg`` (built on the meta device to ask it)."""
        with torch.device("meta"):
            mixer = self.mixer(cfg, 0)
        return mixer.parallel_plan() if hasattr(mixer, "parallel_plan") else None


REGISTRY: dict[str, LayerKind] = {}


def register(symbol: str, name: str, mixer: type[nn.Module], section: str | None = None,
             backend: str = "torch", *, config: type | None = None,
             validate: Callable[[Any, ModelConfig], None] | None = None) -> LayerKind:
    """Map ``symbol`` to a residual :class:`Layer` around ``mixer`` for ``backend``.

    ``mixer`` is called as ``mixer(cfg, layer_idx)`` and declares, next to its code,
    ``init_rules()``, ``flops_per_token(cfg, seq_len)`` (static), and for parallel layouts
    ``parallel_plan()`` and ``layout_rules(cfg)`` (static); see ``composer/blocks/plan.py``.
    ``section`` names the config section it reads: an existing one (``mlp``) or, with
    ``config`` (a dataclass) and an optional ``validate(section, cfg)``, a new one.
    """
    if section is not None and section not in SECTIONS:
        if config is None:
            raise ValueError(f"section {section!r} is not a config section; pass config= (its "
                             "dataclass) to create it")
        register_section(section, config, validate)
    elif config is not None:
        raise ValueError(f"section {section!r} already exists; config= creates a new one")
    if symbol not in SYMBOLS or symbol not in REGISTRY:
        register_symbol(symbol, name)
    if section is not None:
        SYMBOL_NEEDS[symbol] = section
    kind = REGISTRY.setdefault(symbol, LayerKind(symbol, name, section))
    kind.backends[backend] = ModuleSpec(Layer, params={"symbol": symbol},
                                        submodules={"mixer": ModuleSpec(mixer)})
    return kind


def unregister(symbol: str) -> None:
    """Forget a kind registered with :func:`register` (and the section it created)."""
    kind = REGISTRY.pop(symbol)
    if symbol not in MEGATRON_SYMBOLS:
        SYMBOLS.pop(symbol, None)
    SYMBOL_NEEDS.pop(symbol, None)
    section = kind.section
    if section not in BUILTIN_SECTIONS and not any(k.section == section
                                                    for k in REGISTRY.values()):
        SECTIONS.pop(section, None)


def built_symbols() -> list[str]:
    return list(REGISTRY)


def layer_kind(symbol: str) -> LayerKind:
    kind = REGISTRY.get(symbol)
    if kind is None:
        what = SYMBOLS.get(symbol, "unknown")
        raise ConfigError(f"pattern symbol {symbol!r} ({what}) is recognised but not built yet; "
                          f"built symbols: {' '.join(REGISTRY)}")
    return kind


def layer_spec(symbol: str, backend: str = "torch") -> ModuleSpec:
    kind = layer_kind(symbol)
    return kind.backends.get(backend) or kind.backends["torch"]


def mixer_class(symbol: str) -> type[nn.Module]:
    return layer_kind(symbol).mixer


def build_layer(cfg: ModelConfig, layer_idx: int, symbol: str, backend: str = "torch") -> Layer:
    return build_module(layer_spec(symbol, backend), cfg, layer_idx)


def layout_rules(cfg: ModelConfig) -> list[LayoutRule]:
    """Every divisibility rule of the kinds the pattern uses (its MTP parts too)."""
    pattern = cfg.parsed
    rules: list[LayoutRule] = []
    for symbol in dict.fromkeys(pattern.layers + "".join(pattern.mtp)):
        rules += layer_kind(symbol).layout_rules(cfg)
    return rules


register("M", "Mamba-2", Mamba2Mixer, "mamba")
register("*", "attention", Attention, "attention")
register("-", "dense MLP", MLP, "mlp")
register("E", "MoE", MoE, "moe")
register("G", "gated delta net", GatedDeltaNet, "gdn")
register("+", "multi-latent attention", MLA, "mla")
