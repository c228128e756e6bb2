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
exact ones. Which parameters a stage holds mirrors ``composer.parallel.pipeline.prune``
(shared parts where the stage's layers use them). Its ``comm`` is a
:class:`~composer.plan.comm_parts.CommParts` built from the same placements
(:meth:`PlainModel.comm_parts`), so the estimate's collectives are the exact formulas'.

The estimate (bytes and communication parts) equals the exact construction on the debug
presets (``tests/plan/test_search``);
where a model departs from these rules (a kind placed some other way, a construction that
refuses the layout), only the exact build of the printed candidates knows it.
"""

from __future__ import annotations

import collections
import fnmatch
import functools
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard

from composer.config import ModelConfig
from composer.parallel.mesh import ParallelDims
from composer.plan.comm_parts import CommParts, Unit
from composer.plan.ranks import DP_DIMS, Shape, StageParts, _prod


@dataclass(frozen=True)
class Rule:
    """How tensor (and expert) parallelism places one parameter."""

    dim: int | None = None
    """The dimension split over ``tp`` (None: replicated over ``tp``)."""
    heads: int | None = None
    """A head-split linear: split on dim 0 when ``tp`` divides ``heads``, else replicated."""
    expert: bool = False
    """A routed expert's parameter: dim 0 split over ``ep``."""
    grad: str | None = None
    """Its gradient kind under ``tp`` (``partial``, ``partial_if_sp``: summed over ``tp`` by
    ``reduce_tp_grads``; a head-split linear's is ``partial`` where it is replicated)."""

    def grad_kind(self, tp: int) -> str | None:
        from composer.parallel.tensor import PARTIAL

        if tp > 1 and self.heads is not None and self.heads % tp:
            return PARTIAL
        return self.grad if tp > 1 else None


REPLICATED = Rule()


def _layer_rules(owner: nn.Module, top: nn.Module) -> dict[str, Rule]:
    """Rules of the parameters of ``top``'s modules (a layer's mixer, a shared part), names
    relative to ``owner`` (the layer, the part); the outer plan wins."""
    from composer.blocks.protocol import plan_of
    from composer.parallel.tensor import PARTIAL

    rules: dict[str, Rule] = {}
    names = {id(m): n for n, m in owner.named_modules()}
    for module in top.modules():
        plan = plan_of(module)
        if plan is None:
            continue
        base = names[id(module)]
        own = {n for n, _ in module.named_parameters()}

        def put(name: str, rule: Rule, base: str = base, own: set = own) -> None:
            if name in own:
                rules.setdefault(f"{base}.{name}" if base else name, rule)

        for name in plan.colwise:
            put(f"{name}.weight", Rule(0))
            put(f"{name}.bias", Rule(0))
        for name in plan.rowwise:
            put(f"{name}.weight", Rule(1))
            put(f"{name}.bias", Rule(grad=PARTIAL))
        for name, n in plan.heads.items():
            put(f"{name}.weight", Rule(heads=n))
            put(f"{name}.bias", Rule(heads=n))
        for pattern, dim in plan.shard.items():
            for name in sorted(own):
                if fnmatch.fnmatchcase(name, pattern):
                    put(name, Rule(dim))
        for pattern in plan.partial:
            for name in sorted(own):
                if fnmatch.fnmatchcase(name, pattern):
                    put(name, Rule(grad=PARTIAL))
        if plan.experts is not None:
            for leaf in plan.expert_partial:
                put(f"{plan.experts}.{leaf}", Rule(expert=True, grad=PARTIAL))
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
        from composer.blocks.protocol import declared
        from composer.blocks.shared import SharedLayer
        from composer.build.builder import build_model
        from composer.parallel.tensor import PARTIAL, PARTIAL_IF_SP
        from composer.plan.comm_parts import layer_comm
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
        self.layers = {}
        """Each layer's :class:`~composer.plan.comm_parts.LayerComm`, by prefix, in order."""
        for prefix, layer in layers:
            rules.update({f"{prefix}.{n}": r for n, r in _layer_rules(layer, layer.mixer).items()})
            self.kinds[prefix] = by_mixer.get(type(layer.mixer))
            self.layers[prefix] = layer_comm(layer)
            # the norms replicated over tp (composer.parallel.tensor._shard_layers): the
            # norm's gradient a share inside a mixer that takes the residual
            inside = declared(layer.mixer, "takes_residual")
            rules[f"{prefix}.norm.weight"] = Rule(grad=PARTIAL if inside else PARTIAL_IF_SP)
            rules[f"{prefix}.out_norm.weight"] = Rule(grad=PARTIAL_IF_SP)
        for name in ("embed.weight", "lm_head.weight"):
            rules[name] = Rule(0)
        rules["final_norm.weight"] = Rule(grad=PARTIAL_IF_SP)
        for label, part in (getattr(model, "shared", None) or {}).items():
            if not isinstance(part, SharedLayer):  # _shard_shared_parts (a whole shared
                # layer is placed with its first use, above)
                rules.update({f"shared.{label}.{n}": r
                              for n, r in _layer_rules(part, part).items()})
        self.shared_label = {prefix: getattr(layer, "shared_label", None)
                             for prefix, layer in layers}
        self.mtp_depths = len(getattr(model, "mtp", None) or ())
        for d in range(self.mtp_depths):  # apply_mtp_tp
            for leaf in ("norm_h", "norm_e", "final_norm", "proj"):
                rules[f"mtp.{d}.{leaf}.weight"] = Rule(grad=PARTIAL_IF_SP)
        prefixes = [p for p, _ in layers]
        self.params: list[Param] = []
        index = {}
        for name, p in model.named_parameters():  # tied parameters once
            unit = next((q for q in prefixes if name.startswith(q + ".")), "")
            index[id(p)] = len(self.params)
            self.params.append(Param(name, tuple(p.shape), p.element_size(), p.requires_grad,
                                     copies.get(id(p), 0), rules.get(name, REPLICATED), unit))
        self.index = index
        """``id`` of the plain model's parameters -> their index in :attr:`params` (what the
        layers' :class:`~composer.plan.comm_parts.LayerComm` hold)."""
        self.model = model

    def stage_parts(self, dims: ParallelDims, groups: list[tuple[int, ...]], stages: list[int],
                    compute_size: int) -> StageParts:
        """The parameters of a pipeline rank holding ``stages`` (``prune``'s choice)."""
        chosen, kinds = self._held(tuple(groups), tuple(stages))
        shapes = [shape_for(p, dims) for p in chosen]
        params = [(s, p.size, p.trainable, p.copies) for s, p in zip(shapes, chosen, strict=True)]
        units = _units(chosen, dims)
        parts = StageParts(params, list(units.values()), compute_size, kinds, dims)
        parts.comm = self.comm_parts(dims, groups, stages, chosen, shapes, units, compute_size)
        return parts

    def comm_parts(self, dims: ParallelDims, groups: list[tuple[int, ...]], stages: list[int],
                   chosen: list[Param], shapes: list[Shape], units: dict[str, list[int]],
                   compute_size: int) -> CommParts:
        """What the stage's collectives move (:func:`composer.plan.comm_parts.comm_parts`
        without the construction), at the stage's first rank (every coordinate 0 but ``pp``,
        as the exact parts are read). Units: one per layer (its experts apart, or their own
        unit), the root; the gathered bytes each parameter's padded ``Shard`` chunk (FSDP2
        pads the first chunk of the tensor-parallel local tensor) times the shard ranks.
        Approximated: a pipeline rank whose several (virtual) stages each hold parameters
        outside their layers (the embedding's copies where layers read it, the head) counts
        one root unit for them; the construction has one per stage, with the same bytes and,
        every root gathering as often, the same collectives' bytes (only the units' count
        differs, which the communication does not read)."""
        from composer.parallel.tensor import PARTIAL, PARTIAL_IF_SP
        from composer.plan.comm_parts import put_layers

        zero: dict[str, int] = collections.defaultdict(int)
        parts = CommParts([_unit(key, [shapes[i] for i in idx], [chosen[i] for i in idx],
                                 dims, compute_size) for key, idx in units.items()])
        trainable = [(p, s) for p, s in zip(chosen, shapes, strict=True) if p.trainable]
        for p, s in trainable:
            kind = p.rule.grad_kind(dims.tp)
            if kind in (PARTIAL, PARTIAL_IF_SP):
                parts.tp_grad_bytes[kind] = (parts.tp_grad_bytes.get(kind, 0)
                                             + s.numel_at(zero) * p.size)
        last = len(groups) - 1 in stages
        held = self._layers(tuple(groups), tuple(stages))
        put_layers(parts, [self.layers[prefix] for prefix in held],
                   lambda w: shape_for(self.params[self.index[id(w)]], dims).numel_at(
                       zero, gathered=True))
        parts.mtp_depths = self.mtp_depths if last else 0
        if dims.ep > 1 and dims.dp_outer > 1 and not experts_sharded(dims):
            parts.expert_grad_bytes = sum(s.numel_at(zero) * p.size for p, s in trainable
                                          if p.rule.expert)
        if dims.pp > 1:
            parts.stage_ids, parts.n_stages = list(stages), len(groups)
            parts.has_embed, parts.has_readout = 0 in stages, last
            holders = sorted({s % dims.pp for s in self._embed_stages(tuple(groups))})
            embed = next((i for i, p in enumerate(chosen) if p.name == "embed.weight"), None)
            if len(holders) > 1 and embed is not None:
                parts.tied_bytes = shapes[embed].numel_at(zero) * chosen[embed].size
                parts.tied_ranks = len(holders)
        return parts

    @functools.lru_cache(maxsize=1024)  # noqa: B019 (one PlainModel per search)
    def _layers(self, groups: tuple[tuple[int, ...], ...], stages: tuple[int, ...]
                ) -> list[str]:
        """The prefixes of the layers the stages run, in order (the MTP depths' on the last)."""
        keep = {f"layers.{i}" for s in stages for i in groups[s]}
        last = len(groups) - 1 in stages
        return [q for q in self.layers if q in keep or (q.startswith("mtp.") and last)]

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
        used = {self.shared_label[q] for q in keep}

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
            if top == "shared":  # the parts the stages' layers use (prune)
                return p.name.split(".")[1] in used
            return True

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


def _units(chosen: list[Param], dims: ParallelDims) -> dict[str, list[int]]:
    """Data parallelism's units: each layer (less its routed experts when they are apart),
    each layer's experts when they are units of their own (``PREFIX#experts``), the root
    (``""``: the rest)."""
    if dims.grad_replicas == 1:
        return {}
    units: dict[str, list[int]] = {}
    apart = dims.ep > 1
    own = apart and dims.dp_mode == "shard" and experts_sharded(dims)
    for i, p in enumerate(chosen):
        if p.rule.expert and apart:
            if own:
                units.setdefault(p.unit + "#experts", []).append(i)
            continue
        units.setdefault(p.unit, []).append(i)
    return units


def _unit(key: str, shapes: list[Shape], params: list[Param], dims: ParallelDims,
          compute_size: int) -> Unit:
    """A unit's group and bytes as :func:`composer.plan.comm_parts._unit` reads them from
    FSDP2: gathered in the compute dtype (bf16 casts the fp32 masters; fp32 none), reduced
    in fp32; under replicate the whole local tensors, reduced. Mesh names as
    :func:`composer.parallel.mesh.build_parallel_dims` gives them."""
    experts = key.endswith("#experts")
    gather_size = compute_size if compute_size == 2 else None  # None: the master's own
    hsdp = dims.dp_replicate > 1 and dims.dp_mode == "shard"
    if dims.dp_mode != "shard":
        group = "dp_cp" if dims.cp > 1 else "dp"
        reduce = sum(_prod(_local_shape(s)[1]) * p.size
                     for s, p in zip(shapes, params, strict=True))
        return Unit(group, dims.grad_replicas, 0, reduce, key == "")
    if experts:
        n = dims.dp_outer // dims.dp_replicate
        group, replicate = ("expert_dp_shard", "expert_dp_replicate") if hsdp else \
            ("dp_outer", None)
    else:
        n = dims.dp_shard
        group = "dp_shard" if hsdp else "dp_cp" if dims.cp > 1 else "dp"
        replicate = "dp_replicate" if hsdp else None
    gather = reduce = 0
    for s, p in zip(shapes, params, strict=True):
        dim, local = _local_shape(s)
        full = -(-local[dim] // n) * n * _prod(local) // local[dim] if local[dim] else 0
        gather += full * (gather_size or p.size)
        reduce += full * 4
    unit = Unit(group, n, gather, reduce, key == "")
    if replicate is not None:
        unit.replicate_group, unit.replicate_size = replicate, dims.dp_replicate
        unit.shard_bytes = reduce // n
    return unit


@functools.lru_cache(maxsize=1 << 16)
def _local_shape(shape: Shape) -> tuple[int, tuple[int, ...]]:
    """The dimension data parallelism shards (0 where it does not) and the tensor-parallel
    local shape at the first rank, data parallelism's shards gathered."""
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    dim, placements = 0, []
    for d, p in zip(shape.dims, shape.placements, strict=True):
        if d in DP_DIMS:
            dim = p.dim
            p = Replicate()
        placements.append(p)
    if not shape.dims:
        return 0, shape.shape
    local, _ = _compute_local_shape_and_global_offset(shape.shape, shape.sizes,
                                                      [0] * len(shape.dims), placements,
                                                      skip_offset=True)
    return dim, tuple(local)
