"""Context-parallel attention and multi-latent attention (the package docstring): the variants
``kv_gather`` (:class:`GatheredKV`) and ``latent_gather`` (:class:`GatheredLatent`) of the
blocks' time-mixing ops, which take the ops' arguments and attend this rank's queries to the
keys of the whole rows."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from composer.kernels.flex import Visible, flex_attend, use_flex
from composer.parallel.context.layout import CPContext, gather_chunks, gather_padded
from composer.parallel.context.variants import register_variant


def _no_step(step: Any) -> None:
    if step is not None:
        raise ValueError("decoding (step=) does not run under context parallelism")


def _gather(x: torch.Tensor, cp: CPContext, dim: int) -> torch.Tensor:
    """Every rank's ``x`` along ``dim``: the 2N chunks in global order, or the adaptive
    layout's padded pieces (rank-major)."""
    if cp.layout is None:
        return gather_chunks(x, cp, dim)
    return gather_padded(x, cp, dim, cp.layout.max_tokens)


def _attend(q_BHTE: torch.Tensor, k_BKSE: torch.Tensor, v_BKSE: torch.Tensor, cp: CPContext,
            scale: float, window: int | None = None,
            sinks: torch.Tensor | None = None) -> torch.Tensor:
    """This rank's queries against the gathered keys: :func:`chunk_attention` in the 2N-chunk
    layout; in the adaptive one, masked to the same document and earlier positions
    (``cp.extra["mask"]``, :mod:`.adaptive`), and to the ``window`` when given."""
    from composer.blocks.attn_core import attend

    if cp.layout is None:
        return chunk_attention(q_BHTE, k_BKSE, v_BKSE, cp, scale, window, sinks)
    if use_flex(q_BHTE):  # CUDA: the documents' block mask, no [T_r, N x T_max] tensor
        visible = dataclasses.replace(cp.extra["visible"], window=window)
        return flex_attend(q_BHTE, k_BKSE, v_BKSE, scale, visible, sinks)
    mask = cp.extra["mask"]
    if window is not None:
        mask = mask & (cp.extra["dist"] < window)
    return attend(q_BHTE, k_BKSE, v_BKSE, scale, mask=mask, sinks=sinks)


class GatheredKV(nn.Module):
    """``kv_gather``: :class:`composer.blocks.attention.CausalAttention` over the whole rows.
    RoPE at the tokens' global (or in-document) positions ``cp.pos_BT``; keys and values are
    all-gathered (their gradients reduce-scattered back)."""

    def __init__(self, op: nn.Module, cp: CPContext) -> None:
        super().__init__()
        self.op, self.cp = op, cp

    def forward(self, q_BHTE: torch.Tensor, k_BKTE: torch.Tensor, v_BKTE: torch.Tensor,
                rotary: Any, scale: float, *, doc_ids: torch.Tensor | None = None,
                step: Any = None, positions: torch.Tensor | None = None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        """The op's output for this rank's tokens (``doc_ids``: the rows' own are in ``cp``);
        the op's sliding window and the mixer's ``sinks`` apply as in one process."""
        from composer.blocks.attention import apply_rope

        _no_step(step)
        if positions is not None:
            raise ValueError("context parallelism with M-RoPE positions (images) is not built "
                             "yet")
        cp = self.cp
        if rotary is not None:
            cos, sin = rotary.at(cp.pos_BT, q_BHTE.dtype)
            q_BHTE, k_BKTE = apply_rope(q_BHTE, cos, sin), apply_rope(k_BKTE, cos, sin)
        return _attend(q_BHTE, _gather(k_BKTE, cp, 2), _gather(v_BKTE, cp, 2), cp, scale,
                       getattr(self.op, "window", None), sinks)


class GatheredLatent(nn.Module):
    """``latent_gather``: :class:`composer.blocks.mla.LatentAttention` over the whole rows.
    The normalised latents and RoPE keys (``C + R`` numbers a token) are all-gathered and every
    rank expands them into per-head keys and values; rows longer than the op's
    ``max_dense_len`` are refused by their whole length."""

    def __init__(self, op: nn.Module, cp: CPContext) -> None:
        super().__init__()
        self.op, self.cp = op, cp

    def forward(self, qn_BHTN: torch.Tensor, qr_BHTR: torch.Tensor, c_BTC: torch.Tensor,
                kr_BTR: torch.Tensor, expand: Any, rotary: Any, scale: float, *,
                doc_ids: torch.Tensor | None = None, step: Any = None) -> torch.Tensor:
        from composer.blocks.attention import apply_rope
        from composer.blocks.mla import latent_keys

        _no_step(step)
        cp = self.cp
        self.op.check_length(cp.T)
        kr_B1TR = kr_BTR[:, None]
        if rotary is not None:  # None: a NoPE MLA (mla.rope false)
            cos, sin = rotary.at(cp.pos_BT, qn_BHTN.dtype)
            qr_BHTR = apply_rope(qr_BHTR, cos, sin)
            kr_B1TR = apply_rope(kr_B1TR, cos, sin)
        c_BSC, kr_B1SR = _gather(c_BTC, cp, 1), _gather(kr_B1TR, cp, 2)
        q_BHTQ, k_BHSQ, v_BHSV = latent_keys(qn_BHTN, qr_BHTR, c_BSC, kr_B1SR, expand)
        return _attend(q_BHTQ, k_BHSQ, v_BHSV, cp, scale)


register_variant("kv_gather", GatheredKV)
register_variant("latent_gather", GatheredLatent)


def chunk_attention(q_BHTE: torch.Tensor, k_BKSE: torch.Tensor, v_BKSE: torch.Tensor,
                    cp: CPContext, scale: float, window: int | None = None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """This rank's queries (its two chunks) against every key of the rows: chunk ``c`` sees
    keys ``[0, (c + 1) L)`` under the causal mask of global positions (less than ``window``
    back, when given), and its own document's only when the rows are packed."""
    from composer.blocks.attn_core import attend

    L = cp.L
    if use_flex(q_BHTE):  # CUDA: one call over both chunks, a block mask of global positions
        visible = chunk_visible(cp, window, k_BKSE.shape[2], q_BHTE.device)
        return flex_attend(q_BHTE, k_BKSE, v_BKSE, scale, visible, sinks)
    outs = []
    if cp.seg_BT is None and q_BHTE.device.type == "cpu" and window is None and sinks is None:
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
        if window is not None:  # key j is seen by query c L + i when c L + i - j < window
            mask &= ~torch.ones(L, end, dtype=torch.bool, device=q.device).tril_(c * L - window)
        if cp.seg_BT is not None:
            seg_q, seg_k = cp.seg_BT[:, c * L:end], cp.seg_BT[:, :end]
            mask = (mask & (seg_q[:, :, None] == seg_k[:, None, :]))[:, None]
        outs.append(attend(q, k_BKSE[:, :, :end], v_BKSE[:, :, :end], scale, mask=mask,
                           sinks=sinks))
    return torch.cat(outs, dim=2)


def chunk_visible(cp: CPContext, window: int | None, s: int, device: torch.device) -> Visible:
    """:func:`chunk_attention`'s masks as FlexAttention's rule: this rank's queries at their
    global positions (chunk ``c``, then ``2N - 1 - c``), the keys at theirs, within the window
    and the document."""
    q_pos = torch.cat([torch.arange(c * cp.L, (c + 1) * cp.L, device=device)
                       for c in cp.chunks])
    k_pos = torch.arange(s, device=device)
    if cp.seg_BT is None:
        return Visible(q_pos, k_pos, window=window)
    return Visible(q_pos, k_pos, cp.seg_BT[:, q_pos], cp.seg_BT[:, :s], window)


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
