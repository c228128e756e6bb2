"""Context-parallel Mamba-2 and gated delta nets: convolution halos and chunk state passing
(the package docstring)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from composer.parallel.context.adaptive import adaptive_gdn_forward, adaptive_mamba_forward
from composer.parallel.context.layout import CPContext, _global_chunks, dt_args


def halo_conv(x_BTX: torch.Tensor, conv: nn.Module, cp: CPContext) -> torch.Tensor:
    """``silu(conv(x))`` of this rank's two chunks as ``[2B, L, X]`` rows (slot-major within
    each batch row), each preceded by the ``K - 1`` inputs before it in the whole row."""
    from composer.kernels import conv_silu

    b, _, X = x_BTX.shape
    L = cp.L
    h = conv.kernel - 1
    x_B2LX = x_BTX.view(b, 2, L, X)
    if h == 0:
        rows = x_B2LX.reshape(2 * b, L, X)
        return conv_silu(rows, conv, _chunk_docs(cp, b, 0))
    tails = _global_chunks(x_B2LX[:, :, L - h:].contiguous(), cp)  # [B, 2N, h, X]
    halo = torch.stack([tails[:, c - 1] if c > 0 else torch.zeros_like(tails[:, 0])
                        for c in cp.chunks], 1)
    rows = torch.cat([halo, x_B2LX], dim=2).reshape(2 * b, h + L, X)
    return conv_silu(rows, conv, _chunk_docs(cp, b, h))[:, h:]


def _chunk_docs(cp: CPContext, b: int, halo: int) -> torch.Tensor | None:
    """The doc ids of this rank's chunk rows (``[2B, halo + L]``, the halo included; a halo
    before the row's start takes the first token's id: its inputs are zeros)."""
    if cp.doc_BT is None:
        return None
    L = cp.L
    rows = []
    for c in cp.chunks:
        start = c * L - halo
        ids = cp.doc_BT[:, max(start, 0):(c + 1) * L]
        if start < 0:
            ids = torch.cat([ids[:, :1].expand(-1, -start), ids], 1)
        rows.append(ids)
    return torch.stack(rows, 1).reshape(2 * b, halo + L)


def _continues(cp: CPContext) -> torch.Tensor | None:
    """``[B, 2N]``: 1 where chunk ``c`` continues the document of the token before it (always
    for ``c > 0`` without documents; never for ``c = 0``)."""
    if cp.doc_BT is None:
        return None
    L = cp.L
    starts = torch.arange(2 * cp.size, device=cp.doc_BT.device) * L
    prev = cp.doc_BT[:, (starts - 1).clamp(min=0)]
    same = (cp.doc_BT[:, starts] == prev)
    same[:, 0] = False
    return same


def pass_states(local_B2N_: torch.Tensor, trans_B2N_: torch.Tensor, cp: CPContext,
                apply: Any) -> torch.Tensor:
    """The state entering each of this rank's chunks, ``[B, 2, ...]``: the recurrence
    ``start[c] = apply(trans[c-1], start[c-1]) + local[c-1]`` over every chunk of the rows
    (``start[0] = 0``; zero where a document starts at the chunk)."""
    local = _global_chunks(local_B2N_, cp)
    trans = _global_chunks(trans_B2N_, cp)
    cont = _continues(cp)
    starts = [torch.zeros_like(local[:, 0])]
    for c in range(1, 2 * cp.size):
        s = apply(trans[:, c - 1], starts[c - 1]) + local[:, c - 1]
        if cont is not None:
            s = s * cont[:, c].view(-1, *([1] * (s.dim() - 1))).to(s.dtype)
        starts.append(s)
    return torch.stack([starts[c] for c in cp.chunks], 1)


def cp_mamba_forward(self: nn.Module, x_BTD: torch.Tensor, *,
                     doc_ids: torch.Tensor | None = None) -> torch.Tensor:
    """:class:`composer.blocks.mamba2.Mamba2Mixer` over the whole rows: the convolution with
    its halo, the scan with chunk state passing (module docstring)."""
    from composer.kernels import mamba_scan
    from composer.kernels.docs import doc_segments
    from composer.kernels.scan import ssd_end_state

    cp: CPContext = self.cp
    if cp.layout is not None:
        return adaptive_mamba_forward(self, x_BTD)
    b, T, _ = x_BTD.shape
    L, chunk = cp.L, self.mamba_cfg.chunk_size
    z_BTE, xBC_BTX, dt_BTH = self.project(x_BTD)
    conv_RLX = halo_conv(xBC_BTX, self.conv1d, cp).contiguous()  # R = 2B chunk rows
    x_RLHP, B_RLGN, C_RLGN, A_H, extra = self.scan_inputs(conv_RLX)
    dt_RLH = dt_BTH.reshape(2 * b, L, -1)
    docs = _chunk_docs(cp, b, 0)
    R, _, H, P = x_RLHP.shape
    # each chunk's end state from zero and its decay, in closed form (no extra scan)
    seg = None if docs is None else doc_segments(docs)
    end_RHPN, decay_RH = ssd_end_state(x_RLHP, dt_RLH, A_H, B_RLGN, seg, **dt_args(extra))
    local = end_RHPN.reshape(b, 2, H, P, -1)
    decay = decay_RH.reshape(b, 2, H)
    start = pass_states(local, decay, cp, lambda d, s: d[..., None, None] * s)
    y_RLHP = mamba_scan(x_RLHP, dt_RLH, A_H, B_RLGN, C_RLGN, chunk, **extra, doc_ids=docs,
                        initial_state_BHPN=start.reshape(R, H, P, -1))
    return self.finish(y_RLHP.reshape(b, T, H, P), z_BTE, x_BTD.dtype)


def cp_gdn_forward(self: nn.Module, x_BTD: torch.Tensor, *,
                   doc_ids: torch.Tensor | None = None) -> torch.Tensor:
    """:class:`composer.blocks.gdn.GatedDeltaNet` over the whole rows: the convolution with its
    halo, the delta rule with chunk state passing (module docstring)."""
    from composer.kernels.gdn import gated_delta_rule, gdn_end_state

    cp: CPContext = self.cp
    if cp.layout is not None:
        return adaptive_gdn_forward(self, x_BTD)
    b, T, _ = x_BTD.shape
    L, chunk = cp.L, self.gdn_cfg.chunk_size
    conv_RLX = halo_conv(self.project(x_BTD), self.conv1d, cp)
    x_RLD = x_BTD.reshape(2 * b, L, -1)
    q, k, v_RLHV, g, beta = self.rule_inputs(conv_RLX, x_RLD)
    docs = _chunk_docs(cp, b, 0)
    R, _, H, V = v_RLHV.shape
    end_RHKV, trans_RHKK = gdn_end_state(q, k, v_RLHV, g, beta, chunk, doc_ids=docs)
    local = end_RHKV.reshape(b, 2, H, -1, V)
    trans = trans_RHKK.reshape(b, 2, H, *trans_RHKK.shape[-2:])
    start = pass_states(local, trans, cp, lambda m, s: m @ s)
    o_RLHV = gated_delta_rule(q, k, v_RLHV, g, beta, chunk, doc_ids=docs,
                              initial_state_BHKV=start.reshape(R, H, -1, V))
    return self.finish(o_RLHV.reshape(b, T, H, V), x_BTD)
