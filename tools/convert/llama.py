"""Llama 3.x (``LlamaForCausalLM``): the plain decoder, attention ``*`` and SwiGLU MLP ``-`` per
HF layer (the layout is :mod:`composer.convert.decoder`'s)."""

from __future__ import annotations

from composer.convert.decoder import DecoderAdapter


class LlamaAdapter(DecoderAdapter):
    family = "llama"
    symbols = "*-"
    max_positions = 2048
    architectures = ("LlamaForCausalLM",)
    model_type = "llama"

