"""The routed experts of an MoE (:mod:`composer.blocks.moe`): fused 3-D weights, one expert per
slice of rows sorted by expert.

Expert e on a row x (weights ``[out, in]``; biases only with ``moe.expert_bias``):

    gated:  h = glu(x G_e^T + g_e,  x U_e^T + u_e),   y = h D_e^T + d_e
    plain:  h = act(x U_e^T + u_e),                   y = h D_e^T + d_e

with ``glu(g, u) = act(g) * u``, or gpt-oss's clamped SwiGLU when ``moe.swiglu_limit`` is set
(``L`` the limit, ``a`` = ``moe.swiglu_alpha``; transformers' ``GptOssExperts._apply_gate``):

    g' = min(g, L),   u' = clamp(u, -L, L),   glu = (u' + 1) * g' * sigmoid(a g')

Each hidden unit is computed on its own, so expert-tensor parallel splits them over ``tp``
(``F`` of ``G_e``, ``U_e``, ``g_e``, ``u_e`` and the columns of ``D_e``): each rank's ``y`` is
then a partial sum over its hidden units, which the parallel layer reduces. The down bias
``d_e`` is no sum over hidden units, so it must count once: the MoE's plan names it
(``ParallelPlan.expert_partial``) and ``composer/parallel/`` (``count_once``) makes it read as
zeros on every tp rank but rank 0 for each forward, as a row-parallel linear adds its bias once.
Why that form: the forward stays this single-device code with no switch to read (the zeros come
from a pre-hook, next to the local views of the shards), it is exact for any ``tp`` (one rank
adds ``d_e``, nothing is divided by ``tp``), and its gradient is zero off rank 0, so the ``tp``
sum of the partial gradients gives every rank the single-process gradient of ``d_e``.

Computation: rows sorted by expert, then one grouped GEMM per projection on CUDA in bf16
(``torch._grouped_mm``, no host synchronisation; other CUDA dtypes loop). On the CPU, training
forwards loop over the experts' slices (``bench/moe.py``: nothing measured beats the loop
forward + backward, and ``torch._grouped_mm`` has no CPU backward in torch 2.13); forwards
without gradients (evaluation, generation) take ``torch._grouped_mm``, 10-27% faster there.

Shape legend: D d_model, E experts, F expert hidden width, A token-expert assignments (rows).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from composer.blocks.mlp import ACTIVATIONS, activation_ref, is_gated
from composer.kernels import probe


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float,
                   limit: float) -> torch.Tensor:
    """gpt-oss's gated unit (module docstring)."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(alpha * gate))


def clamped_swiglu_ref(gate: torch.Tensor, up: torch.Tensor, alpha: float,
                       limit: float) -> torch.Tensor:
    """Plain-math twin of :func:`clamped_swiglu`."""
    gate = torch.where(gate > limit, torch.full_like(gate, limit), gate)
    up = torch.where(up > limit, torch.full_like(up, limit), up)
    up = torch.where(up < -limit, torch.full_like(up, -limit), up)
    return (up + 1) * gate / (1 + torch.exp(-alpha * gate))


def grouped_mm_dtype(x_AD: torch.Tensor, w_EFD: torch.Tensor) -> torch.dtype | None:
    """The dtype to run ``torch._grouped_mm`` in, or None for the loop. On CUDA: bf16 (the
    dtype its fast kernels and torchtitan use), the input's or autocast's; other CUDA dtypes
    loop. On the CPU: fp32/bf16 when no gradient is needed (its CPU kernel has no backward in
    torch 2.13; forward it beats the loop, ``bench/moe.py``). Rows must be a multiple of 16
    bytes (its alignment). Chosen per call, never at import."""
    if not hasattr(torch, "_grouped_mm"):
        return None
    dtype = x_AD.dtype
    if probe.on_gpu(x_AD):
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
    """Fused weights ``experts.{gate_proj,up_proj} [E, F, D]`` and ``experts.down_proj [E, D, F]``;
    with ``bias``, ``experts.{gate_proj,up_proj}_bias [E, F]`` and ``experts.down_proj_bias
    [E, D]``.

    ``forward`` takes token rows already sorted by expert, so that expert parallelism can put
    an all-to-all dispatch in front of the same computation.
    """

    def __init__(self, n_experts: int, d_model: int, d_ff: int, activation: str,
                 bias: bool = False, swiglu_limit: float | None = None,
                 swiglu_alpha: float = 1.702) -> None:
        super().__init__()
        self.gated = is_gated(activation)
        self.act = ACTIVATIONS[activation]
        self.swiglu_limit, self.swiglu_alpha = swiglu_limit, swiglu_alpha
        if self.gated:
            self.gate_proj = nn.Parameter(torch.empty(n_experts, d_ff, d_model))
        self.up_proj = nn.Parameter(torch.empty(n_experts, d_ff, d_model))
        self.down_proj = nn.Parameter(torch.empty(n_experts, d_model, d_ff))
        if bias:
            if self.gated:
                self.gate_proj_bias = nn.Parameter(torch.empty(n_experts, d_ff))
            self.up_proj_bias = nn.Parameter(torch.empty(n_experts, d_ff))
            self.down_proj_bias = nn.Parameter(torch.empty(n_experts, d_model))
        self.bias = bias

    def _hidden(self, gate_AF: torch.Tensor | None, up_AF: torch.Tensor) -> torch.Tensor:
        if gate_AF is None:
            return self.act(up_AF)
        if self.swiglu_limit is not None:
            return clamped_swiglu(gate_AF, up_AF, self.swiglu_alpha, self.swiglu_limit)
        return self.act(gate_AF) * up_AF

    def _biases(self) -> tuple[torch.Tensor | None, ...]:
        if not self.bias:
            return None, None, None
        return (self.gate_proj_bias if self.gated else None, self.up_proj_bias,
                self.down_proj_bias)

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
        row_A = torch.arange(A, device=x_AD.device)
        valid_A1 = (row_A < ends_E[-1])[:, None]
        offs_E = torch.cat([ends_E[:-1], ends_E.new_full((1,), A)]).to(torch.int32)
        x_AD = torch.where(valid_A1, x_AD, 0)  # its backward zeroes the padding rows' grads
        # each row's expert, for the biases (padding rows: the last expert, zeroed below)
        expert_A = torch.searchsorted(ends_E, row_A, right=True).clamp(max=len(ends_E) - 1)

        def mm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
            y = torch._grouped_mm(x, w.to(x.dtype).transpose(-2, -1), offs=offs_E)
            return y if b is None else y + b.to(x.dtype)[expert_A]

        gate_b, up_b, down_b = self._biases()
        gate_AF = mm(x_AD, self.gate_proj, gate_b) if self.gated else None
        h_AF = self._hidden(gate_AF, mm(x_AD, self.up_proj, up_b))
        return torch.where(valid_A1, mm(h_AF, self.down_proj, down_b), 0)

    def _loop(self, x_AD: torch.Tensor, n_tokens_E: torch.Tensor) -> torch.Tensor:
        """A loop over the experts (never over tokens), skipping empty ones; one host sync for
        the split sizes."""
        gate = self.gate_proj if self.gated else None
        up, down = self.up_proj, self.down_proj
        params = [gate, up, down, *self._biases()]
        # unbind/split once: indexing w[e] per expert makes the backward zero-fill a whole-weight
        # gradient per expert.
        gates, ups, downs, gate_bs, up_bs, down_bs = (
            p.unbind(0) if p is not None else None for p in params)
        sizes = n_tokens_E.tolist()
        n_pad = x_AD.shape[0] - sum(sizes)
        y_AD = []
        for e, x_nD in enumerate(x_AD.split([*sizes, n_pad], dim=0)[:-1]):
            if x_nD.shape[0] == 0:
                continue
            gate_nF = F.linear(x_nD, gates[e], gate_bs and gate_bs[e]) if gates else None
            h_nF = self._hidden(gate_nF, F.linear(x_nD, ups[e], up_bs and up_bs[e]))
            y_AD.append(F.linear(h_nF, downs[e], down_bs and down_bs[e]))
        if not y_AD:
            # No rows (an EP rank may receive none): stay in the graph of x and the weights, so
            # that this rank joins the backward all-to-all like the others and its experts get
            # zero gradients rather than none.
            anchor = sum(w.sum() for w in params if w is not None)
            return x_AD * 0 + anchor * 0
        if n_pad:
            y_AD.append(x_AD.new_zeros(n_pad, x_AD.shape[1]))
        return torch.cat(y_AD)


def expert_ref(x_ND: torch.Tensor, weights: dict[str, torch.Tensor], e: int, activation: str,
               swiglu_limit: float | None = None, swiglu_alpha: float = 1.702) -> torch.Tensor:
    """Plain-math twin of expert ``e`` on every row; ``weights`` uses the MoE's keys
    (``experts.*``), biases when present."""

    def proj(name: str, x: torch.Tensor) -> torch.Tensor:
        y = x @ weights[f"experts.{name}"][e].T
        bias = weights.get(f"experts.{name}_bias")
        return y if bias is None else y + bias[e]

    up = proj("up_proj", x_ND)
    if not is_gated(activation):
        h = activation_ref(activation, up)
    elif swiglu_limit is not None:
        h = clamped_swiglu_ref(proj("gate_proj", x_ND), up, swiglu_alpha, swiglu_limit)
    else:
        h = activation_ref(activation, proj("gate_proj", x_ND)) * up
    return proj("down_proj", h)
