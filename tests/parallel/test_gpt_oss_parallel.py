"""A gpt-oss model (sliding-window and full attention with sinks and biases; the MoE with a
router bias, softmax over the top-k logits, expert biases and the clamped SwiGLU) at cp=2 (packed
documents too) and ep=2 equals one process (fp64, 1e-10); tp=2 is refused in one line, before
any work, for the expert biases."""

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
LAYOUTS = {"cp2": {"cp": 2}, "ep2": {"ep": 2}}


def in_ranks() -> dict:
    out = {name: layout_case(layout, CFG, DATA, fp64=True, steps=1)
           for name, layout in LAYOUTS.items()}
    out["cp2-docs"] = docs_case({"cp": 2}, CFG, DOCS32)
    return out


@pytest.fixture(scope="module")
def ranks() -> dict:
    return run_distributed(in_ranks, 2)[0]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_equals_one_process_fp64(ranks, name: str) -> None:
    ref, got = layout_case({}, CFG, DATA, fp64=True, steps=1), ranks[name]
    assert abs(got["eval"] - ref["eval"]) < 1e-10
    assert any(k.endswith("experts.down_proj_bias") for k in ref["grads"])
    for k, g in ref["grads"].items():
        assert (got["grads"][k] - g).abs().max() < 1e-10, k


@pytest.mark.slow
@pytest.mark.distributed
def test_packed_documents_equal_one_process_fp64(ranks) -> None:
    ref, got = docs_case({}, CFG, DOCS32), ranks["cp2-docs"]
    assert abs(got["loss"] - ref["loss"]) < 1e-10
    for k, g in ref["grads"].items():
        assert (got["grads"][k] - g).abs().max() < 1e-10, k


def test_tensor_parallel_is_refused_before_any_work() -> None:
    from composer.build.builder import check_model
    from composer.config import ModelConfig
    from composer.parallel.mesh import LayoutError, ParallelConfig, resolve_layout

    with pytest.raises(LayoutError, match=r"^MoE \(symbol 'E'\) with moe.expert_bias has no "
                                          r"tensor-parallel form yet"):
        check_model(resolve_layout(ParallelConfig(tp=2), world_size=2),
                    ModelConfig.from_dict(CFG))
