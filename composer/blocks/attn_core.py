"""The time mixing of attention (``*`` and ``W``): RoPE, then masked softmax attention, with or
without a decoding cache.

Masks. Causal: a query at ``t`` sees keys ``s <= t``. Packed documents (``doc_ids``): and only
its own document's. Sliding window (``window``, transformers' ``sliding_window``): and only
``t - s < window``, the query itself and the ``window - 1`` keys before it (Beltagy et al. 2020;
Mistral, Gemma 2/3, gpt-oss). All three combine.

Sinks (gpt-oss; Xiao et al. 2023's attention sinks, learned): one logit ``s_h`` per query head
joins each softmax denominator and is dropped from the output,
``o_t = sum_s exp(l_ts) v_s / (exp(s_h) + sum_s exp(l_ts))``, so a head may attend to nothing.
SDPA has no such term: with sinks the scores are computed explicitly (:func:`attend`).

Devices. On CUDA every masked call (documents, window, sinks, a decoding chunk of more than one
token) goes through FlexAttention's block masks (:mod:`composer.kernels.flex`, the sinks joined
through its log-sum-exp), never a ``[T, S]`` boolean tensor; plain causal attention stays SDPA's
``is_causal`` (flash). A single decoded token's ``[B, 1, 1, S]`` mask is linear in ``S`` and
stays dense. CPU keeps the dense masks below.

Decoding (:mod:`composer.blocks.cache`): a full layer keeps every slot; a windowed one keeps a
ring of ``min(window, max_len)`` slots (slot ``p`` of the sequence lives in ring slot
``p % R``), never more: a new query needs at most the ``window - 1`` keys before it.

Legend: B batch, H query heads, K kv heads, T new tokens (queries), S keys, E head width, R ring
slots.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from composer.blocks.cache import (
    KVState,
    Step,
    StepContext,
    attention_mask,
    attention_visible,
    needs_mask,
)
from composer.blocks.protocol import TimeMixingOp
from composer.blocks.rope import Rotary, apply_rope
from composer.kernels import sdpa_context
from composer.kernels.flex import Visible, flex_attend, use_flex
from composer.kernels.packing import doc_causal_mask


def attend(q_BHTE: torch.Tensor, k_BKSE: torch.Tensor, v_BKSE: torch.Tensor, scale: float, *,
           mask: torch.Tensor | None = None, is_causal: bool = False,
           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax attention of ``q`` over ``k``/``v`` (``mask`` bool ``[B or 1, 1, T, S]``, True:
    may attend; or ``is_causal``), each kv head shared by ``H / K`` query heads. SDPA without
    ``sinks``; with them (``[H]``) the explicit scores, in at least fp32, with the sink column."""
    if sinks is None:
        with sdpa_context(q_BHTE):  # flash first on CUDA; CPU untouched (kernels.sdpa)
            return F.scaled_dot_product_attention(
                q_BHTE, k_BKSE, v_BKSE, attn_mask=mask, is_causal=is_causal, scale=scale,
                enable_gqa=q_BHTE.shape[1] != k_BKSE.shape[1])
    rep = q_BHTE.shape[1] // k_BKSE.shape[1]
    if rep > 1:
        k_BKSE, v_BKSE = k_BKSE.repeat_interleave(rep, 1), v_BKSE.repeat_interleave(rep, 1)
    math_dtype = torch.promote_types(q_BHTE.dtype, torch.float32)
    scores = (q_BHTE.to(math_dtype) @ k_BKSE.to(math_dtype).transpose(-1, -2)) * scale
    t, s = scores.shape[-2:]
    if is_causal:
        mask = torch.ones(t, s, dtype=torch.bool, device=scores.device).tril_(s - t)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.to(math_dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat([scores, sink], -1), -1)[..., :-1]
    return (probs @ v_BKSE.to(math_dtype)).to(q_BHTE.dtype)


def flex_step(q_BHTE: torch.Tensor) -> bool:
    """A cached call's dispatch: FlexAttention on CUDA for more than one new token (a single
    token's mask ``[B, 1, 1, S]`` is linear in the keys and stays dense)."""
    return q_BHTE.shape[2] > 1 and use_flex(q_BHTE)


def window_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """``[T, S]`` bool: key position ``k_pos[s]`` is causal for ``q_pos[t]`` and, with a
    ``window``, less than ``window`` before it."""
    d = q_pos[:, None] - k_pos[None, :]
    ok = d >= 0
    return ok & (d < window) if window is not None else ok


class CausalAttention(TimeMixingOp):
    """The time mixing of :class:`~composer.blocks.attention.Attention`: RoPE, then causal
    attention (within each document by ``doc_ids``, within ``window``, with ``sinks``); with a
    decoding ``step`` the new keys and values go into its :class:`KVState` (a ring when
    windowed). Context parallelism replaces it by ``kv_gather``
    (:mod:`composer.parallel.context.attention`)."""

    context = "kv_gather"

    def __init__(self, window: int | None = None) -> None:
        super().__init__()
        self.window = window

    def forward(self, q_BHTE: torch.Tensor, k_BKTE: torch.Tensor, v_BKTE: torch.Tensor,
                rotary: Rotary | None, scale: float, *, doc_ids: torch.Tensor | None = None,
                step: Step | None = None, positions: torch.Tensor | None = None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        """``o [B, H, T, E]`` from q ``[B, H, T, E]``, k and v ``[B, K, T, E]`` before RoPE
        (``positions``: M-RoPE rows, :meth:`Rotary.for_call`)."""
        if rotary is not None:
            cos, sin = rotary.for_call(q_BHTE, doc_ids, step, positions)
            q_BHTE, k_BKTE = apply_rope(q_BHTE, cos, sin), apply_rope(k_BKTE, cos, sin)
        if step is not None and self.window is not None:
            return _ring_attention(q_BHTE, k_BKTE, v_BKTE, step.state, step.ctx, scale,
                                   self.window, sinks)
        if step is not None:
            return _cached_attention(q_BHTE, k_BKTE, v_BKTE, step.state, step.ctx, scale, sinks)
        t = q_BHTE.shape[2]
        window = self.window if self.window is not None and t > self.window else None
        if use_flex(q_BHTE) and (doc_ids is not None or window is not None or sinks is not None):
            visible = (Visible.packed(doc_ids, window) if doc_ids is not None
                       else Visible.causal(t, q_BHTE.device, window))
            return flex_attend(q_BHTE, k_BKTE, v_BKTE, scale, visible, sinks)
        mask = doc_causal_mask(doc_ids) if doc_ids is not None else None
        if window is not None:
            pos = torch.arange(t, device=q_BHTE.device)
            near = window_mask(pos, pos, window)
            mask = near if mask is None else mask & near
        return attend(q_BHTE, k_BKTE, v_BKTE, scale, mask=mask, is_causal=mask is None,
                      sinks=sinks)


def _cached_attention(q_BHTE: torch.Tensor, k_BKTE: torch.Tensor, v_BKTE: torch.Tensor,
                      state: KVState, ctx: StepContext, scale: float,
                      sinks: torch.Tensor | None) -> torch.Tensor:
    """The new keys and values (after RoPE) written into slots ``ctx.start : ctx.end``, the
    new queries attending to every real slot so far."""
    state.k_BKSE[:, :, ctx.start:ctx.end] = k_BKTE
    state.v_BKSE[:, :, ctx.start:ctx.end] = v_BKTE
    k_BKSE, v_BKSE = state.k_BKSE[:, :, :ctx.end], state.v_BKSE[:, :, :ctx.end]
    if flex_step(q_BHTE) and (needs_mask(ctx) or sinks is not None):
        return flex_attend(q_BHTE, k_BKSE, v_BKSE, scale, attention_visible(ctx), sinks)
    mask = attention_mask(ctx)
    return attend(q_BHTE, k_BKSE, v_BKSE, scale, mask=mask,
                  is_causal=mask is None and ctx.start == 0, sinks=sinks)


def _ring_attention(q_BHTE: torch.Tensor, k_BKTE: torch.Tensor, v_BKTE: torch.Tensor,
                    state: KVState, ctx: StepContext, scale: float, window: int,
                    sinks: torch.Tensor | None) -> torch.Tensor:
    """A windowed layer's cached step: the new queries attend to the ring (the slots before
    ``ctx.start`` it still holds) and the new keys, within the window and among slots of their
    own kind (real or padding, as :func:`~composer.blocks.cache.attention_mask`); then the last
    ``min(T, R)`` new keys and values overwrite their ring slots."""
    r, start, end = state.k_BKSE.shape[2], ctx.start, ctx.end
    device = q_BHTE.device
    ring = torch.arange(r, device=device)
    held_R = start - 1 - torch.remainder(start - 1 - ring, r)  # the slot each holds; < 0: none
    new_T = torch.arange(start, end, device=device)
    k_pos = torch.cat([held_R, new_T])
    real_BS = ctx.real_BS[:, k_pos.clamp(min=0)]
    k_BKSE, v_BKSE = torch.cat([state.k_BKSE, k_BKTE], 2), torch.cat([state.v_BKSE, v_BKTE], 2)
    if flex_step(q_BHTE):  # an empty ring slot gets a position after every query: unseen
        visible = Visible(new_T, torch.where(k_pos >= 0, k_pos, end), ctx.real_BS[:, start:end],
                          real_BS, window)
        o_BHTE = flex_attend(q_BHTE, k_BKSE, v_BKSE, scale, visible, sinks)
    else:
        mask_TS = window_mask(new_T, k_pos, window) & (k_pos >= 0)[None]
        same_BTS = ctx.real_BS[:, start:end, None] == real_BS[:, None, :]
        o_BHTE = attend(q_BHTE, k_BKSE, v_BKSE, scale, mask=(mask_TS[None] & same_BTS)[:, None],
                        sinks=sinks)
    n = min(end - start, r)
    slots = new_T[-n:] % r
    state.k_BKSE[:, :, slots] = k_BKTE[:, :, -n:]
    state.v_BKSE[:, :, slots] = v_BKTE[:, :, -n:]
    return o_BHTE
