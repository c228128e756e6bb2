"""Sliding-window attention (``W``) with learned sinks at tp=2 and cp=2 (the 2N-chunk layout
and the adaptive one, packed documents) equals one process (fp64, 1e-10): the window mask and
the sink logits go through the gathered-K/V path; the sinks split with their heads."""

from __future__ import annotations

import numpy as np
import pytest

from composer.parallel.launch import run_distributed
from tests.helpers import layout_case
from tests.parallel.test_context import DOCS32, docs_case
from tests.parallel.test_pipeline import NO_AUX, cfg_dict

CFG = cfg_dict("W*-W-", NO_AUX, **{"attention.window": 5, "attention.sinks": True,
                                  "attention.window_rope_theta": 100.0})
DATA = np.random.default_rng(0).integers(0, 61, (8, 16))
LAYOUTS = {"tp2": {"tp": 2}, "cp2": {"cp": 2}}


def in_ranks() -> dict:
    out = {name: layout_case(layout, CFG, DATA, fp64=True) for name, layout in LAYOUTS.items()}
    out["cp2-docs"] = docs_case({"cp": 2}, CFG, DOCS32)
    out["cp2-adaptive"] = docs_case({"cp": 2, "cp_adaptive": True}, CFG, DOCS32)
    return out


@pytest.fixture(scope="module")
def ranks() -> dict:
    return run_distributed(in_ranks, 2)[0]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_equals_one_process_fp64(ranks, name: str) -> None:
    ref, got = layout_case({}, CFG, DATA, fp64=True), ranks[name]
    assert abs(got["eval"] - ref["eval"]) < 1e-10
    for k, g in ref["grads"].items():
        assert (got["grads"][k] - g).abs().max() < 1e-10, k
    assert np.allclose(got["losses"], ref["losses"], rtol=0, atol=1e-10)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("name", ["cp2-docs", "cp2-adaptive"])
def test_packed_documents_equal_one_process_fp64(ranks, name: str) -> None:
    ref, got = docs_case({}, CFG, DOCS32), ranks[name]
    assert abs(got["loss"] - ref["loss"]) < 1e-10
    for k, g in ref["grads"].items():
        assert (got["grads"][k] - g).abs().max() < 1e-10, k
