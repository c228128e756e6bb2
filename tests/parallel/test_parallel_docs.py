"""Packed documents (``doc_ids``) under tensor parallelism: the mixers' pre-hooks rewrite only
``args[0]``, so the keyword reaches the sharded attention and Mamba-2 mixers (full sequence
after the SP gather) and the vocab-parallel readout gets the masked labels. fp64, gloo."""

import numpy as np
import pytest
import torch

from composer.config import ModelConfig
from composer.parallel.launch import run_distributed
from composer.parallel.mesh import ParallelConfig
from tests.parallel.test_parallel import tiny_cfg

pytestmark = pytest.mark.slow  # every test here spawns ranks or processes


def case(layout: dict, cfg_dict: dict) -> dict:
    from composer.parallel.data import finish_grads
    from composer.parallel.mesh import build_parallel_dims
    from composer.run import build_sharded

    dims = build_parallel_dims(ParallelConfig(**layout))
    model = build_sharded(ModelConfig.from_dict(cfg_dict), dims, seed=7, dtype=torch.float64)
    ids = torch.from_numpy(np.random.default_rng(0).integers(0, 61, (2, 16))).long()
    docs = torch.tensor([[0] * 5 + [1] * 7 + [2] * 4, [3] * 9 + [4] * 7])
    out = model(ids, ids, doc_ids=docs, return_logits=True)
    out.loss.backward()
    finish_grads(model, dims)

    def full(t: torch.Tensor) -> torch.Tensor:
        return t.full_tensor() if hasattr(t, "full_tensor") else t

    return {"loss": out.loss.item(), "logits": full(out.logits).detach(),
            "grads": {k: full(p.grad).clone() for k, p in model.named_parameters()}}


@pytest.mark.parametrize("sp", [True, False], ids=["sp", "no-sp"])
def test_tp2_with_doc_ids_equals_one_process(sp: bool) -> None:
    ref = case({}, tiny_cfg().to_dict())
    got = run_distributed(case, 2, {"tp": 2, "sequence_parallel": sp}, tiny_cfg().to_dict())[0]
    assert abs(got["loss"] - ref["loss"]) <= 1e-12
    torch.testing.assert_close(got["logits"], ref["logits"], atol=1e-12, rtol=0)
    for k, g in ref["grads"].items():
        torch.testing.assert_close(got["grads"][k], g, atol=1e-12, rtol=0, msg=k)
