"""Plain-math twin of :class:`composer.vision.tower.VisionTower` (use fp64 inputs).

Written from the formulas of the tower's module docstring, not from its code: image by image and
frame by frame, patch coordinates enumerated by loops, the bilinear taps and weights of every
patch spelled out, each rotary pair turned on its own, LayerNorm, GELU and the softmax written
out. Weights come as a dict of the tower's canonical state-dict keys.
"""

from __future__ import annotations

import torch

from composer.blocks.mlp import activation_ref
from composer.vision.tower import VisionConfig


def vision_tower_ref(pixel_values: torch.Tensor, grid_thw: torch.Tensor,
                     w: dict[str, torch.Tensor], v: VisionConfig) -> torch.Tensor:
    """``[sum t h w / m^2, d_out]`` from ``pixel_values`` ``[N, C*Tp*P*P]`` (block-major rows)."""
    m, out, start = v.merge_size, [], 0
    for t, h, w_ in grid_thw.tolist():
        coords = [(br * m + ir, bc * m + ic) for br in range(h // m) for bc in range(w_ // m)
                  for ir in range(m) for ic in range(m)]
        for _ in range(t):
            frame = pixel_values[start:start + h * w_]
            start += h * w_
            out.append(_frame(frame, coords, h, w_, w, v))
    return torch.cat(out)


def _frame(pixels: torch.Tensor, coords: list[tuple[int, int]], h: int, w_: int,
           w: dict[str, torch.Tensor], v: VisionConfig) -> torch.Tensor:
    x = pixels @ w["patch_embed.weight"].reshape(v.d_model, -1).T + w["patch_embed.bias"]
    x = x + torch.stack([_position(r, c, h, w_, w["pos_embed.weight"], v.grid_side)
                         for r, c in coords])
    for j, symbol in enumerate(v.pattern):
        p = f"layers.{j}."
        hn = _layer_norm(x, w[p + "norm.weight"], w[p + "norm.bias"], v.norm_eps)
        if symbol == "B":
            x = x + _attention(hn, coords, w, p + "mixer.", v)
        else:
            x = x + _mlp(hn, w, p + "mixer.", v.activation)
    x = _layer_norm(x, w["merger.norm.weight"], w["merger.norm.bias"], v.norm_eps)
    blocks = torch.stack([torch.cat(list(x[i:i + v.merge_size**2]))
                          for i in range(0, x.shape[0], v.merge_size**2)])
    return _mlp(blocks, w, "merger.mlp.", "gelu")


def _position(r: int, c: int, h: int, w_: int, table: torch.Tensor, g: int) -> torch.Tensor:
    """Bilinear sample of the ``g x g`` table at the point that row ``r`` of ``h`` and column
    ``c`` of ``w_`` map to with aligned corners (first and last rows on the table's edges)."""
    y = r * (g - 1) / (h - 1) if h > 1 else 0.0
    x = c * (g - 1) / (w_ - 1) if w_ > 1 else 0.0
    y0, x0 = int(y), int(x)
    y1, x1 = min(y0 + 1, g - 1), min(x0 + 1, g - 1)
    dy, dx = y - y0, x - x0
    return ((1 - dy) * (1 - dx) * table[y0 * g + x0] + (1 - dy) * dx * table[y0 * g + x1]
            + dy * (1 - dx) * table[y1 * g + x0] + dy * dx * table[y1 * g + x1])


def _layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                eps: float) -> torch.Tensor:
    mean = x.sum(-1, keepdim=True) / x.shape[-1]
    var = ((x - mean) ** 2).sum(-1, keepdim=True) / x.shape[-1]
    return weight * (x - mean) / torch.sqrt(var + eps) + bias


def _mlp(x: torch.Tensor, w: dict[str, torch.Tensor], p: str, activation: str) -> torch.Tensor:
    hidden = activation_ref(activation, x @ w[p + "up_proj.weight"].T + w[p + "up_proj.bias"])
    return hidden @ w[p + "down_proj.weight"].T + w[p + "down_proj.bias"]


def _attention(x: torch.Tensor, coords: list[tuple[int, int]], w: dict[str, torch.Tensor],
               p: str, v: VisionConfig) -> torch.Tensor:
    d, e = v.d_model, v.d_head
    qkv = x @ w[p + "qkv_proj.weight"].T + w[p + "qkv_proj.bias"]
    heads = []
    for hd in range(v.n_heads):
        q = _rotate(qkv[:, hd * e:(hd + 1) * e], coords, v)
        k = _rotate(qkv[:, d + hd * e:d + (hd + 1) * e], coords, v)
        val = qkv[:, 2 * d + hd * e:2 * d + (hd + 1) * e]
        scores = q @ k.T / e**0.5
        scores = torch.exp(scores - scores.max(-1, keepdim=True).values)
        heads.append(scores / scores.sum(-1, keepdim=True) @ val)
    return torch.cat(heads, -1) @ w[p + "o_proj.weight"].T + w[p + "o_proj.bias"]


def _rotate(x: torch.Tensor, coords: list[tuple[int, int]], v: VisionConfig) -> torch.Tensor:
    """Pair ``(i, i + E/2)`` turns by ``row * f_i`` for ``i < E/4``, else by
    ``col * f_(i - E/4)``, ``f_j = theta^(-4j / E)``."""
    e = x.shape[1]
    half, quarter = e // 2, e // 4
    out = x.clone()
    for n, (r, c) in enumerate(coords):
        for i in range(half):
            j, pos = (i, r) if i < quarter else (i - quarter, c)
            ang = torch.tensor(pos * v.rope_theta ** (-4 * j / e), dtype=x.dtype)
            a, b = x[n, i], x[n, i + half]
            out[n, i] = a * torch.cos(ang) - b * torch.sin(ang)
            out[n, i + half] = a * torch.sin(ang) + b * torch.cos(ang)
    return out
