"""The training precision, and what changes the model on meta before it is parallelised: torchao
float8 linears for ``--precision fp8``, the ``--freeze`` parts (:mod:`composer.train.vision`)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from composer.config import ConfigError
from composer.train.vision import freeze


def resolve_precision(asked: str | None, device: torch.device) -> str:
    """``--precision`` (default: bf16 on CUDA, fp32 elsewhere), refused where it cannot run."""
    precision = asked or ("bf16" if device.type == "cuda" else "fp32")
    if precision == "fp8":
        if device.type != "cuda":
            raise ConfigError("--precision fp8 needs a CUDA device (torchao float8 training)")
        try:
            import torchao.float8  # noqa: F401
        except Exception:  # noqa: BLE001 - any import failure means it is not usable
            raise ConfigError("--precision fp8 needs torchao (pip install torchao)") from None
    return precision


def model_transform(precision: str, frozen: list[str]) -> Callable[[torch.nn.Module], None] | None:
    """What changes the model on meta before it is parallelised: float8 linears, frozen parts."""
    if precision != "fp8" and not frozen:
        return None

    def transform(model: torch.nn.Module) -> None:
        if precision == "fp8":
            _fp8(model)
        freeze(model, frozen)

    return transform


def _fp8(model: torch.nn.Module) -> None:
    """torchao float8 training for the linear layers whose shapes suit it (multiples of 16),
    the LM head excepted."""
    from torchao.float8 import convert_to_float8_training

    def keep(module: torch.nn.Module, fqn: str) -> bool:
        ok = isinstance(module, torch.nn.Linear) and "lm_head" not in fqn
        return ok and module.in_features % 16 == 0 and module.out_features % 16 == 0

    convert_to_float8_training(model, module_filter_fn=keep)
