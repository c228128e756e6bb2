"""Mamba-2's depthwise causal convolution with SiLU: causal_conv1d's CUDA kernel, else torch.

    y[b, t, c] = silu(bias[c] + sum_k w[c, k] * x[b, t - (K - 1) + k, c])   (x = 0 before t = 0)

Our activations are ``(B, T, C)`` and the weight ``(C, 1, K)`` (``nn.Conv1d``'s depthwise
layout, the canonical ``conv1d.weight``); ``causal_conv1d_fn`` takes ``x`` as ``(B, C, T)``, the
weight as ``(C, K)`` and ``activation="silu"``. A ``(B, T, C)`` tensor transposed is its
"channel-last" layout, which the kernel accepts without a copy when ``C`` and the strides are
multiples of 8 (its own checks); otherwise we hand it a contiguous ``(B, C, T)`` copy. The kernel
wants weight and bias in one dtype and supports widths 2 to 4; other widths take the torch path.

Packed documents (``doc_ids``, :mod:`composer.kernels.packing`): a tap that would read an input of
an earlier document reads 0 instead, as if each document were convolved alone (the kernel's
``seq_idx``; it takes ``seq_idx`` only in the channel-last layout, so we hand it one, and a
channel count that is not a multiple of 8 takes the torch path).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from composer.kernels import probe
from composer.kernels.packing import doc_positions, seq_idx

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
KERNEL_WIDTHS = (2, 3, 4)

ConvFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


class _CausalConv1d(torch.autograd.Function):
    """``y[t] = bias + sum_lag w[K - 1 - lag] * x[t - lag]`` on ``(B, T, C)`` itself: one
    multiply-add over the tensor per tap, forward and backward (``dx[t] = sum_lag w[K - 1 - lag]
    * dy[t + lag]``, ``dw[K - 1 - lag] = sum_{b, t} dy[t] * x[t - lag]``). ``F.conv1d`` wants
    ``(B, C, T)``: the transposes to it and back, and its depthwise kernel (forward and
    backward), cost 1.6x this on a CPU (``bench/RESULTS.md``). The arithmetic is in ``x``'s
    dtype (weight and bias cast to it, as autocast casts a convolution's); the gradients of the
    weight and bias come back in their own dtypes."""

    @staticmethod
    def forward(ctx: Any, x_BTC: torch.Tensor, weight_C1K: torch.Tensor,
                bias_C: torch.Tensor | None) -> torch.Tensor:
        t, k = x_BTC.shape[1], weight_C1K.shape[-1]
        w_KC = weight_C1K[:, 0, :].T.to(x_BTC.dtype).contiguous()
        if bias_C is None:
            y_BTC = x_BTC * w_KC[k - 1]
        else:
            y_BTC = torch.addcmul(bias_C.to(x_BTC.dtype), x_BTC, w_KC[k - 1])
        for lag in range(1, min(k, t)):
            y_BTC[:, lag:].addcmul_(x_BTC[:, :t - lag], w_KC[k - 1 - lag])
        ctx.save_for_backward(x_BTC, w_KC)
        ctx.dtypes = (weight_C1K.dtype, None if bias_C is None else bias_C.dtype)
        return y_BTC

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, dy_BTC: torch.Tensor):
        x_BTC, w_KC = ctx.saved_tensors
        t, k = x_BTC.shape[1], w_KC.shape[0]
        want_x, want_w, want_b = ctx.needs_input_grad
        dx_BTC = dw_C1K = db_C = None
        if want_x:
            dx_BTC = dy_BTC * w_KC[k - 1]
            for lag in range(1, min(k, t)):
                dx_BTC[:, :t - lag].addcmul_(dy_BTC[:, lag:], w_KC[k - 1 - lag])
        if want_w:
            dw_KC = w_KC.new_zeros(w_KC.shape)
            for lag in range(min(k, t)):
                dw_KC[k - 1 - lag] = (dy_BTC[:, lag:] * x_BTC[:, :t - lag]).sum((0, 1))
            dw_C1K = dw_KC.T[:, None, :].to(ctx.dtypes[0])
        if want_b:
            db_C = dy_BTC.sum((0, 1)).to(ctx.dtypes[1])
        return dx_BTC, dw_C1K, db_C


def causal_conv1d(x_BTC: torch.Tensor, weight_C1K: torch.Tensor,
                  bias_C: torch.Tensor | None) -> torch.Tensor:
    """The depthwise causal convolution in torch (no activation), ``(B, T, C)`` in and out
    (contiguous out): :class:`_CausalConv1d`."""
    return _CausalConv1d.apply(x_BTC, weight_C1K, bias_C)


def conv1d_silu_torch(x_BTC: torch.Tensor, weight_C1K: torch.Tensor,
                      bias_C: torch.Tensor | None) -> torch.Tensor:
    """Torch path: :func:`causal_conv1d`, then SiLU."""
    return F.silu(causal_conv1d(x_BTC, weight_C1K, bias_C))


def causal_conv1d_docs(x_BTC: torch.Tensor, weight_C1K: torch.Tensor, bias_C: torch.Tensor | None,
                      doc_ids_BT: torch.Tensor) -> torch.Tensor:
    """The depthwise causal convolution (no activation) inside each document: one
    multiply-add per tap, the tap ``lag`` steps back kept only where the token is at least
    ``lag`` steps into its document."""
    t, k = x_BTC.shape[1], weight_C1K.shape[-1]
    pos_BT1 = doc_positions(doc_ids_BT)[..., None]
    w_KC = weight_C1K[:, 0, :].T.to(x_BTC.dtype)
    y_BTC = x_BTC * w_KC[k - 1]
    for lag in range(1, min(k, t)):
        shifted_BTC = F.pad(x_BTC[:, : t - lag], (0, 0, lag, 0))
        y_BTC = y_BTC + shifted_BTC.masked_fill(pos_BT1 < lag, 0.0) * w_KC[k - 1 - lag]
    return y_BTC if bias_C is None else y_BTC + bias_C.to(x_BTC.dtype)


def _channel_last_ok(x_BCT: torch.Tensor) -> bool:
    """causal_conv1d's conditions for reading a transposed ``(B, T, C)`` tensor in place."""
    return (x_BCT.stride(1) == 1 and x_BCT.shape[1] % 8 == 0
            and x_BCT.stride(0) % 8 == 0 and x_BCT.stride(2) % 8 == 0)


def conv1d_silu_kernel(x_BTC: torch.Tensor, weight_C1K: torch.Tensor,
                       bias_C: torch.Tensor | None,
                       doc_ids_BT: torch.Tensor | None = None) -> torch.Tensor:
    """causal_conv1d's ``causal_conv1d_fn(x (B, C, T), weight (C, K), bias, seq_idx,
    activation="silu")``; returns ``(B, T, C)`` (a transposed view, as the torch path does)."""
    fn = probe.module("causal_conv1d").causal_conv1d_fn
    x_BCT = x_BTC.transpose(1, 2)
    if not _channel_last_ok(x_BCT):
        # seq_idx needs channel-last: a contiguous (B, T, C) copy, transposed, is one
        x_BCT = x_BCT.contiguous() if doc_ids_BT is None else x_BTC.contiguous().transpose(1, 2)
    weight_CK = weight_C1K[:, 0, :].to(x_BTC.dtype)
    bias_C = bias_C.to(x_BTC.dtype) if bias_C is not None else None
    if doc_ids_BT is None:
        return fn(x_BCT, weight_CK, bias_C, activation="silu").transpose(1, 2)
    return fn(x_BCT, weight_CK, bias_C, seq_idx=seq_idx(doc_ids_BT),
              activation="silu").transpose(1, 2)


def select_conv(x_BTC: torch.Tensor, width: int, docs: bool = False) -> ConvFn:
    """:func:`conv1d_silu_kernel` for a CUDA ``x`` of a kernel dtype and a supported ``width``
    (and, with packed documents, ``C`` a multiple of 8) when causal_conv1d imports, else
    :func:`conv1d_silu_torch`. CPU tensors never probe."""
    if (probe.on_gpu(x_BTC) and x_BTC.dtype in KERNEL_DTYPES and width in KERNEL_WIDTHS
            and (not docs or x_BTC.shape[-1] % 8 == 0) and probe.available("causal_conv1d")):
        return conv1d_silu_kernel
    return conv1d_silu_torch


def _width(conv: nn.Module) -> int:
    kernel = getattr(conv, "kernel", None)  # SplitCausalConv1d
    return kernel if kernel is not None else conv.kernel_size[0]


def _conv_params(conv: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """This rank's ``(C, 1, K)`` weight and bias of a ``SplitCausalConv1d`` or ``nn.Conv1d``."""
    if hasattr(conv, "fused_weight"):  # each part's shard: a cat of DTensors would gather them
        weight = torch.cat([_local(w) for w in conv.weights()])
        biases = [_local(b) for b in conv.biases()]
        return weight, torch.cat(biases) if biases else None
    return _local(conv.weight), None if conv.bias is None else _local(conv.bias)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A tensor-parallel rank's shard of a weight read outside its module's forward (where it
    is a DTensor; inside, the module's local view already is the shard)."""
    return t.to_local() if hasattr(t, "to_local") else t


def conv_silu(x_BTC: torch.Tensor, conv: nn.Module,
              doc_ids: torch.Tensor | None = None) -> torch.Tensor:
    """The mixer's hook: ``silu(conv(x))``. The torch path calls the module itself (so whatever
    its ``forward`` does on CPU stays; with ``doc_ids`` it must take them, as
    ``SplitCausalConv1d`` does); the kernel path reads the module's weight and bias."""
    fn = select_conv(x_BTC, _width(conv), docs=doc_ids is not None)
    if fn is conv1d_silu_torch:
        if doc_ids is None:
            return F.silu(conv(x_BTC))
        return F.silu(conv(x_BTC, doc_ids=doc_ids))
    if doc_ids is None:
        return fn(x_BTC, *_conv_params(conv))
    return fn(x_BTC, *_conv_params(conv), doc_ids)


# ---------------------------------------------------------------- decoding (inference caches)

def conv_continue(x_BTC: torch.Tensor, conv: nn.Module, window_BCW: torch.Tensor,
                  update: bool = False) -> torch.Tensor:
    """``silu(conv(x))`` for tokens that continue a sequence whose last ``K - 1`` inputs are
    ``window`` (channels before time, causal_conv1d's ``conv_state`` layout): the convolution
    of ``[window, x]`` without padding, ``T`` outputs. ``update``: also move the window on by
    the new inputs (what :func:`keep_window` does, from the same concatenation)."""
    weight_C1K, bias_C = _conv_params(conv)
    full_BCL = torch.cat([window_BCW.to(x_BTC.dtype), x_BTC.transpose(1, 2)], dim=-1)
    if update and window_BCW.shape[-1]:
        window_BCW.copy_(full_BCL[..., full_BCL.shape[-1] - window_BCW.shape[-1]:])
    if x_BTC.shape[1] == 1:  # one decoding step: a dot product per channel (no conv setup)
        y_BC = (full_BCL * weight_C1K[:, 0].to(x_BTC.dtype)).sum(-1)
        if bias_C is not None:
            y_BC = y_BC + bias_C.to(x_BTC.dtype)
        return F.silu(y_BC)[:, None]
    y_BCT = F.conv1d(full_BCL, weight_C1K.to(x_BTC.dtype),
                     None if bias_C is None else bias_C.to(x_BTC.dtype),
                     groups=weight_C1K.shape[0])
    return F.silu(y_BCT.transpose(1, 2))


def keep_window(window_BCW: torch.Tensor, x_BTC: torch.Tensor, doc_ids_BT: torch.Tensor | None,
                fresh: bool) -> None:
    """Write the last ``W`` conv inputs into ``window`` (in place): of ``[window, x]``, or of
    ``[0, x]`` when ``fresh``. With ``doc_ids`` only the last document's inputs count (earlier
    ones, e.g. left padding, read as 0, as the convolution itself reads them)."""
    w = window_BCW.shape[-1]
    if w == 0:
        return
    x_BCT = x_BTC.transpose(1, 2)
    if doc_ids_BT is not None:
        x_BCT = x_BCT * (doc_ids_BT == doc_ids_BT[:, -1:])[:, None, :].to(x_BCT.dtype)
    prev_BCW = torch.zeros_like(window_BCW) if fresh else window_BCW
    full_BCL = torch.cat([prev_BCW, x_BCT.to(window_BCW.dtype)], dim=-1)
    window_BCW.copy_(full_BCL[..., full_BCL.shape[-1] - w:])
