"""The parallel layout and its one DeviceMesh.

``world = pp * dp * cp * tp``; ``dp`` fills whatever the other sizes leave. Experts are spread over
the data-parallel ranks (``ep`` divides ``dp * cp``, as in Megatron-Core and torchtitan): the dp
dimension is split into ``dp_outer x ep`` so that ``mesh["ep"]`` holds the ranks that share one
batch of routed tokens and ``mesh["dp_outer"]`` the replicas of one expert. Pipeline and context
parallelism are reserved: their sizes exist and must be 1 for now.

Mesh dimensions (always all present, sizes may be 1): ``("dp_outer", "ep", "tp")``, plus the
flattened ``"dp"`` (= dp_outer x ep) used by data parallelism for non-expert parameters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from composer.config import ConfigError, ModelConfig


class LayoutError(ConfigError):
    """A parallel layout that cannot work for this world size or model; one line."""


@dataclass
class ParallelConfig:
    tp: int = 1
    ep: int = 1
    dp: int | None = None
    """``None`` fills the world: ``world // (pp * cp * tp)``."""
    dp_mode: Literal["shard", "replicate"] = "shard"
    sequence_parallel: bool = True
    pp: int = 1
    cp: int = 1


@dataclass
class ParallelDims:
    tp: int
    ep: int
    dp: int
    dp_mode: str
    sequence_parallel: bool
    world_size: int
    mesh: DeviceMesh | None = None
    dp_mesh: DeviceMesh | None = None
    """The flattened ``dp_outer x ep`` dimension (kept here: slicing it from the root mesh is
    deprecated)."""

    @property
    def dp_outer(self) -> int:
        return self.dp // self.ep

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    def dp_rank(self) -> int:
        return self.dp_mesh.get_local_rank() if self.dp_mesh is not None else 0

    def tp_rank(self) -> int:
        return self.mesh["tp"].get_local_rank() if self.mesh is not None else 0


def resolve_layout(pc: ParallelConfig, world_size: int) -> ParallelDims:
    """Check sizes against the world; one-line :class:`LayoutError` otherwise."""
    for name in ("tp", "ep", "pp", "cp"):
        if getattr(pc, name) < 1:
            raise LayoutError(f"--{name} must be >= 1, got {getattr(pc, name)}")
    if pc.pp != 1 or pc.cp != 1:
        raise LayoutError("pipeline (--pp) and context (--cp) parallelism are not built yet; "
                          "use 1")
    fixed = pc.tp * pc.pp * pc.cp
    if world_size % fixed:
        raise LayoutError(f"world size {world_size} is not a multiple of tp*pp*cp = {fixed}")
    dp = pc.dp if pc.dp is not None else world_size // fixed
    if dp < 1 or dp * fixed != world_size:
        raise LayoutError(f"dp*tp*pp*cp = {dp * fixed} does not equal the world size "
                          f"{world_size} (dp={dp}, tp={pc.tp})")
    if (dp * pc.cp) % pc.ep:
        raise LayoutError(f"ep ({pc.ep}) must divide dp*cp ({dp * pc.cp}): experts are spread "
                          "over the data-parallel ranks")
    return ParallelDims(tp=pc.tp, ep=pc.ep, dp=dp, dp_mode=pc.dp_mode,
                        sequence_parallel=pc.sequence_parallel, world_size=world_size)


def check_model(dims: ParallelDims, cfg: ModelConfig) -> None:
    """Divisibility of the model's heads, groups and experts by the layout."""
    tp, symbols = dims.tp, set(cfg.parsed.layers)
    checks: list[tuple[str, int, int]] = []
    if "*" in symbols and cfg.attention is not None:
        a = cfg.attention
        kv = a.n_kv_heads or a.n_heads
        checks.append(("attention.n_heads", a.n_heads, tp))
        if kv % tp and tp % kv:
            raise LayoutError(f"attention.n_kv_heads ({kv}) and tp ({tp}) must divide one "
                              "another (kv heads are split, or replicated when fewer than tp)")
    if "M" in symbols and cfg.mamba is not None:
        checks += [("mamba.n_heads", cfg.mamba.n_heads, tp),
                   ("mamba.n_groups", cfg.mamba.n_groups, tp)]
        if cfg.mamba.norm_group_size is not None:
            d_inner = cfg.mamba.n_heads * cfg.mamba.d_head
            if (d_inner // tp) % cfg.mamba.norm_group_size:
                raise LayoutError(f"mamba.norm_group_size ({cfg.mamba.norm_group_size}) must "
                                  f"divide the per-rank inner width ({d_inner // tp})")
    if "-" in symbols and cfg.mlp is not None:
        checks.append(("mlp.d_ff", cfg.mlp.d_ff, tp))
    if "E" in symbols and cfg.moe is not None:
        checks += [("moe.n_experts", cfg.moe.n_experts, dims.ep), ("moe.d_ff", cfg.moe.d_ff, tp)]
        if cfg.moe.n_shared_experts:
            shared = cfg.moe.d_ff_shared or cfg.moe.d_ff * cfg.moe.n_shared_experts
            checks.append(("the shared-expert width", shared, tp))
    for what, value, size in checks:
        if value % size:
            dim = "ep" if what == "moe.n_experts" else "tp"
            raise LayoutError(f"{what} ({value}) is not divisible by {dim} ({size})")


def build_parallel_dims(pc: ParallelConfig, cfg: ModelConfig | None = None) -> ParallelDims:
    """Resolve the layout for the current process group and build the mesh (if world > 1)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    dims = resolve_layout(pc, world)
    if cfg is not None:
        check_model(dims, cfg)
    if world > 1:
        device = "cuda" if torch.cuda.is_available() and dist.get_backend() == "nccl" else "cpu"
        mesh = init_device_mesh(device, (dims.dp_outer, dims.ep, dims.tp),
                                mesh_dim_names=("dp_outer", "ep", "tp"))
        dims.dp_mesh = mesh["dp_outer", "ep"]._flatten("dp")
        dims.mesh = mesh
    return dims
