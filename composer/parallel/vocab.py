"""Vocabulary-parallel embedding and readout (Megatron-LM): the embedding's rows and the LM
head's rows are split over ``tp`` (unevenly when the vocabulary does not divide it: DTensor's
chunking); the loss is computed chunk by chunk from the local logits without gathering them
(never ``[tokens, V/tp]`` at once), and the logits, when asked for, are gathered with padding
that exists only inside the gather. Per-token log-probs (``token_logprobs``) reduce the row max,
the sum of ``exp`` and the target logit over the split in their forward only
(:mod:`composer.blocks.logprobs`). Set in place of the model's ``embed`` and ``readout`` by
:func:`composer.parallel.tensor.apply_tp`: each holds what it replaces (the embedding's very
Parameter, the readout's scaling) and the :class:`~composer.parallel.tensor.TPContext`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from composer.blocks.logprobs import linear_token_logprobs, logits_scale
from composer.blocks.loss import CHUNK_ELEMENTS, IGNORE_INDEX
from composer.blocks.model import Readout, shift_labels
from composer.parallel.comm import all_gather

if TYPE_CHECKING:
    from composer.parallel.tensor import TPContext


class _GatherLast(torch.autograd.Function):
    """All-gather an unevenly split last dimension (vocab); backward keeps the local part."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: TPContext, sizes: list[int]) -> torch.Tensor:
        ctx.tp, ctx.sizes = tp, sizes
        width = max(sizes)
        padded = F.pad(x, (0, width - x.shape[-1])).movedim(-1, 0)
        parts = all_gather(padded, 0, tp.group, tp.size).split(width, dim=0)
        return torch.cat([p[:n] for p, n in zip(parts, sizes, strict=True)], 0).movedim(0, -1)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        start = sum(ctx.sizes[: ctx.tp.rank])
        return g[..., start:start + ctx.sizes[ctx.tp.rank]].contiguous(), None, None


def vocab_sizes(vocab: int, size: int) -> list[int]:
    """Rows per rank of a ``Shard(0)`` split of ``vocab`` (DTensor's torch.chunk semantics)."""
    chunk = -(-vocab // size)
    return [max(0, min(chunk, vocab - r * chunk)) for r in range(size)]


class VocabParallelEmbedding(nn.Embedding):
    """Each rank looks up its rows of the vocabulary; the partial sums are reduced (scattered
    over the sequence under SP). The first op of the model: it decides SP for this forward.
    It reads its shard itself (no local-view hooks)."""

    def __init__(self, embed: nn.Embedding, tp: TPContext) -> None:
        nn.Module.__init__(self)  # not nn.Embedding's: it would allocate a new weight
        for attr in ("num_embeddings", "embedding_dim", "padding_idx", "max_norm", "norm_type",
                     "scale_grad_by_freq", "sparse"):
            setattr(self, attr, getattr(embed, attr))
        self.weight = embed.weight  # the same Parameter: keys and placements stay
        self.tp = tp
        self.train(embed.training)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        tp = self.tp
        tp.last_sp = tp.sp_active(ids.shape[1])
        w = self.weight.to_local()
        start = sum(vocab_sizes(self.weight.shape[0], tp.size)[: tp.rank])
        inside = (ids >= start) & (ids < start + w.shape[0])
        rows = (ids - start).clamp(0, max(w.shape[0] - 1, 0))
        out = F.embedding(rows, w) * inside.unsqueeze(-1).to(w.dtype) if w.shape[0] else \
            w.new_zeros((*ids.shape, w.shape[1]))
        return tp.leave(out)


def _chunk_stats(z_nV: torch.Tensor, t_n: torch.Tensor, valid_n: torch.Tensor, start: int,
                 group: dist.ProcessGroup) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Over the whole (split) vocabulary: each row's max, sum of ``exp(z - max)`` and target
    logit (two all-reduces: the max, then the sums and the target logits together)."""
    width = z_nV.shape[-1]
    top_n = z_nV.max(dim=-1).values if width else z_nV.new_full(z_nV.shape[:-1], float("-inf"))
    dist.all_reduce(top_n, op=dist.ReduceOp.MAX, group=group)
    inside_n = valid_n & (t_n >= start) & (t_n < start + width)
    idx_n = (t_n - start).clamp(0, max(width - 1, 0))
    sums = torch.zeros(2, z_nV.shape[0], dtype=z_nV.dtype, device=z_nV.device)
    if width:
        sums[0] = (z_nV - top_n[:, None]).exp().sum(-1)
        sums[1] = torch.where(inside_n, z_nV.gather(1, idx_n[:, None])[:, 0], 0.0)
    dist.all_reduce(sums, group=group)
    return top_n, sums, inside_n


def _vocab_chunks(h_ND, w_VD, target_N, start, group, scale, rows, want_dh, want_dw):
    """:func:`composer.blocks.loss` 's chunked loop over a vocabulary split across ranks: the
    loss and ``n_valid * dloss/dh`` (partial: summed over tp by the caller's reduction) and
    ``n_valid * dloss/dW`` of this rank's rows, one chunk of ``[rows, V/tp]`` logits at a time."""
    math = torch.promote_types(h_ND.dtype, torch.float32)
    valid_N = target_N != IGNORE_INDEX
    n_valid = valid_N.sum()
    dh_ND = torch.empty_like(h_ND) if want_dh else None
    dw_VD = torch.zeros(w_VD.shape, dtype=math, device=w_VD.device) if want_dw else None
    total = torch.zeros((), dtype=math, device=h_ND.device)
    for lo in range(0, h_ND.shape[0], rows):
        h_nD, t_n, valid_n = h_ND[lo:lo + rows], target_N[lo:lo + rows], valid_N[lo:lo + rows]
        z_nV = (h_nD @ w_VD.T).to(math)
        if scale != 1.0:
            z_nV.mul_(scale)
        top_n, sums, inside_n = _chunk_stats(z_nV, t_n, valid_n, start, group)
        lse_n = top_n + sums[0].log()
        total += torch.where(valid_n, lse_n - sums[1], 0.0).sum()
        if dh_ND is None and dw_VD is None:
            continue
        dz_nV = z_nV.sub_(lse_n[:, None]).exp_()  # softmax over the whole vocabulary
        at = inside_n.nonzero()[:, 0]
        dz_nV[at, (t_n[at] - start)] -= 1.0
        dz_nV[(~valid_n).nonzero()[:, 0]] = 0.0
        dz_nV = dz_nV.to(h_ND.dtype)
        if dh_ND is not None:
            torch.mm(dz_nV, w_VD, out=dh_ND[lo:lo + rows])
        if dw_VD is not None:
            dw_VD.add_((dz_nV.T @ h_nD).to(math))
    return total / n_valid, dh_ND, dw_VD, n_valid


class _VocabParallelLinearCE(torch.autograd.Function):
    """The LM head and the loss over a vocabulary split across tp (Megatron-LM's vocab-parallel
    cross-entropy), chunked as the single-device loss is: the gradient formed in the forward,
    no ``[tokens, V/tp]`` logits held whole."""

    @staticmethod
    def forward(ctx, h_ND, w_VD, target_N, start, group, scale, rows):
        loss, dh, dw, n_valid = _vocab_chunks(h_ND, w_VD, target_N, start, group, scale, rows,
                                              ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        ctx.save_for_backward(*(t for t in (dh, dw) if t is not None))
        ctx.has, ctx.factor, ctx.w_dtype = (dh is not None, dw is not None), (scale, n_valid), \
            w_VD.dtype
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        saved = list(ctx.saved_tensors)
        scale, n_valid = ctx.factor
        c = g * scale / n_valid
        dh = saved.pop(0).mul_(c) if ctx.has[0] else None
        dw = saved.pop(0).mul_(c).to(ctx.w_dtype) if ctx.has[1] else None
        return dh, dw, None, None, None, None, None


def linear_cross_entropy(h_ND: torch.Tensor, w_VD: torch.Tensor, target_N: torch.Tensor,
                         vocab: int, tp: TPContext, scale: float = 1.0,
                         chunk_rows: int | None = None) -> torch.Tensor:
    """Mean next-token loss from this rank's rows ``w_VD`` of the head (vocab-split)."""
    start = sum(vocab_sizes(vocab, tp.size)[: tp.rank])
    rows = chunk_rows or max(64, CHUNK_ELEMENTS // max(w_VD.shape[0], 1))
    device = h_ND.device.type
    if torch.is_autocast_enabled(device):  # see composer.blocks.loss.linear_cross_entropy
        low = torch.get_autocast_dtype(device)
        h_ND, w_VD = h_ND.to(low), w_VD.to(low)
    with torch.autocast(device, enabled=False):
        if torch.is_grad_enabled() and (h_ND.requires_grad or w_VD.requires_grad):
            return _VocabParallelLinearCE.apply(h_ND, w_VD, target_N, start, tp.group, scale,
                                                rows)
        return _vocab_chunks(h_ND, w_VD, target_N, start, tp.group, scale, rows, False,
                             False)[0]


class VocabParallelReadout(Readout):
    """The readout with the head split by vocabulary: the loss from the local logits, the logits
    (when asked for) gathered across ranks."""

    def __init__(self, readout: Readout, tp: TPContext) -> None:
        super().__init__(readout.logits_scaling)
        self.tp = tp
        self.train(readout.training)

    def forward(self, h_BTD, weight_VD, labels_BT=None, return_logits=False, *,
                targets_BT=None):
        tp = self.tp
        if targets_BT is None and labels_BT is not None:
            targets_BT = shift_labels(labels_BT)
        vocab = weight_VD.shape[0]
        h = tp.enter(h_BTD)
        w = weight_VD.to_local() if isinstance(weight_VD, DTensor) else weight_VD
        logits = None
        if targets_BT is None or return_logits:
            logits_local = F.linear(h, w)
            if self.logits_scaling != 1.0:
                logits_local = logits_local / self.logits_scaling
            logits = _GatherLast.apply(logits_local, tp, vocab_sizes(vocab, tp.size))
        if targets_BT is None:
            return None, logits
        loss = linear_cross_entropy(h.flatten(0, 1), w, targets_BT.flatten(),
                                    vocab, tp, scale=1.0 / self.logits_scaling)
        return loss, logits

    def token_logprobs(self, h_BTD, weight_VD, targets_BT, temperature=1.0, entropy=False):
        """``(logp, entropy | None)`` over the split vocabulary, replicated on every tp rank. The
        chunked forward all-reduces each chunk's row max, then its sums (``exp``, target logit,
        ``exp * z``); the backward is local (this rank's rows of ``dz``), and the gradient of the
        hidden states, a partial sum here, is summed over tp by ``tp.enter``'s backward: equal
        to one process's. A rank holding no rows of the vocabulary contributes nothing."""
        tp = self.tp
        group = tp.group

        def reduce(t: torch.Tensor, op: str) -> None:
            dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM,
                            group=group)

        h = tp.enter(h_BTD)
        w = weight_VD.to_local() if isinstance(weight_VD, DTensor) else weight_VD
        start = sum(vocab_sizes(weight_VD.shape[0], tp.size)[: tp.rank])
        return linear_token_logprobs(h, w, targets_BT,
                                     logits_scale(self.logits_scaling, temperature), entropy,
                                     start=start, reduce=reduce)
