"""A gpt-oss model (sliding-window and full attention with sinks and biases; the MoE with a
router bias, softmax over the top-k logits, expert biases and the clamped SwiGLU) at cp=2 (packed
documents too), ep=2 and tp=2 (the experts' gate/up biases split with their hidden units, the
down bias counted once) equals one process (fp64, 1e-10)."""

from __future__ import annotations

import numpy as np
import pytest

from composer.parallel.launch import run_distributed
from tests.helpers import layout_case
from tests.parallel.test_context import DOCS32, docs_case
from tests.parallel.test_pipeline import NO_AUX, cfg_dict

CFG = cfg_dict("WE*EWE", NO_AUX, **{
    "attention.window": 5, "attention.sinks": True, "attention.qkv_bias": True,
    "attention.out_bias": True, "moe.score_func": "topk_softmax", "moe.router_bias": True,
    "moe.expert_bias": True, "moe.swiglu_limit": 1.0})
DATA = np.random.default_rng(0).integers(0, 61, (8, 16))
LAYOUTS = {"cp2": {"cp": 2}, "ep2": {"ep": 2}, "tp2": {"tp": 2}}
WIDE = {"tp2-ep2": {"tp": 2, "ep": 2}}
"""On 4 ranks: tp 2 x dp 2, ep 2 inside dp (the down bias replicated over tp, split over ep)."""

STEPS = 2
"""The expert biases start at zero: the second step's loss and the weights after it are where a
wrongly counted down bias would show in the forward, not only in its gradient."""


def in_ranks(layouts: dict, docs: bool) -> dict:
    out = {name: layout_case(layout, CFG, DATA, fp64=True, steps=STEPS)
           for name, layout in layouts.items()}
    if docs:
        out["cp2-docs"] = docs_case({"cp": 2}, CFG, DOCS32)
    return out


@pytest.fixture(scope="module")
def ranks() -> dict[str, list[dict]]:
    """Every rank's results, by case: a replicated weight must be right on every rank (a down
    bias whose tp ranks disagree would leave rank 0's outputs and gradients right)."""
    out: dict[str, list[dict]] = {}
    for world, layouts, docs in ((2, LAYOUTS, True), (4, WIDE, False)):
        for result in run_distributed(in_ranks, world, layouts, docs):
            for name, case in result.items():
                out.setdefault(name, []).append(case)
    return out


@pytest.fixture(scope="module")
def one_process() -> dict:
    return layout_case({}, CFG, DATA, fp64=True, steps=STEPS)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("name", [*LAYOUTS, *WIDE])
def test_layout_equals_one_process_fp64(ranks, one_process, name: str) -> None:
    ref = one_process
    assert any(k.endswith("experts.down_proj_bias") for k in ref["grads"])
    for rank, got in enumerate(ranks[name]):
        assert abs(got["eval"] - ref["eval"]) < 1e-10, rank
        for k, g in ref["grads"].items():
            assert (got["grads"][k] - g).abs().max() < 1e-10, (rank, k)
        assert np.allclose(got["losses"], ref["losses"], rtol=0, atol=1e-10), rank
        for k, p in ref["params"].items():
            assert (got["params"][k] - p).abs().max() < 1e-10, (rank, k)


@pytest.mark.slow
@pytest.mark.distributed
def test_packed_documents_equal_one_process_fp64(ranks) -> None:
    ref, got = docs_case({}, CFG, DOCS32), ranks["cp2-docs"][0]
    assert abs(got["loss"] - ref["loss"]) < 1e-10
    for k, g in ref["grads"].items():
        assert (got["grads"][k] - g).abs().max() < 1e-10, k

