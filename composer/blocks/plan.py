"""What a block declares about itself, as data, for the code that acts on it from outside.

Blocks are single-device modules (docs/architecture.md): their forward knows nothing of
meshes, ranks or collectives. Next to its code each block declares

- its **initialisation** (:meth:`init_rules`): parameter name -> :class:`Init`, so that the
  builder can initialise any shard of any parameter without the block's help, identically
  whatever the layout (``composer/build/init.py``);
- its **parallel plan** (:class:`ParallelPlan`, from ``parallel_plan()``): which weights split by
  rows or columns, per-part splits of fused projections, replicated weights whose gradients are
  partial sums, its expert group, and the statistics that must cover the global batch.
  ``composer/parallel/`` reads it and applies it with hooks and module swaps that live there;
- its **layout rules** (``layout_rules(cfg)``): divisibility of its heads, groups, widths and
  experts by the parallel sizes, checked before anything is built.

Names in rules and plans are relative to the declaring module and may use ``fnmatch`` globs
(``"in_proj.weight_*"``). Nested modules declare their own (an MoE's shared-expert MLP uses the
MLP's plan); when two modules on a parameter's path both name it, the outer one wins.
"""

from __future__ import annotations

import abc
import fnmatch
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import torch
from torch import nn

from composer.blocks.protocol import init_rules_of

# ---------------------------------------------------------------- initialisation


class Init(abc.ABC):
    """Fills a tensor in place from a generator; element by element independent, so that any
    block of rows can be filled on its own (the builder fills a parameter in row blocks, each
    from its own generator)."""

    @abc.abstractmethod
    def fill(self, t: torch.Tensor, generator: torch.Generator | None) -> None:
        """Fill ``t`` in place."""


@dataclass(frozen=True)
class Normal(Init):
    std: float
    mean: float = 0.0

    def fill(self, t: torch.Tensor, generator: torch.Generator | None) -> None:
        nn.init.normal_(t, self.mean, self.std, generator=generator)


@dataclass(frozen=True)
class Uniform(Init):
    low: float
    high: float

    def fill(self, t: torch.Tensor, generator: torch.Generator | None) -> None:
        nn.init.uniform_(t, self.low, self.high, generator=generator)


@dataclass(frozen=True)
class Constant(Init):
    value: float

    def fill(self, t: torch.Tensor, generator: torch.Generator | None) -> None:
        nn.init.constant_(t, self.value)


ZEROS, ONES = Constant(0.0), Constant(1.0)


def find_rule(rules: Mapping[str, object], name: str) -> object | None:
    """The value of the first key of ``rules`` that equals or glob-matches ``name``."""
    if name in rules:
        return rules[name]
    for key, value in rules.items():
        if fnmatch.fnmatchcase(name, key):
            return value
    return None


def init_module(module: nn.Module, generator: torch.Generator | None = None) -> None:
    """Initialise ``module``'s own parameters and persistent buffers from its declared rules, in
    state-dict order from one generator (a unit-test convenience: the builder uses the
    layout-independent per-parameter generators of ``composer/build/init.py``)."""
    with torch.no_grad():
        for name, t in named_state(module):
            rule = rule_for(module, name)
            if rule is None:
                raise ValueError(f"{type(module).__name__}: no initialisation declared for "
                                 f"{name!r} (add it to init_rules())")
            rule.fill(t, generator)


def named_state(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Parameters and persistent buffers, by name (what a checkpoint holds)."""
    out: list[tuple[str, torch.Tensor]] = list(module.named_parameters())
    for prefix, sub in module.named_modules():
        for name, buf in sub.named_buffers(recurse=False):
            if name not in sub._non_persistent_buffers_set:
                out.append((f"{prefix}.{name}" if prefix else name, buf))
    return out


def rule_for(root: nn.Module, name: str) -> Init | None:
    """The rule for ``name`` (relative to ``root``): outermost declaring module first."""
    parts = name.split(".")
    module = root
    for i in range(len(parts)):
        rules = init_rules_of(module)
        rule = find_rule(rules, ".".join(parts[i:]))
        if rule is not None:
            return rule  # type: ignore[return-value]
        if i + 1 < len(parts):
            module = getattr(module, parts[i])
    return None


# ---------------------------------------------------------------- parallel plans


@dataclass(frozen=True)
class ParallelPlan:
    """How a block splits over the tensor-parallel ranks (Megatron-LM's column/row parallel) and
    which of its parts expert parallelism acts on. Names are relative to the block.

    Activations enter a block replicated over ``tp`` (the parallel layer gathers the sequence
    first under sequence parallel) and leave as partial sums (the parallel layer reduces them).
    """

    colwise: tuple[str, ...] = ()
    """``nn.Linear`` submodules whose output features split (weight and bias ``Shard(0)``)."""
    rowwise: tuple[str, ...] = ()
    """``nn.Linear`` submodules whose input features split (weight ``Shard(1)``); their outputs
    are partial sums, their bias is added once."""
    heads: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    """Column-parallel ``nn.Linear`` submodules whose output is ``n`` heads (value: ``n``): split
    when ``tp`` divides ``n``; when ``n`` divides ``tp`` the weight is replicated and each rank
    keeps the head its query heads share (grouped-query attention with few kv heads)."""
    shard: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    """Other parameters (globs) -> the dimension they split along (``Shard(dim)``)."""
    partial: tuple[str, ...] = ()
    """Replicated parameters (globs) whose per-rank gradients are partial sums over ``tp``."""
    experts: str | None = None
    """The submodule holding the routed experts: its ``forward(x_AD, n_tokens_E)`` takes rows
    sorted by expert, and its parameters have the expert on dim 0 (expert parallel splits it)."""
    expert_hidden: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    """Expert weights (names inside ``experts``) -> their hidden dimension, split over ``tp``."""
    expert_partial: tuple[str, ...] = ()
    """Expert parameters (names inside ``experts``) that the experts add to the partial sums of
    their split hidden units (the down-projection bias): replicated over ``tp`` and counted once,
    as a row-parallel bias is (tp rank 0 reads them, the others read zeros), so that their
    per-rank gradients are partial sums over ``tp``."""
    token_sums: tuple[str, ...] = ()
    """:class:`TokenSum` submodules: sums over tokens that must cover the global batch."""
    local_sums: tuple[str, ...] = ()
    """:class:`TokenSum` submodules: sums over this rank's own tokens (whole sequences, e.g.
    per-sequence statistics), which every tensor-parallel rank computes whole."""
    partial_sums: tuple[str, ...] = ()
    """:class:`PartialSum` submodules: points inside the block where a row-parallel output
    (a partial sum over ``tp``) must be whole before the block goes on (a norm, a second
    sub-layer)."""


class TokenSum(nn.Module):
    """The identity on one device. It marks statistics summed over tokens (expert counts, summed
    router probabilities) that must cover the whole batch: the parallel layer replaces it by a
    differentiable sum over the ranks that hold the batch's other tokens."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class PartialSum(nn.Module):
    """The identity on one device. It marks a tensor inside a block that tensor parallelism
    leaves as partial sums (the output of a row-parallel projection) where the block's math
    needs it whole: a block that chains sub-layers inside one mixer (Zamba2's shared block:
    attention, then a norm and an MLP). The parallel layer replaces it by a sum over the
    ranks."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class SequenceChunk(nn.Module):
    """The identity on one device. It marks a per-position tensor ``(B, T, ...)`` that a block
    combines with the residual stream outside its mixer (multi-token prediction's keep mask):
    under sequence parallelism the residual stream is cut over ``T``, and the parallel layer
    replaces this by the same cut of the tensor."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


# ---------------------------------------------------------------- layout rules


@dataclass(frozen=True)
class Divisible:
    """``value`` (named ``what``) must be divisible by the size of mesh dimension ``dim``."""

    what: str
    value: int
    dim: str = "tp"

    def problem(self, sizes: Mapping[str, int]) -> str | None:
        size = sizes[self.dim]
        if self.value % size:
            return f"{self.what} ({self.value}) is not divisible by {self.dim} ({size})"
        return None


@dataclass(frozen=True)
class DivideEachOther:
    """``value`` and the size of ``dim`` must divide one another (split or replicated)."""

    what: str
    value: int
    why: str
    dim: str = "tp"

    def problem(self, sizes: Mapping[str, int]) -> str | None:
        size = sizes[self.dim]
        if self.value % size and size % self.value:
            return f"{self.what} ({self.value}) and {self.dim} ({size}) must divide one another " \
                   f"({self.why})"
        return None


@dataclass(frozen=True)
class DividesShard:
    """``group`` (named ``what``) must divide ``total / size(dim)``, the per-rank width."""

    what: str
    group: int
    total: int
    dim: str = "tp"

    def problem(self, sizes: Mapping[str, int]) -> str | None:
        per_rank = self.total // sizes[self.dim]
        if per_rank % self.group:
            return f"{self.what} ({self.group}) must divide the per-rank inner width ({per_rank})"
        return None


@dataclass(frozen=True)
class Inside:
    """A rule of a part that a block is built from, its message naming the block (Zamba2's
    ``'Z'`` holds an attention, an MLP and a Mamba-2 mixer)."""

    where: str
    rule: object
    """A layout rule (anything with ``problem(sizes)``)."""

    def problem(self, sizes: Mapping[str, int]) -> str | None:
        problem = self.rule.problem(sizes)  # type: ignore[attr-defined]
        return None if problem is None else f"{self.where}: {problem}"


LayoutRule = Divisible | DivideEachOther | DividesShard | Inside
