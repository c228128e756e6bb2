"""M-RoPE (multimodal rotary position embedding) for Qwen3.5-VL: the three position rows of a
prompt with images, their decode-time offset, and the cos/sin tables.

Qwen2-VL §2.1 (Wang et al. 2024), as Qwen3.5 defines it. Every token carries three positions
``(t, h, w)``. A text token has ``t = h = w = p``, its index counted on from the previous token;
the ``N = t * h * w / merge^2`` ``<|image_pad|>`` tokens of an image that starts at ``s`` are
its merged patches in row-major ``(t, h, w)`` order, at ``(s + i_t, s + i_h, s + i_w)``
(``i_h < h / merge``, ``i_w < w / merge``); the text after the image resumes at
``s + max(h, w) / merge``. So a sequence ends at ``max + 1`` after ``L`` real tokens and the
decode-time offset (``delta = max + 1 - L``, per row) puts the ``k``-th generated token at
``L + k + delta`` on all three rows. Padding slots (``attention_mask == 0``) get position 0.
Packed documents (``doc_ids``, training) each count from 0, as 1-D RoPE restarts per document:
a document's positions are those it has alone.

Tables: each of the ``d_rot / 2`` rotary frequencies takes its angle from one of the three rows.
Qwen3.5 interleaves them (``mrope_section = [s_t, s_h, s_w]``): frequency ``i`` reads ``h`` when
``i % 3 == 1`` and ``i < 3 s_h``, ``w`` when ``i % 3 == 2`` and ``i < 3 s_w``, ``t`` otherwise;
Qwen2-VL (``interleaved=False``) gives the first ``s_t`` frequencies to ``t``, the next ``s_h``
to ``h``, the last ``s_w`` to ``w``. The tables keep the rotate-half layout of
``composer.blocks.attention`` (frequency ``i`` rotates channels ``i`` and ``i + d_rot / 2``) and
its products (``position * inv_freq`` in at least fp32), so three equal rows give exactly its
1-D tables. The rotary part is the first ``d_rot`` channels of a head (``rotary_fraction``:
Qwen3.5's full-attention layers rotate a quarter of each head).

Pure functions, no parameters and no composer imports (the attention layers may import them).
Legend: B batch, T time, F rotary frequencies (``d_rot / 2``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def mrope_positions(input_ids: torch.Tensor, image_grid_thw: torch.Tensor | None,
                    attention_mask: torch.Tensor | None = None, *, image_token_id: int,
                    vision_start_token_id: int, spatial_merge_size: int,
                    video_grid_thw: torch.Tensor | None = None,
                    doc_ids: torch.Tensor | None = None,
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions ``[3, B, T]`` (``input_ids``' dtype and device) and offsets ``deltas [B, 1]``
    of a prompt ``input_ids [B, T]`` whose images' patch grids are the rows of
    ``image_grid_thw [n, 3]`` (every image of the batch, in order); ``attention_mask [B, T]``
    marks real tokens (padding anywhere, left padding in practice). Equal to transformers'
    ``Qwen3_5Model.get_rope_index``. Each image is one run of ``image_token_id`` right after a
    ``vision_start_token_id``, ``t * h * w / merge^2`` tokens long; anything else is a
    one-line ``ValueError`` naming the image. ``doc_ids [B, T]`` (non-decreasing along a row):
    packed documents, each counted from 0 (an image block must not cross a boundary); the
    offsets are then the last document's."""
    if video_grid_thw is not None:
        raise ValueError("mrope_positions: videos are not supported yet (images only)")
    if doc_ids is not None and attention_mask is not None:
        raise ValueError("mrope_positions: give doc_ids (packed training rows) or "
                         "attention_mask (padded prompts), not both")
    b, t = input_ids.shape
    grids = [] if image_grid_thw is None else [tuple(g) for g in image_grid_thw.tolist()]
    ids_rows = input_ids.tolist()
    keep_rows = None if attention_mask is None else attention_mask.bool().tolist()
    pos_3BT = torch.zeros(3, b, t, dtype=input_ids.dtype)
    deltas, n_used = [], 0
    for row in range(b):
        keep = [True] * t if keep_rows is None else keep_rows[row]
        ids = [i for i, k in zip(ids_rows[row], keep, strict=True) if k]
        spans = [(0, len(ids))] if doc_ids is None else _doc_spans(doc_ids[row])
        parts = []
        for lo, hi in spans:
            pos_3L, n_used = _row_positions(ids[lo:hi], grids, n_used, image_token_id,
                                            vision_start_token_id, spatial_merge_size)
            parts.append(pos_3L)
        pos_3L = torch.cat(parts, 1)
        pos_3BT[:, row, torch.tensor(keep, dtype=torch.bool)] = pos_3L
        last = parts[-1]
        deltas.append(int(last.max()) + 1 - last.shape[1] if last.numel() else 0)
    if n_used != len(grids):
        raise ValueError(f"image {n_used}: no <|image_pad|> run left for it ({len(grids)} images, "
                         f"{n_used} placeholder runs in the prompt)")
    device = input_ids.device
    return pos_3BT.to(device), torch.tensor(deltas, device=device)[:, None]


def _doc_spans(doc_ids_T: torch.Tensor) -> list[tuple[int, int]]:
    """The ``[lo, hi)`` token ranges of a row's documents."""
    cuts = (torch.nonzero(doc_ids_T[1:] != doc_ids_T[:-1]).flatten() + 1).tolist()
    edges = [0, *cuts, int(doc_ids_T.shape[0])]
    return list(zip(edges[:-1], edges[1:], strict=True))


def _row_positions(ids: list[int], grids: list[tuple[int, ...]], n_used: int, image_token_id: int,
                   vision_start_token_id: int, merge: int) -> tuple[torch.Tensor, int]:
    """One row's ``[3, L]`` positions (real tokens only) and the count of images used so far."""
    chunks, cur, i = [], 0, 0
    while i < len(ids):
        j = i
        is_image = ids[i] == image_token_id
        while j < len(ids) and (ids[j] == image_token_id) == is_image:
            j += 1
        if not is_image:
            chunks.append(torch.arange(cur, cur + j - i).expand(3, -1))
            cur += j - i
        else:
            grid = _check_image(n_used, grids, j - i, i > 0 and ids[i - 1] == vision_start_token_id,
                                merge)
            chunks.append(_image_positions(cur, grid, merge))
            cur += max(grid[1], grid[2]) // merge
            n_used += 1
        i = j
    return (torch.cat(chunks, 1) if chunks else torch.zeros(3, 0, dtype=torch.long)), n_used


def _check_image(idx: int, grids: list[tuple[int, ...]], n_tokens: int, after_start: bool,
                 merge: int) -> tuple[int, ...]:
    """Image ``idx``'s grid, once its placeholder run (``n_tokens`` long) fits it."""
    if idx >= len(grids):
        raise ValueError(f"image {idx}: a run of {n_tokens} <|image_pad|> tokens but only "
                         f"{len(grids)} image(s) given (image_grid_thw has {len(grids)} rows)")
    gt, gh, gw = grids[idx]
    if gh % merge or gw % merge:
        raise ValueError(f"image {idx}: grid {gt}x{gh}x{gw} is not a multiple of the merge size "
                         f"{merge} in h and w")
    want = gt * gh * gw // merge**2
    if n_tokens != want:
        raise ValueError(f"image {idx}: {n_tokens} <|image_pad|> tokens in the prompt, its grid "
                         f"{gt}x{gh}x{gw} needs {want} (t*h*w / merge^2)")
    if not after_start:
        raise ValueError(f"image {idx}: its <|image_pad|> run does not follow a <|vision_start|>")
    return grids[idx]


def _image_positions(start: int, grid: tuple[int, ...], merge: int) -> torch.Tensor:
    """``[3, t * h * w / merge^2]``: the merged patches in row-major ``(t, h, w)`` order."""
    gt, gh, gw = grid[0], grid[1] // merge, grid[2] // merge
    axes = [torch.arange(n) + start for n in (gt, gh, gw)]
    return torch.stack(torch.meshgrid(*axes, indexing="ij")).reshape(3, -1)


def decode_positions(deltas: torch.Tensor, past_len: int | torch.Tensor,
                     n_new: int) -> torch.Tensor:
    """Positions ``[3, B, n_new]`` of the next ``n_new`` (text) tokens: ``past_len + k + delta``
    on all three rows, where ``past_len`` (an int, or ``[B]``) counts each row's real tokens so
    far (``InferenceCache.next_pos_B``; not the padded slot count) and ``deltas [B, 1]`` come
    from :func:`mrope_positions` (zeros for a text-only prompt)."""
    past_B = torch.as_tensor(past_len, device=deltas.device).reshape(-1)
    pos_BT = past_B[:, None] + torch.arange(n_new, device=deltas.device) + deltas
    return pos_BT.expand(3, -1, -1)


def mrope_rows(n_freq: int, mrope_section: Sequence[int], interleaved: bool = True,
               ) -> torch.Tensor:
    """``[F]``: which position row (0 t, 1 h, 2 w) each rotary frequency reads."""
    if len(mrope_section) != 3:
        raise ValueError(f"mrope_section {list(mrope_section)} must have 3 entries (t, h, w)")
    if interleaved:
        rows = torch.zeros(n_freq, dtype=torch.long)
        rows[1:3 * mrope_section[1]:3] = 1
        rows[2:3 * mrope_section[2]:3] = 2
    else:
        rows = torch.repeat_interleave(torch.arange(3), torch.tensor(list(mrope_section)))
    if rows.numel() != n_freq or torch.bincount(rows, minlength=3).tolist() != list(mrope_section):
        raise ValueError(f"mrope_section {list(mrope_section)} does not split the {n_freq} rotary "
                         f"frequencies (d_rot / 2){' interleaved' if interleaved else ''}")
    return rows


def mrope_cos_sin(pos_3BT: torch.Tensor, inv_freq: torch.Tensor, mrope_section: Sequence[int],
                  *, interleaved: bool = True, dtype: torch.dtype = torch.float32,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos``/``sin`` ``[B, 1, T, d_rot]`` (shared by the heads, for ``apply_rope``) at the
    positions ``pos_3BT [3, B, T]``, with the inverse frequencies ``inv_freq [d_rot / 2]`` of
    the layer (``Rotary.inv_freq``: ``rope_frequencies(d_rot, theta, scaling)``), in at least
    fp32 math, cast to ``dtype``."""
    rows = mrope_rows(inv_freq.shape[0], mrope_section, interleaved).to(pos_3BT.device)
    math_dtype = torch.promote_types(dtype, torch.float32)
    pos_BTF = pos_3BT[rows].permute(1, 2, 0)  # each frequency's own row
    angles = pos_BTF.to(math_dtype) * inv_freq.to(pos_3BT.device, math_dtype)
    angles = torch.cat([angles, angles], dim=-1)[:, None]
    return angles.cos().to(dtype), angles.sin().to(dtype)
