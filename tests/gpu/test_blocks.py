"""Whole blocks on a GPU through their composer.kernels hooks (moved from bench/gpu_check.py):
the Mamba-2 mixer (mamba_ssm) and the attention block (an SDPA GPU backend), forward and
backward, fp32 and bf16, must dispatch to the kernel and stay within ``TOL`` of the block run in
fp64 on the same rounded weights and inputs."""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Callable

import pytest
import torch

from composer.kernels import conv as kconv
from composer.kernels import probe
from composer.kernels import scan as kscan
from composer.kernels import sdpa as ksdpa
from tests.gpu.parity import DEVICE, DTYPES, TOL, compare, needs_device
from tests.gpu.test_kernels import BLOCK_SET, TINY

pytestmark = needs_device


class count_dispatch:
    """Counts the calls that reach each kernel wrapper (they are looked up at call time)."""

    def __enter__(self) -> dict[str, int]:
        self.counts = {"mamba_ssm": 0, "causal_conv1d": 0, "sdpa on GPU": 0}
        self.saved = (kscan.ssd_scan_kernel, kconv.conv1d_silu_kernel, ksdpa.sdpa_backends)

        def counted(key: str, fn: Callable, hit: Callable = lambda r: True) -> Callable:
            def wrapper(*a, **kw):
                out = fn(*a, **kw)
                self.counts[key] += bool(hit(out))
                return out
            return wrapper

        kscan.ssd_scan_kernel = counted("mamba_ssm", self.saved[0])
        kconv.conv1d_silu_kernel = counted("causal_conv1d", self.saved[1])
        ksdpa.sdpa_backends = counted("sdpa on GPU", self.saved[2], lambda r: r is not None)
        return self.counts

    def __exit__(self, *exc) -> None:
        kscan.ssd_scan_kernel, kconv.conv1d_silu_kernel, ksdpa.sdpa_backends = self.saved


def block_run(block, x: torch.Tensor, gy: torch.Tensor) -> list:
    block.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    out = block(x)
    out.backward(gy.to(out.dtype))
    return [out.detach(), x.grad] + [p.grad for p in block.parameters()]


def cast_block(block, dtype: torch.dtype):
    block = copy.deepcopy(block)
    keep = set(getattr(block, "keep_fp32", ()))
    for name, p in block.named_parameters():
        p.data = p.data.to(torch.float32 if name in keep else dtype)
    return block


@pytest.fixture
def kernels_on():
    """The kernels enabled (whatever the environment disabled), restored afterwards."""
    saved = os.environ.pop(probe.ENV_DISABLE, None)
    probe.reset()
    yield
    if saved is not None:
        os.environ[probe.ENV_DISABLE] = saved
    probe.reset()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["mamba2", "attention", "window"])
def test_block_dispatches_and_matches_fp64(kind: str, dtype: torch.dtype, kernels_on) -> None:
    """``window``: sliding-window attention (``W``), SDPA with the window's boolean mask."""
    from composer import ModelConfig, apply_overrides
    from composer.blocks.attention import Attention, WindowedAttention
    from composer.blocks.mamba2 import Mamba2Mixer

    if DEVICE != "cuda":
        pytest.skip("CPU: the torch path by design")
    cls, key = {"mamba2": (Mamba2Mixer, "mamba_ssm"), "attention": (Attention, "sdpa on GPU"),
                "window": (WindowedAttention, "sdpa on GPU")}[kind]
    if key == "mamba_ssm" and not probe.available("mamba_ssm"):
        pytest.skip(f"mamba_ssm: {probe.why_unavailable('mamba_ssm')}")
    window = {"attention.window": 16 if TINY else 512}
    cfg = apply_overrides(ModelConfig(pattern="M*W"),
                          [f"{k}={json.dumps(v)}" for k, v in {**BLOCK_SET, **window}.items()])
    block = cls(cfg).to(DEVICE)
    block.reset_parameters(torch.Generator(device=DEVICE).manual_seed(3))
    g = torch.Generator(device=DEVICE).manual_seed(4)
    T = 64 if TINY else 2048
    x = torch.randn(2, T, cfg.d_model, generator=g, device=DEVICE)
    gy = torch.randn(2, T, cfg.d_model, generator=g, device=DEVICE)
    blk = cast_block(block, dtype)
    ref = block_run(cast_block(blk, torch.float64), x.to(dtype).double(), gy)
    block_run(blk, x.to(dtype), gy)  # warm-up (Triton compiles, autotunes)
    with count_dispatch() as counts:
        got = block_run(blk, x.to(dtype), gy)
    assert counts[key], f"not wired: no {key} dispatch (see composer.kernels)"
    assert compare(got, ref) <= TOL[dtype]
