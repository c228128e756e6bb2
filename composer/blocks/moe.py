"""Mixture of experts: top-k routed experts plus optional shared experts.

Routing (Shazeer et al. 2017; Mixtral; DeepSeek-V3 §2.1.2 for sigmoid + bias + groups):

    logits = x W_r^T,   s = softmax(logits)  or  sigmoid(logits)
    choose = s + b                                   (b: score_bias, for choosing only)
    if G > 1: group score = sum of the top-2 ``choose`` in each group; keep the best
              ``topk_groups`` groups, the others are masked to -inf before the top-k
    idx = topk(choose, k),   w = s[idx]   (the scores *without* the bias)
    if renormalize: w = w / (sum(w) + 1e-20);   w = w * routed_scaling_factor
    y = sum_k w_k * expert_{idx_k}(x) + shared(x)     (shared(x) * sigmoid(x W_s^T) with
                                                       shared_expert_gate, W_s [1, D]: Qwen3-Next)

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

The block is single-device. Its plan (``parallel_plan``) names the expert group and the token
sums; expert parallelism (``composer/parallel/expert.py``) then shards the experts' dim 0 over
the ep ranks and swaps in an ``Experts`` that sends the routed rows by all-to-all to the rank
holding their expert, and replaces ``token_sum`` by a sum over the ranks that share the batch, so
``aux`` is the loss of the global batch. Same math, same keys.

Shape legend: B batch, T sequence, D d_model, N = B*T tokens, E experts, K top_k,
F expert hidden width, G expert groups, A = N*K token-expert assignments.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from composer.blocks.mlp import ACTIVATIONS, MLP, mlp_ref
from composer.blocks.plan import (
    ZEROS,
    Divisible,
    Init,
    Normal,
    ParallelPlan,
    TokenSum,
    init_module,
)
from composer.config import ModelConfig, MoEConfig, d_ff_shared_of, is_gated


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
        logits_NE = F.linear(x_ND.to(dtype), self.weight.to(dtype))
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

    ``forward`` takes token rows already sorted by expert, so that expert parallelism can put
    an all-to-all dispatch in front of the same computation.
    """

    def __init__(self, n_experts: int, d_model: int, d_ff: int, activation: str) -> None:
        super().__init__()
        self.gated = is_gated(activation)
        self.act = ACTIVATIONS[activation]
        if self.gated:
            self.gate_proj = nn.Parameter(torch.empty(n_experts, d_ff, d_model))
        self.up_proj = nn.Parameter(torch.empty(n_experts, d_ff, d_model))
        self.down_proj = nn.Parameter(torch.empty(n_experts, d_model, d_ff))

    def forward(self, x_AD: torch.Tensor, n_tokens_E: torch.Tensor) -> torch.Tensor:
        """Apply expert e to its contiguous slice of ``x_AD`` (rows sorted by expert id,
        ``n_tokens_E`` rows for expert e; one host sync for the split sizes)."""
        gate = self.gate_proj if self.gated else None
        up, down = self.up_proj, self.down_proj
        # torch._grouped_mm would replace this loop, but on CPU (torch 2.13) it rejects fp64 and
        # its backward fails, so we loop over experts (never over tokens) and skip empty ones.
        # unbind/split once: indexing w[e] per expert makes the backward zero-fill a whole-weight
        # gradient per expert.
        gates = gate.unbind(0) if gate is not None else None
        ups, downs = up.unbind(0), down.unbind(0)
        y_AD = []
        for e, x_nD in enumerate(x_AD.split(n_tokens_E.tolist(), dim=0)):
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


class MoE(nn.Module):
    """``layers.i.mixer.{router, experts, shared_experts}``; see the module docstring."""

    keep_fp32 = ("router.weight", "router.score_bias")
    stateless = True
    """Token-wise: nothing to keep between decoding steps (:mod:`composer.blocks.cache`)."""

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
        if moe.shared_expert_gate:
            self.shared_expert_gate = nn.Linear(cfg.d_model, 1, bias=False)
        # the load-balancing statistics pass through it: the global batch's under parallelism
        self.token_sum = TokenSum()
        self.aux_loss = torch.zeros(())

    def init_rules(self) -> dict[str, Init]:
        return {"router.weight": Normal(self.init_std), "router.score_bias": ZEROS,
                "experts.*": Normal(self.init_std),
                "shared_expert_gate.weight": Normal(self.init_std)}

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        init_module(self, generator)

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
        y_AD = self.experts(x_ND[token_A], n_tokens_E)
        y_AD = y_AD.to(w_NK.dtype) * w_NK.flatten()[order_A, None]
        y_ND = torch.zeros_like(x_ND, dtype=w_NK.dtype).index_add_(0, token_A, y_AD)

        y_BTD = y_ND.to(x_BTD.dtype).view(B, T, D)
        if self.shared_experts is not None:
            shared_BTD = self.shared_experts(x_BTD)
            if self.moe.shared_expert_gate:
                shared_BTD = shared_BTD * torch.sigmoid(self.shared_expert_gate(x_BTD))
            y_BTD = y_BTD + shared_BTD
        return y_BTD

    def _aux_loss(self, s_NE: torch.Tensor, n_tokens_E: torch.Tensor) -> torch.Tensor:
        coeff = self.moe.aux_loss_coeff
        if coeff == 0:
            return s_NE.new_zeros(())
        p_NE = s_NE if self.moe.score_func == "softmax" else s_NE / s_NE.sum(-1, keepdim=True)
        # Sums rather than means, so that they add up over the ranks holding the batch.
        n_tokens = p_NE.new_full((1,), p_NE.shape[0])
        stats = self.token_sum(torch.cat([p_NE.sum(dim=0), n_tokens_E.to(p_NE.dtype), n_tokens]))
        E = self.moe.n_experts
        p_sum_E, count_E, n = stats.split([E, E, 1])
        return coeff * E * torch.sum((count_E / n) * (p_sum_E / n))

    def parallel_plan(self) -> ParallelPlan:
        """The routed experts are the expert group (split over ep on dim 0); expert-tensor
        parallel splits each expert's hidden units over ``tp``; the router is replicated with
        partial gradients; the shared experts follow the MLP's own plan."""
        return ParallelPlan(partial=("router.weight", "shared_expert_gate.weight"),
                            experts="experts",
                            expert_hidden={"gate_proj": 1, "up_proj": 1, "down_proj": 2},
                            token_sums=("token_sum",))

    @staticmethod
    def layout_rules(cfg: ModelConfig) -> list[Divisible]:
        moe = cfg.moe
        assert moe is not None
        rules = [Divisible("moe.n_experts", moe.n_experts, "ep"), Divisible("moe.d_ff", moe.d_ff)]
        if moe.n_shared_experts:
            rules.append(Divisible("the shared-expert width", d_ff_shared_of(moe)))
        return rules

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
        if moe.shared_expert_gate:
            flops += 2 * cfg.d_model
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
        shared = mlp_ref(x_ND, weights["shared_experts.up_proj.weight"],
                         weights["shared_experts.down_proj.weight"], moe.activation, gate)
        if moe.shared_expert_gate:
            shared = shared / (1 + torch.exp(-(x_ND @ weights["shared_expert_gate.weight"].T)))
        y_ND = y_ND + shared
    return y_ND.view(x.shape)

