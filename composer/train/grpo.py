"""The GRPO objective (``composer train SOURCE --objective grpo --env ENV``): reinforcement
learning on verifiable rewards with group-relative advantages (DeepSeekMath, Shao et al. 2024,
section 4.1), and the DAPO (Yu et al. 2025) and Dr. GRPO (Liu et al. 2025) variants as flags.

Each step trains on a rollout (:mod:`composer.train.grpo_rollout`: ``P`` prompts, ``G``
completions each, sampled by the policy itself; a new one every ``--updates-per-rollout``
steps). The loss of the rollout is ``sum_i,t w_it l_it`` with the per-token term
``l = -min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A) + beta k3`` (``rho = exp(logp -
logp_old)``, ``logp_old`` the log-probs recorded while sampling, ``k3 = exp(d) - d - 1`` with
``d = logp_ref - logp``: :func:`composer.train.rl.losses.policy_loss_terms`) and the weights
``w`` of ``--loss-agg`` over the whole rollout (:func:`~composer.train.rl.losses.token_weights`),
so the gradient is the same for any split over data-parallel ranks and micro-batches
(``--micro-batch-size`` counts sequences). Log-probs come from
:meth:`~composer.blocks.model.HybridModel.token_logprobs` at ``--rollout-temperature``, the
distribution the tokens were sampled from. ``--kl-coef > 0`` scores the tokens under the frozen
reference too (:mod:`composer.train.reference`: the starting weights; under LoRA the base with
its adapters off, no copy).

Logged per step: ``loss``; the rollout's ``reward_mean``, ``reward_std`` (the overlong penalty
included), ``accuracy`` (tasks that judge correctness), ``response_length_mean``,
``truncated_fraction``; over the trained tokens ``entropy``, ``clip_fraction`` and (with a
reference) ``kl``; ``logprob_mismatch`` (the largest ``exp(|logp_generate - logp_train|)`` over
the rollout's tokens, at its first update, when the weights are those that sampled it);
``rollout_s`` (0 on steps that reuse a rollout) and ``train_s``; ``tokens_per_s`` counts the
tokens of the training forwards (prompts and padding included, generation not). Strictly
on-policy (``rho = 1``) and without a KL term, the logged ``loss`` is minus the weighted mean
advantage, about 0 by construction (each group's advantages sum to 0); its gradient is not.
Evaluation
(``--eval-every``, and at step 0) decodes a fixed set of ``eval_iters * prompts_per_step``
eval-split prompts greedily: ``val_accuracy`` and ``val_reward``.

The tokenizer is ``--tokenizer``, else SOURCE's (``tokenizer/`` or ``hf/`` of a checkpoint, a
Hugging Face folder itself: the vocabulary the model was trained with), else the built-in
task's own (a model trained from a preset or pattern); it is kept in ``SAVE/tokenizer`` so
``composer generate SAVE`` speaks the same vocabulary.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from composer.config import ConfigError, ModelConfig
from composer.parallel.data import reshard
from composer.train.grpo_rollout import (
    decode_completion,
    dp_group,
    encode_prompt,
    eval_prompts,
    first_error,
    gather_rows,
    make_rollout,
    micro_batches,
    prompt_share,
)
from composer.train.objectives import Pretrain, StepSums, register_objective
from composer.train.recipe import Recipe
from composer.train.rl.envs import Env, RewardError, make_env
from composer.train.rl.losses import policy_loss_terms


def find_tokenizer(recipe: Recipe, env: Env) -> Any:
    """``--tokenizer``, else SOURCE's, else the environment's (module docstring)."""
    from composer.convert.api import HF_DIR
    from composer.data.tokenizer import TOKENIZER_DIR, has_tokenizer, load_tokenizer
    from composer.train.recipe import model_source

    if recipe.tokenizer is not None:
        return load_tokenizer(recipe.tokenizer)
    name = model_source(recipe.model)[0] if recipe.model is not None else None
    if name is not None and Path(name).is_dir():
        # a run's data tokenizer, a conversion's Hub files, a Hugging Face folder itself
        for folder in (Path(name) / TOKENIZER_DIR, Path(name) / HF_DIR, Path(name)):
            if has_tokenizer(folder):
                return load_tokenizer(str(folder))
    if env.tokenizer is not None:
        return env.tokenizer
    raise ConfigError(f"--env {recipe.env}: no tokenizer (the environment brings none and "
                      f"SOURCE {name or 'a preset'} has no tokenizer/); give --tokenizer")


def _data_ranks(recipe: Recipe) -> int:
    from composer.parallel.mesh import resolve_layout

    world = dist.get_world_size() if dist.is_initialized() else 1
    return resolve_layout(recipe.parallel, world).dp


class GRPO(Pretrain):
    """Group-relative policy optimisation on an environment's rewards (module docstring)."""

    name = "grpo"
    counts_targets = False
    eval_at_start = True
    needs_valid_data = False

    def adjust(self, recipe: Recipe) -> Recipe:
        # a step's batch is the rollout's P x G sequences
        return dataclasses.replace(recipe, global_batch_size=recipe.prompts_per_step *
                                   recipe.group_size)

    def check(self, recipe: Recipe, cfg: ModelConfig) -> None:
        r = recipe
        if r.env is None:
            raise ConfigError("--objective grpo needs --env: a built-in task (arith, countdown) "
                              "or module:function")
        if r.data is not None or r.tokens is not None:
            raise ConfigError("--objective grpo samples its own data from --env: drop --data "
                              "and --tokens")
        if r.parallel.pp > 1 or r.parallel.cp > 1:
            raise ConfigError("--objective grpo under --pp or --cp is not built yet (each rank "
                              "generates with the whole model)")
        if "/" in str(cfg.pattern):
            raise ConfigError("--objective grpo with multi-token prediction is not built yet "
                              "(the policy's log-probs never run the MTP depths)")
        for flag, ok in (("--prompts-per-step must be >= 1", r.prompts_per_step >= 1),
                         ("--group-size must be >= 2 (advantages compare a prompt's "
                          "completions)", r.group_size >= 2),
                         ("--updates-per-rollout must be >= 1", r.updates_per_rollout >= 1),
                         ("--max-new-tokens must be >= 1", r.max_new_tokens >= 1),
                         ("--rollout-temperature must be > 0 (greedy rollouts give a group "
                          "identical completions)", r.rollout_temperature > 0),
                         ("--rollout-top-p must be in (0, 1]", 0 < r.rollout_top_p <= 1),
                         ("--clip-low must be in [0, 1) and --clip-high >= 0",
                          0 <= r.clip_low < 1 and r.clip_high >= 0),
                         ("--kl-coef must be >= 0", r.kl_coef >= 0),
                         ("--overlong-buffer must be in [0, --max-new-tokens] and "
                          "--overlong-penalty >= 0",
                          0 <= r.overlong_buffer <= r.max_new_tokens and
                          r.overlong_penalty >= 0)):
            if not ok:
                raise ConfigError(flag)
        dp = _data_ranks(r)
        if r.prompts_per_step % dp:
            raise ConfigError(f"--prompts-per-step ({r.prompts_per_step}) must be divisible by "
                              f"dp ({dp}): each data-parallel rank generates its share")
        local = r.prompts_per_step // dp * r.group_size
        if r.micro_batch_size is not None and (r.micro_batch_size < 1 or
                                               local % r.micro_batch_size):
            raise ConfigError(f"--micro-batch-size ({r.micro_batch_size}) must divide the "
                              f"{local} sequences of a data-parallel rank (--prompts-per-step "
                              f"{r.prompts_per_step} / dp {dp} x --group-size {r.group_size})")
        tok = find_tokenizer(r, make_env(r.env, list(r.env_arg)))
        if cfg.vocab_size < tok.vocab_size:
            raise ConfigError(f"the model's vocabulary ({cfg.vocab_size}) is smaller than the "
                              f"tokenizer's ({tok.vocab_size}): --set vocab_size="
                              f"{tok.vocab_size} (or more)")

    def open_data(self, recipe: Recipe, cfg: ModelConfig) -> tuple[None, None, int]:
        """No data: rollouts. The row length is an estimate for the FLOP count: the longest
        evaluation prompt plus ``--max-new-tokens``."""
        env = make_env(recipe.env, list(recipe.env_arg)) if recipe.env else None
        if env is None:
            return None, None, recipe.max_new_tokens + 1
        tok = find_tokenizer(recipe, env)
        longest = max(len(encode_prompt(tok, p)) for p in eval_prompts(env, recipe))
        return None, None, longest + recipe.max_new_tokens

    def run_tokenizer(self, recipe: Recipe) -> Any:
        """The rollouts' tokenizer (:func:`find_tokenizer`): the run's vocabulary."""
        return find_tokenizer(recipe, make_env(recipe.env, list(recipe.env_arg)))

    def prepare(self, run: Any) -> None:
        r = run.recipe
        env = make_env(r.env, list(r.env_arg))
        tok = find_tokenizer(r, env)
        prompts = eval_prompts(env, r)  # encoded once, by every rank: the same errors on all
        run.state.update(env=env, tokenizer=tok, rollout=None,
                         eval=(prompts, [encode_prompt(tok, p) for p in prompts]))
        if r.kl_coef > 0:
            from composer.train.reference import build_reference

            run.ref_model = build_reference(run)

    def before_step(self, run: Any, step: int) -> None:
        """A new rollout at each ``(step - 1) % K == 0``, and at the first step of a resumed
        run (its rollout is regenerated from the resumed weights)."""
        if run.state.get("rollout") is None or (step - 1) % run.recipe.updates_per_rollout == 0:
            run.state["rollout"] = None  # its memory goes before the next one's comes
            run.state["rollout"] = make_rollout(run, step)

    def accumulate(self, run: Any) -> StepSums:
        from composer.train.loop import autocast, sync_grads

        r, dims, rollout = run.recipe, run.dims, run.state["rollout"]
        start = time.perf_counter()
        first = rollout.updates == 0
        device = dims.device
        loss = torch.zeros((), dtype=torch.float64, device=device)
        aux = torch.zeros((), dtype=torch.float64, device=device)
        sums = torch.zeros(4, dtype=torch.float64, device=device)  # entropy, clipped, kl, n
        mismatch = torch.zeros((), dtype=torch.float64, device=device)
        parts = list(micro_batches(rollout, run.micro_batch))
        processed = 0
        for i, (seqs, adv, weights) in enumerate(parts):
            with autocast(run):
                out = run.model.token_logprobs(seqs.ids, seqs.targets,
                                               temperature=r.rollout_temperature, entropy=True)
            ref = None
            if run.ref_model is not None:
                ref = run.ref_model.token_logprobs(seqs.ids, seqs.targets,
                                                   temperature=r.rollout_temperature)
            per_token, stats = policy_loss_terms(out.logp, seqs.logp_old, adv, r.clip_low,
                                                 r.clip_high, logp_ref=ref, kl_coef=r.kl_coef)
            term = (weights * per_token).sum()
            # data parallel averages gradients over its replicas: their sum is the rollout's
            sync_grads(run, i, len(parts) - 1)
            (term * dims.grad_replicas + out.aux_loss / len(parts)).backward()
            loss += term.detach().double()
            aux += out.aux_loss.detach().double()
            trained = weights != 0
            sums += torch.stack([out.entropy.detach()[trained].double().sum(),
                                 stats["clipped"][trained].double().sum(),
                                 stats["kl"].detach()[trained].double().sum(),
                                 trained.double().sum()])
            if first:
                scored = seqs.targets != -100
                gap = (out.logp.detach().double() - seqs.logp_old.double()).abs()[scored]
                if gap.numel():
                    mismatch = torch.maximum(mismatch, gap.max())
            processed += seqs.ids.numel()
        rollout.updates += 1
        entropy, clipped, kl, n = sums.tolist()
        metrics = {k: (v, 1.0) for k, v in rollout.metrics.items()}
        metrics.update(entropy=(entropy, n), clip_fraction=(clipped, n),
                       rollout_s=(rollout.rollout_s if first else 0.0, 1.0),
                       train_s=(time.perf_counter() - start, 1.0))
        if run.ref_model is not None:
            metrics["kl"] = (kl, n)
        maxima = {"logprob_mismatch": float(torch.exp(mismatch))} if first else {}
        return StepSums(loss=loss, count=1.0 / dims.dp, aux=aux / len(parts),
                        mtp=torch.zeros((), dtype=torch.float64, device=device),
                        metrics=metrics, maxima=maxima, processed=processed)

    @torch.no_grad()
    def validate(self, run: Any) -> dict[str, float]:
        """Greedy decoding of the fixed evaluation prompts (each data-parallel rank its share,
        ``prompts_per_step / dp`` per generate call): ``val_accuracy`` (tasks that judge
        correctness) and ``val_reward``."""
        r, dims, env = run.recipe, run.dims, run.state["env"]
        prompts, encoded = run.state["eval"]
        share = prompt_share(len(prompts), dims.dp, dims.dp_rank())
        mine, ids = [prompts[i] for i in share], [encoded[i] for i in share]
        per_call = r.prompts_per_step // dims.dp
        rows, error = [], None
        for at in range(0, len(mine), per_call):
            chunk = mine[at:at + per_call]
            texts = greedy_completions(run, ids[at:at + per_call])
            for prompt, text in zip(chunk, texts, strict=True):
                reward = correct = float("nan")
                if error is None:
                    try:
                        score = env.score(prompt, text)
                        reward = float(score.reward)
                        correct = float("nan") if score.correct is None else float(score.correct)
                    except RewardError as exc:
                        error = str(exc)
                rows.append([reward, correct, float(error is not None)])
        reshard(run.model)  # generation left the FSDP roots' own weights gathered
        table = gather_rows(dims, torch.tensor(rows, dtype=torch.float64, device=dims.device))
        message = first_error(dims, error, bool(table[:, 2].any()))
        if message is not None:
            raise RewardError(message)
        out = {"val_reward": float(table[:, 0].mean())}
        judged = ~torch.isnan(table[:, 1])
        if bool(judged.any()):
            out["val_accuracy"] = float(table[judged, 1].mean())
        return out

    def consumed_per_step(self, recipe: Recipe) -> int:
        return recipe.prompts_per_step * recipe.group_size


def greedy_completions(run: Any, prompts: list[list[int]]) -> list[str]:
    """Each prompt's greedy completion (one left-padded batch), as text."""
    from composer.inference import generate
    from composer.train.loop import autocast

    tok = run.state["tokenizer"]
    width = max(len(p) for p in prompts)
    pad = tok.eod or 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], dtype=torch.long)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with autocast(run):
        out = generate(run.model, ids, run.recipe.max_new_tokens, attention_mask=mask,
                       temperature=0.0, eos_token_id=tok.eod,
                       vocab_limit=min(tok.vocab_size, run.model.config.vocab_size),
                       sync_group=dp_group(run.dims))
    texts = []
    for row in out[:, width:].tolist():
        if tok.eod is not None and tok.eod in row:
            row = row[:row.index(tok.eod)]
        texts.append(decode_completion(tok, row, tok.eod))
    return texts


register_objective(GRPO())
