"""Apply the parallel layout to a built model, in one documented order (DESIGN §5):
tensor + sequence parallel, then expert parallel, then data parallel (FSDP2 or replicate).
Pipeline and context parallelism, activation checkpointing and compile will slot in between.

Every rank must hold the same full weights before this runs (build with the same seed, or load
the same portable checkpoint); the plans then keep each rank's shards.
"""

from __future__ import annotations

from torch import nn

from composer.parallel.data import apply_fsdp
from composer.parallel.mesh import ParallelDims
from composer.parallel.tensor import TPContext, apply_tp


def parallelize(model: nn.Module, dims: ParallelDims) -> nn.Module:
    if dims.mesh is None:
        return model
    moes = [layer.mixer for layer in model.layers.values() if hasattr(layer.mixer, "experts")]
    if dims.tp > 1:
        tp_mesh = dims.mesh["tp"]
        apply_tp(model, TPContext(mesh=tp_mesh, group=tp_mesh.get_group(), size=dims.tp,
                                  rank=tp_mesh.get_local_rank(),
                                  sequence_parallel=dims.sequence_parallel,
                                  experts_on_ep=dims.ep > 1))
    if moes and dims.dp > 1:
        from composer.parallel.expert import apply_ep, sum_over

        for moe in moes:
            if dims.ep > 1:
                apply_ep(moe, dims.mesh["ep"], dims.mesh["ep", "tp"] if dims.tp > 1 else None)
            # the load-balancing loss of the global batch, not of each rank's share
            moe.stats_reduce = sum_over(dims.dp_mesh.get_group())
    if dims.dp > 1 and dims.dp_mode == "shard":
        apply_fsdp(model, dims)
    model.parallel_dims = dims
    return model
