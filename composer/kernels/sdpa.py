"""Which of torch's fused attention kernels ``F.scaled_dot_product_attention`` may use.

Attention always goes through SDPA; only the set of its backends changes:

- CPU tensors: untouched (``nullcontext``), so torch picks its CPU kernel as it always has.
- CUDA tensors: FlashAttention-2 first, then cuDNN, memory-efficient, math
  (``sdpa_kernel(..., set_priority=True)``). Flash needs fp16/bf16 and head width <= 256 and
  handles GQA (``enable_gqa``) without copying kv heads; for fp32, or shapes it rejects, SDPA
  falls through the list. Listing the order makes it independent of torch's default, which has
  changed between releases (cuDNN first in 2.5.0 on Hopper, reverted in 2.5.1).
- ``COMPOSER_DISABLE_KERNELS=flash`` (or ``all``): math only, the reference for parity checks.

Packed documents (:func:`doc_sdpa`): on CUDA FlexAttention's block mask of the documents
(:mod:`composer.kernels.flex`); elsewhere the same SDPA call with a block-diagonal causal boolean
mask.
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from composer.kernels import probe
from composer.kernels.flex import Visible, flex_attend, use_flex
from composer.kernels.packing import doc_causal_mask

GPU_ORDER = (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION,
             SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)


def sdpa_backends(q: torch.Tensor) -> tuple[SDPBackend, ...] | None:
    """The SDPA backends allowed for ``q``, in priority order; ``None`` leaves torch's default."""
    if not probe.on_gpu(q):
        return None
    if not probe.available("flash"):
        return (SDPBackend.MATH,)
    return GPU_ORDER


def sdpa_context(q: torch.Tensor) -> AbstractContextManager:
    """Context to run ``F.scaled_dot_product_attention`` in (see the module docstring)."""
    backends = sdpa_backends(q)
    if backends is None:
        return contextlib.nullcontext()
    try:
        return sdpa_kernel(list(backends), set_priority=True)
    except TypeError:  # torch < 2.6 has no set_priority; the list then only filters
        return sdpa_kernel(list(backends))


def doc_sdpa(q_BHTE: torch.Tensor, k_BKTE: torch.Tensor, v_BKTE: torch.Tensor,
             doc_ids_BT: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention inside each packed document (:mod:`composer.kernels.packing`),
    ``o_BHTE`` like the causal call. CUDA: FlexAttention over the documents' block mask
    (:func:`~composer.kernels.flex.use_flex`), no ``T x T`` tensor. Elsewhere SDPA with the
    ``(B, 1, T, T)`` block-diagonal causal boolean mask (the tested torch path)."""
    if use_flex(q_BHTE):
        return flex_attend(q_BHTE, k_BKTE, v_BKTE, scale, Visible.packed(doc_ids_BT))
    mask_B1TS = doc_causal_mask(doc_ids_BT)
    with sdpa_context(q_BHTE):
        return F.scaled_dot_product_attention(
            q_BHTE, k_BKTE, v_BKTE, attn_mask=mask_B1TS, scale=scale,
            enable_gqa=q_BHTE.shape[1] != k_BKTE.shape[1])
