"""Context-parallel attention and multi-latent attention (the package docstring)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from composer.parallel.context.layout import CPContext, gather_chunks, gather_padded


def cp_attention_forward(self: nn.Module, x_BTD: torch.Tensor, *,
                         doc_ids: torch.Tensor | None = None) -> torch.Tensor:
    """:class:`composer.blocks.attention.Attention` over the whole rows (module docstring)."""
    from composer.blocks.attention import apply_rope, rope_cos_sin_at

    cp: CPContext = self.cp
    q_BHTE, k_BKTE, v_BKTE, gate_BTX = self._project(x_BTD)
    if self.rope:
        cos, sin = rope_cos_sin_at(cp.pos_BT, self.inv_freq, q_BHTE.dtype)
        q_BHTE, k_BKTE = apply_rope(q_BHTE, cos, sin), apply_rope(k_BKTE, cos, sin)
    if cp.layout is not None:
        return self._output(adaptive_attention(q_BHTE, k_BKTE, v_BKTE, cp, self.scale),
                            gate_BTX)
    k_all, v_all = gather_chunks(k_BKTE, cp, 2), gather_chunks(v_BKTE, cp, 2)
    return self._output(chunk_attention(q_BHTE, k_all, v_all, cp, self.scale), gate_BTX)


def chunk_attention(q_BHTE: torch.Tensor, k_BKSE: torch.Tensor, v_BKSE: torch.Tensor,
                    cp: CPContext, scale: float) -> torch.Tensor:
    """This rank's queries (its two chunks) against every key of the rows: chunk ``c`` sees
    keys ``[0, (c + 1) L)`` under the causal mask of global positions, and its own document's
    only when the rows are packed."""
    from composer.kernels import sdpa_context

    L = cp.L
    outs = []
    if cp.seg_BT is None and q_BHTE.device.type == "cpu":
        # no mask at all: each chunk's keys as a causal diagonal block and an unmasked prefix,
        # merged by their log-sum-exps (memory linear in the keys; a boolean mask would be
        # converted to an L x (c + 1) L float bias and kept for the backward)
        if k_BKSE.shape[1] != q_BHTE.shape[1]:
            rep = q_BHTE.shape[1] // k_BKSE.shape[1]
            k_BKSE, v_BKSE = (k_BKSE.repeat_interleave(rep, 1), v_BKSE.repeat_interleave(rep, 1))
        e_qk, e_v = q_BHTE.shape[-1], v_BKSE.shape[-1]
        if e_v != e_qk:  # the kernel wants one head width: zero columns change nothing
            width = max(e_qk, e_v)
            q_BHTE, k_BKSE = F.pad(q_BHTE, (0, width - e_qk)), F.pad(k_BKSE, (0, width - e_qk))
            v_BKSE = F.pad(v_BKSE, (0, width - e_v))
        for slot, c in enumerate(cp.chunks):
            q = q_BHTE[:, :, slot * L:(slot + 1) * L]
            end = (c + 1) * L
            outs.append(_PrefixCausalAttention.apply(q, k_BKSE[:, :, :end], v_BKSE[:, :, :end],
                                                     scale))
        return torch.cat(outs, dim=2)[..., :e_v]
    for slot, c in enumerate(cp.chunks):
        q = q_BHTE[:, :, slot * L:(slot + 1) * L]
        end = (c + 1) * L
        mask = torch.ones(L, end, dtype=torch.bool, device=q.device).tril_(c * L)
        if cp.seg_BT is not None:
            seg_q, seg_k = cp.seg_BT[:, c * L:end], cp.seg_BT[:, :end]
            mask = (mask & (seg_q[:, :, None] == seg_k[:, None, :]))[:, None]
        with sdpa_context(q):
            outs.append(F.scaled_dot_product_attention(
                q, k_BKSE[:, :, :end], v_BKSE[:, :, :end], attn_mask=mask, scale=scale,
                enable_gqa=q.shape[1] != k_BKSE.shape[1]))
    return torch.cat(outs, dim=2)


class _PrefixCausalAttention(torch.autograd.Function):
    """Queries ``[B, H, L, E]`` that are the last ``L`` positions of keys ``[B, H, S, E]``:
    attention over the keys before them (no mask) and the causal ``L x L`` block, each by
    torch's CPU flash kernel, merged by their log-sum-exps; the backward runs the kernel's
    backward on each block with the merged output and log-sum-exp (as ring attention does),
    which gives the exact gradient of the merged attention."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                scale: float) -> torch.Tensor:
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        L, S = q.shape[2], k.shape[2]
        blocks = [(0, S - L, False), (S - L, S, True)] if S > L else [(0, S, True)]
        outs = [flash(q, k[:, :, a:b], v[:, :, a:b], 0.0, causal, scale=scale)
                for a, b, causal in blocks]
        if len(outs) == 1:
            o, lse = outs[0]
        else:
            (o1, l1), (o2, l2) = outs
            lse = torch.logaddexp(l1, l2)
            o = (o1 * (l1 - lse).exp()[..., None].to(o1.dtype)
                 + o2 * (l2 - lse).exp()[..., None].to(o2.dtype))
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.blocks, ctx.scale = blocks, scale
        return o

    @staticmethod
    def backward(ctx: Any, do: torch.Tensor) -> tuple[torch.Tensor, ...]:
        back = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        q, k, v, o, lse = ctx.saved_tensors
        dq = torch.zeros_like(q)
        dks, dvs = [], []
        for a, b, causal in ctx.blocks:
            dq_b, dk_b, dv_b = back(do.contiguous(), q, k[:, :, a:b], v[:, :, a:b], o, lse, 0.0,
                                    causal, scale=ctx.scale)
            dq += dq_b
            dks.append(dk_b)
            dvs.append(dv_b)
        return dq, torch.cat(dks, 2), torch.cat(dvs, 2), None


def cp_mla_forward(self: nn.Module, x_BTD: torch.Tensor, *,
                   doc_ids: torch.Tensor | None = None) -> torch.Tensor:
    """:class:`composer.blocks.mla.MLA` over the whole rows: the normalised
    latents and RoPE keys (``C + R`` numbers a token) are all-gathered, and every rank expands
    them into per-head keys and values (module docstring)."""
    from composer.blocks.attention import apply_rope, rope_cos_sin_at

    cp: CPContext = self.cp
    self._check_length(cp.T)
    b, t, _ = x_BTD.shape
    qn_BHTN, qr_BHTR, c_BTC, kr_BTR = self._project(x_BTD)
    cos, sin = rope_cos_sin_at(cp.pos_BT, self.inv_freq, qn_BHTN.dtype)
    cos, sin = self._gain(cos), self._gain(sin)
    qr_BHTR = apply_rope(qr_BHTR, cos, sin)
    kr_B1TR = apply_rope(kr_BTR[:, None], cos, sin)
    if cp.layout is not None:
        n_max = cp.layout.max_tokens
        c_BSC, kr_B1SR = gather_padded(c_BTC, cp, 1, n_max), gather_padded(kr_B1TR, cp, 2, n_max)
    else:
        c_BSC, kr_B1SR = gather_chunks(c_BTC, cp, 1), gather_chunks(kr_B1TR, cp, 2)
    h, S = qn_BHTN.shape[1], c_BSC.shape[1]
    kv = self.kv_b_proj(c_BSC).view(b, S, -1, self.d_nope + self.d_v)
    kn_BHSN, v_BHSV = kv.transpose(1, 2).split([self.d_nope, self.d_v], dim=-1)
    q_BHTQ = torch.cat([qn_BHTN, qr_BHTR], dim=-1)
    k_BHSQ = torch.cat([kn_BHSN, kr_B1SR.expand(-1, h, -1, -1)], dim=-1)
    if cp.layout is not None:
        from composer.kernels import sdpa_context

        with sdpa_context(q_BHTQ):
            o_BHTV = F.scaled_dot_product_attention(q_BHTQ, k_BHSQ, v_BHSV,
                                                    attn_mask=cp.extra["mask"], scale=self.scale)
    else:
        o_BHTV = chunk_attention(q_BHTQ, k_BHSQ, v_BHSV, cp, self.scale)
    return self.o_proj(o_BHTV.transpose(1, 2).reshape(b, t, -1))


def adaptive_attention(q_BHTE: torch.Tensor, k_BKTE: torch.Tensor, v_BKTE: torch.Tensor,
                       cp: CPContext, scale: float) -> torch.Tensor:
    """This rank's queries against every rank's keys (gathered, padded), masked to the same
    document and earlier positions."""
    from composer.kernels import sdpa_context

    n_max = cp.layout.max_tokens
    k_all, v_all = gather_padded(k_BKTE, cp, 2, n_max), gather_padded(v_BKTE, cp, 2, n_max)
    with sdpa_context(q_BHTE):
        return F.scaled_dot_product_attention(
            q_BHTE, k_all, v_all, attn_mask=cp.extra["mask"], scale=scale,
            enable_gqa=q_BHTE.shape[1] != k_all.shape[1])
