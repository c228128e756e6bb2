"""Collectives with autograd, on the backend's native ops, and bucketed gradient reductions.

All-gather and reduce-scatter use ``all_gather_single`` / ``reduce_scatter_single`` (the
``*_into_tensor`` ops of older torch) into one contiguous buffer: NCCL's native collectives on
GPUs, and gloo has them too in torch >= 2.x. Only a backend that lacks them falls back to an
all-reduce (:func:`reduce_scatter`). :func:`all_reduce_coalesced` sums many tensors with one
collective per bucket instead of one per tensor. :func:`send_tensor` / :func:`recv_tensor`
move a tensor of a shape the receiver does not know (the pipeline's forward-only path).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

BUCKET_BYTES = 64 * 2**20
"""Gradient bytes per coalesced all-reduce."""

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather(x: torch.Tensor, dim: int, group: dist.ProcessGroup, size: int) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (one native all-gather)."""
    x = x.contiguous()
    out = torch.empty((size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather_single(out, x, group=group)
    if dim == 0:
        return out
    return torch.cat(out.chunk(size, dim=0), dim=dim)


def reduce_scatter(x: torch.Tensor, dim: int, group: dist.ProcessGroup, size: int,
                   rank: int) -> torch.Tensor:
    """Sum ``x`` over the ranks and keep this rank's chunk of ``dim`` (one native reduce-scatter
    on the chunks stacked along dim 0)."""
    chunks = x.chunk(size, dim=dim)
    stacked = torch.cat([c.contiguous() for c in chunks], dim=0) if dim != 0 else x.contiguous()
    out = torch.empty_like(chunks[rank], memory_format=torch.contiguous_format)
    if _native_reduce_scatter(group):
        try:
            _reduce_scatter_single(out, stacked, group=group)
            return out
        except NotImplementedError:
            _NO_REDUCE_SCATTER.add(dist.get_backend(group))
    dist.all_reduce(stacked, group=group)  # emulation, only where the backend lacks the op
    out.copy_(stacked.chunk(size, dim=0)[rank])
    return out


_NO_REDUCE_SCATTER: set[str] = set()


def _native_reduce_scatter(group: dist.ProcessGroup) -> bool:
    return dist.get_backend(group) not in _NO_REDUCE_SCATTER


class AllReduceSum(torch.autograd.Function):
    """Sum over a group; the backward sums the gradients too (every rank's loss uses the sum)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        y = x.clone()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class AllReduceForward(torch.autograd.Function):
    """Sum over ranks in the forward; the gradient passes through unchanged."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return g, None


class ScaleGrad(torch.autograd.Function):
    """The identity whose backward multiplies the gradient by ``scale``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return g * ctx.scale, None


def all_reduce_coalesced(tensors: list[torch.Tensor], group: dist.ProcessGroup,
                         scale: float = 1.0) -> None:
    """Sum ``tensors`` over ``group`` in place, packed into buckets of ``BUCKET_BYTES`` (one
    collective per bucket and dtype), then multiply by ``scale``."""
    by_dtype: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault((t.dtype, t.device), []).append(t)
    for (dtype, _), group_tensors in by_dtype.items():
        bucket: list[torch.Tensor] = []
        size = 0
        for t in group_tensors + [None]:  # type: ignore[list-item]
            if t is not None and (not bucket or size + t.numel() * dtype.itemsize
                                  <= BUCKET_BYTES):
                bucket.append(t)
                size += t.numel() * dtype.itemsize
                continue
            if bucket:
                flat = torch.cat([b.reshape(-1) for b in bucket])
                dist.all_reduce(flat, group=group)
                if scale != 1.0:
                    flat.mul_(scale)
                for b, part in zip(bucket, flat.split([b.numel() for b in bucket]), strict=True):
                    b.copy_(part.view_as(b))
            bucket, size = ([t], t.numel() * dtype.itemsize) if t is not None else ([], 0)


P2P_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def send_tensor(x: torch.Tensor, dst: int, group: dist.ProcessGroup) -> None:
    """Send ``x`` with its shape and dtype (three point-to-point messages: the header's length,
    the header, the data) to global rank ``dst``; :func:`recv_tensor` receives it."""
    meta = torch.tensor([x.dim(), *x.shape, P2P_DTYPES.index(x.dtype)], dtype=torch.long,
                        device=x.device)
    dist.send(torch.tensor([meta.numel()], dtype=torch.long, device=x.device), dst, group=group)
    dist.send(meta, dst, group=group)
    dist.send(x.contiguous(), dst, group=group)


def recv_tensor(src: int, group: dist.ProcessGroup, device: torch.device) -> torch.Tensor:
    """The tensor :func:`send_tensor` sent from global rank ``src``."""
    n = torch.zeros(1, dtype=torch.long, device=device)
    dist.recv(n, src, group=group)
    meta = torch.zeros(int(n), dtype=torch.long, device=device)
    dist.recv(meta, src, group=group)
    ndim = int(meta[0])
    shape, dtype = meta[1:1 + ndim].tolist(), P2P_DTYPES[int(meta[1 + ndim])]
    x = torch.empty(shape, dtype=dtype, device=device)
    dist.recv(x, src, group=group)
    return x
