"""Parallelism on torch.distributed (docs/parallelism.md), applied from outside the
single-device blocks: the layout's settings (``layout.py``, no torch) and one named DeviceMesh
(``mesh.py``), tensor + sequence parallel read from the plans the blocks declare (``tensor.py``),
expert parallel on the declared expert groups (``expert.py``), FSDP2 sharded or replicated data
parallel (``data.py``), in the one order of ``parallelize.py``; DCP checkpoints that reshard on
load (``checkpoint.py``). Nothing here imports ``composer.build``.

The names below load lazily (PEP 562): ``composer.parallel.layout`` is read by the CLI's parser,
which must not import torch."""

from __future__ import annotations

from typing import Any

__all__ = ["ParallelConfig", "ParallelDims", "build_parallel_dims"]


def __getattr__(name: str) -> Any:
    if name == "ParallelConfig":
        from composer.parallel.layout import ParallelConfig

        return ParallelConfig
    if name in ("ParallelDims", "build_parallel_dims"):
        from composer.parallel import mesh

        return getattr(mesh, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
