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
(:class:`SequenceChunkTP`), the sums inside a mixer that chains sub-layers
(:class:`PartialSumTP`); and from ``vocab.py`` the vocabulary-parallel embedding and
readout (head + loss, never gathering the logits for the loss). A swap builds a new module that
holds the old one's Parameter objects and the context it needs, and sets it in the old one's
place on its parent (:func:`replace_submodule`), so state-dict keys, parameter order and
everything later layers (FSDP, DCP, the optimizer) see are unchanged; no block is mutated.
A bias added to partial sums (a row-parallel linear's, the routed experts' down bias, the plans'
``expert_partial``) counts once: rank 0 adds it (:func:`count_once` for the experts).
Replicated weights whose per-rank gradients are partial sums (norms under SP, qk-norms, the
router, replicated kv projections, row-parallel biases, the experts' down bias) are recorded in the
:class:`TPContext` (:attr:`TPContext.grad_kinds`) and summed over ``tp`` by
:func:`reduce_tp_grads`, in buckets.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from composer.blocks.plan import ParallelPlan, PartialSum, SequenceChunk
from composer.blocks.protocol import declared, plan_of
from composer.blocks.shared import SharedLayer
from composer.kernels.linear import Linear
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
    param_kinds: dict[int, str] = field(default_factory=dict, repr=False)
    """``id(parameter)`` -> its kind while :func:`apply_tp` places parameters; the names (and
    :attr:`grad_kinds`) are known only once every plan is applied. Emptied then: data
    parallelism later replaces the Parameter objects, names outlive it."""

    def place(self, module: nn.Module, name: str, placements: list,
              grad: str | None = None) -> None:
        """:func:`distribute_param` on the ``tp`` mesh, recording the gradient kind."""
        p = distribute_param(module, name, self.mesh, placements)
        if p is not None and grad is not None:
            self.param_kinds[id(p)] = grad

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


class _SumInside(torch.autograd.Function):
    """A partial sum made whole inside a mixer: all-reduce; backward all-reduces too, since
    inside a mixer every rank's gradient of a replicated tensor is its share of the whole (what
    the mixer's entry sums)."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, tp: TPContext) -> torch.Tensor:
        ctx.tp = tp
        y = y.contiguous().clone()
        dist.all_reduce(y, group=tp.group)
        return y

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        g = g.contiguous().clone()
        dist.all_reduce(g, group=ctx.tp.group)
        return g, None


class PartialSumTP(PartialSum):
    """:class:`~composer.blocks.plan.PartialSum` under tp: the sum over the ranks."""

    def __init__(self, tp: TPContext) -> None:
        super().__init__()
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _SumInside.apply(x, self.tp)


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
    ``to_local``, so gradients reach the DTensors). Once per module: the hook itself says
    whether it is there, nothing is written onto the module."""
    if any(hook is _use_local for hook in module._forward_pre_hooks.values()):
        return
    module.register_forward_pre_hook(_use_local)
    module.register_forward_hook(_drop_local, always_call=True)


def install_all_local_views(root: nn.Module) -> None:
    """Local views on every module holding DTensor parameters, but the parallel modules that
    read their shards themselves (the vocabulary-parallel embedding)."""
    for module in root.modules():
        if isinstance(module, VocabParallelEmbedding):
            continue
        if any(isinstance(p, DTensor) for p in module._parameters.values()):
            install_local_views(module)


def replace_submodule(root: nn.Module, name: str, new: nn.Module) -> None:
    """Set ``new`` in place of ``root``'s submodule ``name`` (dotted, relative to ``root``) on
    its parent: the module swap of a parallel form, done from outside."""
    prefix, _, leaf = name.rpartition(".")
    setattr(root.get_submodule(prefix) if prefix else root, leaf, new)


def replace_everywhere(roots: list[nn.Module], old: nn.Module, new: nn.Module) -> None:
    """Set ``new`` in every place where ``old`` is a child inside ``roots`` (a pipeline rank's
    stages hold the model's embedding and readout too, and are no submodules of it)."""
    slots = [(parent, leaf) for root in roots for parent in root.modules()
             for leaf, child in parent.named_children() if child is old]
    for parent, leaf in slots:
        setattr(parent, leaf, new)


# ---------------------------------------------------------------- placing parameters


def distribute_param(module: nn.Module, name: str, mesh: DeviceMesh,
                     placements: list) -> nn.Parameter | None:
    """Replace ``module.<name>`` by a DTensor parameter with ``placements`` on ``mesh`` (on the
    meta device no memory is touched; each rank keeps its own chunk, no communication).
    Returns the new parameter, or None when there was nothing to place (no parameter, or one
    an outer plan placed already)."""
    p = getattr(module, name)
    if p is None or isinstance(p, DTensor):
        return None
    new = nn.Parameter(distribute_tensor(p.data, mesh, placements, src_data_rank=None),
                       requires_grad=p.requires_grad)
    module.register_parameter(name, new)
    return new


class _TakenLinear(nn.Linear):
    """An ``nn.Linear`` built around another one's Parameter objects (nothing allocated), so that
    keys, parameter order and placements stay those of the linear it replaces."""

    def __init__(self, linear: nn.Linear) -> None:
        nn.Module.__init__(self)  # not nn.Linear's: it would allocate a new weight
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.register_parameter("bias", linear.bias)
        self.train(linear.training)


class RowParallelLinear(_TakenLinear):
    """Input features split over ``tp``: weight ``Shard(1)``; the output is a partial sum, so the
    bias (replicated) is added on tp rank 0 only and reaches every rank through the reduction."""

    def __init__(self, linear: nn.Linear, tp_rank: int) -> None:
        super().__init__(linear)
        self.tp_rank = tp_rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        if self.bias is not None:
            y = y + (self.bias if self.tp_rank == 0 else 0.0 * self.bias)
        return y


class HeadSelectLinear(_TakenLinear):
    """A replicated linear of which this rank computes only rows ``rows`` (its head)."""

    def __init__(self, linear: nn.Linear, rows: tuple[int, int]) -> None:
        super().__init__(linear)
        self.rows = rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lo, hi = self.rows
        bias = self.bias[lo:hi] if self.bias is not None else None
        return F.linear(x, self.weight[lo:hi], bias)


def _swap_linear(module: nn.Module, name: str, cls: type, **context: object) -> nn.Linear:
    """Put a ``cls`` holding the parameters of ``module``'s linear ``name`` in its place (once:
    a linear an outer plan swapped already stays)."""
    linear = module.get_submodule(name)
    if isinstance(linear, cls):
        return linear
    if type(linear) not in (nn.Linear, Linear):  # a plain projection, not a wrapper
        raise TypeError(f"cannot make {type(linear).__name__} a {cls.__name__}")
    new = cls(linear, **context)
    replace_submodule(module, name, new)
    return new


def _params(module: nn.Module, pattern: str) -> list[tuple[nn.Module, str]]:
    out = []
    for name, _ in module.named_parameters():
        if fnmatch.fnmatchcase(name, pattern):
            prefix, _, leaf = name.rpartition(".")
            out.append((module.get_submodule(prefix) if prefix else module, leaf))
    return out


def apply_plan(module: nn.Module, plan: ParallelPlan, tp: TPContext) -> None:
    """Place ``module``'s parameters as its plan says (names relative to ``module``)."""
    for name in plan.colwise:
        linear = module.get_submodule(name)
        tp.place(linear, "weight", [Shard(0)])
        tp.place(linear, "bias", [Shard(0)])
    for name in plan.rowwise:
        linear = _swap_linear(module, name, RowParallelLinear, tp_rank=tp.rank)
        tp.place(linear, "weight", [Shard(1)])
        tp.place(linear, "bias", [Replicate()], grad=PARTIAL)
    for name, n_heads in plan.heads.items():
        linear = module.get_submodule(name)
        if n_heads % tp.size == 0:
            tp.place(linear, "weight", [Shard(0)])
            tp.place(linear, "bias", [Shard(0)])
            continue
        width = linear.out_features // n_heads
        head = tp.rank // (tp.size // n_heads)
        linear = _swap_linear(module, name, HeadSelectLinear,
                              rows=(head * width, (head + 1) * width))
        for leaf in ("weight", "bias"):
            tp.place(linear, leaf, [Replicate()], grad=PARTIAL)
    for pattern, dim in plan.shard.items():
        for owner, leaf in _params(module, pattern):
            tp.place(owner, leaf, [Shard(dim)])
    for pattern in plan.partial:
        for owner, leaf in _params(module, pattern):
            tp.place(owner, leaf, [Replicate()], grad=PARTIAL)
    for name in plan.partial_sums:
        if not isinstance(module.get_submodule(name), PartialSumTP):
            replace_submodule(module, name, PartialSumTP(tp))
    if plan.experts is not None:
        _place_experts(module.get_submodule(plan.experts), plan, tp)


def _place_experts(experts: nn.Module, plan: ParallelPlan, tp: TPContext) -> None:
    """The expert group's hidden units split over ``tp``, its ``expert_partial`` parameters
    replicated and counted once (:func:`count_once`). Under expert parallel too, ``apply_ep``
    places them on the ``ep x tp`` mesh and counts them once; their gradient kind is recorded
    here, by name, like every other ``tp`` partial sum."""
    own = dict(experts.named_parameters(recurse=False))
    once = [leaf for leaf in plan.expert_partial if leaf in own]
    if tp.experts_on_ep:
        tp.param_kinds.update((id(own[leaf]), PARTIAL) for leaf in once)
        return
    for leaf, dim in plan.expert_hidden.items():
        if leaf in own:
            tp.place(experts, leaf, [Shard(dim)])
    for leaf in once:
        tp.place(experts, leaf, [Replicate()], grad=PARTIAL)
    count_once(experts, once, tp.rank)


def _zero_local(names: list[str], module: nn.Module, args: tuple) -> None:
    for name in names:  # after the local views: what this forward reads, times zero
        module.__dict__[name] = module.__dict__.get(name, module._parameters[name]) * 0


def count_once(module: nn.Module, names: list[str], tp_rank: int) -> None:
    """Parameters ``names`` of ``module``, whole on every tp rank, that its forward adds to
    partial sums (a row-split bias): on tp rank 0 its forward reads them, on the others zeros
    of the same graph (for that forward, through a pre-hook after the local views), so the
    reduction over ``tp`` counts them once and their gradients are zeros off rank 0, whose
    ``tp`` sum (``reduce_tp_grads``) is the single-process gradient on every rank. The forward
    is the single-device one, unchanged."""
    if not names or tp_rank == 0:
        return
    install_local_views(module)  # first: the zeros replace its views, never the reverse
    module.register_forward_pre_hook(partial(_zero_local, names))


def expert_params(mixer: nn.Module) -> list[nn.Parameter]:
    """The routed-expert parameters of every expert group declared inside ``mixer``, in module
    order: the same order on every rank, which a coalesced reduction of them relies on."""
    out: dict[int, nn.Parameter] = {}
    for module in mixer.modules():
        plan = plan_of(module)
        if plan is not None and plan.experts is not None:
            out.update((id(p), p) for p in module.get_submodule(plan.experts).parameters())
    return list(out.values())


# ---------------------------------------------------------------- the model under TP


def _mixer_enter(tp: TPContext):
    """Into a mixer: its input, and the model's input embeddings for a mixer that reads them
    (``uses_embeddings``: they are cut over the sequence like the residual stream)."""
    def enter(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if kwargs.get("embeddings") is not None:
            kwargs = {**kwargs, "embeddings": tp.enter(kwargs["embeddings"])}
        return (tp.enter(args[0]), *args[1:]), kwargs
    return enter


def _mixer_leave(tp: TPContext):
    return lambda module, args, out: tp.leave(out)


class SequenceChunkTP(SequenceChunk):
    """:class:`~composer.blocks.plan.SequenceChunk` under tp: this rank's chunk of ``T`` when
    the forward runs sequence parallel (the residual stream's cut), else the whole tensor."""

    def __init__(self, tp: TPContext) -> None:
        super().__init__()
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tp = self.tp
        return x.chunk(tp.size, dim=1)[tp.rank] if tp.last_sp else x


def apply_mtp_tp(depth: nn.Module, tp: TPContext) -> None:
    """An MTP depth's glue (:mod:`composer.blocks.mtp`; its layers are ordinary layers): the
    norms and ``proj`` are token-wise on the residual stream as it is, so replicated, their
    gradients partial sums under SP; the keep mask is cut over ``T`` like the stream."""
    for norm in (depth.norm_h, depth.norm_e, depth.final_norm):
        tp.place(norm, "weight", [Replicate()], grad=PARTIAL_IF_SP)
    tp.place(depth.proj, "weight", [Replicate()], grad=PARTIAL_IF_SP)
    if not isinstance(depth.keep, SequenceChunk):
        raise TypeError(f"an MTP depth's keep is a {type(depth.keep).__name__}, not a "
                        "SequenceChunk")
    replace_submodule(depth, "keep", SequenceChunkTP(tp))


def _shard_layers(model: nn.Module, tp: TPContext) -> None:
    """Every layer's norm and mixer (the MTP depths' layers too), by the mixers' plans."""
    from composer.parallel.mesh import LayoutError

    seen: set[int] = set()
    for layer in model.all_layers():
        if id(layer.mixer) in seen:  # a shared layer's later use (composer.blocks.shared)
            continue
        seen.add(id(layer.mixer))
        # a mixer that takes the residual applies the norm itself, inside (on the entered,
        # replicated input): there each rank's gradient is its share, whatever SP
        inside = declared(layer.mixer, "takes_residual")
        tp.place(layer.norm, "weight", [Replicate()], grad=PARTIAL if inside else PARTIAL_IF_SP)
        if layer.out_norm is not None:  # sandwich norm: on the reduced output, like norm
            tp.place(layer.out_norm, "weight", [Replicate()], grad=PARTIAL_IF_SP)
        mixer = layer.mixer
        if plan_of(mixer) is None:
            raise LayoutError(f"{type(mixer).__name__} (symbol {layer.symbol!r}) declares no "
                              "tensor-parallel plan (parallel_plan); use --tp 1")
        for module in list(mixer.modules()):  # outer plans first: they win
            plan = plan_of(module)
            if plan is not None:
                apply_plan(module, plan, tp)
        skip = {id(p) for p in expert_params(mixer)} if tp.experts_on_ep else set()
        for name, p in mixer.named_parameters():
            if not isinstance(p, DTensor) and id(p) not in skip:
                raise LayoutError(f"{type(mixer).__name__} (symbol {layer.symbol!r}): parameter "
                                  f"{name!r} is not in its parallel plan; use --tp 1")
        mixer.register_forward_pre_hook(_mixer_enter(tp), with_kwargs=True)
        mixer.register_forward_hook(_mixer_leave(tp))
    _shard_shared_parts(model, tp)


def _shard_shared_parts(model: nn.Module, tp: TPContext) -> None:
    """A kind's shared part (``shared_part``, reached from its uses' mixers but registered
    under ``model.shared``): sharded once, by the plans its modules declare."""
    from composer.parallel.mesh import LayoutError

    for label, part in (getattr(model, "shared", None) or {}).items():
        if isinstance(part, SharedLayer):
            continue  # a whole shared layer: sharded with its first use above
        for module in list(part.modules()):
            plan = plan_of(module)
            if plan is not None:
                apply_plan(module, plan, tp)
        for name, p in part.named_parameters():
            if not isinstance(p, DTensor):
                raise LayoutError(f"shared layer {label!r}: parameter {name!r} is not in a "
                                  "parallel plan; use --tp 1")


def apply_tp(model: nn.Module, tp: TPContext, roots: list[nn.Module] | None = None) -> None:
    """Shard every layer's mixer by the plans its modules declare, the norms replicated, the
    embedding and head split by vocabulary; record which gradients need a ``tp`` sum.
    ``roots``: a pipeline rank's stages, which hold the model's embedding and readout too."""
    _shard_layers(model, tp)
    roots = [model, *(roots or ())]
    # a pipeline stage may hold no embedding, final norm or head (composer.parallel.pipeline)
    if model.final_norm is not None:
        tp.place(model.final_norm, "weight", [Replicate()], grad=PARTIAL_IF_SP)
    if model.embed is not None:
        tp.place(model.embed, "weight", [Shard(0)])
        replace_everywhere(roots, model.embed, VocabParallelEmbedding(model.embed, tp))
    if not model.config.tie_embeddings and getattr(model, "lm_head", None) is not None:
        tp.place(model.lm_head, "weight", [Shard(0)])
    for depth in getattr(model, "mtp", None) or ():
        apply_mtp_tp(depth, tp)
    replace_everywhere(roots, model.readout, VocabParallelReadout(model.readout, tp))
    install_all_local_views(model)
    tp.grad_kinds = {name: tp.param_kinds[id(p)] for name, p in model.named_parameters()
                     if id(p) in tp.param_kinds}
    tp.param_kinds.clear()


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
