"""Which optional kernels this process may use: lazy, cached import probes and the device rule.

docs/kernels.md: optional kernels are looked up on first use, never at import, and chosen per
call by the tensors' device. On a machine without CUDA, ``transformer_engine`` installs as a shell
whose import raises ``RuntimeError`` and ``mamba_ssm`` / ``causal_conv1d`` install without their
CUDA parts, so a probe catches every ``Exception``. Callers test :func:`on_gpu` first, so a CPU
tensor never even triggers a probe (and never imports an optional package). The one CPU kernel,
``onednn`` (:mod:`composer.kernels.linear`), is part of the torch build: nothing is imported.

``COMPOSER_DISABLE_KERNELS`` (comma-separated names from :data:`KERNELS`, or ``all``) forces the
torch path. Probe results, the variable included, are cached for the life of the process; call
:func:`reset` after changing it in-process.
"""

from __future__ import annotations

import importlib
import os
import warnings
from types import ModuleType

import torch

ENV_DISABLE = "COMPOSER_DISABLE_KERNELS"

KERNELS: dict[str, str | None] = {
    "mamba_ssm": "mamba_ssm.ops.triton.ssd_combined",  # the SSD chunked scan (Triton)
    "mamba_gated_norm": "mamba_ssm.ops.triton.layernorm_gated",  # the gated RMSNorm (Triton)
    "selective_scan": "mamba_ssm.ops.selective_scan_interface",  # Mamba-1's scan (CUDA)
    "causal_conv1d": "causal_conv1d",  # the depthwise causal conv + SiLU (CUDA)
    "transformer_engine": "transformer_engine.pytorch",  # te.Linear (cuBLASLt, FP8)
    "flash": None,  # torch's own fused SDPA kernels: nothing to import, only a switch
    "flex": "torch.nn.attention.flex_attention",  # masked attention by block masks (torch)
    "onednn": None,  # fp32 CPU linears by oneDNN inside torch (kernels.linear): the CPU's one
    "fla": "fla.ops.gated_delta_rule",  # the chunked gated delta rule (Triton)
    "fla_kda": "fla.ops.kda",  # the chunked Kimi delta attention (Triton)
}
"""Kernel name -> the module whose successful import makes it available."""

CPU_KERNELS = frozenset({"onednn"})
"""The kernels for CPU tensors (part of the torch build): probed on a CPU call, importing
nothing; every other kernel is probed only for CUDA tensors (:func:`on_gpu`)."""

_available: dict[str, bool] = {}
_modules: dict[str, ModuleType] = {}
_errors: dict[str, str] = {}


def on_gpu(t: torch.Tensor) -> bool:
    """The device rule: kernels run only on CUDA tensors. The one place it is decided (tests
    monkeypatch it to emulate a GPU)."""
    return t.is_cuda


def disabled_names() -> set[str]:
    """Names switched off by ``COMPOSER_DISABLE_KERNELS`` (all of them for ``all``)."""
    raw = {n.strip().lower() for n in os.environ.get(ENV_DISABLE, "").split(",") if n.strip()}
    if "all" in raw:
        return set(KERNELS)
    unknown = raw - set(KERNELS)
    if unknown:
        warnings.warn(f"{ENV_DISABLE}: unknown kernel name(s) {sorted(unknown)}; known: "
                      f"{', '.join(KERNELS)} or all", stacklevel=3)
    return raw & set(KERNELS)


def onednn_present() -> bool:
    """This torch build has oneDNN and its linear op (``composer.kernels.linear``)."""
    return bool(torch.backends.mkldnn.is_available()
                and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def available(name: str) -> bool:
    """Whether kernel ``name`` imports here and is not disabled (cached after the first call)."""
    if name not in KERNELS:
        raise ValueError(f"unknown kernel {name!r}; known: {', '.join(KERNELS)}")
    if name not in _available:
        _available[name] = _probe(name)
    return _available[name]


def _probe(name: str) -> bool:
    if name in disabled_names():
        _errors[name] = f"disabled by {ENV_DISABLE}"
        return False
    path = KERNELS[name]
    if name == "onednn" and not onednn_present():  # part of the torch build, not a package
        _errors[name] = "this torch build has no oneDNN (torch.backends.mkldnn)"
        return False
    if path is None:
        return True
    try:
        _modules[name] = importlib.import_module(path)
    except Exception as e:  # ImportError, and RuntimeError from CUDA-less shells (docs/kernels.md)
        _errors[name] = f"{type(e).__name__}: {e}"
        return False
    return True


def module(name: str) -> ModuleType:
    """The imported module of an available kernel (its functions are looked up on each call)."""
    if not available(name):
        raise RuntimeError(f"kernel {name!r} is not available: {_errors.get(name, '?')}")
    return _modules[name]


def why_unavailable(name: str) -> str | None:
    """The reason :func:`available` said no (the import error, or the variable), else ``None``."""
    return None if available(name) else _errors.get(name)


def reset() -> None:
    """Forget the cached probes (after changing ``COMPOSER_DISABLE_KERNELS`` or ``sys.modules``)."""
    _available.clear()
    _modules.clear()
    _errors.clear()
