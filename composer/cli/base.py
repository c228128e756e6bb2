"""What every ``composer`` subcommand shares: the usage error, the parser that raises it, the
version, and the size estimates that set the thread count (:mod:`composer.threads`).

Nothing here imports torch at module level: ``composer --help``, ``--version`` and argument
errors finish before any model code loads.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, NoReturn

DEFAULT_PATTERN = "M-M*-ME"
HF_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


class UsageError(Exception):
    """A user mistake: reported as one line, exit code 2."""


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # main() prefixes every message with "composer: error: "; a subcommand's parser adds
        # its own name after it ("generate: argument --top-k: ..."), the root parser nothing.
        command = self.prog.partition(" ")[2]
        raise UsageError(f"{command}: {message}" if command else message)


def version() -> str:
    """The installed package's version (``composer.__version__``); ``0+unknown`` for a source
    tree on ``sys.path`` that was never installed."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("composer-lm")
    except PackageNotFoundError:
        return "0+unknown"


def config_params(cfg: Any) -> int:
    """Parameters of a model config, counted on the meta device (no memory, no init)."""
    from composer.build.builder import build_model, model_stats

    return model_stats(build_model(cfg, device="meta")).n_params


def source_params(source: str | Path | None) -> int:
    """Parameters of what a command reads: a composer folder (portable or ``train --save``: its
    config.yaml, counted exactly), a Hugging Face folder (weight bytes / 2, as bf16), or a
    preset name; 0 when unknown (the command itself reports a bad source)."""
    from composer.config import ModelConfig

    if source is None:
        return 0
    path = Path(source)
    try:
        if (path / "config.yaml").is_file():
            return config_params(ModelConfig.load(path / "config.yaml").validate())
        if path.is_dir():
            return sum(f.stat().st_size for f in path.iterdir()
                       if f.name.endswith(HF_WEIGHT_SUFFIXES)) // 2
        from composer.zoo import get_preset

        return config_params(get_preset(str(source)).config())
    except (ValueError, OSError):
        return 0


def train_work(recipe: Any) -> tuple[int, int]:
    """(parameters, tokens per forward) of a resolved recipe, for the thread count; a model
    that does not resolve counts 0 (train itself then says what is wrong)."""
    from composer.config import ModelConfig, apply_overrides
    from composer.train.engine import DEFAULT_SYNTHETIC_SEQ_LEN
    from composer.train.recipe import model_source

    try:
        name, pattern, overrides = model_source(recipe.model)
        if pattern is None and name is not None and Path(name).is_dir():
            n_params = source_params(name)
        else:
            from composer.zoo import get_preset

            cfg = ModelConfig(pattern=pattern) if pattern is not None else \
                get_preset(str(name)).config()
            apply_overrides(cfg, overrides + list(recipe.set or []))
            n_params = config_params(cfg.validate())
    except ValueError:
        n_params = 0
    rows = recipe.micro_batch_size or recipe.global_batch_size or 1
    return n_params, rows * (recipe.seq_len or DEFAULT_SYNTHETIC_SEQ_LEN)
