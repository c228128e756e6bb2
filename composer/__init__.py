"""composer: declare, build, convert and train hybrid Mamba / attention / MLP / MoE models.

    >>> import composer
    >>> cfg = composer.ModelConfig(pattern="M-M*-ME")
    >>> model = composer.build_model(cfg)                # on CPU, seeded
    >>> logits = model(input_ids)                        # (B, T, vocab)
    >>> ids = composer.generate(model, input_ids, 32)    # (B, T + 32), greedy
    >>> preset = composer.zoo.get_preset("llama-debug")  # presets; composer.convert: converters

Every name here is imported on first use (PEP 562), so ``import composer`` costs nothing and a
command that needs no model (``composer --help``, an argument error) never imports torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what the lazy table below resolves to, for type checkers and editors
    from composer.blocks.model import HybridModel, ModelOutput
    from composer.build.builder import build_model, cast_model, load, model_stats, save
    from composer.build.registry import register
    from composer.config import (
        AttentionConfig,
        ConfigError,
        MambaConfig,
        MLPConfig,
        ModelConfig,
        MoEConfig,
        RopeScaling,
        apply_overrides,
    )
    from composer.inference import generate
    from composer.pattern import Pattern, PatternError, parse_pattern

_EXPORTS = {
    "composer.blocks.model": ("HybridModel", "ModelOutput"),
    "composer.config": ("AttentionConfig", "ConfigError", "MambaConfig", "MLPConfig",
                        "ModelConfig", "MoEConfig", "RopeScaling", "apply_overrides"),
    "composer.inference": ("generate",),
    "composer.pattern": ("Pattern", "PatternError", "parse_pattern"),
    "composer.build.builder": ("build_model", "cast_model", "load", "model_stats", "save"),
    "composer.build.registry": ("register",),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = [  # spelled out for linters; the names of _WHERE (tests/test_lazy_import.py)
    "AttentionConfig", "ConfigError", "HybridModel", "MLPConfig", "MambaConfig", "ModelConfig",
    "ModelOutput", "MoEConfig", "Pattern", "PatternError", "RopeScaling", "apply_overrides",
    "build_model", "cast_model", "generate", "load", "model_stats", "parse_pattern", "register",
    "save",
]


def __getattr__(name: str) -> Any:
    """``composer.X``: a public name, ``__version__``, or a subpackage (``composer.zoo``,
    ``composer.convert``, ``composer.kernels``, ...), imported now and cached."""
    if name in _WHERE:
        value = getattr(importlib.import_module(_WHERE[name]), name)
    elif name == "__version__":
        from composer.cli.base import version

        value = version()
    elif name.startswith("_"):
        raise AttributeError(f"module 'composer' has no attribute {name!r}")
    else:
        try:
            value = importlib.import_module(f"composer.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"composer.{name}":  # the subpackage exists; something it needs not
                raise
            raise AttributeError(f"module 'composer' has no attribute {name!r}") from None
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__) | {"zoo", "convert", "__version__"})
