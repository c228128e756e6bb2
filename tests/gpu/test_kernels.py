"""composer.kernels on a GPU against the torch path (moved from bench/gpu_check.py's ``kernels``
phase, which keeps only the timing): the SSD scan (mamba_ssm), causal conv + SiLU
(causal_conv1d), SDPA per backend and the hook's choice, the delta rule (fla's gated delta rule
and Kimi delta attention kernels), and whole
blocks (Mamba-2 mixer, attention) through their hooks, forward and backward, fp32 and bf16, each
within ``TOL`` of an fp64 torch reference on the same rounded inputs. Skipped without CUDA, and
per kernel when it does not import."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from composer import kernels
from composer.kernels import conv as kconv
from composer.kernels import probe
from composer.kernels import scan as kscan
from composer.kernels import sdpa as ksdpa
from tests.gpu.parity import DEVICE, DTYPES, TINY, TOL, compare, fwd_bwd, needs_device

pytestmark = needs_device

# the widths of bench/gpu_check.py's 1.0B hybrid (its MODEL), or tiny ones on a CPU
S = (dict(b=1, T=50, H=4, P=8, G=2, N=8, L=16, heads=4, kv=2, Tq=32, d=32) if TINY else
     dict(b=2, T=2000, H=64, P=64, G=8, N=128, L=128, heads=16, kv=4, Tq=2048, d=128))
BLOCK_SET = {"d_model": 64, "attention.n_heads": 4, "attention.n_kv_heads": 2,
             "attention.d_head": 16, "mamba.n_heads": 4, "mamba.d_head": 32, "mamba.n_groups": 2,
             "mamba.d_state": 16, "mamba.chunk_size": 16} if TINY else {
    "d_model": 2048, "attention.n_heads": 16, "attention.n_kv_heads": 4, "attention.d_head": 128,
    "mamba.n_heads": 64, "mamba.d_head": 64, "mamba.n_groups": 8, "mamba.d_state": 128,
    "mamba.chunk_size": 128}


def need(kernel: str) -> None:
    if DEVICE != "cuda" or not probe.available(kernel):
        pytest.skip(f"{kernel}: {probe.why_unavailable(kernel) or 'CPU tensor'}")


def scan_case() -> tuple[list[torch.Tensor], Callable[[Callable], Callable]]:
    g = torch.Generator(device=DEVICE).manual_seed(0)
    b, T, H, P, G, N = S["b"], S["T"], S["H"], S["P"], S["G"], S["N"]

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=DEVICE)

    A = -torch.exp(torch.rand(H, generator=g, device=DEVICE) * math.log(16))
    leaves = [r(b, T, H, P), r(b, T, H) - 2, r(b, T, G, N), r(b, T, G, N), r(H), 0.5 * r(H)]

    def make(fn: Callable) -> Callable:
        return lambda x, dt, B, C, D, bias: fn(
            x, dt, A.to(torch.promote_types(x.dtype, torch.float32)), B, C, S["L"], D_H=D,
            dt_bias_H=bias, dt_softplus=True, dt_limit=(1e-3, float("inf")))
    return leaves, make


@pytest.mark.parametrize("dtype", DTYPES)
def test_ssd_scan_kernel_matches_fp64(dtype: torch.dtype) -> None:
    need("mamba_ssm")
    leaves, make = scan_case()
    rounded = [t.to(dtype) for t in leaves]
    ref = fwd_bwd(make(kscan.ssd_scan_torch), rounded, torch.float64)
    assert compare(fwd_bwd(make(kscan.ssd_scan_kernel), rounded, dtype), ref) <= TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_causal_conv_kernel_matches_fp64(dtype: torch.dtype) -> None:
    need("causal_conv1d")
    g = torch.Generator(device=DEVICE).manual_seed(1)
    C, E = S["H"] * S["P"] + 2 * S["G"] * S["N"], S["H"] * S["P"]
    wide = torch.randn(S["b"], S["T"], E + C + S["H"], generator=g, device=DEVICE)
    weight = 0.5 * torch.randn(C, 1, 4, generator=g, device=DEVICE)
    bias = 0.1 * torch.randn(C, generator=g, device=DEVICE)

    def make(fn: Callable) -> Callable:  # the mixer's input: a slice of in_proj's output
        return lambda w, wt, bs: fn(w[..., E:E + C], wt, bs)

    rounded = [t.to(dtype) for t in (wide, weight, bias)]
    ref = fwd_bwd(make(kconv.conv1d_silu_torch), rounded, torch.float64)
    got = fwd_bwd(make(kconv.conv1d_silu_kernel), rounded, dtype)
    assert compare(got, ref) <= TOL[dtype]


SDPA = [b.name.lower() for b in ksdpa.GPU_ORDER] + ["hook"]


@pytest.mark.parametrize("backend", SDPA)
@pytest.mark.parametrize("dtype", DTYPES)
def test_sdpa_backend_matches_fp64(dtype: torch.dtype, backend: str) -> None:
    g = torch.Generator(device=DEVICE).manual_seed(2)
    q = torch.randn(S["b"], S["heads"], S["Tq"], S["d"], generator=g, device=DEVICE)
    k, v = (torch.randn(S["b"], S["kv"], S["Tq"], S["d"], generator=g, device=DEVICE)
            for _ in range(2))

    def attn(ctx: Callable) -> Callable:
        def fn(q, k, v):
            with ctx(q):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return fn

    rounded = [t.to(dtype) for t in (q, k, v)]
    ref = fwd_bwd(attn(lambda q: sdpa_kernel([SDPBackend.MATH])), rounded, torch.float64)
    named = {b.name.lower(): (lambda q, b=b: sdpa_kernel([b])) for b in ksdpa.GPU_ORDER}
    ctx = kernels.sdpa_context if backend == "hook" else named[backend]
    try:
        got = fwd_bwd(attn(ctx), rounded, dtype)
    except RuntimeError as e:  # a backend that does not take these shapes or this dtype
        pytest.skip(f"{backend} unsupported here: {e!s:.80}")
    assert compare(got, ref) <= TOL[dtype]




@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("kernel", "per_channel"), [("fla", False), ("fla_kda", True)],
                         ids=["gdn", "kda"])
def test_delta_rule_kernel_matches_fp64(dtype: torch.dtype, kernel: str,
                                        per_channel: bool) -> None:
    """fla's ``chunk_gated_delta_rule`` (a decay per head) and ``chunk_kda`` (a decay per key
    channel, Kimi delta attention) through ``kernels.gdn.gated_delta_rule``, packed documents
    included, forward and backward against the fp64 torch path."""
    from composer.kernels import gdn as kgdn

    need(kernel)
    g = torch.Generator(device=DEVICE).manual_seed(3)
    b, T, H, K = S["b"], S["T"], S["heads"], S["d"] // 2

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=DEVICE)

    decay = (r(b, T, H, K) if per_channel else r(b, T, H)) - 3
    leaves = [r(b, T, H, K), r(b, T, H, K), r(b, T, H, K), decay, r(b, T, H)]
    doc_ids = (torch.arange(T, device=DEVICE) >= T // 3).long().expand(b, T).contiguous()

    def make(fn: Callable) -> Callable:
        def run(q, k, v, a, beta):
            dtype = torch.promote_types(v.dtype, torch.float32)
            return fn(F.normalize(q.to(dtype), dim=-1), F.normalize(k.to(dtype), dim=-1), v,
                      -F.softplus(a.to(dtype)), torch.sigmoid(beta.to(dtype)), doc_ids=doc_ids)
        return run

    rounded = [t.to(dtype) for t in leaves]
    ref = fwd_bwd(make(lambda *a, **kw: kgdn.gdn_chunked(*a, 16, **kw)), rounded, torch.float64)
    got = fwd_bwd(make(lambda *a, **kw: kgdn.gdn_kernel(*a, **kw)), rounded, dtype)
    assert compare(got, ref) <= TOL[dtype]
