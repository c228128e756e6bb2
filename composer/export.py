"""``composer export RUN OUT``: a training checkpoint (DCP, any layout) -> a portable checkpoint.

Streams: the model is built on the meta device only for its keys, shapes and the layout of its
fused tensors; tensors are read from the newest step with DCP in groups of at most
``GROUP_BYTES`` (DCP reassembles each from whatever shards the saving layout wrote), fused where
the portable format fuses them (Mamba's ``in_proj``/``conv1d`` parts), and written one after the
other through the portable writer into a temporary folder renamed into place when complete.
Memory stays bounded by a group plus one tensor, never the model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from composer.blocks.plan import named_state
from composer.build.builder import build_model, write_portable
from composer.build.init import stored_as
from composer.config import ConfigError, ModelConfig
from composer.data.tokenizer import TOKENIZER_DIR
from composer.parallel.checkpoint import is_training_checkpoint, latest_step
from composer.portable import CONFIG_FILE, DEFAULT_MAX_SHARD

GROUP_BYTES = 256 * 2**20


def export(run: str | Path, out: str | Path, force: bool = False,
           max_shard_bytes: int = DEFAULT_MAX_SHARD,
           progress: Callable[[int], None] | None = None) -> Path:
    """Write the newest step of the training checkpoint folder ``run`` as a portable checkpoint
    at ``out`` (``config.yaml`` + ``model.safetensors``, sharded with an index when large), with
    the run's ``tokenizer/`` when it has one."""
    run = Path(run)
    if not is_training_checkpoint(run):
        raise ConfigError(f"{run}: not a training checkpoint folder (no 'latest' file); "
                          "`composer train --save` writes one")
    step_dir = latest_step(run)
    cfg = ModelConfig.load(run / CONFIG_FILE).validate()
    model = build_model(cfg, device="meta")
    saved = FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata
    parts: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
    for name, t in named_state(model):
        key, _ = stored_as(model, name)
        if f"model.{name}" not in saved:
            raise ConfigError(f"{step_dir}: no tensor {name!r}; the checkpoint does not match "
                              f"{run / CONFIG_FILE}")
        parts.setdefault(key, []).append((name, tuple(t.shape)))
    dtypes = {key: saved[f"model.{names[0][0]}"].properties.dtype for key, names in parts.items()}
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    plan = [(key, dtypes[key], shapes[key]) for key in shapes]

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        group: list[str] = []
        size = 0
        for i, key in enumerate(shapes):
            group.append(key)
            size += dtypes[key].itemsize * torch.Size(shapes[key]).numel()
            if size < GROUP_BYTES and i + 1 < len(shapes):
                continue
            wanted = {name: torch.empty(shape, dtype=dtypes[k])
                      for k in group for name, shape in parts[k]}
            dcp.load({"model": wanted}, checkpoint_id=str(step_dir))  # one process
            for k in group:
                pieces = [wanted.pop(name) for name, _ in parts[k]]
                t = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=0)
                if progress is not None:
                    progress(t.numel() * t.element_size())
                yield k, t
            group, size = [], 0

    extra = {TOKENIZER_DIR: run / TOKENIZER_DIR} if (run / TOKENIZER_DIR).is_dir() else None
    return write_portable(out, cfg, plan, tensors(), force, max_shard_bytes, extra_dirs=extra)
