"""Post-training on CUDA (issue 24): the ``grpo-debug`` recipe trains on the GPU, where the
rollouts decode with the recurrent steps and the training forward takes the CUDA path of every
layer (the mamba_ssm / causal-conv1d / fla kernels when installed): the generation and training
log-probs must still agree (``logprob_mismatch``, the largest ``exp|dlogp|`` of a rollout's first
update; about 1.0000005 on the CPU in fp32), and accuracy rises. fp32 bounds it at 1.01 (a
kernel whose math differs from the recurrence would be far off: a wrong state is a different
distribution); bf16 only has to be finite and close to 1 (rounding of the scan: ~1e-2).
Measured values are printed (``pytest -s``) for bench/RESULTS.md."""

from __future__ import annotations

import math

import pytest

from tests.gpu.parity import DEVICE, needs_device
from tests.helpers import train_case

pytestmark = needs_device


@pytest.mark.parametrize("precision", ["fp32", "bf16"] if DEVICE == "cuda" else ["fp32"])
def test_grpo_debug_on_the_device(precision: str) -> None:
    from composer.train.recipe import read_recipe, recipe_path

    values = read_recipe(recipe_path("grpo-debug"))
    values.pop("description", None)
    values.update(device=DEVICE, precision=precision, steps=60, eval_every=60, log_every=1)
    out = train_case(values)
    rows = [r for r in out["rows"] if "loss" in r]
    mismatch = max(r["logprob_mismatch"] for r in rows if "logprob_mismatch" in r)
    first, last = out["rows"][0], out["rows"][-1]
    print(f"grpo-debug {DEVICE} {precision}: logprob_mismatch max {mismatch:.7f}, "
          f"val_accuracy {first['val_accuracy']:.3f} -> {last['val_accuracy']:.3f}")
    assert all(str(r["device"]).startswith(DEVICE) for r in rows)
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in rows)
    assert mismatch <= (1.01 if precision == "fp32" else 1.2), mismatch
    if precision == "fp32":
        assert last["val_accuracy"] > first["val_accuracy"], (first, last)
