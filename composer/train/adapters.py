"""The LoRA adapters of a training run: new ones (``--lora-rank``, ``--lora-alpha``,
``--lora-dropout``, ``--lora-targets``; :mod:`composer.lora`) or a PEFT adapter folder it starts
from (``--adapter DIR``, converted through the family's converter: ``composer.convert.peft``).

A started adapter fixes the adapters' modules, per-module ranks and scalings; its tensors are
copied into this rank's shards once the model is allocated (a resumed run reads them from its
checkpoint instead, and reads the adapter folder again only for that layout).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from composer.blocks.plan import named_state
from composer.build.init import local_region, local_tensor, stored_as
from composer.config import ConfigError
from composer.lora import LoRAConfig, is_adapter, lora_config


def run_adapters(recipe: Any, resume: Path | None) -> tuple[LoRAConfig | None,
                                                             dict[str, torch.Tensor] | None]:
    """The run's LoRA layout, and the adapter tensors to start from (None: initialised, or
    read from the resumed checkpoint)."""
    if recipe.adapter is None:
        return lora_config(recipe), None
    if recipe.lora_rank:
        raise ConfigError("give --adapter DIR (its adapters train further) or --lora-rank (new "
                          "adapters), not both")
    from composer.convert.peft_folders import adapter_lora_config, training_start

    origin = recipe.origin if isinstance(recipe.origin, str) else None
    if origin is None or not Path(origin).is_dir():
        raise ConfigError(f"--adapter {recipe.adapter}: the adapter's base must be a Hugging "
                          f"Face folder or a portable checkpoint, not {recipe.origin!r}")
    start = training_start(origin, recipe.adapter)
    cfg = adapter_lora_config(start, recipe.lora_dropout)
    return cfg, None if resume is not None else dict(start.tensors)


@torch.no_grad()
def load_adapter_tensors(model: nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy whole adapter tensors (state-dict keys, a fused B whole) into this rank's shards of
    ``model``'s adapters (any layout; a pipeline rank's stages read their own)."""
    used = set()
    for name, t in named_state(model):
        if not is_adapter(name):
            continue
        key, row = stored_as(model, name)
        if key not in tensors:
            raise ConfigError(f"the adapter has no tensor {key!r} for this model")
        offsets, sizes = local_region(t)
        if t.ndim:
            offsets = (offsets[0] + row, *offsets[1:])
        full = tensors[key]
        region = full[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))]
        out = local_tensor(t)
        if tuple(region.shape) != tuple(out.shape):
            raise ConfigError(f"adapter tensor {key!r}: shape {list(full.shape)} does not fit "
                              "the model's adapter")
        out.copy_(region)
        used.add(key)
    if getattr(model, "pipeline", None) is None and used != set(tensors):
        extra = sorted(set(tensors) - used)
        raise ConfigError(f"the adapter's tensor {extra[0]!r} has no place in this model")
