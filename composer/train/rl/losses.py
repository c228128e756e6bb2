"""The GRPO-family policy-gradient math, pure torch (no model): advantages, DAPO's shaping and
filtering, the token weights of the loss aggregations, the clipped surrogate with a KL penalty.

For a prompt ``q`` with ``G`` sampled completions ``y_i`` of rewards ``r_i``, GRPO (DeepSeekMath,
arXiv 2402.03300, section 4.1) replaces PPO's critic by the group baseline,
``A_i = (r_i - mean(r)) / std(r)``, given to every token of ``y_i``, and maximises the clipped
surrogate of PPO per token::

    rho_t = pi(y_t | ...) / pi_old(y_t | ...) = exp(logp_t - logp_old_t)
    loss_t = -min(rho_t * A, clip(rho_t, 1 - eps_low, 1 + eps_high) * A) + beta * k3_t
    k3_t = exp(d_t) - d_t - 1,  d_t = logp_ref_t - logp_t

``k3`` is the unbiased, always non-negative estimator of KL(pi || pi_ref) from samples of pi
(J. Schulman, "Approximating KL Divergence", 2020, http://joschu.net/blog/kl-approx.html), the
one GRPO uses. DAPO (arXiv 2503.14476) decouples the clip range (``eps_high`` 0.28 > ``eps_low``
0.2, "clip-higher"), drops groups whose rewards are all equal (they carry no gradient,
:func:`zero_std_groups`), shapes rewards of over-long completions (:func:`overlong_penalty`) and
averages the loss over all tokens of the batch ("token-mean"). Dr. GRPO (arXiv 2503.20783) shows
that dividing by the group std and by each completion's length biases the optimisation, and
drops both: ``scale="none"`` and "seq-mean-token-sum-norm" (a constant denominator).
"""

from __future__ import annotations

from typing import Literal

import torch

Scale = Literal["group", "batch", "none"]
Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def _std(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """The sample standard deviation (Bessel-corrected, as ``torch.std`` in TRL's and verl's
    GRPO), 0 for a single value (its advantage is 0 anyway)."""
    n = x.numel() if dim is None else x.shape[dim]
    return x.std(dim=dim, correction=1 if n > 1 else 0, keepdim=dim is not None)


def group_advantages(rewards: torch.Tensor, scale: Scale = "group",
                     eps: float = 1e-4) -> torch.Tensor:
    """Advantages ``(P, G)`` of ``rewards`` ``(P, G)``: ``G`` completions of each of ``P``
    prompts. Each reward minus its group's mean, divided by ``std + eps`` where std is the
    group's (``"group"``, GRPO), that of all ``P * G`` rewards (``"batch"``: pass the whole
    batch), or not divided (``"none"``, Dr. GRPO). Computed in fp64, returned in the input's
    floating dtype. A group of equal rewards gets advantages 0 under every scale."""
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be (prompts, group), not {tuple(rewards.shape)}")
    r = rewards.to(torch.float64)
    centred = r - r.mean(dim=1, keepdim=True)
    if scale == "group":
        centred = centred / (_std(r, 1) + eps)
    elif scale == "batch":
        centred = centred / (_std(r) + eps)
    elif scale != "none":
        raise ValueError(f"scale must be group, batch or none, not {scale!r}")
    dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    return centred.to(dtype)


def zero_std_groups(rewards: torch.Tensor) -> torch.Tensor:
    """``(P,)`` bool: True where all ``G`` rewards of a group are equal (exactly: rewards are
    the env's numbers), the groups DAPO's dynamic sampling drops (``--filter-zero-std``): their
    advantages are 0, so they only dilute the batch."""
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be (prompts, group), not {tuple(rewards.shape)}")
    return (rewards == rewards[:, :1]).all(dim=1)


def overlong_penalty(lengths: torch.Tensor, max_new: int, buffer: int,
                     penalty: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment (arXiv 2503.14476, eq. 13), added to the reward: 0 for
    a completion of at most ``max_new - buffer`` tokens, then falling linearly to ``-penalty``
    at ``max_new`` tokens (and beyond): ``-penalty * (length - (max_new - buffer)) / buffer``.
    ``buffer`` 0 disables it (all zeros). ``lengths`` counts the generated tokens."""
    if not 0 <= buffer <= max_new:
        raise ValueError(f"overlong buffer must be in [0, max_new_tokens={max_new}], "
                         f"not {buffer}")
    if buffer == 0:
        return torch.zeros(lengths.shape, dtype=torch.float32, device=lengths.device)
    over = (lengths.to(torch.float64) - (max_new - buffer)).clamp(0, buffer)
    return (0.0 - penalty * over / buffer).to(torch.float32)  # 0.0 - x: no -0.0


def token_weights(mask: torch.Tensor, agg: Aggregation, n_tokens_global: float,
                  n_seqs_global: float, max_new_tokens: int,
                  dtype: torch.dtype | None = None) -> torch.Tensor:
    """``(N, T)`` weights so that ``sum(weights * loss_t)`` over this rank's ``N`` sequences,
    summed over ranks, is the aggregation ``agg`` of the per-token losses over the GLOBAL batch
    (``mask`` 1 on the completion tokens that count):

    - ``"token-mean"`` (DAPO): every token ``1 / n_tokens_global`` (the mean over all tokens);
    - ``"seq-mean-token-mean"`` (GRPO's paper): token of sequence ``i`` ``1 / (n_seqs_global *
      len_i)``, ``len_i`` its number of masked tokens (the mean over sequences of each one's
      mean; a sequence without tokens weighs nothing);
    - ``"seq-mean-token-sum-norm"`` (Dr. GRPO): every token ``1 / (n_seqs_global *
      max_new_tokens)`` (a constant: no length bias).

    A zero global count gives zero weights. ``dtype`` defaults to the mask's floating dtype, else
    fp32."""
    if dtype is None:
        dtype = mask.dtype if mask.is_floating_point() else torch.float32
    m = mask.to(dtype)
    if agg == "token-mean":
        return m / n_tokens_global if n_tokens_global > 0 else torch.zeros_like(m)
    if agg not in AGGREGATIONS:
        raise ValueError(f"loss aggregation must be one of {', '.join(AGGREGATIONS)}, "
                         f"not {agg!r}")
    if n_seqs_global <= 0:
        return torch.zeros_like(m)
    if agg == "seq-mean-token-mean":
        lengths = m.sum(dim=1, keepdim=True)
        return m / (n_seqs_global * lengths.clamp(min=1))
    return m / (n_seqs_global * max_new_tokens)


def policy_loss_terms(logp: torch.Tensor, logp_old: torch.Tensor, adv: torch.Tensor,
                      clip_low: float, clip_high: float, logp_ref: torch.Tensor | None = None,
                      kl_coef: float = 0.0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token losses ``(N, T)`` of the clipped surrogate plus the k3 KL penalty (module
    doc), for log-probs ``(N, T)`` of the sampled tokens under the policy (with grad), the
    policy that sampled them (``logp_old``) and the reference; ``adv`` ``(N,)`` per sequence.
    Weight them with :func:`token_weights` (masked positions must hold finite log-probs: 0).

    ``stats`` (detached): ``"ratio"`` ``rho``; ``"kl"`` the k3 values (zeros without
    ``logp_ref``); ``"clipped"`` True exactly where the clipped branch is the active one and
    differs from the unclipped: ``(A > 0 and rho > 1 + clip_high) or (A < 0 and rho < 1 -
    clip_low)``, with ``rho`` as computed here. There the token's surrogate gradient is zero; at
    the boundaries themselves, with ``A == 0``, and where ``A > 0, rho < 1 - clip_low`` or ``A <
    0, rho > 1 + clip_high`` (PPO's pessimistic side) the unclipped term is the minimum."""
    if kl_coef and logp_ref is None:
        raise ValueError("kl_coef > 0 needs the reference log-probs (logp_ref)")
    a = adv.to(logp.dtype).unsqueeze(-1)
    ratio = torch.exp(logp - logp_old)
    unclipped = ratio * a
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high) * a
    per_token = -torch.minimum(unclipped, clipped)
    kl = torch.zeros_like(logp.detach())
    if logp_ref is not None:
        d = logp_ref - logp
        k3 = torch.exp(d) - d - 1
        if kl_coef:
            per_token = per_token + kl_coef * k3
        kl = k3.detach()
    r = ratio.detach()
    active = ((a > 0) & (r > 1 + clip_high)) | ((a < 0) & (r < 1 - clip_low))
    return per_token, {"clipped": active, "kl": kl, "ratio": r}
