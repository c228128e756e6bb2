"""What decides a rank's collectives, read from its parallelised model on meta (the
impersonated rank of :mod:`composer.plan.ranks`): FSDP2's units and their dtypes, the
replicated weights whose gradients tensor parallel sums, the experts data parallelism leaves to
:func:`composer.parallel.data.finish_grads`, each layer's kind and convolutions, the pipeline
stages. :mod:`composer.plan.comm` turns them into bytes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from composer.parallel.mesh import ParallelDims


@dataclass
class Unit:
    """One FSDP2 / replicate unit: its group, the bytes one call gathers and reduces."""

    group: str
    size: int
    gather_bytes: int
    """The all-gather's output (0 under replicate)."""
    reduce_bytes: int
    """The reduce-scatter's input (sharded) or the all-reduce's tensor (replicate)."""
    root: bool
    replicate_group: str | None = None
    """HSDP: the replica dimension its reduced shard is all-reduced over, and that shard."""
    replicate_size: int = 1
    shard_bytes: int = 0


@dataclass
class CommParts:
    """What decides a rank's collectives, read from its model (:func:`comm_parts`)."""

    units: list[Unit] = field(default_factory=list)
    tp_grad_bytes: dict[str, int] = field(default_factory=dict)
    """Gradient kind (``partial``, ``partial_if_sp``) -> bytes of the gradients summed over tp."""
    expert_grad_bytes: int = 0
    """Routed experts' gradients reduced over ``dp_outer`` by ``finish_grads``."""
    sections: list[str | None] = field(default_factory=list)
    """Each layer's kind section on this rank, in order."""
    branches: list[str | None] = field(default_factory=list)
    """The sections of the mixers the layers run: a layer's own, or a parallel group's
    branches' (Falcon-H1's ``[M*]``)."""
    halos: list[int] = field(default_factory=list)
    """Each layer's convolution tails per chunk: ``(kernel - 1) x`` its convolutions' local
    channels (what context parallelism's halo exchange gathers)."""
    partial_sums: int = 0
    """``PartialSum`` points the layers run (a shared part's at each use): a sub-layer's
    output summed over tp inside its mixer."""
    embedding_reads: int = 0
    """Layers whose mixers read the input embeddings (``uses_embeddings``: entered like the
    residual stream)."""
    stage_ids: list[int] = field(default_factory=lambda: [0])
    n_stages: int = 1
    has_embed: bool = True
    has_readout: bool = True
    mtp_depths: int = 0
    """Multi-token prediction's depths on this rank (each embeds and reads out once more)."""
    tied_bytes: int = 0
    """Gradient bytes of the embedding copies the pipeline sums (0: none on this rank), over
    ``tied_ranks`` pipeline ranks."""
    tied_ranks: int = 1


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p


def _unit(group: Any, root: bool, expert_mesh: Any = None) -> Unit:
    """An FSDP2 parameter group's unit: each parameter's dim-0 padded shard times the shard
    ranks (sharded), or its whole local tensor (replicate), in the policy's dtypes."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, HSDPMeshInfo

    info, mp = group.mesh_info, group.mp_policy
    sharded = isinstance(info, FSDPMeshInfo)
    n = info.shard_mesh_size if sharded else info.replicate_mesh_size
    gather = reduce = shard = 0
    for fp in group.fsdp_params:
        param_dtype = mp.param_dtype or fp.sharded_param.dtype
        reduce_size = (mp.reduce_dtype or param_dtype).itemsize
        local = fp.padded_sharded_param_size.numel() if sharded else \
            _local(fp.sharded_param).numel()
        full = local * n if sharded else local
        gather += full * param_dtype.itemsize if sharded else 0
        reduce += full * reduce_size
        shard += local * reduce_size
    names = info.mesh.mesh_dim_names
    if expert_mesh is not None and info.mesh is expert_mesh and len(names) > 1:
        # HSDP's expert units: dp_outer's own (dp_replicate, dp_shard), not dp_cp's
        names = tuple(f"expert_{n}" for n in names)
    unit = Unit(names[info.shard_mesh_dim if sharded else info.replicate_mesh_dim], n, gather,
                reduce, root)
    if isinstance(info, HSDPMeshInfo):
        unit.replicate_group = names[info.replicate_mesh_dim]
        unit.replicate_size, unit.shard_bytes = info.replicate_mesh_size, shard
    return unit


def _units(roots: list[nn.Module], expert_mesh: Any = None) -> list[Unit]:
    """Every FSDP2 / replicate unit under ``roots`` (the model, a pipeline rank's stages)."""
    from torch.distributed.fsdp import FSDPModule

    out, seen = [], set()
    for top in roots:
        for module in top.modules():
            if isinstance(module, FSDPModule) and id(module) not in seen:
                seen.add(id(module))
                group = module._get_fsdp_state()._fsdp_param_group
                if group is not None:
                    out.append(_unit(group, any(module is r for r in roots), expert_mesh))
    return out


def _convs(mixer: nn.Module) -> tuple[tuple[int, tuple[torch.Tensor, ...]], ...]:
    """The mixer's convolutions: each one's kernel and ``[C, 1, K]`` weights."""
    from composer.blocks.split import SplitCausalConv1d

    return tuple((conv.kernel, tuple(p for p in conv.parameters(recurse=False) if p.ndim == 3))
                 for conv in mixer.modules() if isinstance(conv, SplitCausalConv1d))


def _mixer_modules(mixer: nn.Module) -> list[nn.Module]:
    """The mixer's modules and its shared part's (``shared_part``: held outside its tree)."""
    from composer.blocks.protocol import declared

    out = list(mixer.modules())
    name = declared(mixer, "shared_part", None)
    part = getattr(mixer, name, None) if name else None
    if part is not None and not any(part is m for m in out):
        out += list(part.modules())
    return out


@dataclass(frozen=True)
class LayerComm:
    """What one layer's collectives depend on, read from its modules (parallelised or plain:
    the same fields either way; :func:`layer_comm`)."""

    section: str | None
    """Its mixer's kind section (None: unregistered)."""
    branches: tuple[str | None, ...]
    """The sections of the mixers it runs (:attr:`CommParts.branches`)."""
    convs: tuple[tuple[int, tuple[torch.Tensor, ...]], ...]
    """Its convolutions: kernel and ``[C, 1, K]`` weights (their halos)."""
    partial_sums: int
    embedding_reads: int


def layer_comm(layer: nn.Module) -> LayerComm:
    from composer.blocks.kind import KINDS
    from composer.blocks.plan import PartialSum
    from composer.blocks.protocol import declared

    by_mixer = {kind.mixer: kind for kind in KINDS.values()}
    mixer = layer.mixer
    inner = [by_mixer[type(m)].section for m in mixer.modules()
             if type(m) in by_mixer]  # the mixer first, then any branches
    own = type(mixer) in by_mixer
    return LayerComm(inner[0] if own else None,
                     tuple(inner[:1] if own else inner or [None]), _convs(mixer),
                     sum(isinstance(m, PartialSum) for m in _mixer_modules(mixer)),
                     int(bool(declared(mixer, "uses_embeddings"))))


def put_layers(parts: CommParts, layers: list[LayerComm],
               channels: Callable[[torch.Tensor], int]) -> None:
    """Fill ``parts``' per-layer fields from the rank's layers in order; ``channels``: a
    convolution weight's elements on this rank, tensor parallel's part with data parallelism's
    shards gathered (its halo: ``(kernel - 1) x`` channels)."""
    parts.sections = [layer.section for layer in layers]
    parts.branches = [b for layer in layers for b in layer.branches]
    parts.halos = [sum((kernel - 1) * sum(channels(w) for w in weights) // kernel
                       for kernel, weights in layer.convs) for layer in layers]
    parts.partial_sums = sum(layer.partial_sums for layer in layers)
    parts.embedding_reads = sum(layer.embedding_reads for layer in layers)


def comm_parts(model: nn.Module, dims: ParallelDims) -> CommParts:
    """The parts of an (impersonated) rank's parallelised model that its collectives need."""
    from composer.parallel.data import experts_sharded
    from composer.parallel.tensor import PARTIAL, PARTIAL_IF_SP, expert_params
    from composer.plan.ranks import rank_coords, shape_of

    def nbytes(p: torch.Tensor) -> int:
        return _local(p).numel() * _local(p).element_size()

    pipeline = getattr(model, "pipeline", None)
    roots = [model, *(pipeline.views if pipeline is not None else ())]
    parts = CommParts(_units(roots, dims.expert_mesh))
    tp = dims.tp_context
    if tp is not None:
        for name, p in model.named_parameters():
            kind = tp.grad_kinds.get(name)
            if kind in (PARTIAL, PARTIAL_IF_SP) and p.requires_grad:
                parts.tp_grad_bytes[kind] = parts.tp_grad_bytes.get(kind, 0) + nbytes(p)
    layers = list(model.all_layers())
    coords = rank_coords(dist.get_rank() if dist.is_initialized() else 0, dims)
    put_layers(parts, [layer_comm(layer) for layer in layers],
               lambda w: shape_of(w).numel_at(coords, gathered=True))
    parts.mtp_depths = len(getattr(model, "mtp", None) or ())
    if dims.ep > 1 and dims.dp_outer > 1 and not experts_sharded(dims):
        parts.expert_grad_bytes = sum(nbytes(p) for layer in layers
                                      for p in expert_params(layer.mixer) if p.requires_grad)
    if pipeline is not None:
        parts.stage_ids, parts.n_stages = list(pipeline.stage_ids), pipeline.n_stages
        parts.has_embed, parts.has_readout = pipeline.has_first, pipeline.has_last
        if pipeline.embed_group is not None and model.embed is not None:
            parts.tied_bytes = nbytes(model.embed.weight)
            parts.tied_ranks = len(pipeline.embed_holders)
    return parts
