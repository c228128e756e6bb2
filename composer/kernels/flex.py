"""Masked attention on CUDA without dense masks: FlexAttention (torch.nn.attention.flex_attention).

Every masked attention in composer is one rule over positions and segments: query ``t`` sees key
``s`` when

    0 <= q_pos[t] - k_pos[s]   (< window, when windowed)   and   q_seg[b, t] == k_seg[b, s]

(causal; sliding window; the same document, or the same kind of slot when decoding with
padding). :class:`Visible` holds those ``O(T + S)`` numbers and turns them into a ``mask_mod``;
``create_block_mask`` evaluates it per block (compiled on CUDA, so the ``T x S`` grid is never
materialised) and ``flex_attention`` skips the empty blocks. Attention sinks (gpt-oss, one
logit ``s_h`` per head joined to the softmax denominator) need no score change: from the
log-sum-exp ``lse`` of the attended keys,

    o_sink = o * exp(lse) / (exp(lse) + exp(s_h)) = o * sigmoid(lse - s_h)

exactly, gradients included (flex's ``lse`` is differentiable).

The dispatch (:func:`use_flex`) is the device rule, ``probe.on_gpu``: CUDA tensors take this
path, compiled once per process (``torch.compile(flex_attention)``); CPU tensors keep their
tested dense-mask paths. ``COMPOSER_DISABLE_KERNELS=flex`` sends CUDA back to the dense masks.
Forced onto CPU tensors (the parity tests) it runs flex's eager reference implementation.

Legend: B batch, H query heads, K kv heads, T queries, S keys, E head width (V: value width).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from composer.kernels import probe
from composer.kernels.packing import doc_segments


@dataclass(frozen=True)
class Visible:
    """Which keys each query sees (the module docstring): positions ``q_pos [T]`` and
    ``k_pos [S]`` (a key with ``k_pos > q_pos`` is unseen, so a slot that holds nothing can be
    given a large position), optional segments ``q_seg [B, T]`` / ``k_seg [B, S]`` that must
    match, and an optional sliding ``window``."""

    q_pos: torch.Tensor
    k_pos: torch.Tensor
    q_seg: torch.Tensor | None = None
    k_seg: torch.Tensor | None = None
    window: int | None = None

    @classmethod
    def causal(cls, t: int, device: torch.device, window: int | None = None) -> Visible:
        pos = torch.arange(t, device=device)
        return cls(pos, pos, window=window)

    @classmethod
    def packed(cls, doc_ids_BT: torch.Tensor, window: int | None = None) -> Visible:
        """Causal inside each packed document (:mod:`composer.kernels.packing`)."""
        seg_BT = doc_segments(doc_ids_BT)
        pos = torch.arange(seg_BT.shape[1], device=seg_BT.device)
        return cls(pos, pos, seg_BT, seg_BT, window)

    def mask_mod(self) -> Callable[..., torch.Tensor]:
        q_pos, k_pos, q_seg, k_seg, window = (self.q_pos, self.k_pos, self.q_seg, self.k_seg,
                                              self.window)

        def visible(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor,
                    kv: torch.Tensor) -> torch.Tensor:
            d = q_pos[q] - k_pos[kv]
            ok = d >= 0
            if window is not None:
                ok = ok & (d < window)
            if q_seg is not None:
                ok = ok & (q_seg[b, q] == k_seg[b, kv])
            return ok

        return visible


def use_flex(q: torch.Tensor) -> bool:
    """The dispatch of every masked attention: FlexAttention for CUDA tensors (unless
    ``COMPOSER_DISABLE_KERNELS`` names ``flex``), the dense-mask torch path otherwise."""
    return probe.on_gpu(q) and probe.available("flex")


@functools.cache
def _compiled() -> tuple[Callable[..., object], Callable[..., object]]:
    fa = probe.module("flex")
    return torch.compile(fa.flex_attention), torch.compile(fa.create_block_mask)


def _functions(q: torch.Tensor) -> tuple[Callable[..., object], Callable[..., object]]:
    """``(flex_attention, create_block_mask)``: compiled once for CUDA (fused kernels, no
    dense score or mask matrix); eager elsewhere (flex's reference implementation)."""
    if q.is_cuda:
        return _compiled()
    fa = probe.module("flex")
    return fa.flex_attention, fa.create_block_mask


def flex_attend(q_BHTE: torch.Tensor, k_BKSE: torch.Tensor, v_BKSV: torch.Tensor, scale: float,
                visible: Visible, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """``o [B, H, T, V]``: softmax attention of ``q`` over the keys ``visible`` allows, each kv
    head shared by ``H / K`` query heads (``enable_gqa``), with the per-head ``sinks [H]`` joined
    to every denominator when given (through the log-sum-exp, in fp32)."""
    flex, block_mask_of = _functions(q_BHTE)
    t, s = q_BHTE.shape[2], k_BKSE.shape[2]
    batch = None if visible.q_seg is None else visible.q_seg.shape[0]
    block_mask = block_mask_of(visible.mask_mod(), batch, None, t, s, device=q_BHTE.device)
    gqa = q_BHTE.shape[1] != k_BKSE.shape[1]
    if sinks is None:
        return flex(q_BHTE, k_BKSE, v_BKSV, block_mask=block_mask, scale=scale, enable_gqa=gqa)
    fa = probe.module("flex")
    o_BHTV, aux = flex(q_BHTE, k_BKSE, v_BKSV, block_mask=block_mask, scale=scale,
                       enable_gqa=gqa, return_aux=fa.AuxRequest(lse=True))
    keep_BHT = torch.sigmoid(aux.lse.float() - sinks.float().view(1, -1, 1))
    return (o_BHTV.float() * keep_BHT[..., None]).to(q_BHTE.dtype)
