"""Adaptive context parallelism (``--cp-adaptive``): short documents whole on one rank, long
ones split; the layout, the padded piece rows, and the recurrences over them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from composer.blocks.loss import IGNORE_INDEX
from composer.kernels.flex import Visible, use_flex
from composer.parallel.context.layout import CPContext, gather_padded, safe_targets
from composer.parallel.mesh import LayoutError


@dataclass
class Piece:
    """A contiguous span ``[start, start + length)`` of row ``row``, inside one document (which
    starts at ``doc_start``), on rank ``rank`` at offset ``offset`` of its tokens; ``prev`` is
    the global index of the piece before it in its document (split documents), or None."""

    row: int
    start: int
    length: int
    doc_start: int
    rank: int = 0
    offset: int = 0
    prev: int | None = None


@dataclass
class Layout:
    """Adaptive cp's placement of one batch of packed rows (:func:`adaptive_layout`)."""

    pieces: list[Piece]
    """In global order: by row, then position."""
    size: int
    T: int

    def __post_init__(self) -> None:  # what every layer of the batch asks, counted once
        self._by_rank = [[i for i, p in enumerate(self.pieces) if p.rank == r]
                         for r in range(self.size)]
        self._tokens = [sum(self.pieces[i].length for i in mine) for mine in self._by_rank]
        self.max_tokens = max(self._tokens)
        self.max_pieces = max(len(mine) for mine in self._by_rank)
        self.slot = {g: r * self.max_pieces + j for r, mine in enumerate(self._by_rank)
                     for j, g in enumerate(mine)}
        """Global piece -> its row among every rank's pieces gathered (``max_pieces`` a rank)."""

    def of_rank(self, r: int) -> list[int]:
        return self._by_rank[r]

    def tokens(self, r: int) -> int:
        return self._tokens[r]


def adaptive_layout(doc_BT: Any, n: int, min_tokens: int, halo: int) -> Layout:
    """Documents of at least ``min_tokens`` tokens (and long enough that each of ``2n`` pieces
    covers a convolution ``halo``) are cut into ``2n`` pieces, piece ``j`` on rank ``j`` or
    ``2n - 1 - j`` (the causal balance); every shorter document goes whole to the rank with
    the fewest tokens so far (longest first; ties to the lower rank). Deterministic: every
    rank computes the same layout from the same doc ids."""
    import numpy as np

    doc = np.asarray(doc_BT)
    B, T = doc.shape
    spans = []
    for b in range(B):
        cuts = [0, *(np.nonzero(doc[b, 1:] != doc[b, :-1])[0] + 1).tolist(), T]
        spans += [(b, s, e) for s, e in zip(cuts[:-1], cuts[1:], strict=True)]
    load = [0] * n
    pieces: list[Piece] = []
    short = []
    for b, s, e in spans:
        length = e - s
        if length >= max(min_tokens, 2 * n * max(halo, 1)):
            base, extra = divmod(length, 2 * n)
            start = s
            for j in range(2 * n):
                k = base + (1 if j < extra else 0)
                rank = j if j < n else 2 * n - 1 - j
                pieces.append(Piece(b, start, k, s, rank))
                load[rank] += k
                start += k
        else:
            short.append((b, s, e))
    for b, s, e in sorted(short, key=lambda x: (-(x[2] - x[1]), x[0], x[1])):
        rank = min(range(n), key=lambda r: (load[r], r))
        pieces.append(Piece(b, s, e - s, s, rank))
        load[rank] += e - s
    pieces.sort(key=lambda p: (p.row, p.start))
    offsets = [0] * n
    last_of_doc: dict[tuple[int, int], int] = {}
    for i, p in enumerate(pieces):
        p.offset = offsets[p.rank]
        offsets[p.rank] += p.length
        p.prev = last_of_doc.get((p.row, p.doc_start))
        last_of_doc[(p.row, p.doc_start)] = i
    return Layout(pieces, n, T)


@dataclass
class PieceRows:
    """This rank's pieces as rows ``[P, Lmax]``: ``index`` (into the rank's tokens, ``-1`` on
    the padding after a piece), their global piece numbers and the validity mask."""

    index: torch.Tensor
    valid: torch.Tensor
    ids: list[int]


def _piece_rows(layout: Layout, rank: int, device: torch.device) -> PieceRows:
    mine = layout.of_rank(rank)
    L = max((layout.pieces[i].length for i in mine), default=1)
    index = torch.full((max(len(mine), 1), L), -1, dtype=torch.long)
    for row, i in enumerate(mine):
        p = layout.pieces[i]
        index[row, :p.length] = torch.arange(p.offset, p.offset + p.length)
    index = index.to(device)
    return PieceRows(index, index >= 0, mine)


def to_rows(x_BT_: torch.Tensor, rows: PieceRows, fill: float = 0.0) -> torch.Tensor:
    """``[1, T_r, ...]`` (a rank's tokens) -> ``[P, Lmax, ...]`` (its pieces, padded)."""
    flat = x_BT_[0]
    out = flat[rows.index.clamp(min=0)]
    mask = rows.valid.view(*rows.valid.shape, *([1] * (out.dim() - 2)))
    return torch.where(mask, out, torch.full_like(out, fill))


def from_rows(y_PL_: torch.Tensor, rows: PieceRows, n_tokens: int) -> torch.Tensor:
    """The inverse of :func:`to_rows`: ``[1, T_r, ...]``."""
    flat = y_PL_[rows.valid]  # row-major: pieces in offset order
    return flat[None, :n_tokens]


def _adaptive_meta(cp: CPContext, device: torch.device) -> None:
    """Per batch: the attention mask ``[1, 1, T_r, N * n_max]`` (same document, not later;
    on CUDA FlexAttention's :class:`~composer.kernels.flex.Visible` instead), the rank's piece
    rows, and the RoPE positions within documents."""
    layout, n_max = cp.layout, cp.layout.max_tokens
    doc = torch.full((cp.size, n_max), -1, dtype=torch.long)
    pos = torch.zeros((cp.size, n_max), dtype=torch.long)
    for p in layout.pieces:
        key = p.row * layout.T + p.doc_start
        doc[p.rank, p.offset:p.offset + p.length] = key
        pos[p.rank, p.offset:p.offset + p.length] = torch.arange(p.start, p.start + p.length)
    doc, pos = doc.to(device), pos.to(device)
    n = layout.tokens(cp.rank)
    q_doc, q_pos = doc[cp.rank, :n], pos[cp.rank, :n]
    k_doc, k_pos = doc.reshape(-1), pos.reshape(-1)
    if use_flex(q_pos):  # CUDA: FlexAttention's rule over the same numbers, O(T_r + N T_max)
        cp.extra["visible"] = Visible(q_pos, k_pos, q_doc[None], k_doc[None])
    else:
        cp.extra["mask"], cp.extra["dist"] = adaptive_dense_mask(q_doc, q_pos, k_doc, k_pos)
    cp.extra["rows"] = _piece_rows(layout, cp.rank, device)
    mine = [layout.pieces[i] for i in layout.of_rank(cp.rank)]
    starts = torch.repeat_interleave(torch.tensor([p.doc_start for p in mine]),
                                     torch.tensor([p.length for p in mine]))
    cp.pos_BT = (q_pos - starts.to(device))[None]


def adaptive_dense_mask(q_doc: torch.Tensor, q_pos: torch.Tensor, k_doc: torch.Tensor,
                        k_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch path's ``[1, 1, T_r, N * n_max]`` attention mask (same document, not later)
    and the query-key distances (for sliding windows)."""
    mask = (q_doc[:, None] == k_doc[None, :]) & (k_pos[None, :] <= q_pos[:, None])
    return mask[None, None], (q_pos[:, None] - k_pos[None, :])[None, None]


def adaptive_halo_conv(x_1TX: torch.Tensor, conv: nn.Module, cp: CPContext,
                       op: Callable[..., torch.Tensor] | None = None) -> torch.Tensor:
    """``op(x, conv)`` (default ``silu(conv(x))``) of this rank's pieces as padded rows
    ``[P, Lmax, X]``, each preceded by the ``K - 1`` inputs before it in its document (the
    previous piece's tail, gathered)."""
    from composer.kernels import conv_silu

    op = conv_silu if op is None else op
    rows, layout = cp.extra["rows"], cp.layout
    h = conv.kernel - 1
    x_PLX = to_rows(x_1TX, rows)
    if h == 0:
        return op(x_PLX, conv)
    lengths = torch.tensor([layout.pieces[i].length for i in rows.ids], device=x_PLX.device)
    tail_idx = (lengths[:, None] - h + torch.arange(h, device=x_PLX.device)).clamp(min=0)
    tails = torch.gather(x_PLX, 1, tail_idx[..., None].expand(-1, -1, x_PLX.shape[-1]))
    all_tails = gather_padded(tails, cp, 0, layout.max_pieces)  # [N * max_pieces, h, X]
    halo = torch.stack([all_tails[layout.slot[layout.pieces[g].prev]]
                        if layout.pieces[g].prev is not None else torch.zeros_like(tails[0])
                        for g in rows.ids])
    return op(torch.cat([halo, x_PLX], 1), conv)[:, h:]


def adaptive_pass_states(local_P_: torch.Tensor, trans_P_: torch.Tensor, cp: CPContext,
                         apply: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
                         ) -> torch.Tensor:
    """The state entering each of this rank's pieces: the previous piece's end state
    ``apply(trans, start) + local`` along each split document (0 for a document's first)."""
    layout, rows, p_max = cp.layout, cp.extra["rows"], cp.layout.max_pieces
    local = gather_padded(local_P_, cp, 0, p_max)
    trans = gather_padded(trans_P_, cp, 0, p_max)
    start: dict[int, torch.Tensor] = {}
    zero = torch.zeros_like(local[0])
    for g, p in enumerate(layout.pieces):  # global order: a piece's prev comes first
        if p.prev is None:
            start[g] = zero
        else:
            q = layout.slot[p.prev]
            start[g] = apply(trans[q], start[p.prev]) + local[q]
    return torch.stack([start[g] for g in rows.ids])


def _adaptive_cut(model: nn.Module, cp: CPContext, ids: torch.Tensor, labels: torch.Tensor,
                  kwargs: dict) -> tuple[tuple, dict]:
    """The adaptive layout of the rows (:func:`adaptive_layout`): this rank's tokens as one row
    of its pieces, their targets, and per-token document keys."""
    from composer.blocks.kind import halo
    from composer.blocks.model import mask_doc_boundaries, shift_labels

    doc = kwargs.get("doc_ids")
    if doc is None:
        raise LayoutError("--cp-adaptive places whole documents: it needs packed rows with "
                          "doc ids (--document-isolation)")
    if model.mtp is not None:
        raise LayoutError("--cp-adaptive with multi-token prediction is not built yet")
    moe = model.config.moe
    if moe is not None and moe.seq_aux_loss_coeff:
        raise LayoutError("--cp-adaptive with the sequence-wise balance loss "
                          "(moe.seq_aux_loss_coeff) is not built yet: its sequences are the rows")
    b, t = ids.shape
    targets = shift_labels(mask_doc_boundaries(labels, doc))
    layout = adaptive_layout(doc.cpu().numpy(), cp.size, cp.min_tokens or t // cp.size,
                             halo(model.config)[0])
    cp.layout, cp.T = layout, t
    mine = [layout.pieces[i] for i in layout.of_rank(cp.rank)]
    idx = torch.cat([torch.arange(p.row * t + p.start, p.row * t + p.start + p.length)
                     for p in mine]).to(ids.device)
    keys = torch.cat([torch.full((p.length,), p.row * t + p.doc_start) for p in mine])
    _adaptive_meta(cp, ids.device)
    local_targets = targets.reshape(-1)[idx][None]
    cp.n_rows = (targets != IGNORE_INDEX).sum()
    cp.n_local = (local_targets != IGNORE_INDEX).sum()
    kwargs = {**kwargs, "targets": safe_targets(local_targets),
              "doc_ids": keys.to(ids.device)[None]}
    return (ids.reshape(-1)[idx][None],), kwargs
