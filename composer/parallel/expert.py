"""Expert parallel (EP): each rank of a 1-D ``ep`` mesh holds ``E / ep`` of an MoE's experts.

Applied from outside the block: the MoE's plan names its expert group (``experts``) and its token
sums; :func:`apply_ep` shards the group's weights and swaps in :class:`ExpertParallelExperts`
(the same computation behind an all-to-all there and back) and a :class:`GlobalSum` for the
statistics. The MoE's forward is unchanged.

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

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard

from composer.blocks.plan import TokenSum
from composer.parallel.comm import AllReduceSum, ScaleGrad
from composer.parallel.mesh import ParallelDims
from composer.parallel.tensor import distribute_param, install_local_views


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


class GlobalSum(TokenSum):
    """A :class:`TokenSum` that sums over ``group`` (differentiably: its backward sums the
    gradients too), after scaling the gradient by ``grad_scale`` (``1 / tp``: every tp rank
    computes the same statistics while the weights behind them sum their gradients over tp)."""

    group: dist.ProcessGroup | None = None
    grad_scale: float = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.grad_scale != 1.0:
            x = ScaleGrad.apply(x, self.grad_scale)
        if self.group is not None:
            x = AllReduceSum.apply(x, self.group)
        return x


def make_global(token_sum: nn.Module, group: dist.ProcessGroup | None = None,
                grad_scale: float | None = None) -> None:
    """Turn a :class:`TokenSum` into a :class:`GlobalSum` (or update one)."""
    token_sum.__class__ = GlobalSum
    if group is not None:
        token_sum.group = group
    if grad_scale is not None:
        token_sum.grad_scale = grad_scale


class ExpertParallel:
    """The ep group of one expert module: its mesh, group and local expert count."""

    def __init__(self, ep_mesh: DeviceMesh, n_experts: int) -> None:
        if ep_mesh.ndim != 1:
            raise ValueError(f"apply_ep needs a 1-D ep mesh, got {ep_mesh.ndim} dimensions")
        self.mesh = ep_mesh
        self.group = ep_mesh.get_group()
        self.size = ep_mesh.size()
        if n_experts % self.size:
            raise ValueError(f"moe.n_experts ({n_experts}) is not divisible by ep ({self.size})")
        self.n_local = n_experts // self.size


class ExpertParallelExperts(nn.Module):
    """Mixed in front of an experts class: the rows (sorted by global expert, ``n_tokens_E``
    per expert) go to the ranks holding their experts, are computed there by the original
    class's forward on the local experts, and come back in the same order.

    The ep group's ranks must call every forward (and, when they train, every backward) of this
    module together, since both hold collectives, even when a rank has no token for another.
    """

    ep: ExpertParallel

    def forward(self, x_AD: torch.Tensor, n_tokens_E: torch.Tensor) -> torch.Tensor:
        ep = self.ep
        P, L = ep.size, ep.n_local
        send_PL = n_tokens_E.reshape(P, L).contiguous()
        recv_PL = torch.empty_like(send_PL)
        dist.all_to_all_single(recv_PL.view(-1), send_PL.view(-1), group=ep.group)
        # One host sync for all split sizes: the collectives and the expert loop need ints.
        send_counts_PL, recv_counts_PL = torch.stack([send_PL, recv_PL]).cpu().unbind(0)
        send_P, recv_P = send_counts_PL.sum(1).tolist(), recv_counts_PL.sum(1).tolist()
        n_pad = x_AD.shape[0] - sum(send_P)  # dropped assignments (capacity) stay here
        if n_pad:
            x_AD = x_AD[:sum(send_P)]
        x_RD = funcol.all_to_all_single_autograd(x_AD.contiguous(), recv_P, send_P, ep.group)

        # Arrived rows are grouped by (source rank, local expert); the experts want them by
        # expert.
        local_R = torch.arange(L).repeat(P).repeat_interleave(recv_counts_PL.flatten())
        order_R = torch.argsort(local_R, stable=True).to(x_AD.device)
        y_sorted_RD = super().forward(x_RD[order_R], recv_counts_PL.sum(0))
        y_RD = torch.empty_like(y_sorted_RD).index_copy(0, order_R, y_sorted_RD)
        y_AD = funcol.all_to_all_single_autograd(y_RD, send_P, recv_P, ep.group)
        if n_pad:
            y_AD = torch.cat([y_AD, y_AD.new_zeros(n_pad, y_AD.shape[1])])
        return y_AD


_EP_CLASSES: dict[type, type] = {}


def _ep_class(cls: type) -> type:
    if cls not in _EP_CLASSES:
        _EP_CLASSES[cls] = type(f"ExpertParallel{cls.__name__}", (ExpertParallelExperts, cls), {})
    return _EP_CLASSES[cls]


def apply_ep(moe: nn.Module, ep_mesh: DeviceMesh, ep_tp_mesh: DeviceMesh | None = None) -> None:
    """Shard the expert group of ``moe`` (its plan's ``experts``) over the 1-D ``ep_mesh`` and
    route through all-to-all; its token sums become sums over the ep group.

    With ``ep_tp_mesh`` (the 2-D ``("ep", "tp")`` mesh) each expert's hidden units are also split
    over tp (expert-tensor parallel), ``[Shard(0), Shard(hidden dim)]``.

    Each rank keeps its own chunk of its own weights (no communication): on the meta device
    before initialisation, or with the same full weights on every rank. Call it once per MoE.
    """
    plan = moe.parallel_plan()
    experts = moe.get_submodule(plan.experts)
    if isinstance(experts, ExpertParallelExperts):
        raise ValueError("apply_ep was already applied to this MoE")
    n_experts = next(iter(experts.parameters())).shape[0]
    for name, _ in list(experts.named_parameters(recurse=False)):
        if ep_tp_mesh is None:
            distribute_param(experts, name, ep_mesh, [Shard(0)])
        else:  # with tensor parallel too: experts over ep, each expert's hidden units over tp
            hidden = plan.expert_hidden[name]
            distribute_param(experts, name, ep_tp_mesh, [Shard(0), Shard(hidden)])
    experts.__class__ = _ep_class(type(experts))
    experts.ep = ExpertParallel(ep_mesh, n_experts)
    install_local_views(experts)
    for name in plan.token_sums:
        make_global(moe.get_submodule(name), group=ep_mesh.get_group())


def finish_moe_step(model: nn.Module, dims: ParallelDims | None = None,
                    stepped: bool = True) -> None:
    """After each optimizer step (``stepped``; a skipped step changes nothing): aux-loss-free
    balancing moves every balancing router's score bias by its layer's loads over the global
    batch (``Router.update_bias``), and every MoE forgets its per-step statistics.

    The loads of all layers go in one all-reduce over the data-parallel ranks, which split the
    batch (ep lies inside dp); tensor-parallel ranks route the same tokens (gathered over the
    sequence) and count them whole, and pipeline ranks hold other layers, so neither joins."""
    routers = [m for m in model.modules() if getattr(m, "balancing", False)]
    for module in model.modules():
        if hasattr(module, "end_step"):
            module.end_step()
    loads = [router.take_load() for router in routers]
    if not stepped or not loads:
        return
    flat = torch.cat(loads)
    if dims is not None and dims.dp > 1:
        dist.all_reduce(flat, group=dims.dp_mesh.get_group())
    for router, load_E in zip(routers, flat.split([x.numel() for x in loads]), strict=True):
        router.update_bias(load_E)
