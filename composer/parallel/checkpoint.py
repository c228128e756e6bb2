"""Training checkpoints with torch.distributed.checkpoint (DCP): sharded, resharded on load.

A ``--save`` folder holds ``config.yaml``, one ``step-NNNNNNNN/`` folder per saved step and a
``latest`` file naming the newest complete one. Every rank writes its shards; ``latest`` is
replaced atomically by rank 0 only after all ranks finished, so a crash never publishes a
partial step, and step folders newer than ``latest`` are leftovers of an interrupted save
(:func:`remove_incomplete` deletes them). Old steps are renamed to a hidden name before being
deleted, so an interrupted deletion leaves nothing that looks complete. The state is keyed by
parameter name (the same under every layout: tensor-parallel shards are DTensors of the full
shape, Mamba's fused projections are stored per component), the optimizer's too (:data:`FLAT`), so a
step saved at one layout loads at another.
"""

from __future__ import annotations

import os
import re
import shutil
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from composer.blocks.plan import named_state
from composer.parallel.data import reshard
from composer.portable import CONFIG_FILE, LATEST, is_training_checkpoint, latest_step

__all__ = ["LATEST", "is_training_checkpoint", "latest_step"]  # re-exported from portable

STEP_RE = re.compile(r"step-(\d+)$")

# DCP warns when it runs without a process group; a single process is a supported layout here.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or "
                        "uninitialized", category=UserWarning)

Optimizers = torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None

FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
"""The optimizer state keyed by parameter name, hyperparameters too (``param_groups.<name>.lr``):
ranks that hold different parameters (pipeline stages) never write the same key, where a list of
param groups would be one rank's, kept for all."""
NESTED_GROUPS = re.compile(r"optim\.param_groups\.\d+\.")
"""The keys of a step saved before :data:`FLAT` (param groups as a list); such steps still load."""


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _opt_list(optimizers: Optimizers) -> list[torch.optim.Optimizer]:
    if optimizers is None:
        return []
    return [optimizers] if isinstance(optimizers, torch.optim.Optimizer) else list(optimizers)


def model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers by name (DTensors under parallelism)."""
    return dict(named_state(model))


def step_name(step: int) -> str:
    return f"step-{step:08d}"


def _state(model: nn.Module, opts: list[torch.optim.Optimizer], step: int) -> dict:
    state: dict = {"model": model_state(model), "step": torch.tensor(step)}
    # A fresh optimizer has no state yet (train --steps 0): saving it would materialise its
    # moments (2x the model); resuming then starts a fresh one, which is the same thing.
    if any(o.state for o in opts):
        state["optim"] = get_optimizer_state_dict(model, opts, options=FLAT)
    return state


def write_step(folder: str | Path, step: int, model: nn.Module, optimizers: Optimizers = None,
               async_group: dist.ProcessGroup | None = None,
               async_save: bool = False) -> tuple[Path, Future | None]:
    """Write this rank's shards of step ``step`` (not yet published). ``async_save``: the state
    is staged in host memory and written in the background (over ``async_group``, a process
    group of its own so that its collectives never interleave with training's); the returned
    future completes when this rank's part is on disk."""
    folder = Path(folder)
    step_dir = folder / step_name(step)
    if is_rank0():
        folder.mkdir(parents=True, exist_ok=True)
    barrier()
    reshard(model)  # the shards, which the optimizer holds, not gathered copies
    state = _state(model, _opt_list(optimizers), step)
    if async_save:
        return step_dir, dcp.async_save(state, checkpoint_id=str(step_dir),
                                        process_group=async_group)
    dcp.save(state, checkpoint_id=str(step_dir))
    return step_dir, None


def publish(folder: str | Path, step_dir: Path, config, keep_last: int | None = None,
            before: Callable[[], None] | None = None) -> None:
    """Once every rank has written ``step_dir``: point ``latest`` at it (atomically, rank 0),
    then delete all but the newest ``keep_last`` steps. ``before`` runs on rank 0 first."""
    folder = Path(folder)
    barrier()
    if is_rank0():
        if before is not None:
            before()
        config.save(folder / CONFIG_FILE)
        tmp = folder / f".{LATEST}.tmp"
        tmp.write_text(step_dir.name + "\n")
        os.replace(tmp, folder / LATEST)
        if keep_last:
            for old in _steps(folder)[:-keep_last]:
                _remove(old)
    barrier()


def save_checkpoint(folder: str | Path, step: int, model: nn.Module,
                    optimizers: Optimizers = None) -> Path:
    """Write and publish step ``step`` (every rank calls it)."""
    step_dir, _ = write_step(folder, step, model, optimizers)
    publish(folder, step_dir, model.config)
    return step_dir


def _steps(folder: Path) -> list[Path]:
    """Step folders up to the one ``latest`` names, oldest first."""
    newest = latest_step(folder).name
    found = sorted(p for p in folder.iterdir() if p.is_dir() and STEP_RE.match(p.name))
    return [p for p in found if p.name <= newest]


def _remove(path: Path) -> None:
    trash = path.with_name(f".trash-{path.name}")
    os.replace(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def remove_incomplete(folder: str | Path) -> list[str]:
    """Delete step folders that ``latest`` never named (newer than it, or all of them when it
    is missing) and half-deleted ones; rank 0 only. Returns the names removed."""
    folder = Path(folder)
    if not folder.is_dir() or not is_rank0():
        return []
    newest = latest_step(folder).name if is_training_checkpoint(folder) else ""
    removed = []
    for p in sorted(folder.iterdir()):
        if p.name.startswith(".trash-") or (p.is_dir() and STEP_RE.match(p.name)
                                            and p.name > newest):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p.name)
        elif p.name == f".{LATEST}.tmp":
            p.unlink(missing_ok=True)
    return removed


def load_checkpoint(folder: str | Path, model: nn.Module, optimizers: Optimizers = None,
                    step_dir: Path | None = None,
                    skip: Callable[[str], bool] | None = None) -> int:
    """Load the latest step (or ``step_dir``) into an already parallelised ``model`` (any
    layout) and, when the step holds one, the optimizer state; returns the step. ``skip``:
    tensors of the model the step does not hold, left as they are (LoRA adapters on a run's
    weights: pass no optimizers then, the step's optimizer is the base's)."""
    step_dir = step_dir or latest_step(Path(folder))
    opts = _opt_list(optimizers)
    tensors = model_state(model)
    if skip is not None:
        tensors = {k: v for k, v in tensors.items() if not skip(k)}
    state: dict = {"model": tensors, "step": torch.tensor(0)}
    saved = FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata
    with_optim = bool(opts) and any(k.startswith("optim.") for k in saved)
    options = None if any(NESTED_GROUPS.match(k) for k in saved) else FLAT
    if with_optim:
        state["optim"] = get_optimizer_state_dict(model, opts, options=options)
    dcp.load(state, checkpoint_id=str(step_dir))
    if with_optim:
        set_optimizer_state_dict(model, opts, state["optim"], options=options)
    return int(state["step"])
