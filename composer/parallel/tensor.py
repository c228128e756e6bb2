"""Tensor and sequence parallelism (Megatron-LM, Shoeybi et al. 2019; Korthikanti et al. 2022).

Weights are DTensors on the ``tp`` mesh dimension so that FSDP2 composes with them and DCP sees
layout-independent global shapes; the math runs on their local shards with explicit collectives:

    residual stream   [B, T/tp, D] per rank (sequence parallel) or [B, T, D] replicated
    enter a mixer     all-gather over T (SP)        | identity, all-reduce of the grad (no SP)
    column parallel   local output features (heads, channels, experts' hidden units)
    row parallel      local input features -> partial sums
    leave a mixer     reduce-scatter over T (SP)    | all-reduce (no SP)

Each block's plan lives in :func:`apply_tp` next to the mapping from block to plan. Replicated
weights whose per-rank gradients are partial sums (norms under SP, qk-norms, the router,
replicated kv projections, row-parallel biases added on rank 0) are marked and summed over ``tp``
by :func:`reduce_tp_grads` before the optimizer step. The vocabulary is split unevenly when it
does not divide ``tp`` (DTensor's chunking); padding exists only inside the logits gather.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from composer.blocks.split import local

PARTIAL = "partial"  # grads are partial sums on every forward
PARTIAL_IF_SP = "partial_if_sp"  # partial under sequence parallel, identical otherwise


@dataclass
class TPContext:
    mesh: DeviceMesh
    group: dist.ProcessGroup
    size: int
    rank: int
    sequence_parallel: bool
    last_sp: bool = False
    """Whether the latest forward ran sequence parallel (it needs T divisible by tp)."""
    experts_on_ep: bool = False
    """Expert parallelism will shard routed experts on the 2-D ep x tp mesh; leave them."""

    def sp_active(self, t: int) -> bool:
        return self.sequence_parallel and t % self.size == 0

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        return _Enter.apply(x, self, self.last_sp)

    def leave(self, y: torch.Tensor) -> torch.Tensor:
        return _Leave.apply(y, self, self.last_sp)


# ---------------------------------------------------------------- collectives with autograd


def _all_gather(x: torch.Tensor, dim: int, group: dist.ProcessGroup, size: int) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _reduce_scatter(x: torch.Tensor, dim: int, group: dist.ProcessGroup, size: int,
                    rank: int) -> torch.Tensor:
    x = x.contiguous()
    dist.all_reduce(x, group=group)  # gloo has no reduce-scatter; NCCL users could swap it in
    return x.chunk(size, dim=dim)[rank].contiguous()


class _Enter(torch.autograd.Function):
    """Into a mixer: all-gather the sequence (SP) or pass through (no SP); backward reduces."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: TPContext, sp: bool) -> torch.Tensor:
        ctx.tp, ctx.sp = tp, sp
        return _all_gather(x, 1, tp.group, tp.size) if sp else x

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        tp = ctx.tp
        if ctx.sp:
            return _reduce_scatter(g, 1, tp.group, tp.size, tp.rank), None, None
        g = g.contiguous()
        dist.all_reduce(g, group=tp.group)
        return g, None, None


class _Leave(torch.autograd.Function):
    """Out of a mixer: reduce-scatter the partial sums over the sequence (SP) or all-reduce."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, tp: TPContext, sp: bool) -> torch.Tensor:
        ctx.tp, ctx.sp = tp, sp
        if sp:
            return _reduce_scatter(y, 1, tp.group, tp.size, tp.rank)
        y = y.contiguous().clone()
        dist.all_reduce(y, group=tp.group)
        return y

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        tp = ctx.tp
        return (_all_gather(g, 1, tp.group, tp.size) if ctx.sp else g), None, None


class _AllReduce(torch.autograd.Function):
    """Sum over ranks in the forward; the gradient passes through unchanged."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return g, None


class _Scatter(torch.autograd.Function):
    """Keep this rank's chunk of dim 1; the backward all-gathers."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: TPContext) -> torch.Tensor:
        ctx.tp = tp
        return x.chunk(tp.size, dim=1)[tp.rank].contiguous()

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return _all_gather(g, 1, ctx.tp.group, ctx.tp.size), None


class _GatherLast(torch.autograd.Function):
    """All-gather an unevenly split last dimension (vocab); backward keeps the local part."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: TPContext, sizes: list[int]) -> torch.Tensor:
        ctx.tp, ctx.sizes = tp, sizes
        width = max(sizes)
        padded = F.pad(x, (0, width - x.shape[-1]))
        parts = _all_gather(padded, -1, tp.group, tp.size).split(width, dim=-1)
        return torch.cat([p[..., :n] for p, n in zip(parts, sizes, strict=True)], dim=-1)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        start = sum(ctx.sizes[: ctx.tp.rank])
        return g[..., start:start + ctx.sizes[ctx.tp.rank]].contiguous(), None, None


def enter(x: torch.Tensor, tp: TPContext, sp: bool) -> torch.Tensor:
    return _Enter.apply(x, tp, sp)


def leave(y: torch.Tensor, tp: TPContext, sp: bool) -> torch.Tensor:
    return _Leave.apply(y, tp, sp)


def all_reduce(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return _AllReduce.apply(x, group)


def scatter_seq(x: torch.Tensor, tp: TPContext) -> torch.Tensor:
    return _Scatter.apply(x, tp)


def gather_seq(x: torch.Tensor, tp: TPContext) -> torch.Tensor:
    """All-gather the sequence; the backward reduce-scatters (the consumers' grads are partial)."""
    return _Enter.apply(x, tp, True)


def gather_vocab(x: torch.Tensor, tp: TPContext, sizes: list[int]) -> torch.Tensor:
    return _GatherLast.apply(x, tp, sizes)


# ---------------------------------------------------------------- parallel linear layers


def distribute_param(module: nn.Module, name: str, mesh: DeviceMesh, placement,
                     grad: str | None = None) -> None:
    """Replace ``module.<name>`` by a DTensor parameter with ``placement`` on ``mesh``."""
    p = getattr(module, name)
    if p is None or hasattr(p, "to_local"):
        return
    new = nn.Parameter(distribute_tensor(p.data, mesh, [placement]), requires_grad=p.requires_grad)
    if grad is not None:
        new._tp_grad = grad  # type: ignore[attr-defined]
    module.register_parameter(name, new)


class ColumnParallelLinear(nn.Linear):
    """Output features split over ``tp``: weight ``Shard(0)``, bias ``Shard(0)``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, local(self.weight), local(self.bias) if self.bias is not None else None)


class RowParallelLinear(nn.Linear):
    """Input features split over ``tp``: weight ``Shard(1)``; the output is a partial sum, so the
    bias (replicated) is added on tp rank 0 only and reaches every rank through the reduction."""

    tp_rank: int = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = local(self.bias) if self.bias is not None and self.tp_rank == 0 else None
        y = F.linear(x, local(self.weight))
        if self.bias is not None:
            y = y + (bias if bias is not None else 0.0 * local(self.bias))
        return y


def to_column(linear: nn.Linear, tp: TPContext) -> None:
    linear.__class__ = ColumnParallelLinear
    distribute_param(linear, "weight", tp.mesh, Shard(0))
    distribute_param(linear, "bias", tp.mesh, Shard(0))


def to_row(linear: nn.Linear, tp: TPContext) -> None:
    linear.__class__ = RowParallelLinear
    linear.tp_rank = tp.rank
    distribute_param(linear, "weight", tp.mesh, Shard(1))
    distribute_param(linear, "bias", tp.mesh, Replicate(), grad=PARTIAL)


def to_replicated(module: nn.Module, names: tuple[str, ...], tp: TPContext, grad: str) -> None:
    for name in names:
        distribute_param(module, name, tp.mesh, Replicate(), grad=grad)


def to_replicated_linear(linear: nn.Linear, tp: TPContext, grad: str) -> None:
    """A linear every rank computes whole (e.g. kv projections when kv heads < tp)."""
    linear.__class__ = ColumnParallelLinear
    to_replicated(linear, ("weight", "bias"), tp, grad)


# ---------------------------------------------------------------- vocabulary parallel


def vocab_sizes(vocab: int, size: int) -> list[int]:
    """Rows per rank of a ``Shard(0)`` split of ``vocab`` (DTensor's torch.chunk semantics)."""
    chunk = -(-vocab // size)
    return [max(0, min(chunk, vocab - r * chunk)) for r in range(size)]


def embed(ids: torch.Tensor, weight: torch.Tensor, tp: TPContext, sp: bool) -> torch.Tensor:
    """Vocab-parallel lookup: each rank looks up its rows, the partial sums are reduced."""
    w = local(weight)
    start = sum(vocab_sizes(weight.shape[0], tp.size)[: tp.rank])
    inside = (ids >= start) & (ids < start + w.shape[0])
    rows = (ids - start).clamp(0, max(w.shape[0] - 1, 0))
    out = F.embedding(rows, w) * inside.unsqueeze(-1).to(w.dtype) if w.shape[0] else \
        w.new_zeros((*ids.shape, w.shape[1]))
    return leave(out, tp, sp)


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
                  ignore_index: int = -100) -> torch.Tensor:
    """Mean next-token loss over the non-ignored targets, from vocab-split logits."""
    start = sum(vocab_sizes(vocab, tp.size)[: tp.rank])
    keep = target != ignore_index
    losses = _VocabParallelCE.apply(logits_local, torch.where(keep, target, 0), start, tp.group)
    return (losses * keep).sum() / keep.sum().clamp(min=1)


# ---------------------------------------------------------------- gradients


def reduce_tp_grads(model: nn.Module) -> None:
    """Sum over ``tp`` the gradients of replicated weights whose per-rank grads are partial
    (call after backward, before the optimizer step)."""
    tp: TPContext | None = getattr(model, "tp", None)
    if tp is None or tp.size == 1:
        return
    kinds: dict[str, str] = getattr(model, "tp_grad_kinds", {})
    for name, p in model.named_parameters():
        kind = kinds.get(name)
        if p.grad is None or kind is None or (kind == PARTIAL_IF_SP and not tp.last_sp):
            continue
        dist.all_reduce(local(p.grad), group=tp.group)


# ---------------------------------------------------------------- the model under TP


def tp_forward(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor | None):
    """HybridModel.forward with vocab-parallel embedding, head and loss (see the module doc)."""
    from composer.blocks.model import IGNORE_INDEX, ModelOutput, shift_labels

    cfg, tp = model.config, model.tp
    tp.last_sp = tp.sp_active(ids.shape[1])
    x = embed(ids, model.embed.weight, tp, tp.last_sp)
    if cfg.embedding_multiplier != 1.0:
        x = x * cfg.embedding_multiplier
    for layer in model.layers.values():
        x = layer(x)
    h = tp.enter(model.final_norm(x))
    logits_local = F.linear(h, local(model.output_weight()))
    if cfg.logits_scaling != 1.0:
        logits_local = logits_local / cfg.logits_scaling
    if labels is None:
        return gather_vocab(logits_local, tp, vocab_sizes(cfg.vocab_size, tp.size))
    loss = cross_entropy(logits_local.flatten(0, 1), shift_labels(labels).flatten(),
                         cfg.vocab_size, tp, IGNORE_INDEX)
    aux = model.aux_loss(loss)
    return ModelOutput(loss=loss + aux, logits=None, aux_loss=aux)


def apply_tp(model: nn.Module, tp: TPContext) -> None:
    """Shard every block over ``tp`` (each block's ``apply_tp``), the norms replicated, the
    embedding and head split by vocabulary; record which gradients need a ``tp`` sum."""
    for layer in model.layers.values():
        to_replicated(layer.norm, ("weight",), tp, PARTIAL_IF_SP)
        if not hasattr(layer.mixer, "apply_tp"):
            from composer.parallel.mesh import LayoutError

            raise LayoutError(f"{type(layer.mixer).__name__} (symbol {layer.symbol!r}) has no "
                              "tensor-parallel plan (apply_tp); use --tp 1")
        layer.mixer.apply_tp(tp)
        layer.tp = tp
    to_replicated(model.final_norm, ("weight",), tp, PARTIAL_IF_SP)
    distribute_param(model.embed, "weight", tp.mesh, Shard(0))
    if not model.config.tie_embeddings:
        distribute_param(model.lm_head, "weight", tp.mesh, Shard(0))
    model.tp = tp
    model.tp_grad_kinds = {name: p._tp_grad for name, p in model.named_parameters()
                           if getattr(p, "_tp_grad", None)}
