"""Mamba-2's gated, grouped RMSNorm (:class:`composer.blocks.norm.GatedRMSNorm`): mamba_ssm's
Triton kernel on CUDA, else the block's torch math.

    y = w * rms_g(x * silu(z))          (norm_before_gate False: Mamba-2, transformers 5.x)
    y = w * rms_g(x) * silu(z)          (norm_before_gate True: Falcon-H1)

with ``rms_g`` normalising each group of ``group_size`` channels on its own. mamba_ssm's
``rmsnorm_fn(x, weight, bias, z, eps, group_size, norm_before_gate)``
(``mamba_ssm/ops/triton/layernorm_gated.py``, the norm of mamba_ssm's own ``Mamba2``) computes
exactly this in fp32 from ``x``, ``z`` and ``weight`` in their own dtypes, in one pass forward
and one backward, and returns ``x``'s dtype; the wrapper casts that to the dtype the torch path
returns (below), so both paths give the same dtype.
"""

from __future__ import annotations

import torch

from composer.kernels import probe

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def use_gated_norm_kernel(x: torch.Tensor) -> bool:
    """Whether ``x`` takes mamba_ssm's kernel: a CUDA tensor of a kernel dtype, and the kernel
    imports. A CPU tensor never probes."""
    return (probe.on_gpu(x) and x.dtype in KERNEL_DTYPES
            and probe.available("mamba_gated_norm"))


def gated_rms_norm_kernel(x: torch.Tensor, gate: torch.Tensor | None, weight: torch.Tensor,
                          group_size: int, eps: float, norm_before_gate: bool) -> torch.Tensor:
    """mamba_ssm's ``rmsnorm_fn``; the torch path's result dtype (``GatedRMSNorm.forward``):
    ``x``'s when the gate comes after the norm, else ``promote(x, weight)``."""
    fn = probe.module("mamba_gated_norm").rmsnorm_fn
    y = fn(x, weight, None, z=gate, eps=eps, group_size=group_size,
           norm_before_gate=norm_before_gate)
    after = gate is not None and norm_before_gate
    return y.to(x.dtype if after else torch.promote_types(x.dtype, weight.dtype))
