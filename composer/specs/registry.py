"""The one table from pattern symbol to block spec, per backend (DESIGN §3, §4).

A symbol maps to a :class:`LayerKind`: its name, the config section it needs, and a
:class:`ModuleSpec` per backend (``torch`` always; optional kernel backends may add their own with
the same parameters and keys). Users register new kinds with :func:`register`; the pattern parser
then accepts the symbol and the builder builds it. ``G``, ``+`` and ``D`` are recognised by the
parser but have no entry here, so building them fails with a clear message.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from composer.blocks.attention import Attention
from composer.blocks.layer import Layer
from composer.blocks.mamba2 import Mamba2Mixer
from composer.blocks.mlp import MLP
from composer.blocks.moe import MoE
from composer.config import ConfigError, ModelConfig
from composer.specs.module_spec import ModuleSpec, build_module
from composer.specs.pattern import SYMBOLS, register_symbol


@dataclass
class LayerKind:
    symbol: str
    name: str
    section: str | None
    """The ``ModelConfig`` field this kind reads (``mamba``, ``attention``, ...), if any."""
    backends: dict[str, ModuleSpec] = field(default_factory=dict)


REGISTRY: dict[str, LayerKind] = {}


def register(symbol: str, name: str, mixer: type[nn.Module], section: str | None = None,
             backend: str = "torch") -> LayerKind:
    """Map ``symbol`` to a residual :class:`Layer` around ``mixer`` for ``backend``.

    ``mixer`` is called as ``mixer(cfg, layer_idx)`` and should provide
    ``reset_parameters(generator)`` and ``flops_per_token(cfg, seq_len)``.
    """
    if symbol not in SYMBOLS or symbol not in REGISTRY:
        register_symbol(symbol, name)
    kind = REGISTRY.setdefault(symbol, LayerKind(symbol, name, section))
    kind.backends[backend] = ModuleSpec(Layer, params={"symbol": symbol},
                                        submodules={"mixer": ModuleSpec(mixer)})
    return kind


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
    return layer_spec(symbol).submodules["mixer"].module


def build_layer(cfg: ModelConfig, layer_idx: int, symbol: str, backend: str = "torch") -> Layer:
    return build_module(layer_spec(symbol, backend), cfg, layer_idx)


register("M", "Mamba-2", Mamba2Mixer, "mamba")
register("*", "attention", Attention, "attention")
register("-", "dense MLP", MLP, "mlp")
register("E", "MoE", MoE, "moe")
