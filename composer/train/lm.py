"""Next-token prediction's step (the ``pretrain`` and ``sft`` objectives): each micro-batch's
forward and backward, weighted so that the step's gradient is that of the mean cross-entropy
over every predicted token of the global batch (:mod:`composer.train.loop` explains the
weights), and the validation loss. The helpers (:func:`autocast`, :func:`dp_total`) serve the
other objectives too."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from composer.parallel.data import reshard, set_grad_sync
from composer.train.data import Micro
from composer.train.objectives import StepSums, n_targets, stand_in_labels
from composer.train.vision import image_inputs

if TYPE_CHECKING:
    from composer.train.loop import Run


def autocast(run: Run):
    """bf16 autocast under bf16 and fp8 precision; with ``--fp8-backend te`` TE's FP8 autocast
    inside it (:func:`composer.train.fp8_te.te_autocast`)."""
    if run.fp8_backend == "te":
        from composer.train.fp8_te import te_autocast

        dims = run.dims
        return te_autocast(dims.device, dims.fsdp_mesh.get_group() if dims.fsdp_mesh else None)
    if run.precision in ("bf16", "fp8"):
        return torch.autocast(run.dims.device.type, dtype=torch.bfloat16)
    return nullcontext()


def _tensors(run: Run, micro: list[Micro]
             ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The micro-batches' ids (stacked), under document isolation their doc ids, and their own
    labels when they have some (masked samples; None: the ids are the labels), on the
    device."""
    device = run.dims.device
    ids = torch.from_numpy(np.concatenate([mb.ids for mb in micro])).long()
    ids = ids.to(device, non_blocking=True)
    run.batch_device = ids.device
    docs = labels = None
    if run.recipe.document_isolation and micro[0].doc_ids is not None:
        docs = torch.from_numpy(np.concatenate([mb.doc_ids for mb in micro]))
        docs = docs.to(device, non_blocking=True)
    if micro[0].labels is not None:
        labels = torch.from_numpy(np.concatenate([mb.labels for mb in micro])).long()
        labels = labels.to(device, non_blocking=True)
    return ids, docs, labels


def _forward(run: Run, micro: Micro, training: bool = True):
    ids, docs, labels = _tensors(run, [micro])
    kwargs: dict[str, Any] = {} if docs is None else {"doc_ids": docs}
    kwargs.update(image_inputs(run, [micro], training))
    with autocast(run):
        return run.model(ids, ids if labels is None else labels, **kwargs)


def sync_grads(run: Run, i: int, last: int) -> None:
    """Before micro-batch ``i``'s backward: whether data parallel reduces the gradients after
    it. ``every``: after each; ``last``: from micro-batch ``last`` on, the last one sure to run
    a backward (-1: none is; the later ones reduce too, so nothing is left unreduced), summed
    over the micro-batches before it unreduced (the same update, one reduction per step)."""
    if run.dims.grad_replicas > 1 and run.dims.pp == 1:
        set_grad_sync(run.model, run.grad_sync == "every" or i >= last)


def dp_total(run: Run, n_local: float) -> torch.Tensor:
    """``n_local`` summed over the data-parallel ranks (fp64, on the device)."""
    total = torch.tensor(float(n_local), dtype=torch.float64, device=run.dims.device)
    if run.dims.dp > 1:
        dist.all_reduce(total, group=run.dims.dp_mesh.get_group())
    return total


def lm_accumulate(run: Run) -> StepSums:
    """Next-token prediction (pretrain, sft): forward and backward over this rank's
    micro-batches of the next global batch; the summed token cross-entropy, the mean aux loss,
    the mean (weighted) multi-token-prediction loss and the predicted tokens (this rank's)."""
    dims = run.dims
    isolated = run.recipe.document_isolation
    micro = run.batches.local(run.consumed, dims.dp, dims.dp_rank(), run.micro_batch)
    counts = [n_targets(mb, isolated) for mb in micro]
    if isolated or micro[0].labels is not None:  # a count that varies: one small all-reduce
        n_global = dp_total(run, sum(counts))
    else:
        n_global = float(run.recipe.global_batch_size * (run.seq_len - 1))
    pipeline = getattr(run.model, "pipeline", None)
    if pipeline is not None:  # the schedule runs the micro-batches (composer.parallel.pipeline)
        ids, docs, labels = _tensors(run, micro)
        with autocast(run):
            ce_sum, aux, mtp = pipeline.train_step(ids, docs,
                                                   dims.grad_replicas / float(n_global), labels)
        return StepSums(ce_sum, float(sum(counts)), aux, mtp, processed=_rows_tokens(micro))
    ce_sum = torch.zeros((), dtype=torch.float64, device=dims.device)
    aux_sum = torch.zeros((), dtype=torch.float64, device=dims.device)
    mtp_sum = torch.zeros((), dtype=torch.float64, device=dims.device)
    # a micro-batch with a target (or stand-in labels) has a graph; the others may not
    sure = [i for i, (mb, n) in enumerate(zip(micro, counts, strict=True))
            if n or mb.labels is not None]
    for i, (mb, n) in enumerate(zip(micro, counts, strict=True)):
        stand_in = None if n or mb.labels is None else stand_in_labels(mb, isolated)
        out = _forward(run, mb if stand_in is None else stand_in)
        # loss = ce + aux + mtp: the main cross-entropy is weighted by its tokens, the
        # per-micro-batch means (load balancing, multi-token prediction) averaged
        extra = out.aux_loss + out.mtp_loss
        if stand_in is not None:  # no supervised target: a finite mean, weighted 0
            ce = (out.loss - extra) * 0.0
        else:
            ce = out.loss - extra if n else out.aux_loss * 0.0  # no target: NaN mean
        term = ce * (n * dims.dp / n_global) + extra / len(micro)
        if term.requires_grad:  # a dense model's micro-batch without a target has no graph
            sync_grads(run, i, sure[-1] if sure else -1)
            term.backward()
        ce_sum += ce.detach().double() * n
        aux_sum += out.aux_loss.detach().double()
        mtp_sum += out.mtp_loss.detach().double()
    return StepSums(ce_sum, float(sum(counts)), aux_sum / len(micro), mtp_sum / len(micro),
                    processed=_rows_tokens(micro))


def _rows_tokens(micro: list[Micro]) -> int:
    """Predicted positions of the rows (``T - 1`` each): what ``tokens_per_s`` measures."""
    return sum(mb.ids.shape[0] * (mb.ids.shape[1] - 1) for mb in micro)


def _eval_ce(run: Run, micro: Micro) -> torch.Tensor:
    """A micro-batch's mean cross-entropy (fp64), through the pipeline when there is one."""
    pipeline = getattr(run.model, "pipeline", None)
    if pipeline is None:
        out = _forward(run, micro, training=False)
        return (out.loss - out.aux_loss - out.mtp_loss).double()
    ids, docs, labels = _tensors(run, [micro])
    with autocast(run):
        return pipeline.loss(ids, docs, labels)[0]


@torch.no_grad()
def validation_sums(run: Run, width: int,
                    sums: Callable[[Any], torch.Tensor]) -> list[float]:
    """``sums(micro_batch)`` (a ``[width]`` fp64 tensor) added up over ``eval_iters`` global
    batches of the validation data (the same ones at every evaluation) and over every rank, in
    eval mode; the tp, pp and cp ranks that hold the same numbers are divided out. Every
    objective's evaluation of validation batches (next-token loss, DPO's pairs)."""
    dims, r = run.dims, run.recipe
    run.model.eval()
    totals = torch.zeros(width, dtype=torch.float64, device=dims.device)
    try:
        for it in range(r.eval_iters):
            for mb in run.valid.local(it * r.global_batch_size, dims.dp, dims.dp_rank(),
                                      run.micro_batch):
                totals += sums(mb)
    finally:
        run.model.train()
    reshard(run.model)  # evaluation left the FSDP roots' own weights gathered
    totals /= dims.tp * dims.pp * dims.cp  # these ranks hold the same numbers
    if dist.is_initialized():
        dist.all_reduce(totals)
    return totals.tolist()


def validate(run: Run) -> float:
    """Mean next-token loss over the validation batches (:func:`validation_sums`)."""
    isolated = run.recipe.document_isolation

    def sums(mb: Micro) -> torch.Tensor:
        n = n_targets(mb, isolated)
        if not n:
            return torch.zeros(2, dtype=torch.float64, device=run.dims.device)
        ce = _eval_ce(run, mb)
        return torch.stack([ce * n, ce.new_tensor(float(n))])

    loss, n = validation_sums(run, 2, sums)
    return loss / n
