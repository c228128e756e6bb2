"""Sliding-window attention (``W``) with learned sinks at tp=2 and cp=2 (the 2N-chunk layout
and the adaptive one, packed documents) equals one process (fp64, 1e-10): the window mask and
the sink logits go through the gathered-K/V path; the sinks split with their heads. A Gemma 3
shaped model (sandwich norms, zero-centred, scaled embedding, GeGLU-tanh) at tp=2 and cp=2
too."""

from __future__ import annotations

import numpy as np
import pytest

from composer.parallel.launch import run_distributed
from tests.helpers import layout_case
from tests.parallel.test_context import DOCS32, docs_case
from tests.parallel.test_pipeline import NO_AUX, cfg_dict

CFG = cfg_dict("W*-W-", NO_AUX, **{"attention.window": 5, "attention.sinks": True,
                                  "attention.window_rope_theta": 100.0})
GEMMA = cfg_dict("W-W-*-", NO_AUX, **{
    "attention.window": 3, "attention.window_rope_theta": 100.0, "attention.qk_norm": True,
    "attention.softmax_scale": 0.3, "attention.d_head": 16, "sandwich_norm": True,
    "norm_zero_centered": True, "embedding_multiplier": 5.0,
    "embedding_multiplier_in_dtype": True, "mlp.activation": "geglu_tanh"})
DATA = np.random.default_rng(0).integers(0, 61, (8, 16))
LAYOUTS = {"tp2": ({"tp": 2}, CFG), "cp2": ({"cp": 2}, CFG), "gemma-tp2": ({"tp": 2}, GEMMA),
           "gemma-cp2": ({"cp": 2}, GEMMA)}


def in_ranks() -> dict:
    out = {name: layout_case(layout, cfg, DATA, fp64=True)
           for name, (layout, cfg) in LAYOUTS.items()}
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
    ref, got = layout_case({}, LAYOUTS[name][1], DATA, fp64=True), ranks[name]
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
