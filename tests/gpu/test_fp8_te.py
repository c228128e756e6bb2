"""FP8 through transformer-engine on CUDA (``--precision fp8 --fp8-backend te``): the linears
become ``te.Linear`` with the parameter names of a bf16 run, a short run's losses are finite,
fall and stay near bf16's (FP8's per-GEMM rounding, E4M3's 2**-4 relative step, gives a
few-percent loss difference at this size; the bound is ``tests.gpu.parity.TOL["fp8"]``), and
the masters stay fp32. Skipped without CUDA, transformer-engine or an FP8 GPU (sm_89+)."""

from __future__ import annotations

import math

import pytest
import torch

from composer.train import fp8_te
from tests.gpu.parity import TOL
from tests.helpers import train_case

FP8_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
pytestmark = pytest.mark.skipif(not (FP8_GPU and fp8_te.available()),
                                reason="needs CUDA sm_89+ and transformer-engine")

TINY = {"pattern": "M-M*-", "set": {
    "d_model": 128, "vocab_size": 512, "attention.n_heads": 4, "attention.n_kv_heads": 2,
    "mamba.n_heads": 4, "mamba.d_head": 64, "mamba.n_groups": 2, "mamba.d_state": 16,
    "mamba.chunk_size": 16, "mlp.d_ff": 256}}
RECIPE = {"model": TINY, "tokens": "synthetic", "seq_len": 64, "steps": 8,
          "global_batch_size": 4, "lr": 1e-3, "device": "cuda", "log_every": 1}


def test_te_linears_train_with_bf16_names() -> None:
    from composer.train.engine import resolve, setup

    recipe, _ = resolve(None, None, {**RECIPE, "steps": 0, "precision": "fp8",
                                     "fp8_backend": "te"})
    run, _ = setup(recipe, None, quiet=True)
    run.log.close()
    te = fp8_te._te()
    assert sum(isinstance(m, te.Linear) for m in run.model.modules()) > 0
    fp8 = train_case({**RECIPE, "precision": "fp8", "fp8_backend": "te"})
    bf16 = train_case({**RECIPE, "precision": "bf16"})
    assert fp8["params"].keys() == bf16["params"].keys()
    assert {p.dtype for p in fp8["params"].values()} == {torch.float32}
    assert all(math.isfinite(v) for v in fp8["losses"]) and fp8["losses"][-1] < fp8["losses"][0]
    assert fp8["losses"] == pytest.approx(bf16["losses"], rel=TOL["fp8"])
