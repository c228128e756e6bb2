"""Shared layers (``{a:T}`` / ``{a}``, composer/blocks/shared.py): stored once and counted once;
the model equals its unshared twin holding copies, and the shared gradient equals the sum of
the copies' gradients (fp64); a kind's ``shared_part`` shares only that submodule; each use
decodes with its own state; tp=2, pp=2 (the uses on both stages), cp=2 and dp=2 equal one
process (fp64, gloo)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import composer
from composer.build.registry import unregister
from composer.config import ModelConfig
from tests.helpers import randomize

F64 = torch.float64
SIZES = {"d_model": 32, "vocab_size": 61, "attention": {"n_heads": 4, "n_kv_heads": 2},
         "mlp": {"d_ff": 64}, "mamba": {"d_state": 8, "d_head": 8, "n_groups": 2,
                                        "chunk_size": 4}}


def _model(pattern: str, seed: int = 3) -> composer.HybridModel:
    model = composer.build_model(ModelConfig.from_dict({"pattern": pattern, **SIZES}), seed=0)
    randomize(model, seed=seed)
    return model.to(F64)


def _twin(shared: composer.HybridModel, pattern: str) -> composer.HybridModel:
    """The unshared model of ``pattern`` holding a copy of each shared layer at each use."""
    twin = _model(pattern)
    state = {k: v for k, v in shared.state_dict().items() if not k.startswith("shared.")}
    for label, uses in shared.config.parsed.shared_uses().items():
        for k, v in shared.shared[label].state_dict().items():
            state |= {f"layers.{i}.{k}": v for i in uses}
    twin.load_state_dict(state, strict=True)
    return twin


def test_stored_once_counted_once_and_the_gradient_is_the_sum_over_uses() -> None:
    pattern, flat = "{a:*}-{b:[M*]}{a}-{b}", "*-[M*]*-[M*]"
    model = _model(pattern)
    keys = set(model.state_dict())
    assert {"shared.a.norm.weight", "shared.a.mixer.q_proj.weight",
            "shared.b.mixer.0.in_proj.weight", "shared.b.mixer.1.o_proj.weight"} <= keys
    assert not any(k.startswith(("layers.0.", "layers.2.", "layers.3.", "layers.5."))
                   for k in keys)
    twin = _twin(model, flat)
    per_layer = {i: sum(p.numel() for p in twin.layers[str(i)].parameters()) for i in range(6)}
    stats = composer.model_stats(model, 64)
    assert stats.n_params == composer.model_stats(twin, 64).n_params - per_layer[3] - per_layer[5]
    assert stats.params_by_kind["shared a (*, 2 uses)"] == per_layer[0]
    assert stats.flops_per_token == composer.model_stats(twin, 64).flops_per_token
    ids = torch.randint(0, 61, (2, 10), generator=torch.Generator().manual_seed(1))
    docs = torch.tensor([[0] * 4 + [1] * 6, [2] * 10])
    for m in (model, twin):
        m(ids, ids, doc_ids=docs).loss.backward()
    torch.testing.assert_close(model(ids, doc_ids=docs), twin(ids, doc_ids=docs),
                               rtol=1e-12, atol=1e-12)
    for label, uses in model.config.parsed.shared_uses().items():
        for name, p in model.shared[label].named_parameters():
            want = sum(twin.get_parameter(f"layers.{i}.{name}").grad for i in uses)
            torch.testing.assert_close(p.grad, want, rtol=1e-10, atol=1e-12)
    for name, p in model.layers.named_parameters():  # the layers of their own: as the twin's
        torch.testing.assert_close(p.grad, twin.layers.get_parameter(name).grad)


def test_each_use_decodes_with_its_own_state() -> None:
    model = _model("{a:*}M{a}-{m:M}{m}").eval()
    ids = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache(2, 12)
        got = [model.forward_cached(ids[:, :7], cache, last_only=False)]
        got += [model.forward_cached(ids[:, t:t + 1], cache, last_only=False)
                for t in range(7, 12)]
    torch.testing.assert_close(torch.cat(got, 1), full, rtol=1e-10, atol=1e-10)
    assert cache.layers[0] is not cache.layers[2] and cache.layers[4] is not cache.layers[5]


class _Scaled(nn.Module):
    """A test kind: ``scale * core(x)`` with ``core`` shared and ``scale`` each use's own."""

    shared_part = "core"
    stateless = True

    def __init__(self, cfg: ModelConfig, layer_idx: int = 0) -> None:
        super().__init__()
        self.core = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.scale = nn.Parameter(torch.ones(cfg.d_model))

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        return self.scale * self.core(x_BTD)

    @staticmethod
    def flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
        return 2 * cfg.d_model ** 2

    def init_rules(self) -> dict:
        from composer.blocks.plan import Constant, Normal

        return {"core.weight": Normal(0.02), "scale": Constant(1.0)}


def test_a_kinds_shared_part_is_shared_and_the_rest_is_each_uses_own() -> None:
    composer.register("Y", "scaled linear", _Scaled)
    try:
        model = composer.build_model(ModelConfig.from_dict({"pattern": "{s:Y}-{s}", **SIZES}))
        keys = set(model.state_dict())
        assert {"shared.s.weight", "layers.0.mixer.scale", "layers.2.mixer.scale",
                "layers.0.norm.weight", "layers.2.norm.weight"} <= keys
        assert not any(k.endswith("core.weight") for k in keys)
        assert model.layers["0"].mixer.core is model.layers["2"].mixer.core is model.shared.s
        twin = composer.build_model(ModelConfig.from_dict({"pattern": "Y-Y", **SIZES}))
        state = {k: v for k, v in model.state_dict().items() if not k.startswith("shared.")}
        state |= {f"layers.{i}.mixer.core.weight": model.shared.s.weight for i in (0, 2)}
        twin.load_state_dict(state, strict=True)
        with torch.no_grad():
            model.layers["2"].mixer.scale.mul_(1.5)  # the uses' own parts differ
            twin.layers["2"].mixer.scale.mul_(1.5)
        ids = torch.randint(0, 61, (2, 6), generator=torch.Generator().manual_seed(2))
        for m in (model, twin):
            m(ids, ids).loss.backward()
        want = sum(twin.get_parameter(f"layers.{i}.mixer.core.weight").grad for i in (0, 2))
        torch.testing.assert_close(model.shared.s.weight.grad, want)
        for i in (0, 2):
            torch.testing.assert_close(model.layers[str(i)].mixer.scale.grad,
                                       twin.layers[str(i)].mixer.scale.grad)
    finally:
        unregister("Y")


# ---------------------------------------------------------------- tp=2, pp=2, cp=2, dp=2

PARALLEL_CFG = {"pattern": "{a:*}-{m:M}|{a}-{m}-", **SIZES}  # pp=2: both stages use a and m
DATA = np.random.default_rng(0).integers(0, 61, (8, 16))
LAYOUTS = (("tp2", {"tp": 2}), ("pp2", {"pp": 2}), ("cp2", {"cp": 2}),
           ("dp2", {"dp": 2, "dp_mode": "shard"}))


def _in_ranks() -> dict:
    from tests.helpers import layout_case

    return {name: layout_case(layout, PARALLEL_CFG, DATA, fp64=True) for name, layout in LAYOUTS}


@pytest.mark.slow
def test_tp2_pp2_cp2_dp2_equal_one_process_fp64() -> None:
    """The eval loss, every gradient and three AdamW steps; under pp=2 both stages use both
    shared layers (each holds a copy, their gradients summed)."""
    from composer.parallel.launch import run_distributed
    from tests.helpers import layout_case

    ranks = run_distributed(_in_ranks, 2)
    ref = layout_case({}, PARALLEL_CFG, DATA, fp64=True)
    for name, _ in LAYOUTS:
        got = ranks[0][name]
        assert abs(got["eval"] - ref["eval"]) < 1e-10, name
        assert np.allclose(got["losses"], ref["losses"], rtol=1e-10, atol=0), name
        for part in ("grads", "params"):
            held = {**ranks[1][name][part], **got[part]}
            assert held.keys() == ref[part].keys(), (name, part)
            for k, want in ref[part].items():
                err = float((held[k] - want).abs().max())
                assert err < 1e-10, (name, part, k, err)
