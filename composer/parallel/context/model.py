"""Applying context parallelism to a model: the cp forms swapped in, the rows cut by a
forward pre-hook, the rows' mean loss by a forward hook (the package docstring)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from composer.blocks.loss import IGNORE_INDEX
from composer.blocks.protocol import declared, time_ops
from composer.parallel.context.adaptive import _adaptive_cut
from composer.parallel.context.layout import (
    CPContext,
    check_cp_length,
    cp_length,
    local_index,
    rows_mean,
    safe_targets,
)
from composer.parallel.context.variants import variant_factory
from composer.parallel.mesh import LayoutError, ParallelDims


class CPDepthRows:
    """Multi-token prediction's inputs under cp (:class:`composer.blocks.mtp.DepthRows`): each
    depth's shifted ids, keep mask and targets come from the whole (uncut) rows, then this
    rank's positions; each depth's loss is the rows' mean (:func:`rows_mean`). The ids are the
    labels (the engine's convention)."""

    reads_whole_rows = True

    def __init__(self, cp: CPContext) -> None:
        self.cp = cp

    def __call__(self, input_ids: torch.Tensor, labels: torch.Tensor,
                 doc_ids: torch.Tensor | None, n_depths: int
                 ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
        from composer.blocks.mtp import DepthRows

        cp = self.cp
        ids = cp.rows_ids
        idx = local_index(cp.T, cp.size, cp.rank, ids.device)
        out = []
        for ids_BT, keep_BT, target_BT, _ in DepthRows()(ids, ids, cp.rows_doc, n_depths):
            n_rows = (target_BT[:, :cp.T] != IGNORE_INDEX).sum()
            out.append((ids_BT[:, idx], keep_BT[:, idx], target_BT[:, idx], n_rows))
        return out

    def loss(self, readout: Any, g_BTD: torch.Tensor, weight_VD: torch.Tensor,
             target_BT: torch.Tensor, n_targets: torch.Tensor) -> torch.Tensor:
        ce, _ = readout(g_BTD, weight_VD, None, targets_BT=safe_targets(target_BT))
        return rows_mean(ce, (target_BT != IGNORE_INDEX).sum(), n_targets, self.cp)


def _op_variants(mixer: nn.Module) -> list[tuple[str, Any]] | None:
    """``(name, factory)`` for each time-mixing op the mixer declares, or None when it declares
    none or one has no registered variant."""
    ops = time_ops(mixer)
    if not ops:
        return None
    out = [(name, variant_factory(op)) for name, op in ops]
    return None if any(f is None for _, f in out) else out


def check_cp(model: nn.Module, cp: int) -> None:
    """Refuse what context parallelism cannot run (one line): a layer kind it does not split."""
    if cp == 1:
        return
    from composer.blocks.model import named_layers

    for key, layer in named_layers(model):
        mixer = layer.mixer
        if declared(mixer, "stateless") or _op_variants(mixer) is not None:
            continue
        raise LayoutError(f"--cp: {key} ({getattr(layer, 'symbol', '?')!r}, "
                          f"{type(mixer).__name__}) has no context-parallel form yet")


@dataclass
class CutRows:
    """Rows cut for this rank (:func:`cut_rows`)."""

    ids: torch.Tensor
    targets: torch.Tensor
    doc_ids: torch.Tensor | None
    """This rank's tokens' doc ids (the mixers that are not cp-aware read them)."""
    pos: torch.Tensor
    rows_doc_ids: torch.Tensor | None
    """The whole rows' doc ids, uncut (what the cp mixers read, cut to ``t``)."""
    rows_ids: torch.Tensor
    """The whole rows' ids, uncut."""
    t: int
    n_rows: torch.Tensor
    """Predicted tokens of the whole rows."""
    n_local: torch.Tensor


def cut_rows(cp: CPContext, ids: torch.Tensor, labels: torch.Tensor,
             doc: torch.Tensor | None, model_cfg: Any) -> CutRows:
    """Shift the targets on the whole rows (masked at document starts), then keep this rank's
    chunks of ids, targets and doc ids, and its tokens' RoPE positions."""
    from composer.blocks.model import mask_doc_boundaries, shift_labels
    from composer.kernels.packing import doc_positions

    check_cp_length(model_cfg, cp.size, ids.shape[1])
    rows_ids, rows_doc = ids, doc
    targets = shift_labels(labels if doc is None else mask_doc_boundaries(labels, doc))
    t = cp_length(cp.size, ids.shape[1])
    if t < ids.shape[1]:  # the last token is only a target: not an input of anything
        ids, targets = ids[:, :t], targets[:, :t]
        doc = None if doc is None else doc[:, :t]
    idx = local_index(t, cp.size, cp.rank, ids.device)
    pos = idx.expand(ids.shape[0], -1) if doc is None else doc_positions(doc)[:, idx]
    local_targets = targets[:, idx]
    n_local = (local_targets != IGNORE_INDEX).sum()
    return CutRows(ids[:, idx], local_targets, None if doc is None else doc[:, idx], pos,
                   rows_doc, rows_ids, t, (targets != IGNORE_INDEX).sum(), n_local)


def _pre_hook(cp: CPContext, model: nn.Module, args: tuple,
              kwargs: dict) -> tuple[tuple, dict]:
    ids = args[0] if args else kwargs.pop("input_ids")
    labels = args[1] if len(args) > 1 else kwargs.pop("labels", None)
    if labels is None:
        raise ValueError("under context parallelism the model computes the loss (give labels); "
                         "its logits would be this rank's chunks only")
    if model.mtp is not None and labels is not ids and not torch.equal(labels, ids):
        raise ValueError("under context parallelism multi-token prediction takes the ids as "
                         "labels (as the training engine gives them)")
    cp.layout = None
    if cp.adaptive:
        return _adaptive_cut(model, cp, ids, labels, kwargs)
    rows = cut_rows(cp, ids, labels, kwargs.get("doc_ids"), model.config)
    cp.set_rows(rows.t, rows.pos, rows.rows_doc_ids, rows.rows_ids)
    cp.n_rows, cp.n_local = rows.n_rows, rows.n_local
    kwargs = {**kwargs, "targets": safe_targets(rows.targets)}
    if rows.doc_ids is not None:
        kwargs["doc_ids"] = rows.doc_ids
    return (rows.ids,), kwargs


def _post_hook(cp: CPContext, model: nn.Module, args: tuple, kwargs: dict, out: Any) -> Any:
    """The rows' mean cross-entropy (module docstring: summed over the group in the forward,
    the gradient ``N`` times this rank's)."""
    extra = out.aux_loss + out.mtp_loss
    out.loss = rows_mean(out.loss - extra, cp.n_local, cp.n_rows, cp) + extra
    return out


def apply_cp(model: nn.Module, dims: ParallelDims) -> CPContext:
    """Swap every time-mixing op of every layer for its context-parallel variant (the variants
    hold the context; parameters and keys unchanged) and make the model cut its rows (module
    docstring); under pipeline parallelism the pipeline cuts them (it reads the returned
    context, kept as ``dims.cp_context``). On the meta device, before data parallelism wraps
    the layers."""
    from composer.blocks.model import named_layers

    check_cp(model, dims.cp)
    if dims.cp_adaptive and dims.pp > 1:
        raise LayoutError("--cp-adaptive with --pp is not built yet")
    mesh = dims.cp_mesh
    cp = CPContext(group=mesh.get_group(), size=dims.cp, rank=mesh.get_local_rank(),
                   adaptive=dims.cp_adaptive, min_tokens=dims.cp_min_tokens)
    from composer.blocks.shared import distinct

    # every mixer's variants first, then the swaps: a shared layer's ops are swapped once
    mixers = distinct([layer.mixer for _, layer in named_layers(model)])  # MTP layers too
    swaps = [(mixer, _op_variants(mixer)) for mixer in mixers]
    swapped: set[tuple[int, str]] = set()
    for mixer, variants in swaps:
        if variants is not None:  # the ops swapped for their variants, which hold the context
            for name, factory in variants:
                owner, _, leaf = name.rpartition(".")  # "0.core": a parallel group's branch
                parent = mixer.get_submodule(owner) if owner else mixer
                if (id(parent), leaf) not in swapped:
                    swapped.add((id(parent), leaf))
                    setattr(parent, leaf, factory(getattr(parent, leaf), cp))
    mtp = getattr(model, "mtp", None)
    if mtp is not None:
        mtp.rows = CPDepthRows(cp)
    dims.cp_context = cp
    if dims.pp == 1:
        model.register_forward_pre_hook(partial(_pre_hook, cp), with_kwargs=True)
        model.register_forward_hook(partial(_post_hook, cp), with_kwargs=True)
    return cp
