"""The SSD chunked scan of Mamba-2 (Dao & Gu 2024, "Transformers are SSMs", §6 "SSD algorithm").

Per head ``h`` (state ``[P, N]``), with ``a_t = dt_t * A_h`` (negative) and ``g = h // (H // G)``:

    state_t = exp(a_t) * state_{t-1} + dt_t * x_t ⊗ B_{t,g}
    y_t     = state_t · C_{t,g} + D_h * x_t

The sequence is cut into chunks of ``L`` steps and the semiseparable matrix
``M[l, s] = C_l · B_s * exp(a_{s+1} + ... + a_l)`` (``s <= l``) is split into blocks (§6.1):

1. diagonal blocks: inside a chunk, a masked "attention" ``y = (C Bᵀ ∘ decay) (x dt)``;
2. each chunk's final state, assuming it starts from zero: ``Σ_s decay(s → end) B_s ⊗ x_s dt_s``;
3. the inter-chunk recurrence over those states (a semiseparable matmul over chunks, using
   ``segsum`` again), giving each chunk's starting state and the final state;
4. the starting state's contribution: ``y_l += exp(a_1 + ... + a_l) * C_l · state_start``.

Padded steps get ``dt = 0``: they neither decay the state (``exp(0) = 1``) nor feed it, so the
final state is exact for any ``T``.

Shape legend:
    B batch, T time, H heads, P head dim, G groups (of B/C), R heads per group (H = G * R),
    N state size, K chunks, L position in a chunk (target), S position in a chunk (source),
    Z chunk boundary (K + 1 of them: the initial state, then the end of each chunk).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def segsum(a_XL: torch.Tensor) -> torch.Tensor:
    """``out[..., l, s] = a[s+1] + ... + a[l]`` for ``s <= l`` (0 on the diagonal), else ``-inf``.

    Summing a masked copy avoids ``cumsum[l] - cumsum[s]``, which loses precision to cancellation
    once the cumulative decay grows large.
    """
    n = a_XL.shape[-1]
    a_XLS = a_XL[..., :, None].expand(*a_XL.shape, n)  # [..., k, s] = a[k]
    strict = torch.ones(n, n, dtype=torch.bool, device=a_XL.device).tril(-1)
    out_XLS = a_XLS.masked_fill(~strict, 0.0).cumsum(-2)
    causal = torch.ones(n, n, dtype=torch.bool, device=a_XL.device).tril()
    return out_XLS.masked_fill(~causal, -torch.inf)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # At least fp32 (bf16 exp/cumsum over a chunk is far too coarse); fp64 stays fp64 for tests.
    return torch.promote_types(dtype, torch.float32)


def _to_chunks(t_BT_: torch.Tensor, pad: int, chunk_size: int) -> torch.Tensor:
    """``[B, T, ...] -> [B, K, L, ...]``, zero-padding ``T`` up to a multiple of ``chunk_size``."""
    if pad:
        t_BT_ = F.pad(t_BT_, (0, 0) * (t_BT_.dim() - 2) + (0, pad))
    return t_BT_.reshape(t_BT_.shape[0], -1, chunk_size, *t_BT_.shape[2:])


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
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Chunked SSD scan; ``dt`` is positive (already softplus'd), ``A`` negative.

    Returns ``y_BTHP`` in the dtype of ``x``, and with ``return_final_state`` also the state after
    the last step, ``[B, H, P, N]`` in the compute dtype (fp32, or fp64 for fp64 inputs).
    """
    out_dtype = x_BTHP.dtype
    dtype = _compute_dtype(out_dtype)
    b, T, H, P = x_BTHP.shape
    G, N = B_BTGN.shape[2], B_BTGN.shape[3]
    R = H // G
    pad = (-T) % chunk_size
    x_BTHP, dt_BTH = x_BTHP.to(dtype), dt_BTH.to(dtype)

    # Heads are split as h = g * R + r so that B/C are shared by broadcasting, never copied.
    xdt_BKLGRP = _to_chunks((x_BTHP * dt_BTH[..., None]).view(b, T, G, R, P), pad, chunk_size)
    a_BKLGR = _to_chunks((dt_BTH * A_H.to(dtype)).view(b, T, G, R), pad, chunk_size)
    B_BKLGN = _to_chunks(B_BTGN.to(dtype), pad, chunk_size)
    C_BKLGN = _to_chunks(C_BTGN.to(dtype), pad, chunk_size)
    a_BGRKL = a_BKLGR.permute(0, 3, 4, 1, 2)
    acum_BGRKL = a_BGRKL.cumsum(-1)

    # 1. diagonal blocks: C·B is per group, the decay per head.
    CB_BGKLS = torch.einsum("bklgn,bksgn->bgkls", C_BKLGN, B_BKLGN)
    M_BGRKLS = CB_BGKLS[:, :, None] * torch.exp(segsum(a_BGRKL))
    y_BKLGRP = torch.einsum("bgrkls,bksgrp->bklgrp", M_BGRKLS, xdt_BKLGRP)

    # 2. each chunk's end state, as if it started from zero.
    to_end_BKLGR = torch.exp(acum_BGRKL[..., -1:] - acum_BGRKL).permute(0, 3, 4, 1, 2)
    states_BKGRPN = torch.einsum(
        "bklgn,bklgrp->bkgrpn", B_BKLGN, xdt_BKLGRP * to_end_BKLGR[..., None]
    )

    # 3. inter-chunk recurrence as one semiseparable matmul over the chunk boundaries.
    if initial_state_BHPN is None:
        init_BGRPN = states_BKGRPN.new_zeros(b, G, R, P, N)
    else:
        init_BGRPN = initial_state_BHPN.to(dtype).reshape(b, G, R, P, N)
    states_BZGRPN = torch.cat([init_BGRPN[:, None], states_BKGRPN], dim=1)
    chunk_decay_BGRZZ = torch.exp(segsum(F.pad(acum_BGRKL[..., -1], (1, 0))))
    states_BZGRPN = torch.einsum("bgrzy,bygrpn->bzgrpn", chunk_decay_BGRZZ, states_BZGRPN)
    start_BKGRPN, final_BGRPN = states_BZGRPN[:, :-1], states_BZGRPN[:, -1]

    # 4. the starting state's contribution, decayed to each position of the chunk.
    from_start_BKLGR = torch.exp(acum_BGRKL).permute(0, 3, 4, 1, 2)
    y_BKLGRP = (
        y_BKLGRP
        + torch.einsum("bklgn,bkgrpn->bklgrp", C_BKLGN, start_BKGRPN) * from_start_BKLGR[..., None]
    )

    y_BTHP = y_BKLGRP.reshape(b, -1, H, P)[:, :T]
    if D_H is not None:
        y_BTHP = y_BTHP + D_H.to(dtype)[:, None] * x_BTHP
    y_BTHP = y_BTHP.to(out_dtype)
    if return_final_state:
        return y_BTHP, final_BGRPN.reshape(b, H, P, N)
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
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Plain-math twin of :func:`ssd_scan`: the recurrence, one time step at a time."""
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
