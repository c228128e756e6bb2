"""Tensor and sequence parallelism (Megatron-LM, Shoeybi et al. 2019; Korthikanti et al. 2022),
applied from outside the blocks by reading the plans they declare (``composer/blocks/plan.py``).

Weights become DTensors on the ``tp`` mesh dimension so that FSDP2 composes with them and DCP sees
layout-independent global shapes; the blocks' math runs on the local shards (a forward hook puts
each module's local tensors in place of its DTensor parameters for the duration of its forward)
with explicit collectives around each mixer:

    residual stream   [B, T/tp, D] per rank (sequence parallel) or [B, T, D] replicated
    enter a mixer     all-gather over T (SP)        | identity, all-reduce of the grad (no SP)
    column parallel   local output features (heads, channels, experts' hidden units)
    row parallel      local input features -> partial sums
    leave a mixer     reduce-scatter over T (SP)    | all-reduce (no SP)

Module swaps that live here: row-parallel linears (bias added on one rank), head-selecting
linears (fewer kv heads than ranks), the sequence cut of multi-token prediction's keep mask
(:class:`SequenceChunkTP`); and from ``vocab.py`` the vocabulary-parallel embedding and
readout (head + loss, never gathering the logits for the loss). Replicated weights whose
per-rank gradients are partial sums (norms under SP, qk-norms, the router, replicated kv
projections, row-parallel biases) are recorded and summed over ``tp`` by
:func:`reduce_tp_grads`, in buckets.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from composer.blocks.plan import ParallelPlan, SequenceChunk
from composer.parallel.comm import all_gather, all_reduce_coalesced, reduce_scatter
from composer.parallel.vocab import VocabParallelEmbedding, VocabParallelReadout

PARTIAL = "partial"  # grads are partial sums on every forward
PARTIAL_IF_SP = "partial_if_sp"  # partial under sequence parallel, identical otherwise


@dataclass
class TPContext:
    mesh: DeviceMesh
    group: dist.ProcessGroup
    size: int
    rank: int
    sequence_parallel: bool
    last_sp: bool = False
    """Whether the latest forward ran sequence parallel (it needs T divisible by tp)."""
    experts_on_ep: bool = False
    """Expert parallelism will shard routed experts on the 2-D ep x tp mesh; leave them."""
    grad_kinds: dict[str, str] = field(default_factory=dict)
    """Parameter name -> PARTIAL / PARTIAL_IF_SP, for :func:`reduce_tp_grads`."""

    def sp_active(self, t: int) -> bool:
        return self.sequence_parallel and t % self.size == 0

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        return _Enter.apply(x, self, self.last_sp)

    def leave(self, y: torch.Tensor) -> torch.Tensor:
        return _Leave.apply(y, self, self.last_sp)


class _Enter(torch.autograd.Function):
    """Into a mixer: all-gather the sequence (SP) or pass through (no SP); backward reduces."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: TPContext, sp: bool) -> torch.Tensor:
        ctx.tp, ctx.sp = tp, sp
        return all_gather(x, 1, tp.group, tp.size) if sp else x

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        tp = ctx.tp
        if ctx.sp:
            return reduce_scatter(g, 1, tp.group, tp.size, tp.rank), None, None
        g = g.contiguous()
        dist.all_reduce(g, group=tp.group)
        return g, None, None


class _Leave(torch.autograd.Function):
    """Out of a mixer: reduce-scatter the partial sums over the sequence (SP) or all-reduce."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, tp: TPContext, sp: bool) -> torch.Tensor:
        ctx.tp, ctx.sp = tp, sp
        if sp:
            return reduce_scatter(y, 1, tp.group, tp.size, tp.rank)
        y = y.contiguous().clone()
        dist.all_reduce(y, group=tp.group)
        return y

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        tp = ctx.tp
        return (all_gather(g, 1, tp.group, tp.size) if ctx.sp else g), None, None


# ---------------------------------------------------------------- local views of DTensors


def _use_local(module: nn.Module, args: tuple) -> None:
    for name, p in module._parameters.items():
        if isinstance(p, DTensor):
            module.__dict__[name] = p.to_local()  # shadows the parameter for this forward


def _drop_local(module: nn.Module, args: tuple, out: object) -> None:
    for name in module._parameters:
        module.__dict__.pop(name, None)


def install_local_views(module: nn.Module) -> None:
    """During ``module``'s forward, its DTensor parameters read as their local shards (through
    ``to_local``, so gradients reach the DTensors). Once per module."""
    if getattr(module, "_composer_local_views", False):
        return
    module.register_forward_pre_hook(_use_local)
    module.register_forward_hook(_drop_local, always_call=True)
    module._composer_local_views = True


def install_all_local_views(root: nn.Module) -> None:
    for module in root.modules():
        if any(isinstance(p, DTensor) for p in module._parameters.values()):
            install_local_views(module)


# ---------------------------------------------------------------- placing parameters


def distribute_param(module: nn.Module, name: str, mesh: DeviceMesh, placements: list,
                     grad: str | None = None) -> None:
    """Replace ``module.<name>`` by a DTensor parameter with ``placements`` on ``mesh`` (on the
    meta device no memory is touched; each rank keeps its own chunk, no communication)."""
    p = getattr(module, name)
    if p is None or isinstance(p, DTensor):
        return
    new = nn.Parameter(distribute_tensor(p.data, mesh, placements, src_data_rank=None),
                       requires_grad=p.requires_grad)
    if grad is not None:
        new._tp_grad = grad  # type: ignore[attr-defined]
    module.register_parameter(name, new)


class RowParallelLinear(nn.Linear):
    """Input features split over ``tp``: weight ``Shard(1)``; the output is a partial sum, so the
    bias (replicated) is added on tp rank 0 only and reaches every rank through the reduction."""

    tp_rank: int = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        if self.bias is not None:
            y = y + (self.bias if self.tp_rank == 0 else 0.0 * self.bias)
        return y


class HeadSelectLinear(nn.Linear):
    """A replicated linear of which this rank computes only rows ``rows`` (its head)."""

    rows: tuple[int, int] = (0, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lo, hi = self.rows
        bias = self.bias[lo:hi] if self.bias is not None else None
        return F.linear(x, self.weight[lo:hi], bias)


def _swap(module: nn.Module, cls: type) -> None:
    if type(module) is not nn.Linear and not issubclass(cls, type(module)):
        raise TypeError(f"cannot make {type(module).__name__} a {cls.__name__}")
    module.__class__ = cls


def _params(module: nn.Module, pattern: str) -> list[tuple[nn.Module, str]]:
    out = []
    for name, _ in module.named_parameters():
        if fnmatch.fnmatchcase(name, pattern):
            prefix, _, leaf = name.rpartition(".")
            out.append((module.get_submodule(prefix) if prefix else module, leaf))
    return out


def apply_plan(module: nn.Module, plan: ParallelPlan, tp: TPContext) -> None:
    """Place ``module``'s parameters as its plan says (names relative to ``module``)."""
    mesh = tp.mesh
    for name in plan.colwise:
        linear = module.get_submodule(name)
        distribute_param(linear, "weight", mesh, [Shard(0)])
        distribute_param(linear, "bias", mesh, [Shard(0)])
    for name in plan.rowwise:
        linear = module.get_submodule(name)
        _swap(linear, RowParallelLinear)
        linear.tp_rank = tp.rank
        distribute_param(linear, "weight", mesh, [Shard(1)])
        distribute_param(linear, "bias", mesh, [Replicate()], grad=PARTIAL)
    for name, n_heads in plan.heads.items():
        linear = module.get_submodule(name)
        if n_heads % tp.size == 0:
            distribute_param(linear, "weight", mesh, [Shard(0)])
            distribute_param(linear, "bias", mesh, [Shard(0)])
            continue
        _swap(linear, HeadSelectLinear)
        width = linear.out_features // n_heads
        head = tp.rank // (tp.size // n_heads)
        linear.rows = (head * width, (head + 1) * width)
        for leaf in ("weight", "bias"):
            distribute_param(linear, leaf, mesh, [Replicate()], grad=PARTIAL)
    for pattern, dim in plan.shard.items():
        for owner, leaf in _params(module, pattern):
            distribute_param(owner, leaf, mesh, [Shard(dim)])
    for pattern in plan.partial:
        for owner, leaf in _params(module, pattern):
            distribute_param(owner, leaf, mesh, [Replicate()], grad=PARTIAL)
    if plan.experts is not None and not tp.experts_on_ep:
        experts = module.get_submodule(plan.experts)
        for leaf, dim in plan.expert_hidden.items():
            if getattr(experts, leaf, None) is not None:
                distribute_param(experts, leaf, mesh, [Shard(dim)])


def expert_params(mixer: nn.Module) -> list[nn.Parameter]:
    """The routed-expert parameters of every expert group declared inside ``mixer``, in module
    order: the same order on every rank, which a coalesced reduction of them relies on."""
    out: dict[int, nn.Parameter] = {}
    for module in mixer.modules():
        plan = module.parallel_plan() if hasattr(module, "parallel_plan") else None
        if plan is not None and plan.experts is not None:
            out.update((id(p), p) for p in module.get_submodule(plan.experts).parameters())
    return list(out.values())


# ---------------------------------------------------------------- the model under TP


def _mixer_enter(tp: TPContext):
    return lambda module, args: (tp.enter(args[0]), *args[1:])


def _mixer_leave(tp: TPContext):
    return lambda module, args, out: tp.leave(out)


class SequenceChunkTP(SequenceChunk):
    """:class:`~composer.blocks.plan.SequenceChunk` under tp: this rank's chunk of ``T`` when
    the forward runs sequence parallel (the residual stream's cut), else the whole tensor."""

    tp: TPContext

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tp = self.tp
        return x.chunk(tp.size, dim=1)[tp.rank] if tp.last_sp else x


def apply_mtp_tp(depth: nn.Module, tp: TPContext) -> None:
    """An MTP depth's glue (:mod:`composer.blocks.mtp`; its layers are ordinary layers): the
    norms and ``proj`` are token-wise on the residual stream as it is, so replicated, their
    gradients partial sums under SP; the keep mask is cut over ``T`` like the stream."""
    for norm in (depth.norm_h, depth.norm_e, depth.final_norm):
        distribute_param(norm, "weight", tp.mesh, [Replicate()], grad=PARTIAL_IF_SP)
    distribute_param(depth.proj, "weight", tp.mesh, [Replicate()], grad=PARTIAL_IF_SP)
    depth.keep.__class__ = SequenceChunkTP
    depth.keep.tp = tp


def apply_tp(model: nn.Module, tp: TPContext) -> None:
    """Shard every layer's mixer by the plans its modules declare, the norms replicated, the
    embedding and head split by vocabulary; record which gradients need a ``tp`` sum."""
    from composer.parallel.mesh import LayoutError

    for layer in model.all_layers():  # the MTP depths' layers too
        distribute_param(layer.norm, "weight", tp.mesh, [Replicate()], grad=PARTIAL_IF_SP)
        mixer = layer.mixer
        if not hasattr(mixer, "parallel_plan"):
            raise LayoutError(f"{type(mixer).__name__} (symbol {layer.symbol!r}) declares no "
                              "tensor-parallel plan (parallel_plan); use --tp 1")
        for module in mixer.modules():  # outer plans first: they win
            if hasattr(module, "parallel_plan"):
                apply_plan(module, module.parallel_plan(), tp)
        skip = {id(p) for p in expert_params(mixer)} if tp.experts_on_ep else set()
        for name, p in mixer.named_parameters():
            if not isinstance(p, DTensor) and id(p) not in skip:
                raise LayoutError(f"{type(mixer).__name__} (symbol {layer.symbol!r}): parameter "
                                  f"{name!r} is not in its parallel plan; use --tp 1")
        mixer.register_forward_pre_hook(_mixer_enter(tp))
        mixer.register_forward_hook(_mixer_leave(tp))
    # a pipeline stage may hold no embedding, final norm or head (composer.parallel.pipeline)
    if model.final_norm is not None:
        distribute_param(model.final_norm, "weight", tp.mesh, [Replicate()],
                         grad=PARTIAL_IF_SP)
    if model.embed is not None:
        distribute_param(model.embed, "weight", tp.mesh, [Shard(0)])
        model.embed.__class__ = VocabParallelEmbedding
        model.embed.tp = tp
        model.embed._composer_local_views = True  # it reads its shard itself
    if not model.config.tie_embeddings and getattr(model, "lm_head", None) is not None:
        distribute_param(model.lm_head, "weight", tp.mesh, [Shard(0)])
    for depth in getattr(model, "mtp", None) or ():
        apply_mtp_tp(depth, tp)
    model.readout.__class__ = VocabParallelReadout
    model.readout.tp = tp
    install_all_local_views(model)
    tp.grad_kinds = {name: p._tp_grad for name, p in model.named_parameters()
                     if getattr(p, "_tp_grad", None)}


def local_grad(p: torch.Tensor) -> torch.Tensor:
    g = p.grad
    return g.to_local() if isinstance(g, DTensor) else g


def reduce_tp_grads(model: nn.Module, tp: TPContext | None) -> None:
    """Sum over ``tp`` the gradients of replicated weights whose per-rank grads are partial
    (after backward, before the optimizer step), coalesced into buckets."""
    if tp is None or tp.size == 1:
        return
    grads = []
    for name, p in model.named_parameters():
        kind = tp.grad_kinds.get(name)
        if p.grad is None or kind is None or (kind == PARTIAL_IF_SP and not tp.last_sp):
            continue
        grads.append(local_grad(p))
    all_reduce_coalesced(grads, tp.group)
