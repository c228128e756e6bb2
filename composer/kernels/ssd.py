"""The SSD chunked scan of Mamba-2 (Dao & Gu 2024, "Transformers are SSMs", §6 "SSD algorithm").

Per head ``h`` (state ``[P, N]``), with ``a_t = dt_t * A_h`` (negative) and ``g = h // (H // G)``:

    state_t = exp(a_t) * state_{t-1} + dt_t * x_t ⊗ B_{t,g}
    y_t     = state_t · C_{t,g} + D_h * x_t

The sequence is cut into chunks of ``L`` steps. With ``X = x * dt`` and ``cs`` the cumulative sum
of ``a`` inside a chunk, the semiseparable matrix ``M[l, s] = C_l · B_s * exp(cs_l - cs_s)``
(``s <= l``) is split into blocks (§6.1):

1. diagonal blocks: inside a chunk, a masked "attention" ``y_l = Σ_s M[l, s] X_s``;
2. each chunk's end state, as if it started from zero: ``Σ_s exp(cs_end - cs_s) X_s ⊗ B_s``;
3. the recurrence over chunk boundaries, one step per chunk:
   ``start_{k+1} = exp(cs_end,k) * start_k + local_k`` (the last one is the final state);
4. the starting state's contribution: ``y_l += exp(cs_l) * C_l · start``.

Every product is a batched matmul; the only ``L x L`` elementwise work is the decay
``exp(cs_l - cs_s)`` and its product with ``C·B``. The backward pass is written out by hand
(:class:`_SSDScan`): it recomputes the decay instead of saving ``L x L`` tensors and keeps only
the chunks' starting states and their read-out ``C · start`` (the size of ``y``), so the scan's
training cost is a few matmuls per chunk plus a handful of ``L x L`` passes. Within a chunk the
decay is a difference of cumulative sums, as in mamba_ssm's kernels, with the sums in fp64 (the
``[B, T, H]`` sums are cheap, and two large fp32 sums would lose digits to cancellation); the
``[B, T, H]`` differences are taken in fp64 and rounded once, the ``L x L`` ones from a two-term
(``hi + lo``) split of the sums, as accurate at compute-dtype cost (:meth:`_Chunked.decay`).

Padded steps get ``dt = 0``: they neither decay the state (``exp(0) = 1``) nor feed it, so the
final state is exact for any ``T``.

Packed documents (``doc_ids``, :mod:`composer.kernels.packing`): the state restarts from zero at
the first token of every document, i.e. the decay across a boundary is exactly 0. Every path by
which state moves forward in time goes through one of three exponentials of cumulative-sum
differences, and each gets a 0/1 mask of "no boundary in between" (``exp(-inf)`` for the pairs
that straddle one):

- ``decay[l, s] = exp(cs_l - cs_s)``: 0 unless ``s`` and ``l`` are in the same document;
- ``to_end[s] = exp(cs_end - cs_s)``: 0 unless ``s`` is in the chunk's last document;
- ``from_start[l] = exp(cs_l)``: 0 unless ``l`` continues the document of the token before
  the chunk (so is the chunk-boundary weight ``w = from_start[end]``).

The surviving entries are the same fp64 differences as without documents (no large number
enters a sum, so nothing cancels), and the backward needs no change: it only ever uses these
tensors, so a masked entry passes no gradient, exactly as a constant-0 factor. An initial state
belongs to the row's first document and the final state is that of its last.

Shape legend:
    B batch, T time, H heads, P head dim, G groups (of B/C), R heads per group (H = G * R),
    N state size, K chunks, L position in a chunk (target), S position in a chunk (source),
    Q = R * P (a group's heads and their dims, one matmul dimension).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from composer.kernels.packing import doc_segments


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # At least fp32 (bf16 exp/cumsum over a chunk is far too coarse); fp64 stays fp64 for tests.
    return torch.promote_types(dtype, torch.float32)


def _to_chunks(t_BT_: torch.Tensor, pad: int, chunk_size: int) -> torch.Tensor:
    """``[B, T, ...] -> [B, K, L, ...]``, zero-padding ``T`` up to a multiple of ``chunk_size``."""
    if pad:
        t_BT_ = F.pad(t_BT_, (0, 0) * (t_BT_.dim() - 2) + (0, pad))
    return t_BT_.reshape(t_BT_.shape[0], -1, chunk_size, *t_BT_.shape[2:])


def _bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` over equal leading dims, folded into one batch dim by ``reshape`` (a view for
    our layouts, transposed operands included) and run by ``torch.bmm``, which reads a
    transposed operand in place; ``torch.matmul`` on 5-D inputs copies some of them."""
    lead = a.shape[:-2]
    out = torch.bmm(a.reshape(-1, *a.shape[-2:]), b.reshape(-1, *b.shape[-2:]))
    return out.view(*lead, *out.shape[-2:])


class _Chunked:
    """The chunked views and the cheap per-step quantities shared by forward and backward.

    Two layouts of ``x``-sized tensors are used: the natural ``[B, K, L, G, R, P]`` (a view of
    the input; its ``(R, P)`` rows are the ``Q`` rows of the per-group matmuls) and the
    per-head ``[B, K, G, R, L, P]``, made contiguous once, for the per-head ``L x L`` matmuls.
    """

    def __init__(self, x_BTHP, dt_BTH, A_H, B_BTGN, C_BTGN, L: int,
                 seg_BT: torch.Tensor | None = None) -> None:
        b, T, H, P = x_BTHP.shape
        G, N = B_BTGN.shape[2], B_BTGN.shape[3]
        R = H // G
        self.b, self.T, self.H, self.P, self.G, self.N, self.R, self.L = b, T, H, P, G, N, R, L
        self.pad = pad = (-T) % L
        self.K = K = (T + pad) // L
        self.x_BKLGRP = _to_chunks(x_BTHP.view(b, T, G, R, P), pad, L)
        self.dt_BKLGR = _to_chunks(dt_BTH.view(b, T, G, R), pad, L)
        self.A_GR = A_H.view(G, R)
        self.B_BKGLN = _to_chunks(B_BTGN, pad, L).transpose(2, 3)
        self.C_BKGLN = _to_chunks(C_BTGN, pad, L).transpose(2, 3)
        # The cumulative decay in fp64 (a [B, T, H] tensor: cheap): exp(cs_l - cs_s) of two
        # large fp32 sums would lose digits to cancellation (see decay() for the L x L ones).
        self.dtype = x_BTHP.dtype
        self.cs64_BKLGR = (self.dt_BKLGR.double() * self.A_GR.double()).cumsum(2)
        # Decay from each step to the chunk's end, from its start to each step, over the chunk.
        self.to_end_BKLGR = torch.exp(self.cs64_BKLGR[:, :, -1:] - self.cs64_BKLGR).to(self.dtype)
        self.from_start_BKLGR = torch.exp(self.cs64_BKLGR).to(self.dtype)
        self.same_BKLS = None
        if seg_BT is not None:
            self._isolate_documents(seg_BT)
        self.w_BKH = self.from_start_BKLGR[:, :, -1].reshape(b, K, H)
        # X = x * dt, per head and contiguous (the operand of the L x L matmuls).
        self.X_BKGRLP = x_BTHP.new_empty(b, K, G, R, L, P)
        torch.mul(self.per_head(self.x_BKLGRP), self.per_head(self.dt_BKLGR[..., None]),
                  out=self.X_BKGRLP)

    def _isolate_documents(self, seg_BT: torch.Tensor) -> None:
        """Zero the decays that cross a document boundary (module docstring). ``seg`` is the
        non-decreasing document index of each step; padding joins the last document."""
        b, K, L = self.b, self.K, self.L
        if self.pad:
            seg_BT = torch.cat([seg_BT, seg_BT[:, -1:].expand(b, self.pad)], 1)
        seg_BKL = seg_BT.reshape(b, K, L)
        # The document of the step before each chunk (the first step's own for chunk 0).
        before_BK = torch.cat([seg_BKL[:, :1, 0], seg_BKL[:, :-1, -1]], 1)
        cut_end_BKL = seg_BKL != seg_BKL[:, :, -1:]
        cut_start_BKL = seg_BKL != before_BK[:, :, None]
        self.to_end_BKLGR.masked_fill_(cut_end_BKL[..., None, None], 0.0)
        self.from_start_BKLGR.masked_fill_(cut_start_BKL[..., None, None], 0.0)
        self.same_BKLS = seg_BKL[:, :, :, None] == seg_BKL[:, :, None, :]

    def group_rows(self, t_BKLGRP: torch.Tensor) -> torch.Tensor:
        """``[B, K, L, G, R, P] -> [B, K, G, L, Q]`` (a view)."""
        b, K, L, G = t_BKLGRP.shape[:4]
        return t_BKLGRP.reshape(b, K, L, G, -1).transpose(2, 3)

    @staticmethod
    def per_head(t_BKLGRP: torch.Tensor) -> torch.Tensor:
        """``[B, K, L, G, R, P] -> [B, K, G, R, L, P]`` (a view)."""
        return t_BKLGRP.permute(0, 1, 3, 4, 2, 5)

    @staticmethod
    def natural(t_BKGRLP: torch.Tensor) -> torch.Tensor:
        """``[B, K, G, R, L, P] -> [B, K, L, G, R, P]`` (a view)."""
        return t_BKGRLP.permute(0, 1, 4, 2, 3, 5)

    def new_natural(self) -> torch.Tensor:
        """An empty, contiguous ``[B, K, L, G, R, P]`` (elementwise results keep the layout of
        their first input; a permuted one would be copied again by every reshape)."""
        return self.x_BKLGRP.new_empty(self.x_BKLGRP.shape)

    def Xe_BKGLQ(self) -> torch.Tensor:
        """``X * to_end`` in the per-group layout: the rows that build each chunk's end state."""
        scale_BKLGR = self.dt_BKLGR * self.to_end_BKLGR
        return self.group_rows(torch.mul(self.x_BKLGRP, scale_BKLGR[..., None],
                                         out=self.new_natural()))

    def decay(self) -> torch.Tensor:
        """``exp(cs_l - cs_s)`` for ``s <= l``, else 0: ``[B, K, G, R, L, S]``, contiguous.

        The ``L x L`` difference is taken in the compute dtype from a two-term split of the fp64
        sums, ``cs = hi + lo`` (``hi`` = ``cs`` rounded, ``lo`` the rounding error, rounded):
        ``(hi_l - hi_s) + lo_l - lo_s``. A difference of two floats is correctly rounded, so the
        only digits lost to cancellation are those of ``lo``, which are ``eps`` below ``hi``'s:
        the result is within a few ``eps`` of the fp64 difference (relative), as good as rounding
        that once, at three cheap compute-dtype passes instead of an fp64 pass and a conversion.
        """
        cs64_BKGRL = self.cs64_BKLGR.permute(0, 1, 3, 4, 2).contiguous()
        hi_BKGRL = cs64_BKGRL.to(self.dtype)
        lo_BKGRL = (cs64_BKGRL - hi_BKGRL).to(self.dtype)
        diff_BKGRLS = hi_BKGRL[..., :, None] - hi_BKGRL[..., None, :]
        diff_BKGRLS.add_(lo_BKGRL[..., :, None]).sub_(lo_BKGRL[..., None, :])
        if self.same_BKLS is not None:  # exp(-inf) = 0 across a document boundary
            diff_BKGRLS.masked_fill_(~self.same_BKLS[:, :, None, None], float("-inf"))
        return diff_BKGRLS.exp_().tril_()

    def cb(self) -> torch.Tensor:
        """``C_l · B_s`` per group: ``[B, K, G, L, S]``."""
        return _bmm(self.C_BKGLN, self.B_BKGLN.transpose(-1, -2))

    def unchunk(self, t_BKL_: torch.Tensor) -> torch.Tensor:
        """``[B, K, L, ...] -> [B, T, ...]``, dropping the padding."""
        return t_BKL_.reshape(self.b, self.K * self.L, *t_BKL_.shape[3:])[:, : self.T]


def _forward(c: _Chunked, init_BHPN: torch.Tensor | None):
    b, K, H, P, N, G, L = c.b, c.K, c.H, c.P, c.N, c.G, c.L
    # 1. diagonal blocks.
    M_BKGRLS = c.decay().mul_(c.cb()[:, :, :, None])
    y_BKLGRP = c.natural(M_BKGRLS @ c.X_BKGRLP)
    # 2. each chunk's end state from zero: [B, K, G, Q, N] = [B, K, H, P, N].
    local_BKHPN = _bmm(c.Xe_BKGLQ().transpose(-1, -2), c.B_BKGLN).view(b, K, H, P, N)
    # 3. the recurrence over chunk boundaries: start[k] is the state entering chunk k (kept
    # contiguous for the matmuls), final the state after the last chunk.
    start_BKHPN = local_BKHPN.new_empty(b, K, H, P, N)
    final_BHPN = local_BKHPN.new_empty(b, H, P, N)
    if init_BHPN is None:
        start_BKHPN[:, 0] = 0.0
    else:
        start_BKHPN[:, 0] = init_BHPN
    for k in range(K):
        torch.addcmul(local_BKHPN[:, k], c.w_BKH[:, k, :, None, None], start_BKHPN[:, k],
                      out=start_BKHPN[:, k + 1] if k + 1 < K else final_BHPN)
    # 4. the starting states' contribution.
    out_BKLGRP = c.new_natural()
    yoff_BKGLQ = None  # zero when the only chunk starts from zero
    if K > 1 or init_BHPN is not None:
        yoff_BKGLQ = _bmm(c.C_BKGLN, start_BKHPN.reshape(b, K, G, -1, N).transpose(-1, -2))
        yoff_BKLGRP = yoff_BKGLQ.transpose(2, 3).view(b, K, L, G, c.R, P)
        y_BKLGRP = torch.addcmul(y_BKLGRP, yoff_BKLGRP, c.from_start_BKLGR[..., None],
                                 out=out_BKLGRP)
    else:
        y_BKLGRP = out_BKLGRP.copy_(y_BKLGRP)
    return c.unchunk(y_BKLGRP).reshape(b, c.T, H, P), final_BHPN, start_BKHPN, yoff_BKGLQ


def _backward(c: _Chunked, start_BKHPN, yoff_BKGLQ, dy_BTHP, dfinal_BHPN):
    """Gradients w.r.t. (x, dt, A, B, C, initial state); ``D`` is handled by the caller.
    ``yoff`` is the forward's ``C · start`` (``None`` when it was zero)."""
    b, K, H, P, N, G, R, L = c.b, c.K, c.H, c.P, c.N, c.G, c.R, c.L
    dy_BKLGRP = _to_chunks(dy_BTHP.reshape(b, c.T, G, R, P), c.pad, L)

    # 4. starting states: y += from_start * (C · start).
    if yoff_BKGLQ is not None:
        dyoff_BKLGRP = dy_BKLGRP * c.from_start_BKLGR[..., None]
        dyoff_BKGLQ = c.group_rows(dyoff_BKLGRP)
        dC_BKGLN = _bmm(dyoff_BKGLQ, start_BKHPN.reshape(b, K, G, -1, N))
        dstart_BKHPN = _bmm(dyoff_BKGLQ.transpose(-1, -2), c.C_BKGLN).view(b, K, H, P, N)
        yoff_BKLGRP = yoff_BKGLQ.transpose(2, 3).view(b, K, L, G, R, P)
        dcs_BKLGR = (dyoff_BKLGRP * yoff_BKLGRP).sum(-1)
    else:
        dC_BKGLN = c.C_BKGLN.new_zeros(c.C_BKGLN.shape)
        dstart_BKHPN = start_BKHPN.new_zeros(start_BKHPN.shape)
        dcs_BKLGR = c.from_start_BKLGR.new_zeros(c.from_start_BKLGR.shape)

    # 3. the recurrence, backwards over the chunks: dstates[k] is the gradient at the state
    # entering chunk k + 1, i.e. of chunk k's local end state.
    dlocal_BKHPN = start_BKHPN.new_empty(b, K, H, P, N)
    if dfinal_BHPN is None:
        dlocal_BKHPN[:, K - 1] = 0.0
    else:
        dlocal_BKHPN[:, K - 1] = dfinal_BHPN
    dw_BKH = start_BKHPN.new_empty(b, K, H)
    dinit_BHPN = None
    for k in range(K - 1, -1, -1):
        dw_BKH[:, k] = torch.linalg.vecdot(dlocal_BKHPN[:, k].flatten(-2),
                                           start_BKHPN[:, k].flatten(-2))
        out = dlocal_BKHPN[:, k - 1] if k else None
        dinit_BHPN = torch.addcmul(dstart_BKHPN[:, k], c.w_BKH[:, k, :, None, None],
                                   dlocal_BKHPN[:, k], out=out)
    dcs_end_BKGR = (dw_BKH * c.w_BKH).view(b, K, G, R)

    # 2. the chunks' local end states: local = Σ_s (x_s * dt_s * to_end_s) ⊗ B_s.
    dlocal_BKGQN = dlocal_BKHPN.view(b, K, G, -1, N)
    dXe_BKLGRP = _bmm(c.B_BKGLN, dlocal_BKGQN.transpose(-1, -2)).transpose(2, 3).reshape(
        b, K, L, G, R, P)
    dB_BKGLN = _bmm(c.Xe_BKGLQ(), dlocal_BKGQN)
    # d(to_end) * to_end, for the cumulative sums: Σ_p dXe * x * dt * to_end
    dXe_x_BKLGR = (dXe_BKLGRP * c.x_BKLGRP).sum(-1)
    dto_end_BKLGR = dXe_x_BKLGR * c.dt_BKLGR * c.to_end_BKLGR
    dcs_BKLGR -= dto_end_BKLGR
    dcs_end_BKGR += dto_end_BKLGR.sum(2)

    # 1. diagonal blocks: y = (CB ∘ decay) @ X per head.
    dy_BKGRLP = c.per_head(dy_BKLGRP).contiguous()
    decay_BKGRLS = c.decay()
    CB_BKGLS = c.cb()
    M_BKGRLS = decay_BKGRLS * CB_BKGLS[:, :, :, None]
    dM_BKGRLS = dy_BKGRLP @ c.X_BKGRLP.transpose(-1, -2)
    dX_BKGRLP = M_BKGRLS.transpose(-1, -2) @ dy_BKGRLP
    dCB_BKGLS = (dM_BKGRLS * decay_BKGRLS).sum(3)
    dC_BKGLN = dC_BKGLN + _bmm(dCB_BKGLS, c.B_BKGLN)
    dB_BKGLN = dB_BKGLN + _bmm(dCB_BKGLS.transpose(-1, -2), c.C_BKGLN)
    dseg_BKGRLS = dM_BKGRLS.mul_(M_BKGRLS)  # d/d(cs_l - cs_s)
    dcs_BKLGR += (dseg_BKGRLS.sum(-1) - dseg_BKGRLS.sum(-2)).permute(0, 1, 4, 2, 3)

    # X = x * dt from both paths: dX = dX_diag + dXe * to_end.
    dX_BKLGRP = torch.addcmul(c.natural(dX_BKGRLP), dXe_BKLGRP, c.to_end_BKLGR[..., None],
                              out=c.new_natural())
    # cs = cumsum(dt * A) inside the chunk.
    dcs_BKLGR[:, :, -1] += dcs_end_BKGR
    da_BKLGR = dcs_BKLGR.flip(2).cumsum(2).flip(2)
    ddt_BKLGR = da_BKLGR * c.A_GR + (dX_BKLGRP * c.x_BKLGRP).sum(-1)
    dA_GR = (da_BKLGR * c.dt_BKLGR).sum((0, 1, 2))
    dx_BKLGRP = dX_BKLGRP * c.dt_BKLGR[..., None]
    return (
        c.unchunk(dx_BKLGRP).reshape(b, c.T, H, P),
        c.unchunk(ddt_BKLGR).reshape(b, c.T, H),
        dA_GR.reshape(H),
        c.unchunk(dB_BKGLN.transpose(2, 3)),
        c.unchunk(dC_BKGLN.transpose(2, 3)),
        dinit_BHPN,
    )


class _SSDScan(torch.autograd.Function):
    """The chunked scan (without ``D``) with its hand-written backward; inputs all in one dtype."""

    @staticmethod
    def forward(ctx: Any, x_BTHP, dt_BTH, A_H, B_BTGN, C_BTGN, init_BHPN, L: int, seg_BT):
        c = _Chunked(x_BTHP, dt_BTH, A_H, B_BTGN, C_BTGN, L, seg_BT)
        y_BTHP, final_BHPN, start_BKHPN, yoff_BKGLQ = _forward(c, init_BHPN)
        ctx.save_for_backward(x_BTHP, dt_BTH, A_H, B_BTGN, C_BTGN, start_BKHPN, yoff_BKGLQ,
                              seg_BT)
        ctx.L, ctx.has_init = L, init_BHPN is not None
        return y_BTHP, final_BHPN

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, dy_BTHP, dfinal_BHPN):
        x_BTHP, dt_BTH, A_H, B_BTGN, C_BTGN, start_BKHPN, yoff_BKGLQ, seg_BT = ctx.saved_tensors
        c = _Chunked(x_BTHP, dt_BTH, A_H, B_BTGN, C_BTGN, ctx.L, seg_BT)
        if dy_BTHP is None:
            dy_BTHP = torch.zeros_like(x_BTHP)
        dx, ddt, dA, dB, dC, dinit = _backward(c, start_BKHPN, yoff_BKGLQ, dy_BTHP,
                                             dfinal_BHPN)
        return dx, ddt, dA, dB, dC, (dinit if ctx.has_init else None), None, None


def ssd_scan(
    x_BTHP: torch.Tensor,
    dt_BTH: torch.Tensor,
    A_H: torch.Tensor,
    B_BTGN: torch.Tensor,
    C_BTGN: torch.Tensor,
    chunk_size: int,
    D_H: torch.Tensor | None = None,
    initial_state_BHPN: torch.Tensor | None = None,
    return_final_state: bool = False,
    *,
    doc_ids: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Chunked SSD scan; ``dt`` is positive (already softplus'd), ``A`` negative.

    Returns ``y_BTHP`` in the dtype of ``x``, and with ``return_final_state`` also the state after
    the last step, ``[B, H, P, N]`` in the compute dtype (fp32, or fp64 for fp64 inputs). The
    result does not depend on ``chunk_size`` (up to rounding); a sequence shorter than one chunk
    is one chunk of its own length. With ``doc_ids`` (``(B, T)``, :mod:`composer.kernels.packing`)
    the state restarts from zero at each document's first token.
    """
    out_dtype = x_BTHP.dtype
    dtype = _compute_dtype(out_dtype)
    T = x_BTHP.shape[1]
    L = max(1, min(chunk_size, T))
    x_BTHP = x_BTHP.to(dtype)
    init = None if initial_state_BHPN is None else initial_state_BHPN.to(dtype)
    seg_BT = None if doc_ids is None else doc_segments(doc_ids)
    # The scan sets its own precision: under autocast its matmuls would drop to bf16 in the
    # forward while the hand-written backward (run outside autocast) stays in fp32.
    with torch.autocast(x_BTHP.device.type, enabled=False):
        y_BTHP, final_BHPN = _SSDScan.apply(
            x_BTHP, dt_BTH.to(dtype), A_H.to(dtype), B_BTGN.to(dtype), C_BTGN.to(dtype), init, L,
            seg_BT,
        )
    if D_H is not None:
        y_BTHP = torch.addcmul(y_BTHP, D_H.to(dtype)[:, None], x_BTHP)
    y_BTHP = y_BTHP.to(out_dtype)
    if return_final_state:
        return y_BTHP, final_BHPN
    return y_BTHP


def ssd_scan_ref(
    x_BTHP: torch.Tensor,
    dt_BTH: torch.Tensor,
    A_H: torch.Tensor,
    B_BTGN: torch.Tensor,
    C_BTGN: torch.Tensor,
    D_H: torch.Tensor | None = None,
    initial_state_BHPN: torch.Tensor | None = None,
    return_final_state: bool = False,
    *,
    doc_ids: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Plain-math twin of :func:`ssd_scan`: the recurrence, one time step at a time; with
    ``doc_ids`` the state is set to zero before the first step of every new document."""
    out_dtype = x_BTHP.dtype
    dtype = _compute_dtype(out_dtype)
    b, T, H, P = x_BTHP.shape
    G, N = B_BTGN.shape[2], B_BTGN.shape[3]
    group_of_head = torch.arange(H, device=x_BTHP.device) // (H // G)
    x_BTHP, dt_BTH, A_H = x_BTHP.to(dtype), dt_BTH.to(dtype), A_H.to(dtype)
    B_BTHN = B_BTGN.to(dtype)[:, :, group_of_head]
    C_BTHN = C_BTGN.to(dtype)[:, :, group_of_head]
    if initial_state_BHPN is None:
        state_BHPN = x_BTHP.new_zeros(b, H, P, N)
    else:
        state_BHPN = initial_state_BHPN.to(dtype)
    ys = []
    for t in range(T):
        if doc_ids is not None and t > 0:
            same_B = (doc_ids[:, t] == doc_ids[:, t - 1]).to(dtype)
            state_BHPN = state_BHPN * same_B[:, None, None, None]
        decay_BH = torch.exp(dt_BTH[:, t] * A_H)
        inp_BHPN = (dt_BTH[:, t, :, None] * x_BTHP[:, t])[..., None] * B_BTHN[:, t, :, None, :]
        state_BHPN = decay_BH[..., None, None] * state_BHPN + inp_BHPN
        y_BHP = (state_BHPN * C_BTHN[:, t, :, None, :]).sum(-1)
        if D_H is not None:
            y_BHP = y_BHP + D_H.to(dtype)[:, None] * x_BTHP[:, t]
        ys.append(y_BHP)
    y_BTHP = torch.stack(ys, dim=1).to(out_dtype)
    if return_final_state:
        return y_BTHP, state_BHPN
    return y_BTHP
