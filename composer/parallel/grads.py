"""The global gradient norm and clipping, under any layout.

After :func:`composer.parallel.data.finish_grads` every rank holds complete gradients for its
pieces of the parameters: a DTensor's local shard, or a whole tensor. A piece that several
ranks hold (replicated over tp, over dp_outer for experts, over every rank for a plain tensor)
is counted once by weighting its squared sum by ``shards / world``, where ``shards`` is the
number of distinct pieces of that parameter (the product of the mesh sizes it is sharded
over); one all-reduce over the world then gives the single-process sum of squares.

A mesh dimension splits a parameter unless its placement is ``Replicate``: FSDP2 over a
``dp x tp`` DTensor places ``_StridedShard`` on dp, which is no ``Shard`` (``is_shard()`` is
False), so counting only ``Shard`` placements weighed such pieces by ``1 / dp`` too little.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor


def _pieces(p: torch.Tensor) -> int:
    """How many distinct pieces of ``p`` the ranks of its mesh hold (module docstring)."""
    if not isinstance(p, DTensor):
        return 1
    mesh = p.device_mesh
    if any(pl.is_partial() for pl in p.placements):
        raise ValueError("a parameter with a Partial placement has no norm of its own pieces")
    return math.prod(mesh.size(i) for i, pl in enumerate(p.placements)
                     if not pl.is_replicate())


def grad_norm(model: nn.Module, device: torch.device, pp: int = 1,
              copies: Mapping[str, int] | None = None) -> torch.Tensor:
    """The L2 norm of all gradients, as on one process (a 0-dim tensor on ``device``, fp32, or
    fp64 when a gradient is; no host synchronisation). Under pipeline parallelism (``pp > 1``)
    a rank holds its stages' parameters only, so each is held by ``world / pp`` ranks, and the
    ones in ``copies`` (name -> pipeline ranks holding one: the embedding on the first and the
    last stage, a shared layer on the stages that use it) by that many times more."""
    copies = copies or {}
    world = dist.get_world_size() if dist.is_initialized() else 1
    grads, weights = [], []
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        grads.append(g.to(torch.promote_types(g.dtype, torch.float32)))
        n_copies = copies.get(name, 1) if pp > 1 else 1
        weights.append(_pieces(p) * pp / (world * n_copies))
    fp64 = any(g.dtype == torch.float64 for g in grads)
    # every rank takes part in the all-reduce, also one that holds no gradient
    total = torch.zeros((), dtype=torch.float64, device=device)
    if grads:
        sq = torch.stack([n.double() for n in torch._foreach_norm(grads)]).square()
        total = (sq * torch.tensor(weights, dtype=torch.float64, device=sq.device)).sum()
    if world > 1:
        dist.all_reduce(total)
    return total.sqrt().to(torch.float64 if fp64 else torch.float32)


def clip_grads(model: nn.Module, norm: torch.Tensor, max_norm: float) -> None:
    """Scale every gradient by ``min(1, max_norm / (norm + 1e-6))`` (PyTorch's rule)."""
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    grads = [(p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad)
             for p in model.parameters() if p.grad is not None]
    if grads:
        torch._foreach_mul_(grads, coef.to(grads[0].device))
