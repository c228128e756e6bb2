"""Dense projections on the CPU through oneDNN: ``linear(x, W, b) = x W^T + b``.

PyTorch runs an fp32 ``F.linear`` on the CPU as an MKL ``sgemm``; the oneDNN library that ships
inside the same build (``torch.ops.mkldnn._linear_pointwise``, the op inductor's CPU backend
emits) is faster for these products on the machines we measured: on a 2-core AMD EPYC (AVX-512),
``x W^T`` and ``dy W`` ran 8-10% faster at ``d_model``-sized shapes, 25-30% for a 32k-vocabulary
LM head, and 2-3x for a one-token decoding step against a 32k head, while ``dy^T x`` (the weight
gradient) was as fast or faster on MKL (``bench/RESULTS.md``, 2026-12-04). So
:class:`_OneDNNLinear` takes the forward product and the input gradient from oneDNN and the
weight gradient from ``torch.mm``; both libraries compute in true fp32 (no reduced-precision
accumulation), so the results equal ``F.linear``'s up to the order of the sums.

It is used only where it is plain math on plain tensors (:func:`onednn_ok`): CPU, fp32 input,
weight and bias, no tensor subclass (a ``DTensor`` under tensor parallelism, a float8 or
quantised weight take ``F.linear``, which they dispatch themselves), outside autocast (which
casts ``F.linear``'s inputs), outside ``torch.compile`` (inductor picks its own kernels) and
outside any ``TorchDispatchMode`` (``FlopCounterMode``, selective activation checkpointing's
policy, debug modes: they know ``aten.mm``, and ``--ac selective`` saves exactly its outputs).
``COMPOSER_DISABLE_KERNELS=onednn`` (or ``all``) forces ``F.linear`` everywhere, the reference.
Parameters and state-dict keys are ``nn.Linear``'s: :class:`Linear` is an ``nn.Linear`` whose
forward calls :func:`linear`.

Legend: N rows (tokens), I input features, O output features.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from composer.kernels import probe
from composer.kernels.probe import onednn_present

_PLAIN = (torch.Tensor, nn.Parameter)
__all__ = ["Linear", "linear", "mm_nn", "mm_nt", "onednn_ok", "onednn_present"]


def onednn_ok(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether :func:`linear` takes oneDNN for these operands (module docstring)."""
    f32 = torch.float32
    return (x.device.type == "cpu" and x.dtype == f32 and weight.dtype == f32
            and type(x) is torch.Tensor and type(weight) in _PLAIN and weight.dim() == 2
            and weight.device.type == "cpu"
            and (bias is None or (type(bias) in _PLAIN and bias.dtype == f32))
            and x.numel() > 0 and weight.numel() > 0
            and not torch.is_autocast_enabled("cpu") and not torch.compiler.is_compiling()
            and torch._C._len_torch_dispatch_stack() == 0
            and probe.available("onednn"))


def _mm_t(a_NI: torch.Tensor, w_OI: torch.Tensor, b_O: torch.Tensor | None) -> torch.Tensor:
    """``a W^T (+ b)`` by oneDNN; ``a`` 2-D (made contiguous), ``w`` any 2-D layout."""
    return torch.ops.mkldnn._linear_pointwise(a_NI.contiguous(), w_OI, b_O, "none", [], "")


def _product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x W^T + b`` by oneDNN for ``x`` of any leading shape."""
    return _mm_t(x.reshape(-1, x.shape[-1]), weight, bias).view(*x.shape[:-1], weight.shape[0])


def mm_nt(a_NI: torch.Tensor, w_OI: torch.Tensor) -> torch.Tensor:
    """``a @ w.T`` for 2-D plain tensors: oneDNN where :func:`onednn_ok`, else ``torch.mm``
    (for callers that write their own backward, e.g. the fused LM-head loss)."""
    if onednn_ok(a_NI, w_OI, None):
        return _mm_t(a_NI, w_OI, None)
    return a_NI @ w_OI.T


def mm_nn(a_NO: torch.Tensor, w_OI: torch.Tensor) -> torch.Tensor:
    """``a @ w`` for 2-D plain tensors (an input gradient): oneDNN where :func:`onednn_ok`."""
    if onednn_ok(a_NO, w_OI, None):
        return _mm_t(a_NO, w_OI.T, None)
    return a_NO @ w_OI


class _OneDNNLinear(torch.autograd.Function):
    """``x W^T + b`` with ``x`` of any leading shape; ``dx = dy W`` by oneDNN, ``dW = dy^T x``
    and ``db = sum(dy)`` by torch. Saves what ``F.linear`` saves (``x`` and ``W``)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
        x_NI = x.reshape(-1, x.shape[-1])  # a copy only for a non-viewable x: made once
        ctx.save_for_backward(x_NI if weight.requires_grad else None,
                              weight if x.requires_grad else None)
        ctx.x_shape = x.shape
        ctx.has_bias = bias is not None
        return _mm_t(x_NI, weight, bias).view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, dy: torch.Tensor):
        x_NI, weight = ctx.saved_tensors
        dy_NO = dy.reshape(-1, dy.shape[-1])
        need_x, need_w, need_b = ctx.needs_input_grad
        dx = _mm_t(dy_NO, weight.T, None).view(ctx.x_shape) if need_x else None
        dw = torch.mm(dy_NO.T, x_NI) if need_w else None
        db = dy_NO.sum(0) if ctx.has_bias and need_b else None
        return dx, dw, db


def linear(x: torch.Tensor, weight: torch.Tensor,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, by oneDNN on the CPU where :func:`onednn_ok`."""
    if not onednn_ok(x, weight, bias):
        return F.linear(x, weight, bias)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                    or (bias is not None and bias.requires_grad)):
        return _OneDNNLinear.apply(x, weight, bias)
    return _product(x, weight, bias)  # no graph: Function.apply would add ~20 us per call


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, keys, init and parallel plans) computed by :func:`linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
