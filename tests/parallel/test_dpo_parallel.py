"""The DPO objective on two gloo ranks equals one process: the losses, gradient norms, reward
metrics, weights after two steps and the validation metrics at tp=2, dp=2 (FSDP: the reference
copy sharded like the policy; the global-pair normalisation) and ep=2, and LoRA at dp=2 (the
reference is the policy with its adapters off), all with fp64 masters; the reference copy's
parameters are laid out (types, placements, local shapes) as the policy's at tp=2 and dp=2. All
cases run in one pair of spawned ranks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from composer.parallel.launch import run_distributed
from tests.helpers import train_case
from tests.train.test_dpo import dpo_values, preference_data

pytestmark = pytest.mark.slow  # every test here spawns ranks

LAYOUTS = {"tp2": {"tp": 2}, "dp2": {"dp": 2}, "ep2": {"ep": 2},
           "dp2-lora": {"dp": 2, "lora_rank": 4}}
EVAL = {"split": "80,20,0", "eval_every": 2, "eval_iters": 1}
METRICS = ("reward_accuracy", "reward_margin", "chosen_reward", "rejected_reward", "tokens")


def _summary(out: dict) -> dict:
    rows = [r for r in out["rows"] if r["step"] > 0]
    return {"losses": out["losses"], "norms": [r["grad_norm"] for r in rows],
            "metrics": [[r[k] for k in METRICS] for r in rows],
            "val": [out["rows"][-1][k] for k in ("val_loss", "val_reward_accuracy",
                                                 "val_reward_margin")],
            "params": out["params"]}


def _values(data: str, layout: dict) -> dict:
    return dpo_values(data, **layout, **EVAL)


def _shards(data: str, layout: dict) -> tuple[list, list]:
    """How the policy's and the reference copy's parameters are laid out on this rank."""
    from composer.train.engine import resolve, setup

    recipe, resume = resolve(None, None, _values(data, layout))
    run, _ = setup(recipe, resume, quiet=True)
    run.log.close()

    def layout_of(model) -> list:
        return [(k, type(p).__name__, str(getattr(p, "placements", None)), tuple(p.shape))
                for k, p in model.named_parameters()]

    return layout_of(run.model), layout_of(run.ref_model.model)


def in_ranks(data: str) -> dict:
    out = {name: _summary(train_case(_values(data, layout), fp64=True))
           for name, layout in LAYOUTS.items()}
    out["shards"] = {name: _shards(data, LAYOUTS[name]) for name in ("tp2", "dp2")}
    return out


@pytest.mark.parametrize("layout", ["tp2", "dp2"])
def test_the_reference_copy_is_sharded_like_the_policy(ranks, layout: str) -> None:
    policy, reference = ranks[1]["shards"][layout]
    assert policy == reference
    assert any(kind == "DTensor" for _, kind, _, _ in reference)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> tuple[str, dict]:
    data = preference_data(Path(tmp_path_factory.mktemp("dpo")), 60)
    return data, run_distributed(in_ranks, 2, data)[0]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_equals_one_process(ranks, layout: str) -> None:
    data, got = ranks
    one = {k: v for k, v in LAYOUTS[layout].items() if k == "lora_rank"}
    ref = _summary(train_case(_values(data, one), fp64=True))
    got = got[layout]
    assert abs(ref["losses"][0] - np.log(2)) <= 1e-12
    assert np.allclose(got["losses"], ref["losses"], rtol=1e-10, atol=0)
    assert np.allclose(got["norms"], ref["norms"], rtol=1e-10, atol=0)
    assert np.allclose(got["metrics"], ref["metrics"], rtol=1e-10, atol=1e-12)
    assert np.allclose(got["val"], ref["val"], rtol=1e-10, atol=1e-12)
    for k, p in ref["params"].items():
        assert (got["params"][k] - p).abs().max() < 1e-10, k
