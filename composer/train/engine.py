"""``composer train``: resolve the recipe, find what to resume, build, train.

Resuming: when ``SOURCE`` is a run folder (it has ``latest``), or ``--save`` names one, the run
continues from its latest step with the recipe saved there; the command line and ``--config``
override only what they name (``--steps M`` extends or shortens the run to ``M`` steps in all,
the schedule reshaped accordingly); a model named as well (SOURCE, ``--config``'s ``model``,
``--set``) must build the saved one, or the run is refused. Step folders an interrupted save
left behind are removed first. A run that fails before its first step removes what it created
in ``--save`` and ``--log-dir`` (never what was there before). ``--exit-at-step K`` stops after
step ``K`` with a checkpoint, leaving the schedule for ``--steps`` untouched.

SOURCE may also be a Hugging Face folder: converted into a temporary portable checkpoint (each
rank its own, removed at exit: :mod:`composer.train.source`) and trained from; its tokenizer is
kept in ``SAVE/tokenizer`` when the data has none. ``--objective`` picks what the loop optimises
(:mod:`composer.train.objectives`: ``pretrain``, the default, ``sft``, ``dpo`` or ``grpo``).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from composer.config import ConfigError, ModelConfig, apply_overrides
from composer.parallel.checkpoint import (
    is_rank0,
    is_training_checkpoint,
    latest_step,
    load_checkpoint,
    remove_incomplete,
)
from composer.parallel.data import default_grad_sync
from composer.parallel.mesh import LayoutError, ParallelDims, build_parallel_dims
from composer.portable import CONFIG_FILE
from composer.train.data import SYNTHETIC, Batches, Rows, blend_batches, synthetic_rows
from composer.train.loop import Run, Summary, seed_everything, train_loop
from composer.train.metrics import MetricsLog
from composer.train.objectives import get_objective
from composer.train.optim import build_optimizers
from composer.train.precision import model_transform, resolve_fp8_backend, resolve_precision
from composer.train.recipe import (
    RECIPE_FILE,
    Recipe,
    merge,
    model_source,
    read_recipe,
    recipe_path,
)
from composer.train.schedule import Schedule
from composer.train.source import converted_hf, is_hf_folder
from composer.train.state import CreatedPaths, Saver, read_train_state, restore_rng
from composer.train.vision import check_vision

DEFAULT_SYNTHETIC_SEQ_LEN = 128


def resolve(source: str | None, config: str | None,
            flags: dict[str, Any]) -> tuple[Recipe, Path | None]:
    """The recipe (defaults < a resumed run's < ``--config`` < flags) and the run to resume."""
    from_config = read_recipe(recipe_path(config)) if config else {}
    save = flags.get("save") or from_config.get("save")
    resume = next((Path(c) for c in (source, save) if c and is_training_checkpoint(Path(c))),
                  None)
    recipe = Recipe()
    if resume is not None:
        saved = read_train_state(latest_step(resume)).get("recipe") or {}
        saved.pop("exit_at_step", None)  # it ended the run being resumed; not this one
        recipe = merge(recipe, saved, f"{resume} (saved recipe)")
        recipe.model = str(resume)
        if save is None:
            recipe.save = str(resume)
    recipe = merge(recipe, from_config, config or "")
    recipe = merge(recipe, flags, "command line")
    if resume is not None:
        check_same_model(resume, source, config, from_config, flags)
    if source is not None and resume is None:
        recipe.model = source
    if resume is not None:
        recipe.model = str(resume)
    if recipe.model is None:
        raise ConfigError("nothing to train: give SOURCE (a preset or checkpoint folder) or a "
                          "recipe with `model:`")
    if recipe.origin is None:
        recipe.origin = recipe.model
    if recipe.steps is None:
        raise ConfigError("--steps is required (the run's total number of optimizer steps)")
    return recipe, resume


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def check_same_model(resume: Path, source: str | None, config: str | None,
                     from_config: dict[str, Any], flags: dict[str, Any]) -> None:
    """A run folder resumes its own model: a model named on the command line or in ``--config``
    (or ``--set``) that differs from the saved one is refused, never silently replaced."""
    typed, what = from_config.get("model"), f"--config {config}'s model"
    if source is not None and Path(source).resolve() != resume.resolve():
        typed, what = source, source
    overrides = flags.get("set", from_config.get("set")) or []
    if typed is None and not overrides:
        return
    saved = ModelConfig.load(resume / CONFIG_FILE)
    if typed is None:  # --set alone: it would change the saved model
        cfg = ModelConfig.from_dict(saved.to_dict())
        apply_overrides(cfg, list(overrides))
        cfg.validate()
    else:
        cfg, tensors = _model_config(Recipe(model=typed, set=list(overrides)))
        if tensors is not None:
            tensors.close()
    cfg, saved = cfg.canonical(), saved.canonical()  # equal when they build the same model
    if cfg == saved:
        return
    there, here = _flat(saved.to_dict()), _flat(cfg.to_dict())
    diff = [f"{k} {there.get(k)!r} there, {here.get(k)!r} here" for k in dict.fromkeys(
        [*there, *here]) if there.get(k) != here.get(k)]
    if typed is None:
        what = "--set " + " ".join(overrides)
    raise ConfigError(f"{resume} holds a run of a different model than {what} "
                      f"({'; '.join(diff[:3])}{'; ...' if len(diff) > 3 else ''}): resume it "
                      f"with `composer train {resume}`, or pick a new --save folder")


def _model_config(recipe: Recipe) -> tuple[ModelConfig, Any]:
    """The config and, for a portable checkpoint, its tensors."""
    from composer.build.builder import open_portable
    from composer.zoo import get_preset, presets

    name, pattern, overrides = model_source(recipe.model)
    overrides = overrides + list(recipe.set or [])
    if name is not None and pattern is None and is_hf_folder(Path(name)):
        if overrides:
            raise ConfigError(f"{name}: `set` overrides apply to presets and patterns, not to "
                              "a checkpoint's fixed shapes")
        return open_portable(converted_hf(Path(name)))
    if pattern is not None:
        cfg = ModelConfig(pattern=pattern)
    elif name in presets():
        cfg = get_preset(name).config()
    elif name is not None and Path(name).is_dir():
        if overrides:
            raise ConfigError(f"{name}: `set` overrides apply to presets and patterns, not to "
                              "a checkpoint's fixed shapes")
        return open_portable(Path(name))
    else:
        raise ConfigError(f"{name}: not a checkpoint folder, a Hugging Face folder or a preset "
                          "name")
    apply_overrides(cfg, overrides)
    return cfg.validate(), None


def _check(recipe: Recipe, dp: int) -> int:
    g, m = recipe.global_batch_size, recipe.micro_batch_size
    if recipe.steps < 0 or g < 1 or recipe.lr <= 0:
        raise ConfigError("--steps must be >= 0, --global-batch-size >= 1 and --lr > 0")
    if g % dp:
        raise ConfigError(f"--global-batch-size ({g}) must be divisible by dp ({dp})")
    m = m or g // dp
    if m < 1 or (g // dp) % m:
        raise ConfigError(f"--global-batch-size ({g}) must be a multiple of --micro-batch-size "
                          f"({m}) x dp ({dp})")
    for name in ("save_every", "keep_last", "max_skipped_steps", "log_every"):
        if getattr(recipe, name) < (0 if name == "save_every" else 1):
            raise ConfigError(f"--{name.replace('_', '-')} must be "
                              f"{'>= 0' if name == 'save_every' else '>= 1'}")
    if recipe.eval_every < 0 or recipe.eval_iters < 1:
        raise ConfigError("--eval-every must be >= 0 and --eval-iters >= 1")
    if recipe.exit_at_step is not None and recipe.exit_at_step < 1:
        raise ConfigError("--exit-at-step must be >= 1")
    return m


def check_batches(recipe: Recipe, cfg: ModelConfig,
                  dims: ParallelDims) -> tuple[int, str | None]:
    """The micro-batch size and the pipeline schedule (None without ``pp``) of a resolved
    layout: the batch splits over dp and micro-batches, the stage split and the schedule, or a
    one-line error before any work (``composer train`` and ``composer plan``)."""
    micro = _check(recipe, dims.dp)
    schedule = None
    if dims.pp > 1:
        from composer.build.stages import check_pipeline

        _, schedule = check_pipeline(cfg, dims.pp, recipe.parallel.pp_schedule,
                                     recipe.global_batch_size // (micro * dims.dp))
    return micro, schedule


def _indexed(recipe: Recipe, cfg: ModelConfig, blend: list[tuple[float, str]],
             split: str | None) -> tuple[Batches, Batches | None, int]:
    """Train (and validation) batches of a blend of indexed datasets."""
    from composer.data.gpt import GPTSamples, split_documents
    from composer.data.indexed import IndexedDataset

    if not recipe.seq_len:
        raise ConfigError("--seq-len is required with --data (tokens per sample)")
    parts: list[list[GPTSamples]] = [[], []]
    for _, prefix in blend:
        ds = IndexedDataset(prefix)
        ranges = split_documents(ds.n_documents, split)
        for which in (0, 1):
            if len(ranges[which]) or which == 0:
                parts[which].append(GPTSamples(ds, recipe.seq_len, recipe.seed, ranges[which],
                                               name=prefix))
    train, valid = blend_batches(parts, [w for w, _ in blend], " + ".join(p for _, p in blend),
                                 recipe.global_batch_size, cfg.vocab_size)
    return train, valid, recipe.seq_len + 1


def open_data(recipe: Recipe, cfg: ModelConfig) -> tuple[Batches, Batches | None, int]:
    """Training batches, validation batches (or None) and tokens per row."""
    from composer.data.blend import parse_blend
    from composer.run import check_vocab, load_tokens

    if recipe.tokens is not None and recipe.data is not None:
        raise ConfigError("give --tokens or --data, not both")
    g = recipe.global_batch_size
    if recipe.tokens == SYNTHETIC:
        seq_len = recipe.seq_len or DEFAULT_SYNTHETIC_SEQ_LEN
        rows = synthetic_rows(cfg.vocab_size, seq_len, recipe.seed)
        return Batches(Rows(rows, recipe.seed), g), None, seq_len
    if recipe.tokens is not None:
        rows = load_tokens(recipe.tokens, recipe.seq_len)
        if len({len(r) for r in rows}) != 1:
            rows = [r for r in rows if len(r) == len(rows[0])]  # a 1-D array's short tail
        check_vocab(rows, cfg, recipe.tokens)
        return Batches(Rows(np.stack(rows), recipe.seed), g), None, len(rows[0])
    if recipe.data is not None:
        return _indexed(recipe, cfg, parse_blend(recipe.data), recipe.split)
    from composer.data.corpus import BUILTIN, BUILTIN_SPLIT

    if not recipe.steps:  # --steps 0 writes the initial weights: no data needed
        return Batches(Rows(np.zeros((1, 2), dtype=np.int64), 0), g), None, 2
    return _indexed(recipe, cfg, [(1.0, str(BUILTIN))], recipe.split or BUILTIN_SPLIT)


def data_tokenizer(recipe: Recipe) -> Path | None:
    """The tokenizer folder of the training data: ``PREFIX.tokenizer/`` of the first dataset of
    ``--data`` (or of the built-in corpus, without ``--data`` and ``--tokens``); None for token
    arrays, or a dataset prepared without one."""
    from composer.data.blend import parse_blend
    from composer.data.corpus import BUILTIN

    if recipe.tokens is not None:
        return None
    prefix = parse_blend(recipe.data)[0][1] if recipe.data is not None else str(BUILTIN)
    folder = Path(f"{prefix}.tokenizer")
    return folder if folder.is_dir() else None


def save_run_tokenizer(recipe: Recipe, tokenizer: Any) -> None:
    """Keep the run's tokenizer in ``SAVE/tokenizer/`` (the objective's: the data's, GRPO's
    rollout vocabulary), so that ``composer generate SAVE`` (and the export) encode and decode
    text with the vocabulary the model learnt."""
    from composer.data.tokenizer import TOKENIZER_DIR, has_tokenizer, load_tokenizer, save_tokenizer

    if tokenizer is None:  # a Hugging Face SOURCE brings its own (fine-tuning: the same one)
        name = model_source(recipe.model)[0] if recipe.model else None
        if name is not None and is_hf_folder(Path(name)) and has_tokenizer(name):
            tokenizer = Path(name)
    if tokenizer is None:
        return
    if isinstance(tokenizer, Path):
        tokenizer = load_tokenizer(str(tokenizer))
    folder = Path(recipe.save) / TOKENIZER_DIR
    source = getattr(tokenizer, "folder", None)
    if source is not None and Path(source).resolve() == folder.resolve():
        return  # a resumed run reads its own copy
    shutil.rmtree(folder, ignore_errors=True)  # no file of another tokenizer stays
    save_tokenizer(tokenizer, folder)


def _check_cp(recipe: Recipe, cfg: ModelConfig, seq_len: int) -> None:
    """Context parallelism's row checks (:mod:`composer.parallel.context`)."""
    layout = recipe.parallel
    if layout.cp <= 1:
        return
    if layout.cp_adaptive:
        if not recipe.document_isolation:
            raise LayoutError("--cp-adaptive places whole documents: it needs "
                              "--document-isolation (packed documents)")
        return
    from composer.parallel.context import check_cp_length

    check_cp_length(cfg, layout.cp, seq_len)


def dry_run_device(recipe: Recipe) -> torch.device:
    """The device a dry run checks the run for: CUDA unless the recipe says ``--device cpu``
    (a GPU job checked on a machine without GPUs: precision resolves as on CUDA)."""
    return torch.device("cpu" if recipe.device == "cpu" else "cuda")


def setup(recipe: Recipe, resume: Path | None, quiet: bool = False,
          dry_run: bool = False) -> tuple[Run, int]:
    """Build the run; returns it and the last step to take.

    ``dry_run`` (``composer train --dry-run``, :mod:`composer.plan.dry_run`, in an impersonated
    rank's fake process group): the same path up to the first step without allocating or
    writing anything: the mesh on the CPU, precision resolved for :func:`dry_run_device`, the
    model left on meta (parallelised, its optimizers built, their state lazy), no checkpoint or
    adapter read, and none of :func:`_start`'s work (resume's state, the run folder, the
    objective's ``prepare``, the metrics log)."""
    from composer.build.builder import build_model, model_stats
    from composer.run import build_sharded
    from composer.train.adapters import load_adapter_tensors, run_adapters

    objective = get_objective(recipe.objective)
    recipe = objective.adjust(recipe)  # sft: document isolation
    if resume is not None:
        if not dry_run:
            remove_incomplete(resume)
        cfg, tensors = ModelConfig.load(resume / CONFIG_FILE), None
    else:
        cfg, tensors = _model_config(recipe)
    batches, valid, seq_len = objective.open_data(recipe, cfg)
    objective.check(recipe, cfg)
    check_vision(recipe, cfg, batches)
    _check_cp(recipe, cfg, seq_len)  # before the mesh: a refusal leaves no peer waiting
    try:
        dims = build_parallel_dims(recipe.parallel, "cpu" if dry_run else recipe.device)
    except LayoutError as exc:
        if resume is None:
            raise
        raise LayoutError(f"{exc} (the layout of a resumed run comes from its saved recipe; "
                          "give --tp/--ep/--dp to change it)") from None
    precision = resolve_precision(recipe.precision,
                                  dry_run_device(recipe) if dry_run else dims.device)
    fp8_backend = resolve_fp8_backend(recipe.fp8_backend, precision)
    if fp8_backend == "te":
        from composer.train.fp8_te import check_layout

        check_layout(dims.tp, recipe.lora_rank)
    dims.precision = "bf16" if precision in ("bf16", "fp8") else "fp32"
    micro, schedule = check_batches(recipe, cfg, dims)
    if recipe.eval_every and valid is None and recipe.steps and objective.needs_valid_data:
        raise ConfigError("--eval-every needs validation data: an indexed dataset (--data) "
                          "with a valid share in --split, e.g. --split 98,2,0")
    lora, start = run_adapters(recipe, resume)
    seed_everything(recipe.seed)
    try:  # fp32 masters whatever the source's dtype
        model = build_sharded(cfg, dims, seed=None if resume else recipe.seed, tensors=tensors,
                              dtype=torch.float32,
                              transform=model_transform(precision, recipe.freeze,
                                                        fp8_backend),
                              lora=lora, allocate=not dry_run)
    finally:
        if tensors is not None:
            tensors.close()
    if start is not None and not dry_run:
        load_adapter_tensors(model, start)
    if model.pipeline is not None:
        model.pipeline.configure(schedule, recipe.global_batch_size // (micro * dims.dp))
    opt = build_optimizers(model, recipe.optimizer, recipe.lr, recipe.weight_decay,
                           (recipe.adam_beta1, recipe.adam_beta2), recipe.adam_eps)
    run = Run(recipe=recipe, model=model, dims=dims, optimizers=opt,
              batches=batches, valid=valid,
              schedule=Schedule(recipe.lr, recipe.lr / 10 if recipe.min_lr is None
                                else recipe.min_lr, recipe.steps, recipe.warmup_steps,
                                recipe.schedule, recipe.decay_steps),
              micro_batch=micro, seq_len=seq_len, precision=precision,
              fp8_backend=fp8_backend, objective=objective,
              flops_per_token=model_stats(build_model(cfg, device="meta"),
                                          seq_len=seq_len).flops_per_token)
    run.grad_sync = recipe.parallel.grad_sync or default_grad_sync(
        model, dims, recipe.global_batch_size // (micro * dims.dp))[0]
    last = recipe.steps if recipe.exit_at_step is None else min(recipe.steps, recipe.exit_at_step)
    if not dry_run:
        _start(run, resume, last, quiet)
    return run, last


def _start(run: Run, resume: Path | None, last: int, quiet: bool) -> None:
    """What a run reads and writes before its first step: a resumed run's checkpoint and
    state, the run folder (``recipe.yaml``, the tokenizer), the objective's ``prepare`` and
    the metrics log."""
    recipe, model, opt, seq_len = run.recipe, run.model, run.optimizers, run.seq_len
    if resume is not None:
        step_dir = latest_step(resume)
        run.start_step = load_checkpoint(resume, model, opt.opts, step_dir)
        saved = read_train_state(step_dir)
        run.consumed = saved.get("consumed_samples", run.start_step * recipe.global_batch_size)
        run.tokens = saved.get("tokens", run.consumed * (seq_len - 1))
        run.skipped = saved.get("skipped_steps", 0)
        restore_rng(step_dir)
        if is_rank0():
            print(f"composer train: resuming from step {run.start_step} ({resume})",
                  file=sys.stderr, flush=True)
    run.start_consumed = run.consumed
    if recipe.save:
        if resume is None or Path(recipe.save).resolve() != resume.resolve():
            remove_incomplete(recipe.save)
        run.saver = Saver(recipe.save, recipe.keep_last, recipe.async_save)
        if is_rank0():
            Path(recipe.save).mkdir(parents=True, exist_ok=True)
            recipe.write(Path(recipe.save) / RECIPE_FILE)
            save_run_tokenizer(recipe, run.objective.run_tokenizer(recipe))
    run.objective.prepare(run)  # a reference model, an environment
    run.log = MetricsLog(recipe.log_dir or recipe.save, is_rank0(), last, run.start_step, quiet,
                         recipe.tensorboard)


def train(recipe: Recipe, resume: Path | None = None, quiet: bool = False) -> Summary:
    """Train as ``recipe`` says (every rank calls it, inside the process group if any)."""
    created = CreatedPaths([recipe.save, recipe.log_dir or recipe.save]) if is_rank0() else None
    run = None
    try:
        run, last = setup(recipe, resume, quiet)
        summary = train_loop(run, last, quiet)
    except BaseException:
        if run is not None:
            run.log.close()
        # a run that took no step leaves nothing it created (a step taken stays saved)
        if created is not None and (run is None or run.consumed == run.start_consumed):
            created.remove()
        raise
    run.log.close()
    if summary.stopped_by_signal and is_rank0():
        saved = f", saved to {recipe.save}" if recipe.save else " (no --save: nothing saved)"
        print(f"composer train: interrupted at step {summary.step}{saved}", file=sys.stderr,
              flush=True)
    return summary
