"""The gated delta rule (Yang, Kautz & Hatamizadeh, ICLR 2025, "Gated Delta Networks", §3):
chunked (WY / UT transform, §3.3) in plain torch, a sequential reference twin, and
flash-linear-attention's kernel on CUDA.

Per v-head, state ``S`` is ``[K, V]`` (keys by values), ``q`` and ``k`` L2-normalised by the
caller, ``q`` scaled by ``scale`` (default ``K ** -0.5``) here, ``g <= 0`` the log decay and
``beta`` the write strength:

    S_t = exp(g_t) S_{t-1}                       (decay)
    u_t = beta_t (v_t - S_t^T k_t)               (the delta: what S does not yet predict)
    S_t = S_t + k_t u_t^T                        (= exp(g_t) S_{t-1} (I - beta k k^T) + beta k v^T)
    o_t = S_t^T q_t

(transformers' ``torch_recurrent_gated_delta_rule``; fla's ``fused_recurrent``). Grouped heads:
q/k have ``G`` heads, v has ``H = G * R``; v-head ``h`` reads q/k head ``h // R``
(``repeat_interleave``, transformers' and fla's convention).

Kimi delta attention (KDA, :mod:`composer.blocks.kda`) is the same rule with a log decay per
key channel, ``g [B, T, H, K]``: ``S_t = diag(exp(g_t)) S_{t-1}`` decays each row of the state
by its own rate. Every function here takes either shape; below, a per-channel ``Γ`` gains a
trailing ``K`` and sits inside the key sums (``A[t, j] = beta_t sum_k k_t k_j Γ[t, j, k]``),
``exp(c)`` and ``exp(c_L - c)`` scale ``K`` (and ``Q``) per channel, and the chunk's decay
``exp(c_L)`` scales the rows of ``S``.

Chunked form. Inside a chunk of ``L`` steps, with ``c`` the cumulative sum of ``g`` from the
chunk's start, ``Γ[t, j] = exp(c_t - c_j)`` for ``j <= t`` and ``S0`` the state entering it,
unrolling the recurrence gives a unit lower-triangular system for the deltas ``U``:

    (I + A) U = diag(beta) V - diag(beta * exp(c)) K S0,
    A[t, j]   = beta_t (k_t . k_j) Γ[t, j]  for j < t, else 0
    O   = diag(exp(c)) Q S0 + ((Q K^T) * Γ) U               (the diagonal included)
    S_L = exp(c_L) S0 + (K * exp(c_L - c))^T U

so ``U = U0 - W S0`` with ``U0 = (I + A)^-1 diag(beta) V`` and ``W = (I + A)^-1 diag(beta e^c) K``,
both solved for all chunks at once (``solve_triangular``); only the pass over chunk boundaries is
sequential. Cumulative sums are taken in fp64 and their differences rounded once (as in
:mod:`composer.kernels.ssd`). Padded steps have ``g = beta = k = v = 0``: they neither decay nor
write, so the final state is exact for any ``T``.

Packed documents (``doc_ids``, :mod:`composer.kernels.packing`): the state restarts from zero at
each document's first token, i.e. the decay across a boundary is exactly 0. As in ``ssd.py``
every exponential of a cumulative-sum difference is masked to 0 across a boundary: ``Γ`` (so
``I + A`` becomes block diagonal by document), ``exp(c_t)`` (0 unless ``t`` continues the
document entering the chunk) and ``exp(c_L - c_t)`` (0 unless ``t`` is in the chunk's last
document). An initial state belongs to each row's first document, the final state is its last.

The backward pass is autograd through these ops (``solve_triangular`` differentiates); a
hand-written one, as for SSD, is future work.

Shape legend:
    B batch, T time, G q/k heads, H v-heads (H = G * R), K key head dim, V value head dim,
    N chunks, L position in a chunk (target), S position in a chunk (source).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from composer.kernels import probe
from composer.kernels.packing import doc_segments, doc_starts

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

GDNOut = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _heads_first(t_BT_: torch.Tensor, pad: int, L: int, dtype: torch.dtype) -> torch.Tensor:
    """``[B, T, H, ...] -> [B, H, N, L, ...]`` in ``dtype``, zero-padding ``T`` to ``N * L``."""
    t = t_BT_.to(dtype).transpose(1, 2)
    if pad:
        t = F.pad(t, (0, 0) * (t.dim() - 3) + (0, pad))
    return t.reshape(t.shape[0], t.shape[1], -1, L, *t.shape[3:])


def _decays(g_BHNL_: torch.Tensor, seg_BT: torch.Tensor | None, dtype: torch.dtype):
    """``Γ [B, H, N, L, S]`` (0 above the diagonal), ``exp(c) [B, H, N, L]`` and
    ``exp(c_L - c) [B, H, N, L]``, masked across document boundaries when ``seg`` is given. A
    per-key-channel decay ``g [B, H, N, L, K]`` (KDA) gives each of them a trailing ``K``."""
    if g_BHNL_.dim() == 4:  # the scalar decay as one channel
        decay, from_start, to_end = _decays(g_BHNL_[..., None], seg_BT, dtype)
        return decay[..., 0], from_start[..., 0], to_end[..., 0]
    b, _, n, L, _ = g_BHNL_.shape
    c64 = g_BHNL_.double().cumsum(-2)
    diff = (c64[..., :, None, :] - c64[..., None, :, :]).to(dtype)
    keep_LS = torch.ones(L, L, dtype=torch.bool, device=g_BHNL_.device).tril_()
    from_start = torch.exp(c64).to(dtype)
    to_end = torch.exp(c64[..., -1:, :] - c64).to(dtype)
    if seg_BT is None:
        return diff.masked_fill(~keep_LS[..., None], float("-inf")).exp(), from_start, to_end
    pad = n * L - seg_BT.shape[1]
    if pad:  # padding joins the last document
        seg_BT = torch.cat([seg_BT, seg_BT[:, -1:].expand(b, pad)], 1)
    seg_BNL = seg_BT.reshape(b, n, L)
    before_BN = torch.cat([seg_BNL[:, :1, 0], seg_BNL[:, :-1, -1]], 1)
    same_BNLS = (seg_BNL[..., :, None] == seg_BNL[..., None, :]) & keep_LS
    decay = diff.masked_fill(~same_BNLS[:, None, ..., None], float("-inf")).exp()
    from_start = from_start.masked_fill((seg_BNL != before_BN[..., None])[:, None, ..., None],
                                        0.0)
    to_end = to_end.masked_fill((seg_BNL != seg_BNL[..., -1:])[:, None, ..., None], 0.0)
    return decay, from_start, to_end


def _weighted(a_BHNLK: torch.Tensor, b_BHNSK: torch.Tensor, decay: torch.Tensor) -> torch.Tensor:
    """``(a b^T) * Γ`` ``[B, H, N, L, S]``; with a per-channel ``Γ [B, H, N, L, S, K]`` the
    decay sits inside the key sum: ``sum_k a[l, k] b[s, k] Γ[l, s, k]``."""
    if decay.dim() == a_BHNLK.dim():
        return (a_BHNLK @ b_BHNSK.transpose(-1, -2)) * decay
    return (a_BHNLK[..., :, None, :] * b_BHNSK[..., None, :, :] * decay).sum(-1)


def gdn_chunked(
    q_BTGK: torch.Tensor,
    k_BTGK: torch.Tensor,
    v_BTHV: torch.Tensor,
    g_BTH: torch.Tensor,
    beta_BTH: torch.Tensor,
    chunk_size: int = 64,
    scale: float | None = None,
    initial_state_BHKV: torch.Tensor | None = None,
    return_final_state: bool = False,
    *,
    doc_ids: torch.Tensor | None = None,
) -> GDNOut:
    """Chunked gated delta rule (module docstring). Returns ``o_BTHV`` in the compute dtype
    (``promote(v.dtype, fp32)``) and with ``return_final_state`` also ``S [B, H, K, V]``. The
    result does not depend on ``chunk_size`` (up to rounding)."""
    b, T, G, K = q_BTGK.shape
    H, V = v_BTHV.shape[2], v_BTHV.shape[3]
    dtype = _compute_dtype(v_BTHV.dtype)
    scale = K ** -0.5 if scale is None else scale
    L = max(1, min(chunk_size, T))
    pad = (-T) % L
    R = H // G
    with torch.autocast(v_BTHV.device.type, enabled=False):
        q = _heads_first(q_BTGK.repeat_interleave(R, 2), pad, L, dtype) * scale
        k = _heads_first(k_BTGK.repeat_interleave(R, 2), pad, L, dtype)
        v = _heads_first(v_BTHV, pad, L, dtype)
        beta = _heads_first(beta_BTH, pad, L, dtype)
        seg = None if doc_ids is None else doc_segments(doc_ids)
        decay, from_start, to_end = _decays(_heads_first(g_BTH, pad, L, dtype), seg, dtype)
        if from_start.dim() == 4:  # scalar decay: broadcast over the key channels
            from_start, to_end = from_start[..., None], to_end[..., None]
        k_beta = k * beta[..., None]
        # I + A, strictly lower (solve_triangular with unitriangular reads neither the diagonal
        # nor the upper triangle, both of which are 0 or ignored here).
        A = _weighted(k_beta, k, decay)
        U0 = torch.linalg.solve_triangular(A, v * beta[..., None], upper=False,
                                           unitriangular=True)
        W = torch.linalg.solve_triangular(A, k_beta * from_start, upper=False,
                                          unitriangular=True)
        attn = _weighted(q, k, decay)
        q_start = q * from_start
        k_end = k * to_end
        chunk_decay = from_start[..., -1, :, None]  # [B, H, N, 1 or K, 1]
        if initial_state_BHKV is None:
            S = v.new_zeros(b, H, K, V)
        else:
            S = initial_state_BHKV.to(dtype)
        outs = []
        for i in range(v.shape[2]):
            u = U0[:, :, i] - W[:, :, i] @ S
            outs.append(q_start[:, :, i] @ S + attn[:, :, i] @ u)
            S = S * chunk_decay[:, :, i] + k_end[:, :, i].transpose(-1, -2) @ u
        o = torch.stack(outs, 2).reshape(b, H, -1, V)[:, :, :T].transpose(1, 2)
    if return_final_state:
        return o, S
    return o


def gdn_recurrent_ref(
    q_BTGK: torch.Tensor,
    k_BTGK: torch.Tensor,
    v_BTHV: torch.Tensor,
    g_BTH: torch.Tensor,
    beta_BTH: torch.Tensor,
    scale: float | None = None,
    initial_state_BHKV: torch.Tensor | None = None,
    return_final_state: bool = False,
    *,
    doc_ids: torch.Tensor | None = None,
) -> GDNOut:
    """Plain-math twin of :func:`gdn_chunked`: the recurrence one step at a time (use fp64); with
    ``doc_ids`` the state is set to zero before the first step of every new document."""
    b, T, G, K = q_BTGK.shape
    H, V = v_BTHV.shape[2], v_BTHV.shape[3]
    dtype = _compute_dtype(v_BTHV.dtype)
    scale = K ** -0.5 if scale is None else scale
    kv_head = torch.arange(H, device=v_BTHV.device) // (H // G)
    q = q_BTGK.to(dtype)[:, :, kv_head] * scale
    k = k_BTGK.to(dtype)[:, :, kv_head]
    v, g, beta = v_BTHV.to(dtype), g_BTH.to(dtype), beta_BTH.to(dtype)
    S = v.new_zeros(b, H, K, V) if initial_state_BHKV is None else initial_state_BHKV.to(dtype)
    outs = []
    for t in range(T):
        if doc_ids is not None and t > 0:
            S = S * (doc_ids[:, t] == doc_ids[:, t - 1]).to(dtype)[:, None, None, None]
        S = _per_row(torch.exp(g[:, t])) * S
        pred = torch.einsum("bhkv,bhk->bhv", S, k[:, t])
        u = beta[:, t, :, None] * (v[:, t] - pred)
        S = S + k[:, t, :, :, None] * u[:, :, None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t]))
    o = torch.stack(outs, 1)
    if return_final_state:
        return o, S
    return o


def _per_row(decay: torch.Tensor) -> torch.Tensor:
    """A step's decay ``[B, H]`` (one per head) or ``[B, H, K]`` (one per key channel, KDA) as
    the factor of the state ``[B, H, K, V]``: per head, or per row of the state."""
    return decay[..., None] if decay.dim() == 3 else decay[..., None, None]


def gdn_step(q_B1GK: torch.Tensor, k_B1GK: torch.Tensor, v_B1HV: torch.Tensor,
             g_B1H: torch.Tensor, beta_B1H: torch.Tensor, state_BHKV: torch.Tensor,
             scale: float | None = None) -> torch.Tensor:
    """One step of the recurrence (a decoded token), updating ``state`` in place; the
    arithmetic of :func:`gdn_recurrent_ref` (fla's ``fused_recurrent_gated_delta_rule`` would
    take this layout on CUDA). Returns ``o [B, 1, H, V]`` in the state's dtype (>= fp32)."""
    G, K = q_B1GK.shape[2], q_B1GK.shape[3]
    H = v_B1HV.shape[2]
    dtype = torch.promote_types(_compute_dtype(v_B1HV.dtype), state_BHKV.dtype)
    scale = K ** -0.5 if scale is None else scale
    q_BHK = q_B1GK[:, 0].to(dtype).repeat_interleave(H // G, dim=1) * scale
    k_BHK = k_B1GK[:, 0].to(dtype).repeat_interleave(H // G, dim=1)
    v_BHV, g_BH, beta_BH = v_B1HV[:, 0].to(dtype), g_B1H[:, 0].to(dtype), beta_B1H[:, 0].to(dtype)
    b, _, K, V = state_BHKV.shape
    if state_BHKV.dtype == dtype and state_BHKV.is_contiguous():
        S = state_BHKV  # updated in place
    else:
        S = state_BHKV.to(dtype).contiguous()
    S.mul_(_per_row(torch.exp(g_BH)))
    flat = S.view(b * H, K, V)
    pred_BHV = torch.bmm(k_BHK.reshape(b * H, 1, K), flat).view(b, H, V)
    u_BHV = beta_BH[..., None] * (v_BHV - pred_BHV)
    flat.baddbmm_(k_BHK.reshape(b * H, K, 1), u_BHV.reshape(b * H, 1, V))
    if S is not state_BHKV:
        state_BHKV.copy_(S)
    return torch.bmm(q_BHK.reshape(b * H, 1, K), flat).view(b, 1, H, V)


# ---------------------------------------------------------------- the fla kernel on CUDA


def gdn_kernel(q_BTGK, k_BTGK, v_BTHV, g_BTH, beta_BTH, scale=None, initial_state_BHKV=None,
               return_final_state=False, *, doc_ids=None) -> GDNOut:
    """fla's ``chunk_gated_delta_rule(q, k, v, g, beta, scale, initial_state,
    output_final_state, cu_seqlens)`` (``[B, T, H, ...]`` layout, fp32 state). q/k heads are
    repeated to the v-heads first (not every fla release takes fewer q/k heads). Packed
    documents: the rows are flattened into one varlen batch (``cu_seqlens`` at every row and
    document start); a row's initial state goes to its first document, its final state is
    that of its last. A per-key-channel decay ``g [B, T, H, K]`` (KDA) goes to fla's
    ``chunk_kda`` instead, with the same arguments (``g`` the log decay, already gated)."""
    if g_BTH.dim() == 4:
        fn = probe.module("fla_kda").chunk_kda
    else:
        fn = probe.module("fla").chunk_gated_delta_rule
    b, T, G, K = q_BTGK.shape
    H, V = v_BTHV.shape[2], v_BTHV.shape[3]
    R = H // G
    q, k = q_BTGK.repeat_interleave(R, 2), k_BTGK.repeat_interleave(R, 2)
    q, k, v = (t.to(v_BTHV.dtype).contiguous() for t in (q, k, v_BTHV))
    g, beta = g_BTH.float().contiguous(), beta_BTH.to(v_BTHV.dtype).contiguous()
    init = None if initial_state_BHKV is None else initial_state_BHKV.float().contiguous()
    if doc_ids is None:
        o, final = fn(q, k, v, g, beta, scale=scale, initial_state=init,
                      output_final_state=return_final_state)
    else:
        starts_BT = doc_starts(doc_ids).clone()
        starts_BT[:, 0] = True
        first_N = starts_BT.flatten().nonzero().flatten()  # the start of every sequence
        cu = torch.cat([first_N, first_N.new_full((1,), b * T)])
        row_first_B = starts_BT.sum(1).cumsum(0) - starts_BT.sum(1)  # index of each row's first
        if init is not None:
            full = init.new_zeros(first_N.numel(), H, K, V)
            full[row_first_B] = init
            init = full
        flat = [t.reshape(1, b * T, *t.shape[2:]) for t in (q, k, v, g, beta)]
        o, final = fn(*flat, scale=scale, initial_state=init,
                      output_final_state=return_final_state, cu_seqlens=cu)
        o = o.reshape(b, T, H, V)
        if return_final_state:
            final = final[starts_BT.sum(1).cumsum(0) - 1]
    o = o.to(_compute_dtype(v_BTHV.dtype))
    return (o, final) if return_final_state else o


def gated_delta_rule(q_BTGK, k_BTGK, v_BTHV, g_BTH, beta_BTH, chunk_size: int = 64,
                     scale: float | None = None, initial_state_BHKV=None,
                     return_final_state: bool = False, *, doc_ids=None) -> GDNOut:
    """The block's hook: :func:`gdn_kernel` for CUDA tensors of a kernel dtype when fla imports
    (and ``COMPOSER_DISABLE_KERNELS`` does not name it), else :func:`gdn_chunked`. CPU tensors
    never probe. Same semantics and return dtypes on both paths."""
    name = "fla_kda" if g_BTH.dim() == 4 else "fla"
    if probe.on_gpu(v_BTHV) and v_BTHV.dtype in KERNEL_DTYPES and probe.available(name):
        return gdn_kernel(q_BTGK, k_BTGK, v_BTHV, g_BTH, beta_BTH, scale, initial_state_BHKV,
                          return_final_state, doc_ids=doc_ids)
    return gdn_chunked(q_BTGK, k_BTGK, v_BTHV, g_BTH, beta_BTH, chunk_size, scale,
                       initial_state_BHKV, return_final_state, doc_ids=doc_ids)


def gdn_end_state(q_BTGK: torch.Tensor, k_BTGK: torch.Tensor, v_BTHV: torch.Tensor,
                  g_BTH: torch.Tensor, beta_BTH: torch.Tensor, chunk_size: int = 64, *,
                  doc_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's end state from a zero start ``[B, H, K, V]`` and its transition ``M``
    ``[B, H, K, K]``: a start state ``S`` ends as ``M @ S + end`` (the rule is linear in the
    state). One :func:`gated_delta_rule` pass with ``v`` widened by ``K`` zero columns started
    from ``[0 | I]``: the extra columns come out as ``M``. With ``doc_ids`` a start state does not
    survive a document start (``M`` is 0 then)."""
    b, T, H, V = v_BTHV.shape
    K = q_BTGK.shape[-1]
    v_aug = torch.cat([v_BTHV, v_BTHV.new_zeros(b, T, H, K)], -1)
    init = v_BTHV.new_zeros(b, H, K, V + K)
    init[..., V:] = torch.eye(K, dtype=init.dtype, device=init.device)
    _, end = gated_delta_rule(q_BTGK, k_BTGK, v_aug, g_BTH, beta_BTH, chunk_size,
                              initial_state_BHKV=init, return_final_state=True, doc_ids=doc_ids)
    return end[..., :V], end[..., V:]
