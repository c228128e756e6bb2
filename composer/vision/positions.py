"""M-RoPE positions for prompts with images: re-exported from :mod:`composer.blocks.mrope`,
where they live so that the attention layers (below :mod:`composer.vision`) can use them."""

from composer.blocks.mrope import decode_positions, mrope_cos_sin, mrope_positions, mrope_rows

__all__ = ["decode_positions", "mrope_cos_sin", "mrope_positions", "mrope_rows"]
