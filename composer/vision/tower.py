"""The vision tower of Qwen3-VL / Qwen3.5-VL: images to language-model inputs, as blocks.

A ViT (Dosovitskiy et al. 2021) over native-resolution images (Qwen2-VL, Wang et al. 2024 §2.1):

1. **Patch embedding**: each row of ``pixel_values`` is one ``C x Tp x P x P`` patch (``Tp``
   frames, ``P x P`` pixels), the processor's flattening; a ``Conv3d`` whose stride is its
   kernel is one linear map of that row, ``x = W . patch + b`` (``W`` kept in the ``Conv3d``
   layout ``[D, C, Tp, P, P]``).
2. **Learned positions**: a ``G x G`` table (``G^2 = n_position_embeddings``) resampled to each
   image's ``h x w`` patch grid, bilinearly with aligned corners, and added.
3. **2-D RoPE** (rotate-half, the whole head): of a head's ``E / 2`` rotation pairs the first
   ``E / 4`` turn by the patch's row ``r``, the next ``E / 4`` by its column ``c``, with the
   frequencies ``theta^(-4i / E)``: angles ``[r * f, c * f]``.
4. ``depth`` pre-norm blocks, each two residual layers of the tower's pattern (``B-``):
   ``x + attn(ln(x))`` with **bidirectional** attention inside each frame of each image (the
   images of a batch are packed into one sequence, no padding; a frame never sees another), then
   ``x + mlp(ln(x))`` (plain GELU-tanh MLP with biases). LayerNorms, not RMSNorms.
5. **Patch merger**: LayerNorm per patch, then every ``m x m`` block of neighbouring patches
   concatenated (``m = merge_size``) and ``down(gelu(up(.)))`` to the language model's width
   ``d_out``: one language token per block.

Token order: patches come block-major, as the processor emits them (row of ``m x m`` blocks,
column of blocks, row in block, column in block), frame after frame, image after image; so the
``m^2`` patches of a block are consecutive and step 5 is a reshape. Positions (steps 2 and 3) are
computed in that order.

Canonical state-dict keys (the converter maps Hugging Face's ``model.visual.*`` to these)::

    patch_embed.weight [D, C, Tp, P, P]     patch_embed.bias [D]
    pos_embed.weight [G*G, D]
    layers.{2i}.norm.{weight,bias} [D]      layers.{2i}.mixer.qkv_proj.weight [3D, D]  (+ bias)
    layers.{2i}.mixer.o_proj.{weight,bias}  (rows of qkv_proj: [q; k; v], each head-major)
    layers.{2i+1}.norm.{weight,bias}        layers.{2i+1}.mixer.up_proj.{weight,bias} [F, D]
    layers.{2i+1}.mixer.down_proj.{weight,bias} [D, F]
    merger.norm.{weight,bias} [D]           merger.mlp.up_proj.{weight,bias} [D m^2, D m^2]
    merger.mlp.down_proj.{weight,bias} [d_out, D m^2]

Plans (data, applied by ``composer/parallel`` later): each attention mixer splits its heads (q, k,
v parts of ``qkv_proj`` by rows, ``o_proj`` row parallel), each MLP and the merger's MLP split
their hidden units (``up_proj`` column, ``down_proj`` row parallel); embeddings, positions and
norms are replicated.

Legend: N patches (all images), D tower width, H heads, E head width, F MLP width, S patches of
one frame, M merged tokens (``N / m^2``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from composer.blocks.attention import apply_rope, rope_frequencies
from composer.blocks.mlp import ACTIVATIONS
from composer.blocks.plan import ONES, ZEROS, Divisible, Init, Normal, ParallelPlan, init_module
from composer.blocks.protocol import TimeMixingOp
from composer.blocks.split import SplitLinear
from composer.config import VisionConfig, validate_vision
from composer.kernels import sdpa_context
from composer.kernels.linear import Linear

# ---------------------------------------------------------------- the config section


# VisionConfig and validate_vision live in composer.config (the model config's ``vision:``
# section, importable without torch); re-exported here.


# ---------------------------------------------------------------- where each patch sits


@dataclass
class ImageLayout:
    """What the tower derives from ``grid_thw`` (``[n, 3]``: frames, patch rows, patch
    columns of each image): every patch's row and column in block-major order, and the length
    of each attention segment (one per frame)."""

    rows_N: torch.Tensor
    cols_N: torch.Tensor
    segments: list[int]
    grids: list[tuple[int, int, int]]


def block_order(h: int, w: int, m: int) -> torch.Tensor:
    """Raster indices ``r * w + c`` of an ``h x w`` grid listed block-major (blocks of
    ``m x m``, the processor's order)."""
    return torch.arange(h * w).view(h // m, m, w // m, m).permute(0, 2, 1, 3).reshape(-1)


def image_layout(grid_thw: torch.Tensor, n_patches: int, merge: int) -> ImageLayout:
    """The layout of ``grid_thw``; one-line ``ValueError`` when it does not describe the
    ``n_patches`` rows of ``pixel_values``."""
    grids = [tuple(int(g) for g in row) for row in grid_thw.reshape(-1, 3).tolist()]
    for i, (t, h, w) in enumerate(grids):
        if t < 1 or h < 1 or w < 1 or h % merge or w % merge:
            raise ValueError(f"image {i}: grid (t, h, w) = {(t, h, w)} must be positive with h "
                             f"and w divisible by the merge size {merge}")
    total = sum(t * h * w for t, h, w in grids)
    if total != n_patches:
        raise ValueError(f"grid_thw describes {total} patches but pixel_values has "
                         f"{n_patches} rows")
    rows, cols = [], []
    for t, h, w in grids:
        idx = block_order(h, w, merge).repeat(t)
        rows.append(idx // w)
        cols.append(idx % w)
    segments = [h * w for t, h, w in grids for _ in range(t)]
    return ImageLayout(torch.cat(rows), torch.cat(cols), segments, grids)


# ---------------------------------------------------------------- blocks


class LayerNorm(nn.Module):
    """``y = w * (x - mean) / sqrt(var + eps) + b`` over the last dimension (Ba et al. 2016),
    computed in at least fp32 and cast back."""

    def __init__(self, d: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))
        self.bias = nn.Parameter(torch.zeros(d))

    def init_rules(self) -> dict[str, Init]:
        return {"weight": ONES, "bias": ZEROS}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = torch.promote_types(x.dtype, torch.float32)
        h = F.layer_norm(x.to(dtype), x.shape[-1:], self.weight.to(dtype),
                         self.bias.to(dtype), self.eps)
        return h.to(x.dtype)


class SegmentAttention(TimeMixingOp):
    """Bidirectional SDPA inside each segment of a packed sequence (a frame of an image): one
    dense call per segment, so no mask and no padding (flash-eligible on CUDA). The GPU hook
    for many small images is a varlen kernel over the same ``cu_seqlens``; not wired yet.
    No context-parallel form: a frame's patches stay on one rank."""

    context = None

    def forward(self, q_HNE: torch.Tensor, k_HNE: torch.Tensor, v_HNE: torch.Tensor,
                segments: list[int], scale: float) -> torch.Tensor:
        """``o [H, N, E]`` from ``q``, ``k``, ``v [H, N, E]`` (after RoPE)."""
        outs = []
        with sdpa_context(q_HNE):
            for q, k, v in zip(q_HNE.split(segments, 1), k_HNE.split(segments, 1),
                               v_HNE.split(segments, 1), strict=True):
                outs.append(F.scaled_dot_product_attention(q, k, v, scale=scale))
        return torch.cat(outs, 1) if len(outs) > 1 else outs[0]


class VisionAttention(nn.Module):
    """``mixer.qkv_proj`` (fused ``[q; k; v]``, each head-major, with bias) and ``mixer.o_proj``;
    2-D RoPE on q and k, then :class:`SegmentAttention` (``core``)."""

    uses_layout = True
    ops = ("core",)

    def __init__(self, v: VisionConfig) -> None:
        super().__init__()
        d = v.d_model
        self.n_heads, self.d_head, self.init_std = v.n_heads, v.d_head, v.init_std
        self.scale = self.d_head**-0.5
        # parts so that tensor parallelism splits each by heads (composer/blocks/split.py); the
        # state dict shows one fused qkv_proj.weight, transformers' layout
        self.qkv_proj = SplitLinear(d, {"q": d, "k": d, "v": d}, bias=True)
        self.o_proj = Linear(d, d, bias=True)
        self.core = SegmentAttention()

    def init_rules(self) -> dict[str, Init]:
        return {"qkv_proj.weight_*": Normal(self.init_std), "qkv_proj.bias_*": ZEROS,
                "o_proj.weight": Normal(self.init_std), "o_proj.bias": ZEROS}

    def forward(self, x_ND: torch.Tensor, cos_NE: torch.Tensor, sin_NE: torch.Tensor,
                segments: list[int]) -> torch.Tensor:
        n = x_ND.shape[0]
        qkv = self.qkv_proj(x_ND).view(n, 3, -1, self.d_head).permute(1, 2, 0, 3)
        q_HNE, k_HNE = apply_rope(qkv[0], cos_NE, sin_NE), apply_rope(qkv[1], cos_NE, sin_NE)
        o_HNE = self.core(q_HNE, k_HNE, qkv[2], segments, self.scale)
        return self.o_proj(o_HNE.transpose(0, 1).reshape(n, -1))

    def parallel_plan(self) -> ParallelPlan:
        """Heads split over ``tp``: each of q, k, v split by rows (whole heads), o_proj row
        parallel."""
        return ParallelPlan(shard={"qkv_proj.*": 0}, rowwise=("o_proj",))

    @staticmethod
    def layout_rules(v: VisionConfig) -> list[Divisible]:
        return [Divisible("vision.n_heads", v.n_heads)]

    @staticmethod
    def flops_per_token(v: VisionConfig, seq_len: int) -> int:
        """Projections ``2 * 4 D^2`` plus scores and weighted sum ``4 * D * seq_len`` (the
        segment's length)."""
        return 8 * v.d_model**2 + 4 * v.d_model * seq_len


class VisionMLP(nn.Module):
    """``mixer.up_proj``, ``mixer.down_proj`` (with biases): ``down(act(up(x)))``."""

    stateless = True

    def __init__(self, v: VisionConfig, d_in: int | None = None, d_ff: int | None = None,
                 d_out: int | None = None, activation: str | None = None) -> None:
        super().__init__()
        d_in = d_in or v.d_model
        self.init_std = v.init_std
        self.act = ACTIVATIONS[activation or v.activation]
        self.up_proj = Linear(d_in, d_ff or v.d_ff, bias=True)
        self.down_proj = Linear(d_ff or v.d_ff, d_out or d_in, bias=True)

    def init_rules(self) -> dict[str, Init]:
        return {"*_proj.weight": Normal(self.init_std), "*_proj.bias": ZEROS}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(x)))

    def parallel_plan(self) -> ParallelPlan:
        """Hidden units split over ``tp``: up column parallel, down row parallel."""
        return ParallelPlan(colwise=("up_proj",), rowwise=("down_proj",))

    @staticmethod
    def layout_rules(v: VisionConfig) -> list[Divisible]:
        return [Divisible("vision.d_ff", v.d_ff)]

    @staticmethod
    def flops_per_token(v: VisionConfig, seq_len: int) -> int:
        return 4 * v.d_model * v.d_ff


def tower_flops(v: VisionConfig, grids: list[tuple[int, int, int]]) -> int:
    """Forward FLOPs of the tower on images of ``(t, h, w)`` patches (a multiply-add is 2):
    the patch embedding, each layer's ``flops_per_token`` at its frame's length, the merger's
    two projections (norms, activations, rotary and the position resampling are negligible)."""
    d_cat = v.d_model * v.merge_size**2
    total = 0
    for t, h, w in grids:
        n, s = t * h * w, h * w
        total += 2 * n * v.d_patch * v.d_model
        total += v.depth * n * (VisionAttention.flops_per_token(v, s)
                                + VisionMLP.flops_per_token(v, s))
        total += 2 * (n // v.merge_size**2) * d_cat * (d_cat + v.d_out)
    return total


class VisionLayer(nn.Module):
    """``layers.j.norm`` (LayerNorm) and ``layers.j.mixer``: ``x + mixer(norm(x))``."""

    def __init__(self, v: VisionConfig, mixer: nn.Module) -> None:
        super().__init__()
        self.norm = LayerNorm(v.d_model, v.norm_eps)
        self.mixer = mixer

    def forward(self, x_ND: torch.Tensor, cos_NE: torch.Tensor, sin_NE: torch.Tensor,
                segments: list[int]) -> torch.Tensor:
        h_ND = self.norm(x_ND)
        if getattr(self.mixer, "uses_layout", False):
            return x_ND + self.mixer(h_ND, cos_NE, sin_NE, segments)
        return x_ND + self.mixer(h_ND)


class PatchMerger(nn.Module):
    """``merger.norm``, then each ``m x m`` block concatenated, ``merger.mlp.{up,down}_proj`` with
    an exact GELU between (transformers' ``nn.GELU()``)."""

    def __init__(self, v: VisionConfig) -> None:
        super().__init__()
        d_cat = v.d_model * v.merge_size**2
        self.d_cat = d_cat
        self.norm = LayerNorm(v.d_model, v.norm_eps)
        self.mlp = VisionMLP(v, d_in=d_cat, d_ff=d_cat, d_out=v.d_out, activation="gelu")

    def forward(self, x_ND: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.norm(x_ND).reshape(-1, self.d_cat))


# ---------------------------------------------------------------- the tower


class VisionTower(nn.Module):
    """``forward(pixel_values [N, C*Tp*P*P], grid_thw [n, 3]) -> [M, d_out]``: the merged
    tokens of every image, image after image (``t * h * w / m^2`` each)."""

    def __init__(self, v: VisionConfig) -> None:
        super().__init__()
        validate_vision(v)
        self.cfg = v
        k = (v.temporal_patch_size, v.patch_size, v.patch_size)
        self.patch_embed = nn.Conv3d(v.in_channels, v.d_model, k, stride=k, bias=True)
        self.pos_embed = nn.Embedding(v.n_position_embeddings, v.d_model)
        self.layers = nn.ModuleList(
            VisionLayer(v, VisionAttention(v) if s == "B" else VisionMLP(v)) for s in v.pattern)
        self.merger = PatchMerger(v)
        # frequencies of one axis: E / 2 channels rotate by each of row and column
        self.inv_freq = rope_frequencies(v.d_head // 2, v.rope_theta, None)

    def init_rules(self) -> dict[str, Init]:
        # patch_embed: PyTorch's Conv3d default would be U(+-1/sqrt(fan_in)); a normal keeps
        # one rule for every projection of the tower
        return {"patch_embed.weight": Normal(self.cfg.init_std), "patch_embed.bias": ZEROS,
                "pos_embed.weight": Normal(self.cfg.init_std)}

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        init_module(self, generator)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        v = self.cfg
        if pixel_values.dim() != 2 or pixel_values.shape[1] != v.d_patch:
            raise ValueError(f"pixel_values must be [patches, {v.d_patch}] (C * Tp * P * P), "
                             f"got {tuple(pixel_values.shape)}")
        layout = image_layout(grid_thw, pixel_values.shape[0], v.merge_size)
        w = self.patch_embed.weight
        x_ND = F.linear(pixel_values.to(w.dtype), w.flatten(1), self.patch_embed.bias)
        x_ND = x_ND + self.positions(layout).to(x_ND.dtype)
        cos_NE, sin_NE = self.rotary(layout, x_ND)
        for layer in self.layers:
            x_ND = layer(x_ND, cos_NE, sin_NE, layout.segments)
        return self.merger(x_ND)

    def positions(self, layout: ImageLayout) -> torch.Tensor:
        """``[N, D]``: the ``G x G`` table resampled (bilinear, aligned corners) to each
        image's grid, in block-major order, repeated over frames."""
        g, table = self.cfg.grid_side, self.pos_embed.weight
        grid_DGG = table.t().reshape(1, -1, g, g)
        out = []
        for t, h, w in layout.grids:
            pos_DS = F.interpolate(grid_DGG, size=(h, w), mode="bilinear",
                                   align_corners=True).reshape(table.shape[1], h * w)
            out.append(pos_DS[:, block_order(h, w, self.cfg.merge_size)].t().repeat(t, 1))
        return torch.cat(out)

    def rotary(self, layout: ImageLayout,
               like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos``/``sin`` ``[N, E]``: angles ``[r f, c f, r f, c f]`` (rotate-half pairs
        ``i, i + E/2``), in at least fp32 and cast to ``like``'s dtype."""
        dtype = torch.promote_types(like.dtype, torch.float32)
        inv_freq = self.inv_freq.to(like.device, dtype)
        rows = layout.rows_N.to(like.device, dtype)[:, None] * inv_freq
        cols = layout.cols_N.to(like.device, dtype)[:, None] * inv_freq
        angles = torch.cat([rows, cols, rows, cols], -1)
        return angles.cos().to(like.dtype), angles.sin().to(like.dtype)
