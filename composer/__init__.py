"""composer: declare, build, convert and train hybrid Mamba / attention / MLP / MoE models.

    >>> import composer
    >>> cfg = composer.ModelConfig(pattern="M-M*-ME")
    >>> model = composer.build_model(cfg)                # on CPU, seeded
    >>> logits = model(input_ids)                        # (B, T, vocab)
    >>> ids = composer.generate(model, input_ids, 32)    # (B, T + 32), greedy
"""

from composer.blocks.model import HybridModel, ModelOutput
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
from composer.specs.builder import build_model, cast_model, load, model_stats, save
from composer.specs.registry import register

__version__ = "0.1.0"

__all__ = [
    "AttentionConfig",
    "ConfigError",
    "HybridModel",
    "MLPConfig",
    "MambaConfig",
    "ModelConfig",
    "ModelOutput",
    "MoEConfig",
    "Pattern",
    "PatternError",
    "RopeScaling",
    "apply_overrides",
    "build_model",
    "cast_model",
    "generate",
    "load",
    "model_stats",
    "parse_pattern",
    "register",
    "save",
]
