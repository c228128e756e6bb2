"""Reinforcement learning pieces for ``--objective grpo``, pure functions with no model in them:
environments (:mod:`.envs`: prompts and rewards; :mod:`.tasks`: the built-in tasks and their
tokenizer) and the policy-gradient math (:mod:`.losses`: advantages, DAPO's overlong penalty and
zero-variance filter, token weights of the three loss aggregations, the clipped surrogate with
the k3 KL penalty)."""

from composer.train.rl.envs import Env, Prompt, RewardError, Score, make_env

__all__ = ["Env", "Prompt", "RewardError", "Score", "make_env"]
