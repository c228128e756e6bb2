"""M-RoPE positions and tables (composer.blocks.mrope) against transformers' Qwen3.5-VL on a
tiny random config: the three position rows and offsets equal ``Qwen3_5Model.get_rope_index``
exactly (text only, one image, two images, a left-padded batch of 2), decoding continues them,
the cos/sin tables equal ``Qwen3_5TextRotaryEmbedding`` and reduce to composer's 1-D RoPE, and a
prompt that does not fit its images is a one-line error naming the image."""

import pytest
import torch

from composer.blocks.attention import apply_rope, rope_cos_sin, rope_cos_sin_at, rope_frequencies
from composer.blocks.mrope import decode_positions, mrope_cos_sin, mrope_positions, mrope_rows

SECTION = [3, 3, 2]  # head_dim 32, partial_rotary_factor 0.5: d_rot 16, 8 frequencies
THETA = 10000.0


@pytest.fixture(scope="module")
def hf():
    from transformers import Qwen3_5Config
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Model

    rope = dict(rope_type="default", rope_theta=THETA, partial_rotary_factor=0.5,
                mrope_section=SECTION, mrope_interleaved=True)
    text = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                linear_num_value_heads=2, linear_num_key_heads=1, linear_key_head_dim=8,
                linear_value_head_dim=8, layer_types=["linear_attention", "full_attention"],
                rope_parameters=rope)
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                  patch_size=4, spatial_merge_size=2, temporal_patch_size=2,
                  num_position_embeddings=16)
    torch.manual_seed(0)
    return Qwen3_5Model(Qwen3_5Config(text_config=text, vision_config=vision)).eval()


def _ids(hf):
    c = hf.config
    return dict(image_token_id=c.image_token_id, vision_start_token_id=c.vision_start_token_id,
                spatial_merge_size=c.vision_config.spatial_merge_size)


def _prompt(hf, parts, pad=0):
    """Token ids of ``parts`` (an int: that many text tokens; a grid: one image) after ``pad``
    left padding, and the image grids."""
    c, g = hf.config, torch.Generator().manual_seed(len(parts) + pad)
    ids, grids = [0] * pad, []
    for part in parts:
        if isinstance(part, int):
            ids += torch.randint(1, 60, (part,), generator=g).tolist()
        else:
            n = part[0] * part[1] * part[2] // 4
            ids += [c.vision_start_token_id] + [c.image_token_id] * n + [c.vision_end_token_id]
            grids.append(part)
    return ids, grids


def _batch(hf, rows):
    """``input_ids [B, T]`` (left-padded to the longest row), ``attention_mask``, grids."""
    built = [_prompt(hf, parts) for parts in rows]
    t = max(len(ids) for ids, _ in built)
    ids = torch.tensor([[0] * (t - len(i)) + i for i, _ in built])
    mask = torch.tensor([[0] * (t - len(i)) + [1] * len(i) for i, _ in built])
    grids = [g for _, gs in built for g in gs]
    return ids, mask, (torch.tensor(grids) if grids else None)


def _hf_rope_index(hf, ids, grids, mask):
    types = (ids == hf.config.image_token_id).int()  # the processor's mm_token_type_ids
    return hf.get_rope_index(ids, types, image_grid_thw=grids, attention_mask=mask)


CASES = {
    "text-only": [[13]],
    "one-image": [[5, (1, 4, 6), 4]],
    "two-images": [[3, (1, 4, 6), 2, (1, 8, 2), 5]],
    "image-first-t2": [[(2, 4, 4), 3]],
    "batch2-left-padded": [[4, (1, 6, 4), 3], [2, (1, 4, 4), 1, (1, 2, 8), 6]],
}


@pytest.mark.parametrize(("case", "with_mask"), [
    (case, with_mask) for case in CASES for with_mask in (True, False)
    if with_mask or len(CASES[case]) == 1])  # a left-padded batch needs its mask
def test_positions_equal_get_rope_index(hf, case, with_mask):
    ids, mask, grids = _batch(hf, CASES[case])
    if not with_mask:
        assert not bool((mask == 0).any())
        mask = None
    pos, deltas = mrope_positions(ids, grids, mask, **_ids(hf))
    want_pos, want_deltas = _hf_rope_index(hf, ids, grids, mask)
    assert pos.dtype == want_pos.dtype and torch.equal(pos, want_pos)
    assert torch.equal(deltas, want_deltas)


def test_text_after_an_image_resumes_after_its_largest_extent(hf):
    ids, _ = _prompt(hf, [2, (1, 4, 8), 1])  # 2 text, vision_start, 8 patches (2 x 4), end, 1
    pos, deltas = mrope_positions(torch.tensor([ids]), torch.tensor([[1, 4, 8]]), **_ids(hf))
    image = pos[:, 0, 3:11]
    assert image.tolist() == [[3] * 8, [3, 3, 3, 3, 4, 4, 4, 4], [3, 4, 5, 6, 3, 4, 5, 6]]
    assert pos[:, 0, 11:].tolist() == [[7, 8]] * 3  # 3 + max(2, 4), not 3 + 8
    assert deltas.tolist() == [[9 - 13]]


@pytest.mark.parametrize("case", ["one-image", "batch2-left-padded", "text-only"])
def test_decode_positions_continue_the_prompt(hf, case):
    """The next tokens' positions equal get_rope_index on the prompt plus those tokens, and the
    generate convention (the prompt's last position + 1, + 2, ...)."""
    ids, mask, grids = _batch(hf, CASES[case])
    pos, deltas = mrope_positions(ids, grids, mask, **_ids(hf))
    n = 3
    new = decode_positions(deltas, mask.sum(1), n)
    more = torch.cat([ids, torch.randint(1, 60, (ids.shape[0], n))], 1)
    full, _ = _hf_rope_index(hf, more, grids, torch.cat([mask, torch.ones_like(mask[:, :n])], 1))
    assert torch.equal(new, full[:, :, -n:])
    assert torch.equal(new, pos[:, :, -1:] + 1 + torch.arange(n))
    assert torch.equal(decode_positions(deltas[:1], int(mask[0].sum()), n), new[:, :1])


def _hf_tables(hf, pos, dtype=torch.float32):
    rot = hf.language_model.rotary_emb
    return rot(torch.zeros(1, dtype=dtype), pos)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tables_equal_transformers(hf, dtype):
    ids, mask, grids = _batch(hf, CASES["batch2-left-padded"])
    pos, _ = mrope_positions(ids, grids, mask, **_ids(hf))
    want_cos, want_sin = _hf_tables(hf, pos, dtype)
    inv_freq = hf.language_model.rotary_emb.inv_freq  # theirs: the same products, bit for bit
    cos, sin = mrope_cos_sin(pos, inv_freq, SECTION, dtype=dtype)
    assert cos.shape == (2, 1, ids.shape[1], 16)
    assert torch.equal(cos[:, 0], want_cos) and torch.equal(sin[:, 0], want_sin)
    ours = rope_frequencies(16, THETA, None)  # composer's fp64 frequencies: 1 ulp apart
    cos, sin = mrope_cos_sin(pos, ours, SECTION, dtype=dtype)
    tol = 1e-6 if dtype == torch.float32 else 8e-3
    assert (cos[:, 0].float() - want_cos.float()).abs().max() <= tol
    assert (sin[:, 0].float() - want_sin.float()).abs().max() <= tol


def test_rotated_queries_equal_transformers(hf):
    """composer's apply_rope with the M-RoPE tables rotates the first d_rot channels of a head
    as transformers' apply_rotary_pos_emb (partial rotary: the rest pass through)."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import apply_rotary_pos_emb

    ids, mask, grids = _batch(hf, CASES["two-images"])
    pos, _ = mrope_positions(ids, grids, mask, **_ids(hf))
    q = torch.randn(1, 2, ids.shape[1], 32, generator=torch.Generator().manual_seed(1))
    cos, sin = mrope_cos_sin(pos, hf.language_model.rotary_emb.inv_freq, SECTION)
    want, _ = apply_rotary_pos_emb(q, q, *_hf_tables(hf, pos))
    assert torch.equal(apply_rope(q, cos, sin), want)


def test_text_only_tables_are_composers_1d_rope(hf):
    ids, mask, _ = _batch(hf, [[9], [5]])  # row 1 left-padded by 4
    pos, deltas = mrope_positions(ids, None, mask, **_ids(hf))
    assert torch.equal(pos[0], pos[1]) and torch.equal(pos[0], pos[2]) and not deltas.any()
    inv_freq = rope_frequencies(16, THETA, None)
    for dtype in (torch.float32, torch.bfloat16):
        cos, sin = mrope_cos_sin(pos, inv_freq, SECTION, dtype=dtype)
        want_cos, want_sin = rope_cos_sin_at(pos[0], inv_freq, dtype)
        assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
        cos_t, sin_t = rope_cos_sin(9, inv_freq, torch.device("cpu"), dtype)  # Rotary.table
        assert torch.equal(cos[0, 0], cos_t) and torch.equal(sin[0, 0], sin_t)


def test_rows_of_the_two_layouts():
    assert mrope_rows(8, [3, 3, 2]).tolist() == [0, 1, 2, 0, 1, 2, 0, 1]
    assert mrope_rows(32, [11, 11, 10]).tolist() == [0, 1, 2] * 10 + [0, 1]  # Qwen3.5
    assert mrope_rows(8, [4, 2, 2], interleaved=False).tolist() == [0] * 4 + [1] * 2 + [2] * 2
    with pytest.raises(ValueError, match=r"^mrope_section \[3, 3, 3\] does not split the 8 "):
        mrope_rows(8, [3, 3, 3])
    with pytest.raises(ValueError, match=r"^mrope_section \[4, 4\] must have 3 entries"):
        mrope_rows(8, [4, 4])


def _error(hf, ids, grids):
    with pytest.raises(ValueError) as info:
        mrope_positions(torch.tensor([ids]), torch.tensor(grids), **_ids(hf))
    assert "\n" not in str(info.value)
    return str(info.value)


def test_placeholder_errors_name_the_image(hf):
    ids, grids = _prompt(hf, [2, (1, 4, 4), 3, (1, 4, 6), 1])
    img = hf.config.image_token_id
    short = ids[:12] + ids[13:]  # image 1 (6 tokens, from index 12) loses one
    assert _error(hf, short, grids) == ("image 1: 5 <|image_pad|> tokens in the prompt, its grid "
                                        "1x4x6 needs 6 (t*h*w / merge^2)")
    assert _error(hf, ids, grids + [[1, 2, 2]]) == (
        "image 2: no <|image_pad|> run left for it (3 images, 2 placeholder runs in the prompt)")
    assert _error(hf, ids, grids[:1]) == ("image 1: a run of 6 <|image_pad|> tokens but only 1 "
                                          "image(s) given (image_grid_thw has 1 rows)")
    bare = ids[:2] + [5] + ids[3:]  # image 0's vision_start replaced by text
    assert _error(hf, bare, grids) == (
        "image 0: its <|image_pad|> run does not follow a <|vision_start|>")
    assert _error(hf, ids[:3] + [img] * 3 + ids[7:], [[1, 3, 4]] + grids[1:]) == (
        "image 0: grid 1x3x4 is not a multiple of the merge size 2 in h and w")
    with pytest.raises(ValueError, match=r"^mrope_positions: videos are not supported yet"):
        mrope_positions(torch.tensor([ids]), torch.tensor(grids),
                        video_grid_thw=torch.tensor([[2, 4, 4]]), **_ids(hf))
