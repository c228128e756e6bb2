"""Parallel groups (``[M*]``, composer/blocks/group.py): a group layer equals its branches called
on the same normed input with their multipliers, summed (fp64); the group is one layer for
counts and FLOPs; packed documents equal documents alone; cached decoding equals the full
forward; MoE branches are refused; tp=2, pp=2 and cp=2 equal one process (fp64, gloo)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import composer
from composer.config import ConfigError, ModelConfig
from tests.helpers import randomize

F64 = torch.float64
SIZES = {"d_model": 32, "vocab_size": 61, "attention": {"n_heads": 4, "n_kv_heads": 2},
         "mlp": {"d_ff": 64}, "mamba": {"d_state": 8, "d_head": 8, "n_groups": 2,
                                        "chunk_size": 4}}
SCALES = {"branches": [{"symbol": "M", "in_multiplier": 0.5, "out_multiplier": 1.25},
                       {"symbol": "*", "in_multiplier": 2.0, "out_multiplier": 0.75}]}


def cfg_dict(pattern: str = "[M*]-[M*]-", scales: bool = True) -> dict:
    return {"pattern": pattern, **SIZES, **({"parallel": SCALES} if scales else {})}


def _model(pattern: str = "[M*]-[M*]-", dtype: torch.dtype = F64) -> composer.HybridModel:
    model = composer.build_model(ModelConfig.from_dict(cfg_dict(pattern)), seed=0)
    randomize(model, seed=3)
    return model.to(dtype).eval()


def test_the_group_is_its_branches_summed_with_their_multipliers() -> None:
    """``x + 1.25 * M(0.5 * norm(x)) + 0.75 * attn(2 * norm(x))`` with the branches' own
    modules, and the keys ``layers.i.mixer.{0,1}.*`` (fp64, 1e-12)."""
    model = _model()
    layer = model.layers["0"]
    x = torch.randn(2, 9, 32, dtype=F64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        h = layer.norm(x)
        want = x + 1.25 * layer.mixer[0](0.5 * h) + 0.75 * layer.mixer[1](2.0 * h)
        torch.testing.assert_close(layer(x), want, rtol=1e-12, atol=1e-12)
    keys = model.state_dict()
    assert "layers.0.mixer.0.in_proj.weight" in keys and "layers.0.mixer.1.q_proj.weight" in keys
    assert not any(k.startswith("layers.0.mixer.2") for k in keys)


def test_one_layer_for_counts_and_flops() -> None:
    cfg = ModelConfig.from_dict(cfg_dict())
    stats = composer.model_stats(composer.build_model(cfg, device="meta"), 256)
    assert stats.n_layers == 4 and stats.layer_counts == {"[M*]": 2, "-": 2}
    alone = ModelConfig.from_dict(cfg_dict("M*-M*-", scales=False))
    split = composer.model_stats(composer.build_model(alone, device="meta"), 256)
    # the weights of M * - M * - less one norm per group; their FLOPs summed
    assert stats.n_params == split.n_params - 2 * 32
    assert stats.flops_per_token == split.flops_per_token
    assert "[M*] parallel Mamba-2 + attention" in stats.params_by_kind


def test_packed_documents_equal_documents_alone() -> None:
    model = _model()
    docs = torch.tensor([[0, 0, 0, 0, 1, 1, 2, 2, 2, 2, 2], [5, 6, 6, 6, 6, 6, 6, 6, 6, 7, 7]])
    ids = torch.randint(0, 61, (2, 11), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        packed = model(ids, doc_ids=docs)
        for r in range(2):
            for d in docs[r].unique():
                cols = (docs[r] == d).nonzero()[:, 0]
                alone = model(ids[r:r + 1, cols])
                torch.testing.assert_close(packed[r:r + 1, cols], alone, rtol=1e-10, atol=1e-10)


def test_decoding_with_a_cache_equals_the_full_forward() -> None:
    """A left-padded prefill then one token per call (fp64, 1e-10); the group's state is one
    entry per branch."""
    model = _model()
    ids = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(5))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, :3] = 0
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache(2, 12)
        got = [model.forward_cached(ids[:, :7], cache, attention_mask=mask, last_only=False)]
        got += [model.forward_cached(ids[:, t:t + 1], cache, last_only=False)
                for t in range(7, 12)]
        alone = model(ids[1:, 3:])
    got = torch.cat(got, 1)
    torch.testing.assert_close(got[0], full[0], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(got[1, 3:], alone[0], rtol=1e-10, atol=1e-10)
    state = cache.layers[0]
    assert isinstance(state, tuple) and len(state) == 2 and 1 not in cache.layers  # '-' keeps none


def test_a_group_of_token_wise_branches_is_stateless_and_moe_is_refused() -> None:
    cfg = ModelConfig.from_dict({**cfg_dict("[*-]-", scales=False)})
    model = composer.build_model(cfg, seed=0)
    assert composer.generate(model, torch.tensor([[1, 2, 3]]), 2).shape == (1, 5)
    with pytest.raises(ConfigError, match=r"'\[ME\]'.*'E' \(routed experts\)"):
        composer.build_model(ModelConfig.from_dict(cfg_dict("[ME]", scales=False)), device="meta")
    with pytest.raises(ConfigError, match="parallel.branches: 'Q' is not a layer symbol"):
        ModelConfig.from_dict(cfg_dict() | {"parallel": {"branches": [{"symbol": "Q"}]}}).validate()


# ---------------------------------------------------------------- tp=2, pp=2, cp=2: gloo ranks

PARALLEL_CFG = cfg_dict("[M*]-[M*]-")
DATA = np.random.default_rng(0).integers(0, 61, (8, 16))


def _in_ranks() -> dict:
    from tests.helpers import layout_case

    return {name: layout_case(layout, PARALLEL_CFG, DATA, fp64=True)
            for name, layout in (("tp2", {"tp": 2}), ("pp2", {"pp": 2}), ("cp2", {"cp": 2}))}


@pytest.mark.slow
def test_tp2_pp2_cp2_equal_one_process_fp64() -> None:
    """The eval loss, every gradient and three AdamW steps (one spawn of two gloo ranks)."""
    from composer.parallel.launch import run_distributed
    from tests.helpers import layout_case

    ranks = run_distributed(_in_ranks, 2)
    ref = layout_case({}, PARALLEL_CFG, DATA, fp64=True)
    for name in ("tp2", "pp2", "cp2"):
        got = ranks[0][name]
        assert abs(got["eval"] - ref["eval"]) < 1e-10, name
        assert np.allclose(got["losses"], ref["losses"], rtol=1e-10, atol=0), name
        for part in ("grads", "params"):  # a pipeline rank holds its stage's (both: the tied)
            held = {**ranks[1][name][part], **got[part]}
            assert held.keys() == ref[part].keys(), (name, part)
            for k, want in ref[part].items():
                err = float((held[k] - want).abs().max())
                assert err < 1e-10, (name, part, k, err)
