"""Mixture of experts: top-k routed experts plus optional shared experts.

Routing (Shazeer et al. 2017; Mixtral; DeepSeek-V3 §2.1.2 for sigmoid + bias + groups):

    logits = x W_r^T,   s = softmax(logits)  or  sigmoid(logits)
    choose = s + b                                   (b: score_bias, for choosing only)
    if G > 1: group score = sum of the top-2 ``choose`` in each group; keep the best
              ``topk_groups`` groups, the others are masked to -inf before the top-k
    idx = topk(choose, k),   w = s[idx]   (the scores *without* the bias)
    if renormalize: w = w / (sum(w) + 1e-20);   w = w * routed_scaling_factor
    y = sum_k w_k * expert_{idx_k}(x) + shared(x)

An expert is the MLP of ``mlp.py``: gated ``down(act(gate x) * up x)`` or plain ``down(act(up x))``.
Router math runs in fp32 (fp64 when the input is fp64, so the fp64 reference can check the exact
math); expert matmuls run in the input dtype; their outputs are scaled by the routing weights and
summed in the router dtype, then cast back to the input dtype (as NemotronHExperts does).

Load-balancing loss (Switch Transformer, Fedus et al. 2021, eq. 4), normalised exactly as
transformers' ``load_balancing_loss_func`` for one layer:

    aux = n_experts * sum_e f_e * P_e,   f_e = count_e / N,   P_e = mean_n p_ne

``count_e`` counts the (token, k) assignments to expert e, so ``sum_e f_e = top_k`` and a
perfectly balanced router gives ``aux = top_k`` (Megatron also divides by ``top_k``, giving 1).
``p`` is the softmax probability, or for a sigmoid router the scores normalised to sum to 1 per
token. ``f`` counts the experts actually chosen (after bias and group masking).

Expert parallelism (``composer/parallel/expert.py``) sets ``MoE.ep``: the expert weights become
DTensors sharded over the ep ranks, the routed rows travel by all-to-all to the rank that holds
their expert, and the sums behind ``f`` and ``P`` run over the ep group, so ``aux`` equals the
loss of the group's concatenated batch. With ``ep`` unset nothing changes: same math, same keys.

Shape legend: B batch, T sequence, D d_model, N = B*T tokens, E experts, K top_k,
F expert hidden width, G expert groups, A = N*K token-expert assignments.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from composer.blocks.mlp import ACTIVATIONS, MLP, mlp_ref
from composer.config import ModelConfig, MoEConfig, d_ff_shared_of, is_gated

if TYPE_CHECKING:
    from composer.parallel.expert import ExpertParallel
    from composer.parallel.tensor import TPContext


def _router_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


class Router(nn.Module):
    """``router.weight [E, D]`` (fp32) and, if ``score_correction_bias``, ``router.score_bias``."""

    def __init__(self, d_model: int, moe: MoEConfig) -> None:
        super().__init__()
        self.moe = moe
        self.weight = nn.Parameter(torch.empty(moe.n_experts, d_model, dtype=torch.float32))
        if moe.score_correction_bias:
            # A buffer: it is steered by load statistics (aux-loss-free balancing), not by gradient.
            self.register_buffer("score_bias", torch.zeros(moe.n_experts, dtype=torch.float32))
        else:
            self.score_bias: torch.Tensor | None = None

    def forward(self, x_ND: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Return routing weights ``w_NK``, expert ids ``idx_NK`` and scores ``s_NE``."""
        moe = self.moe
        dtype = _router_dtype(x_ND.dtype)
        logits_NE = F.linear(x_ND.to(dtype), _local(self.weight).to(dtype))
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


class Experts(nn.Module):
    """Fused weights ``experts.{gate_proj,up_proj} [E, F, D]`` and ``experts.down_proj [E, D, F]``.

    ``forward`` takes token rows already sorted by expert, so the same module serves expert
    parallelism after an all-to-all dispatch.
    """

    def __init__(self, n_experts: int, d_model: int, d_ff: int, activation: str) -> None:
        super().__init__()
        self.gated = is_gated(activation)
        self.act = ACTIVATIONS[activation]
        if self.gated:
            self.gate_proj = nn.Parameter(torch.empty(n_experts, d_ff, d_model))
        self.up_proj = nn.Parameter(torch.empty(n_experts, d_ff, d_model))
        self.down_proj = nn.Parameter(torch.empty(n_experts, d_model, d_ff))

    def reset_parameters(self, std: float, generator: torch.Generator | None = None) -> None:
        for w in ((self.gate_proj,) if self.gated else ()) + (self.up_proj, self.down_proj):
            nn.init.normal_(w, 0.0, std, generator=generator)

    def forward(self, x_AD: torch.Tensor, n_tokens_E: list[int]) -> torch.Tensor:
        """Apply expert e to its contiguous slice of ``x_AD`` (rows sorted by expert id).

        Under expert parallelism the weights are DTensors and ``n_tokens_E`` counts this rank's
        local experts only; the local shard is taken here, after any FSDP pre-forward unshard.
        """
        gate = _local(self.gate_proj) if self.gated else None
        up, down = _local(self.up_proj), _local(self.down_proj)
        # torch._grouped_mm would replace this loop, but on CPU (torch 2.13) it rejects fp64 and
        # its backward fails, so we loop over experts (never over tokens) and skip empty ones.
        # unbind/split once: indexing w[e] per expert makes the backward zero-fill a whole-weight
        # gradient per expert.
        gates = gate.unbind(0) if gate is not None else None
        ups, downs = up.unbind(0), down.unbind(0)
        y_AD = []
        for e, x_nD in enumerate(x_AD.split(list(n_tokens_E), dim=0)):
            if x_nD.shape[0] == 0:
                continue
            if gates is not None:
                h_nF = self.act(F.linear(x_nD, gates[e])) * F.linear(x_nD, ups[e])
            else:
                h_nF = self.act(F.linear(x_nD, ups[e]))
            y_AD.append(F.linear(h_nF, downs[e]))
        if not y_AD:
            # No rows (an EP rank may receive none): stay in the graph of x and the weights, so
            # that this rank joins the backward all-to-all like the others and its experts get
            # zero gradients rather than none.
            anchor = sum(w.sum() for w in (gate, up, down) if w is not None)
            return x_AD * 0 + anchor * 0
        return torch.cat(y_AD)


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return g * ctx.scale, None


def _local(w: torch.Tensor) -> torch.Tensor:
    # Duck-typed DTensor check: importing torch.distributed.tensor here would add ~1 s to startup.
    return w.to_local() if hasattr(w, "to_local") else w


class MoE(nn.Module):
    """``layers.i.mixer.{router, experts, shared_experts}``; see the module docstring."""

    keep_fp32 = ("router.weight", "router.score_bias")

    def __init__(self, cfg: ModelConfig, layer_idx: int = 0) -> None:
        super().__init__()
        assert cfg.moe is not None, "an MoE layer needs cfg.moe"
        self.moe = moe = cfg.moe
        self.layer_idx = layer_idx
        self.init_std = cfg.init_std
        self.router = Router(cfg.d_model, moe)
        self.experts = Experts(moe.n_experts, cfg.d_model, moe.d_ff, moe.activation)
        if moe.n_shared_experts > 0:
            self.shared_experts = MLP(cfg, d_ff=d_ff_shared_of(moe), activation=moe.activation,
                                      bias=False)
        else:
            self.shared_experts = None
        self.aux_loss = torch.zeros(())
        # Set by composer.parallel.expert.apply_ep; a plain object, so no state-dict keys.
        self.ep: ExpertParallel | None = None
        # Set by composer.parallel: a differentiable sum of the load-balancing statistics over
        # the data-parallel ranks, so the aux loss is that of the global batch; and the factor
        # on its gradient under tensor parallelism (every tp rank computes the same aux, while
        # the router's gradients are summed over tp).
        self.stats_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.aux_grad_scale = 1.0

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        nn.init.normal_(self.router.weight, 0.0, self.init_std, generator=generator)
        if self.router.score_bias is not None:
            nn.init.zeros_(self.router.score_bias)
        self.experts.reset_parameters(self.init_std, generator)
        if self.shared_experts is not None:
            self.shared_experts.reset_parameters(generator)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        B, T, D = x_BTD.shape
        x_ND = x_BTD.reshape(B * T, D)
        w_NK, idx_NK, s_NE = self.router(x_ND)
        n_tokens_E = torch.bincount(idx_NK.flatten(), minlength=self.moe.n_experts)
        self.aux_loss = self._aux_loss(s_NE, n_tokens_E)

        # Sorting the assignments by expert makes each expert's tokens one contiguous slice.
        expert_A = idx_NK.flatten()
        order_A = torch.argsort(expert_A, stable=True)
        token_A = order_A // self.moe.top_k
        if self.ep is None:
            y_AD = self.experts(x_ND[token_A], n_tokens_E.tolist())
        else:  # the experts live on the ep ranks: all-to-all there and back, same row order
            y_AD = self.ep.run_experts(self.experts, x_ND[token_A], n_tokens_E)
        y_AD = y_AD.to(w_NK.dtype) * w_NK.flatten()[order_A, None]
        y_ND = torch.zeros_like(x_ND, dtype=w_NK.dtype).index_add_(0, token_A, y_AD)

        y_BTD = y_ND.to(x_BTD.dtype).view(B, T, D)
        if self.shared_experts is not None:
            y_BTD = y_BTD + self.shared_experts(x_BTD)
        return y_BTD

    def _aux_loss(self, s_NE: torch.Tensor, n_tokens_E: torch.Tensor) -> torch.Tensor:
        coeff = self.moe.aux_loss_coeff
        if coeff == 0:
            return s_NE.new_zeros(())
        p_NE = s_NE if self.moe.score_func == "softmax" else s_NE / s_NE.sum(-1, keepdim=True)
        # Sums rather than means, so that expert parallelism can add them up over its group.
        n_tokens = p_NE.new_full((1,), p_NE.shape[0])
        stats = torch.cat([p_NE.sum(dim=0), n_tokens_E.to(p_NE.dtype), n_tokens])
        if self.aux_grad_scale != 1.0:
            stats = _ScaleGrad.apply(stats, self.aux_grad_scale)
        if self.stats_reduce is not None:
            stats = self.stats_reduce(stats)
        elif self.ep is not None:
            stats = self.ep.all_reduce(stats)
        E = self.moe.n_experts
        p_sum_E, count_E, n = stats.split([E, E, 1])
        return coeff * E * torch.sum((count_E / n) * (p_sum_E / n))

    def apply_tp(self, tp: TPContext) -> None:
        """Expert-tensor parallel: every expert's hidden units split over ``tp`` (unless expert
        parallelism shards the experts on a 2-D ep x tp mesh itself); the router replicated, its
        gradients summed; shared experts as a dense MLP."""
        from torch.distributed.tensor import Shard

        from composer.parallel.tensor import PARTIAL, distribute_param, to_replicated

        to_replicated(self.router, ("weight",), tp, PARTIAL)
        if not tp.experts_on_ep:
            for name, dim in (("gate_proj", 1), ("up_proj", 1), ("down_proj", 2)):
                if hasattr(self.experts, name):
                    distribute_param(self.experts, name, tp.mesh, Shard(dim))
        if self.shared_experts is not None:
            self.shared_experts.apply_tp(tp)
        self.aux_grad_scale = 1.0 / tp.size

    @staticmethod
    def flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
        """Forward FLOPs per token (2 per multiply-add); independent of ``seq_len``."""
        moe = cfg.moe
        assert moe is not None
        n_mats = 3 if is_gated(moe.activation) else 2
        flops = 2 * cfg.d_model * moe.n_experts
        flops += 2 * moe.top_k * n_mats * cfg.d_model * moe.d_ff
        if moe.n_shared_experts > 0:
            flops += 2 * n_mats * cfg.d_model * d_ff_shared_of(moe)
        return flops


# ---------------------------------------------------------------- plain-math twins


def router_ref(x_ND: torch.Tensor, weight: torch.Tensor, moe: MoEConfig,
               score_bias: torch.Tensor | None = None) -> torch.Tensor:
    """Dense routing weights ``w_NE`` (zero for unchosen experts), chosen by sorting."""
    dtype = _router_dtype(x_ND.dtype)
    logits_NE = x_ND.to(dtype) @ weight.to(dtype).T
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


def moe_ref(x: torch.Tensor, weights: dict[str, torch.Tensor], cfg: ModelConfig) -> torch.Tensor:
    """Every expert on every token, mixed by the dense ``w_NE``; ``weights`` uses MoE's keys."""
    moe = cfg.moe
    assert moe is not None
    x_ND = x.reshape(-1, x.shape[-1])
    w_NE = router_ref(x_ND, weights["router.weight"], moe, weights.get("router.score_bias"))
    y_ND = torch.zeros_like(x_ND)
    for e in range(moe.n_experts):
        gate = weights["experts.gate_proj"][e] if is_gated(moe.activation) else None
        up, down = weights["experts.up_proj"][e], weights["experts.down_proj"][e]
        y_ND = y_ND + w_NE[:, e:e + 1].to(x.dtype) * mlp_ref(x_ND, up, down, moe.activation, gate)
    if moe.n_shared_experts > 0:
        gate = weights.get("shared_experts.gate_proj.weight")
        y_ND = y_ND + mlp_ref(x_ND, weights["shared_experts.up_proj.weight"],
                              weights["shared_experts.down_proj.weight"], moe.activation, gate)
    return y_ND.view(x.shape)

