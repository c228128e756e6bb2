"""ModuleSpec: which class builds a module, with which extra arguments and submodules.

Borrowed in spirit from Megatron-Core: a spec is data, so swapping an implementation (a kernel
backend, a user's own block) is a change to a table, not to the model code. Every module built
from a spec is called as ``module(cfg, layer_idx, **params, **built_submodules)``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from torch import nn

from composer.config import ModelConfig


@dataclass(frozen=True)
class ModuleSpec:
    module: type[nn.Module]
    params: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    submodules: Mapping[str, ModuleSpec] = field(default_factory=lambda: MappingProxyType({}))


def build_module(spec: ModuleSpec, cfg: ModelConfig, layer_idx: int) -> nn.Module:
    """Instantiate ``spec`` (submodules first)."""
    subs = {name: build_module(sub, cfg, layer_idx) for name, sub in spec.submodules.items()}
    return spec.module(cfg, layer_idx, **spec.params, **subs)
