"""The Mamba-2 SSD scan, from raw ``dt``: mamba_ssm's Triton kernel on CUDA, else our torch scan.

Both functions here take the arguments of mamba_ssm's ``mamba_chunk_scan_combined`` (Dao & Gu
2024, §6; ``mamba_ssm/ops/triton/ssd_combined.py``) and compute

    dt = clamp(softplus?(dt + dt_bias), dt_limit),   y = SSD(x, dt, A, B, C) + D * x,

exactly as that kernel's ``_chunk_cumsum_fwd`` does: the bias is added in fp32, softplus is the
identity above 20 (as ``F.softplus``), and the clamp is always applied (a no-op for
``(0, inf)`` after softplus). Passing the raw ``dt`` lets the kernel fuse the softplus and clamp
and differentiate through them; the torch path does them as the mixer always has.

Precision contract (both paths): ``y`` comes back in ``promote(x.dtype, fp32)``, the final state
in the same dtype. The torch path computes in that dtype from the start; the kernel takes ``x``,
``B``, ``C`` in their own dtype (bf16 operands, fp32 accumulation and fp32 dt / decay) and its
output, in ``x``'s dtype, is upcast.

Packed documents: ``doc_ids`` (``(B, T)``, :mod:`composer.kernels.packing`) restarts the state at
each document; the torch path masks its decays, the kernel gets ``seq_idx`` (int32, 0 for each
row's first document), which its chunk-state, state-passing and chunk-scan kernels compare.

Shape legend: B batch, T time, H heads, P head dim, G groups, N state size.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from composer.kernels import probe
from composer.kernels.packing import seq_idx
from composer.kernels.ssd import ssd_scan

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
NO_LIMIT = (0.0, float("inf"))
# The torch path's chunk: the scan's result does not depend on it, and on a CPU a short chunk
# is cheaper (the L x L work per token grows with L, the per-chunk state work shrinks with it;
# 64 is the best of 32/64/128/256 for fp32 at H 16, P 64, N 128, see bench/RESULTS.md).
TORCH_CHUNK = 64

ScanOut = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def scan_dt(dt_BTH: torch.Tensor, dt_bias_H: torch.Tensor | None = None,
            dt_softplus: bool = False, dt_limit: tuple[float, float] = NO_LIMIT) -> torch.Tensor:
    """``clamp(softplus?(dt + dt_bias), dt_limit)`` in ``>= fp32``: the scan's ``dt``."""
    dt_BTH = dt_BTH.to(torch.promote_types(dt_BTH.dtype, torch.float32))
    if dt_bias_H is not None:
        dt_BTH = dt_BTH + dt_bias_H
    if dt_softplus:
        dt_BTH = F.softplus(dt_BTH)
    return dt_BTH.clamp(min=dt_limit[0], max=dt_limit[1])


def ssd_end_state(x_BTHP: torch.Tensor, dt_BTH: torch.Tensor, A_H: torch.Tensor,
                  B_BTGN: torch.Tensor, seg_BT: torch.Tensor | None = None,
                  **dt_args) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's end state from a zero start, ``sum_t exp(cs_T - cs_t) dt_t x_t ⊗ B_t``, and
    its decay ``exp(cs_T)`` (``[B, H, P, N]``, ``[B, H]``; ``cs`` the cumulative sum of
    ``dt * A``, in fp64 as the scan takes it): what a start state becomes at the end is
    ``decay * start + end``. With document segments (``seg_BT``, 0 for the row's first) only the
    last document feeds the end state and a start state does not survive a document start.
    Raw ``dt`` and ``dt_args`` as :func:`ssd_scan_torch` takes them. Plain autograd: it keeps
    only ``x``, ``B`` and ``[B, T, H]`` weights for the backward."""
    dtype = _compute_dtype(x_BTHP)
    dt_BTH = scan_dt(dt_BTH, **dt_args).to(dtype)
    cs64_BTH = (dt_BTH.double() * A_H.double()).cumsum(1)
    to_end_BTH = (cs64_BTH[:, -1:] - cs64_BTH).to(dtype).exp()
    decay_BH = cs64_BTH[:, -1].to(dtype).exp()
    if seg_BT is not None:
        to_end_BTH = to_end_BTH * (seg_BT == seg_BT[:, -1:])[..., None].to(dtype)
        decay_BH = decay_BH * (seg_BT[:, -1] == 0)[:, None].to(dtype)
    b, T, H, P = x_BTHP.shape
    G, N = B_BTGN.shape[2], B_BTGN.shape[3]
    w_BTGR = (to_end_BTH * dt_BTH).view(b, T, G, H // G)
    x_BTGRP = x_BTHP.to(dtype).view(b, T, G, H // G, P)
    end = torch.einsum("btgr,btgrp,btgn->bgrpn", w_BTGR, x_BTGRP, B_BTGN.to(dtype))
    return end.reshape(b, H, P, N), decay_BH


def ssd_scan_torch(
    x_BTHP: torch.Tensor,
    dt_BTH: torch.Tensor,
    A_H: torch.Tensor,
    B_BTGN: torch.Tensor,
    C_BTGN: torch.Tensor,
    chunk_size: int,
    *,
    D_H: torch.Tensor | None = None,
    dt_bias_H: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = NO_LIMIT,
    initial_state_BHPN: torch.Tensor | None = None,
    return_final_state: bool = False,
    doc_ids: torch.Tensor | None = None,
) -> ScanOut:
    """Torch path: the mixer's dt arithmetic, then :func:`composer.kernels.ssd.ssd_scan` in chunks
    of at most :data:`TORCH_CHUNK` steps (``chunk_size`` is the kernel's tile, not part of the
    math)."""
    dtype = _compute_dtype(x_BTHP)
    dt_BTH = scan_dt(dt_BTH, dt_bias_H, dt_softplus, dt_limit)
    return ssd_scan(x_BTHP.to(dtype), dt_BTH, A_H, B_BTGN, C_BTGN, min(chunk_size, TORCH_CHUNK),
                    D_H=D_H,
                    initial_state_BHPN=initial_state_BHPN, return_final_state=return_final_state,
                    doc_ids=doc_ids)


def ssd_scan_kernel(
    x_BTHP: torch.Tensor,
    dt_BTH: torch.Tensor,
    A_H: torch.Tensor,
    B_BTGN: torch.Tensor,
    C_BTGN: torch.Tensor,
    chunk_size: int,
    *,
    D_H: torch.Tensor | None = None,
    dt_bias_H: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = NO_LIMIT,
    initial_state_BHPN: torch.Tensor | None = None,
    return_final_state: bool = False,
    doc_ids: torch.Tensor | None = None,
) -> ScanOut:
    """mamba_ssm's ``mamba_chunk_scan_combined``; same arguments and results as the torch path.

    Our layouts are already the kernel's (``x`` (B, T, H, P), ``dt`` (B, T, H), ``A`` (H,),
    ``B``/``C`` (B, T, G, N), ``D`` (H,), initial state (B, H, P, N)); the gate ``z`` is not
    fused here because the mixer's gated RMSNorm applies it. The kernel itself makes ``B``/``C``
    contiguous in their last dim when needed. ``doc_ids`` becomes ``seq_idx``.
    """
    fn = probe.module("mamba_ssm").mamba_chunk_scan_combined
    out = fn(x_BTHP, dt_BTH, A_H, B_BTGN, C_BTGN, chunk_size, D=D_H, z=None, dt_bias=dt_bias_H,
             initial_states=initial_state_BHPN,
             seq_idx=None if doc_ids is None else seq_idx(doc_ids), dt_softplus=dt_softplus,
             dt_limit=(float(dt_limit[0]), float(dt_limit[1])),
             return_final_states=return_final_state)
    dtype = _compute_dtype(x_BTHP)
    if return_final_state:
        y, final = out
        return y.to(dtype), final.to(dtype)
    return out.to(dtype)


def select_scan(x_BTHP: torch.Tensor) -> Callable[..., ScanOut]:
    """:func:`ssd_scan_kernel` for a CUDA ``x`` of a kernel dtype when mamba_ssm imports, else
    :func:`ssd_scan_torch`. A CPU tensor never probes (never imports mamba_ssm)."""
    if (probe.on_gpu(x_BTHP) and x_BTHP.dtype in KERNEL_DTYPES
            and probe.available("mamba_ssm")):
        return ssd_scan_kernel
    return ssd_scan_torch


def mamba_scan(x_BTHP: torch.Tensor, *args, **kwargs) -> ScanOut:
    """The mixer's hook: the scan that :func:`select_scan` picks for ``x``, called."""
    return select_scan(x_BTHP)(x_BTHP, *args, **kwargs)


def ssd_step(x_B1HP: torch.Tensor, dt_B1H: torch.Tensor, A_H: torch.Tensor,
             B_B1GN: torch.Tensor, C_B1GN: torch.Tensor, state_BHPN: torch.Tensor, *,
             D_H: torch.Tensor | None = None, dt_bias_H: torch.Tensor | None = None,
             dt_softplus: bool = False, dt_limit: tuple[float, float] = NO_LIMIT) -> torch.Tensor:
    """One step of the SSD recurrence (a decoded token), updating ``state`` in place:

        dt = clamp(softplus?(dt + dt_bias), dt_limit)
        state = exp(dt * A) * state + dt * x ⊗ B,    y = state · C + D * x

    the arithmetic of :func:`ssd_scan_torch` (mamba_ssm's ``selective_state_update``, the
    kernel that would take this layout on CUDA). Returns ``y [B, 1, H, P]`` in
    ``promote(x.dtype, fp32)``."""
    dtype = torch.promote_types(_compute_dtype(x_B1HP), state_BHPN.dtype)
    x_BHP = x_B1HP[:, 0].to(dtype)
    dt_BH = dt_B1H[:, 0].to(torch.promote_types(dt_B1H.dtype, torch.float32))
    if dt_bias_H is not None:
        dt_BH = dt_BH + dt_bias_H
    if dt_softplus:
        dt_BH = F.softplus(dt_BH)
    if not dt_softplus or tuple(dt_limit) != NO_LIMIT:  # after softplus (0, inf) is a no-op
        dt_BH = dt_BH.clamp(min=dt_limit[0], max=dt_limit[1])
    dt_BH = dt_BH.to(dtype)
    b, h, p, n = state_BHPN.shape
    g = B_B1GN.shape[2]
    decay_BH = torch.exp(dt_BH * A_H.to(dtype))
    if state_BHPN.dtype == dtype and state_BHPN.is_contiguous():
        state = state_BHPN  # updated in place: decay, then the rank-1 write (one baddbmm)
    else:
        state = state_BHPN.to(dtype).contiguous()
    state.mul_(decay_BH[..., None, None])
    # a group's heads share B and C: its (heads x P) rows are one matrix of the batched products
    flat = state.view(b * g, (h // g) * p, n)
    B_X1N = B_B1GN[:, 0].to(dtype).reshape(b * g, 1, n)
    flat.baddbmm_((dt_BH[..., None] * x_BHP).reshape(b * g, (h // g) * p, 1), B_X1N)
    y_BHP = torch.bmm(flat, C_B1GN[:, 0].to(dtype).reshape(b * g, n, 1)).view(b, h, p)
    if state is not state_BHPN:
        state_BHPN.copy_(state)
    if D_H is not None:
        y_BHP = torch.addcmul(y_BHP, D_H.to(dtype)[:, None], x_BHP)
    return y_BHP[:, None]
