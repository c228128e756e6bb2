"""Hugging Face converters (installed as ``composer.convert``), both directions, strict and
streaming: :func:`from_hf` and :func:`to_hf`. One adapter per family in this package."""

from composer.convert.api import from_hf, to_hf
from composer.convert.infer import adapters, infer_adapter
from composer.portable import CheckpointError

__all__ = ["CheckpointError", "adapters", "from_hf", "infer_adapter", "to_hf"]
