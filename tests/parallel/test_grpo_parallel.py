"""GRPO on two gloo ranks equals one process for a fixed seed: at dp=2 (each rank generating
half the prompts; also with ``--scale-rewards batch`` and ``seq-mean-token-mean``, which need the
whole rollout's statistics, and with ``--kl-coef``'s sharded reference) and at tp=2: the
rollouts' rewards and advantages, the losses, gradient norms, the weights after two steps (the
second rollout is sampled by the updated weights) and the greedy evaluation, in fp32. A reward
function failing on rank 1 stops both ranks with its message; a prompt count that dp does not
divide is refused. All cases run in one pair of spawned ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from composer.parallel.launch import run_distributed
from tests.train.test_grpo import grpo_values, reward_env

pytestmark = pytest.mark.slow  # every test here spawns ranks

LAYOUTS = {"dp2": {"dp": 2, "micro_batch_size": 4}, "tp2": {"tp": 2},
           "dp2-batch": {"dp": 2, "scale_rewards": "batch", "loss_agg": "seq-mean-token-mean"},
           "dp2-kl": {"dp": 2, "kl_coef": 0.1}}
"""Layouts; with the batch's reward std and the per-sequence mean, options whose global
statistics the ranks must share; with the KL term, a sharded reference copy."""
OPTIONS = ("scale_rewards", "loss_agg", "kl_coef")
TOLERANCE = 1e-5
"""fp32: the layouts sum the same terms in other orders (another batch split, a split
vocabulary and split heads), a relative change of ~1e-7 per step; Adam's normalisation moves a
weight by at most ``lr / eps`` times its gradient's change, ~1e-6 here."""


def grpo_case(values: dict) -> dict:
    """Each step's global rollout plan (rewards, advantages, kept), losses, gradient norms,
    the final evaluation and weights (whole tensors) of the run ``values`` describe (every
    rank calls it)."""
    from composer.train.engine import resolve, setup
    from composer.train.loop import take_step

    recipe, resume = resolve(None, None, values)
    run, last = setup(recipe, resume, quiet=True)
    plans, losses, norms = [], [], []
    try:
        for step in range(1, last + 1):
            stats = take_step(run, step, False)
            plan = run.state["rollout"].plan
            plans.append({"rewards": plan.rewards, "advantages": plan.advantages,
                          "keep": plan.keep})
            losses.append(stats.loss)
            norms.append(stats.grad_norm)
        val = run.objective.validate(run)  # greedy, each rank its share of the eval prompts
    finally:
        run.log.close()

    def whole(v: torch.Tensor) -> torch.Tensor:
        return (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()

    return {"plans": plans, "losses": losses, "norms": norms, "val": val,
            "params": {k: whole(v) for k, v in run.model.named_parameters()}}


def values(folder: str, **layout) -> dict:
    # adam_eps bounds how far rounding noise in a near-zero gradient moves a weight
    return grpo_values(steps=2, lr=1e-2, schedule="constant", adam_eps=1e-3, max_new_tokens=4,
                       **reward_env(Path(folder), "first_char"), **layout)


def in_ranks(folder: str, bad: str) -> dict:
    from composer.config import ConfigError
    from composer.train.rl.envs import RewardError

    out = {name: grpo_case(values(folder, **layout)) for name, layout in LAYOUTS.items()}
    try:
        grpo_case({**values(folder, dp=2), "prompts_per_step": 3})
    except ConfigError as exc:
        out["refused"] = str(exc)
    try:  # rank 1's reward function raises: every rank stops with its message
        grpo_case({**values(folder, dp=2), **reward_env(Path(folder) / "bad", "raises_if_bad",
                                                        bad)})
    except RewardError as exc:
        out["error"] = str(exc)
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> tuple[str, dict, list[str]]:
    from composer.train.grpo_rollout import mix_seed
    from composer.train.rl.envs import make_env

    folder = tmp_path_factory.mktemp("grpo")
    env = reward_env(folder, "first_char")  # the prompts files, before the ranks read them
    (folder / "bad").mkdir()
    last = make_env(env["env"], env["env_arg"]).prompts(4, mix_seed(values(str(folder))["seed"],
                                                                     0))[3]
    reward_env(folder / "bad", "raises_if_bad", last.text)  # the last prompt: rank 1's
    results = run_distributed(in_ranks, 2, str(folder), last.text)
    return str(folder), results[0], [r.get("error") for r in results]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_equals_one_process(ranks, layout: str) -> None:
    folder, got, _ = ranks
    options = {k: v for k, v in LAYOUTS[layout].items() if k in OPTIONS}
    ref, got = grpo_case(values(folder, **options)), got[layout]
    for mine, theirs in zip(got["plans"], ref["plans"], strict=True):
        assert torch.equal(mine["keep"], theirs["keep"])
        assert torch.allclose(mine["rewards"], theirs["rewards"], rtol=0, atol=0)
        assert torch.allclose(mine["advantages"], theirs["advantages"], rtol=0,
                              atol=TOLERANCE)
    assert got["losses"] == pytest.approx(ref["losses"], rel=TOLERANCE, abs=TOLERANCE)
    assert got["norms"] == pytest.approx(ref["norms"], rel=TOLERANCE)
    assert min(ref["norms"]) > 1e-2  # the updates are not trivially zero
    assert got["val"] == pytest.approx(ref["val"], rel=1e-12)
    for k, p in ref["params"].items():
        assert (got["params"][k] - p).abs().max() <= TOLERANCE, k


def test_prompts_not_divisible_by_dp_are_refused(ranks) -> None:
    assert ranks[1]["refused"] == ("--prompts-per-step (3) must be divisible by dp (2): each "
                                   "data-parallel rank generates its share")


def test_one_ranks_reward_error_stops_every_rank(ranks) -> None:
    *_, errors = ranks
    assert errors[0] == errors[1] and errors[0].startswith(
        "reward function tests.train.test_grpo:raises_if_bad raised on prompt 3: KeyError"), errors
