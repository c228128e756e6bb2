"""Training checkpoints with torch.distributed.checkpoint (DCP): sharded, resharded on load.

A ``--save`` folder holds ``config.yaml``, one ``step-NNNNNNNN/`` folder per saved step and a
``latest`` file naming the newest complete one. Every rank writes its shards; ``latest`` is
replaced atomically by rank 0 only after all ranks finished, so a crash never publishes a
partial step. The state is keyed by parameter name (the same under every layout: tensor-parallel
shards are DTensors of the full shape, Mamba's fused projections are stored per component), so a
step saved at one layout loads at another.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from composer.blocks.plan import named_state
from composer.checkpoint import CONFIG_FILE

LATEST = "latest"

# DCP warns when it runs without a process group; a single process is a supported layout here.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or "
                        "uninitialized", category=UserWarning)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers by name (DTensors under parallelism)."""
    return dict(named_state(model))


def is_training_checkpoint(folder: Path) -> bool:
    return (Path(folder) / LATEST).exists()


def latest_step(folder: Path) -> Path:
    folder = Path(folder)
    name = (folder / LATEST).read_text().strip()
    path = folder / name
    if not path.is_dir():
        raise FileNotFoundError(f"{folder}/{LATEST} names {name!r}, which is missing")
    return path


def save_checkpoint(folder: str | Path, step: int, model: nn.Module,
                    optimizer: torch.optim.Optimizer | None = None) -> Path:
    folder = Path(folder)
    step_dir = folder / f"step-{step:08d}"
    state: dict = {"model": model_state(model), "step": torch.tensor(step)}
    # A fresh optimizer has no state yet (train --steps 0): saving it would materialise its
    # moments (2x the model); resuming then starts a fresh one, which is the same thing.
    if optimizer is not None and optimizer.state:
        state["optim"] = get_optimizer_state_dict(model, optimizer)
    if _rank0():
        folder.mkdir(parents=True, exist_ok=True)
    _barrier()
    dcp.save(state, checkpoint_id=str(step_dir))
    _barrier()
    if _rank0():
        model.config.save(folder / CONFIG_FILE)
        tmp = folder / f".{LATEST}.tmp"
        tmp.write_text(step_dir.name + "\n")
        os.replace(tmp, folder / LATEST)
    _barrier()
    return step_dir


def load_checkpoint(folder: str | Path, model: nn.Module,
                    optimizer: torch.optim.Optimizer | None = None) -> int:
    """Load the latest step into an already parallelised ``model`` (any layout); its step."""
    step_dir = latest_step(Path(folder))
    state: dict = {"model": model_state(model), "step": torch.tensor(0)}
    saved = FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata
    with_optim = optimizer is not None and any(k.startswith("optim.") for k in saved)
    if with_optim:
        state["optim"] = get_optimizer_state_dict(model, optimizer)
    dcp.load(state, checkpoint_id=str(step_dir))
    if with_optim:
        set_optimizer_state_dict(model, optimizer, state["optim"])
    return int(state["step"])
