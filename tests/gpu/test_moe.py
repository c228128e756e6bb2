"""Routed experts on a GPU (moved from bench/gpu_check.py's ``moe`` phase, which keeps the
timing): ``Experts._grouped`` (``torch._grouped_mm``, bf16) and ``_loop`` (fp32, bf16), plain and
gpt-oss experts (biases, clamped SwiGLU), within
tolerance of an fp64 loop, forward and backward, with padding rows and an empty expert; a whole
MoE layer's forward and backward without a host synchronisation. The cases are
bench/moe.py's ``parity_rows`` and ``no_sync_row``."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from tests.gpu.parity import DEVICE, DTYPES, needs_device

pytestmark = needs_device


@pytest.fixture(scope="module")
def bench_moe():
    path = Path(__file__).resolve().parents[2] / "bench" / "moe.py"
    spec = importlib.util.spec_from_file_location("bench_moe", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("dtype", DTYPES)
def test_experts_match_fp64(bench_moe, dtype: torch.dtype) -> None:
    rows = bench_moe.parity_rows(DEVICE, [dtype])
    assert rows and all(r["ok"] for r in rows), rows


def test_moe_layer_never_synchronises(bench_moe) -> None:
    if DEVICE != "cuda":
        pytest.skip("the sync debug mode needs CUDA")
    r = bench_moe.no_sync_row(DEVICE)
    assert r["ok"], r["note"]
