"""The parallel layout and its one DeviceMesh.

``world = pp * dp * cp * tp``; ``dp`` fills whatever the other sizes leave. Experts are spread over
the data-parallel ranks (``ep`` divides ``dp * cp``, as in Megatron-Core and torchtitan): the dp
dimension is split into ``dp_outer x ep`` so that ``mesh["ep"]`` holds the ranks that share one
batch of routed tokens and ``mesh["dp_outer"]`` the replicas of one expert. Pipeline
parallelism (``pp``) is the outermost dimension (:mod:`composer.parallel.pipeline`). Context
parallelism (``cp``, :mod:`composer.parallel.context`) splits each sequence over its ranks,
which read the same rows: for the data they are one data-parallel rank, for the gradients
(FSDP2 over ``dp x cp``, the flattened ``"dp_cp"``) and the MoE load statistics they are
``cp`` more, as in Megatron-Core.

Mesh dimensions (always all present, sizes may be 1): ``("dp_outer", "ep", "cp", "tp")``,
with ``"pp"`` in front when ``pp > 1``, plus the flattened ``"dp"`` (= dp_outer x ep: the
data shards) and ``"dp_cp"`` (dp x cp: what data parallelism shards the weights over).

HSDP (``dp_replicate = R > 1``): the ``dp x cp`` ranks are unflattened into a 2-D
``(dp_replicate, dp_shard)`` mesh (``ParallelDims.shard_mesh``; ``dp_shard = dp * cp / R``),
the replica index outermost: ``R`` groups of consecutive data-parallel ranks, each holding one
whole copy of the weights sharded over its ``dp_shard`` ranks (FSDP2: ``Replicate`` on dim 0,
``Shard`` on dim 1), as Megatron's distributed optimizer and torchtitan shard within a node
and replicate across nodes. ``R`` divides ``dp_outer`` (ep's and cp's ranks lie within one
replica group), so the expert replicas split the same way (``ParallelDims.expert_mesh``).
Which rows a rank reads does not change: ``dp`` is still every data-parallel rank.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from composer.blocks.plan import LayoutRule
from composer.parallel.layout import LAYOUT_KEYS, ParallelConfig
from composer.settings import ConfigError, check

__all__ = ["LayoutError", "ParallelConfig", "ParallelDims", "build_parallel_dims",
           "check_layout", "check_replicas", "resolve_device", "resolve_layout"]


class LayoutError(ConfigError):
    """A parallel layout that cannot work for this world size or model; one line."""


@dataclass
class ParallelDims:
    """The mesh facts of a resolved layout: the sizes of its dimensions (``dp`` filled in),
    its meshes and the contexts applied on them. The settings it was built from are ``config``;
    they read through as attributes too (``dims.ac`` is ``dims.config.ac``), so that nothing
    is declared twice."""

    config: ParallelConfig
    """The layout's settings, with ``dp`` resolved."""
    world_size: int
    tp: int = 1
    ep: int = 1
    dp: int = 1
    pp: int = 1
    cp: int = 1
    mesh: DeviceMesh | None = None
    dp_mesh: DeviceMesh | None = None
    """The flattened ``dp_outer x ep`` dimension (kept here: slicing it from the root mesh is
    deprecated): the ranks that read different rows."""
    device: torch.device = torch.device("cpu")
    """Where this rank's tensors live (``cuda:LOCAL_RANK`` with NCCL, the CPU with gloo)."""
    precision: str = "fp32"
    """``bf16``: data parallel gathers bf16 copies of the fp32 master weights for compute and
    reduces gradients in fp32 (FSDP2 ``MixedPrecisionPolicy``); the trainer sets it from the
    recipe's ``precision`` once the device is known."""
    tp_context: Any = None
    cp_context: Any = None
    """The context-parallel context (set by ``apply_cp``), or None."""
    """The tensor-parallel state once applied (``composer.parallel.tensor.TPContext``)."""
    pp_mesh: DeviceMesh | None = None
    tied_group: Any = None
    """With ``pp > 1``: this rank and its counterpart on the other end of the pipeline (the
    first and last pipeline ranks at the same dp / tp position), which hold the two copies of
    tied embeddings; None elsewhere."""
    cp_mesh: DeviceMesh | None = None
    fsdp_mesh: DeviceMesh | None = None
    """``dp x cp`` flattened (``dp_mesh`` when ``cp = 1``): data parallelism's ranks, and the
    group over which the MoE load statistics are summed."""
    shard_mesh: DeviceMesh | None = None
    """What FSDP2 wraps the units over: ``fsdp_mesh``, or under HSDP its 2-D
    ``(dp_replicate, dp_shard)`` view (module docstring)."""
    expert_mesh: DeviceMesh | None = None
    """The routed experts' replicas (``mesh["dp_outer"]``), under HSDP as a 2-D
    ``(dp_replicate, dp_shard)`` view: what expert FSDP wraps them over."""

    def __getattr__(self, name: str) -> Any:
        # only reached for names that are not fields: the layout's other settings
        config = self.__dict__.get("config")
        if config is not None and name in LAYOUT_KEYS:
            return getattr(config, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def grad_replicas(self) -> int:
        """The ranks whose gradients data parallelism averages: ``dp x cp``."""
        return self.dp * self.cp

    @property
    def dp_outer(self) -> int:
        return self.dp // self.ep

    @property
    def dp_replicate(self) -> int:
        return self.config.dp_replicate

    @property
    def dp_shard(self) -> int:
        """The ranks one copy of the weights is sharded over: ``dp x cp / dp_replicate``."""
        return self.grad_replicas // self.dp_replicate

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    def dp_rank(self) -> int:
        return self.dp_mesh.get_local_rank() if self.dp_mesh is not None else 0

    def tp_rank(self) -> int:
        return self.mesh["tp"].get_local_rank() if self.mesh is not None else 0

    def pp_rank(self) -> int:
        return self.pp_mesh.get_local_rank() if self.pp_mesh is not None else 0

    def cp_rank(self) -> int:
        return self.cp_mesh.get_local_rank() if self.cp_mesh is not None else 0


def resolve_layout(pc: ParallelConfig, world_size: int) -> ParallelDims:
    """Check sizes against the world; one-line :class:`LayoutError` otherwise."""
    try:
        check(pc)
    except ConfigError as exc:
        raise LayoutError(f"--{exc}") from None  # "--ac must be one of ..."
    for name in ("tp", "ep", "pp", "cp"):
        if getattr(pc, name) < 1:
            raise LayoutError(f"--{name} must be >= 1, got {getattr(pc, name)}")
    if pc.cp > 1 and pc.ep > 1:
        raise LayoutError("--cp with --ep is not built yet: experts are spread over dp only, "
                          "so use --ep 1 with context parallelism")
    fixed = pc.tp * pc.pp * pc.cp
    if world_size % fixed:
        raise LayoutError(f"world size {world_size} is not a multiple of tp*pp*cp = {fixed}")
    dp = pc.dp if pc.dp is not None else world_size // fixed
    if dp < 1 or dp * fixed != world_size:
        raise LayoutError(f"dp*tp*pp*cp = {dp * fixed} does not equal the world size "
                          f"{world_size} (dp={dp}, tp={pc.tp})")
    if dp % pc.ep:
        raise LayoutError(f"ep ({pc.ep}) must divide dp ({dp}): experts are spread over the "
                          "data-parallel ranks")
    check_replicas(pc, dp)
    return ParallelDims(config=dataclasses.replace(pc, dp=dp), world_size=world_size,
                        tp=pc.tp, ep=pc.ep, dp=dp, pp=pc.pp, cp=pc.cp)


def check_replicas(pc: ParallelConfig, dp: int) -> None:
    """HSDP's sizes: ``R`` divides ``dp / ep`` (an ep group lies within one replica group), and
    only the sharded mode has shards to replicate; a pipeline reduces once per step (its
    schedule's last backward), so ``--grad-sync every`` is refused with ``pp > 1``."""
    r = pc.dp_replicate
    if r < 1:
        raise LayoutError(f"--dp-replicate must be >= 1, got {r}")
    if pc.grad_sync == "every" and pc.pp > 1:
        raise LayoutError("--grad-sync every with --pp > 1: the pipeline schedule reduces the "
                          "gradients once per step, after its last backward")
    if r == 1:
        return
    if pc.dp_mode != "shard":
        raise LayoutError(f"--dp-replicate {r} needs --dp-mode shard (replicate already keeps "
                          "a whole copy on every rank)")
    if dp % r:
        raise LayoutError(f"--dp-replicate ({r}) must divide dp ({dp})")
    if (dp // pc.ep) % r:
        raise LayoutError(f"--dp-replicate ({r}) must divide dp / ep ({dp} / {pc.ep}): an "
                          "expert-parallel group lies within one replica group")


def check_layout(dims: ParallelDims, rules: Iterable[LayoutRule]) -> None:
    """Every divisibility rule the model's kinds declare (heads, groups, widths, experts by tp
    and ep); the first broken one as a one-line :class:`LayoutError`."""
    sizes = {"tp": dims.tp, "ep": dims.ep, "dp": dims.dp, "cp": dims.cp, "pp": dims.pp}
    for rule in rules:
        problem = rule.problem(sizes)
        if problem:
            raise LayoutError(problem)


def resolve_device(name: str = "auto") -> torch.device:
    """``auto``: CUDA when available; under torchrun each rank takes ``cuda:LOCAL_RANK``."""
    if name not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"--device must be auto, cpu or cuda; got {name!r}")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is available")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))


def build_parallel_dims(pc: ParallelConfig, device: str | torch.device | None = None
                        ) -> ParallelDims:
    """Resolve the layout for the current process group and build the mesh (if world > 1).

    ``device``: ``auto``/``cpu``/``cuda`` or a device; by default the process group's (CUDA
    under NCCL, else the CPU) or, without one, ``auto``."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    dims = resolve_layout(pc, world)
    if device is None:
        nccl = dist.is_initialized() and dist.get_backend() == "nccl"
        device = "cuda" if nccl else ("cpu" if dist.is_initialized() else "auto")
    dims.device = resolve_device(device) if isinstance(device, str) else torch.device(device)
    if world > 1:
        if (dims.device.type == "cuda") != (dist.get_backend() == "nccl"):
            raise LayoutError(f"device {dims.device} does not match the process group's "
                              f"{dist.get_backend()} backend (NCCL for CUDA, gloo for the CPU)")
        shape, names = (dims.dp_outer, dims.ep, dims.cp, dims.tp), ("dp_outer", "ep", "cp", "tp")
        if dims.pp > 1:
            shape, names = (dims.pp, *shape), ("pp", *names)
        mesh = init_device_mesh(dims.device.type, shape, mesh_dim_names=names)
        if dims.pp > 1:
            dims.pp_mesh = mesh["pp"]
            dims.tied_group = _tied_group(mesh, dims.pp)
        dims.dp_mesh = mesh["dp_outer", "ep"]._flatten("dp")
        dims.cp_mesh = mesh["cp"]
        dims.fsdp_mesh = (mesh["dp_outer", "ep", "cp"]._flatten("dp_cp") if dims.cp > 1
                          else dims.dp_mesh)
        dims.shard_mesh, dims.expert_mesh = dims.fsdp_mesh, mesh["dp_outer"]
        if dims.dp_replicate > 1:
            names = ("dp_replicate", "dp_shard")
            r = dims.dp_replicate
            dims.shard_mesh = dims.fsdp_mesh._unflatten(0, (r, dims.dp_shard), names)
            dims.expert_mesh = dims.expert_mesh._unflatten(0, (r, dims.dp_outer // r), names)
        dims.mesh = mesh
    return dims


def _tied_group(mesh: DeviceMesh, pp: int) -> Any:
    """Every rank creates every (first, last) pipeline pair's group, in the same order; returns
    this rank's, or None when it is in the middle of the pipeline."""
    ranks = mesh.mesh.reshape(pp, -1)
    mine = None
    for col in range(ranks.shape[1]):
        pair = [int(ranks[0, col]), int(ranks[pp - 1, col])]
        group = dist.new_group(pair)
        if dist.get_rank() in pair:
            mine = group
    return mine
