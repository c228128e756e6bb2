"""Shared layers: the pattern's ``{a:T}`` ... ``{a}`` (docs/patterns.md), one set of weights at
several depths.

Every use of label ``a`` is built as its layer would be; then the *shared part* of the first
use is kept once, as ``model.shared[a]`` (state-dict keys ``shared.a.*``), and every use reaches
it as a plain attribute, not a registered submodule. So the part is stored once, counted once,
initialised once, and autograd sums its gradient over the uses; everything that walks the
registered modules (casts, ``to``, state dicts, optimizers) sees it once.

The shared part is the whole layer, its norm and mixer (``shared.a.norm.weight``,
``shared.a.mixer.*``), unless the kind's mixer class declares ``shared_part = "name"``: then
only ``mixer.<name>`` is shared (``shared.a.*`` is that module) and the rest of each use's
mixer is its own (Zamba2's shared transformer block with per-site adapters). Each use keeps its
own layer index, decoding state and post-norm placement.

Parallelism (``composer/parallel/``): tensor parallelism shards each distinct module once;
context parallelism swaps each distinct mixer's ops once; a pipeline stage that uses a label
holds a copy and the copies' gradients are summed after every backward (they start equal and
stay equal, like the tied embedding); FSDP leaves the shared parts in the root unit.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from composer.blocks.protocol import declared


class SharedLayer(nn.Module):
    """``shared.a.norm.weight`` and ``shared.a.mixer.*``: a whole layer shared by its uses."""

    def __init__(self, norm: nn.Module, mixer: nn.Module) -> None:
        super().__init__()
        self.norm = norm
        self.mixer = mixer


def refer(module: nn.Module, name: str, target: nn.Module) -> None:
    """Make ``module.name`` the shared ``target`` without registering it as a submodule."""
    module._modules.pop(name, None)
    object.__setattr__(module, name, target)


def share_layers(cfg: Any, layers: dict[int, nn.Module]) -> dict[str, nn.Module]:
    """Point every use of each shared label at its first use's shared part; returns label ->
    part (what ``HybridModel.shared`` registers)."""
    out: dict[str, nn.Module] = {}
    for label, uses in cfg.parsed.shared_uses().items():
        first = layers[uses[0]]
        part = declared(first.mixer, "shared_part")
        if part is None:
            owner = SharedLayer(first.norm, first.mixer)
            for i in uses:
                refer(layers[i], "norm", owner.norm)
                refer(layers[i], "mixer", owner.mixer)
        else:
            owner = getattr(first.mixer, part)
            for i in uses:
                refer(layers[i].mixer, part, owner)
        for i in uses:
            layers[i].shared_label = label
        out[label] = owner
    return out


def distinct(modules: list[nn.Module]) -> list[nn.Module]:
    """``modules`` without repeats (a shared layer's uses share their mixer), in order."""
    seen: set[int] = set()
    out = []
    for m in modules:
        if id(m) not in seen:
            seen.add(id(m))
            out.append(m)
    return out
