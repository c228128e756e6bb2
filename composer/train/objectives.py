"""Training objectives: what a row's labels are, what the loss counts, what data the objective
reads. One loop (:mod:`composer.train.loop`) runs them all (docs/finetuning.md).

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
import sys
from pathlib import Path
from typing import Any

import numpy as np

from composer.config import ConfigError, ModelConfig
from composer.train.data import IGNORE_INDEX, Batches, Micro, blend_batches
from composer.train.recipe import Recipe


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
    """Whether ``run.tokens`` counts the global valid targets (else the rows' tokens)."""

    def adjust(self, recipe: Recipe) -> Recipe:
        return recipe

    def check(self, recipe: Recipe, cfg: ModelConfig) -> None:
        """Refuse what the objective cannot run (before the mesh: no peer left waiting)."""

    def open_data(self, recipe: Recipe, cfg: ModelConfig) -> tuple[Batches, Batches | None, int]:
        from composer.train.engine import open_data

        return open_data(recipe, cfg)

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


OBJECTIVES = {o.name: o for o in (Pretrain(), SFT())}


def get_objective(name: str) -> Pretrain:
    if name not in OBJECTIVES:
        raise ConfigError(f"--objective {name!r}: expected one of {', '.join(OBJECTIVES)}")
    return OBJECTIVES[name]


def _pad_id(prefix: str) -> int:
    """The dataset tokenizer's end-of-document token, else 0 (the padding is masked and
    isolated: any id in the vocabulary does)."""
    from composer.data.tokenizer import load_tokenizer

    folder = Path(f"{prefix}.tokenizer")
    if not folder.is_dir():
        return 0
    eod = load_tokenizer(str(folder)).eod
    return 0 if eod is None else int(eod)


def open_sft_data(recipe: Recipe, cfg: ModelConfig) -> tuple[Batches, Batches | None, int]:
    """Train (and validation) batches of packed masked conversations; rows of ``--seq-len``."""
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
    for _, prefix in blend:
        ds = MaskedDataset(prefix)
        ranges = split_documents(ds.n_documents, recipe.split)
        for which in (0, 1):
            if len(ranges[which]) or which == 0:
                parts[which].append(SFTSamples(ds, recipe.seq_len, recipe.seed, ranges[which],
                                               recipe.truncate, _pad_id(prefix), name=prefix))
    truncated = sum(s.truncated for p in parts for s in p)
    if truncated:
        from composer.parallel.checkpoint import is_rank0

        if is_rank0():
            print(f"composer train: {truncated} conversation(s) longer than --seq-len "
                  f"{recipe.seq_len} truncated (--truncate {recipe.truncate})", file=sys.stderr,
                  flush=True)
    train, valid = blend_batches(parts, [w for w, _ in blend], " + ".join(p for _, p in blend),
                                 recipe.global_batch_size, cfg.vocab_size)
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
