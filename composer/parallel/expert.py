"""Expert parallel (EP): each rank of a 1-D ``ep`` mesh holds ``E / ep`` of an MoE's experts.

Applied from outside the block: the MoE's plan names its expert group (``experts``) and its token
sums; :func:`apply_ep` shards the group's weights and sets in their places on the MoE an
:class:`ExpertParallelExperts` (holding the group's Parameter objects: the same keys; the
group's own computation behind an all-to-all there and back) and a :class:`GlobalSum` for the
statistics. The MoE's forward is unchanged, and nothing is written onto the MoE's modules.

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

Capacity dropping happens before the dispatch (in ``MoE.forward``, on this rank's tokens): the
dropped rows come last and never leave the rank. ``chunks = 2`` (``--ep-overlap``) overlaps the
dispatch with the experts' computation (:class:`ExpertParallelExperts`). After each optimizer
step :func:`finish_moe_step` sums every layer's expert loads over the data-parallel ranks and
moves the balancing biases (aux-loss-free balancing).

Shape legend (as in ``moe.py``): A routed rows this rank sends, R rows it receives, D d_model,
E experts, P ep ranks, L = E / P local experts.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.func import functional_call

from composer.blocks.plan import TokenSum
from composer.blocks.protocol import declared, plan_of
from composer.parallel.comm import AllReduceSum, ScaleGrad
from composer.parallel.mesh import ParallelDims
from composer.parallel.tensor import count_once, distribute_param, replace_submodule


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

    def __init__(self, group: dist.ProcessGroup | None = None, grad_scale: float = 1.0) -> None:
        super().__init__()
        self.group = group
        self.grad_scale = grad_scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.grad_scale != 1.0:
            x = ScaleGrad.apply(x, self.grad_scale)
        if self.group is not None:
            x = AllReduceSum.apply(x, self.group)
        return x


def make_global(moe: nn.Module, name: str, group: dist.ProcessGroup | None = None,
                grad_scale: float | None = None) -> None:
    """Set a :class:`GlobalSum` in place of ``moe``'s :class:`TokenSum` ``name``; over a
    :class:`GlobalSum` already there, a new one keeping what is not given (a group, a scale)."""
    old = moe.get_submodule(name)
    if isinstance(old, GlobalSum):
        group = old.group if group is None else group
        grad_scale = old.grad_scale if grad_scale is None else grad_scale
    elif not isinstance(old, TokenSum):
        raise TypeError(f"{type(moe).__name__}.{name} is a {type(old).__name__}, not a TokenSum")
    replace_submodule(moe, name, GlobalSum(group, 1.0 if grad_scale is None else grad_scale))


class ExpertParallel:
    """The ep group of one expert module: its mesh, group, local expert count, and into how
    many chunks a forward splits its rows to overlap dispatch with compute (1: none)."""

    def __init__(self, ep_mesh: DeviceMesh, n_experts: int, chunks: int = 1) -> None:
        if ep_mesh.ndim != 1:
            raise ValueError(f"apply_ep needs a 1-D ep mesh, got {ep_mesh.ndim} dimensions")
        if chunks < 1:
            raise ValueError(f"chunks must be >= 1, got {chunks}")
        self.mesh = ep_mesh
        self.group = ep_mesh.get_group()
        self.size = ep_mesh.size()
        if n_experts % self.size:
            raise ValueError(f"moe.n_experts ({n_experts}) is not divisible by ep ({self.size})")
        self.n_local = n_experts // self.size
        self.chunks = chunks


class ExpertParallelExperts(nn.Module):
    """In place of an expert group: the rows (sorted by global expert, ``n_tokens_E`` per
    expert) go to the ranks holding their experts, are computed there by the group's own
    forward on the local experts, and come back in the same order.

    It holds the group's Parameter objects as its own (so the keys, ``experts.<name>``, their
    placements and FSDP's view of them are those of the group) and the group itself outside the
    module tree, for its computation only: :func:`torch.func.functional_call` runs it on this
    module's current parameters (their local shards), whatever FSDP or ``to_empty`` made them.

    With ``ep.chunks = C > 1`` (all-to-all / compute overlap) each expert's rows are cut into
    C consecutive parts, chunk c holding rows ``floor(c n / C) .. floor((c + 1) n / C)`` of an
    expert with n rows; every chunk's dispatch is issued first (asynchronous collectives), then
    chunk c is computed while the later ones are in flight, and its combine is issued before
    chunk c + 1 is computed. Same rows, same experts: the same result up to the summation order
    of the weight gradients.

    The ep group's ranks must call every forward (and, when they train, every backward) of this
    module together, since both hold collectives, even when a rank has no token for another.
    """

    def __init__(self, experts: nn.Module, ep: ExpertParallel) -> None:
        super().__init__()
        nested = [n for n, _ in experts.named_parameters() if "." in n]
        if nested:
            raise TypeError(f"{type(experts).__name__} holds parameters in submodules "
                            f"({nested[0]}): expert parallel needs them on the group itself")
        for name, p in experts.named_parameters(recurse=False):
            self.register_parameter(name, p)
        self.ep = ep
        # outside the module tree (a tuple is no submodule): its keys would double ours
        self.body = (experts,)
        self.train(experts.training)

    def forward(self, x_AD: torch.Tensor, n_tokens_E: torch.Tensor) -> torch.Tensor:
        ep = self.ep
        P, L, C = ep.size, ep.n_local, ep.chunks
        steps_C1 = torch.arange(C + 1, device=n_tokens_E.device)[:, None]
        bounds_CE = n_tokens_E[None] * steps_C1 // C
        send_PCL = (bounds_CE[1:] - bounds_CE[:-1]).view(C, P, L).transpose(0, 1).contiguous()
        recv_PCL = torch.empty_like(send_PCL)
        dist.all_to_all_single(recv_PCL.view(-1), send_PCL.view(-1), group=ep.group)
        # One host sync for all split sizes: the collectives and the expert loop need ints.
        send_counts_PCL, recv_counts_PCL = torch.stack([send_PCL, recv_PCL]).cpu().unbind(0)
        n_sent = int(send_counts_PCL.sum())
        n_pad = x_AD.shape[0] - n_sent  # dropped assignments (capacity) stay here
        x_AD = x_AD[:n_sent]
        perm_A = self._chunk_order(n_tokens_E, n_sent) if C > 1 else None
        if perm_A is not None:
            x_AD = x_AD[perm_A]
        send_CP = send_counts_PCL.sum(2).T.tolist()
        recv_CP = recv_counts_PCL.sum(2).T.tolist()
        x_parts = x_AD.contiguous().split([sum(sizes) for sizes in send_CP])
        x_RDs = [funcol.all_to_all_single_autograd(x_c, recv_CP[c], send_CP[c], ep.group)
                 for c, x_c in enumerate(x_parts)]  # all dispatches in flight
        y_parts = []
        for c, x_RD in enumerate(x_RDs):
            y_RD = self._compute(x_RD, recv_counts_PCL[:, c])
            y_parts.append(funcol.all_to_all_single_autograd(y_RD, send_CP[c], recv_CP[c],
                                                             ep.group))
        y_AD = torch.cat(y_parts) if C > 1 else y_parts[0]
        if perm_A is not None:
            y_AD = torch.empty_like(y_AD).index_copy(0, perm_A, y_AD)
        if n_pad:
            y_AD = torch.cat([y_AD, y_AD.new_zeros(n_pad, y_AD.shape[1])])
        return y_AD

    def _chunk_order(self, n_tokens_E: torch.Tensor, n_sent: int) -> torch.Tensor:
        """The row order that puts chunk 0's rows first, then chunk 1's, ..., each chunk still
        sorted by expert: row ``pos`` of an expert with ``n`` rows is in chunk
        ``ceil((pos + 1) C / n) - 1``."""
        C, E = self.ep.chunks, n_tokens_E.shape[0]
        expert_A = torch.repeat_interleave(torch.arange(E, device=n_tokens_E.device), n_tokens_E,
                                           output_size=n_sent)
        start_E = torch.cumsum(n_tokens_E, 0) - n_tokens_E
        pos_A = torch.arange(n_sent, device=n_tokens_E.device) - start_E[expert_A]
        chunk_A = ((pos_A + 1) * C - 1) // n_tokens_E[expert_A]
        return torch.argsort(chunk_A, stable=True)

    def _compute(self, x_RD: torch.Tensor, recv_counts_PL: torch.Tensor) -> torch.Tensor:
        """The local experts on arrived rows, which come grouped by (source rank, local
        expert): regrouped by expert for the computation, then put back."""
        P, L = recv_counts_PL.shape
        local_R = torch.arange(L).repeat(P).repeat_interleave(recv_counts_PL.flatten())
        order_R = torch.argsort(local_R, stable=True).to(x_RD.device)
        y_sorted_RD = self._local_experts(x_RD[order_R], recv_counts_PL.sum(0))
        return torch.empty_like(y_sorted_RD).index_copy(0, order_R, y_sorted_RD)

    def _local_experts(self, x_AD: torch.Tensor, n_tokens_E: torch.Tensor) -> torch.Tensor:
        """The group's forward on this rank's experts: its weights' local shards (``to_local``
        keeps the gradients flowing to the DTensors), or what a forward pre-hook shadowed them
        with for this forward (LoRA's adapted weights, ``composer/lora.py``)."""
        local = {}
        for name, _ in self.named_parameters(recurse=False):
            p = getattr(self, name)  # a shadow in __dict__ wins over the parameter
            local[name] = p.to_local() if isinstance(p, DTensor) else p
        return functional_call(self.body[0], local, (x_AD, n_tokens_E))


def apply_ep(moe: nn.Module, ep_mesh: DeviceMesh, ep_tp_mesh: DeviceMesh | None = None,
             chunks: int = 1) -> None:
    """Shard the expert group of ``moe`` (its plan's ``experts``) over the 1-D ``ep_mesh`` and
    route through all-to-all; its token sums become sums over the ep group. ``chunks > 1``
    overlaps the dispatch of later chunks with the computation of earlier ones.

    With ``ep_tp_mesh`` (the 2-D ``("ep", "tp")`` mesh) each expert's hidden units are also split
    over tp (expert-tensor parallel), ``[Shard(0), Shard(hidden dim)]``; the plan's
    ``expert_partial`` (the down bias) ``[Shard(0), Replicate()]``, counted once over tp
    (:func:`~composer.parallel.tensor.count_once`; ``apply_tp`` recorded its gradient kind).

    Each rank keeps its own chunk of its own weights (no communication): on the meta device
    before initialisation, or with the same full weights on every rank. Call it once per MoE.
    """
    plan = plan_of(moe)
    if plan is None or plan.experts is None:
        raise ValueError(f"{type(moe).__name__} declares no expert group (parallel_plan)")
    experts = moe.get_submodule(plan.experts)
    if isinstance(experts, ExpertParallelExperts):
        raise ValueError("apply_ep was already applied to this MoE")
    n_experts = next(iter(experts.parameters())).shape[0]
    wrapper = ExpertParallelExperts(experts, ExpertParallel(ep_mesh, n_experts, chunks))
    # placed on the wrapper: the group itself keeps its parameters as they were
    for name, _ in list(wrapper.named_parameters(recurse=False)):
        if ep_tp_mesh is None:
            distribute_param(wrapper, name, ep_mesh, [Shard(0)])
        elif name in plan.expert_partial:  # replicated over tp, counted once (below)
            distribute_param(wrapper, name, ep_tp_mesh, [Shard(0), Replicate()])
        else:  # with tensor parallel too: experts over ep, each expert's hidden units over tp
            hidden = plan.expert_hidden[name]
            distribute_param(wrapper, name, ep_tp_mesh, [Shard(0), Shard(hidden)])
    if ep_tp_mesh is not None:
        once = [name for name in plan.expert_partial if name in wrapper._parameters]
        count_once(wrapper, once, ep_tp_mesh.get_local_rank("tp"))
    replace_submodule(moe, plan.experts, wrapper)
    for name in plan.token_sums:
        make_global(moe, name, group=ep_mesh.get_group())


def finish_moe_step(model: nn.Module, dims: ParallelDims | None = None,
                    stepped: bool = True) -> None:
    """After each optimizer step (``stepped``; a skipped step changes nothing): aux-loss-free
    balancing moves every balancing router's score bias by its layer's loads over the global
    batch (``Router.update_bias``), and every MoE forgets its per-step statistics.

    The loads of all layers go in one all-reduce over the ranks that split the batch: data
    parallel (ep lies inside dp) and context parallel (``dp x cp``); tensor-parallel ranks route
    the same tokens (gathered over the sequence) and count them whole, and pipeline ranks hold
    other layers, so neither joins."""
    routers = [m for m in model.modules() if declared(m, "balancing", False)]
    for module in model.modules():
        end_step = declared(module, "end_step")
        if end_step is not None:
            end_step()
    loads = [router.take_load() for router in routers]
    if not stepped or not loads:
        return
    flat = torch.cat(loads)
    if dims is not None and dims.grad_replicas > 1:
        dist.all_reduce(flat, group=dims.fsdp_mesh.get_group())
    for router, load_E in zip(routers, flat.split([x.numel() for x in loads]), strict=True):
        router.update_bias(load_E)
