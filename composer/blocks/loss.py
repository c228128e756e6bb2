"""The LM head and next-token cross-entropy in one pass over chunks of tokens.

``loss = mean_n [logsumexp_v(z[n]) - z[n, t_n]]`` with ``z = scale * h @ W^T`` over the positions
``n`` whose target is not ``IGNORE_INDEX``. The logits of all tokens (``N x V``: 131 MB in fp32 for
1024 tokens of a 32k vocabulary) are never held at once: rows are taken ``chunk`` at a time, and
when a gradient is wanted, each chunk's gradient is formed right away from the closed form

    dloss/dz[n] = (softmax(z[n]) - onehot(t_n)) / n_valid,

then pushed through the head's two matmuls (``dh = dz @ W * scale``, ``dW += dz^T @ h * scale``)
before the next chunk overwrites the buffer. The backward only scales the stored gradients by the
incoming one. Compared with ``cross_entropy(linear(h, W))`` this skips the separate softmax
backward and the zero-filled ``N x V`` gradient, and the peak memory holds one chunk of logits
instead of the logits, their log-softmax and their gradient (the Liger-Kernel / Apple "cut
cross-entropy" idea, written here for plain torch). The price: with grad enabled, the head's
backward matmuls run inside the forward, even if ``backward`` is never called, and one
backward per loss (``retain_graph`` for a second one is refused with an error).

Legend: N tokens (rows), D model width, V vocabulary.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from composer.kernels.linear import mm_nn, mm_nt

IGNORE_INDEX = -100
CHUNK_ELEMENTS = 1 << 23
"""Logits per chunk (32 MiB in fp32): ``max(64, CHUNK_ELEMENTS // V)`` rows at a time."""


def _math_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _chunk_rows(vocab: int, chunk_rows: int | None) -> int:
    return chunk_rows or max(64, CHUNK_ELEMENTS // max(vocab, 1))


def _chunk_loss(z_nV: torch.Tensor, target_n: torch.Tensor,
                valid_n: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed loss of a chunk and its ``logsumexp`` (``z`` in the math dtype)."""
    lse_n = torch.logsumexp(z_nV, dim=-1)
    picked_n = z_nV.gather(1, target_n.clamp(min=0)[:, None])[:, 0]
    return torch.where(valid_n, lse_n - picked_n, 0.0).sum(), lse_n


def _add_product(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, first: bool) -> None:
    """``acc = a @ b`` (first chunk) or ``acc += a @ b``; a product in a lower precision than
    ``acc`` is rounded once and accumulated in ``acc``'s dtype."""
    if acc.dtype != a.dtype:
        prod = a @ b
        if first:
            acc.copy_(prod)
        else:
            acc.add_(prod)
    elif first:
        torch.mm(a, b, out=acc)
    else:
        acc.addmm_(a, b)


def _chunks(h_ND: torch.Tensor, w_VD: torch.Tensor, target_N: torch.Tensor, scale: float,
            rows: int, want_dh: bool, want_dw: bool):
    """The loss over all chunks, and (if wanted) ``n_valid * dloss/dh`` and ``.../dW``."""
    math = _math_dtype(h_ND.dtype)
    valid_N = target_N != IGNORE_INDEX
    n_valid = valid_N.sum()
    dh_ND = torch.empty_like(h_ND) if want_dh else None
    dw_VD = torch.empty(w_VD.shape, dtype=math, device=w_VD.device) if want_dw else None
    total = torch.zeros((), dtype=math, device=h_ND.device)
    for start in range(0, h_ND.shape[0], rows):
        h_nD = h_ND[start:start + rows]
        t_n, valid_n = target_N[start:start + rows], valid_N[start:start + rows]
        z_nV = mm_nt(h_nD, w_VD).to(math)
        if scale != 1.0:
            z_nV.mul_(scale)
        part, lse_n = _chunk_loss(z_nV, t_n, valid_n)
        total += part
        if dh_ND is None and dw_VD is None:
            continue
        # z becomes dloss/dz * n_valid: softmax - onehot on valid rows, 0 on ignored ones.
        dz_nV = z_nV.sub_(lse_n[:, None]).exp_()
        rows_n = valid_n.nonzero()[:, 0]
        dz_nV[rows_n, t_n[rows_n]] -= 1.0
        if len(rows_n) < len(t_n):
            dz_nV[(~valid_n).nonzero()[:, 0]] = 0.0  # row indices: no pass over the chunk
        dz_nV = dz_nV.to(h_ND.dtype)
        if dh_ND is not None:
            dh_ND[start:start + rows] = mm_nn(dz_nV, w_VD)
        if dw_VD is not None:
            _add_product(dw_VD, dz_nV.T, h_nD, first=start == 0)
    return total / n_valid, dh_ND, dw_VD, n_valid


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, h_ND: torch.Tensor, w_VD: torch.Tensor, target_N: torch.Tensor,
                scale: float, rows: int) -> torch.Tensor:
        loss, dh_ND, dw_VD, n_valid = _chunks(h_ND, w_VD, target_N, scale, rows,
                                              ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        ctx.save_for_backward(*(t for t in (dh_ND, dw_VD) if t is not None))
        ctx.has = (dh_ND is not None, dw_VD is not None)
        ctx.factor = (scale, n_valid)
        ctx.w_dtype = w_VD.dtype
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, g: torch.Tensor):
        if getattr(ctx, "consumed", False):  # the stored gradients were scaled in place
            raise RuntimeError("linear_cross_entropy: a second backward through the same loss "
                               "(retain_graph) is not supported; compute the loss again")
        ctx.consumed = True
        saved = list(ctx.saved_tensors)
        scale, n_valid = ctx.factor
        c = g * scale / n_valid  # a 0-dim tensor: multiplying keeps the stored dtypes
        dh = saved.pop(0).mul_(c) if ctx.has[0] else None
        dw = saved.pop(0).mul_(c).to(ctx.w_dtype) if ctx.has[1] else None
        return dh, dw, None, None, None


def linear_cross_entropy(h_ND: torch.Tensor, w_VD: torch.Tensor, target_N: torch.Tensor,
                         scale: float = 1.0, chunk_rows: int | None = None) -> torch.Tensor:
    """Mean cross-entropy of ``scale * h @ W^T`` against ``target`` (``IGNORE_INDEX`` skipped).

    Equal to :func:`linear_cross_entropy_ref` (NaN when every target is ignored, as
    ``F.cross_entropy``); logits and softmax in at least fp32. ``chunk_rows`` defaults to
    ``max(64, CHUNK_ELEMENTS // V)``.
    """
    rows = _chunk_rows(w_VD.shape[0], chunk_rows)
    device = h_ND.device.type
    if torch.is_autocast_enabled(device):
        # the head's matmuls in autocast's dtype, by hand: the backward is formed in the
        # forward, and autocast would cast some of its operands and not others
        low = torch.get_autocast_dtype(device)
        h_ND, w_VD = h_ND.to(low), w_VD.to(low)
    with torch.autocast(device, enabled=False):
        if torch.is_grad_enabled() and (h_ND.requires_grad or w_VD.requires_grad):
            return _LinearCrossEntropy.apply(h_ND, w_VD, target_N, scale, rows)
        return _chunks(h_ND, w_VD, target_N, scale, rows, False, False)[0]


def linear_cross_entropy_ref(h_ND: torch.Tensor, w_VD: torch.Tensor, target_N: torch.Tensor,
                             scale: float = 1.0) -> torch.Tensor:
    """Plain twin: the whole logits, then ``F.cross_entropy`` (autograd does the rest)."""
    z_NV = F.linear(h_ND, w_VD).to(_math_dtype(h_ND.dtype)) * scale
    return F.cross_entropy(z_NV, target_N, ignore_index=IGNORE_INDEX)
