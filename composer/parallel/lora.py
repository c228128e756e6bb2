"""LoRA adapters under tensor parallelism: each sharded like its base (``composer/lora.py``).

Applied after tensor / expert parallelism, so a base is already a DTensor (or a swapped
:class:`~composer.parallel.tensor.RowParallelLinear` / ``HeadSelectLinear``). With ``x`` the
mixer's input as the base sees it:

    base Shard(0), column parallel       B Shard(0) (a fused base: each part), A Replicate,
    (each SplitLinear part too)          A's gradient partial (each rank back-propagates through
                                         its own output rows)
    base Shard(1), row parallel          A Shard(1), B Replicate with partial gradient (its
                                         input ``A x`` is a partial sum, as the base's output)
    base replicated                      both replicated, with the base weight's gradient kind
    HeadSelectLinear (rows of one head)  both replicated, partial; B computes the same rows

Routed-expert adapters (``A [E, r, in]``, ``B [E, out, r]``) follow their weight's placement on
its mesh, dimension by dimension: the expert dim split over ep (``Shard(0)``: both split), a
hidden dim split over tp (the output rows ``Shard(1)``: B split, A replicated with partial
gradient; the input columns ``Shard(2)``: A split, B replicated with partial gradient).

The gradient kinds go into ``tp.grad_kinds`` (summed over ``tp`` by ``reduce_tp_grads``) and the
adapters' modules get local views (an experts' adapter is read through ``to_local`` by the
experts' pre-hook).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from composer.blocks.split import SplitLinear
from composer.lora import EXPERTS, LoRA, LoRAConfig, add_lora
from composer.parallel.mesh import LayoutError, ParallelDims
from composer.parallel.tensor import (
    PARTIAL,
    HeadSelectLinear,
    TPContext,
    _swap_linear,
    distribute_param,
    install_local_views,
)


def _base_weights(base: nn.Module) -> list[nn.Parameter]:
    return base.weights() if isinstance(base, SplitLinear) else [base.weight]


def _place_adapter(base: nn.Module, lora: LoRA, base_kind: str | None,
                   tp: TPContext) -> dict[str, str]:
    """Place ``lora`` as its base is placed; returns the adapter's gradient kinds by name
    relative to ``lora``."""
    placements = [w.placements if isinstance(w, DTensor) else None for w in _base_weights(base)]
    first = placements[0]
    if isinstance(base, HeadSelectLinear):
        tp.place(lora.A, "weight", [Replicate()])
        tp.place(lora.B, "weight", [Replicate()])
        _swap_linear(lora, "B", HeadSelectLinear, rows=base.rows)
        kinds = {"A.weight": PARTIAL, "B.weight": PARTIAL}
    elif first is not None and first[0] == Shard(1):  # row parallel
        tp.place(lora.A, "weight", [Shard(1)])
        tp.place(lora.B, "weight", [Replicate()])
        kinds = {"B.weight": PARTIAL}
    elif first is not None and first[0] == Shard(0):  # column parallel (per part when fused)
        tp.place(lora.A, "weight", [Replicate()])
        if isinstance(lora.B, SplitLinear):
            for part in lora.B.parts:
                tp.place(lora.B, f"weight_{part}", [Shard(0)])
            kinds = {"A.weight": PARTIAL}
        else:
            tp.place(lora.B, "weight", [Shard(0)])
            kinds = {"A.weight": PARTIAL}
    elif first is not None and first[0] == Replicate():
        tp.place(lora.A, "weight", [Replicate()])
        tp.place(lora.B, "weight", [Replicate()])
        kinds = {"A.weight": base_kind, "B.weight": base_kind} if base_kind else {}
    else:
        raise LayoutError(f"LoRA: cannot shard an adapter for a base placed as {first}")
    for module in (lora.A, lora.B):
        install_local_views(module)
    return {name: kind for name, kind in kinds.items() if kind is not None}


def _place_expert_adapters(experts: nn.Module, dims: ParallelDims) -> dict[str, str]:
    """Place each routed-expert adapter as its weight is placed (module docstring); returns the
    gradient kinds by name relative to ``experts``."""
    kinds = {}
    for name, adapter in experts.lora.named_children():
        w = experts._parameters[name]
        if not isinstance(w, DTensor):
            continue
        a_pl, b_pl, partial = [], [], {"A": False, "B": False}
        for i, pl in enumerate(w.placements):
            tp_dim = dims.tp > 1 and w.device_mesh.mesh_dim_names[i] == "tp"
            dim = pl.dim if isinstance(pl, Shard) else None
            a_pl.append(pl if dim in (0, 2) else Replicate())
            b_pl.append(pl if dim in (0, 1) else Replicate())
            partial["A"] |= tp_dim and dim == 1  # output rows split: A's grad partial
            partial["B"] |= tp_dim and dim == 2  # input columns split: B's grad partial
        distribute_param(adapter, "A", w.device_mesh, a_pl)
        distribute_param(adapter, "B", w.device_mesh, b_pl)
        kinds |= {f"lora.{name}.{leaf}": PARTIAL for leaf, p in partial.items() if p}
    return kinds


def apply_lora(model: nn.Module, cfg: LoRAConfig, dims: ParallelDims) -> None:
    """Attach the adapters (:func:`composer.lora.add_lora`) and, under tp / ep, shard them like
    their bases (module docstring)."""
    tp = dims.tp_context if dims.tp > 1 else None
    targets = add_lora(model, cfg)
    for t in targets:
        base = model.get_submodule(t.path)
        if t.name == EXPERTS:
            kinds = _place_expert_adapters(base, dims)
        elif tp is not None:
            base_kind = tp.grad_kinds.get(f"{t.path}.weight")
            kinds = {f"lora.{k}": v for k, v in
                     _place_adapter(base, base.lora, base_kind, tp).items()}
        else:
            continue
        if tp is not None:
            tp.grad_kinds |= {f"{t.path}.{leaf}": kind for leaf, kind in kinds.items()}
    if tp is not None:
        tp.param_kinds.clear()  # tp.place recorded kinds by id too; the names are the record
