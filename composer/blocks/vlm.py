"""What a vision-language model's forward adds to the text model's (Qwen3.5-VL; mixed into
:class:`composer.blocks.model.HybridModel`): the images' features in place of their
``<|image_pad|>`` placeholders, the M-RoPE position rows (:mod:`composer.blocks.mrope`), and the
tower's stand-in for a training batch without images. ``visual`` is the tower
(:class:`composer.vision.tower.VisionTower`), ``config.vision`` its section.
"""

from __future__ import annotations

import torch

from composer.blocks.mrope import mrope_positions


class VisionInputs:
    """Methods of :class:`~composer.blocks.model.HybridModel` (needs ``config``, ``visual``
    and ``embed_tokens``)."""

    def embed_inputs(self, input_ids: torch.Tensor, pixel_values: torch.Tensor | None = None,
                     image_grid_thw: torch.Tensor | None = None) -> torch.Tensor:
        """The token embeddings, with the images' features (the tower's output on
        ``pixel_values`` ``[N, C*Tp*P*P]``, ``image_grid_thw`` ``[n, 3]``) in place of the
        ``<|image_pad|>`` placeholders, in order."""
        x_BTD = self.embed_tokens(input_ids)
        if pixel_values is None and image_grid_thw is None:
            return x_BTD
        v = self.config.vision
        if v is None:
            raise ValueError("images given to a text-only model (its config has no vision "
                             "section)")
        if pixel_values is None or image_grid_thw is None:
            raise ValueError("give pixel_values and image_grid_thw together")
        feats_MD = self.visual(pixel_values, image_grid_thw)
        mask_BT = input_ids == v.image_token_id
        n_tokens = int(mask_BT.sum())
        if n_tokens != feats_MD.shape[0]:
            raise ValueError(f"{n_tokens} <|image_pad|> tokens in the prompt but the "
                             f"{image_grid_thw.shape[0]} image(s) give {feats_MD.shape[0]} "
                             "features (t*h*w / merge^2 each)")
        return x_BTD.masked_scatter(mask_BT[..., None], feats_MD.to(x_BTD.dtype))

    def mrope_inputs(self, input_ids: torch.Tensor, image_grid_thw: torch.Tensor | None,
                     attention_mask: torch.Tensor | None = None,
                     doc_ids: torch.Tensor | None = None,
                     ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """M-RoPE positions ``[3, B, T]`` and offsets ``[B, 1]`` of a prompt with images
        (:func:`composer.blocks.mrope.mrope_positions`; packed documents count from 0 each);
        None without images or without ``attention.mrope_section`` (1-D positions)."""
        a, v = self.config.attention, self.config.vision
        if image_grid_thw is None or v is None or a is None or a.mrope_section is None:
            return None
        return mrope_positions(input_ids, image_grid_thw, attention_mask,
                               image_token_id=v.image_token_id,
                               vision_start_token_id=v.vision_start_token_id,
                               spatial_merge_size=v.merge_size, doc_ids=doc_ids)

    def tower_stand_in(self, dtype: torch.dtype) -> torch.Tensor:
        """A zero that depends on every tower parameter: the tower on one blank image of
        ``merge x merge`` patches, times 0. A training batch without images adds it so that
        the tower takes part in the backward as in a batch with images (a zero gradient):
        FSDP2 reduces only the parameters that took part, and every rank must reduce the same
        ones, and the update must not depend on which rank had the images."""
        v = self.config.vision
        if v is None:
            raise ValueError("tower_stand_in: the model has no vision tower")
        weight = self.visual.patch_embed.weight
        pixels = torch.zeros(v.merge_size ** 2, v.d_patch, device=weight.device)
        grid = torch.tensor([[1, v.merge_size, v.merge_size]])
        return (self.visual(pixels, grid).sum() * 0.0).to(dtype)
