"""Hugging Face converters (installed as ``composer.convert``): one adapter per family."""
