"""Mamba-1 (S) under context parallelism equals one process (gloo, fp64, 1e-10): the eval loss,
every gradient and two AdamW steps at cp=2; packed documents that cross the ranks' chunks, in
the 2N-chunk layout and the adaptive one. All three in one spawn of two ranks. Tensor
parallelism is refused in one line before any work (tests/blocks/test_mamba1.py has the exact
message; here the training engine's refusal)."""

from __future__ import annotations

import numpy as np
import pytest

from composer.parallel.launch import run_distributed
from tests.parallel.test_context import DOCS, _same, docs_case
from tests.parallel.test_parallel import case, check_same

CFG = {"pattern": "S*SE", "d_model": 32, "vocab_size": 61, "attention": {"n_heads": 4},
       "moe": {"n_experts": 4, "top_k": 4, "d_ff": 32},  # top-k of all: no routing ties
       "mamba1": {"d_inner": 48, "d_state": 6, "dt_rank": 4, "inner_norms": "learned"}}
DATA = np.random.default_rng(0).integers(0, 61, (8, 16))


def in_ranks() -> dict:
    return {"train": case({"cp": 2}, CFG, DATA, 2, True),
            "docs": docs_case({"cp": 2}, CFG, DOCS),
            "adaptive": docs_case({"cp": 2, "cp_adaptive": True}, CFG, DOCS)}


@pytest.mark.slow
def test_cp2_equals_one_process_fp64() -> None:
    got = run_distributed(in_ranks, 2)
    reference = case({}, CFG, DATA, 2, True)
    docs = docs_case({}, CFG, DOCS)
    for rank in got:
        check_same(rank["train"], reference, tol=1e-10, loss_tol=1e-10)
        _same(rank["docs"], docs)
        _same(rank["adaptive"], docs)


def test_tp_is_refused_before_any_work() -> None:
    from composer.build.builder import check_model
    from composer.config import ModelConfig
    from composer.parallel.mesh import LayoutError, ParallelConfig, resolve_layout

    with pytest.raises(LayoutError, match=r"^Mamba-1 \(symbol 'S'\) has no tensor-parallel "
                                          r"form: .* use --tp 1$"):
        check_model(resolve_layout(ParallelConfig(tp=2, cp=2), world_size=4),
                    ModelConfig.from_dict(CFG))
