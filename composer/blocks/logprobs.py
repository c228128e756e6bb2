"""Per-token log-probabilities and entropies of given targets, chunk by chunk from the head.

Preference optimisation and reinforcement learning score sequences token by token: for each
position ``n`` with a target ``t_n`` (``IGNORE_INDEX`` elsewhere),

    z[n] = scale * h[n] @ W^T                  (scale = 1 / (logits_scaling * temperature))
    logp[n] = z[n, t_n] - logsumexp_v z[n]     H[n] = logsumexp_v z[n] - sum_v p[n, v] z[n, v]

with ``p = softmax(z)``, in at least fp32. As with the chunked loss (:mod:`composer.blocks.loss`)
the ``N x V`` logits are never held whole: rows are taken ``chunk`` at a time. A backward needs
each chunk's softmax again, so the forward keeps only ``lse[n]`` and ``E_p[z][n]`` per row, and
the backward recomputes each chunk's logits (activation checkpointing by hand) and forms

    dlogp[n] / dz[n] = onehot(t_n) - p[n]      dH[n] / dz[n] = -p[n] * (z[n] - E_p[z][n])

scaled by the incoming per-token gradients, then pushes it through the head's two matmuls.

The vocabulary may be split across ranks (``composer/parallel/vocab.py``): ``start`` is the
first vocabulary row this ``W`` holds and ``reduce(t, op)`` sums (``"sum"``) or maximises
(``"max"``) a per-row tensor over the split, in place. Only the forward reduces (the row max,
then the sum of ``exp``, the target logit and ``sum exp * z`` in one call); the backward is
local, and its ``dL/dh`` is this rank's partial sum, which the caller's sequence gather sums
over the ranks in its backward (so the gradient equals one process's, not ``tp`` times it).

Legend: N tokens (rows), D model width, V vocabulary (this rank's rows when split).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from composer.blocks.loss import CHUNK_ELEMENTS, IGNORE_INDEX

Reduce = Callable[[torch.Tensor, str], None]
"""``reduce(t, "max" | "sum")``: in place over the ranks that split the vocabulary."""


@dataclass
class TokenLogprobs:
    """What :meth:`composer.blocks.model.HybridModel.token_logprobs` returns."""

    logp: torch.Tensor
    """``(B, T)`` in the math dtype (>= fp32): ``log softmax(z_t / temperature)[target_t]``;
    0 where the target is ``IGNORE_INDEX``."""
    entropy: torch.Tensor | None
    """``(B, T)`` entropy of ``softmax(z_t / temperature)`` (only with ``entropy=True``); 0 where
    the target is ignored."""
    aux_loss: torch.Tensor
    """The MoE load-balancing losses of this forward (0-dim), as in ``ModelOutput``."""


def _stats(z_nV: torch.Tensor, t_n: torch.Tensor, start: int, reduce: Reduce | None,
           want_entropy: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's ``lse``, target logit and ``E_p[z]`` over the whole (maybe split) vocabulary."""
    width = z_nV.shape[-1]
    top_n = z_nV.max(-1).values if width else z_nV.new_full(z_nV.shape[:-1], float("-inf"))
    if reduce is not None:
        reduce(top_n, "max")
    inside_n = (t_n >= start) & (t_n < start + width)  # IGNORE_INDEX < 0 <= start
    sums = z_nV.new_zeros(3 if want_entropy else 2, z_nV.shape[0])
    if width:
        shifted_nV = z_nV - top_n[:, None]
        e_nV = shifted_nV.exp()
        sums[0] = e_nV.sum(-1)
        idx_n = (t_n - start).clamp(0, width - 1)
        sums[1] = torch.where(inside_n, z_nV.gather(1, idx_n[:, None])[:, 0], 0.0)
        if want_entropy:  # relative to the max: no cancellation against a large logit
            sums[2] = (e_nV * shifted_nV).sum(-1)
    if reduce is not None:
        reduce(sums, "sum")
    lse_n = top_n + sums[0].log()
    mean_n = top_n + sums[2] / sums[0] if want_entropy else lse_n
    return lse_n, sums[1], mean_n


def _logits(h_nD: torch.Tensor, w_VD: torch.Tensor, scale: float, math: torch.dtype):
    z_nV = (h_nD @ w_VD.T).to(math)
    return z_nV.mul_(scale) if scale != 1.0 else z_nV


def _forward(h_ND, w_VD, target, scale, rows, start, reduce, want_entropy):
    """``(logp, entropy, lse, E_p[z])``, each shaped like ``target`` (``h_ND``: its rows
    flattened), one chunk of logits at a time. Written through flat views: the results are no
    views themselves (FSDP2 warns of a view among a forward's outputs)."""
    math = torch.promote_types(h_ND.dtype, torch.float32)
    n = h_ND.shape[0]
    out = [torch.zeros(target.shape, dtype=math, device=h_ND.device) for _ in range(4)]
    logp_N, ent_N, lse_N, mean_N = (t.view(-1) for t in out)
    target_N = target.reshape(-1)
    valid_N = target_N != IGNORE_INDEX
    for lo in range(0, n, rows):
        z_nV = _logits(h_ND[lo:lo + rows], w_VD, scale, math)
        lse_n, picked_n, mean_n = _stats(z_nV, target_N[lo:lo + rows], start, reduce,
                                         want_entropy)
        valid_n = valid_N[lo:lo + rows]
        logp_N[lo:lo + rows] = torch.where(valid_n, picked_n - lse_n, 0.0)
        if want_entropy:
            ent_N[lo:lo + rows] = torch.where(valid_n, lse_n - mean_n, 0.0)
        lse_N[lo:lo + rows], mean_N[lo:lo + rows] = lse_n, mean_n
    return tuple(out)


class _TokenLogprobs(torch.autograd.Function):
    """The chunked forward, and a backward that recomputes each chunk's logits (module
    docstring)."""

    @staticmethod
    def forward(ctx: Any, h_ND, w_VD, target, scale, rows, start, reduce, want_entropy):
        logp, ent, lse, mean = _forward(h_ND, w_VD, target, scale, rows, start, reduce,
                                        want_entropy)
        ctx.save_for_backward(h_ND, w_VD, target.reshape(-1), lse.view(-1), mean.view(-1))
        ctx.args = (scale, rows, start)
        ctx.set_materialize_grads(False)
        return logp, ent

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, g_logp: torch.Tensor | None, g_ent: torch.Tensor | None):
        h_ND, w_VD, target_N, lse_N, mean_N = ctx.saved_tensors
        scale, rows, start = ctx.args
        want_dh, want_dw = ctx.needs_input_grad[:2]
        math = lse_N.dtype
        valid_N = target_N != IGNORE_INDEX
        dh_ND = torch.zeros_like(h_ND) if want_dh else None
        dw_VD = torch.zeros(w_VD.shape, dtype=math, device=w_VD.device) if want_dw else None
        width = w_VD.shape[0]
        for lo in range(0, h_ND.shape[0] if width else 0, rows):
            sl = slice(lo, lo + rows)
            h_nD, t_n, valid_n = h_ND[sl], target_N[sl], valid_N[sl]
            z_nV = _logits(h_nD, w_VD, scale, math)
            p_nV = (z_nV - lse_N[sl, None]).exp()
            dz_nV = torch.zeros_like(z_nV)
            if g_logp is not None:
                gl_n = torch.where(valid_n, g_logp.reshape(-1)[sl].to(math), 0.0)
                dz_nV -= gl_n[:, None] * p_nV
                at = (valid_n & (t_n >= start) & (t_n < start + width)).nonzero()[:, 0]
                dz_nV[at, t_n[at] - start] += gl_n[at]
            if g_ent is not None:
                ge_n = torch.where(valid_n, g_ent.reshape(-1)[sl].to(math), 0.0)
                dz_nV -= ge_n[:, None] * p_nV * (z_nV - mean_N[sl, None])
            dz_nV = (dz_nV * scale).to(h_ND.dtype)
            if dh_ND is not None:
                dh_ND[sl] = dz_nV @ w_VD
            if dw_VD is not None:
                dw_VD += (dz_nV.T @ h_nD).to(math)
        dw = dw_VD.to(w_VD.dtype) if dw_VD is not None else None
        return dh_ND, dw, None, None, None, None, None, None


def linear_token_logprobs(h: torch.Tensor, w_VD: torch.Tensor, target: torch.Tensor,
                          scale: float = 1.0, entropy: bool = False, *,
                          chunk_rows: int | None = None, start: int = 0,
                          reduce: Reduce | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(logp, entropy | None)``, shaped like ``target`` (``h``: ``(*target.shape, D)``), of
    ``target`` under ``softmax(scale * h @ W^T)`` (module docstring), in at least fp32;
    ``chunk_rows`` defaults to ``max(64, CHUNK_ELEMENTS // V)``. ``start`` / ``reduce``: a
    vocabulary split over ranks."""
    h_ND = h.reshape(-1, h.shape[-1])
    rows = chunk_rows or max(64, CHUNK_ELEMENTS // max(w_VD.shape[0], 1))
    device = h_ND.device.type
    if torch.is_autocast_enabled(device):  # as linear_cross_entropy: the head in autocast's
        low = torch.get_autocast_dtype(device)  # dtype, by hand
        h_ND, w_VD = h_ND.to(low), w_VD.to(low)
    with torch.autocast(device, enabled=False):
        if torch.is_grad_enabled() and (h_ND.requires_grad or w_VD.requires_grad):
            logp, ent = _TokenLogprobs.apply(h_ND, w_VD, target, scale, rows, start, reduce,
                                             entropy)
        else:
            logp, ent = _forward(h_ND, w_VD, target, scale, rows, start, reduce, entropy)[:2]
    return logp, ent if entropy else None


def logits_scale(logits_scaling: float, temperature: float) -> float:
    """The factor on ``h @ W^T``: ``1 / (logits_scaling * temperature)``; temperature 0 (greedy
    decoding) scores under the logits' own distribution, as ``composer.generate`` reports it."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    return 1.0 / (logits_scaling * (temperature or 1.0))


def token_logprobs_ref(model: torch.nn.Module, input_ids: torch.Tensor, targets: torch.Tensor,
                       *, doc_ids: torch.Tensor | None = None, temperature: float = 1.0,
                       entropy: bool = False) -> TokenLogprobs:
    """Plain twin of ``HybridModel.token_logprobs``: the whole logits of ``model(input_ids)``,
    ``log_softmax`` in at least fp32 (fp64 for an fp64 model), autograd for the rest."""
    logits_BTV = model(input_ids, doc_ids=doc_ids)
    z_BTV = logits_BTV.to(torch.promote_types(logits_BTV.dtype, torch.float32))
    z_BTV = z_BTV * logits_scale(1.0, temperature)
    logp_BTV = F.log_softmax(z_BTV, -1)
    valid_BT = targets != IGNORE_INDEX
    picked_BT = logp_BTV.gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    ent = None
    if entropy:
        ent = torch.where(valid_BT, -(logp_BTV.exp() * logp_BTV).sum(-1), 0.0)
    return TokenLogprobs(torch.where(valid_BT, picked_BT, 0.0), ent,
                         model.aux_loss(logits_BTV))
