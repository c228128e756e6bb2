"""A stage's shards without building it: each parameter's placements from the blocks' declared
plans, for the search over layouts (:mod:`composer.plan.search`), which cannot afford the exact
construction (:mod:`composer.plan.ranks`, about 0.1 s per layer at any world size) of every
stage of every candidate.

The model is built once, unparallelised, on the meta device. Each parameter gets the
placements ``composer.parallel`` would give it, read from the same declarations
(``parallel_plan()`` of the mixers' modules, outer plans first, as ``apply_plan`` places them;
the norms, MTP's norms and projection replicated; embedding and head split by vocabulary;
routed experts over ``ep`` on dim 0, their hidden units over ``tp``), then data parallelism's
``Shard(0)`` of the local tensor over the ``dp x cp`` ranks (routed experts under expert
parallelism: over ``dp_outer``, on dim 0 when the local experts divide, else dim 1, as
``shard_experts`` does; left alone when they are not sharded). The result is a
:class:`~composer.plan.ranks.StageParts` (same shape rules, same torch DTensor arithmetic),
so that its bytes, units in flight and gathered sizes are computed by the same code as the
exact ones. Which parameters a stage holds mirrors ``composer.parallel.pipeline.prune``.

The estimate equals the exact construction on the debug presets (``tests/plan/test_search``);
where a model departs from these rules (a kind placed some other way, a construction that
refuses the layout), only the exact build of the printed candidates knows it.
"""

from __future__ import annotations

import fnmatch
import functools
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard

from composer.config import ModelConfig
from composer.parallel.mesh import ParallelDims
from composer.plan.ranks import Shape, StageParts


@dataclass(frozen=True)
class Rule:
    """How tensor (and expert) parallelism places one parameter."""

    dim: int | None = None
    """The dimension split over ``tp`` (None: replicated over ``tp``)."""
    heads: int | None = None
    """A head-split linear: split on dim 0 when ``tp`` divides ``heads``, else replicated."""
    expert: bool = False
    """A routed expert's parameter: dim 0 split over ``ep``."""


REPLICATED = Rule()


def _layer_rules(layer: nn.Module) -> dict[str, Rule]:
    """Rules of a layer's parameters (names relative to the layer); the outer plan wins."""
    from composer.blocks.protocol import plan_of

    rules: dict[str, Rule] = {}
    names = {id(m): n for n, m in layer.named_modules()}
    for module in layer.mixer.modules():
        plan = plan_of(module)
        if plan is None:
            continue
        base = names[id(module)]
        own = {n for n, _ in module.named_parameters()}

        def put(name: str, rule: Rule, base: str = base, own: set = own) -> None:
            if name in own:
                rules.setdefault(f"{base}.{name}", rule)

        for name in plan.colwise:
            put(f"{name}.weight", Rule(0))
            put(f"{name}.bias", Rule(0))
        for name in plan.rowwise:
            put(f"{name}.weight", Rule(1))
            put(f"{name}.bias", REPLICATED)
        for name, n in plan.heads.items():
            put(f"{name}.weight", Rule(heads=n))
            put(f"{name}.bias", Rule(heads=n))
        for pattern, dim in plan.shard.items():
            for name in sorted(own):
                if fnmatch.fnmatchcase(name, pattern):
                    put(name, Rule(dim))
        if plan.experts is not None:
            for leaf, dim in plan.expert_hidden.items():
                put(f"{plan.experts}.{leaf}", Rule(dim, expert=True))
            for name in own:
                if name.startswith(f"{plan.experts}."):
                    put(name, Rule(expert=True))  # expert_partial: replicated over tp
    return rules


@dataclass
class Param:
    name: str
    shape: tuple[int, ...]
    size: int
    trainable: bool
    copies: int
    """Optimizer state copies (2 AdamW, 1 Muon), as :func:`composer.plan.ranks.stage_parts`."""
    rule: Rule
    unit: str
    """The data-parallel unit it belongs to: a layer's prefix, or ``""`` for the root."""


class PlainModel:
    """The unparallelised model's parameters with their rules, built once per search."""

    def __init__(self, cfg: ModelConfig, optimizer: str) -> None:
        from composer.blocks.kind import KINDS
        from composer.blocks.model import named_layers
        from composer.build.builder import build_model
        from composer.train.optim import build_optimizers

        self.cfg = cfg
        model = build_model(cfg, device="meta")
        opts = build_optimizers(model, optimizer, 1e-3, 0.0, (0.9, 0.95), 1e-8).opts
        copies = {id(p): 2 if isinstance(o, torch.optim.AdamW) else 1
                  for o in opts for g in o.param_groups for p in g["params"]}
        rules: dict[str, Rule] = {}
        by_mixer = {kind.mixer: kind for kind in KINDS.values()}
        self.kinds: dict[str, object] = {}
        layers = named_layers(model)
        for prefix, layer in layers:
            rules.update({f"{prefix}.{n}": r for n, r in _layer_rules(layer).items()})
            self.kinds[prefix] = by_mixer.get(type(layer.mixer))
        for name in ("embed.weight", "lm_head.weight"):
            rules[name] = Rule(0)
        prefixes = [p for p, _ in layers]
        self.params: list[Param] = []
        for name, p in model.named_parameters():  # tied parameters once
            unit = next((q for q in prefixes if name.startswith(q + ".")), "")
            self.params.append(Param(name, tuple(p.shape), p.element_size(), p.requires_grad,
                                     copies.get(id(p), 0), rules.get(name, REPLICATED), unit))

    def stage_parts(self, dims: ParallelDims, groups: list[tuple[int, ...]], stages: list[int],
                    compute_size: int) -> StageParts:
        """The parameters of a pipeline rank holding ``stages`` (``prune``'s choice)."""
        chosen, kinds = self._held(tuple(groups), tuple(stages))
        params = [(shape_for(p, dims), p.size, p.trainable, p.copies) for p in chosen]
        return StageParts(params, _units(chosen, dims), compute_size, kinds, dims)

    @functools.lru_cache(maxsize=64)  # noqa: B019 (one PlainModel per search)
    def _embed_stages(self, groups: tuple[tuple[int, ...], ...]) -> list[int]:
        from composer.parallel.pipeline import embed_stages

        return embed_stages(self.cfg, list(groups))

    @functools.lru_cache(maxsize=1024)  # noqa: B019 (one PlainModel per search)
    def _held(self, groups: tuple[tuple[int, ...], ...], stages: tuple[int, ...]
              ) -> tuple[list[Param], list]:
        keep = {f"layers.{i}" for s in stages for i in groups[s]}
        first, last = 0 in stages, len(groups) - 1 in stages
        embed = bool(set(stages) & set(self._embed_stages(groups)))

        def held(p: Param) -> bool:
            top = p.name.split(".")[0]
            if p.unit:
                return p.unit in keep or (top == "mtp" and last)
            if top == "embed":
                return embed
            if top == "visual":
                return first
            if top in ("final_norm", "lm_head", "mtp"):
                return last
            return True  # shared parts (model.shared): on every stage, an over-count on those
            # whose layers use none (prune keeps the ones used)

        chosen = [p for p in self.params if held(p)]
        kinds = [self.kinds[u] for u in dict.fromkeys(p.unit for p in chosen if p.unit)]
        return chosen, kinds


def shape_for(p: Param, dims: ParallelDims) -> Shape:
    """The parameter's shape rule under ``dims`` (module docstring), in local order: tensor
    and expert parallelism first, data parallelism's split of the local tensor last."""
    dp = dims.dp_shard if dims.dp_mode == "shard" and dims.grad_replicas > 1 else 1
    outer = dims.dp_outer // dims.dp_replicate if dp > 1 and experts_sharded(dims) else 1
    return _shape(p.shape, p.rule, dims.tp, dims.ep, dp, outer)


@functools.lru_cache(maxsize=1 << 16)
def _shape(shape: tuple[int, ...], rule: Rule, tp: int, ep: int, dp: int, outer: int) -> Shape:
    """``dp``: data parallelism's shards (1: none); ``outer``: the routed experts' (1: they
    are not sharded)."""
    names, sizes, placements = [], [], []

    def add(name: str, size: int, placement: object) -> None:
        if size > 1:
            names.append(name)
            sizes.append(size)
            placements.append(placement)

    apart = rule.expert and ep > 1
    if apart:
        add("ep", ep, Shard(0))
    tp_dim = rule.dim if rule.heads is None else (0 if rule.heads % tp == 0 else None)
    add("tp", tp, Shard(tp_dim) if tp_dim is not None else Replicate())
    if not apart:  # over dp x cp, under HSDP a replica group's share of it
        add("dp_shard", dp, Shard(0))
    else:
        add("dp_outer_shard", outer, Shard(0 if (shape[0] // ep) % outer == 0 else 1))
    return Shape(shape, tuple(names), tuple(sizes), tuple(placements))


def experts_sharded(dims: ParallelDims) -> bool:
    from composer.parallel.data import experts_sharded as sharded

    return sharded(dims)


def _units(chosen: list[Param], dims: ParallelDims) -> list[list[int]]:
    """Data parallelism's units: each layer (less its routed experts when they are apart),
    each layer's experts when they are units of their own, the root (the rest)."""
    if dims.grad_replicas == 1:
        return []
    units: dict[str, list[int]] = {}
    apart = dims.ep > 1
    own = apart and dims.dp_mode == "shard" and experts_sharded(dims)
    for i, p in enumerate(chosen):
        if p.rule.expert and apart:
            if own:
                units.setdefault(p.unit + "#experts", []).append(i)
            continue
        units.setdefault(p.unit, []).append(i)
    return list(units.values())
