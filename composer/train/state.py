"""What a training checkpoint holds beyond the DCP model and optimizer state, and the saver.

Per step folder: ``train_state.json`` (rank 0: step, consumed samples and tokens, skipped-step
counts, the learning-rate schedule and the resolved recipe) and ``rng-rank-R.json`` (each rank:
the torch CPU and CUDA, numpy and python random states). Plain JSON, so loading a checkpoint
never unpickles anything.
"""

from __future__ import annotations

import base64
import json
import os
import random
import shutil
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


class CreatedPaths:
    """What a run is about to create in the folders it writes (``--save``, ``--log-dir``), so
    that a run failing before its first step can remove it: a folder that did not exist (with
    any parents made for it), or the new entries of one that did. Nothing that existed before
    is touched."""

    def __init__(self, folders: list[str | None]) -> None:
        self.new: list[Path] = []
        self.kept: dict[Path, set[str]] = {}
        for folder in dict.fromkeys(f for f in folders if f):
            path = Path(folder).absolute()
            if path.is_dir():
                self.kept[path] = set(os.listdir(path))
                continue
            while not path.parent.exists():
                path = path.parent
            if not path.exists():
                self.new.append(path)

    def remove(self) -> None:
        for path in self.new:
            shutil.rmtree(path, ignore_errors=True)
        for folder, names in self.kept.items():
            for name in set(os.listdir(folder)) - names if folder.is_dir() else ():
                target = folder / name
                if target.is_dir() and not target.is_symlink():
                    shutil.rmtree(target, ignore_errors=True)
                else:
                    target.unlink(missing_ok=True)
