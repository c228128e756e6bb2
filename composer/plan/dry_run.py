"""``composer train --dry-run``: training's own setup of one rank of a world of any size, up to
its first step, on the meta device, checked against the plan of its layout (docs/planning.md,
"Dry run").

First the plan (:func:`composer.plan.report.make_plan`: train's checks, every rank class); its
worst class's example rank is the one dry-run unless a rank is given. That rank is impersonated
(:func:`composer.plan.ranks.impersonate`) and built by :func:`composer.train.engine.setup` with
``dry_run=True``, the function ``composer train`` runs: the recipe's model, data and objective
checks, the mesh, the model parallelised on meta, its optimizers and schedule, the batch,
micro-batch and pipeline checks; nothing is allocated, read from a checkpoint or written. What
the rank built (:func:`composer.plan.ranks.built_bytes`) must equal the plan's bytes for it; a
difference is a bug of the plan, refused as one.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from composer.config import ConfigError, ModelConfig
from composer.plan.hardware import GPU
from composer.plan.ranks import (
    StageParts,
    built_bytes,
    check_no_group,
    impersonate,
    rank_coords,
)
from composer.train.recipe import Recipe


class PlanMismatch(RuntimeError):
    """A dry-run rank holds other bytes than the plan says: a bug of the plan (exit 1)."""

    exit_code = 1


def world_of(recipe: Recipe, gpus: int | None) -> int:
    """``--gpus``, else the world the recipe's layout names (``dp`` given: ``dp x tp x pp x
    cp``); a disagreement of the two is train's layout error."""
    if gpus is not None:
        if gpus < 1:
            raise ConfigError("--gpus must be >= 1")
        return gpus
    pc = recipe.parallel
    if pc.dp is None:
        raise ConfigError("--dry-run needs the world size: give --gpus N (or a recipe whose "
                          "layout names dp)")
    return pc.dp * pc.tp * pc.pp * pc.cp


def _config(recipe: Recipe, resume: Path | None) -> ModelConfig:
    """The model config, without converting or opening anything but config files."""
    from composer.portable import CONFIG_FILE
    from composer.train.engine import _model_config
    from composer.train.recipe import model_source
    from composer.train.source import is_hf_folder

    if resume is not None:
        return ModelConfig.load(resume / CONFIG_FILE)
    name = model_source(recipe.model)[0]
    if name is not None and is_hf_folder(Path(name)):
        raise ConfigError(f"--dry-run with a Hugging Face SOURCE ({name}): a dry run writes "
                          "nothing, and training converts it first; convert it with `composer "
                          "convert from-hf` and dry-run the converted folder")
    cfg, tensors = _model_config(recipe)
    if tensors is not None:
        tensors.close()
    return cfg


def dry_run(recipe: Recipe, resume: Path | None, world: int, hw: GPU,
            rank: int | None = None) -> dict[str, Any]:
    """The plan's object with a ``dry_run`` entry: the rank, its stage and class, the bytes it
    built (``params_bytes``, ``grads_bytes``, ``optimizer_bytes``) and its run's facts."""
    from composer.plan.report import make_plan
    from composer.train.engine import dry_run_device, setup
    from composer.train.precision import resolve_precision

    check_no_group()
    if rank is not None and not 0 <= rank < world:
        raise ConfigError(f"--dry-run-rank must be in 0..{world - 1} (--gpus {world}), got {rank}")
    if not recipe.seq_len:
        raise ConfigError("--dry-run: --seq-len is required (tokens per sample), as for "
                          "composer plan")
    precision = resolve_precision(recipe.precision, dry_run_device(recipe))
    stages: list[StageParts] = []
    plan = make_plan(dataclasses.replace(recipe, precision=precision), _config(recipe, resume),
                     world, hw, stages)
    if rank is None:
        rank = next(c["example_rank"] for c in plan["rank_classes"] if c["worst"])
    with impersonate(rank, world):
        run, last = setup(recipe, resume, quiet=True, dry_run=True)
        built = built_bytes(run.model, run.optimizers.opts)
    per_stage = world // run.dims.pp
    stage = rank // per_stage
    parts = stages[stage]
    planned = parts.bytes_at(rank_coords(rank, parts.dims))
    # the class of ``rank``: the first rank of its stage with its bytes (as rank_classes groups)
    example = next(r for r in range(stage * per_stage, rank + 1)
                   if parts.bytes_at(rank_coords(r, parts.dims)) == planned)
    klass = next(c for c in plan["rank_classes"] if c["example_rank"] == example)
    expected = {"params": planned.params, "grads": planned.grads,
                "optimizer": planned.optimizer}
    if built != expected:
        raise PlanMismatch(f"dry run: rank {rank} built {built}, the plan says {expected} "
                           "(a bug of composer plan: please report it)")
    plan["dry_run"] = {"rank": rank, "world": world, "stage": stage, "class_rank": example,
                       "class_ranks": klass["n_ranks"], "worst": klass["worst"],
                       **{f"{k}_bytes": v for k, v in built.items()},
                       "precision": run.precision, "micro_batch_size": run.micro_batch,
                       "steps": last, "passed": True}
    return plan


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.3f} {unit}"
    return f"{n} B"


def summary_line(plan: dict[str, Any]) -> str:
    """The dry run's line under the plan's table."""
    d = plan["dry_run"]
    which = "the worst class" if d["worst"] else "its class"
    return (f"dry run: rank {d['rank']} of {d['world']} (stage {d['stage']}, {which}: "
            f"{d['class_ranks']} ranks like rank {d['class_rank']}) passed composer train's "
            f"setup up to its first step; it holds {_size(d['params_bytes'])} of parameters, "
            f"{_size(d['grads_bytes'])} of gradients and {_size(d['optimizer_bytes'])} of "
            "optimizer state, the plan's bytes exactly")
