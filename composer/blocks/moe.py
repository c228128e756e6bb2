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

Expert computation: rows sorted by expert, then one grouped GEMM per projection on CUDA in
bf16 (``torch._grouped_mm``, no host synchronisation; other CUDA dtypes loop). On the CPU,
training forwards loop over the experts' slices (``bench/moe.py``: nothing measured beats the
loop forward + backward, and ``torch._grouped_mm`` has no CPU backward in torch 2.13); forwards
without gradients (evaluation, generation) take ``torch._grouped_mm``, 10-27% faster there.

Shape legend: B batch, T sequence, D d_model, N = B*T tokens, E experts, K top_k,
F expert hidden width, G expert groups, A = N*K token-expert assignments.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from composer.blocks.kind import LayerKind
from composer.blocks.mlp import ACTIVATIONS, MLP, Activation, is_gated, mlp_ref
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
    score_func: Literal["softmax", "sigmoid"] = "softmax"
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


MOE_TRAINING_ONLY = ("aux_loss_scope", "seq_aux_loss_coeff", "bias_update_rate")
"""MoE settings of training alone: they change the losses and the bias updates, never a forward's
outputs, and no Hugging Face config has them (an export leaves them out, an import gives the
defaults)."""


def d_ff_shared_of(e: MoEConfig) -> int:
    return e.d_ff_shared if e.d_ff_shared is not None else e.d_ff * e.n_shared_experts


def grouped_mm_dtype(x_AD: torch.Tensor, w_EFD: torch.Tensor) -> torch.dtype | None:
    """The dtype to run ``torch._grouped_mm`` in, or None for the loop. On CUDA: bf16 (the
    dtype its fast kernels and torchtitan use), the input's or autocast's; other CUDA dtypes
    loop. On the CPU: fp32/bf16 when no gradient is needed (its CPU kernel has no backward in
    torch 2.13; forward it beats the loop, ``bench/moe.py``). Rows must be a multiple of 16
    bytes (its alignment). Chosen per call, never at import."""
    if not hasattr(torch, "_grouped_mm"):
        return None
    dtype = x_AD.dtype
    if x_AD.is_cuda:
        if torch.is_autocast_enabled("cuda"):
            dtype = torch.get_autocast_dtype("cuda")
        if dtype != torch.bfloat16:
            return None
    elif x_AD.device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return None
    elif torch.is_grad_enabled() and (x_AD.requires_grad or w_EFD.requires_grad):
        return None
    align = 16 // dtype.itemsize
    return dtype if w_EFD.shape[1] % align == 0 and w_EFD.shape[2] % align == 0 else None


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
        """Apply expert e to its contiguous slice of ``x_AD``: the rows are sorted by expert id,
        ``n_tokens_E[e]`` of them for expert e; rows after ``sum(n_tokens_E)`` are padding
        (dropped assignments) and their outputs are zero."""
        dtype = grouped_mm_dtype(x_AD, self.up_proj)
        if dtype is not None:
            return self._grouped(x_AD.to(dtype), n_tokens_E)
        return self._loop(x_AD, n_tokens_E)

    def _grouped(self, x_AD: torch.Tensor, n_tokens_E: torch.Tensor) -> torch.Tensor:
        """One ``torch._grouped_mm`` per projection, without host synchronisation: the group
        offsets stay on the device, the padding rows join the last group as zeros."""
        A = x_AD.shape[0]
        ends_E = torch.cumsum(n_tokens_E, 0)
        valid_A1 = (torch.arange(A, device=x_AD.device) < ends_E[-1])[:, None]
        offs_E = torch.cat([ends_E[:-1], ends_E.new_full((1,), A)]).to(torch.int32)
        x_AD = torch.where(valid_A1, x_AD, 0)  # its backward zeroes the padding rows' grads

        def mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return torch._grouped_mm(x, w.to(x.dtype).transpose(-2, -1), offs=offs_E)

        if self.gated:
            h_AF = self.act(mm(x_AD, self.gate_proj)) * mm(x_AD, self.up_proj)
        else:
            h_AF = self.act(mm(x_AD, self.up_proj))
        return torch.where(valid_A1, mm(h_AF, self.down_proj), 0)

    def _loop(self, x_AD: torch.Tensor, n_tokens_E: torch.Tensor) -> torch.Tensor:
        """A loop over the experts (never over tokens), skipping empty ones; one host sync for
        the split sizes."""
        gate = self.gate_proj if self.gated else None
        up, down = self.up_proj, self.down_proj
        # unbind/split once: indexing w[e] per expert makes the backward zero-fill a whole-weight
        # gradient per expert.
        gates = gate.unbind(0) if gate is not None else None
        ups, downs = up.unbind(0), down.unbind(0)
        sizes = n_tokens_E.tolist()
        n_pad = x_AD.shape[0] - sum(sizes)
        y_AD = []
        for e, x_nD in enumerate(x_AD.split([*sizes, n_pad], dim=0)[:-1]):
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
        if n_pad:
            y_AD.append(x_AD.new_zeros(n_pad, x_AD.shape[1]))
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
        return s_NE if self.moe.score_func == "softmax" else s_NE / s_NE.sum(-1, keepdim=True)

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
        parallel splits each expert's hidden units over ``tp``; the router is replicated with
        partial gradients; the shared experts follow the MLP's own plan."""
        return ParallelPlan(partial=("router.weight", "shared_expert_gate.weight"),
                            experts="experts",
                            expert_hidden={"gate_proj": 1, "up_proj": 1, "down_proj": 2},
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


# ---------------------------------------------------------------- plain-math twins


def moe_ref(x: torch.Tensor, weights: dict[str, torch.Tensor], cfg: ModelConfig) -> torch.Tensor:
    """Every expert on every token, mixed by the dense ``w_NE``; ``weights`` uses MoE's keys."""
    moe = cfg.moe
    assert moe is not None
    x_ND = x.reshape(-1, x.shape[-1])
    w_NE = router_ref(x_ND, weights["router.weight"], moe, weights.get("router.score_bias"))
    if moe.capacity_factor is not None:
        w_NE = drop_ref(w_NE, capacity(moe, x_ND.shape[0]))
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



def seq_aux_loss_ref(x_BTD: torch.Tensor, weights: dict[str, torch.Tensor],
                     cfg: ModelConfig) -> torch.Tensor:
    """DeepSeek-V3 eq. 17-20 term by term: ``coeff * mean_b sum_i f_i P_i`` with
    ``f_i = E / (K T) * #{t: i chosen}`` and ``P_i = mean_t s_it / sum_j s_jt``."""
    moe = cfg.moe
    assert moe is not None
    E, K = moe.n_experts, moe.top_k
    total = x_BTD.new_zeros((), dtype=router_dtype(x_BTD.dtype))
    for x_TD in x_BTD:
        w_TE = router_ref(x_TD, weights["router.weight"], moe, weights.get("router.score_bias"))
        logits_TE = x_TD.to(total.dtype) @ weights["router.weight"].to(total.dtype).T
        s_TE = torch.softmax(logits_TE, -1) if moe.score_func == "softmax" else \
            torch.sigmoid(logits_TE)
        T = x_TD.shape[0]
        f_E = (w_TE > 0).to(total.dtype).sum(0) * E / (K * T)
        P_E = (s_TE / s_TE.sum(-1, keepdim=True)).mean(0)
        total = total + (f_E * P_E).sum()
    return moe.seq_aux_loss_coeff * total / x_BTD.shape[0]


KIND = LayerKind("E", "MoE", MoE, "moe", MoEConfig, validate_moe, always=True)
"""``E``: the mixture of experts."""
