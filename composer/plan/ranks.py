"""The exact part of a plan: what each rank holds, read from the real construction path.

One process impersonates a rank of a world of any size through torch's fake process group
(``init_process_group("fake", ...)``: collectives are no-ops, meshes and groups are real), builds
and parallelises the model on the meta device exactly as training does
(:func:`composer.run.build_meta`) and reads that rank's shards. One rank is built per pipeline
stage (the stages hold different layers); the other ranks of a stage hold the same parameters
over meshes of the same shape, so their shard sizes follow from each parameter's global shape
and placements at their mesh coordinates (torch's own DTensor arithmetic). Ranks whose bytes are
equal form one *rank class*, named by its first rank.

Bytes per rank:
- ``params``: the fp32 masters' local shards (``to_local()``);
- ``grads``: one gradient per trainable master, in the master's dtype (FSDP2 reduces in fp32,
  ``MixedPrecisionPolicy.reduce_dtype``, into the sharded fp32 gradient; replicated and
  expert-apart gradients are the masters' shape and dtype too);
- ``optimizer``: AdamW's two moments per trainable master plus its fp32 ``step`` scalar;
  Muon's momentum for the matrices :func:`composer.train.optim.build_optimizers` gives it;
- ``buffers``: data parallelism's unsharded units in flight, the current and the prefetched
  one (the two largest units' all-gathered bytes in the compute dtype; none where a unit is
  neither sharded nor cast).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

from composer.config import ConfigError, ModelConfig
from composer.lora import LoRAConfig
from composer.parallel.layout import ParallelConfig
from composer.parallel.mesh import LayoutError, ParallelDims, build_parallel_dims
from composer.plan.comm_parts import comm_parts

ROOT_DIMS = ("pp", "dp_outer", "ep", "cp", "tp")
DP_DIMS = ("dp", "dp_cp", "dp_outer", "dp_shard", "dp_outer_shard")
"""Mesh dimensions data parallelism shards over (what an FSDP unit gathers). Under HSDP the
shard mesh is ``(dp_replicate, dp_shard)`` and the experts' ``(dp_replicate, dp_shard)`` of
``dp_outer``; the experts' are named ``dp_outer_replicate``, ``dp_outer_shard`` here
(:func:`shape_of`), their coordinates differ."""
STEP_BYTES = 4
"""AdamW's ``step``: one fp32 scalar per parameter (``torch.optim.AdamW``, not fused)."""


@dataclass
class RankBytes:
    params: int
    grads: int
    optimizer: int
    buffers: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.buffers


@dataclass
class RankClass:
    stage: int
    example_rank: int
    n_ranks: int
    bytes: RankBytes


def check_no_group() -> None:
    """Impersonation needs a process of its own, neither in a process group nor one of
    torchrun's ranks: one line otherwise."""
    if dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if dist.is_initialized() or world > 1:
        raise ConfigError(f"composer plan and train --dry-run impersonate ranks in a process "
                          f"of their own: this one is already rank {rank} of {world} (run it "
                          "outside torchrun or composer launch)")


@contextmanager
def impersonate(rank: int, world: int) -> Iterator[None]:
    """Be ``rank`` of ``world`` (fake process group) for the block (:func:`check_no_group`)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    check_no_group()
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def rank_coords(rank: int, dims: ParallelDims) -> dict[str, int]:
    """``rank``'s coordinate on every mesh dimension, the flattened ones included (the mesh is
    ``(pp, dp_outer, ep, cp, tp)``, row-major over the ranks). HSDP's ``dp_replicate x
    dp_shard`` unflattens ``dp_cp`` (dense parameters) or ``dp_outer`` (experts, named
    ``dp_outer_replicate x dp_outer_shard`` by :func:`shape_of`) row-major."""
    coords, rest = {}, rank
    for name in reversed(ROOT_DIMS):
        size = {"pp": dims.pp, "dp_outer": dims.dp_outer, "ep": dims.ep, "cp": dims.cp,
                "tp": dims.tp}[name]
        coords[name], rest = rest % size, rest // size
    coords["dp"] = coords["dp_outer"] * dims.ep + coords["ep"]
    coords["dp_cp"] = coords["dp"] * dims.cp + coords["cp"]
    # HSDP's 2-D views, the replica index outermost (composer.parallel.mesh)
    shard, outer = dims.dp_shard, dims.dp_outer // dims.dp_replicate
    coords["dp_replicate"], coords["dp_shard"] = divmod(coords["dp_cp"], shard)
    coords["dp_outer_replicate"], coords["dp_outer_shard"] = divmod(coords["dp_outer"], outer)
    return coords


@dataclass(frozen=True)
class Shape:
    """What decides a parameter's local size on any rank: global shape, mesh, placements."""

    shape: tuple[int, ...]
    dims: tuple[str, ...]
    sizes: tuple[int, ...]
    placements: tuple

    def numel_at(self, coords: dict[str, int], gathered: bool = False) -> int:
        """Local elements at ``coords``; ``gathered``: with data parallelism's shards
        all-gathered (an FSDP unit's unsharded view)."""
        even = _even_numel(self, gathered)
        if even is not None:
            return even
        return _local_numel(self, tuple(coords[d] for d in self.dims), gathered)


@functools.lru_cache(maxsize=1 << 16)
def _even_numel(shape: Shape, gathered: bool) -> int | None:
    """The local elements when every rank holds as many (then the coordinates do not matter),
    else None: the first rank's chunk is the largest of every split, so the chunks are all
    equal exactly when it times the number of chunks is the whole."""
    first = _local_numel(shape, (0,) * len(shape.dims), gathered)
    chunks = _prod(tuple(n for d, n, p in zip(shape.dims, shape.sizes, shape.placements,
                                              strict=True)
                         if not isinstance(p, Replicate) and not (gathered and d in DP_DIMS)))
    return first if first * chunks == _prod(shape.shape) else None


@functools.lru_cache(maxsize=1 << 16)
def _local_numel(shape: Shape, at: tuple[int, ...], gathered: bool) -> int:
    if not shape.dims:
        return _prod(shape.shape)
    placements = [Replicate() if gathered and d in DP_DIMS else p
                  for d, p in zip(shape.dims, shape.placements, strict=True)]
    local, _ = _compute_local_shape_and_global_offset(shape.shape, shape.sizes, list(at),
                                                      placements, skip_offset=True)
    return _prod(local)


def _prod(shape: tuple[int, ...]) -> int:
    out = 1
    for n in shape:
        out *= n
    return out


def shape_of(p: torch.Tensor) -> Shape:
    if isinstance(p, DTensor):
        mesh = p.device_mesh
        names = tuple(mesh.mesh_dim_names)
        if "ep" in names:  # an expert over its own replicas' mesh (DP_DIMS)
            names = tuple({"dp_replicate": "dp_outer_replicate",
                           "dp_shard": "dp_outer_shard"}.get(n, n) for n in names)
        return Shape(tuple(p.shape), names, tuple(mesh.mesh.shape), tuple(p.placements))
    return Shape(tuple(p.shape), (), (), ())


@dataclass
class StageParts:
    """One stage's parameters, each with its shape rule, element size and optimizer state
    count, and its data-parallel units (lists of parameter indices)."""

    params: list[tuple[Shape, int, bool, int]]
    """(shape, bytes per element, trainable, optimizer state copies: 2 AdamW, 1 Muon)."""
    units: list[list[int]]
    compute_size: int
    kinds: list = dataclasses.field(default_factory=list)
    dims: ParallelDims | None = None
    """The :class:`~composer.blocks.kind.LayerKind` of each layer on the stage (None: unknown)."""
    comm: Any = None
    """The stage's :class:`composer.plan.comm_parts.CommParts` (what its collectives move)."""
    _split: tuple | None = dataclasses.field(default=None, repr=False)

    def bytes_at(self, coords: dict[str, int]) -> RankBytes:
        """The bytes of the rank at ``coords``. A parameter whose every chunk is equal counts
        the same on every rank: those are summed once (:meth:`split`), the others per rank."""
        const, uneven, units = self.split()
        p, g, o = (a + b for a, b in zip(const, self._sums(uneven, coords), strict=True))
        sizes = [c + self._gathered(idx, coords) for c, idx in units]
        return RankBytes(p, g, o, sum(sorted(sizes, reverse=True)[:2]))

    def split(self) -> tuple:
        """``(params, grads, optimizer)`` of the evenly split parameters, the indices of the
        others, and each unit's even part of :meth:`in_flight` with its other indices."""
        if self._split is None:
            even = [_even_numel(s, False) is not None and _even_numel(s, True) is not None
                    for s, _, _, _ in self.params]
            anywhere: dict[str, int] = collections.defaultdict(int)  # every coordinate 0
            const = self._sums([i for i, e in enumerate(even) if e], anywhere)
            units = [(self._gathered([i for i in unit if even[i]], anywhere),
                      [i for i in unit if not even[i]]) for unit in self.units]
            self._split = (const, [i for i, e in enumerate(even) if not e], units)
        return self._split

    def _sums(self, indices: list[int], coords: dict[str, int]) -> tuple[int, int, int]:
        params = grads = opt = 0
        for i in indices:
            shape, size, trainable, copies = self.params[i]
            n = shape.numel_at(coords) * size
            params += n
            if trainable:
                grads += n
                opt += copies * n + (STEP_BYTES if copies == 2 else 0)
        return params, grads, opt

    def unsharded_params(self, rank: int, dims: ParallelDims | None = None) -> int:
        """Elements of ``rank``'s parameters with data parallelism's shards gathered."""
        coords = rank_coords(rank, dims or self.dims)
        return sum(shape.numel_at(coords, gathered=True) for shape, _, _, _ in self.params)

    def in_flight(self, coords: dict[str, int]) -> int:
        """The two largest units' gathered bytes in the compute dtype (current + prefetched)."""
        return self.bytes_at(coords).buffers

    def _gathered(self, indices: list[int], coords: dict[str, int]) -> int:
        """A unit's (part's) gathered bytes in the compute dtype: its parameters that data
        parallelism shards or that are cast (none where a unit is neither)."""
        total = 0
        for i in indices:
            shape, size, _, _ = self.params[i]
            sharded = any(d in DP_DIMS for d in shape.dims) and \
                shape.numel_at(coords, gathered=True) != shape.numel_at(coords)
            if sharded or size != self.compute_size:
                total += shape.numel_at(coords, gathered=True) * self.compute_size
        return total


def stage_parts(model: nn.Module, optimizer: str, compute_size: int) -> StageParts:
    """The parameters of an impersonated rank's model (built by :func:`build_rank`)."""
    from torch.distributed.fsdp import FSDPModule

    from composer.train.optim import build_optimizers

    copies = state_copies(build_optimizers(model, optimizer, 1e-3, 0.0, (0.9, 0.95), 1e-8).opts)
    index: dict[int, int] = {}
    params = []
    for p in model.parameters():  # each parameter once (tied ones are one)
        index[id(p)] = len(params)
        params.append((shape_of(p), p.element_size(), p.requires_grad, copies.get(id(p), 0)))
    units = []
    # a pipeline rank's stages are data parallelism's roots (their embedding, norm, head): they
    # hold the layers but are not submodules of the model
    views = model.pipeline.views if getattr(model, "pipeline", None) is not None else []
    modules = {id(m): m for root in [model, *views] for m in root.modules()}
    for module in modules.values():
        if isinstance(module, FSDPModule):
            group = module._get_fsdp_state()._fsdp_param_group
            if group is not None:
                units.append([index[id(fp.sharded_param)] for fp in group.fsdp_params])
    from composer.blocks.kind import KINDS

    by_mixer = {kind.mixer: kind for kind in KINDS.values()}
    kinds = [by_mixer.get(type(layer.mixer)) for layer in model.all_layers()]
    return StageParts(params, units, compute_size, kinds)


def state_copies(opts: list[torch.optim.Optimizer]) -> dict[int, int]:
    """Optimizer state copies of each parameter (by ``id``): 2 under AdamW (its moments), 1
    under Muon (its momentum)."""
    copies = {}
    for opt in opts:
        n = 2 if isinstance(opt, torch.optim.AdamW) else 1
        for group in opt.param_groups:
            for p in group["params"]:
                copies[id(p)] = n
    return copies


def build_rank(cfg: ModelConfig, layout: ParallelConfig, precision: str,
               lora: LoRAConfig | None = None, frozen: Sequence[str] = ()
               ) -> tuple[nn.Module, ParallelDims]:
    """The current (impersonated) rank's model on meta, as training builds it (fp32 masters;
    ``lora``: its adapters, the base frozen; ``frozen``: the ``--freeze`` parts)."""
    from composer.run import build_meta
    from composer.train.vision import freeze

    dims = build_parallel_dims(layout, "cpu")
    dims.precision = "bf16" if precision in ("bf16", "fp8") else "fp32"
    transform = (lambda model: freeze(model, frozen)) if frozen else None
    return build_meta(cfg, dims, dtype=torch.float32, transform=transform, lora=lora), dims


def rank_bytes(cfg: ModelConfig, layout: ParallelConfig, world: int, precision: str = "bf16",
               optimizer: str = "adamw", stages: list[StageParts] | None = None,
               lora: LoRAConfig | None = None, frozen: Sequence[str] = ()
               ) -> list[tuple[int, RankBytes]]:
    """``(stage, bytes)`` of every rank of ``layout`` on ``world`` ranks, in rank order: one
    impersonated construction per stage, the stage's other ranks from their coordinates.
    ``stages``: filled with each stage's :class:`StageParts`; ``lora``, ``frozen``: as
    :func:`build_rank`."""
    compute_size = 2 if precision in ("bf16", "fp8") else 4
    per_stage = world // layout.pp
    out = []
    for stage in range(layout.pp):
        with impersonate(stage * per_stage, world):
            try:
                model, dims = build_rank(cfg, layout, precision, lora, frozen)
            except NotImplementedError as exc:  # what the same layout's training would meet
                first = str(exc).splitlines()[0]
                raise LayoutError(f"rank {stage * per_stage} cannot be built: {first}") from None
            parts = stage_parts(model, optimizer, compute_size)
            parts.dims = dims
            parts.comm = comm_parts(model, dims)
        if stages is not None:
            stages.append(parts)
        out.extend((stage, parts.bytes_at(rank_coords(rank, dims)))
                   for rank in range(stage * per_stage, (stage + 1) * per_stage))
    return out


def rank_classes(cfg: ModelConfig, layout: ParallelConfig, world: int, precision: str = "bf16",
                 optimizer: str = "adamw", stages: list[StageParts] | None = None,
                 lora: LoRAConfig | None = None, frozen: Sequence[str] = ()
                 ) -> list[RankClass]:
    """The distinct rank classes (equal bytes on one stage), by stage, then first rank."""
    seen: dict[tuple, RankClass] = {}
    per_rank = rank_bytes(cfg, layout, world, precision, optimizer, stages, lora, frozen)
    for rank, (stage, b) in enumerate(per_rank):
        key = (stage, *dataclasses.astuple(b))
        if key in seen:
            seen[key].n_ranks += 1
        else:
            seen[key] = RankClass(stage, rank, 1, b)
    return list(seen.values())


def local_bytes(model: nn.Module, optimizers: list[torch.optim.Optimizer] | None = None
                ) -> dict[str, int]:
    """What this rank holds now (``to_local()`` sums): parameters, gradients, optimizer state."""
    def size(t: torch.Tensor | None) -> int:
        if t is None:
            return 0
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.numel() * t.element_size()

    params = list(model.parameters())
    state = 0
    for opt in optimizers or []:
        for s in opt.state.values():
            state += sum(size(v) for v in s.values() if isinstance(v, torch.Tensor))
    return {"params": sum(size(p) for p in params), "grads": sum(size(p.grad) for p in params),
            "optimizer": state}


def built_bytes(model: nn.Module, optimizers: list[torch.optim.Optimizer]) -> dict[str, int]:
    """What a rank built but not yet stepped will hold (``composer train --dry-run``): its
    parameters' ``to_local()`` bytes, a gradient per trainable parameter in its dtype, and its
    optimizers' state, which they create at the first step, counted from their parameter
    groups (:func:`state_copies`; AdamW's ``step`` an fp32 scalar)."""
    copies = state_copies(optimizers)
    params = grads = state = 0
    for p in model.parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        n = local.numel() * local.element_size()
        params += n
        if p.requires_grad:
            grads += n
        k = copies.get(id(p), 0)
        state += k * n + (STEP_BYTES if k == 2 else 0)
    return {"params": params, "grads": grads, "optimizer": state}
