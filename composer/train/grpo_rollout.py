"""GRPO rollouts: the policy samples each prompt's group of completions, the environment scores
them, and the group-relative advantages and per-token loss weights are laid out for training.

Which prompts, which samples. Rollout ``k`` serves steps ``k K + 1 .. (k + 1) K``
(``K = --updates-per-rollout``; a rollout is made at every step with ``(step - 1) % K == 0``,
global step numbering). It draws ``P = --prompts-per-step`` prompts from the environment with a
seed mixed from (``--seed``, ``k``); data-parallel rank ``r`` takes prompts
``[r P / dp, (r + 1) P / dp)``, and each prompt's ``G = --group-size`` completions come from one
:func:`composer.generate` call on the training weights themselves (no copy, no weight sync),
seeded from (``--seed``, the step, the prompt's index): a prompt's completions are the same
whichever rank draws them, so the rollout does not depend on ``dp``. Every rank of the
data-parallel group takes the same number of decoding steps (``sync_group``), so the sharded
model's collectives stay matched. The log-prob of each sampled token is recorded as it is
sampled (after temperature, before top-p): the ``logp_old`` of the policy loss. A resumed run
regenerates the rollout it stopped in from the weights it resumes with (the same prompts, new
completions and old log-probs): a rollout is not part of the checkpoint.

Scores to weights. Each completion is scored by ``env.score`` (a :class:`RewardError` on any
rank stops every rank with its one-line message, before any update). One small all-gather over
the data-parallel group gives every rank the whole rollout's table (reward, correctness,
length, truncation of each of the ``P G`` completions, in prompt order), from which every rank
computes the same group-relative advantages (``--scale-rewards``; ``batch`` uses the std of all
``P G`` rewards), DAPO's filters (``--filter-zero-std`` drops the groups whose rewards are all
equal, ``--mask-truncated`` the completions without an eos, ``--overlong-buffer`` /
``--overlong-penalty`` soften the rewards of long ones) and the global token and sequence counts
that :func:`composer.train.rl.losses.token_weights` normalises by: the loss of the whole
rollout, whatever its split over ranks and micro-batches.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from composer.blocks.model import completion_targets
from composer.parallel.data import reshard
from composer.train.rl.envs import Env, Prompt, RewardError
from composer.train.rl.losses import (
    group_advantages,
    overlong_penalty,
    token_weights,
    zero_std_groups,
)


def mix_seed(*keys: int) -> int:
    """A 63-bit seed from integer keys (``numpy.random.SeedSequence``): distinct keys give
    unrelated streams, the same keys the same one, on every platform."""
    state = np.random.SeedSequence([int(k) % 2**64 for k in keys]).generate_state(1, np.uint64)
    return int(state[0]) >> 1


def prompt_share(n: int, dp: int, rank: int) -> range:
    """The indices of the ``n`` prompts that data-parallel ``rank`` generates (contiguous)."""
    per = n // dp
    return range(rank * per, (rank + 1) * per)


def rollout_index(step: int, updates_per_rollout: int) -> int:
    """The rollout that serves optimizer ``step`` (1-based)."""
    return (step - 1) // updates_per_rollout


@dataclass
class Sequences:
    """This rank's sequences (prompt + completion), right-padded, in prompt order."""

    ids: torch.Tensor
    """``(N, T)`` token ids, ``pad_id`` after each sequence's end."""
    targets: torch.Tensor
    """``(N, T)`` next-token targets: the completion tokens, ``-100`` elsewhere
    (:func:`composer.blocks.model.completion_targets`)."""
    logp_old: torch.Tensor
    """``(N, T)`` fp32, aligned with ``targets``: the generation log-prob of each target."""
    lengths: torch.Tensor
    """``(N,)`` completion tokens (the eos included)."""
    ends: torch.Tensor
    """``(N,)`` prompt + completion tokens: where each row's padding starts."""
    truncated: torch.Tensor
    """``(N,)`` bool: the completion emitted no eos within ``--max-new-tokens``."""

    @property
    def n(self) -> int:
        return self.ids.shape[0]

    def rows(self, start: int, stop: int) -> Sequences:
        """Rows ``start .. stop - 1``, trimmed to their longest sequence."""
        width = int(self.ends[start:stop].max())
        return Sequences(self.ids[start:stop, :width], self.targets[start:stop, :width],
                         self.logp_old[start:stop, :width], self.lengths[start:stop],
                         self.ends[start:stop], self.truncated[start:stop])


def split_completions(ids_BT: torch.Tensor, prompt_len: int, logprobs_BN: torch.Tensor,
                      finished_B: torch.Tensor, eos: int | None
                      ) -> tuple[list[list[int]], list[list[float]], list[bool]]:
    """Each row's completion tokens (up to and including its first eos), their generation
    log-probs, and whether it was truncated (no eos), from a ``Generated``."""
    tokens, logps, truncated = [], [], []
    new_BN = ids_BT[:, prompt_len:].tolist()
    for row, lp, done in zip(new_BN, logprobs_BN.tolist(), finished_B.tolist(), strict=True):
        n = row.index(eos) + 1 if done and eos is not None and eos in row else len(row)
        tokens.append(row[:n])
        logps.append(lp[:n])
        truncated.append(not done)
    return tokens, logps, truncated


def pad_sequences(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]],
                  logprobs: Sequence[Sequence[float]], truncated: Sequence[bool],
                  pad_id: int, device: torch.device | None = None) -> Sequences:
    """Prompt + completion rows, right-padded with ``pad_id``; the generation log-prob of
    completion token ``j`` (position ``len(prompt) + j``) sits at position
    ``len(prompt) + j - 1``, the position that predicts it."""
    ends = [len(p) + len(c) for p, c in zip(prompts, completions, strict=True)]
    n, width = len(ends), max(ends)
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    scored = torch.zeros((n, width), dtype=torch.bool)
    logp = torch.zeros((n, width), dtype=torch.float32)
    for i, (p, c, lp) in enumerate(zip(prompts, completions, logprobs, strict=True)):
        ids[i, :ends[i]] = torch.tensor([*p, *c], dtype=torch.long)
        scored[i, len(p):ends[i]] = True
        logp[i, len(p) - 1:ends[i] - 1] = torch.tensor(lp, dtype=torch.float32)
    seqs = Sequences(ids, completion_targets(ids, scored), logp,
                     torch.tensor([len(c) for c in completions]), torch.tensor(ends),
                     torch.tensor(list(truncated), dtype=torch.bool))
    if device is not None:
        seqs = Sequences(*(t.to(device) for t in (seqs.ids, seqs.targets, seqs.logp_old,
                                                  seqs.lengths, seqs.ends, seqs.truncated)))
    return seqs


@dataclass
class Plan:
    """What the whole rollout's table decides, the same on every rank (global, prompt order,
    ``P G`` entries each)."""

    rewards: torch.Tensor
    """fp64, the overlong penalty included."""
    advantages: torch.Tensor
    keep: torch.Tensor
    """bool: the completion is trained on (not filtered, not masked)."""
    n_seqs: int
    n_tokens: int


def plan_update(rewards: torch.Tensor, lengths: torch.Tensor, truncated: torch.Tensor,
                recipe: Any) -> Plan:
    """Advantages and the trained completions from the rollout's rewards, completion lengths
    and truncation flags (each ``P G`` long, group by group; module docstring)."""
    p, g = recipe.prompts_per_step, recipe.group_size
    rewards = rewards.double()
    if recipe.overlong_buffer > 0:
        rewards = rewards + overlong_penalty(lengths, recipe.max_new_tokens,
                                             recipe.overlong_buffer,
                                             recipe.overlong_penalty).double()
    adv = group_advantages(rewards.view(p, g), recipe.scale_rewards).reshape(-1)
    keep = torch.ones(p * g, dtype=torch.bool, device=rewards.device)
    if recipe.filter_zero_std:
        keep &= ~zero_std_groups(rewards.view(p, g)).repeat_interleave(g)
    if recipe.mask_truncated:
        keep &= ~truncated.bool()
    return Plan(rewards, adv, keep, int(keep.sum()), int((lengths * keep).sum()))


@dataclass
class Rollout:
    """A rollout as this rank trains on it."""

    step: int
    """The step it was generated at."""
    seqs: Sequences
    advantages: torch.Tensor
    """``(N,)`` this rank's completions' advantages."""
    weights: torch.Tensor
    """``(N, T)`` fp32: the loss is ``sum(weights * per-token term)`` over every rank."""
    plan: Plan
    metrics: dict[str, float] = field(default_factory=dict)
    """The rollout's global statistics (reward_mean, accuracy, ...)."""
    rollout_s: float = 0.0
    updates: int = 0
    """Optimizer steps taken on it so far."""


def dp_group(dims: Any) -> Any:
    """The data-parallel group, or None in one data-parallel rank."""
    return dims.dp_mesh.get_group() if dims.dp > 1 else None


def gather_rows(dims: Any, local_NK: torch.Tensor) -> torch.Tensor:
    """Every data-parallel rank's rows, in rank order (one all-gather)."""
    if dims.dp == 1:
        return local_NK
    parts = [torch.empty_like(local_NK) for _ in range(dims.dp)]
    dist.all_gather(parts, local_NK.contiguous(), group=dp_group(dims))
    return torch.cat(parts)


def first_error(dims: Any, message: str | None, failed: bool) -> str | None:
    """The lowest data-parallel rank's error message, on every rank, once some rank has
    ``failed`` (known to all from the gathered table): the others stop with it too."""
    if not failed:
        return None
    if dims.dp == 1:
        return message
    messages: list[str | None] = [None] * dims.dp
    dist.all_gather_object(messages, message, group=dp_group(dims))
    return next(m for m in messages if m)


def encode_prompt(tokenizer: Any, prompt: Prompt) -> list[int]:
    """The prompt's token ids (the tokenizer's post-processor applied, as generation encodes a
    prompt; a prompt with ``meta["messages"]`` rendered with the tokenizer's chat template and
    its generation prompt); a one-line :class:`RewardError` naming the prompt when it cannot be
    encoded. Every rank encodes every prompt of a rollout, so all of them stop on the same
    error."""
    try:
        messages = prompt.meta.get("messages")
        if messages is not None:  # a chat prompt: the template holds the special tokens
            if not hasattr(tokenizer, "apply_chat_template"):
                raise ValueError(f"a chat prompt (messages), and the tokenizer "
                                 f"{type(tokenizer).__name__} has no chat template")
            ids = tokenizer.encode(tokenizer.apply_chat_template(messages,
                                                                 add_generation_prompt=True))
        elif hasattr(tokenizer, "encode_prompt"):
            ids = tokenizer.encode_prompt(prompt.text)
        else:
            ids = tokenizer.encode(prompt.text)
    except ValueError as exc:
        raise RewardError(f"prompt {prompt.index}: {exc}") from None
    if not ids:
        raise RewardError(f"prompt {prompt.index}: the text {prompt.text!r} encodes to no token")
    return list(ids)


def decode_completion(tokenizer: Any, tokens: list[int], eos: int | None) -> str:
    """The completion's text: the eos dropped, ids past the tokenizer's vocabulary (a padded
    model vocabulary) too."""
    return tokenizer.decode([t for t in tokens if t != eos and t < tokenizer.vocab_size])


def generate_group(run: Any, ids: list[int], n: int, temperature: float, seed: int,
                   top_p: float | None = None) -> Any:
    """``n`` continuations of one prompt (a ``Generated``), every data-parallel rank taking the
    same number of decoding steps."""
    from composer.inference import generate
    from composer.train.loop import autocast

    r, tok = run.recipe, run.state["tokenizer"]
    with autocast(run):
        return generate(run.model, torch.tensor([ids] * n, dtype=torch.long), r.max_new_tokens,
                        temperature=temperature, top_p=top_p, eos_token_id=tok.eod,
                        seed=seed, return_logprobs=True, sync_group=dp_group(run.dims))


def _sample(run: Any, env: Env, prompts: list[Prompt], encoded: list[list[int]], step: int
            ) -> tuple[list[list[int]], tuple[list, list, list], torch.Tensor, str | None]:
    """Generate and score this rank's prompts: the prompt ids per completion, the
    completions, this rank's table rows (reward, correct, length, truncated, failed) and the
    first error met."""
    r, tok = run.recipe, run.state["tokenizer"]
    g = r.group_size
    prompt_ids, tokens, logps, truncated, table = [], [], [], [], []
    error = None
    for prompt, ids in zip(prompts, encoded, strict=True):
        gen = generate_group(run, ids, g, r.rollout_temperature,
                             mix_seed(r.seed, step, prompt.index), r.rollout_top_p)
        t, lp, tr = split_completions(gen.ids.cpu(), len(ids), gen.logprobs.cpu(),
                                      gen.finished.cpu(), tok.eod)
        for c, trunc in zip(t, tr, strict=True):
            reward, correct = math.nan, math.nan
            if error is None:
                try:
                    score = env.score(prompt, decode_completion(tok, c, tok.eod))
                    reward = float(score.reward)
                    correct = math.nan if score.correct is None else float(score.correct)
                except RewardError as exc:
                    error = str(exc)
            table.append([reward, correct, len(c), float(trunc), float(error is not None)])
        prompt_ids += [ids] * g
        tokens += t
        logps += lp
        truncated += tr
    local = torch.tensor(table, dtype=torch.float64, device=run.dims.device)
    return prompt_ids, (tokens, logps, truncated), local, error


def rollout_metrics(plan: Plan, correct: torch.Tensor, lengths: torch.Tensor,
                    truncated: torch.Tensor) -> dict[str, float]:
    """The rollout's global statistics (the logged ``reward_*``, ``accuracy``, ...)."""
    metrics = {"reward_mean": float(plan.rewards.mean()),
               "reward_std": float(plan.rewards.std()) if len(plan.rewards) > 1 else 0.0,
               "response_length_mean": float(lengths.double().mean()),
               "truncated_fraction": float(truncated.double().mean())}
    judged = ~torch.isnan(correct)
    if bool(judged.any()):
        metrics["accuracy"] = float(correct[judged].mean())
    return metrics


def make_rollout(run: Any, step: int) -> Rollout:
    """This rank's share of the rollout for ``step`` (module docstring)."""
    r, dims, env = run.recipe, run.dims, run.state["env"]
    start = time.perf_counter()
    prompts = env.prompts(r.prompts_per_step,
                          seed=mix_seed(r.seed, rollout_index(step, r.updates_per_rollout)),
                          split="train")
    encoded = [encode_prompt(run.state["tokenizer"], p) for p in prompts]  # every rank: all
    share = prompt_share(len(prompts), dims.dp, dims.dp_rank())
    prompt_ids, (tokens, logps, truncated), local, error = _sample(
        run, env, [prompts[i] for i in share], [encoded[i] for i in share], step)
    reshard(run.model)  # generation left the FSDP roots' own weights gathered
    table = gather_rows(dims, local).cpu()
    message = first_error(dims, error, bool(table[:, 4].any()))
    if message is not None:
        if run.saver is not None:  # an earlier step's save completes; nothing half-written
            run.saver.finish()
        raise RewardError(message)
    lengths, trunc = table[:, 2].long(), table[:, 3].bool()
    plan = plan_update(table[:, 0], lengths, trunc, r)
    pad = run.state["tokenizer"].eod or 0
    seqs = pad_sequences(prompt_ids, tokens, logps, truncated, pad, dims.device)
    rows = [i * r.group_size + j for i in share for j in range(r.group_size)]
    keep = plan.keep[rows].to(dims.device)
    weights = token_weights((seqs.targets != -100) & keep[:, None], r.loss_agg, plan.n_tokens,
                            plan.n_seqs, r.max_new_tokens)
    return Rollout(step, seqs, plan.advantages[rows].to(dims.device, torch.float32),
                   weights.float(), plan, rollout_metrics(plan, table[:, 1], lengths, trunc),
                   rollout_s=time.perf_counter() - start)


def micro_batches(rollout: Rollout, micro: int) -> Iterator[tuple[Sequences, torch.Tensor,
                                                                    torch.Tensor]]:
    """``(sequences, advantages, weights)`` of each micro-batch of ``micro`` sequences,
    trimmed to their longest."""
    for start in range(0, rollout.seqs.n, micro):
        part = rollout.seqs.rows(start, start + micro)
        width = part.ids.shape[1]
        yield part, rollout.advantages[start:start + micro], \
            rollout.weights[start:start + micro, :width]


def eval_prompts(env: Env, recipe: Any) -> list[Prompt]:
    """The fixed evaluation set: ``eval_iters * prompts_per_step`` prompts of the eval split."""
    return env.prompts(recipe.eval_iters * recipe.prompts_per_step, seed=recipe.seed,
                       split="eval")
