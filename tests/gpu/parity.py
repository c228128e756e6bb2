"""What the GPU tests compare: forward + backward of a function on (rounded) inputs against an
fp64 torch reference on the same inputs; ``err = max|out - ref| / max|ref|`` over the output and
every input gradient. ``DEVICE``: ``cuda``, or what ``COMPOSER_GPU_TESTS_DEVICE`` says (``cpu``:
bench/gpu_check.py's dry run runs these tests' logic on a CPU, where the kernel rows skip)."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch

DEVICE = os.environ.get("COMPOSER_GPU_TESTS_DEVICE", "cuda")
ON_DEVICE = DEVICE != "cuda" or torch.cuda.is_available()
needs_device = pytest.mark.skipif(not ON_DEVICE, reason="no CUDA device")

TOL = {torch.float32: 1e-2, torch.bfloat16: 3e-2, "fp8": 1.5e-1}
"""Bounds on a kernel's ``err``: fp32 1e-2 (the Triton kernels use TF32 operands), bf16 3e-2,
FP8 1.5e-1; the torch path in the same dtype is the baseline, not bounded."""

DTYPES = [torch.float32] if DEVICE != "cuda" else [torch.float32, torch.bfloat16]
TINY = DEVICE != "cuda"  # the CPU run of the logic: tiny shapes


def relerr(got: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.double()
    return ((got.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def fwd_bwd(fn: Callable, leaves: list[torch.Tensor], dtype: torch.dtype,
            seed: int = 7) -> list[torch.Tensor]:
    """``fn(*leaves)`` forward + backward against a fixed random upstream gradient, on copies of
    ``leaves`` cast to ``dtype``; returns ``[out, *grads]``."""
    xs = [t.detach().to(dtype).requires_grad_() for t in leaves]
    out = fn(*xs)
    g = torch.Generator(device=out.device).manual_seed(seed)
    gy = torch.randn(out.shape, generator=g, device=out.device).to(out.dtype)
    out.backward(gy)
    return [out.detach()] + [t.grad for t in xs]


def compare(got: list[torch.Tensor | None], ref: list[torch.Tensor | None]) -> float:
    """The largest :func:`relerr` over outputs and gradients (a missing gradient is infinite)."""
    return max(float("inf") if a is None else relerr(a, b)
               for a, b in zip(got, ref, strict=True) if b is not None)
