"""Expert parallel (EP): each rank of a 1-D ``ep`` mesh holds ``E / ep`` of an MoE's experts.

Layout (GShard, Lepikhin et al. 2020; as Megatron-Core and torchtitan): the routed-expert weights
``experts.{gate_proj, up_proj, down_proj}`` become DTensors with ``Shard(0)`` on the ep mesh, so
expert ``e`` lives on ep rank ``e // (E / ep)`` while the global shape stays ``[E, ...]`` (a DCP
checkpoint taken at one ep size loads at any other). The router and the shared experts stay
replicated. Each rank routes its own tokens, then:

1. counts:  ``send_PL[p, l]`` = rows for local expert ``l`` of rank ``p`` (the routed rows are
   already sorted by global expert, so each destination rank's rows are one contiguous block);
   one all-to-all of these ``E`` counts gives ``recv_PL[p, l]``, the rows rank ``p`` sends to our
   local expert ``l``;
2. dispatch: a differentiable all-to-all of the rows with uneven splits ``send_PL.sum(1)`` /
   ``recv_PL.sum(1)``; rows arrive grouped by source rank, then by local expert;
3. compute: regroup the rows by local expert (a stable sort, remembered) and run ``Experts``;
4. combine: undo the regrouping and all-to-all the outputs back with the splits swapped; they
   return in the order they left, and ``MoE.forward`` weights and sums them as without EP.

Load-balancing loss under EP: the per-expert counts, the summed router probabilities and the token
counts are all-reduced over the ep group (differentiably, for ``P``), so every rank's
``aux_loss`` equals the single-process loss of the group's concatenated tokens:
``coeff * E * sum_e (count_e / N) * (sum_n p_ne / N)`` with ``N`` the group's token count. Its
backward all-reduces the gradient of ``sum_n p_ne``: when every rank adds ``aux_loss`` to its
loss and data parallel averages over the ep ranks, the router receives exactly ``d aux`` (with
``dp_outer > 1``, the mean over ep groups of each group's ``d aux``). When ranks instead sum
gradients of losses that add up to the global one, each rank adds ``aux_loss / ep``.

Gradient scaling, for whoever wires data parallel (see :func:`expert_grad_scale`).

Shape legend (as in ``moe.py``): A routed rows this rank sends, R rows it receives, D d_model,
E experts, P ep ranks, L = E / P local experts.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from composer.blocks.moe import Experts, MoE

EXPERT_WEIGHTS = ("gate_proj", "up_proj", "down_proj")


def expert_grad_scale(ep: int) -> float:
    """Factor for routed-expert gradients when each rank's loss is the mean over its own tokens.

    An expert on ep rank ``r`` computes rows from every rank of its ep group, so after backward
    its gradient is ``sum over the group's ranks q of d loss_q``. Non-expert weights are averaged
    over all ``dp = dp_outer * ep`` ranks, which gives ``d mean_q loss_q``; an expert is
    replicated over ``dp_outer`` ranks only, so averaging it there gives ``ep`` times that. Scale
    expert gradients by ``1 / ep``, i.e. divide them by ``dp`` rather than ``dp_outer`` (with
    FSDP2: ``experts.set_gradient_divide_factor(dp)``, as torchtitan does). Not needed when the
    loss is already normalised by the global token count and gradients are summed.
    """
    if ep < 1:
        raise ValueError(f"ep must be >= 1, got {ep}")
    return 1.0 / ep


class _AllReduceSum(torch.autograd.Function):
    """Sum over a group; the backward sums the gradients too (every rank's loss uses the sum)."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor,
                group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group  # type: ignore[attr-defined]
        y = x.clone()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx,
                 grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)  # type: ignore[attr-defined]
        return grad, None


class ExpertParallel:
    """What ``MoE.forward`` consults once :func:`apply_ep` has sharded its experts.

    A plain object, not a module: it adds no state-dict keys. The ep group's ranks must call
    every forward (and, when they train, every backward) of this MoE together, since both hold
    collectives, even when a rank has no token for another.
    """

    def __init__(self, ep_mesh: DeviceMesh, n_experts: int) -> None:
        if ep_mesh.ndim != 1:
            raise ValueError(f"apply_ep needs a 1-D ep mesh, got {ep_mesh.ndim} dimensions")
        self.mesh = ep_mesh
        self.group = ep_mesh.get_group()
        self.size = ep_mesh.size()
        if n_experts % self.size:
            raise ValueError(f"moe.n_experts ({n_experts}) is not divisible by ep ({self.size})")
        self.n_local = n_experts // self.size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Differentiable sum over the ep group (the load-balancing statistics)."""
        if self.size == 1:
            return x
        return _AllReduceSum.apply(x, self.group)

    def run_experts(self, experts: Experts, x_AD: torch.Tensor,
                    n_tokens_E: torch.Tensor) -> torch.Tensor:
        """Outputs for the rows ``x_AD`` (sorted by global expert, ``n_tokens_E`` per expert),
        computed on the ranks that hold their experts and returned in the same row order."""
        P, L = self.size, self.n_local
        send_PL = n_tokens_E.reshape(P, L).contiguous()
        recv_PL = torch.empty_like(send_PL)
        dist.all_to_all_single(recv_PL.view(-1), send_PL.view(-1), group=self.group)
        # One host sync for all split sizes: the collectives and the expert loop need ints.
        send_counts_PL, recv_counts_PL = torch.stack([send_PL, recv_PL]).cpu().unbind(0)
        send_P, recv_P = send_counts_PL.sum(1).tolist(), recv_counts_PL.sum(1).tolist()
        x_RD = funcol.all_to_all_single_autograd(x_AD.contiguous(), recv_P, send_P, self.group)

        # Arrived rows are grouped by (source rank, local expert); Experts wants them by expert.
        local_R = torch.arange(L).repeat(P).repeat_interleave(recv_counts_PL.flatten())
        order_R = torch.argsort(local_R, stable=True).to(x_AD.device)
        y_sorted_RD = experts(x_RD[order_R], recv_counts_PL.sum(0).tolist())
        y_RD = torch.empty_like(y_sorted_RD).index_copy(0, order_R, y_sorted_RD)
        return funcol.all_to_all_single_autograd(y_RD, send_P, recv_P, self.group)


def apply_ep(moe: MoE, ep_mesh: DeviceMesh, ep_tp_mesh: DeviceMesh | None = None) -> None:
    """Shard ``moe``'s routed experts over the 1-D ``ep_mesh`` and route through all-to-all.

    With ``ep_tp_mesh`` (the 2-D ``("ep", "tp")`` mesh) each expert's hidden units are also split
    over tp (expert-tensor parallel), ``[Shard(0), Shard(hidden dim)]``.

    Expert weights become ``Shard(0)`` DTensors made from each rank's full tensor; with the default
    ``src_data_rank`` the values of the mesh's first rank win, so build the model with the same
    seed everywhere (or load a checkpoint afterwards). Call it once per MoE.
    """
    if moe.ep is not None:
        raise ValueError("apply_ep was already applied to this MoE")
    ep = ExpertParallel(ep_mesh, moe.moe.n_experts)
    for name in EXPERT_WEIGHTS:
        w = getattr(moe.experts, name, None)
        if w is None:  # gate_proj exists only for gated activations
            continue
        if ep_tp_mesh is None:
            dt = distribute_tensor(w.detach(), ep_mesh, [Shard(0)])
        else:  # with tensor parallel too: experts over ep, each expert's hidden units over tp
            hidden = 2 if name == "down_proj" else 1
            dt = distribute_tensor(w.detach(), ep_tp_mesh, [Shard(0), Shard(hidden)])
        setattr(moe.experts, name, nn.Parameter(dt, requires_grad=w.requires_grad))
    moe.ep = ep


def sum_over(group: dist.ProcessGroup) -> Callable[[torch.Tensor], torch.Tensor]:
    """A differentiable sum over ``group`` (for the load-balancing statistics over dp)."""
    return lambda x: _AllReduceSum.apply(x, group)
