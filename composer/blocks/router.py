"""The MoE router: which experts each token goes to, with what weight; capacity dropping; the
aux-loss-free balancing bias. Used by :mod:`composer.blocks.moe`.

Routing (Shazeer et al. 2017; Mixtral; DeepSeek-V3 §2.1.2 for sigmoid + bias + groups):

    logits = x W_r^T (+ b_r with router_bias),   s = softmax(logits)  or  sigmoid(logits)
    choose = s + b                                   (b: score_bias, for choosing only)
    if G > 1: group score = sum of the top-2 ``choose`` in each group; keep the best
              ``topk_groups`` groups, the others are masked to -inf before the top-k
    idx = topk(choose, k),   w = s[idx]   (the scores *without* the bias)
    if renormalize: w = w / (sum(w) + 1e-20);   w = w * routed_scaling_factor

gpt-oss (``score_func="topk_softmax"``): ``idx = topk(logits, k)``, ``w = softmax(logits[idx])``
over the chosen k alone (equal to the softmax renormalised over the chosen, computed as gpt-oss
does); ``s = softmax(logits)`` still feeds the load-balancing losses.

Capacity (``moe.capacity_factor = c``; GShard, Switch): each expert takes at most
``C = ceil(c * N * K / E)`` of a forward's ``N`` tokens, those with the highest routing weight
``w`` (ties: the lower token index); a dropped assignment contributes nothing, so a token whose
every choice is dropped leaves the layer as zero (plus the shared experts) and the residual
carries it. Dropping is decided on each rank's own tokens, before any dispatch.

Aux-loss-free balancing (DeepSeek-V3 §2.1.2; ``moe.bias_update_rate = gamma``): training
forwards count the assignments per expert (``Router.load_E``, fp32, recomputations inside the
backward excluded); after each optimizer step the loads of the global batch (summed over the
data-parallel ranks by the caller) move the bias, ``b_e += gamma * sign(mean_e' load_e' -
load_e)`` (:meth:`Router.update_bias`). The bias changes the choice only, never the weights.

Shape legend: N tokens, D d_model, E experts, K top_k, G expert groups, A = N*K assignments.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from composer.blocks.moe import MoEConfig



def router_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32, or fp64 for fp64 inputs (so that the fp64 twins check the exact math)."""
    return torch.promote_types(dtype, torch.float32)


class Router(nn.Module):
    """``router.weight [E, D]`` (fp32); ``router.bias [E]`` (fp32) with ``router_bias``; and, if
    ``score_correction_bias``, ``router.score_bias``."""

    def __init__(self, d_model: int, moe: MoEConfig) -> None:
        super().__init__()
        self.moe = moe
        self.weight = nn.Parameter(torch.empty(moe.n_experts, d_model, dtype=torch.float32))
        if moe.router_bias:
            self.bias = nn.Parameter(torch.empty(moe.n_experts, dtype=torch.float32))
        else:
            self.bias: nn.Parameter | None = None
        if moe.score_correction_bias:
            # A buffer: it is steered by load statistics (aux-loss-free balancing), not by gradient.
            self.register_buffer("score_bias", torch.zeros(moe.n_experts, dtype=torch.float32))
        else:
            self.score_bias: torch.Tensor | None = None
        self.load_E: torch.Tensor | None = None
        """Assignments per expert counted by training forwards since the last bias update
        (fp32; an attribute, not state: it lives for one optimizer step)."""

    step_stats = ("load_E",)
    """Attributes that accumulate over an optimizer step's forwards (a forward that must not
    count, such as a pipeline's shape inference, is undone by restoring them)."""

    @property
    def balancing(self) -> bool:
        """Whether aux-loss-free balancing moves ``score_bias`` (``moe.bias_update_rate > 0``)."""
        return self.score_bias is not None and self.moe.bias_update_rate > 0

    def count_load(self, n_chosen_E: torch.Tensor) -> None:
        """Add a forward's assignments per expert to ``load_E``: training forwards only, and not
        the recomputation of activation checkpointing inside the backward."""
        if not (self.balancing and self.training and torch.is_grad_enabled()):
            return
        if torch._C._current_graph_task_id() != -1:  # running inside a backward pass
            return
        load_E = n_chosen_E.detach().to(torch.float32)
        self.load_E = load_E if self.load_E is None else self.load_E + load_E

    def take_load(self) -> torch.Tensor:
        """The counted loads (zeros when nothing was counted), and reset them."""
        load_E, self.load_E = self.load_E, None
        if load_E is None:
            return torch.zeros(self.moe.n_experts, device=self.weight.device)
        return load_E

    @torch.no_grad()
    def update_bias(self, load_E: torch.Tensor) -> None:
        """``b_e += rate * sign(mean(load) - load_e)``, in fp32 (``load_E``: the global batch's
        assignments per expert)."""
        load_E = load_E.to(torch.float32)
        step_E = self.moe.bias_update_rate * torch.sign(load_E.mean() - load_E)
        self.score_bias.copy_((self.score_bias.float() + step_E).to(self.score_bias.dtype))

    def forward(self, x_ND: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Return routing weights ``w_NK``, expert ids ``idx_NK`` and scores ``s_NE``."""
        moe = self.moe
        dtype = router_dtype(x_ND.dtype)
        bias = None if self.bias is None else self.bias.to(dtype)
        with torch.autocast(x_ND.device.type, enabled=False):  # fp32 even under bf16 autocast
            logits_NE = F.linear(x_ND.to(dtype), self.weight.to(dtype), bias)
        if moe.score_func == "topk_softmax":
            top_NK, idx_NK = torch.topk(logits_NE, moe.top_k, dim=-1)
            w_NK = torch.softmax(top_NK, dim=-1)
            return w_NK * moe.routed_scaling_factor, idx_NK, torch.softmax(logits_NE, dim=-1)
        if moe.score_func == "softmax":
            s_NE = torch.softmax(logits_NE, dim=-1)
        else:
            s_NE = torch.sigmoid(logits_NE)
        choose_NE = s_NE if self.score_bias is None else s_NE + self.score_bias.to(dtype)
        if moe.n_expert_groups > 1:
            choose_NE = self._mask_groups(choose_NE)
        idx_NK = torch.topk(choose_NE, moe.top_k, dim=-1).indices
        w_NK = s_NE.gather(1, idx_NK)
        if moe.renormalize:
            w_NK = w_NK / (w_NK.sum(dim=-1, keepdim=True) + 1e-20)
        return w_NK * moe.routed_scaling_factor, idx_NK, s_NE

    def _mask_groups(self, choose_NE: torch.Tensor) -> torch.Tensor:
        n, n_groups = choose_NE.shape[0], self.moe.n_expert_groups
        choose_NGe = choose_NE.view(n, n_groups, -1)
        # transformers takes top-2 per group and so fails on groups of one expert; we take top-1.
        top = min(2, choose_NGe.shape[-1])
        group_score_NG = choose_NGe.topk(top, dim=-1).values.sum(dim=-1)
        keep_NG = torch.zeros_like(group_score_NG, dtype=torch.bool)
        keep_NG.scatter_(1, group_score_NG.topk(self.moe.topk_groups, dim=-1).indices, True)
        return choose_NGe.masked_fill(~keep_NG[..., None], float("-inf")).view(n, -1)


def count_assignments(expert_A: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Assignments per expert ``[E]`` (ids ``>= E`` are dropped ones, not counted); a scatter,
    since ``torch.bincount`` synchronises with the host on CUDA."""
    counts = expert_A.new_zeros(n_experts + 1)
    counts.scatter_add_(0, expert_A.clamp(max=n_experts), torch.ones_like(expert_A))
    return counts[:n_experts]


def capacity(moe: MoEConfig, n_tokens: int) -> int:
    """Assignments an expert takes from a forward of ``n_tokens`` tokens:
    ``ceil(capacity_factor * n_tokens * top_k / n_experts)`` (Megatron's ``get_capacity``)."""
    assert moe.capacity_factor is not None
    return math.ceil(moe.capacity_factor * n_tokens * moe.top_k / moe.n_experts)


def within_capacity(idx_NK: torch.Tensor, w_NK: torch.Tensor, n_experts: int,
                    cap: int) -> torch.Tensor:
    """``keep_A`` (the flattened ``(n, k)`` assignments): each expert keeps its ``cap``
    assignments of highest weight ``w``, ties to the earlier token; no host synchronisation."""
    expert_A, w_A = idx_NK.flatten(), w_NK.flatten()
    by_weight_A = torch.argsort(-w_A.detach(), stable=True)
    # grouped by expert, each expert's assignments by falling weight
    order_A = by_weight_A[torch.argsort(expert_A[by_weight_A], stable=True)]
    n_E = count_assignments(expert_A, n_experts)
    start_E = torch.cumsum(n_E, 0) - n_E
    rank_A = torch.arange(expert_A.numel(), device=expert_A.device) - start_E[expert_A[order_A]]
    return torch.empty_like(expert_A, dtype=torch.bool).scatter_(0, order_A, rank_A < cap)


# ---------------------------------------------------------------- plain-math twins


def router_ref(x_ND: torch.Tensor, weight: torch.Tensor, moe: MoEConfig,
               score_bias: torch.Tensor | None = None,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """Dense routing weights ``w_NE`` (zero for unchosen experts), chosen by sorting."""
    dtype = router_dtype(x_ND.dtype)
    logits_NE = x_ND.to(dtype) @ weight.to(dtype).T
    if bias is not None:
        logits_NE = logits_NE + bias.to(dtype)
    if moe.score_func == "topk_softmax":
        rank_NE = logits_NE.argsort(dim=-1, descending=True).argsort(dim=-1)
        chosen_NE = rank_NE < moe.top_k
        z_NE = torch.where(chosen_NE, torch.exp(logits_NE - logits_NE.max(-1, keepdim=True).values),
                           torch.zeros_like(logits_NE))
        return z_NE / z_NE.sum(dim=-1, keepdim=True) * moe.routed_scaling_factor
    if moe.score_func == "softmax":
        z_NE = torch.exp(logits_NE - logits_NE.max(dim=-1, keepdim=True).values)
        s_NE = z_NE / z_NE.sum(dim=-1, keepdim=True)
    else:
        s_NE = 1 / (1 + torch.exp(-logits_NE))
    choose_NE = s_NE if score_bias is None else s_NE + score_bias.to(dtype)
    n, n_groups = choose_NE.shape[0], moe.n_expert_groups
    if n_groups > 1:
        sorted_NGe = choose_NE.view(n, n_groups, -1).sort(dim=-1, descending=True).values
        group_score_NG = sorted_NGe[..., :2].sum(dim=-1)
        rank_NG = group_score_NG.argsort(dim=-1, descending=True).argsort(dim=-1)
        dropped_NE = (rank_NG >= moe.topk_groups).repeat_interleave(moe.n_experts // n_groups, 1)
        choose_NE = torch.where(dropped_NE, float("-inf"), choose_NE)
    rank_NE = choose_NE.argsort(dim=-1, descending=True).argsort(dim=-1)
    w_NE = torch.where(rank_NE < moe.top_k, s_NE, torch.zeros_like(s_NE))
    if moe.renormalize:
        w_NE = w_NE / (w_NE.sum(dim=-1, keepdim=True) + 1e-20)
    return w_NE * moe.routed_scaling_factor


def drop_ref(w_NE: torch.Tensor, cap: int) -> torch.Tensor:
    """Dense routing weights after capacity dropping: per expert, the ``cap`` chosen tokens of
    highest weight stay (ties: the lower token index), the others' weights become zero."""
    out_NE = torch.zeros_like(w_NE)
    for e in range(w_NE.shape[1]):
        column = w_NE[:, e].detach().tolist()
        chosen = [n for n, w in enumerate(column) if w > 0]
        for n in sorted(chosen, key=lambda n: (-column[n], n))[:cap]:
            out_NE[n, e] = w_NE[n, e]
    return out_NE
