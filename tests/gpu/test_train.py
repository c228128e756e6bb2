"""The engine trains on CUDA (moved from bench/gpu_check.py's train report, which keeps the
timing of the 1.0B run): ``composer train`` of a tiny hybrid for 12 steps logs every step with
its parameters (``device``) and its batch (``batch_device``) on CUDA, finite losses that fall,
no skipped step, and the final ``--json`` line."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import yaml

from tests.gpu.parity import DEVICE, needs_device

pytestmark = needs_device

ROOT = Path(__file__).resolve().parents[2]
TINY = {"pattern": "M-M*-", "set": {
    "d_model": 64, "vocab_size": 512, "tie_embeddings": False, "attention.n_heads": 4,
    "attention.n_kv_heads": 2, "attention.d_head": 16, "mamba.n_heads": 4, "mamba.d_head": 32,
    "mamba.n_groups": 2, "mamba.d_state": 16, "mamba.chunk_size": 16, "mlp.d_ff": 128,
    "mlp.activation": "relu2"}}
STEPS = 12


def test_training_runs_on_cuda(tmp_path: Path) -> None:
    recipe = {"model": TINY, "global_batch_size": 2, "micro_batch_size": 1, "lr": 3e-4,
              "min_lr": 3e-5, "warmup_steps": 5, "schedule": "cosine", "optimizer": "adamw",
              "grad_clip": 1.0}
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    precision = "bf16" if DEVICE == "cuda" else "fp32"
    cmd = [sys.executable, "-m", "composer", "train", "--config", str(tmp_path / "recipe.yaml"),
           "--tokens", "synthetic", "--seq-len", "64", "--steps", str(STEPS), "--precision",
           precision, "--ac", "full", "--device", DEVICE, "--log-dir", str(tmp_path),
           "--log-every", "1", "--json"]
    path = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(ROOT)) if p)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": path})
    assert proc.returncode == 0, proc.stderr[-2000:]
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == STEPS
    for key in ("device", "batch_device"):
        assert all(str(s.get(key, "")).startswith(DEVICE) for s in steps), \
            sorted({str(s.get(key)) for s in steps})
    losses = [s["loss"] for s in steps]
    assert all(math.isfinite(v) for v in losses), losses
    assert losses[-1] < losses[0], losses
    assert not any(s.get("skipped") for s in steps)
    final = json.loads(proc.stdout.strip().splitlines()[-1])
    assert final["steps"] == STEPS
