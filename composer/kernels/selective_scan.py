"""The Mamba-1 selective scan (Gu & Dao 2023, "Mamba", §3.2 Algorithm 2 and §3.3): mamba_ssm's
CUDA kernel on CUDA, else a chunked torch scan; plus the sequential fp64 twin.

Per channel ``e`` and state index ``n``, with a diagonal ``A [E, N]`` (negative)::

    dt_t  = softplus?(dt_t + dt_bias)                        (in >= fp32)
    h_t   = exp(dt_t A) * h_{t-1} + dt_t x_t B_t             (state [E, N])
    y_t   = h_t . C_t + D x_t

The torch path cuts the sequence into chunks of ``L`` steps; inside a chunk every step's state is
built by a log-depth (Hillis-Steele) scan of the pairs ``(a_t, u_t) = (exp(dt_t A), dt_t x_t
B_t)``, composed as ``(a, u) then (a', u') = (a a', a' u + u')``. Every factor is a decay in
``[0, 1]``, so nothing overflows whatever ``dt A`` is (a cumulative sum of ``dt A`` divided out
later would overflow ``exp`` for long chunks of large steps). Only one chunk's ``[B, L, E, N]``
states exist at a time: gradients recompute each chunk from its saved start state
(:class:`_ChunkedScan`), so training keeps ``[B, T / L, E, N]`` start states, never
``[B, T, E, N]``.

Packed documents (``doc_ids``, :mod:`composer.kernels.packing`): the decay is 0 at each
document's first token, so the state restarts there; an initial state belongs to each row's
first document. mamba_ssm's ``selective_scan_fn`` has neither documents nor an initial state:
such calls take the torch path on every device.

Precision contract (both paths): ``y`` comes back in ``promote(x.dtype, fp32)``, the final state
in the same dtype; the torch path computes in that dtype from the start.

Shape legend: B batch, T time, L chunk, E channels (d_inner), N state size.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from composer.kernels import probe
from composer.kernels.packing import doc_starts

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
TORCH_CHUNK = 32
"""Steps per chunk of the torch scan. The result does not depend on it (the kernel has no chunk
at all, so no config holds it); 32 was the fastest of 16-128, forward and backward, on the CPU
(E 256, N 16, T 512)."""
ScanOut = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def scan_dt(dt_BTE: torch.Tensor, dt_bias_E: torch.Tensor | None = None,
            dt_softplus: bool = False) -> torch.Tensor:
    """``softplus?(dt + dt_bias)`` in ``>= fp32`` (the bias added in fp32, as the kernel does)."""
    dt_BTE = dt_BTE.to(_compute_dtype(dt_BTE))
    if dt_bias_E is not None:
        dt_BTE = dt_BTE + dt_bias_E.to(dt_BTE.dtype)
    return F.softplus(dt_BTE) if dt_softplus else dt_BTE


def _keep(doc_ids: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """``[B, T]``: 0 at each document's first token (not the row's), where the state restarts."""
    return None if doc_ids is None else (~doc_starts(doc_ids)).to(dtype)


def _prefix(a_BLEN: torch.Tensor, u_BLEN: torch.Tensor) -> torch.Tensor:
    """Every step's state ``h_t = a_t h_{t-1} + u_t`` (``h_{-1} = 0``) of one chunk, by
    ``ceil(log2 L)`` rounds that compose each step with the span ``d`` steps before it. The
    product of the decays is not needed after the last round, so it is not formed there."""
    L, d = a_BLEN.shape[1], 1
    while d < L:
        u_BLEN = torch.cat([u_BLEN[:, :d], torch.addcmul(u_BLEN[:, d:], a_BLEN[:, d:],
                                                         u_BLEN[:, :-d])], 1)
        if 2 * d < L:
            a_BLEN = torch.cat([a_BLEN[:, :d], a_BLEN[:, d:] * a_BLEN[:, :-d]], 1)
        d *= 2
    return u_BLEN


def _chunk(x_BLE: torch.Tensor, dt_BLE: torch.Tensor, A_EN: torch.Tensor, B_BLN: torch.Tensor,
           C_BLN: torch.Tensor, keep_BL: torch.Tensor | None,
           h0_BEN: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk from its start state: ``(h . C [B, L, E], h after the chunk [B, E, N])``."""
    a_BLEN = torch.exp(dt_BLE[..., None] * A_EN)
    if keep_BL is not None:
        a_BLEN = a_BLEN * keep_BL[:, :, None, None]
    u_BLEN = (dt_BLE * x_BLE)[..., None] * B_BLN[:, :, None, :]
    # the start state enters as part of the first step's input: h_0 = a_0 h_start + u_0
    u_BLEN = torch.cat([torch.addcmul(u_BLEN[:, :1], a_BLEN[:, :1], h0_BEN[:, None]),
                        u_BLEN[:, 1:]], 1)
    h_BLEN = _prefix(a_BLEN, u_BLEN)
    return (h_BLEN @ C_BLN[..., None])[..., 0], h_BLEN[:, -1]


def _chunks(T: int, L: int) -> list[slice]:
    return [slice(s, min(s + L, T)) for s in range(0, T, L)]


def _scan_no_grad(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                  C: torch.Tensor, keep: torch.Tensor | None, h: torch.Tensor,
                  L: int) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """The chunks in order: ``(y, final state, each chunk's start state)``."""
    ys, starts = [], []
    for s in _chunks(x.shape[1], L):
        starts.append(h)
        y, h = _chunk(x[:, s], dt[:, s], A, B[:, s], C[:, s],
                      None if keep is None else keep[:, s], h)
        ys.append(y)
    return torch.cat(ys, 1), h, starts


class _ChunkedScan(torch.autograd.Function):
    """The chunked scan with a bounded-memory backward: the forward keeps only each chunk's
    start state; the backward walks the chunks in reverse, recomputes one chunk's graph from its
    start state and differentiates it (the gradient of its end state comes from the next
    chunk)."""

    @staticmethod
    def forward(ctx, x, dt, A, B, C, h0, keep, L):  # noqa: ANN001, ANN205 (autograd signature)
        y, h, starts = _scan_no_grad(x, dt, A, B, C, keep, h0, L)
        ctx.save_for_backward(x, dt, A, B, C, keep, torch.stack(starts, 1))
        ctx.L = L
        return y, h

    @staticmethod
    def backward(ctx, gy, gh):  # noqa: ANN001, ANN205
        x, dt, A, B, C, keep, starts = ctx.saved_tensors
        grads = [torch.zeros_like(t) for t in (x, dt, B, C)]
        gA = torch.zeros_like(A)
        g_end = torch.zeros_like(starts[:, 0]) if gh is None else gh
        for k, s in reversed(list(enumerate(_chunks(x.shape[1], ctx.L)))):
            with torch.enable_grad():
                ins = [t[:, s].detach().requires_grad_() for t in (x, dt, B, C)]
                A_ = A.detach().requires_grad_()
                h0 = starts[:, k].detach().requires_grad_()
                y, h = _chunk(ins[0], ins[1], A_, ins[2], ins[3],
                              None if keep is None else keep[:, s], h0)
                out = torch.autograd.grad((y, h), (*ins, A_, h0),
                                          (torch.zeros_like(y) if gy is None else gy[:, s], g_end))
            for g, got in zip(grads, out[:4], strict=True):
                g[:, s] = got
            gA += out[4]
            g_end = out[5]
        gx, gdt, gB, gC = grads
        return gx, gdt, gA, gB, gC, g_end, None, None


def selective_scan_chunked(x_BTE: torch.Tensor, dt_BTE: torch.Tensor, A_EN: torch.Tensor,
                           B_BTN: torch.Tensor, C_BTN: torch.Tensor, chunk_size: int, *,
                           D_E: torch.Tensor | None = None,
                           initial_state_BEN: torch.Tensor | None = None,
                           return_final_state: bool = False,
                           doc_ids: torch.Tensor | None = None) -> ScanOut:
    """The scan for a positive ``dt`` (after softplus), in chunks of ``chunk_size`` steps
    (module docstring); any ``T``, the last chunk may be shorter."""
    dtype = torch.promote_types(_compute_dtype(x_BTE), dt_BTE.dtype)
    x, dt = x_BTE.to(dtype), dt_BTE.to(dtype)
    A, B, C = A_EN.to(dtype), B_BTN.to(dtype), C_BTN.to(dtype)
    b, _, E = x.shape
    h0 = (x.new_zeros(b, E, A.shape[1]) if initial_state_BEN is None
          else initial_state_BEN.to(dtype))
    keep = _keep(doc_ids, dtype)
    L = max(1, chunk_size)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x, dt, A, B, C, h0)):
        y, final = _ChunkedScan.apply(x, dt, A, B, C, h0, keep, L)
    else:
        y, final, _ = _scan_no_grad(x, dt, A, B, C, keep, h0, L)
    if D_E is not None:
        y = y + x * D_E.to(dtype)
    return (y, final) if return_final_state else y


def selective_scan_torch(x_BTE: torch.Tensor, dt_BTE: torch.Tensor, A_EN: torch.Tensor,
                         B_BTN: torch.Tensor, C_BTN: torch.Tensor,
                         chunk_size: int | None = None, *, D_E: torch.Tensor | None = None,
                         dt_bias_E: torch.Tensor | None = None,
                         dt_softplus: bool = False,
                         initial_state_BEN: torch.Tensor | None = None,
                         return_final_state: bool = False,
                         doc_ids: torch.Tensor | None = None) -> ScanOut:
    """Torch path: the raw ``dt``'s arithmetic (:func:`scan_dt`), then
    :func:`selective_scan_chunked` in chunks of ``chunk_size`` (None: :data:`TORCH_CHUNK`)."""
    return selective_scan_chunked(
        x_BTE, scan_dt(dt_BTE, dt_bias_E, dt_softplus), A_EN, B_BTN, C_BTN,
        chunk_size or TORCH_CHUNK, D_E=D_E,
        initial_state_BEN=initial_state_BEN, return_final_state=return_final_state,
        doc_ids=doc_ids)


def selective_scan_kernel(x_BTE: torch.Tensor, dt_BTE: torch.Tensor, A_EN: torch.Tensor,
                          B_BTN: torch.Tensor, C_BTN: torch.Tensor,
                          chunk_size: int | None = None, *, D_E: torch.Tensor | None = None,
                          dt_bias_E: torch.Tensor | None = None,
                          dt_softplus: bool = False,
                          initial_state_BEN: torch.Tensor | None = None,
                          return_final_state: bool = False,
                          doc_ids: torch.Tensor | None = None) -> ScanOut:
    """mamba_ssm's ``selective_scan_fn(u [B, E, T], delta [B, E, T], A [E, N], B [B, N, T],
    C [B, N, T], D, z=None, delta_bias, delta_softplus, return_last_state)``; same results as the
    torch path (``chunk_size`` is the torch path's; the kernel tiles itself). The kernel adds the
    bias and takes the softplus in fp32 and accumulates in fp32."""
    assert initial_state_BEN is None and doc_ids is None, "the kernel has neither"
    fn = probe.module("selective_scan").selective_scan_fn
    out = fn(x_BTE.transpose(1, 2), dt_BTE.transpose(1, 2), A_EN.float(),
             B_BTN.transpose(1, 2), C_BTN.transpose(1, 2),
             D=None if D_E is None else D_E.float(), z=None,
             delta_bias=None if dt_bias_E is None else dt_bias_E.float(),
             delta_softplus=dt_softplus, return_last_state=return_final_state)
    dtype = _compute_dtype(x_BTE)
    if return_final_state:
        y, final = out
        return y.transpose(1, 2).to(dtype), final.to(dtype)
    return out.transpose(1, 2).to(dtype)


def select_selective_scan(x_BTE: torch.Tensor, initial_state: torch.Tensor | None = None,
                          doc_ids: torch.Tensor | None = None) -> Callable[..., ScanOut]:
    """:func:`selective_scan_kernel` for a CUDA ``x`` of a kernel dtype, without documents or a
    start state, when mamba_ssm's selective scan imports; else :func:`selective_scan_torch`. A
    CPU tensor never probes (never imports mamba_ssm)."""
    if (probe.on_gpu(x_BTE) and x_BTE.dtype in KERNEL_DTYPES and initial_state is None
            and doc_ids is None and probe.available("selective_scan")):
        return selective_scan_kernel
    return selective_scan_torch


def selective_scan(x_BTE: torch.Tensor, *args, **kwargs) -> ScanOut:
    """The mixer's hook: the scan that :func:`select_selective_scan` picks, called."""
    fn = select_selective_scan(x_BTE, kwargs.get("initial_state_BEN"), kwargs.get("doc_ids"))
    return fn(x_BTE, *args, **kwargs)


def selective_end_state(x_BTE: torch.Tensor, dt_BTE: torch.Tensor, A_EN: torch.Tensor,
                        B_BTN: torch.Tensor, chunk_size: int | None = None, *,
                        doc_ids: torch.Tensor | None = None, dt_bias_E: torch.Tensor | None = None,
                        dt_softplus: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """A span's end state from zero and what a start state is multiplied by over it,
    ``(S_local [B, E, N], decay [B, E, N])``: ``S_end = decay * S_start + S_local``. The decay is
    ``exp(A * sum_t dt_t)``, 0 when a document starts inside the span; ``S_local`` is the
    chunked scan's final state (only the last document feeds it)."""
    dt = scan_dt(dt_BTE, dt_bias_E, dt_softplus)
    zeros = torch.zeros_like(B_BTN)  # C does not reach the end state
    _, local = selective_scan_chunked(x_BTE, dt, A_EN, B_BTN, zeros, chunk_size or TORCH_CHUNK,
                                      return_final_state=True, doc_ids=doc_ids)
    decay = torch.exp(dt.sum(1)[..., None] * A_EN.to(dt.dtype))
    if doc_ids is not None:
        decay = decay * (~doc_starts(doc_ids).any(1)).to(decay.dtype)[:, None, None]
    return local, decay


def selective_step(x_B1E: torch.Tensor, dt_B1E: torch.Tensor, A_EN: torch.Tensor,
                   B_B1N: torch.Tensor, C_B1N: torch.Tensor, state_BEN: torch.Tensor, *,
                   D_E: torch.Tensor | None = None, dt_bias_E: torch.Tensor | None = None,
                   dt_softplus: bool = False) -> torch.Tensor:
    """One step of the recurrence (a decoded token), updating ``state`` in place (mamba_ssm's
    ``selective_state_update`` math): returns ``y [B, 1, E]`` in ``promote(x.dtype, fp32)``."""
    dtype = torch.promote_types(_compute_dtype(x_B1E), state_BEN.dtype)
    x_BE = x_B1E[:, 0].to(dtype)
    dt_BE = scan_dt(dt_B1E[:, 0], dt_bias_E, dt_softplus).to(dtype)
    state = state_BEN.to(dtype)
    state = torch.exp(dt_BE[..., None] * A_EN.to(dtype)) * state \
        + (dt_BE * x_BE)[..., None] * B_B1N[:, 0, None, :].to(dtype)
    state_BEN.copy_(state)
    y_BE = (state @ C_B1N[:, 0, :, None].to(dtype))[..., 0]
    if D_E is not None:
        y_BE = y_BE + x_BE * D_E.to(dtype)
    return y_BE[:, None]


def selective_scan_ref(x_BTE: torch.Tensor, dt_BTE: torch.Tensor, A_EN: torch.Tensor,
                       B_BTN: torch.Tensor, C_BTN: torch.Tensor, *,
                       D_E: torch.Tensor | None = None,
                       initial_state_BEN: torch.Tensor | None = None,
                       return_final_state: bool = False,
                       doc_ids: torch.Tensor | None = None) -> ScanOut:
    """Plain-math sequential twin of :func:`selective_scan_chunked` (positive ``dt``), one step
    at a time, ``exp`` of each step's ``dt A``; the state restarts at each document start.
    Meant for fp64."""
    b, T, E = x_BTE.shape
    h = (torch.zeros(b, E, A_EN.shape[1], dtype=x_BTE.dtype) if initial_state_BEN is None
         else initial_state_BEN.clone())
    ys = []
    for t in range(T):
        decay = torch.exp(dt_BTE[:, t, :, None] * A_EN)
        if doc_ids is not None and t > 0:
            decay = decay * (doc_ids[:, t] == doc_ids[:, t - 1]).to(decay.dtype)[:, None, None]
        h = decay * h + dt_BTE[:, t, :, None] * x_BTE[:, t, :, None] * B_BTN[:, t, None, :]
        y = (h * C_BTN[:, t, None, :]).sum(-1)
        ys.append(y if D_E is None else y + D_E * x_BTE[:, t])
    y = torch.stack(ys, 1)
    return (y, h) if return_final_state else y
