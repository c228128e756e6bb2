"""SFT of a vision-language model with images on two gloo ranks equals one process: losses,
gradient norms and weights of two steps (fp64 masters), with FSDP2 (``--dp-mode shard``) and
with ``replicate``, and with ``--freeze vision``. The data has rows without images, so some
micro-batches on some ranks have none: they run the tower's stand-in, and every rank reduces
the same gradients. All cases run in one pair of spawned ranks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from composer.parallel.launch import run_distributed
from tests.helpers import train_case
from tests.train.test_vlm_sft import vl_dataset, vl_values

pytestmark = pytest.mark.slow  # every test here spawns ranks

CASES = {"shard": {"dp": 2, "micro_batch_size": 1},
         "replicate": {"dp": 2, "dp_mode": "replicate", "micro_batch_size": 2},
         "freeze": {"dp": 2, "micro_batch_size": 1, "freeze": ["vision"]}}


def _summary(out: dict) -> dict:
    return {"losses": out["losses"], "norms": [r["grad_norm"] for r in out["rows"]],
            "params": out["params"]}


def in_ranks(data: tuple[str, dict]) -> dict:
    return {name: _summary(train_case(vl_values(data, **case), fp64=True))
            for name, case in CASES.items()}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> tuple[tuple[str, dict], dict]:
    data = vl_dataset(Path(tmp_path_factory.mktemp("vlsft")))
    return data, run_distributed(in_ranks, 2, data)[0]


@pytest.mark.parametrize("case", list(CASES))
def test_dp2_equals_one_process(ranks, case: str) -> None:
    data, got = ranks
    extra = {"freeze": ["vision"]} if case == "freeze" else {}
    ref = _summary(train_case(vl_values(data, **extra), fp64=True))
    got = got[case]
    assert np.allclose(got["losses"], ref["losses"], rtol=1e-10, atol=0)
    assert np.allclose(got["norms"], ref["norms"], rtol=1e-10, atol=0)
    assert got["params"].keys() == ref["params"].keys()
    for k, p in ref["params"].items():
        assert (got["params"][k] - p).abs().max() < 1e-10, k
