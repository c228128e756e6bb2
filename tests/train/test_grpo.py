"""The GRPO objective in one process: the rollout's layout (log-probs aligned with the targets
they score, completions cut at their eos), the update plan's DAPO flags, ``composer train
--objective grpo`` end to end (metrics, the step-0 accuracy row, the saved tokenizer), a
rollout reused for ``--updates-per-rollout 2``, LoRA's reference without a copy, the one-line
errors of a bad reward function with nothing saved, the refusals; and (slow) that the shipped
``grpo-debug`` recipe learns its task."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from composer.config import ConfigError
from composer.train.grpo_rollout import (
    mix_seed,
    pad_sequences,
    plan_update,
    prompt_share,
    split_completions,
)
from composer.train.recipe import Recipe
from composer.train.rl.tasks import EOS, TASKS_TOKENIZER

MODEL = {"pattern": "M*-", "set": {"vocab_size": 22, "d_model": 32, "attention.n_heads": 2,
                                   "attention.n_kv_heads": 2, "mamba.n_heads": 2,
                                   "mamba.d_head": 16, "mamba.n_groups": 1, "mamba.d_state": 8,
                                   "mamba.chunk_size": 8, "mlp.d_ff": 64}}
ARITH = ["digits=1", "ops=+", "max_answer=9"]


def grpo_values(**kw) -> dict:
    """A seconds-long GRPO run on one-digit sums (answers of up to two tokens)."""
    return {"model": MODEL, "objective": "grpo", "env": "arith", "env_arg": ARITH,
            "prompts_per_step": 4, "group_size": 4, "max_new_tokens": 3, "steps": 2,
            "lr": 1e-3, "device": "cpu", "precision": "fp32", "seed": 3, **kw}


def test_pad_sequences_aligns_logprobs_with_targets() -> None:
    seqs = pad_sequences([[5, 6, 7], [4]], [[8, 9, EOS], [3]], [[-0.1, -0.2, -0.3], [-0.5]],
                         [False, True], pad_id=EOS)
    assert seqs.ids.tolist() == [[5, 6, 7, 8, 9, EOS], [4, 3, EOS, EOS, EOS, EOS]]
    # position t predicts token t + 1: the completion's tokens only, each with its log-prob
    assert seqs.targets.tolist() == [[-100, -100, 8, 9, EOS, -100],
                                     [3, -100, -100, -100, -100, -100]]
    assert torch.equal(seqs.logp_old, torch.tensor([[0, 0, -0.1, -0.2, -0.3, 0],
                                                    [-0.5, 0, 0, 0, 0, 0]]))
    assert seqs.lengths.tolist() == [3, 1] and seqs.truncated.tolist() == [False, True]
    second = seqs.rows(1, 2)  # trimmed to its own length
    assert second.ids.tolist() == [[4, 3]] and second.targets.tolist() == [[3, -100]]


def test_split_completions_cuts_at_the_first_eos() -> None:
    ids = torch.tensor([[1, 2, 7, EOS, EOS], [1, 2, EOS, EOS, EOS], [1, 2, 7, 8, 9]])
    logp = torch.tensor([[-1.0, -2.0, 0.0], [-3.0, 0.0, 0.0], [-1.0, -1.5, -2.5]])
    tokens, logps, truncated = split_completions(ids, 2, logp,
                                                 torch.tensor([True, True, False]), EOS)
    assert tokens == [[7, EOS], [EOS], [7, 8, 9]]
    assert logps == [[-1.0, -2.0], [-3.0], [-1.0, -1.5, -2.5]]
    assert truncated == [False, False, True]


def test_prompt_shares_and_seeds() -> None:
    assert [list(prompt_share(8, 4, r)) for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert mix_seed(0, 1, 2) == mix_seed(0, 1, 2)
    assert len({mix_seed(0, s, i) for s in range(20) for i in range(20)}) == 400
    assert 0 <= mix_seed(2**40, -1) < 2**63


def _recipe(**kw) -> Recipe:
    return dataclasses.replace(Recipe(), prompts_per_step=3, group_size=2, max_new_tokens=4,
                               **kw)


def test_plan_update_dapo_flags() -> None:
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 1.0])  # group 1 (two 1.0) has zero std
    lengths = torch.tensor([2, 4, 1, 3, 4, 2])
    truncated = torch.tensor([False, True, False, False, True, False])
    plain = plan_update(rewards, lengths, truncated, _recipe())
    assert plain.keep.all() and (plain.n_seqs, plain.n_tokens) == (6, 16)
    assert plain.advantages[2:4].tolist() == [0.0, 0.0]
    a = 0.5 / (math.sqrt(0.5) + 1e-4)  # +-(r - mean) / (sample std + eps)
    assert plain.advantages.tolist() == pytest.approx([a, -a, 0, 0, -a, a], rel=1e-12)

    filtered = plan_update(rewards, lengths, truncated, _recipe(filter_zero_std=True))
    assert filtered.keep.tolist() == [True, True, False, False, True, True]
    assert (filtered.n_seqs, filtered.n_tokens) == (4, 12)
    masked = plan_update(rewards, lengths, truncated, _recipe(mask_truncated=True))
    assert masked.keep.tolist() == [True, False, True, True, False, True]
    assert (masked.n_seqs, masked.n_tokens) == (4, 8)
    # buffer 2 of max 4: lengths 3 and 4 lose 0.5 and 1.0 of the penalty 1.0
    longer = plan_update(rewards, lengths, truncated, _recipe(overlong_buffer=2))
    assert longer.rewards.tolist() == [1.0, -1.0, 1.0, 0.5, -1.0, 1.0]
    assert longer.advantages[2] > 0 > longer.advantages[3]  # group 1 is no longer level
