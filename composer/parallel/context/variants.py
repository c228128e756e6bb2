"""The context-parallel variant of each time-mixing op, by the strategy name the op declares
(:attr:`composer.blocks.protocol.TimeMixingOp.context`).

A variant is a parameterless module built as ``factory(op, cp)``: it holds the op it replaces
and the :class:`~composer.parallel.context.layout.CPContext`, takes the op's arguments and
returns what the op returns for this rank's tokens (its two chunks, or its adaptive pieces),
exchanging with the other ranks what the strategy needs. Each variant is written once and
serves every kind whose op names it; a kind with an op of its own registers a variant here
with :func:`register_variant`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

VARIANTS: dict[str, Callable[[nn.Module, Any], nn.Module]] = {}


def register_variant(name: str, factory: Callable[[nn.Module, Any], nn.Module]) -> None:
    """Make ``factory(op, cp)`` the context-parallel form of every op whose ``context`` is
    ``name``."""
    VARIANTS[name] = factory


def variant_factory(op: nn.Module) -> Callable[[nn.Module, Any], nn.Module] | None:
    """The factory for ``op``'s declared strategy, or None (no strategy, or none registered)."""
    from composer.parallel.context import attention, recurrent  # noqa: F401  (they register)

    name = getattr(op, "context", None)
    return VARIANTS.get(name) if name is not None else None
