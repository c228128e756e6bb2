"""``composer plan`` without a full layout: the search over layouts (docs/planning.md).

Every combination of the sizes the user left open is tried: ``tp`` over the divisors of the
world within a node (``<= gpus_per_node``), ``pp``, ``cp`` and ``ep`` over the divisors of what
is left (``ep`` of ``dp``), and the micro-batch size (given, or :data:`MICRO_SIZES`); ``dp``
fills the rest, ``dp_mode`` is the recipe's (``shard`` by default). Each goes through train's
own checks (:func:`composer.plan.report.check`); a refused one is dropped. The others are
estimated (:mod:`composer.plan.analytic`: the exact parameter bytes and the collectives'
parts without a construction, one plain meta model for the whole search; the step time is the
slowest stage's, as in the exact plan) and ranked by the step-time lower bound among those
whose worst rank fits; then, best first, each is planned exactly (the construction of
:mod:`composer.plan.ranks`, cached per layout: the micro-batch size does not change it) until
``top`` fit, so the printed bytes are the exact ones.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

from composer.parallel.mesh import LayoutError
from composer.plan.estimate import Collective, step_time
from composer.plan.hardware import GPU
from composer.plan.report import assemble_plan, check
from composer.settings import ConfigError

SEARCHED = ("tp", "pp", "cp", "ep")
"""The sizes a full layout gives; ``composer plan`` searches over those left out."""
MICRO_SIZES = (1, 2, 4, 8)
"""Micro-batch sizes tried when none is given."""
MEMORY_MARGIN = 0.1
"""A layout is memory-bound when its worst rank is within this fraction of the GPU's memory."""
EXTRA_EXACT = 10
"""Exact plans tried beyond ``top`` (layouts the construction refuses, or that fit only by the
estimate) before the search gives up on filling ``top``."""


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(world: int, per_node: int, fixed: dict[str, int], micro: int | None,
            experts: bool = True) -> list[dict[str, int]]:
    """The layouts to try, smallest sizes first; ``fixed`` sizes are kept as given; ``ep``
    only for a model with routed experts (elsewhere every ``ep`` is the same layout)."""
    def options(name: str, rest: int) -> list[int]:
        if name in fixed:
            return [fixed[name]]
        if name == "ep" and not experts:
            return [1]
        if name == "tp":
            return [d for d in divisors(rest) if d <= per_node]
        return divisors(rest)

    out = []
    for tp in options("tp", world):
        for pp in options("pp", world // tp if world % tp == 0 else 1):
            left = world // (tp * pp) if world % (tp * pp) == 0 else 1
            for cp in options("cp", left):
                dp = left // cp if left % cp == 0 else 1
                for ep in options("ep", dp):
                    for m in [micro] if micro else MICRO_SIZES:
                        out.append({"tp": tp, "pp": pp, "cp": cp, "ep": ep,
                                    "micro_batch_size": m})
    return out


def with_layout(recipe: Any, layout: dict[str, int]) -> Any:
    sizes = {k: v for k, v in layout.items() if k in SEARCHED}
    return dataclasses.replace(recipe, parallel=dataclasses.replace(recipe.parallel, **sizes),
                               micro_batch_size=layout["micro_batch_size"])


def describe(layout: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in layout.items() if v is not None)


def binding(plan: dict[str, Any], dims: Any, bubble: float, hw: GPU, precision: str) -> str:
    """What limits a layout: ``memory`` when its worst rank is within :data:`MEMORY_MARGIN`
    of the GPU's memory; else the larger of the pipeline bubble and the slowest collective
    (``bubble`` or the collective's kind), each collective alone at its link's bandwidth."""
    if worst_bytes(plan) >= (1 - MEMORY_MARGIN) * hw.mem_bytes:
        return "memory"

    def seconds(c: dict) -> float:  # without compute nor overlap: its transfer time
        one = Collective(c["kind"], c["group"], c["bytes_per_step"], c["intra_node"])
        return step_time(0.0, [one], dims, 1, hw, precision)["upper"]

    times = {c["kind"]: seconds(c) for c in plan["comm"]}
    times["bubble"] = bubble
    return max(times, key=times.get)


class Search:
    """One search: the plain model, the flops per token and the exact builds, shared by every
    layout tried."""

    def __init__(self, recipe: Any, cfg: Any, world: int, hw: GPU) -> None:
        from composer.build.builder import build_model, model_stats
        from composer.plan.analytic import PlainModel
        from composer.train.adapters import run_adapters

        self.recipe, self.cfg, self.world, self.hw = recipe, cfg, world, hw
        self.precision = recipe.precision or "bf16"
        self.size = 2 if self.precision in ("bf16", "fp8") else 4
        self.plain = PlainModel(cfg, recipe.optimizer)
        self.lora = run_adapters(recipe, None)[0]  # the exact part builds them as training
        self.stats = model_stats(build_model(cfg, device="meta"), seq_len=recipe.seq_len)
        self.builds: dict[tuple, tuple | LayoutError] = {}
        self.groups: dict[int, list[tuple[int, ...]]] = {}

    def estimate(self, recipe: Any, checked: tuple) -> dict[str, Any]:
        """The plan with estimated rank bytes (one class per stage: its first rank, which holds
        the larger chunk of every uneven split)."""
        from composer.build.stages import stage_layers
        from composer.parallel.pipeline import rank_stages
        from composer.plan.ranks import RankClass, rank_coords

        dims = checked[0]
        if dims.pp not in self.groups:
            self.groups[dims.pp] = stage_layers(self.cfg, dims.pp)
        groups = self.groups[dims.pp]
        per_stage = self.world // dims.pp
        stages, classes = [], []
        for s in range(dims.pp):
            parts = self.plain.stage_parts(dims, groups, rank_stages(len(groups), dims.pp, s),
                                           self.size)
            rank = s * per_stage
            stages.append(parts)
            classes.append(RankClass(s, rank, per_stage, parts.bytes_at(rank_coords(rank, dims))))
        return self.assemble(recipe, checked, classes, stages)

    def exact(self, recipe: Any, checked: tuple) -> dict[str, Any]:
        """The plan with the exact construction (cached per layout); a layout the construction
        refuses raises its one-line :class:`LayoutError`."""
        from composer.plan.ranks import rank_classes

        key = dataclasses.astuple(dataclasses.replace(recipe.parallel, dp=None))
        if key not in self.builds:
            stages: list = []
            try:
                classes = rank_classes(self.cfg, recipe.parallel, self.world, self.precision,
                                       recipe.optimizer, stages, self.lora, recipe.freeze)
                self.builds[key] = (classes, stages)
            except LayoutError as exc:
                self.builds[key] = exc
        built = self.builds[key]
        if isinstance(built, LayoutError):
            raise built
        return self.assemble(recipe, checked, *built)

    def assemble(self, recipe: Any, checked: tuple, classes: list, stages: list) -> dict:
        times: dict[str, float] = {}
        plan = assemble_plan(recipe, self.cfg, self.world, self.hw, checked, classes, stages,
                             stats=self.stats, times=times)
        plan["binding"] = binding(plan, checked[0], times["bubble"], self.hw, self.precision)
        return plan


def search(recipe: Any, cfg: Any, world: int, hw: GPU, fixed: dict[str, int],
           top: int = 5) -> dict[str, Any]:
    """The ``top`` layouts that fit, best first, as ``candidates`` (module docstring), the best
    one's fields at the top level too; a one-line :class:`ConfigError` when no layout passes
    train's checks or none fits."""
    s = Search(recipe, cfg, world, hw)
    experts = any(p.rule.expert for p in s.plain.params)
    tried = layouts(world, hw.per_node, fixed, recipe.micro_batch_size, experts)
    valid, first_error = [], None
    for layout in tried:
        r = with_layout(recipe, layout)
        try:
            valid.append((layout, r, check(r, cfg, world)))
        except ConfigError as exc:
            if first_error is None:
                first_error = (layout, str(exc))
    if not valid:
        layout, message = first_error
        raise LayoutError(f"no layout of {world} GPUs passes train's checks; the first tried "
                          f"({describe(layout)}): {message}")
    estimated = []
    for _, r, checked in valid:
        plan = s.estimate(r, checked)
        t = plan["step_time_s"]
        estimated.append((not plan["feasible"], t["lower"], t["upper"], worst_bytes(plan),
                          len(estimated), r, checked))
    estimated.sort(key=lambda e: e[:5])  # ties on the lower bound: the better upper bound
    chosen, refusals = [], []
    for infeasible, *_, r, checked in estimated[:top + EXTRA_EXACT]:
        if infeasible or len(chosen) == top:
            break
        try:
            plan = s.exact(r, checked)
        except LayoutError as exc:
            refusals.append(str(exc))
            continue
        if plan["feasible"]:
            chosen.append(plan)
    if not chosen and refusals:
        raise LayoutError(f"no layout of {world} GPUs that fits could be built: the "
                          f"construction refused the {len(refusals)} best, the first with: "
                          f"{refusals[0]}")
    if not chosen:
        raise LayoutError(no_fit(s, estimated, hw))
    chosen.sort(key=lambda p: (p["step_time_s"]["lower"], p["step_time_s"]["upper"]))
    return {**chosen[0], "candidates": chosen}


def worst_bytes(plan: dict[str, Any]) -> int:
    return max(c["total_bytes"] for c in plan["rank_classes"])


def no_fit(s: Search, estimated: list, hw: GPU) -> str:
    """The one line when no layout fits: the closest one (the smallest worst rank)."""
    _, _, _, worst, _, r, checked = min(estimated, key=lambda e: e[3])
    with contextlib.suppress(LayoutError):  # refused by the construction: the estimate's bytes
        worst = worst_bytes(s.exact(r, checked))
    dims, micro, _ = checked
    layout = {"tp": dims.tp, "pp": dims.pp, "cp": dims.cp, "ep": dims.ep, "dp": dims.dp,
              "micro_batch_size": micro}
    return (f"no layout of {s.world} GPUs fits in {hw.mem_bytes / 2**30:.1f} GiB; the closest, "
            f"{describe(layout)}, needs {worst / 2**30:.1f} GiB on its worst rank")
