"""RMSNorm and the gated, grouped RMSNorm of Mamba-2.

RMSNorm (Zhang & Sennrich 2019): ``y = w * x / sqrt(mean(x^2) + eps)``, computed in fp32 and cast
back before the weight multiply, as transformers and Megatron do.

Zero-centred RMSNorm (Qwen3-Next, Qwen3.5; Megatron's ``layernorm_zero_centered_gamma``):
``y = (1 + w) * x / sqrt(mean(x^2) + eps)`` with ``w`` stored (initialised to 0), so that weight
decay pulls the scale towards 1 and a bf16 checkpoint's ``w`` is kept exactly. The product runs
in fp32 and is cast once at the end, as transformers' ``Qwen3NextRMSNorm`` does.

Gated RMSNorm (Mamba-2 paper §7, "normalization"): ``y = w * rms_g(x * silu(z))`` where ``rms_g``
normalises each group of ``group_size`` channels on its own. transformers 5.x and Megatron use
``group_size = d_inner / n_groups``; older code normalised over the whole width (one group).
With ``norm_before_gate`` (Falcon-H1's ``mamba_norm_before_gate``) the gate comes after:
``y = w * rms_g(x) * silu(z)``. On CUDA it is mamba_ssm's fused Triton kernel
(:mod:`composer.kernels.norm`), same math and result dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from composer.blocks.plan import ONES, ZEROS, Init
from composer.kernels.norm import gated_rms_norm_kernel, use_gated_norm_kernel


def _math_dtype(x: torch.Tensor) -> torch.dtype:
    """fp32 for half types, fp64 stays fp64 (the reference tests run in fp64)."""
    return torch.promote_types(x.dtype, torch.float32)


class RMSNorm(nn.Module):
    """``weight [d]``; with ``zero_centered`` the scale is ``1 + weight`` (module docstring).
    :class:`~composer.blocks.model.HybridModel` sets ``zero_centered`` on every RMSNorm of the
    model from ``ModelConfig.norm_zero_centered``."""

    def __init__(self, d: int, eps: float = 1e-5, zero_centered: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.zero_centered = zero_centered
        self.weight = nn.Parameter(torch.zeros(d) if zero_centered else torch.ones(d))

    def init_rules(self) -> dict[str, Init]:
        return {"weight": ZEROS if self.zero_centered else ONES}

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        (nn.init.zeros_ if self.zero_centered else nn.init.ones_)(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(_math_dtype(x))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.zero_centered:
            return (h * (1.0 + self.weight.to(h.dtype))).to(x.dtype)
        return self.weight * h.to(x.dtype)


class GatedRMSNorm(nn.Module):
    def __init__(self, d: int, group_size: int, eps: float = 1e-5,
                 norm_before_gate: bool = False) -> None:
        super().__init__()
        if d % group_size:
            raise ValueError(f"group size {group_size} must divide the width {d}")
        self.eps = eps
        self.group_size = group_size
        self.norm_before_gate = norm_before_gate
        self.weight = nn.Parameter(torch.ones(d))

    def init_rules(self) -> dict[str, Init]:
        return {"weight": ONES}

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        if use_gated_norm_kernel(x):  # CUDA: mamba_ssm's fused kernel (composer.kernels.norm)
            return gated_rms_norm_kernel(x, gate, self.weight, self.group_size, self.eps,
                                         self.norm_before_gate)
        h = x.to(_math_dtype(x))
        if gate is not None and not self.norm_before_gate:
            h = h * F.silu(gate.to(h.dtype))
        shape = h.shape
        h = h.view(*shape[:-1], shape[-1] // self.group_size, self.group_size)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if gate is not None and self.norm_before_gate:  # in >= fp32, as transformers does
            return (self.weight * h.view(shape) * F.silu(gate.to(h.dtype))).to(x.dtype)
        return self.weight * h.view(shape).to(x.dtype)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 zero_centered: bool = False) -> torch.Tensor:
    """Plain-math twin of :class:`RMSNorm` (use fp64 inputs)."""
    scale = 1 + weight if zero_centered else weight
    return scale * x / torch.sqrt((x * x).sum(-1, keepdim=True) / x.shape[-1] + eps)


def gated_rms_norm_ref(x: torch.Tensor, z: torch.Tensor | None, weight: torch.Tensor,
                       group_size: int, eps: float) -> torch.Tensor:
    """Plain-math twin of :class:`GatedRMSNorm`: loop over groups, no views."""
    if z is not None:
        x = x * z / (1 + torch.exp(-z))
    out = []
    for g in range(x.shape[-1] // group_size):
        part = x[..., g * group_size:(g + 1) * group_size]
        out.append(part / torch.sqrt((part * part).sum(-1, keepdim=True) / group_size + eps))
    return weight * torch.cat(out, -1)
