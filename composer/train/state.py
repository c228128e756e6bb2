"""What a training checkpoint holds beyond the DCP model and optimizer state, and the saver.

Per step folder: ``train_state.json`` (rank 0: step, consumed samples and tokens, skipped-step
counts, the learning-rate schedule and the resolved recipe) and ``rng-rank-R.json`` (each rank:
the torch CPU and CUDA, numpy and python random states). Plain JSON, so loading a checkpoint
never unpickles anything.
"""

from __future__ import annotations

import base64
import json
import random
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from composer.parallel.checkpoint import is_rank0, publish, write_step

TRAIN_STATE = "train_state.json"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def rng_state() -> dict[str, Any]:
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    py_version, py_state, py_gauss = random.getstate()
    state = {"torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
             "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(gauss)],
             "python": [py_version, list(py_state), py_gauss]}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [base64.b64encode(s.numpy().tobytes()).decode()
                         for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    def tensor(text: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)

    torch.set_rng_state(tensor(state["torch"]))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))
    version, py_state, py_gauss = state["python"]
    random.setstate((version, tuple(py_state), py_gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([tensor(s) for s in state["cuda"]])


def read_train_state(step_dir: Path) -> dict[str, Any]:
    path = Path(step_dir) / TRAIN_STATE
    if not path.exists():  # a step written by `train --steps 0` before this engine, or export
        return {}
    return json.loads(path.read_text())


def restore_rng(step_dir: Path) -> None:
    """This rank's saved random states (rank 0's when the step was saved by fewer ranks)."""
    for rank in (_rank(), 0):
        path = Path(step_dir) / f"rng-rank-{rank}.json"
        if path.exists():
            set_rng_state(json.loads(path.read_text()))
            return


class Saver:
    """Saves steps into ``folder``; with ``async_save`` the previous save is completed (and
    published) before the next one starts, and by :meth:`finish`."""

    def __init__(self, folder: str | Path, keep_last: int, async_save: bool = False) -> None:
        self.folder, self.keep_last, self.async_save = Path(folder), keep_last, async_save
        self.pending: tuple[Path, Future, dict, Any] | None = None
        self.group = None
        if async_save and dist.is_initialized():
            self.group = dist.new_group(backend="gloo")  # DCP's own collectives, off the hot path

    def save(self, step: int, model: nn.Module, optimizers: list, train_state: dict) -> Path:
        self.finish()
        step_dir, future = write_step(self.folder, step, model, optimizers,
                                      async_group=self.group, async_save=self.async_save)
        step_dir.mkdir(parents=True, exist_ok=True)
        (step_dir / f"rng-rank-{_rank()}.json").write_text(json.dumps(rng_state()))
        if future is None:
            self._publish(step_dir, train_state, model.config)
        else:
            self.pending = (step_dir, future, train_state, model.config)
        return step_dir

    def finish(self) -> None:
        """Wait for a pending asynchronous save, then publish it."""
        if self.pending is None:
            return
        step_dir, future, train_state, config = self.pending
        self.pending = None
        future.result()
        self._publish(step_dir, train_state, config)

    def _publish(self, step_dir: Path, train_state: dict, config) -> None:
        def write_state() -> None:
            (step_dir / TRAIN_STATE).write_text(json.dumps(train_state, indent=1))

        publish(self.folder, step_dir, config, self.keep_last,
                before=write_state if is_rank0() else None)
