"""The training precision, and what changes the model on meta before it is parallelised: float8
linears for ``--precision fp8`` (transformer-engine, :mod:`composer.train.fp8_te`, or torchao),
the ``--freeze`` parts (:mod:`composer.train.vision`)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from composer.config import ConfigError
from composer.train.vision import freeze

FP8_BACKENDS = ("te", "torchao")


def _torchao_imports() -> bool:
    try:
        import torchao.float8  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means it is not usable
        return False
    return True


def resolve_precision(asked: str | None, device: torch.device) -> str:
    """``--precision`` (default: bf16 on CUDA, fp32 elsewhere), refused where it cannot run."""
    precision = asked or ("bf16" if device.type == "cuda" else "fp32")
    if precision == "fp8" and device.type != "cuda":
        raise ConfigError("--precision fp8 needs a CUDA device (transformer-engine or torchao "
                          "float8 training)")
    return precision


def resolve_fp8_backend(asked: str | None, precision: str) -> str | None:
    """``--fp8-backend`` under ``--precision fp8`` (default: te when it imports, else torchao);
    None for other precisions. The chosen backend must import here."""
    if precision != "fp8":
        return None
    from composer.train import fp8_te

    backend = asked or ("te" if fp8_te.available() else "torchao")
    if backend == "te" and not fp8_te.available():
        raise ConfigError("--fp8-backend te needs transformer-engine with CUDA (pip install "
                          "transformer-engine[pytorch])")
    if backend == "torchao" and not _torchao_imports():
        raise ConfigError("--precision fp8 needs transformer-engine or torchao (pip install "
                          "torchao)" if asked is None else
                          "--fp8-backend torchao needs torchao (pip install torchao)")
    return backend


def model_transform(precision: str, frozen: list[str], fp8_backend: str | None = "torchao"
                    ) -> Callable[[torch.nn.Module], None] | None:
    """What changes the model on meta before it is parallelised: float8 linears, frozen parts."""
    if precision != "fp8" and not frozen:
        return None

    def transform(model: torch.nn.Module) -> None:
        if precision == "fp8" and fp8_backend == "te":
            from composer.train.fp8_te import swap_linears

            swap_linears(model)
        elif precision == "fp8":
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
