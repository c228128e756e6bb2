"""The training loop: accumulation over micro-batches, clipping, skipping, saving, logging.

Each step the run's objective (:mod:`composer.train.objectives`) runs this rank's forwards and
backwards (``before_step``, then ``accumulate``); the loop reduces what it returns over every
rank in one all-reduce, clips, steps and logs, whatever the objective. For next-token prediction
(:mod:`composer.train.lm`: pretrain, sft), one optimizer step ``s`` consumes one global batch of
``G`` sequences: data-parallel rank ``r`` runs its ``G / dp`` rows as micro-batches of ``m``.
Each micro-batch's backward is of ``ce_i * n_i * dp / N + aux_i / k`` (``n_i`` its predicted
tokens: those with a valid label, under sft the supervised ones,
:func:`composer.train.objectives.n_targets`; ``N`` the global batch's, ``k = G / (m dp)``
micro-batches): data parallel averages gradients over ``dp``, so the step's
gradient is that of the mean cross-entropy over every predicted token of the global batch, the
same for any ``(m, dp)``. MoE load-balancing losses are computed per micro-batch (their
statistics summed over data-parallel ranks) and averaged over the micro-batches, as in
Megatron-Core.

Then: complete the reductions (:func:`composer.parallel.data.finish_grads`), the global gradient
norm (logged as ``grad_norm``), and either a clipped optimizer step or, when the loss or the norm
is not finite, a skipped step that changes nothing (after ``max_skipped_steps`` consecutive skips
the run stops: :class:`TrainingHalted`, exit code 3). A SIGTERM or SIGINT finishes the current
step, saves and stops; a second one exits at once.
"""

from __future__ import annotations

import faulthandler
import math
import os
import random
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from composer.blocks.model import HybridModel
from composer.parallel.data import finish_grads
from composer.parallel.expert import finish_moe_step
from composer.parallel.grads import clip_grads, grad_norm
from composer.parallel.mesh import ParallelDims
from composer.train.data import Batches
from composer.train.lm import autocast, dp_total, lm_accumulate, sync_grads, validate
from composer.train.metrics import MetricsLog, max_memory_bytes, peak_flops
from composer.train.objectives import Pretrain, StepSums
from composer.train.optim import Optimizers
from composer.train.recipe import Recipe
from composer.train.schedule import Schedule
from composer.train.state import Saver


class TrainingHalted(RuntimeError):
    """The run cannot go on (non-finite losses or weights); one line, exit code 3."""

    exit_code = 3


@dataclass
class Summary:
    steps: int = 0
    """Optimizer steps taken in this invocation (skipped ones included)."""
    step: int = 0
    """The run's step count at the end."""
    loss: float | None = None
    tokens: int = 0
    tokens_per_s: float | None = None
    wall_s: float = 0.0
    skipped: int = 0
    stopped_by_signal: bool = False
    losses: list[float] = field(default_factory=list)
    rows: list[dict[str, Any]] = field(default_factory=list)


class StopRequest:
    """SIGTERM / SIGINT: ask the loop to stop after the current step; a second signal exits."""

    def __init__(self) -> None:
        self.requested = False
        self._old: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._old[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame) -> None:
        if self.requested:
            os._exit(128 + signum)
        self.requested = True

    def close(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


@dataclass
class Run:
    """Everything the loop needs, prepared by :func:`composer.train.engine.setup`."""

    recipe: Recipe
    model: HybridModel
    dims: ParallelDims
    optimizers: Optimizers
    batches: Batches
    schedule: Schedule
    micro_batch: int
    seq_len: int  # tokens per row (--data: --seq-len + 1); `tokens` counts the predicted ones
    flops_per_token: int
    precision: str
    fp8_backend: str | None = None
    """Under ``--precision fp8``: ``te`` or ``torchao`` (:mod:`composer.train.precision`)."""
    start_step: int = 0
    consumed: int = 0
    tokens: int = 0
    skipped: int = 0
    saver: Saver | None = None
    log: MetricsLog | None = None
    batch_device: Any = None
    valid: Batches | None = None
    """Validation batches (``--eval-every``)."""
    start_consumed: int = 0  # `consumed` at the start: a step was taken once they differ
    rows_tokens: int = 0
    """Predicted positions of the rows trained on in this invocation (``T - 1`` per row): what
    ``tokens_per_s`` and ``mfu`` measure, the same as ``tokens`` for pretraining (sft counts its
    supervised targets in ``tokens``)."""
    objective: Pretrain = field(default_factory=Pretrain)
    """What the labels are and what the loss counts (:mod:`composer.train.objectives`)."""
    ref_model: Any = None
    """The objective's frozen reference (dpo, grpo with a KL term;
    :mod:`composer.train.reference`)."""
    state: dict[str, Any] = field(default_factory=dict)
    """The objective's own state between steps (GRPO's current rollout)."""
    grad_sync: str = "every"
    """``--grad-sync`` resolved (:func:`composer.parallel.data.default_grad_sync`): ``last``
    reduces the data-parallel gradients once per step (:func:`composer.train.lm.sync_grads`);
    the first logged row says which."""


def accumulate(run: Run) -> StepSums:
    """This rank's forward and backward of the next step, as its objective defines them."""
    return run.objective.accumulate(run)



def params_finite(model: HybridModel) -> bool:
    ok = torch.ones((), device=next(model.parameters()).device)
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        if not torch.isfinite(local).all():
            ok.zero_()
            break
    if dist.is_initialized():
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return bool(ok)


def save(run: Run, step: int) -> None:
    if run.saver is None:
        return
    if not params_finite(run.model):
        raise TrainingHalted(f"the weights are not finite after step {step} (is --lr too "
                             "large?); not saving them")
    state = {"step": step, "consumed_samples": run.consumed, "tokens": run.tokens,
             "skipped_steps": run.skipped, "schedule": vars(run.schedule),
             "recipe": run.recipe.to_dict()}
    run.saver.save(step, run.model, run.optimizers.opts, state)


def _reduce_stats(run: Run, sums: StepSums, stop: bool
                  ) -> tuple[float, float, float, bool, float, int, dict[str, float]]:
    """One all-reduce (two with maxima): the global mean loss, the mean aux and MTP losses,
    whether any rank stops, the global count, the global processed tokens and the objective's
    metrics."""
    dims = run.dims
    # the count: every tp, pp and cp rank counts the same (a cp rank's loss is its rows' mean,
    # composer.parallel.context); the loss comes from the last stage only
    same = dims.tp * dims.cp
    names = sorted(sums.metrics)
    extra = [float(stop), sums.count / (same * dims.pp), sums.processed / (same * dims.pp)]
    for name in names:  # a ratio of two sums: the ranks holding the same numbers cancel out
        extra += [float(sums.metrics[name][0]), float(sums.metrics[name][1])]
    stats = torch.cat([torch.stack([sums.loss.double() / same, sums.aux / (same * dims.dp),
                                    sums.mtp / (same * dims.dp)]),
                       torch.tensor(extra, dtype=torch.float64, device=dims.device)])
    if dist.is_initialized():
        dist.all_reduce(stats)
    values = stats.tolist()
    loss, aux_mean, mtp_mean, stops, count, processed = values[:6]
    metrics = {n: values[6 + 2 * i] / values[7 + 2 * i] if values[7 + 2 * i] else None
               for i, n in enumerate(names)}
    if sums.maxima:
        top = sorted(sums.maxima)
        peak = torch.tensor([float(sums.maxima[n]) for n in top], dtype=torch.float64,
                            device=dims.device)
        if dist.is_initialized():
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        metrics.update(zip(top, peak.tolist(), strict=True))
    return (loss / max(count, 1.0), aux_mean, mtp_mean, stops > 0, count, round(processed),
            metrics)


@dataclass
class StepStats:
    lr: float
    loss: float
    aux_loss: float
    grad_norm: float
    stop: bool
    """Some rank was asked to stop (every rank learns it in the same all-reduce)."""
    mtp_loss: float = 0.0
    """The weighted multi-token-prediction term (``(w / D) * sum_k ce_k``), mean over
    micro-batches and data-parallel ranks; ``loss`` is the main cross-entropy alone."""
    targets: float = 0
    """The global batch's count: the loss's denominator (predicted tokens, pairs, ...)."""
    processed: int = 0
    """The global batch's tokens run through the model."""
    metrics: dict[str, float | None] = field(default_factory=dict)
    """The objective's metrics (:class:`~composer.train.objectives.StepSums`)."""

    @property
    def finite(self) -> bool:
        return math.isfinite(self.loss) and math.isfinite(self.grad_norm)


def take_step(run: Run, step: int, stop_requested: bool) -> StepStats:
    """One optimizer step (or a skipped one) on the next global batch."""
    r = run.recipe
    lr = run.schedule(step)
    run.optimizers.set_lr(lr)
    run.objective.before_step(run, step)
    sums = accumulate(run)
    finish_grads(run.model, run.dims)
    pipeline = getattr(run.model, "pipeline", None)
    copies: dict[str, int] = {}
    if pipeline is not None:
        pipeline.sync_tied()
        pipeline.sync_shared()
        copies = pipeline.copies()
    norm_t = grad_norm(run.model, run.dims.device, run.dims.pp, copies)
    loss, aux_mean, mtp_mean, stop, targets, processed, metrics = _reduce_stats(
        run, sums, stop_requested)
    stats = StepStats(lr, loss, aux_mean, float(norm_t), stop, mtp_mean, targets, processed,
                      metrics)
    if stats.finite:
        if r.grad_clip > 0:
            clip_grads(run.model, norm_t, r.grad_clip)
        run.optimizers.step()
    else:
        run.skipped += 1
    finish_moe_step(run.model, run.dims, stepped=stats.finite)  # aux-loss-free balancing
    run.optimizers.zero_grad()
    run.consumed += run.objective.consumed_per_step(r)
    run.rows_tokens += processed
    run.tokens += round(targets) if run.objective.counts_targets else processed  # sft: supervised
    return stats


def _row(run: Run, step: int, s: StepStats, tokens_per_s: float,
         peak: float | None) -> dict[str, Any]:
    row = {"step": step, "loss": s.loss if math.isfinite(s.loss) else None, "lr": s.lr,
           "grad_norm": s.grad_norm if math.isfinite(s.grad_norm) else None,
           "tokens": run.tokens, "tokens_per_s": tokens_per_s,
           "mfu": run.flops_per_token * tokens_per_s / (peak * run.dims.world_size)
           if peak else None,
           "skipped": run.skipped, "max_memory_bytes": max_memory_bytes(run.dims.device),
           "device": str(next(run.model.parameters()).device),
           "batch_device": str(run.batch_device)}
    if s.aux_loss:
        row["aux_loss"] = s.aux_loss
    if s.mtp_loss:
        row["mtp_loss"] = s.mtp_loss
    row.update(run.objective.row_metrics(round(s.targets)))
    row.update(s.metrics)
    return row


def train_loop(run: Run, last_step: int, quiet: bool = False) -> Summary:
    """Steps ``start_step + 1 .. last_step``; saves every ``save_every`` and at the end."""
    r = run.recipe
    summary = Summary(step=run.start_step)
    stop = StopRequest()
    peak = peak_flops(run.dims.device, run.precision, r.peak_tflops)
    consecutive, first_row = 0, True
    start = t_log = time.perf_counter()
    tokens_at_log = tokens_at_start = run.rows_tokens
    can_validate = run.valid is not None or not run.objective.needs_valid_data
    try:
        if run.objective.eval_at_start and can_validate and r.eval_every and \
                run.start_step == 0 and last_step > 0:
            row = {"step": 0, **run.objective.validate(run)}
            summary.rows.append(row)
            run.log.log(row)
        for step in range(run.start_step + 1, last_step + 1):
            if r.timeout_s:  # the watchdog: every thread's stack, then exit 1
                faulthandler.dump_traceback_later(r.timeout_s, exit=True)
            s = take_step(run, step, stop.requested)
            consecutive = 0 if s.finite else consecutive + 1
            summary.steps, summary.step = summary.steps + 1, step
            summary.losses.append(s.loss)
            evaluating = bool(can_validate and r.eval_every and
                              (step % r.eval_every == 0 or step == last_step))
            if step % r.log_every == 0 or step == last_step or not s.finite or evaluating:
                now = time.perf_counter()
                row = _row(run, step, s,
                           (run.rows_tokens - tokens_at_log) / max(now - t_log, 1e-9),
                           peak)
                if first_row:  # says how data parallel reduces the gradients
                    row["grad_sync"], first_row = run.grad_sync, False
                if evaluating:
                    row.update(run.objective.validate(run))
                t_log, tokens_at_log = time.perf_counter(), run.rows_tokens
                summary.rows.append(row)
                run.log.log(row)
            run.log.advance()
            if consecutive >= r.max_skipped_steps:
                what = f"loss {s.loss}" if not math.isfinite(s.loss) else \
                    f"gradient norm {s.grad_norm}"
                raise TrainingHalted(f"non-finite {what} at step {step}: {consecutive} "
                                     f"consecutive steps skipped (--max-skipped-steps "
                                     f"{r.max_skipped_steps}); the last checkpoint is intact")
            if s.stop:
                summary.stopped_by_signal = True
                break
            if r.save_every and step % r.save_every == 0 and step != last_step:
                save(run, step)
        if summary.steps or run.start_step == 0:
            save(run, summary.step)
        if run.saver is not None:
            run.saver.finish()
    except TrainingHalted:
        if run.saver is not None:  # an earlier, finite step still being written
            run.saver.finish()
        raise
    finally:
        if r.timeout_s:
            faulthandler.cancel_dump_traceback_later()
        stop.close()
    summary.wall_s = time.perf_counter() - start
    summary.loss = summary.losses[-1] if summary.losses else None
    summary.tokens = run.tokens
    summary.skipped = run.skipped
    if summary.steps:
        summary.tokens_per_s = (run.rows_tokens - tokens_at_start) / summary.wall_s
    return summary


__all__ = ["Run", "Summary", "TrainingHalted", "accumulate", "autocast", "dp_total",
           "lm_accumulate", "seed_everything", "sync_grads", "take_step", "train_loop",
           "validate"]
"""The step helpers of :mod:`composer.train.lm` are re-exported for the objectives."""


def seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


