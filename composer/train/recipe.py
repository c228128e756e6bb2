"""Training recipes: every ``composer train`` flag as one typed field, settable from YAML.

A recipe is a flat YAML mapping whose keys are the flags with underscores
(``global_batch_size: 256``); ``model`` names what to train: a preset, a checkpoint folder, or
``{preset: NAME, set: {KEY: VALUE}}`` / ``{pattern: "M-M*-", set: {...}}`` with ``--set``-style
config overrides. Values resolve in this order, later winning: the defaults below, the recipe
saved in a run being resumed, ``--config`` (a file or a shipped recipe's name), then the flags
given on the command line. The resolved recipe is saved in the run folder.

Shipped recipes live in ``composer/train/recipes/`` (``composer train --list-recipes``).
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from composer.config import ConfigError
from composer.suggest import closest

RECIPES_DIR = Path(__file__).parent / "recipes"
RECIPE_FILE = "recipe.yaml"


@dataclass
class Recipe:
    model: Any = None
    """A preset name, a checkpoint folder, or ``{preset|pattern: ..., set: {...}}``."""
    description: str = ""
    tokens: str | None = None
    """A ``.npy`` array of token ids, or ``synthetic`` (a built-in learnable corpus)."""
    data: Any = None
    """An indexed dataset PREFIX, or a blend ``[0.7, A, 0.3, B]``; with neither ``tokens`` nor
    ``data``, the built-in corpus."""
    split: str | None = None
    """Train/valid/test weights by documents, e.g. ``969,30,1`` (default: all train; the
    built-in corpus: ``98,2,0``)."""
    document_isolation: bool = False
    eval_every: int = 0
    eval_iters: int = 10
    seq_len: int | None = None
    steps: int | None = None
    global_batch_size: int = 8
    micro_batch_size: int | None = None
    lr: float = 3e-4
    min_lr: float | None = None
    warmup_steps: int = 0
    schedule: str = "cosine"
    decay_steps: int = 0
    optimizer: str = "adamw"
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    grad_clip: float = 1.0
    precision: str | None = None
    ac: str = "none"
    tp: int = 1
    ep: int = 1
    dp: int | None = None
    dp_mode: str = "shard"
    sequence_parallel: bool = True
    ep_overlap: bool = False
    pp: int = 1
    pp_schedule: str | None = None
    cp: int = 1
    cp_adaptive: bool = False
    cp_min_tokens: int | None = None
    compile: bool = False
    save: str | None = None
    save_every: int = 0
    keep_last: int = 3
    async_save: bool = False
    exit_at_step: int | None = None
    max_skipped_steps: int = 3
    timeout_s: float | None = None
    log_every: int = 1
    log_dir: str | None = None
    peak_tflops: float | None = None
    tensorboard: bool = False
    seed: int = 0
    device: str = "auto"
    set: list[str] = field(default_factory=list)
    """``KEY=VALUE`` config overrides applied to the model (as ``--set``)."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def write(self, path: str | Path) -> None:
        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))


FIELDS = {f.name: f for f in dataclasses.fields(Recipe)}
CHOICES = {"schedule": ("constant", "cosine", "linear", "wsd"), "optimizer": ("adamw", "muon"),
           "precision": ("fp32", "bf16", "fp8"), "ac": ("none", "full", "selective"),
           "dp_mode": ("shard", "replicate"), "device": ("auto", "cpu", "cuda"),
           "pp_schedule": ("gpipe", "1f1b", "interleaved-1f1b")}


def _coerce(name: str, value: Any, where: str) -> Any:
    """YAML's value for field ``name`` in the field's type (``3e-4`` is a string in YAML 1.1)."""
    kind = str(FIELDS[name].type)
    if value is None or name in ("model", "set", "data"):
        return value
    try:
        if kind.startswith("bool"):
            if isinstance(value, str) and value.lower() in ("true", "false"):
                return value.lower() == "true"
            if not isinstance(value, bool):
                raise ValueError
            return value
        if kind.startswith("int"):
            if isinstance(value, bool) or float(value) != int(float(value)):
                raise ValueError
            return int(float(value))
        if kind.startswith("float"):
            return float(value)
        return str(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: {name} must be {kind.split(' ')[0]}, got {value!r}") from None


def check_choice(name: str, value: Any) -> None:
    if name in CHOICES and value is not None and value not in CHOICES[name]:
        raise ConfigError(f"{name} must be one of {', '.join(CHOICES[name])}; got {value!r}")


def merge(recipe: Recipe, values: dict[str, Any], where: str) -> Recipe:
    """``recipe`` with ``values`` (by field name; dashes allowed) laid over it."""
    out = dataclasses.replace(recipe)
    for key, value in values.items():
        name = key.replace("-", "_")
        if name == "batch_size":
            name = "global_batch_size"
        if name not in FIELDS:
            near = closest(name, FIELDS)
            hint = f" (did you mean {near!r}?)" if near else ""
            raise ConfigError(f"{where}: unknown recipe key {key!r}{hint}")
        value = _coerce(name, value, where)
        check_choice(name, value)
        if name == "set" and value is not None and not isinstance(value, list):
            raise ConfigError(f"{where}: set must be a list of KEY=VALUE strings")
        setattr(out, name, value)
    return out


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


HELP = {
    "tokens": "a .npy array of token ids (1-D or 2-D), or `synthetic` (built in)",
    "data": "an indexed dataset PREFIX, or a blend: WEIGHT PREFIX WEIGHT PREFIX ...",
    "split": "train/valid/test weights by documents, e.g. 969,30,1",
    "document_isolation": "tokens attend to, and states carry over, their own document only",
    "eval_every": "evaluate on the validation split every N steps (val_loss)",
    "eval_iters": "global batches per evaluation (default 10)",
    "seq_len": "tokens per sample (+1); cuts a 1-D --tokens array into sequences this long",
    "steps": "the run's total optimizer steps (the schedule's N); 0 writes the initial weights",
    "global_batch_size": "sequences per optimizer step (default 8)",
    "micro_batch_size": "sequences per forward per rank (default: global / dp)",
    "lr": "peak learning rate (default 3e-4)",
    "min_lr": "final learning rate of cosine/linear/wsd (default lr/10)",
    "warmup_steps": "linear warmup steps (default 0)",
    "schedule": "learning-rate schedule after warmup (default cosine)",
    "decay_steps": "wsd: the final steps that decay to min_lr",
    "optimizer": "adamw (default), or muon for hidden matrices with adamw for the rest",
    "weight_decay": "decoupled weight decay of matrices and embeddings (default 0.1)",
    "adam_beta1": "default 0.9", "adam_beta2": "default 0.95", "adam_eps": "default 1e-8",
    "grad_clip": "clip the global gradient norm to this (default 1.0; 0 disables)",
    "precision": "fp32, bf16 (fp32 masters; the default on CUDA) or fp8 (CUDA, torchao)",
    "ac": "activation checkpointing per layer: none (default), full or selective",
    "tp": "tensor-parallel size", "ep": "expert-parallel size (divides dp)",
    "dp": "data-parallel size (default: the rest of the world)",
    "dp_mode": "FSDP2 sharding (default) or replication",
    "ep_overlap": "expert parallel: dispatch half the tokens while the experts compute the rest",
    "pp": "pipeline-parallel size: the pattern's '|' segments, or balanced stages",
    "pp_schedule": "gpipe, 1f1b (default) or interleaved-1f1b (default with virtual stages)",
    "cp": "context-parallel size: each sequence split into 2 x cp chunks over cp ranks",
    "cp_adaptive": "context parallel for packed documents: shorter ones whole on one rank",
    "cp_min_tokens": "with --cp-adaptive: documents this long or longer are split over the cp "
                     "ranks (default: sequence length / cp)",
    "compile": "torch.compile every layer",
    "save": "the run folder for checkpoints (resumes from it when it has one)",
    "save_every": "save every N steps (default: only at the end)",
    "keep_last": "keep the newest K step folders (default 3)",
    "async_save": "write checkpoints in the background while training goes on",
    "exit_at_step": "stop after this step with a checkpoint (the schedule keeps --steps)",
    "max_skipped_steps": "stop (exit 3) after this many consecutive non-finite steps (3)",
    "timeout_s": "bound collectives and steps: a slower step prints every stack and exits",
    "log_every": "log every N steps (default 1)",
    "log_dir": "where metrics.jsonl goes (default: --save)",
    "peak_tflops": "peak TFLOP/s per device for MFU (default: known GPUs' bf16 peak)",
    "tensorboard": "also write TensorBoard scalars (needs tensorboard)",
    "seed": "initialisation (presets) and data order (default 0)",
    "device": "auto (default): CUDA when available; under torchrun cuda:LOCAL_RANK",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """One flag per recipe field; only the flags given reach the recipe (no defaults here)."""
    for name, help_text in HELP.items():
        flag = "--" + name.replace("_", "-")
        kind = str(FIELDS[name].type)
        if kind.startswith("bool"):
            p.add_argument(flag, action="store_true", default=argparse.SUPPRESS, help=help_text)
            continue
        names = [flag, "--batch-size"] if name == "global_batch_size" else [flag]
        typ = int if kind.startswith("int") else float if kind.startswith("float") else str
        p.add_argument(*names, dest=name, type=typ, choices=CHOICES.get(name),
                       nargs="+" if name == "data" else None,
                       default=argparse.SUPPRESS, help=help_text)
    p.add_argument("--no-sequence-parallel", dest="sequence_parallel", action="store_false",
                   default=argparse.SUPPRESS, help="keep activations replicated across tp ranks")
    p.add_argument("--activation-checkpointing", action="store_true", default=argparse.SUPPRESS,
                   help="the same as --ac full")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", default=argparse.SUPPRESS,
                   help="override a model config field of a preset or pattern (repeatable)")
