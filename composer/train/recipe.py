"""Training recipes: every ``composer train`` flag as one typed field, settable from YAML.

A recipe is a YAML mapping whose keys are the flags with underscores
(``global_batch_size: 256``), the parallel layout under ``parallel:`` (``parallel: {tp: 2}``;
:class:`~composer.parallel.layout.ParallelConfig`). ``model`` names what to train: a preset, a
checkpoint folder, or ``{preset: NAME, set: {KEY: VALUE}}`` / ``{pattern: "M-M*-", set: {...}}``
with ``--set``-style config overrides. Values resolve in this order, later winning: the defaults
below, the recipe saved in a run being resumed, ``--config`` (a file or a shipped recipe's name),
then the flags given on the command line. The resolved recipe is saved in the run folder.

Each field is declared once, with its help: the flags are made from the fields
(:func:`composer.settings.add_flags`; the layout's flags keep their flat names, ``--tp 2``) and
YAML, flags and saved recipes are coerced by the same engine (:mod:`composer.settings`). The
layout's keys are also read at a recipe's top level (``tp: 2``): flags arrive that way, and so do
recipes written before ``parallel:`` existed.

Shipped recipes live in ``composer/train/recipes/`` (``composer train --list-recipes``).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

from composer.parallel.layout import LAYOUT_KEYS, ParallelConfig
from composer.settings import ConfigError, add_flags, set_field, setting, to_plain
from composer.suggest import closest

RECIPES_DIR = Path(__file__).parent / "recipes"
RECIPE_FILE = "recipe.yaml"


@dataclass
class Recipe:
    model: Any = setting(None, cli=False)
    """A preset name, a checkpoint folder, or ``{preset|pattern: ..., set: {...}}`` (the
    command's SOURCE)."""
    description: str = setting("", cli=False)
    origin: Any = setting(None, cli=False)
    """What the run was first trained from (``model`` of its first invocation; a resumed run's
    ``model`` is the run itself): what ``export --adapter`` names as the base."""
    objective: Literal["pretrain", "sft", "dpo", "grpo"] = setting(
        "pretrain", "pretrain (default: every token predicted), sft (the masked tokens of chat "
        "data from `composer data prepare --format chat`), dpo (preference pairs from "
        "`--format preference`) or grpo (reinforcement learning on --env's rewards)")
    tokens: str | None = setting(
        None, "a .npy array of token ids (1-D or 2-D), or `synthetic` (built in)")
    data: Any = setting(
        None, "an indexed dataset PREFIX, or a blend: WEIGHT PREFIX WEIGHT PREFIX ...", nargs="+")
    """An indexed dataset PREFIX, or a blend ``[0.7, A, 0.3, B]``; with neither ``tokens`` nor
    ``data``, the built-in corpus."""
    split: str | None = setting(None, "train/valid/test weights by documents, e.g. 969,30,1")
    """Default: all train; the built-in corpus: ``98,2,0``."""
    document_isolation: bool = setting(
        False, "tokens attend to, and states carry over, their own document only")
    truncate: Literal["right", "left", "error"] = setting(
        "right", "sft: a conversation longer than --seq-len loses its end (right, default), its "
        "start (left), or stops the run (error)")
    lora_rank: int = setting(0, "LoRA adapters of this rank on the projections (0: none, "
                             "the whole model trains)")
    lora_alpha: float | None = setting(None, "LoRA scale numerator: y = Wx + (alpha/r) BAx "
                                       "(default: the rank, a scale of 1)")
    lora_dropout: float = setting(0.0, "dropout on the LoRA branch's input (default 0)")
    lora_targets: list[str] = setting(
        factory=lambda: ["all"], help="projections to adapt: names (q_proj, in_proj, ...), `all` "
        "(default: every projection but routed experts) or `experts`", nargs="+")
    freeze: list[str] = setting(
        factory=list, help="parts that do not train: vision (the tower but its merger), merger, "
        "language (all but the tower); e.g. --freeze vision", nargs="+")
    adapter: str | None = setting(
        None, "a PEFT LoRA adapter folder to load onto the model (and train further)")
    dpo_beta: float = setting(0.1, "dpo: the KL strength beta of the DPO loss (default 0.1)")
    env: str | None = setting(
        None, "grpo: the reward environment, a built-in task (arith, countdown) or "
        "module:function, a callable (prompt, completion, meta) -> float")
    env_arg: list[str] = setting(
        factory=list, help="grpo: a KEY=VALUE knob of --env (repeatable), e.g. digits=2",
        action="append", metavar="KEY=VALUE")
    tokenizer: str | None = setting(
        None, "grpo: the tokenizer folder of prompts and completions (default: the built-in "
        "task's own, else SOURCE's)")
    prompts_per_step: int = setting(8, "grpo: prompts per rollout (default 8)")
    group_size: int = setting(8, "grpo: completions sampled per prompt (default 8)")
    rollout_temperature: float = setting(1.0, "grpo: sampling temperature (default 1.0)")
    rollout_top_p: float = setting(1.0, "grpo: nucleus sampling threshold (default 1.0: off)")
    max_new_tokens: int = setting(32, "grpo: the longest completion in tokens (default 32)")
    scale_rewards: Literal["group", "batch", "none"] = setting(
        "group", "grpo: divide advantages by the group's reward std (group, default), the "
        "batch's (batch), or not at all (none: Dr. GRPO)")
    clip_low: float = setting(0.2, "grpo: the ratio's lower clip epsilon (default 0.2)")
    clip_high: float = setting(0.2, "grpo: the ratio's upper clip epsilon (default 0.2; DAPO "
                               "0.28)")
    kl_coef: float = setting(0.0, "grpo: weight of the k3 KL penalty to the reference "
                             "(default 0: no reference model)")
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = setting(
        "token-mean", "grpo: token-mean (default, DAPO), seq-mean-token-mean (GRPO) or "
        "seq-mean-token-sum-norm (Dr. GRPO)")
    updates_per_rollout: int = setting(
        1, "grpo: optimizer steps on one rollout batch (default 1: strictly on-policy)")
    filter_zero_std: bool = setting(
        False, "grpo: drop groups whose rewards are all equal (DAPO dynamic sampling)")
    mask_truncated: bool = setting(
        False, "grpo: completions cut at --max-new-tokens get no loss (DAPO)")
    overlong_buffer: int = setting(
        0, "grpo: the last L tokens before --max-new-tokens are penalised linearly (DAPO "
        "soft overlong punishment; default 0: off)")
    overlong_penalty: float = setting(
        1.0, "grpo: the overlong penalty at --max-new-tokens (default 1.0)")
    eval_every: int = setting(0, "evaluate on the validation split every N steps (val_loss)")
    eval_iters: int = setting(10, "global batches per evaluation (default 10)")
    seq_len: int | None = setting(
        None, "tokens per sample (+1); cuts a 1-D --tokens array into sequences this long")
    steps: int | None = setting(
        None, "the run's total optimizer steps (the schedule's N); 0 writes the initial weights")
    global_batch_size: int = setting(8, "sequences per optimizer step (default 8)",
                                     flags=("--global-batch-size", "--batch-size"))
    micro_batch_size: int | None = setting(
        None, "sequences per forward per rank (default: global / dp)")
    lr: float = setting(3e-4, "peak learning rate (default 3e-4)")
    min_lr: float | None = setting(
        None, "final learning rate of cosine/linear/wsd (default lr/10)")
    warmup_steps: int = setting(0, "linear warmup steps (default 0)")
    schedule: Literal["constant", "cosine", "linear", "wsd"] = setting(
        "cosine", "learning-rate schedule after warmup (default cosine)")
    decay_steps: int = setting(0, "wsd: the final steps that decay to min_lr")
    optimizer: Literal["adamw", "muon"] = setting(
        "adamw", "adamw (default), or muon for hidden matrices with adamw for the rest")
    weight_decay: float = setting(
        0.1, "decoupled weight decay of matrices and embeddings (default 0.1)")
    adam_beta1: float = setting(0.9, "default 0.9")
    adam_beta2: float = setting(0.95, "default 0.95")
    adam_eps: float = setting(1e-8, "default 1e-8")
    grad_clip: float = setting(
        1.0, "clip the global gradient norm to this (default 1.0; 0 disables)")
    precision: Literal["fp32", "bf16", "fp8"] | None = setting(
        None, "fp32, bf16 (fp32 masters; the default on CUDA) or fp8 (CUDA: transformer-engine "
        "or torchao, --fp8-backend)")
    fp8_backend: Literal["te", "torchao"] | None = setting(
        None, "with --precision fp8: te (transformer-engine's linears, current scaling; the "
        "default when it imports) or torchao (float8 linears)")
    parallel: ParallelConfig = setting(factory=ParallelConfig, title="parallel layout",
                                       help="the recipe's `parallel:` mapping")
    save: str | None = setting(
        None, "the run folder for checkpoints (resumes from it when it has one)")
    save_every: int = setting(0, "save every N steps (default: only at the end)")
    keep_last: int = setting(3, "keep the newest K step folders (default 3)")
    async_save: bool = setting(
        False, "write checkpoints in the background while training goes on")
    exit_at_step: int | None = setting(
        None, "stop after this step with a checkpoint (the schedule keeps --steps)")
    max_skipped_steps: int = setting(
        3, "stop (exit 3) after this many consecutive non-finite steps (3)")
    timeout_s: float | None = setting(
        None, "bound collectives and steps: a slower step prints every stack and exits")
    log_every: int = setting(1, "log every N steps (default 1)")
    log_dir: str | None = setting(None, "where metrics.jsonl goes (default: --save)")
    peak_tflops: float | None = setting(
        None, "peak TFLOP/s per device for MFU (default: known GPUs' bf16 peak)")
    tensorboard: bool = setting(False, "also write TensorBoard scalars (needs tensorboard)")
    seed: int = setting(0, "initialisation (presets) and data order (default 0)")
    device: Literal["auto", "cpu", "cuda"] = setting(
        "auto", "auto (default): CUDA when available; under torchrun cuda:LOCAL_RANK")
    set: list[str] = setting(
        factory=list, help="override a model config field of a preset or pattern (repeatable)",
        action="append", metavar="KEY=VALUE")
    """``KEY=VALUE`` config overrides applied to the model (as ``--set``)."""

    def to_dict(self) -> dict[str, Any]:
        return to_plain(self)

    def write(self, path: str | Path) -> None:
        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))


FIELDS = {f.name: f for f in dataclasses.fields(Recipe)}
assert not set(LAYOUT_KEYS) & set(FIELDS), "a layout key would shadow a recipe field"


def merge(recipe: Recipe, values: dict[str, Any], where: str) -> Recipe:
    """``recipe`` with ``values`` (by field name; dashes allowed; the layout's keys under
    ``parallel`` or at the top level) laid over it."""
    out = copy.deepcopy(recipe)
    for key, value in values.items():
        name = str(key).replace("-", "_")
        if name == "batch_size":
            name = "global_batch_size"
        if name == "parallel":
            if not isinstance(value, dict):
                raise ConfigError(f"{where}: parallel must be a mapping of layout keys "
                                  f"({', '.join(LAYOUT_KEYS)}), got {value!r}")
            for inner, v in value.items():
                _set(out, f"parallel.{str(inner).replace('-', '_')}", v, where)
        elif name in LAYOUT_KEYS:
            _set(out, f"parallel.{name}", value, where)
        elif name in FIELDS:
            _set(out, name, value, where)
        else:
            near = closest(name, [*FIELDS, *LAYOUT_KEYS])
            hint = f" (did you mean {near!r}?)" if near else ""
            raise ConfigError(f"{where}: unknown recipe key {key!r}{hint}")
    return out


def _set(recipe: Recipe, dotted: str, value: Any, where: str) -> None:
    try:
        set_field(recipe, dotted, value, nulls=False)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def recipe_path(name: str) -> Path:
    """A recipe file, or a shipped recipe by name."""
    path = Path(name)
    if path.is_file():
        return path
    shipped = RECIPES_DIR / f"{name}.yaml"
    if shipped.is_file():
        return shipped
    raise ConfigError(f"--config {name}: no such file, and no shipped recipe of that name "
                      f"(shipped: {', '.join(shipped_recipes())})")


def read_recipe(path: str | Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({str(exc).splitlines()[0]})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a recipe is a mapping of flag names to values")
    return data


def shipped_recipes() -> dict[str, str]:
    """Shipped recipe names and their one-line descriptions."""
    return {p.stem: str(read_recipe(p).get("description", "")) for p in
            sorted(RECIPES_DIR.glob("*.yaml"))}


def model_source(model: Any) -> tuple[str | None, str | None, list[str]]:
    """``(preset_or_folder, pattern, overrides)`` from a recipe's ``model`` value."""
    if model is None or isinstance(model, str):
        return model, None, []
    if not isinstance(model, dict) or not ({"preset", "pattern"} & set(model)) or \
            set(model) - {"preset", "pattern", "set"}:
        raise ConfigError("model must be a preset name, a checkpoint folder, or a mapping with "
                          "`preset` or `pattern` and optionally `set`")
    if "preset" in model and "pattern" in model:
        raise ConfigError("model: give `preset` or `pattern`, not both")
    overrides = model.get("set") or {}
    if isinstance(overrides, dict):
        overrides = [f"{k}={v}" for k, v in overrides.items()]
    return model.get("preset"), model.get("pattern"), list(overrides)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """One flag per recipe field (the layout's in their own group); only the flags given reach
    the recipe (no defaults here)."""
    groups = add_flags(p, Recipe)
    groups["parallel"].add_argument(
        "--activation-checkpointing", action="store_true", default=argparse.SUPPRESS,
        help="the same as --ac full")
