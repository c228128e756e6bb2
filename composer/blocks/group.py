"""Parallel groups: the pattern's ``[..]`` (docs/patterns.md), several mixers in one residual.

``[M*]`` is one residual block whose branches read the same normed input and whose outputs add
up: ``x + sum_b out_b * mixer_b(in_b * norm(x))`` (Falcon-H1's Mamba-2 and attention side by
side; ``[*-]`` is GPT-J's parallel attention and MLP). ``in_b`` / ``out_b`` are per-symbol
multipliers from the config's ``parallel`` section (1 when it is absent), kept as numbers, never
folded into weights. Checkpoint keys are ``layers.i.mixer.{b}.*``: branch ``b`` as the layer of
its symbol would hold it under ``layers.i.mixer.*``.

The group is one layer for everything outside it: counts, FLOPs (the sum), pipeline splitting,
the decoding state (a tuple, one entry per branch: ``None`` for a token-wise branch), packed
documents and M-RoPE positions (passed to the branches that read them). Tensor parallelism:
each branch's plan shards it as in its own layer (every plan takes a replicated input and
leaves partial sums), and the parallel layer wraps the group once, so the partial sums are
reduced once, after the sum. Context parallelism swaps each branch's time-mixing ops for their
variants (``ops`` names them ``"0.core"``); a group is refused when one branch has no cp form.
MoE branches are refused (expert parallelism routes per layer).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from composer.blocks.cache import Step
from composer.blocks.kind import KINDS
from composer.blocks.plan import ParallelPlan
from composer.blocks.protocol import call_mixer, declared, has_cache, lora_targets_of, plan_of
from composer.config import ConfigError
from composer.pattern import branches_of


@dataclass
class BranchScale:
    """The multipliers of one branch symbol in every parallel group (Falcon-H1's
    ``attention_in_multiplier`` and ``attention_out_multiplier`` are ``symbol: '*'``)."""

    symbol: str
    in_multiplier: float = 1.0
    """Scales the normed input the branch reads."""
    out_multiplier: float = 1.0
    """Scales the branch's output before the sum."""


@dataclass
class ParallelConfig:
    """The ``parallel`` section: multipliers per branch symbol (unlisted symbols: 1, 1)."""

    branches: list[BranchScale] = field(default_factory=list)

    def scales(self, symbol: str) -> tuple[float, float]:
        for b in self.branches:
            if b.symbol == symbol:
                return float(b.in_multiplier), float(b.out_multiplier)
        return 1.0, 1.0


def validate_parallel(sec: ParallelConfig, cfg: Any) -> None:
    seen: set[str] = set()
    for b in sec.branches:
        if b.symbol not in KINDS:
            raise ConfigError(f"parallel.branches: {b.symbol!r} is not a layer symbol; built "
                              f"symbols: {' '.join(KINDS)}")
        if b.symbol in seen:
            raise ConfigError(f"parallel.branches lists {b.symbol!r} twice")
        seen.add(b.symbol)
        for name in ("in_multiplier", "out_multiplier"):
            value = getattr(b, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise ConfigError(f"parallel.branches[{b.symbol!r}].{name} must be a number, "
                                  f"got {value!r}")


class ParallelGroup(nn.ModuleList):
    """``layers.i.mixer.{b}.*``: one mixer per branch; built through :func:`group_class`, which
    fixes the branch symbols and derives the class-level declarations from their kinds."""

    symbols: tuple[str, ...] = ()

    def __init__(self, cfg: Any, layer_idx: int) -> None:
        super().__init__([KINDS[s].mixer(cfg, layer_idx) for s in self.symbols])
        for s, branch in zip(self.symbols, self, strict=True):
            plan = plan_of(branch)
            if plan is not None and plan.experts is not None:
                raise ConfigError(f"parallel group {self.token!r}: {s!r} (routed experts) cannot "
                                  "be a branch (expert parallelism routes whole layers)")
        sec = cfg.section("parallel")
        self.scales = [sec.scales(s) if sec is not None else (1.0, 1.0) for s in self.symbols]
        self.ops = tuple(f"{b}.{name}" for b, branch in enumerate(self)
                         for name in declared(branch, "ops"))
        self.keep_fp32 = tuple(f"{b}.{name}" for b, branch in enumerate(self)
                               for name in declared(branch, "keep_fp32"))

    @property
    def token(self) -> str:
        return "[" + "".join(self.symbols) + "]"

    def forward(self, x_BTD: torch.Tensor, *, doc_ids: torch.Tensor | None = None,
                step: Step | None = None, positions: torch.Tensor | None = None) -> torch.Tensor:
        out_BTD = None
        for b, branch in enumerate(self):
            in_mult, out_mult = self.scales[b]
            h_BTD = x_BTD * in_mult if in_mult != 1.0 else x_BTD
            own = Step(step.state[b], step.ctx) if step is not None and has_cache(branch) \
                else None
            y_BTD = call_mixer(branch, h_BTD, doc_ids, own, positions)
            if out_mult != 1.0:
                y_BTD = y_BTD * out_mult
            out_BTD = y_BTD if out_BTD is None else out_BTD + y_BTD
        return out_BTD

    def parallel_plan(self) -> ParallelPlan | None:
        """Nothing of its own: the branches' plans shard them (the walk over submodules); None
        (no tensor-parallel form) when a branch has none."""
        if any(plan_of(branch) is None for branch in self):
            return None
        return ParallelPlan()

    @property
    def aux_loss(self) -> torch.Tensor | None:
        losses = [a for branch in self if (a := declared(branch, "aux_loss")) is not None]
        return sum(losses) if losses else None

    def lora_targets(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for b, branch in enumerate(self):
            for name, path in lora_targets_of(branch).items():
                if name in out:
                    raise ConfigError(f"parallel group {self.token!r}: LoRA target {name!r} is "
                                      "in two branches")
                out[name] = f"{b}.{path}"
        return out

    def stored_as(self, name: str) -> tuple[str, int]:
        b, _, rest = name.partition(".")
        branch = self[int(b)]
        if declared(branch, "stored_as") is None:
            return name, 0
        key, row = branch.stored_as(rest)
        return f"{b}.{key}", row


def _init_cache(self: ParallelGroup, batch: int, max_len: int, device: torch.device,
                dtype: torch.dtype) -> tuple[Any, ...]:
    return tuple(branch.init_cache(batch, max_len, device, dtype) if has_cache(branch) else None
                 for branch in self)


@functools.cache
def group_class(token: str) -> type[ParallelGroup]:
    """The mixer class of parallel group ``token`` (``"[M*]"``), its declarations derived from
    the branch kinds: FLOPs and layout rules summed / joined, doc ids and positions if any
    branch reads them, a decoding state if any branch keeps one, stateless if all are."""
    symbols = branches_of(token)
    kinds = [KINDS[s] for s in symbols]
    mixers = [k.mixer for k in kinds]

    def flops_per_token(cfg: Any, seq_len: int) -> int:
        return sum(k.flops_per_token(cfg, seq_len) for k in kinds)

    def layout_rules(cfg: Any) -> list:
        return [rule for k in kinds for rule in k.layout_rules(cfg)]

    attrs = {
        "symbols": symbols,
        "uses_doc_ids": any(declared(m, "uses_doc_ids") for m in mixers),
        "uses_positions": any(declared(m, "uses_positions") for m in mixers),
        "stateless": all(declared(m, "stateless") for m in mixers),
        "flops_per_token": staticmethod(flops_per_token),
        "layout_rules": staticmethod(layout_rules),
        "init_cache": _init_cache if any(has_cache(m) for m in mixers) else None,
        "__doc__": f"Parallel group {token}: " + " + ".join(k.name for k in kinds) + ".",
    }
    return type(f"ParallelGroup{token}", (ParallelGroup,), attrs)


def group_name(token: str) -> str:
    return "parallel " + " + ".join(KINDS[s].name for s in branches_of(token))
