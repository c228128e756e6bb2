"""Transformer Engine linears driven by our own parameters (same weights, same keys, no new ones).

TE has no stable functional linear: its autograd function (``_Linear.apply``) takes a long,
release-specific argument list. What is stable is the module ``te.pytorch.Linear(in, out,
bias, params_dtype=..., device=...)`` whose forward reads ``self.weight`` / ``self.bias``. So
:func:`te_linear` keeps, per ``nn.Linear`` of ours, a TE ``Linear`` "shell" built on the meta
device whose ``weight`` and ``bias`` entries are rebound to our ``Parameter`` objects. The shell
is not a submodule (it lives in a weak-keyed side table), so our state dict, optimizer and
parameter count are unchanged, and gradients land on our parameters. Its own state (FP8 scaling
history) is not checkpointed.

In bf16, TE's GEMM is cuBLASLt like torch's, so the gain comes from FP8: run the step under
``te.pytorch.fp8_autocast(enabled=True)`` (H100/H200); that changes numerics (stated tolerance:
``bench/gpu_check.py``) and needs ``in``/``out`` features divisible by 16. Nothing is wired to
this by default; DTensor (tensor-parallel) weights always take the torch path.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import nn

from composer.kernels import probe

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_shells: weakref.WeakKeyDictionary[nn.Linear, nn.Module] = weakref.WeakKeyDictionary()


def te_linear_available(x: torch.Tensor, linear: nn.Linear | None = None) -> bool:
    """Whether :func:`te_linear` would use TE for ``x`` (and ``linear``): a CUDA tensor of a TE
    dtype, plain (non-DTensor) weights, and ``transformer_engine.pytorch`` importable."""
    if not probe.on_gpu(x) or x.dtype not in KERNEL_DTYPES:
        return False
    if linear is not None and hasattr(linear.weight, "to_local"):
        return False
    return probe.available("transformer_engine")


def _shell(linear: nn.Linear) -> nn.Module:
    shell = _shells.get(linear)
    if shell is None:
        te = probe.module("transformer_engine")
        kwargs = dict(bias=linear.bias is not None, params_dtype=linear.weight.dtype)
        try:  # meta: TE defers allocation and init; older releases want a real device
            shell = te.Linear(linear.in_features, linear.out_features, device="meta", **kwargs)
        except Exception:
            shell = te.Linear(linear.in_features, linear.out_features,
                              device=linear.weight.device, **kwargs)
        _shells[linear] = shell
    # Rebind on every call: load_state_dict(assign=True) or to_empty() replace our Parameters.
    # Writing _parameters directly skips TE's register_parameter bookkeeping (init functions).
    if shell._parameters.get("weight") is not linear.weight:
        shell._parameters["weight"] = linear.weight
    if linear.bias is not None and shell._parameters.get("bias") is not linear.bias:
        shell._parameters["bias"] = linear.bias
    return shell


def te_linear(x: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
    """``linear(x)`` through TE when :func:`te_linear_available`, else ``F.linear`` (torch)."""
    if not te_linear_available(x, linear):
        return F.linear(x, linear.weight, linear.bias)
    return _shell(linear)(x)
