"""Mixture of experts: top-k routed experts plus optional shared experts.

Routing (which experts, with what weights ``w``): :mod:`composer.blocks.router`. Then

    y = sum_k w_k * expert_{idx_k}(x) + shared(x)     (shared(x) * sigmoid(x W_s^T) with
                                                       shared_expert_gate, W_s [1, D]: Qwen3-Next)

An expert is the MLP of ``mlp.py``: gated ``down(act(gate x) * up x)`` or plain ``down(act(up x))``.
Router math runs in fp32 (fp64 when the input is fp64, so the fp64 reference can check the exact
math); expert matmuls run in the input dtype; their outputs are scaled by the routing weights and
summed in the router dtype, then cast back to the input dtype (as NemotronHExperts does).

Load-balancing loss (Switch Transformer, Fedus et al. 2021, eq. 4), per MoE layer (the model's
``aux_loss`` sums the layers), normalised exactly as transformers' ``load_balancing_loss_func``
for one layer:

    aux = aux_loss_coeff * E * sum_e f_e * P_e,   f_e = count_e / N,   P_e = mean_n p_ne

``count_e`` counts the (token, k) assignments to expert e, so ``sum_e f_e = top_k`` and a
perfectly balanced router gives ``aux = coeff * top_k`` (Megatron divides by ``top_k``, giving
``coeff``: Megatron's ``moe_aux_loss_coeff`` is our coefficient times ``top_k``). ``p`` is the
softmax probability, or for a sigmoid router the scores normalised to sum to 1 per token. ``f``
counts the experts chosen (after bias and group masking, before capacity dropping). The tokens ``N``
(``moe.aux_loss_scope``): ``micro_batch``, one forward's tokens over every data-parallel rank
(the statistics pass through ``token_sum``); ``global_batch``, ``count`` and ``N`` summed over the
optimizer step's micro-batches so far (Megatron's ``global_aux_loss``; ``P`` stays the current
micro-batch's), reset by :meth:`MoE.end_step`.

Sequence-wise balance loss (DeepSeek-V3 eq. 17-20; ``moe.seq_aux_loss_coeff``), per sequence
``b`` of ``T`` tokens, then averaged over the sequences:

    seq_aux = coeff * mean_b sum_e (E / (K T)) count_be * mean_t p_bte

Capacity and aux-loss-free balancing: :mod:`composer.blocks.router`.

The block is single-device. Its plan (``parallel_plan``) names the expert group and the token
sums; expert parallelism (``composer/parallel/expert.py``) then shards the experts' dim 0 over
the ep ranks and swaps in an ``Experts`` that sends the routed rows by all-to-all to the rank
holding their expert, and replaces ``token_sum`` by a sum over the ranks that share the batch, so
``aux`` is the loss of the global batch. Same math, same keys.

Expert computation (fused weights, biases, gpt-oss's clamped SwiGLU, grouped GEMMs):
:mod:`composer.blocks.experts`.

Shape legend: B batch, T sequence, D d_model, N = B*T tokens, E experts, K top_k,
F expert hidden width, G expert groups, A = N*K token-expert assignments.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from composer.blocks.experts import (  # noqa: F401  (Experts, grouped_mm_dtype: re-exported)
    Experts,
    expert_ref,
    grouped_mm_dtype,
)
from composer.blocks.kind import LayerKind
from composer.blocks.mlp import MLP, Activation, is_gated, mlp_ref
from composer.blocks.plan import (
    ZEROS,
    Divisible,
    Init,
    Normal,
    ParallelPlan,
    TokenSum,
    init_module,
)
from composer.blocks.router import (
    Router,
    capacity,
    count_assignments,
    drop_ref,
    router_dtype,
    router_ref,
    within_capacity,
)
from composer.config import ConfigError, ModelConfig, positive
from composer.kernels.linear import Linear

# ---------------------------------------------------------------- the kind's config section


@dataclass
class MoEConfig:
    n_experts: int = 8
    top_k: int = 2
    d_ff: int = 512
    activation: Activation = "swiglu"
    n_shared_experts: int = 0
    d_ff_shared: int | None = None
    """Width of the shared-expert MLP; ``None`` means ``d_ff * n_shared_experts``."""
    score_func: Literal["softmax", "sigmoid", "topk_softmax"] = "softmax"
    """``topk_softmax``: top-k on the logits, then a softmax over the chosen k alone (gpt-oss;
    the weights sum to 1, so ``renormalize`` changes nothing)."""
    router_bias: bool = False
    """A learned bias on the router logits, ``router.bias [E]`` (fp32; gpt-oss)."""
    expert_bias: bool = False
    """Biases on the experts' projections (``experts.*_proj_bias``; gpt-oss)."""
    swiglu_limit: float | None = None
    """gpt-oss's clamped SwiGLU in the routed experts (:mod:`composer.blocks.experts`): the
    gate clamped above at the limit, the up projection to ``[-limit, limit]``,
    ``(up + 1) * gate * sigmoid(swiglu_alpha * gate)``; ``None``: the plain gated unit."""
    swiglu_alpha: float = 1.702
    """The sigmoid's gain in that clamped SwiGLU (used only with ``swiglu_limit``)."""
    renormalize: bool = True
    """Divide the top-k weights by their sum."""
    score_correction_bias: bool = False
    """A per-expert fp32 bias added to the scores for choosing experts only (aux-loss-free)."""
    routed_scaling_factor: float = 1.0
    n_expert_groups: int = 1
    topk_groups: int = 1
    aux_loss_coeff: float = 0.0
    """Weight of the switch-style load-balancing loss of each MoE layer, added to the training
    loss (Megatron-Core ``moe_aux_loss_coeff``; :mod:`composer.blocks.moe` has the formula)."""
    aux_loss_scope: Literal["micro_batch", "global_batch"] = "micro_batch"
    """Over which tokens that loss counts the expert loads ``f_e``: ``micro_batch`` (each
    micro-batch's tokens over every data-parallel rank; Megatron ``aux_loss`` counts one rank's
    micro-batch) or ``global_batch`` (the running sum over the step's micro-batches so far,
    Megatron ``global_aux_loss``)."""
    seq_aux_loss_coeff: float = 0.0
    """Weight of DeepSeek-V3's sequence-wise balance loss (eq. 17-20; Megatron ``seq_aux_loss``),
    each sequence balanced on its own, averaged over the sequences; 0 = off."""
    bias_update_rate: float = 0.0
    """Aux-loss-free balancing (DeepSeek-V3 §2.1.2): after each optimizer step the score bias of
    every MoE layer moves by ``rate * sign(mean load - load_e)``, the loads counted over the
    global batch; 0 = off (needs ``score_correction_bias``; Megatron
    ``moe_router_bias_update_rate``, typically 1e-3)."""
    capacity_factor: float | None = None
    """Token dropping: each expert takes at most ``ceil(capacity_factor * N * top_k / E)`` of a
    forward's ``N`` tokens (per rank), those with the highest routing weight; the others skip
    that expert (the residual carries them). It is part of the model: evaluation and generation
    drop too (a decoding step's ``N`` is its batch). ``None``: dropless."""
    shared_expert_gate: bool = False
    """Scale the shared experts' output by ``sigmoid(shared_expert_gate(x))``, one scalar per
    token (``shared_expert_gate.weight [1, D]``; Qwen2-MoE, Qwen3-Next, Qwen3.5-MoE)."""


def validate_moe(e: MoEConfig, cfg: ModelConfig) -> None:
    positive(e, "moe.", ("n_experts", "top_k", "d_ff", "d_ff_shared", "routed_scaling_factor",
                          "n_expert_groups", "topk_groups"))
    if e.top_k > e.n_experts:
        raise ConfigError(f"moe.top_k ({e.top_k}) must be <= moe.n_experts ({e.n_experts})")
    if e.n_shared_experts < 0:
        raise ConfigError(f"moe.n_shared_experts must be >= 0, got {e.n_shared_experts}")
    if e.n_experts % e.n_expert_groups or e.topk_groups > e.n_expert_groups:
        raise ConfigError(f"moe.n_experts ({e.n_experts}) must divide into moe.n_expert_groups "
                          f"({e.n_expert_groups}) and moe.topk_groups ({e.topk_groups}) must not "
                          "exceed it")
    if e.n_expert_groups > 1 and e.top_k > e.topk_groups * (e.n_experts // e.n_expert_groups):
        raise ConfigError(f"moe.top_k ({e.top_k}) exceeds the experts in moe.topk_groups groups")
    for name in ("aux_loss_coeff", "seq_aux_loss_coeff", "bias_update_rate"):
        if getattr(e, name) < 0:
            raise ConfigError(f"moe.{name} must be >= 0, got {getattr(e, name)}")
    if e.bias_update_rate and not e.score_correction_bias:
        raise ConfigError("moe.bias_update_rate needs the score bias it updates "
                          "(moe.score_correction_bias: true)")
    if e.capacity_factor is not None and not e.capacity_factor > 0:
        raise ConfigError(f"moe.capacity_factor must be > 0 (or null: dropless), got "
                          f"{e.capacity_factor}")
    if e.shared_expert_gate and not e.n_shared_experts:
        raise ConfigError("moe.shared_expert_gate needs shared experts (moe.n_shared_experts >= 1)")
    if e.score_func == "topk_softmax" and (e.score_correction_bias or e.n_expert_groups > 1):
        raise ConfigError("moe.score_func topk_softmax chooses on the logits: it takes no "
                          "moe.score_correction_bias and no moe.n_expert_groups")
    if e.swiglu_limit is not None and (e.activation != "swiglu" or not e.swiglu_limit > 0):
        raise ConfigError(f"moe.swiglu_limit ({e.swiglu_limit}) must be > 0 and needs "
                          f"moe.activation swiglu, got {e.activation!r}")


MOE_TRAINING_ONLY = ("aux_loss_scope", "seq_aux_loss_coeff", "bias_update_rate")
"""MoE settings of training alone: they change the losses and the bias updates, never a forward's
outputs, and no Hugging Face config has them (an export leaves them out, an import gives the
defaults)."""


def d_ff_shared_of(e: MoEConfig) -> int:
    return e.d_ff_shared if e.d_ff_shared is not None else e.d_ff * e.n_shared_experts


class MoE(nn.Module):
    """``layers.i.mixer.{router, experts, shared_experts}``; see the module docstring."""

    keep_fp32 = ("router.weight", "router.bias", "router.score_bias")
    stateless = True
    """Token-wise: nothing to keep between decoding steps (:mod:`composer.blocks.cache`)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int = 0) -> None:
        super().__init__()
        assert cfg.moe is not None, "an MoE layer needs cfg.moe"
        self.moe = moe = cfg.moe
        self.layer_idx = layer_idx
        self.init_std = cfg.init_std
        self.router = Router(cfg.d_model, moe)
        self.experts = Experts(moe.n_experts, cfg.d_model, moe.d_ff, moe.activation,
                               bias=moe.expert_bias, swiglu_limit=moe.swiglu_limit,
                               swiglu_alpha=moe.swiglu_alpha)
        if moe.n_shared_experts > 0:
            self.shared_experts = MLP(cfg, d_ff=d_ff_shared_of(moe), activation=moe.activation,
                                      bias=False)
        else:
            self.shared_experts = None
        if moe.shared_expert_gate:
            self.shared_expert_gate = Linear(cfg.d_model, 1, bias=False)
        # the load-balancing statistics pass through it: the global batch's under parallelism
        self.token_sum = TokenSum()
        # the sequence-wise statistics: this rank's own sequences (whole on every tp rank)
        self.seq_sum = TokenSum()
        self.aux_loss = torch.zeros(())
        self.step_count_E: torch.Tensor | None = None
        """``aux_loss_scope="global_batch"``: assignments and tokens summed over the step's
        micro-batches so far (``[E + 1]``), reset by :meth:`end_step`."""

    step_stats = ("step_count_E",)
    """As :attr:`composer.blocks.router.Router.step_stats`."""

    def init_rules(self) -> dict[str, Init]:
        return {"router.weight": Normal(self.init_std), "router.score_bias": ZEROS,
                "router.bias": Normal(self.init_std), "experts.*_proj_bias": ZEROS,
                # by name: a glob would name the adapters inside experts too (composer/lora.py)
                "experts.gate_proj": Normal(self.init_std),
                "experts.up_proj": Normal(self.init_std),
                "experts.down_proj": Normal(self.init_std),
                "shared_expert_gate.weight": Normal(self.init_std)}

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        init_module(self, generator)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        B, T, D = x_BTD.shape
        E, K = self.moe.n_experts, self.moe.top_k
        x_ND = x_BTD.reshape(B * T, D)
        w_NK, idx_NK, s_NE = self.router(x_ND)
        expert_A = idx_NK.flatten()
        n_chosen_E = count_assignments(expert_A, E)
        self.router.count_load(n_chosen_E)
        self.aux_loss = self._aux_loss(s_NE, n_chosen_E) + self._seq_aux_loss(s_NE, idx_NK, B)

        if self.moe.capacity_factor is not None:  # dropped assignments sort last, as padding
            keep_A = within_capacity(idx_NK, w_NK, E, capacity(self.moe, B * T))
            expert_A = torch.where(keep_A, expert_A, E)
        # Sorting the assignments by expert makes each expert's tokens one contiguous slice.
        order_A = torch.argsort(expert_A, stable=True)
        token_A = order_A // K
        y_AD = self.experts(x_ND[token_A], count_assignments(expert_A, E))
        y_AD = y_AD.to(w_NK.dtype) * w_NK.flatten()[order_A, None]
        y_ND = torch.zeros_like(x_ND, dtype=w_NK.dtype).index_add_(0, token_A, y_AD)

        y_BTD = y_ND.to(x_BTD.dtype).view(B, T, D)
        if self.shared_experts is not None:
            shared_BTD = self.shared_experts(x_BTD)
            if self.moe.shared_expert_gate:
                shared_BTD = shared_BTD * torch.sigmoid(self.shared_expert_gate(x_BTD))
            y_BTD = y_BTD + shared_BTD
        return y_BTD

    def _probs(self, s_NE: torch.Tensor) -> torch.Tensor:
        return s_NE if self.moe.score_func != "sigmoid" else s_NE / s_NE.sum(-1, keepdim=True)

    def _aux_loss(self, s_NE: torch.Tensor, n_chosen_E: torch.Tensor) -> torch.Tensor:
        coeff = self.moe.aux_loss_coeff
        if coeff == 0:
            return s_NE.new_zeros(())
        p_NE = self._probs(s_NE)
        # Sums rather than means, so that they add up over the ranks holding the batch.
        n_tokens = p_NE.new_full((1,), p_NE.shape[0])
        stats = self.token_sum(torch.cat([p_NE.sum(dim=0), n_chosen_E.to(p_NE.dtype), n_tokens]))
        E = self.moe.n_experts
        p_sum_E, count_E, n = stats.split([E, E, 1])
        n_p = n
        if self.moe.aux_loss_scope == "global_batch" and self.training:
            step = torch.cat([count_E, n]).detach()
            if self.step_count_E is not None:
                step = step + self.step_count_E
            if torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1:
                self.step_count_E = step  # not again in a recomputation inside the backward
            count_E, n = step.split([E, 1])
        return coeff * E * torch.sum((count_E / n) * (p_sum_E / n_p))

    def _seq_aux_loss(self, s_NE: torch.Tensor, idx_NK: torch.Tensor, B: int) -> torch.Tensor:
        """DeepSeek-V3's sequence-wise balance loss (module docstring), over the ``B`` sequences
        of this forward."""
        coeff = self.moe.seq_aux_loss_coeff
        if coeff == 0:
            return s_NE.new_zeros(())
        E, K = self.moe.n_experts, self.moe.top_k
        p_BTE = self._probs(s_NE).view(B, -1, E)
        chosen_BTE = torch.zeros_like(p_BTE).scatter_(2, idx_NK.view(B, p_BTE.shape[1], K), 1.0)
        stats_B2E = self.seq_sum(torch.stack([chosen_BTE.sum(1), p_BTE.sum(1)], dim=1))
        # each token picks K experts: the sequences' lengths from the (summed) counts, which
        # stay whole when context parallelism cuts the sequences
        T_B1 = stats_B2E[:, 0].sum(-1, keepdim=True) / K
        f_BE = stats_B2E[:, 0] * E / (K * T_B1)
        return coeff * torch.sum(f_BE * stats_B2E[:, 1] / T_B1) / B

    def lora_targets(self) -> dict[str, str]:
        """The projections LoRA may adapt (:mod:`composer.lora`): the shared experts' under the
        MLP's names (as PEFT's ``target_modules`` match them: ``gate_proj`` names every gate
        projection), and the routed experts' 3-D weights as ``experts`` (adapted in weight
        space, only when asked for)."""
        out = {}
        if self.shared_experts is not None:
            out = {name: f"shared_experts.{path}"
                   for name, path in self.shared_experts.lora_targets().items()}
        return {**out, "experts": "experts"}

    def end_step(self) -> None:
        """Forget the statistics of the finished optimizer step (``global_batch`` scope)."""
        self.step_count_E = None

    def parallel_plan(self) -> ParallelPlan:
        """The routed experts are the expert group (split over ep on dim 0); expert-tensor
        parallel splits each expert's hidden units over ``tp`` (the gate/up biases with them,
        the down bias counted once); the router is replicated with partial gradients; the
        shared experts follow the MLP's own plan."""
        return ParallelPlan(partial=("router.weight", "router.bias", "shared_expert_gate.weight"),
                            experts="experts",
                            expert_hidden={"gate_proj": 1, "up_proj": 1, "down_proj": 2,
                                           "gate_proj_bias": 1, "up_proj_bias": 1},
                            expert_partial=("down_proj_bias",),
                            token_sums=("token_sum",), local_sums=("seq_sum",))

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


    @staticmethod
    def activation_bytes_per_token(cfg: ModelConfig, seq_len: int, ac: str, size: int,
                                   tp: int = 1, cp: int = 1) -> float:
        """Saved for the backward per token on one of ``tp`` ranks, with uniform routing
        (each rank's experts see ``top_k`` assignments per token on average, whatever ``ep``)
        and the experts' hidden units split over ``tp``; everything else is whole on every rank
        (the router is replicated, the experts' outputs are partial sums of the whole width).
        With ``k = top_k``, ``F = d_ff / tp`` and ``n`` experts, ``ac`` none keeps:

        - router: its input ``d`` (gathered over the sequence under sequence parallel; the
          dispatch and the shared experts read the same tensor), the scores ``n``, the
          renormalisation's sum (``1``) and the chosen weights ``k``;
        - dispatch: the assignments' indices (top-k, sort order, token: ``3 k`` int64) and the
          dispatched tokens (``k d``);
        - experts, per assignment: gated the gate and up outputs, the activation and the
          product (``4 F``), ungated ``2 F``;
        - combine: the per-assignment weights (``k``), the experts' outputs and their weighted
          copy (``2 k d``);
        - shared experts: the MLP's hidden tensors (gated ``4 F_shared``, ungated ``2``).

        The router and the combine run in at least fp32 (under bf16: an fp32 copy of the input,
        fp32 scores, weights and weighted outputs; the shared experts then keep the input in
        its own dtype besides); the dispatched rows and the experts' tensors are at ``size``.

        ``selective`` keeps the matmul outputs: the router's scores (``n``), per assignment
        the gate, up and down outputs (gated ``2 F + d``, ungated ``F + d``) and the shared
        experts' likewise; ``full`` keeps nothing of its own. The same on CUDA with the
        per-expert loop; with ``torch._grouped_mm`` (bf16 on CUDA) ``none`` keeps the same
        tensors as one buffer per projection, but ``selective`` recomputes the experts
        (``_grouped_mm`` is not among the ops it saves). Group-limited routing's indices and
        the balance losses' statistics (a few numbers per token or per expert) are not
        counted."""
        moe = cfg.moe
        assert moe is not None
        if ac == "full":
            return 0.0
        d, k, n, gated = cfg.d_model, moe.top_k, moe.n_experts, is_gated(moe.activation)
        F = moe.d_ff / tp
        shared = d_ff_shared_of(moe) / tp if moe.n_shared_experts > 0 else 0.0
        if ac == "selective":
            experts = k * ((2 if gated else 1) * F + d)
            if shared:
                experts += (2 if gated else 1) * shared + d
            return size * (n + experts)
        hidden = 4 if gated else 2
        wide = max(size, 4)  # the router and the combine compute in >= fp32
        router = d + n + int(moe.renormalize) + k
        combine = k + 2 * k * d
        own = size * (k * d + k * hidden * F + hidden * shared) + 8 * 3 * k
        if shared and size < 4:  # the shared experts read the input in its own dtype
            own += size * d
        return wide * (router + combine) + own

# ---------------------------------------------------------------- plain-math twins


def moe_ref(x: torch.Tensor, weights: dict[str, torch.Tensor], cfg: ModelConfig) -> torch.Tensor:
    """Every expert on every token, mixed by the dense ``w_NE``; ``weights`` uses MoE's keys."""
    moe = cfg.moe
    assert moe is not None
    x_ND = x.reshape(-1, x.shape[-1])
    w_NE = router_ref(x_ND, weights["router.weight"], moe, weights.get("router.score_bias"),
                      weights.get("router.bias"))
    if moe.capacity_factor is not None:
        w_NE = drop_ref(w_NE, capacity(moe, x_ND.shape[0]))
    y_ND = torch.zeros_like(x_ND)
    for e in range(moe.n_experts):
        y_eND = expert_ref(x_ND, weights, e, moe.activation, moe.swiglu_limit, moe.swiglu_alpha)
        y_ND = y_ND + w_NE[:, e:e + 1].to(x.dtype) * y_eND
    if moe.n_shared_experts > 0:
        gate = weights.get("shared_experts.gate_proj.weight")
        shared = mlp_ref(x_ND, weights["shared_experts.up_proj.weight"],
                         weights["shared_experts.down_proj.weight"], moe.activation, gate)
        if moe.shared_expert_gate:
            shared = shared / (1 + torch.exp(-(x_ND @ weights["shared_expert_gate.weight"].T)))
        y_ND = y_ND + shared
    return y_ND.view(x.shape)



def seq_aux_loss_ref(x_BTD: torch.Tensor, weights: dict[str, torch.Tensor],
                     cfg: ModelConfig) -> torch.Tensor:
    """DeepSeek-V3 eq. 17-20 term by term: ``coeff * mean_b sum_i f_i P_i`` with
    ``f_i = E / (K T) * #{t: i chosen}`` and ``P_i = mean_t s_it / sum_j s_jt``."""
    moe = cfg.moe
    assert moe is not None
    E, K = moe.n_experts, moe.top_k
    total = x_BTD.new_zeros((), dtype=router_dtype(x_BTD.dtype))
    for x_TD in x_BTD:
        w_TE = router_ref(x_TD, weights["router.weight"], moe, weights.get("router.score_bias"),
                          weights.get("router.bias"))
        logits_TE = x_TD.to(total.dtype) @ weights["router.weight"].to(total.dtype).T
        if "router.bias" in weights:
            logits_TE = logits_TE + weights["router.bias"].to(total.dtype)
        s_TE = torch.sigmoid(logits_TE) if moe.score_func == "sigmoid" else \
            torch.softmax(logits_TE, -1)
        T = x_TD.shape[0]
        f_E = (w_TE > 0).to(total.dtype).sum(0) * E / (K * T)
        P_E = (s_TE / s_TE.sum(-1, keepdim=True)).mean(0)
        total = total + (f_E * P_E).sum()
    return moe.seq_aux_loss_coeff * total / x_BTD.shape[0]


KIND = LayerKind("E", "MoE", MoE, "moe", MoEConfig, validate_moe, always=True)
"""``E``: the mixture of experts."""
