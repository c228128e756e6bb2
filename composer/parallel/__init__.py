"""Parallelism on torch.distributed (DESIGN §5): one named DeviceMesh, tensor + sequence parallel
(DTensor plans declared next to each block), expert parallel (all-to-all), sharded or replicated
data parallel (FSDP2), DCP checkpoints that reshard on load."""

from composer.parallel.mesh import ParallelConfig, ParallelDims, build_parallel_dims

__all__ = ["ParallelConfig", "ParallelDims", "build_parallel_dims"]
