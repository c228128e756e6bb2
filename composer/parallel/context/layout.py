"""Context parallelism's layout: which chunks a rank holds, the per-batch context the
cp forms read, the collectives with autograd that move chunks, and the row checks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from composer.blocks.loss import IGNORE_INDEX
from composer.parallel.comm import AllReduceForward, ScaleGrad, all_gather, reduce_scatter
from composer.parallel.mesh import LayoutError


def chunk_owner(c: int, n: int) -> tuple[int, int]:
    """``(rank, slot)`` holding global chunk ``c`` of ``2n``."""
    return (c, 0) if c < n else (2 * n - 1 - c, 1)


def rank_chunks(rank: int, n: int) -> tuple[int, int]:
    return rank, 2 * n - 1 - rank


def local_index(t: int, n: int, rank: int, device: torch.device | None = None) -> torch.Tensor:
    """The global positions of rank ``rank``'s tokens, in its order (chunk ``r``, then chunk
    ``2n - 1 - r``)."""
    chunk = t // (2 * n)
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk, device=device)
                      for c in rank_chunks(rank, n)])


@dataclass
class CPContext:
    """The cp group and the current batch's global view (set by the model's pre-hook)."""

    group: Any
    size: int
    rank: int
    T: int = 0
    """The whole rows' length."""
    pos_BT: torch.Tensor | None = None
    """RoPE positions of the local tokens: global, or within their document."""
    seg_BT: torch.Tensor | None = None
    """The whole rows' document segments (:func:`composer.kernels.packing.doc_segments`)."""
    doc_BT: torch.Tensor | None = None
    """The whole rows' doc ids (cut to ``T``), or None."""
    rows_doc: torch.Tensor | None = None
    rows_ids: torch.Tensor | None = None
    """The uncut rows (multi-token prediction's shifted inputs and targets)."""
    n_local: torch.Tensor | None = None
    n_rows: torch.Tensor | None = None
    extra: dict = field(default_factory=dict)
    adaptive: bool = False
    """``--cp-adaptive`` (:func:`adaptive_layout`): short documents whole on one rank."""
    min_tokens: int | None = None
    """Documents of at least this many tokens are split (default: ``T / size``)."""
    layout: Any = None
    """The current batch's adaptive :class:`Layout` (None: the 2N-chunk layout)."""

    @property
    def L(self) -> int:
        return self.T // (2 * self.size)

    def set_rows(self, t: int, pos_BT: torch.Tensor, doc_BT: torch.Tensor | None,
                 ids_BT: torch.Tensor | None = None) -> None:
        """The rows about to run: the length cut (``t``), the local tokens' RoPE positions, the
        whole rows' doc ids (or None) and, for multi-token prediction, ids (uncut: a row of
        ``t + 1`` keeps its last token, a target)."""
        from composer.kernels.packing import doc_segments

        self.T, self.pos_BT, self.rows_ids = t, pos_BT, ids_BT
        self.rows_doc = doc_BT
        self.doc_BT = None if doc_BT is None else doc_BT[:, :t]
        self.seg_BT = None if doc_BT is None else doc_segments(self.doc_BT)

    @property
    def chunks(self) -> tuple[int, int]:
        return rank_chunks(self.rank, self.size)


class _GatherChunks(torch.autograd.Function):
    """Every chunk of the rows along ``dim``, in global order, from each rank's two (side by
    side along ``dim``); the backward sums the gradients over the ranks and returns each its
    own chunks' (one reduce-scatter)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cp: CPContext, dim: int) -> torch.Tensor:
        ctx.cp, ctx.dim = cp, dim
        n = cp.size
        x0 = x.movedim(dim, 0)
        m = x0.shape[0] // 2
        out = all_gather(x0, 0, cp.group, n).view(2 * n, m, *x0.shape[1:])  # rank-major
        order = [2 * r + s for r, s in (chunk_owner(c, n) for c in range(2 * n))]
        return out[order].reshape(2 * n * m, *x0.shape[1:]).movedim(0, dim)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        cp, dim, n = ctx.cp, ctx.dim, ctx.cp.size
        g0 = g.movedim(dim, 0)
        m = g0.shape[0] // (2 * n)
        g0 = g0.reshape(2 * n, m, *g0.shape[1:])
        rank_major = [c for r in range(n) for c in rank_chunks(r, n)]
        stacked = g0[rank_major].reshape(2 * n * m, *g0.shape[2:])
        mine = reduce_scatter(stacked, 0, cp.group, n, cp.rank)
        return mine.movedim(0, dim), None, None


def gather_chunks(x: torch.Tensor, cp: CPContext, dim: int) -> torch.Tensor:
    return _GatherChunks.apply(x, cp, dim)


def _global_chunks(x: torch.Tensor, cp: CPContext) -> torch.Tensor:
    """``x`` ``[B, 2, ...]`` (this rank's two chunks' items) -> ``[B, 2N, ...]``."""
    return gather_chunks(x, cp, 1)


class _GatherPadded(torch.autograd.Function):
    """Every rank's ``x`` along ``dim`` padded to ``n_max`` and concatenated (rank-major); the
    backward sums the gradients over the ranks and returns this rank's unpadded part."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cp: CPContext, dim: int, n_max: int) -> torch.Tensor:
        ctx.cp, ctx.dim, ctx.n = cp, dim, x.shape[dim]
        x0 = x.movedim(dim, 0)
        pad = x0.new_zeros(n_max - x0.shape[0], *x0.shape[1:])
        out = all_gather(torch.cat([x0, pad]), 0, cp.group, cp.size)
        return out.movedim(0, dim)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        cp = ctx.cp
        mine = reduce_scatter(g.movedim(ctx.dim, 0).contiguous(), 0, cp.group, cp.size,
                              cp.rank)
        return mine[:ctx.n].movedim(0, ctx.dim), None, None, None


def gather_padded(x: torch.Tensor, cp: CPContext, dim: int, n_max: int) -> torch.Tensor:
    return _GatherPadded.apply(x, cp, dim, n_max)


def cp_length(cp: int, row_len: int) -> int:
    """The tokens of a row that context parallelism cuts: all of them, or all but the last when
    one is left over (the data path's ``seq_len + 1`` rows: the last token is only a target)."""
    return row_len - 1 if row_len % (2 * cp) == 1 else row_len


def check_cp_length(cfg: Any, cp: int, row_len: int) -> None:
    """The rows (or all but their last token) must cut into ``2 cp`` chunks, none shorter than
    a convolution's halo."""
    n = cp_length(cp, row_len)
    if n % (2 * cp):
        raise LayoutError(f"--cp {cp}: rows of {row_len} tokens do not cut into 2 x cp = "
                          f"{2 * cp} chunks (the sequence length must be a multiple of "
                          f"{2 * cp})")
    from composer.blocks.kind import halo

    chunk = n // (2 * cp)
    width, kind = halo(cfg)
    if chunk < width:
        raise LayoutError(f"--cp {cp}: chunks of {chunk} tokens are shorter than the {kind} "
                          f"convolution's halo of {width}")


def safe_targets(targets_BT: torch.Tensor) -> torch.Tensor:
    """``targets`` with position ``(0, 0)`` made a real target when there is none at all: a
    mean over no tokens is 0 / 0 (and so is its gradient); the caller multiplies the mean by
    the true count, 0, so the substitute never counts. No host synchronisation."""
    none = (targets_BT != IGNORE_INDEX).sum() == 0
    out = targets_BT.clone()
    out[0, 0] = torch.where(none, torch.zeros_like(out[0, 0]), out[0, 0])
    return out


def rows_mean(ce_local: torch.Tensor, n_local: torch.Tensor, n_rows: torch.Tensor,
              cp: CPContext) -> torch.Tensor:
    """The rows' mean from this rank's mean over its ``n_local`` tokens: the token sums added
    over the cp group in the forward, the gradient ``cp`` times this rank's (module
    docstring)."""
    token_sum = ce_local * n_local.to(ce_local.dtype)
    mean = AllReduceForward.apply(token_sum / n_rows.to(ce_local.dtype), cp.group)
    return ScaleGrad.apply(mean, float(cp.size))
