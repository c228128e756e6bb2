"""Direct preference optimisation (``composer train SOURCE --objective dpo --data PREFS``):
Rafailov et al. 2023, "Direct Preference Optimization: Your Language Model is Secretly a Reward
Model", eq. 7:

    L = -log sigmoid(beta * ((logp(y_w) - logp_ref(y_w)) - (logp(y_l) - logp_ref(y_l))))

``logp(y)`` is the sum of the policy's token log-probabilities over the completion tokens of
``prompt + y`` (the mask of :mod:`composer.data.preference`: the chosen or rejected assistant
turns and their end-of-turn tokens), ``logp_ref`` the same under the frozen reference
(:mod:`composer.train.reference`: the starting weights, or under new LoRA adapters the base with
the adapters off), ``beta`` ``--dpo-beta``. The implicit rewards are ``chosen_reward = beta *
(logp(y_w) - logp_ref(y_w))`` and ``rejected_reward`` likewise.

Batches: a global batch is ``--global-batch-size`` *pairs* (``--micro-batch-size`` pairs per
micro-batch), taken in the layout-independent order of
:class:`composer.data.preference.PreferencePairs` (blends of several preference datasets as for
pretraining). A micro-batch of ``m`` pairs is one forward of ``2m`` rows, its chosen sides then
its rejected sides, each right-padded to the longest side of the micro-batch (padding is never
scored, and a causal model never reads it into the positions before it). ``--seq-len``, when
given, caps a side: a longer one is cut as ``--truncate`` says (``right``, the default, keeps its
first ``--seq-len`` tokens, so the prompt and the start of the answer; ``left`` its last;
``error`` refuses it), as SFT cuts a conversation; how many pairs were cut is printed once.
Padding does run through the model: an MoE layer routes it like any token (it counts in the
micro-batch's load-balancing loss, and with a ``capacity_factor`` it takes capacity), so with
either the update depends on how pairs are grouped into micro-batches, as it does for SFT.

The step's loss is the mean of ``L`` over the global batch's pairs: each micro-batch's backward
is of ``sum(L) * grad_replicas / G`` (plus the mean MoE aux loss), so that the gradient averaged
over data-parallel ranks is that of the global mean, the same for any micro-batch size or dp.
Metrics, each a global mean over the pairs: ``loss``, ``reward_accuracy`` (the fraction with
``chosen_reward > rejected_reward``; 0 at step 0, where both are 0), ``reward_margin``
(``chosen_reward - rejected_reward``), ``chosen_reward``, ``rejected_reward``, and the policy's
``chosen_logp`` and ``rejected_logp``; ``pairs`` is the global batch's count. Evaluation
(``--eval-every``, and once at step 0) gives ``val_loss``, ``val_reward_accuracy`` and
``val_reward_margin`` on the validation split. ``tokens`` counts the tokens of the pairs trained
on, both sides, padding excluded (the same for every layout); ``tokens_per_s`` and ``mfu`` are
measured on them.

Refused before the mesh: ``--pp > 1`` and ``--cp > 1`` (not built yet), multi-token prediction
(its depths train on the ids as labels, which preference pairs do not have), ``--tokens``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F

from composer.config import ConfigError, ModelConfig
from composer.train.data import Batches
from composer.train.objectives import Pretrain, StepSums, register_objective
from composer.train.recipe import Recipe

if TYPE_CHECKING:
    from composer.train.loop import Run


def dpo_loss(logp_w: torch.Tensor, logp_l: torch.Tensor, ref_w: torch.Tensor,
             ref_l: torch.Tensor, beta: float
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per pair: ``L`` (module docstring), the chosen reward and the rejected reward (each
    ``(N,)``, in the inputs' dtype: the caller passes fp64 sums)."""
    chosen = beta * (logp_w - ref_w)
    rejected = beta * (logp_l - ref_l)
    return -F.logsigmoid(chosen - rejected), chosen, rejected


@dataclass
class PairMicro:
    """``m`` pairs as ``2m`` rows: ``ids`` and ``mask`` ``(2m, T)`` int64, rows ``0..m-1`` the
    chosen sides, ``m..2m-1`` the rejected ones, right-padded (mask 0) to the longest; ``tokens``
    the unpadded tokens of all of them."""

    ids: np.ndarray
    mask: np.ndarray
    tokens: int

    @property
    def pairs(self) -> int:
        return self.ids.shape[0] // 2


class PairBatches(Batches):
    """Global batches of ``global_batch`` pairs of ``samples`` (indexable by the global sample
    number, returning ``(ids_w, mask_w, ids_l, mask_l)``); rank ``r`` reads the contiguous
    ``r``-th share, in micro-batches of ``micro`` pairs, as :class:`Batches` does for rows."""

    def __init__(self, samples, global_batch: int, vocab_size: int, pad_id: int,
                 name: str) -> None:
        super().__init__(samples, global_batch, vocab_size, name)
        self.pad_id = pad_id

    def micro_batch(self, rows: list, start: int) -> PairMicro:
        sides = [p[0:2] for p in rows] + [p[2:4] for p in rows]
        width = max(len(ids) for ids, _ in sides)
        ids = np.full((len(sides), width), self.pad_id, dtype=np.int64)
        mask = np.zeros((len(sides), width), dtype=np.int64)
        for row, (side_ids, side_mask) in enumerate(sides):
            ids[row, :len(side_ids)], mask[row, :len(side_mask)] = side_ids, side_mask
        self.check_vocab(ids, f"pair {start}")
        return PairMicro(ids, mask, sum(len(s) for s, _ in sides))


def open_dpo_data(recipe: Recipe, cfg: ModelConfig
                  ) -> tuple[PairBatches, PairBatches | None, int]:
    """Train (and validation) batches of preference pairs, and the longest row."""
    from composer.data.blend import Blend, parse_blend
    from composer.data.gpt import split_documents
    from composer.data.masked import MaskedDataset, is_masked
    from composer.data.preference import PreferencePairs, is_preference
    from composer.train.objectives import dataset_pad_id

    if recipe.tokens is not None or recipe.data is None:
        raise ConfigError("--objective dpo needs --data PREFIX: preference pairs from "
                          "`composer data prepare --format preference`")
    blend = parse_blend(recipe.data)
    for _, prefix in blend:
        if not is_masked(prefix) or not is_preference(prefix):
            raise ConfigError(f"--objective dpo: {prefix} is not a dataset of preference pairs; "
                              "prepare it with `composer data prepare --format preference`")
    parts: list[list[PreferencePairs]] = [[], []]
    for _, prefix in blend:
        ds = MaskedDataset(prefix)
        ranges = split_documents(ds.n_documents // 2, recipe.split)
        for which in (0, 1):
            if len(ranges[which]) or which == 0:
                parts[which].append(PreferencePairs(ds, recipe.seed, ranges[which],
                                                    recipe.seq_len, recipe.truncate, prefix))
    truncated = sum(s.truncated for p in parts for s in p)
    if truncated:
        from composer.parallel.checkpoint import is_rank0

        if is_rank0():
            print(f"composer train: {truncated} preference pair(s) with a side longer than "
                  f"--seq-len {recipe.seq_len} truncated (--truncate {recipe.truncate})",
                  file=sys.stderr, flush=True)
    weights = [w for w, _ in blend]
    name = " + ".join(p for _, p in blend)
    pad = dataset_pad_id(blend[0][1])
    batches = [PairBatches(s[0] if len(s) == 1 else Blend(s, weights), recipe.global_batch_size,
                           cfg.vocab_size, pad, name) for s in parts if s]
    valid = batches[1] if len(parts[1]) == len(blend) else None
    longest = max(s.longest for p in parts for s in p)
    return batches[0], valid, min(longest, recipe.seq_len or longest)


def _sums(run: Run, mb: PairMicro, grad: bool) -> tuple[torch.Tensor, ...]:
    """A micro-batch's per-pair ``L``, rewards and policy log-probs (fp64), and the policy's
    aux loss; the loss keeps its graph when ``grad``."""
    from composer.blocks.model import completion_targets
    from composer.train.loop import autocast

    device = run.dims.device
    ids = torch.from_numpy(mb.ids).to(device, non_blocking=True)
    targets = completion_targets(ids, torch.from_numpy(mb.mask).to(device, non_blocking=True))
    run.batch_device = ids.device
    ref = run.ref_model.token_logprobs(ids, targets).double().sum(-1)
    with autocast(run), torch.set_grad_enabled(grad):
        out = run.model.token_logprobs(ids, targets)
    logp = out.logp.double().sum(-1)
    m = mb.pairs
    loss, chosen, rejected = dpo_loss(logp[:m], logp[m:], ref[:m], ref[m:], run.recipe.dpo_beta)
    return loss, chosen, rejected, logp.detach(), out.aux_loss


class DPO(Pretrain):
    """Preference pairs, a frozen reference, the DPO loss (module docstring)."""

    name = "dpo"
    counts_targets = False  # tokens: the pairs' tokens (StepSums.processed), not pairs
    eval_at_start = True  # val_loss is ln 2 before any update: the reference is the start

    def check(self, recipe: Recipe, cfg: ModelConfig) -> None:
        layout = recipe.parallel
        if layout.pp > 1 or layout.cp > 1:
            raise ConfigError(f"--objective dpo under --{'pp' if layout.pp > 1 else 'cp'} > 1 is "
                              "not built yet (tp, dp and ep are)")
        if "/" in str(cfg.pattern):
            raise ConfigError("--objective dpo with multi-token prediction is not built (its "
                              "depths train on the ids as labels; preference pairs have none)")
        if not recipe.dpo_beta > 0:
            raise ConfigError(f"--dpo-beta must be > 0, got {recipe.dpo_beta}")

    def open_data(self, recipe: Recipe, cfg: ModelConfig) -> tuple[Any, Any, int]:
        return open_dpo_data(recipe, cfg)

    def prepare(self, run: Run) -> None:
        from composer.train.reference import build_reference

        run.ref_model = build_reference(run)

    def accumulate(self, run: Run) -> StepSums:
        from composer.train.loop import sync_grads

        dims = run.dims
        micro = run.batches.local(run.consumed, dims.dp, dims.dp_rank(), run.micro_batch)
        scale = dims.grad_replicas / run.recipe.global_batch_size
        zero = torch.zeros((), dtype=torch.float64, device=dims.device)
        loss_sum, aux_sum = zero.clone(), zero.clone()
        stats = torch.zeros(6, dtype=torch.float64)
        for i, mb in enumerate(micro):
            loss, chosen, rejected, logp, aux = _sums(run, mb, grad=True)
            sync_grads(run, i, len(micro) - 1)
            (loss.sum() * scale + aux / len(micro)).backward()
            loss_sum += loss.detach().sum()
            aux_sum += aux.detach().double()
            m = mb.pairs
            stats += torch.stack([(chosen > rejected).double().sum(), (chosen - rejected).sum(),
                                  chosen.sum(), rejected.sum(), logp[:m].sum(),
                                  logp[m:].sum()]).detach().cpu()
        n = float(sum(mb.pairs for mb in micro))
        names = ("reward_accuracy", "reward_margin", "chosen_reward", "rejected_reward",
                 "chosen_logp", "rejected_logp")
        return StepSums(loss_sum, n, aux_sum / len(micro), zero.clone(),
                        metrics={k: (float(v), n) for k, v in zip(names, stats.tolist(),
                                                                  strict=True)},
                        processed=sum(mb.tokens for mb in micro))

    def validate(self, run: Run) -> dict[str, float]:
        """The mean ``L``, reward accuracy and margin over ``eval_iters`` global batches of the
        validation pairs (the same ones at every evaluation)."""
        from composer.train.lm import validation_sums

        def sums(mb: PairMicro) -> torch.Tensor:
            loss, chosen, rejected, _, _ = _sums(run, mb, grad=False)
            return torch.stack([loss.sum(), (chosen > rejected).double().sum(),
                                (chosen - rejected).sum(),
                                torch.tensor(float(mb.pairs), dtype=torch.float64,
                                             device=run.dims.device)])

        loss, right, margin, n = validation_sums(run, 4, sums)
        return {"val_loss": loss / n, "val_reward_accuracy": right / n,
                "val_reward_margin": margin / n}

    def row_metrics(self, targets: int) -> dict[str, Any]:
        return {"pairs": targets}


register_objective(DPO())
