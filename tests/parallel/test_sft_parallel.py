"""The SFT objective on two gloo ranks equals one process: the gradient of one step at dp=2
(the global masked-token normalisation, fp32 1e-6), and the losses, gradient norms and weights
of two steps and the masked validation loss at pp=2, cp=2, tp=2 and ep=2 (fp64 masters). All cases
run in one pair of spawned ranks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from composer.parallel.launch import run_distributed
from tests.helpers import train_case
from tests.train.test_sft import LENGTHS, assert_grads_close, masked_data, sft_values, step_grads

pytestmark = pytest.mark.slow  # every test here spawns ranks

LAYOUTS = {"pp2": {"pp": 2, "micro_batch_size": 1}, "cp2": {"cp": 2}, "tp2": {"tp": 2},
           "ep2": {"ep": 2}}
EVAL = {"split": "80,20,0", "eval_every": 2, "eval_iters": 1}
"""Every layout also evaluates (the masked validation loss) after its second step."""


def _summary(out: dict) -> dict:
    return {"losses": out["losses"], "norms": [r["grad_norm"] for r in out["rows"]],
            "supervised": [r["supervised_tokens"] for r in out["rows"]],
            "val_loss": out["rows"][-1]["val_loss"],
            "params": out["params"]}


def in_ranks(data: str) -> dict:
    results = {"dp2": step_grads(sft_values(data, dp=2, micro_batch_size=2))}
    for name, layout in LAYOUTS.items():
        results[name] = _summary(train_case(sft_values(data, **layout, **EVAL), fp64=True))
    return results


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> tuple[str, dict]:
    tmp = tmp_path_factory.mktemp("sft")
    data = masked_data(Path(tmp), LENGTHS * 3, unsupervised=4)
    return data, run_distributed(in_ranks, 2, data)[0]


def test_dp2_gradient_equals_one_process(ranks) -> None:
    data, got = ranks
    assert_grads_close(got["dp2"], step_grads(sft_values(data, micro_batch_size=8)))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_equals_one_process(ranks, layout: str) -> None:
    data, got = ranks
    ref = _summary(train_case(sft_values(data, **EVAL), fp64=True))
    got = got[layout]
    assert got["supervised"] == ref["supervised"]
    assert np.allclose(got["losses"], ref["losses"], rtol=1e-10, atol=0)
    assert np.allclose(got["norms"], ref["norms"], rtol=1e-10, atol=0)
    assert np.isclose(got["val_loss"], ref["val_loss"], rtol=1e-10, atol=0)
    for k, p in ref["params"].items():
        if k in got["params"]:  # a pipeline rank holds its stages' weights
            assert (got["params"][k] - p).abs().max() < 1e-10, k
