"""Parallelism on torch.distributed (docs/parallelism.md), applied from outside the
single-device blocks:
one named DeviceMesh (``mesh.py``), tensor + sequence parallel read from the plans the blocks
declare (``tensor.py``), expert parallel on the declared expert groups (``expert.py``), FSDP2
sharded or replicated data parallel (``data.py``), in the one order of ``parallelize.py``; DCP
checkpoints that reshard on load (``checkpoint.py``). Nothing here imports ``composer.specs``."""

from composer.parallel.mesh import ParallelConfig, ParallelDims, build_parallel_dims

__all__ = ["ParallelConfig", "ParallelDims", "build_parallel_dims"]
