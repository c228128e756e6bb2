"""Generation: inference caches and decoding (docs/generation.md).

``composer.generate(model, input_ids, max_new_tokens, ...)`` (:mod:`composer.inference.decode`)
prefills the prompt once, then decodes one token per step from a per-model
:class:`~composer.blocks.cache.InferenceCache`: a preallocated K/V cache for attention, the
compressed latent for multi-latent attention, and a constant-size conv window + state for
Mamba-2 and gated-delta-net layers (the cache layout is documented in
:mod:`composer.blocks.cache`). ``composer generate`` (:mod:`composer.cli.generate`) is the
command-line front door.
"""

from composer.inference.decode import Generated, generate

__all__ = ["Generated", "generate"]
