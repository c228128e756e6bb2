"""Vocabulary-parallel embedding and readout (Megatron-LM): the embedding's rows and the LM
head's rows are split over ``tp`` (unevenly when the vocabulary does not divide it: DTensor's
chunking); the loss is computed from the local logits without gathering them, and the logits,
when asked for, are gathered with padding that exists only inside the gather. Swapped in for
the model's ``embed`` and ``readout`` by :func:`composer.parallel.tensor.apply_tp`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from composer.blocks.model import Readout, shift_labels
from composer.parallel.comm import all_gather

if TYPE_CHECKING:
    from composer.parallel.tensor import TPContext

IGNORE_INDEX = -100


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
    over the sequence under SP). The first op of the model: it decides SP for this forward."""

    tp: TPContext

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


class _VocabParallelCE(torch.autograd.Function):
    """Cross-entropy over logits split by vocabulary, never gathering them (Megatron-LM)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, start: int,
                group: dist.ProcessGroup) -> torch.Tensor:
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        top = logits.max(dim=-1).values if logits.shape[-1] else \
            logits.new_full(logits.shape[:-1], float("-inf"))
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        exp = (logits - top.unsqueeze(-1)).exp()
        total = exp.sum(-1)
        dist.all_reduce(total, group=group)
        inside = (target >= start) & (target < start + logits.shape[-1])
        idx = (target - start).clamp(0, max(logits.shape[-1] - 1, 0))
        picked = torch.zeros_like(total)
        if logits.shape[-1]:
            picked = (logits.gather(-1, idx.unsqueeze(-1)).squeeze(-1) - top) * inside
        dist.all_reduce(picked, group=group)
        ctx.save_for_backward(exp / total.unsqueeze(-1), inside, idx)
        return total.log() - picked

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        probs, inside, idx = ctx.saved_tensors
        grad = probs.clone()
        if grad.shape[-1]:
            grad.scatter_add_(-1, idx.unsqueeze(-1), -inside.to(grad.dtype).unsqueeze(-1))
        return grad * g.unsqueeze(-1), None, None, None


def cross_entropy(logits_local: torch.Tensor, target: torch.Tensor, vocab: int, tp: TPContext,
                  ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Mean next-token loss over the non-ignored targets, from vocab-split logits."""
    start = sum(vocab_sizes(vocab, tp.size)[: tp.rank])
    keep = target != ignore_index
    losses = _VocabParallelCE.apply(logits_local, torch.where(keep, target, 0), start, tp.group)
    return (losses * keep).sum() / keep.sum().clamp(min=1)


class VocabParallelReadout(Readout):
    """The readout with the head split by vocabulary: the loss from the local logits, the logits
    (when asked for) gathered across ranks."""

    tp: TPContext

    def forward(self, h_BTD, weight_VD, labels_BT=None, return_logits=False):
        tp = self.tp
        vocab = weight_VD.shape[0]
        h = tp.enter(h_BTD)
        w = weight_VD.to_local() if isinstance(weight_VD, DTensor) else weight_VD
        logits_local = F.linear(h, w)
        if self.logits_scaling != 1.0:
            logits_local = logits_local / self.logits_scaling
        logits = None
        if labels_BT is None or return_logits:
            logits = _GatherLast.apply(logits_local, tp, vocab_sizes(vocab, tp.size))
        if labels_BT is None:
            return None, logits
        loss = cross_entropy(logits_local.flatten(0, 1), shift_labels(labels_BT).flatten(),
                             vocab, tp)
        return loss, logits
