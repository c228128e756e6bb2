"""Training objectives: what a row's labels are, what the loss counts, what data the objective
reads. One loop (:mod:`composer.train.loop`) runs them all (docs/finetuning.md,
docs/post-training.md).

The interface (:class:`Pretrain` is the base of every objective): ``adjust`` and ``check`` the
recipe, ``open_data``, ``prepare`` once the model is built (a reference model, an environment),
then per step ``before_step`` (GRPO's rollouts) and ``accumulate``: forward and backward of this
rank's share of the global batch, returning :class:`StepSums`, whose sums the loop reduces over
every rank in one all-reduce (each logged value is a global sum over a global count);
``validate`` gives the ``val_*`` values. ``dpo`` (:mod:`composer.train.dpo`) and ``grpo``
(:mod:`composer.train.grpo`) register themselves when imported (:func:`register_objective`);
:func:`get_objective` imports them on demand.

- ``pretrain`` (the default): next-token prediction on every token; the ids are the labels.
- ``sft``: supervised fine-tuning on masked conversations (:mod:`composer.data.sft`): the labels
  are the ids where the loss mask is 1 and ``-100`` elsewhere; document isolation is forced (the
  packed conversations never see each other), and the loss is the mean cross-entropy over the
  supervised targets of the whole global batch (the loop's global count of valid targets).
  ``run.tokens`` (and the ``tokens`` metric) counts the supervised targets; each logged row
  reports ``supervised_tokens``, the step's global batch's count.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from composer.config import ConfigError, ModelConfig
from composer.train.data import IGNORE_INDEX, Batches, Micro, blend_batches
from composer.train.recipe import Recipe

if TYPE_CHECKING:
    from composer.train.loop import Run


@dataclass
class StepSums:
    """One rank's share of a step, as sums the loop reduces over every rank (one all-reduce;
    the tp, cp and pp ranks that hold the same numbers are divided out)."""

    loss: torch.Tensor
    """This rank's sum of loss terms (fp64, detached): the logged loss is the global sum over
    the global ``count``."""
    count: float
    """This rank's share of the loss's denominator (predicted tokens, pairs, ...)."""
    aux: torch.Tensor
    """The mean MoE load-balancing loss over this rank's micro-batches (fp64)."""
    mtp: torch.Tensor
    """The mean multi-token-prediction loss (fp64; zero without MTP)."""
    metrics: dict[str, tuple[float, float]] = field(default_factory=dict)
    """``name -> (sum, count)`` of this rank: logged as the global sum over the global count
    (every rank gives the same names)."""
    maxima: dict[str, float] = field(default_factory=dict)
    """``name -> value`` of this rank: logged as the largest over the ranks."""
    processed: int = 0
    """Tokens this rank ran through the model (``tokens_per_s``, ``mfu``)."""


def n_targets(micro: Micro, isolated: bool) -> int:
    """Predicted tokens of a micro-batch: the positions whose next token is a valid label
    (``T - 1`` per row with the ids as labels), less the document boundaries (nothing is
    predicted across one) under document isolation."""
    m, t = micro.ids.shape
    valid = None if micro.labels is None else micro.labels[:, 1:] != IGNORE_INDEX
    if isolated and micro.doc_ids is not None:
        same = micro.doc_ids[:, 1:] == micro.doc_ids[:, :-1]
        valid = same if valid is None else valid & same
    return m * (t - 1) if valid is None else int(valid.sum())


class Pretrain:
    """Next-token prediction on every token (today's behaviour, unchanged)."""

    name = "pretrain"
    counts_targets = False
    """Whether ``run.tokens`` counts the global ``StepSums.count`` (else the rows' tokens)."""
    eval_at_start = False
    """Log a validation row at step 0, before any update (with ``--eval-every``)."""
    needs_valid_data = True
    """``--eval-every`` needs validation batches (GRPO evaluates on its environment)."""

    def adjust(self, recipe: Recipe) -> Recipe:
        return recipe

    def check(self, recipe: Recipe, cfg: ModelConfig) -> None:
        """Refuse what the objective cannot run (before the mesh: no peer left waiting)."""

    def open_data(self, recipe: Recipe, cfg: ModelConfig) -> tuple[Batches, Batches | None, int]:
        from composer.train.engine import open_data

        return open_data(recipe, cfg)

    def run_tokenizer(self, recipe: Recipe) -> Any:
        """The tokenizer (an object or a folder) kept in ``SAVE/tokenizer``, or None: the
        training data's (:func:`composer.train.engine.data_tokenizer`)."""
        from composer.train.engine import data_tokenizer

        return data_tokenizer(recipe)

    def prepare(self, run: Run) -> None:
        """Once the model is built, before the first step."""

    def before_step(self, run: Run, step: int) -> None:
        """Before each step's :meth:`accumulate`."""

    def accumulate(self, run: Run) -> StepSums:
        """Forward and backward over this rank's share of the next global batch; gradients
        scaled so that their average over data-parallel ranks is that of the global loss."""
        from composer.train.loop import lm_accumulate

        return lm_accumulate(run)

    def validate(self, run: Run) -> dict[str, float]:
        """The ``val_*`` values of an evaluation (every rank calls it)."""
        from composer.train.loop import validate

        return {"val_loss": validate(run)}

    def consumed_per_step(self, recipe: Recipe) -> int:
        """Samples consumed per step (the data position saved in checkpoints)."""
        return recipe.global_batch_size

    def row_metrics(self, targets: int) -> dict[str, Any]:
        return {}


class SFT(Pretrain):
    """Masked, packed conversations (module docstring)."""

    name = "sft"
    counts_targets = True

    def adjust(self, recipe: Recipe) -> Recipe:
        # packed conversations must never see each other: isolation is the objective's
        return dataclasses.replace(recipe, document_isolation=True)

    def check(self, recipe: Recipe, cfg: ModelConfig) -> None:
        layout = recipe.parallel
        if "/" in str(cfg.pattern) and (layout.pp > 1 or layout.cp > 1):
            raise ConfigError("--objective sft with multi-token prediction under --pp or --cp is "
                              "not built yet (its depths read the ids as labels)")

    def open_data(self, recipe: Recipe, cfg: ModelConfig) -> tuple[Batches, Batches | None, int]:
        return open_sft_data(recipe, cfg)

    def row_metrics(self, targets: int) -> dict[str, Any]:
        return {"supervised_tokens": targets}


OBJECTIVES: dict[str, Pretrain] = {o.name: o for o in (Pretrain(), SFT())}
_MODULES = {"dpo": "composer.train.dpo", "grpo": "composer.train.grpo"}
"""Objectives that register themselves when their module is imported."""


def register_objective(objective: Pretrain) -> Pretrain:
    OBJECTIVES[objective.name] = objective
    return objective


def get_objective(name: str) -> Pretrain:
    if name not in OBJECTIVES and name in _MODULES:
        importlib.import_module(_MODULES[name])
    if name not in OBJECTIVES:
        names = dict.fromkeys([*OBJECTIVES, *_MODULES])
        raise ConfigError(f"--objective {name!r}: expected one of {', '.join(names)}")
    return OBJECTIVES[name]


def dataset_pad_id(prefix: str) -> int:
    """The dataset tokenizer's end-of-document token, else 0 (the padding is masked and
    isolated: any id in the vocabulary does)."""
    from composer.data.tokenizer import load_tokenizer

    folder = Path(f"{prefix}.tokenizer")
    if not folder.is_dir():
        return 0
    eod = load_tokenizer(str(folder)).eod
    return 0 if eod is None else int(eod)


IMAGE_TOKENS = ("image_token_id", "vision_start_token_id", "vision_end_token_id")
PATCH_SIZES = ("patch_size", "temporal_patch_size", "merge_size")


def check_images(prefix: str, meta: dict[str, Any], cfg: ModelConfig) -> None:
    """A dataset with images (``meta["images"]``, :mod:`composer.data.masked`) trains only a
    model whose tower reads them as they were made: the same placeholder token ids, patch and
    merge sizes (one-line :class:`ConfigError` naming both values)."""
    info = meta["images"]
    v = cfg.vision
    if v is None:
        raise ConfigError(f"--objective sft: {prefix} has {info['count']:,} images and the "
                          "model has no vision tower (a text model)")
    for key in IMAGE_TOKENS:
        if info[key] != getattr(v, key):
            raise ConfigError(f"--objective sft: {prefix} has {key} {info[key]}, the model's "
                              f"vision.{key} is {getattr(v, key)} (prepare the data with the "
                              "model's tokenizer)")
    for key in PATCH_SIZES:
        if info["settings"][key] != getattr(v, key):
            raise ConfigError(f"--objective sft: {prefix}'s images have {key} "
                              f"{info['settings'][key]}, the model's vision.{key} is "
                              f"{getattr(v, key)} (prepare them with the model's "
                              "preprocessor_config.json)")


def open_sft_data(recipe: Recipe, cfg: ModelConfig) -> tuple[Batches, Batches | None, int]:
    """Train (and validation) batches of packed masked conversations; rows of ``--seq-len``.
    A dataset with images is checked against the model's tower (:func:`check_images`) and
    makes the batches' ``has_images``."""
    from composer.data.blend import parse_blend
    from composer.data.gpt import split_documents
    from composer.data.masked import MaskedDataset, is_masked
    from composer.data.sft import SFTSamples

    if recipe.tokens is not None or recipe.data is None:
        raise ConfigError("--objective sft needs --data PREFIX: a masked dataset from "
                          "`composer data prepare --format chat`")
    if not recipe.seq_len:
        raise ConfigError("--seq-len is required with --objective sft (tokens per packed row)")
    blend = parse_blend(recipe.data)
    for _, prefix in blend:
        if not is_masked(prefix):
            raise ConfigError(f"--objective sft: {prefix} has no loss mask ({prefix}.mask.idx); "
                              "prepare it with `composer data prepare --format chat`")
    parts: list[list[SFTSamples]] = [[], []]
    has_images = False
    for _, prefix in blend:
        ds = MaskedDataset(prefix)
        if ds.meta.get("kind") == "preference":
            raise ConfigError(f"--objective sft: {prefix} is a preference set (pairs of chosen "
                              "and rejected answers): train it with --objective dpo")
        if ds.has_images:
            check_images(prefix, ds.meta, cfg)
            has_images = True
        ranges = split_documents(ds.n_documents, recipe.split)
        for which in (0, 1):
            if len(ranges[which]) or which == 0:
                parts[which].append(SFTSamples(ds, recipe.seq_len, recipe.seed, ranges[which],
                                               recipe.truncate, dataset_pad_id(prefix),
                                               name=prefix))
    truncated = sum(s.truncated for p in parts for s in p)
    if truncated:
        from composer.parallel.checkpoint import is_rank0

        if is_rank0():
            print(f"composer train: {truncated} conversation(s) longer than --seq-len "
                  f"{recipe.seq_len} truncated (--truncate {recipe.truncate})", file=sys.stderr,
                  flush=True)
    train, valid = blend_batches(parts, [w for w, _ in blend], " + ".join(p for _, p in blend),
                                 recipe.global_batch_size, cfg.vocab_size, has_images)
    return train, valid, recipe.seq_len


def stand_in_labels(micro: Micro, isolated: bool) -> Micro | None:
    """``micro`` with one real label where it has no valid target at all (a batch of
    conversations whose supervised turns were truncated away): the loop weights its loss by the
    true count, 0, so the stand-in never counts, but the mean is finite (a mean over no token
    is 0 / 0, and so is its gradient) and the backward reaches every module as on the other
    ranks. None when no position can take one (every token its own document)."""
    ok = np.ones(micro.ids[:, 1:].shape, dtype=bool)
    if isolated and micro.doc_ids is not None:
        ok = micro.doc_ids[:, 1:] == micro.doc_ids[:, :-1]
    where = np.argwhere(ok)
    if not len(where):
        return None
    b, t = (int(x) for x in where[0])
    labels = micro.labels.copy()
    labels[b, t + 1] = micro.ids[b, t + 1]
    return dataclasses.replace(micro, labels=labels)
