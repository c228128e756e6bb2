"""The context-parallel variants of the recurrent ops (the package docstring): the convolution
with its halo (:class:`HaloConv`, for every ``"halo_conv"`` op) and chunk state passing
(:class:`StatePassing`, for every :class:`~composer.blocks.ops.LinearRecurrence`), each in the
2N-chunk layout and in the adaptive one (``cp.layout``, :mod:`.adaptive`).

2N-chunk layout: a rank's tokens ``[B, 2L, ...]`` are its two chunks side by side; the op runs
on them as ``2B`` rows of ``L``. Adaptive: a rank's tokens ``[1, T_r, ...]`` are its pieces end
to end; the op runs on them as padded rows ``[P, Lmax, ...]`` (:func:`.adaptive.to_rows`), the
padding made identity steps (``mask_steps``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from composer.parallel.context.adaptive import (
    adaptive_halo_conv,
    adaptive_pass_states,
    from_rows,
    to_rows,
)
from composer.parallel.context.layout import CPContext, _global_chunks
from composer.parallel.context.variants import register_variant

if TYPE_CHECKING:
    from composer.blocks.cache import Step
    from composer.blocks.ops import LinearRecurrence


def halo_conv(x_BTX: torch.Tensor, conv: nn.Module, cp: CPContext,
              op: Callable[..., torch.Tensor] | None = None) -> torch.Tensor:
    """``op(x, conv)`` (default ``silu(conv(x))``) of this rank's two chunks as ``[2B, L, X]``
    rows (slot-major within each batch row), each preceded by the ``K - 1`` inputs before it in
    the whole row."""
    from composer.kernels import conv_silu

    op = conv_silu if op is None else op
    b, _, X = x_BTX.shape
    L = cp.L
    h = conv.kernel - 1
    x_B2LX = x_BTX.view(b, 2, L, X)
    if h == 0:
        rows = x_B2LX.reshape(2 * b, L, X)
        return op(rows, conv, doc_ids=_chunk_docs(cp, b, 0))
    tails = _global_chunks(x_B2LX[:, :, L - h:].contiguous(), cp)  # [B, 2N, h, X]
    halo = torch.stack([tails[:, c - 1] if c > 0 else torch.zeros_like(tails[:, 0])
                        for c in cp.chunks], 1)
    rows = torch.cat([halo, x_B2LX], dim=2).reshape(2 * b, h + L, X)
    return op(rows, conv, doc_ids=_chunk_docs(cp, b, h))[:, h:]


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
                apply: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
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


def _no_step(step: Step | None) -> None:
    if step is not None:
        raise ValueError("context parallelism does not decode: build the model without --cp "
                         "to generate")


class HaloConv(nn.Module):
    """A ``"halo_conv"`` op (:class:`~composer.blocks.ops.CausalConv`) on this rank's tokens:
    each chunk (or adaptive piece) convolved after the ``K - 1`` inputs before it in its row
    (or document), gathered from the rank that holds them. ``[B, T_local, X]`` in and out."""

    def __init__(self, op: nn.Module, cp: CPContext) -> None:
        super().__init__()
        self.op = op
        self.cp = cp

    def forward(self, x_BTX: torch.Tensor, conv: nn.Module, *,
                doc_ids: torch.Tensor | None = None, step: Step | None = None) -> torch.Tensor:
        """``doc_ids`` (this rank's tokens') are not read: the chunks' come from the whole
        rows (``cp.doc_BT``), an adaptive piece is inside one document."""
        _no_step(step)
        cp = self.cp
        if cp.layout is not None:
            rows = cp.extra["rows"]
            y_PLX = adaptive_halo_conv(x_BTX, conv, cp, self.op)
            return from_rows(y_PLX, rows, x_BTX.shape[1])
        b, T, X = x_BTX.shape
        return halo_conv(x_BTX, conv, cp, self.op).reshape(b, T, X)


class StatePassing(nn.Module):
    """A :class:`~composer.blocks.ops.LinearRecurrence` on this rank's tokens, exact: each
    chunk's (or piece's) ``(S_local, M)`` from ``op.end_state``, gathered; the recurrence
    ``S_start[c] = carry(M[c-1], S_start[c-1]) + S_local[c-1]`` over the row's chunks (or a
    document's pieces) on every rank; the op run again on this rank's from their true starts.
    Takes the op's arguments; returns its ``[B, T_local, ...]``."""

    def __init__(self, op: LinearRecurrence, cp: CPContext) -> None:
        super().__init__()
        self.op = op
        self.cp = cp

    def forward(self, *tokens: torch.Tensor, doc_ids: torch.Tensor | None = None,
                initial_state: torch.Tensor | None = None, step: Step | None = None,
                **consts: Any) -> torch.Tensor:
        _no_step(step)
        if initial_state is not None:
            raise ValueError("under context parallelism a row starts from zero")
        if self.cp.layout is not None:
            return self._pieces(tokens, consts)
        return self._chunks(tokens, consts)

    def _chunks(self, tokens: tuple[torch.Tensor, ...], consts: dict) -> torch.Tensor:
        """The 2N-chunk layout: ``[B, 2L, ...]`` run as ``[2B, L, ...]``."""
        cp, op = self.cp, self.op
        b, T = tokens[0].shape[:2]
        assert T == 2 * cp.L, (T, cp.L)
        rows = [t.reshape(2 * b, cp.L, *t.shape[2:]) for t in tokens]
        docs = _chunk_docs(cp, b, 0)
        local, trans = op.end_state(*rows, doc_ids=docs, **consts)
        start = pass_states(local.reshape(b, 2, *local.shape[1:]),
                            trans.reshape(b, 2, *trans.shape[1:]), cp, op.carry)
        y = op(*rows, doc_ids=docs, initial_state=start.reshape(2 * b, *start.shape[2:]),
               **consts)
        return y.reshape(b, T, *y.shape[2:])

    def _pieces(self, tokens: tuple[torch.Tensor, ...], consts: dict) -> torch.Tensor:
        """The adaptive layout: ``[1, T_r, ...]`` run as padded piece rows ``[P, Lmax, ...]``
        (each inside one document: no doc ids)."""
        cp, op = self.cp, self.op
        rows = cp.extra["rows"]
        pieces = op.mask_steps([to_rows(t, rows) for t in tokens], rows.valid)
        local, trans = op.end_state(*pieces, **consts)
        start = adaptive_pass_states(local, trans, cp, op.carry)
        return from_rows(op(*pieces, initial_state=start, **consts), rows, tokens[0].shape[1])


register_variant("halo_conv", HaloConv)
register_variant("state_passing", StatePassing)
