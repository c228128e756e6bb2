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
LORA_MARK = ".lora."
"""Adapter tensors (``<base>.lora.A.weight``, ``.lora.B.weight``) have this in their names."""


Install = Callable[[torch.nn.Module, Path], dict[str, float]]
"""Adds a LoRA run's adapter modules to its meta model; returns each adapted base's scaling
(:func:`composer.convert.peft_folders.lora_modules`: the glue to ``composer.lora``, which
lives above this module: ``composer.convert`` imports ``composer.export``, not the reverse)."""


class Saved:
    """The newest step of a run: its config, meta model (with its LoRA modules when it has
    adapters), and where each state-dict key's parts are saved."""

    def __init__(self, run: Path, install: Install | None = None) -> None:
        """``install``: how to add a LoRA run's adapter modules; without it, a LoRA run is
        refused (a plain export would drop its adapters)."""
        if not is_training_checkpoint(run):
            raise ConfigError(f"{run}: not a training checkpoint folder (no 'latest' file); "
                              "`composer train --save` writes one")
        self.run, self.step_dir = run, latest_step(run)
        self.cfg = ModelConfig.load(run / CONFIG_FILE).validate()
        self.meta = FileSystemReader(str(self.step_dir)).read_metadata().state_dict_metadata
        self.lora = any(LORA_MARK in k for k in self.meta)
        if self.lora and install is None:
            raise ConfigError(f"{run}: a LoRA run; a plain export would drop its adapters: use "
                              "--adapter (a PEFT adapter folder) or --merge (merged weights)")
        self.model = build_model(self.cfg, device="meta")
        self.scalings: dict[str, float] = {}
        if self.lora and install is not None:
            self.scalings = install(self.model, run)
        self.parts: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
        for name, t in named_state(self.model):
            key, _ = stored_as(self.model, name)
            if f"model.{name}" not in self.meta:
                raise ConfigError(f"{self.step_dir}: no tensor {name!r}; the checkpoint does not "
                                  f"match {run / CONFIG_FILE}")
            self.parts.setdefault(key, []).append((name, tuple(t.shape)))
        self.dtypes = {key: self.meta[f"model.{names[0][0]}"].properties.dtype
                       for key, names in self.parts.items()}
        self.shapes = {k: tuple(v.shape) for k, v in self.model.state_dict().items()}

    def keys(self, adapters: bool) -> list[str]:
        """The state-dict keys of the base model, or of its adapters."""
        return [k for k in self.shapes if (LORA_MARK in k) == adapters]

    def stream(self, keys: list[str], progress: Callable[[int], None] | None = None
               ) -> Iterator[tuple[str, torch.Tensor]]:
        """Each key's tensor, read with DCP in groups of at most ``GROUP_BYTES``."""
        group: list[str] = []
        size = 0
        for i, key in enumerate(keys):
            group.append(key)
            size += self.dtypes[key].itemsize * torch.Size(self.shapes[key]).numel()
            if size < GROUP_BYTES and i + 1 < len(keys):
                continue
            wanted = {name: torch.empty(shape, dtype=self.dtypes[k])
                      for k in group for name, shape in self.parts[k]}
            dcp.load({"model": wanted}, checkpoint_id=str(self.step_dir))  # one process
            for k in group:
                pieces = [wanted.pop(name) for name, _ in self.parts[k]]
                t = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=0)
                if progress is not None:
                    progress(t.numel() * t.element_size())
                yield k, t
            group, size = [], 0

    def adapters(self) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """The adapter tensors (``<base>.lora.A.weight``, ``.lora.B.weight``) and scalings."""
        return dict(self.stream(self.keys(adapters=True))), dict(self.scalings)


def export(run: str | Path, out: str | Path, force: bool = False,
           max_shard_bytes: int = DEFAULT_MAX_SHARD,
           progress: Callable[[int], None] | None = None, install: Install | None = None
           ) -> Path:
    """Write the newest step of the training checkpoint folder ``run`` as a portable checkpoint
    at ``out`` (``config.yaml`` + ``model.safetensors``, sharded with an index when large), with
    the run's ``tokenizer/`` when it has one. A LoRA run needs ``install`` (its adapter
    modules, :data:`Install`): each adapted weight is written merged, ``W + s B A`` (in fp32,
    cast back), without adapter tensors."""
    run = Path(run)
    saved = Saved(run, install)
    keys = saved.keys(adapters=False)
    plan = [(key, saved.dtypes[key], saved.shapes[key]) for key in keys]
    lora, scalings = saved.adapters() if saved.lora else ({}, {})

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for key, t in saved.stream(keys, progress):
            base = key.removesuffix(".weight")
            a, b = lora.get(base + ".lora.A.weight"), lora.get(base + ".lora.B.weight")
            if a is not None and b is not None:
                t = (t.float() + scalings[base] * (b.float() @ a.float())).to(t.dtype)
            yield key, t

    extra = {TOKENIZER_DIR: run / TOKENIZER_DIR} if (run / TOKENIZER_DIR).is_dir() else None
    return write_portable(out, saved.cfg, plan, tensors(), force, max_shard_bytes,
                          extra_dirs=extra)
