"""Training a vision-language model: the images of a batch, the layouts that take them, and
``--freeze vision|merger|language``.

Images (SFT rows that carry them, :mod:`composer.data.sft`) go to the model's forward with their
micro-batch (:func:`image_inputs`). They train under data parallelism (FSDP2 or replicate) on one
device per rank; tensor, pipeline and context parallelism refuse them (the tower's plan is
declared but not applied, and a stage or a chunk of the sequence does not see every image).

``--freeze`` parts of a vision-language model that do not train:

- ``vision``: the tower but its merger (``visual.*`` but ``visual.merger.*``): the patch
  embedding, the position table and the tower's blocks;
- ``merger``: the patch merger (``visual.merger.*``), the projection into the language model;
- ``language``: everything outside the tower (embedding, layers, MTP depths, final norm, head).

A frozen parameter has no gradient and no optimizer state; the gradient still flows through it
to what trains (``--freeze vision language`` trains the merger alone, the LLaVA stage-1 recipe).
Frozen weights stay exactly as loaded. Applied on the meta device, before parallelisation, so
FSDP2 and the optimizer see the final ``requires_grad``. LoRA freezes the whole base already, so
the two are not combined.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from composer.config import ConfigError, ModelConfig

if TYPE_CHECKING:
    from composer.train.data import Micro
    from composer.train.loop import Run
    from composer.train.recipe import Recipe

PARTS = ("vision", "merger", "language")


def part_of(name: str) -> str:
    """The part a parameter (state-dict name) belongs to."""
    if name.startswith("visual.merger."):
        return "merger"
    return "vision" if name.startswith("visual.") else "language"


def check_vision(recipe: Recipe, cfg: ModelConfig, batches: Any) -> None:
    """Refuse images under tp, pp or cp, and a ``--freeze`` that cannot be (before the mesh)."""
    layout = recipe.parallel
    if getattr(batches, "has_images", False) and max(layout.tp, layout.pp, layout.cp) > 1:
        raise ConfigError("training on images under --tp, --pp or --cp is not built yet (data "
                          "parallelism is: --dp, --dp-mode)")
    check_freeze(recipe.freeze, cfg, bool(recipe.lora_rank or recipe.adapter))


def check_freeze(parts: Sequence[str], cfg: ModelConfig, lora: bool) -> None:
    """Refuse an unknown part, a tower part of a text model, everything frozen, or LoRA."""
    if not parts:
        return
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        raise ConfigError(f"--freeze {unknown[0]!r}: expected some of {', '.join(PARTS)}")
    if cfg.vision is None and set(parts) & {"vision", "merger"}:
        raise ConfigError("--freeze vision/merger: the model has no vision tower (a text model)")
    left = [p for p in PARTS if p not in parts and (p == "language" or cfg.vision is not None)]
    if not left:
        raise ConfigError(f"--freeze {' '.join(parts)}: nothing would train")
    if lora:
        raise ConfigError("--freeze with LoRA (--lora-rank, --adapter): LoRA trains only its "
                          "adapters, the base is frozen already")


def freeze(model: nn.Module, parts: Sequence[str]) -> None:
    """``requires_grad = False`` for every parameter of ``parts``."""
    for name, p in model.named_parameters():
        if part_of(name) in parts:
            p.requires_grad_(False)


def image_inputs(run: Run, micro: list[Micro], training: bool = True) -> dict[str, Any]:
    """The micro-batches' images as ``forward`` keywords. A training batch without images, of
    data that has some, runs the tower on its stand-in while the tower trains
    (:meth:`HybridModel.tower_stand_in`): every rank then reduces the same gradients, whichever
    ranks had the images, and no layout changes the update."""
    grids = [mb.image_grid_thw for mb in micro if mb.image_grid_thw is not None]
    if not grids:
        if not training or not getattr(run.batches, "has_images", False):
            return {}
        visual = getattr(run.model, "visual", None)
        trains = visual is not None and any(p.requires_grad for p in visual.parameters())
        return {"tower_stand_in": True} if trains else {}
    pixels = torch.cat([mb.pixel_values for mb in micro if mb.pixel_values is not None])
    # the grids stay on the host: the positions and the tower's layout are planned from them
    return {"pixel_values": pixels.to(run.dims.device, non_blocking=True),
            "image_grid_thw": torch.cat(grids)}
