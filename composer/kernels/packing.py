"""Document isolation inside packed rows: what every layer kind derives from ``doc_ids``.

Megatron's ``reset_attention_mask`` + ``reset_position_ids``, extended to every layer kind: a
packed row holds several documents and a token sees only the earlier tokens of its own document.
``doc_ids`` is a ``(B, T)`` integer tensor, equal within a document and normally non-decreasing
along a row (``[0, 0, 0, 1, 1, 2, ...]``, or the data loader's global document numbers). Only
*changes* of id matter: a document is a run of equal ids, so ``[3, 3, 5, 5]`` and ``[0, 0, 1, 1]``
mean the same packing, and an id that came back (``[0, 1, 0]``) would start a third document
rather than rejoin the first (which keeps attention, the convolution and the scan consistent).

    starts[t]    = t > 0 and doc_ids[t] != doc_ids[t - 1]        a document begins at t
    segment[t]   = starts[0] + ... + starts[t]                   0, 1, 2, ... per row
    position[t]  = t - (first index of t's document)             RoPE positions restart at 0

These are cheap ``(B, T)`` ops with no host synchronisation. The ``(B, 1, T, T)`` attention mask
is the only quadratic one (one bool per query/key pair, as SDPA needs it on the torch path).

Legend: B batch, T time (query), S time (key).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def doc_starts(doc_ids_BT: torch.Tensor) -> torch.Tensor:
    """``(B, T)`` bool: True at the first token of every document but the row's first."""
    return F.pad(doc_ids_BT[:, 1:] != doc_ids_BT[:, :-1], (1, 0), value=False)


def doc_segments(doc_ids_BT: torch.Tensor) -> torch.Tensor:
    """``(B, T)`` int64: the document's index within its row (0 for the first document)."""
    return doc_starts(doc_ids_BT).cumsum(1)


def doc_positions(doc_ids_BT: torch.Tensor) -> torch.Tensor:
    """``(B, T)`` int64: each token's position within its document (0 at its first token)."""
    t = doc_ids_BT.shape[1]
    idx_T = torch.arange(t, device=doc_ids_BT.device)
    first_BT = torch.where(doc_starts(doc_ids_BT), idx_T, 0).cummax(1).values
    return idx_T - first_BT


def seq_idx(doc_ids_BT: torch.Tensor) -> torch.Tensor:
    """mamba_ssm's and causal_conv1d's ``seq_idx``: ``(B, T)`` int32, contiguous, 0 for each
    row's first document (mamba_ssm's state passing starts from sequence 0, so an initial state
    belongs to the first document, as in :func:`composer.kernels.ssd.ssd_scan`)."""
    return doc_segments(doc_ids_BT).to(torch.int32).contiguous()


def doc_causal_mask(doc_ids_BT: torch.Tensor) -> torch.Tensor:
    """``(B, 1, T, S)`` bool, True where query ``t`` may attend key ``s``: ``s <= t`` in the same
    document (block-diagonal causal; the diagonal is always allowed, so no row is empty)."""
    seg_BT = doc_segments(doc_ids_BT)
    t = seg_BT.shape[1]
    causal_TS = torch.ones(t, t, dtype=torch.bool, device=seg_BT.device).tril_()
    return ((seg_BT[:, :, None] == seg_BT[:, None, :]) & causal_TS)[:, None]
