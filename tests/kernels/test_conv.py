"""The torch depthwise causal convolution (composer.kernels.conv.causal_conv1d, tap by tap with
a hand-written backward) against ``F.conv1d`` with causal padding, in fp64: outputs and the
gradients of the input, weight and bias, for an input that is a slice of a wider tensor (as the
Mamba-2 mixer's is), sequences shorter than the kernel, without a bias, and in bf16 against a
bf16 weight's fp32 result."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from composer.kernels.conv import causal_conv1d

F64 = torch.float64


def conv_ref(x_BTC: torch.Tensor, w_C1K: torch.Tensor, b_C: torch.Tensor | None) -> torch.Tensor:
    t, k = x_BTC.shape[1], w_C1K.shape[-1]
    y = F.conv1d(x_BTC.transpose(1, 2), w_C1K, b_C, padding=k - 1, groups=w_C1K.shape[0])
    return y[..., :t].transpose(1, 2)


def _inputs(T: int, K: int, bias: bool, dtype: torch.dtype = F64):
    g = torch.Generator().manual_seed(T * 10 + K)
    wide = torch.randn(2, T, 20, generator=g, dtype=dtype)
    w = torch.randn(12, 1, K, generator=g, dtype=dtype)
    b = torch.randn(12, generator=g, dtype=dtype) if bias else None
    dy = torch.randn(2, T, 12, generator=g, dtype=dtype)
    return wide, w, b, dy


@pytest.mark.parametrize(("T", "K", "bias"), [(9, 4, True), (9, 4, False), (2, 4, True),
                                              (1, 3, True), (7, 1, True)])
def test_matches_conv1d_with_gradients(T: int, K: int, bias: bool) -> None:
    wide, w, b, dy = _inputs(T, K, bias)
    got, want = [], []
    for fn, out in ((causal_conv1d, got), (conv_ref, want)):
        leaves = [t.clone().requires_grad_() for t in (wide, w) + ((b,) if bias else ())]
        x = leaves[0][..., 5:17]  # a strided slice, as the mixer's xBC of in_proj's output
        y = fn(x, leaves[1], leaves[2] if bias else None)
        y.backward(dy)
        out += [y.detach(), *[t.grad for t in leaves]]
    assert got[0].is_contiguous()
    for a, e in zip(got, want, strict=True):
        torch.testing.assert_close(a, e, atol=1e-12, rtol=0)


def test_low_precision_input_computes_in_its_dtype() -> None:
    """A bf16 input with an fp32 weight (autocast's view of a master weight): the arithmetic in
    bf16, as an autocast convolution's; the weight's gradient comes back in fp32."""
    wide, w, b, dy = _inputs(9, 4, True, torch.float32)
    x = wide[..., 5:17].to(torch.bfloat16).requires_grad_()
    w.requires_grad_()
    y = causal_conv1d(x, w, b)
    assert y.dtype == torch.bfloat16
    y.backward(dy.to(torch.bfloat16))
    assert w.grad.dtype == torch.float32
    want = conv_ref(x.detach().float(), w.detach().bfloat16().float(), b.bfloat16().float())
    # bf16 rounding of each of the 4 products and sums: |y| ~ 3, unit roundoff 2^-8
    torch.testing.assert_close(y.float(), want, atol=0.1, rtol=0.02)
