"""The CLI under torchrun: train at tp=2 and save, evaluate the checkpoint at dp=2 and on one
process; the losses agree and only rank 0 prints."""

import json
import subprocess
import sys

import numpy as np
import pytest

from composer.cli import main

pytestmark = pytest.mark.slow  # every test here spawns ranks or processes

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]  # what the torchrun script runs


def run(args, tmp_path, nproc=2):
    cmd = ([*TORCHRUN, "--standalone", "--nproc_per_node", str(nproc), "-m",
            "composer"]
           if nproc > 1 else [sys.executable, "-m", "composer"])
    proc = subprocess.run(cmd + args, capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_train_tp2_then_eval_anywhere(tmp_path):
    assert main(["build", "--preset", "nemotron-3-nano-debug", "--out", str(tmp_path / "ck"),
                 "--json"]) == 0
    np.save(tmp_path / "tokens.npy", np.random.default_rng(0).integers(0, 512, (8, 32)))
    tok = str(tmp_path / "tokens.npy")
    out = run(["train", str(tmp_path / "ck"), "--tokens", tok, "--steps", "2", "--batch-size",
               "4", "--lr", "1e-3", "--tp", "2", "--save", str(tmp_path / "run"), "--json"],
              tmp_path)
    losses = json.loads(out)["losses"]  # one line: rank 1 printed nothing
    assert len(losses) == 2
    at_dp2 = json.loads(run(["eval", str(tmp_path / "run"), "--tokens", tok, "--dp", "2",
                             "--json"], tmp_path))
    at_one = json.loads(run(["eval", str(tmp_path / "run"), "--tokens", tok, "--json"],
                            tmp_path, nproc=1))
    assert at_dp2["n_tokens"] == at_one["n_tokens"] == 8 * 31
    assert abs(at_dp2["loss"] - at_one["loss"]) <= 1e-5 * at_one["loss"]
    assert at_one["loss"] < losses[0]  # two steps of training helped
