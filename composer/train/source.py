"""A Hugging Face folder as ``composer train``'s SOURCE: recognised as ``composer generate``
recognises one (:func:`composer.cli.generate.source_kind`), converted with
:func:`composer.convert.from_hf` into a temporary portable checkpoint that the run trains from."""

from __future__ import annotations

from pathlib import Path

from composer.portable import CONFIG_FILE, is_training_checkpoint


def is_hf_folder(folder: Path) -> bool:
    """A Hugging Face folder (``config.json`` with ``architectures``), not one of ours (as
    ``composer generate`` recognises one: :func:`composer.cli.generate.source_kind`)."""
    import json

    if not folder.is_dir() or (folder / CONFIG_FILE).is_file() or is_training_checkpoint(folder):
        return False
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and isinstance(config.get("architectures"), list) and \
        bool(config["architectures"])


_CONVERTED: dict[Path, Path] = {}


def converted_hf(folder: Path) -> Path:
    """``folder`` converted (``composer.convert.from_hf``) into a temporary portable checkpoint,
    once per process, removed at exit: the run trains from it and saves its own checkpoints, so
    nothing of the conversion needs to outlive the process (each rank converts its own copy:
    no rank waits on another's files)."""
    import atexit
    import shutil
    import tempfile

    from composer.convert import from_hf

    key = folder.resolve()
    if key not in _CONVERTED:
        tmp = Path(tempfile.mkdtemp(prefix="composer-train-hf-"))
        atexit.register(shutil.rmtree, tmp, True)
        from_hf(folder, tmp / "checkpoint")
        _CONVERTED[key] = tmp / "checkpoint"
    return _CONVERTED[key]
