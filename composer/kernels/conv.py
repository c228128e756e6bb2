"""Mamba-2's depthwise causal convolution with SiLU: causal_conv1d's CUDA kernel, else torch.

    y[b, t, c] = silu(bias[c] + sum_k w[c, k] * x[b, t - (K - 1) + k, c])   (x = 0 before t = 0)

Our activations are ``(B, T, C)`` and the weight ``(C, 1, K)`` (``nn.Conv1d``'s depthwise
layout, the canonical ``conv1d.weight``); ``causal_conv1d_fn`` takes ``x`` as ``(B, C, T)``, the
weight as ``(C, K)`` and ``activation="silu"``. A ``(B, T, C)`` tensor transposed is its
"channel-last" layout, which the kernel accepts without a copy when ``C`` and the strides are
multiples of 8 (its own checks); otherwise we hand it a contiguous ``(B, C, T)`` copy. The kernel
wants weight and bias in one dtype and supports widths 2 to 4; other widths take the torch path.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from composer.kernels import probe

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
KERNEL_WIDTHS = (2, 3, 4)

ConvFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def conv1d_silu_torch(x_BTC: torch.Tensor, weight_C1K: torch.Tensor,
                      bias_C: torch.Tensor | None) -> torch.Tensor:
    """Torch path (the same ops as ``SplitCausalConv1d.forward``, then SiLU)."""
    t, k = x_BTC.shape[1], weight_C1K.shape[-1]
    y = F.conv1d(x_BTC.transpose(1, 2), weight_C1K, bias_C, padding=k - 1,
                 groups=weight_C1K.shape[0])
    return F.silu(y[..., :t].transpose(1, 2))


def _channel_last_ok(x_BCT: torch.Tensor) -> bool:
    """causal_conv1d's conditions for reading a transposed ``(B, T, C)`` tensor in place."""
    return (x_BCT.stride(1) == 1 and x_BCT.shape[1] % 8 == 0
            and x_BCT.stride(0) % 8 == 0 and x_BCT.stride(2) % 8 == 0)


def conv1d_silu_kernel(x_BTC: torch.Tensor, weight_C1K: torch.Tensor,
                       bias_C: torch.Tensor | None) -> torch.Tensor:
    """causal_conv1d's ``causal_conv1d_fn(x (B, C, T), weight (C, K), bias, activation="silu")``;
    returns ``(B, T, C)`` (a transposed view, as the torch path does)."""
    fn = probe.module("causal_conv1d").causal_conv1d_fn
    x_BCT = x_BTC.transpose(1, 2)
    if not _channel_last_ok(x_BCT):
        x_BCT = x_BCT.contiguous()
    weight_CK = weight_C1K[:, 0, :].to(x_BTC.dtype)
    bias_C = bias_C.to(x_BTC.dtype) if bias_C is not None else None
    return fn(x_BCT, weight_CK, bias_C, activation="silu").transpose(1, 2)


def select_conv(x_BTC: torch.Tensor, width: int) -> ConvFn:
    """:func:`conv1d_silu_kernel` for a CUDA ``x`` of a kernel dtype and a supported ``width``
    when causal_conv1d imports, else :func:`conv1d_silu_torch`. CPU tensors never probe."""
    if (probe.on_gpu(x_BTC) and x_BTC.dtype in KERNEL_DTYPES and width in KERNEL_WIDTHS
            and probe.available("causal_conv1d")):
        return conv1d_silu_kernel
    return conv1d_silu_torch


def _width(conv: nn.Module) -> int:
    kernel = getattr(conv, "kernel", None)  # SplitCausalConv1d
    return kernel if kernel is not None else conv.kernel_size[0]


def _conv_params(conv: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """This rank's ``(C, 1, K)`` weight and bias of a ``SplitCausalConv1d`` or ``nn.Conv1d``."""
    if hasattr(conv, "fused_weight"):
        return conv.fused_weight(), conv.fused_bias()
    return conv.weight, conv.bias


def conv_silu(x_BTC: torch.Tensor, conv: nn.Module) -> torch.Tensor:
    """The mixer's hook: ``silu(conv(x))``. The torch path calls the module itself (so whatever
    its ``forward`` does on CPU stays); the kernel path reads the module's weight and bias."""
    fn = select_conv(x_BTC, _width(conv))
    if fn is conv1d_silu_torch:
        return F.silu(conv(x_BTC))
    return fn(x_BTC, *_conv_params(conv))
