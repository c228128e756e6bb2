"""A layer kind registered from user code, with its own config section and its declared plan,
is known everywhere without editing a composer file: validation, YAML, ``--set`` overrides,
layout checks, the builder, the counts, ``composer build``, and tensor and data parallelism
(tp=2 and dp=2 equal to one process for eval loss, every gradient and three AdamW steps, from
the same initial weights: also for a kind that declares only ``reset_parameters``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import composer
from composer.blocks.plan import ONES, ZEROS, Divisible, Normal, ParallelPlan, init_module
from composer.build.registry import unregister
from composer.config import ConfigError, ModelConfig
from composer.parallel.launch import run_distributed
from tests.parallel.test_parallel import case, check_same, tokens


@dataclass
class MeanMixConfig:
    d_inner: int = 32
    decay_init: float = 1.0


def validate_mean_mix(section: MeanMixConfig, cfg: ModelConfig) -> None:
    if section.d_inner <= 0:
        raise ConfigError(f"meanmix.d_inner must be positive, got {section.d_inner}")


class MeanMix(nn.Module):
    """``out(silu(gate x) * causal_mean(value x) * scale)``: a toy token mixer (a user's)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int = 0) -> None:
        super().__init__()
        s = cfg.meanmix
        self.init_std, self.decay_init = cfg.init_std, s.decay_init
        self.gate = nn.Linear(cfg.d_model, s.d_inner, bias=True)
        self.value = nn.Linear(cfg.d_model, s.d_inner, bias=False)
        self.scale = nn.Parameter(torch.empty(s.d_inner))
        self.out = nn.Linear(s.d_inner, cfg.d_model, bias=True)

    def init_rules(self):
        return {"*.weight": Normal(self.init_std), "*.bias": ZEROS, "scale": ONES}

    def reset_parameters(self, generator=None):
        init_module(self, generator)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        v = self.value(x_BTD)
        steps = torch.arange(1, x_BTD.shape[1] + 1, dtype=v.dtype, device=v.device)
        mean = v.cumsum(1) / steps[:, None]
        return self.out(F.silu(self.gate(x_BTD)) * mean * self.scale)

    def parallel_plan(self) -> ParallelPlan:
        return ParallelPlan(colwise=("gate", "value"), rowwise=("out",), shard={"scale": 0})

    @staticmethod
    def layout_rules(cfg: ModelConfig):
        return [Divisible("meanmix.d_inner", cfg.meanmix.d_inner)]

    @staticmethod
    def flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
        return 2 * 3 * cfg.d_model * cfg.meanmix.d_inner


class LegacyMix(nn.Module):
    """A user mixer that declares no init rules, only ``reset_parameters(generator)``: the
    builder falls back to it, layout-independently."""

    def __init__(self, cfg: ModelConfig, layer_idx: int = 0) -> None:
        super().__init__()
        self.up = nn.Linear(cfg.d_model, 2 * cfg.d_model)
        self.down = nn.Linear(2 * cfg.d_model, cfg.d_model)

    def reset_parameters(self, generator=None):
        for linear in (self.up, self.down):
            nn.init.normal_(linear.weight, 0.0, 0.1, generator=generator)
            nn.init.uniform_(linear.bias, -0.1, 0.1, generator=generator)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))

    def parallel_plan(self) -> ParallelPlan:
        return ParallelPlan(colwise=("up",), rowwise=("down",))

    @staticmethod
    def flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
        return 2 * 4 * cfg.d_model ** 2


def register() -> None:
    composer.register("R", "causal mean mix", MeanMix, "meanmix", config=MeanMixConfig,
                      validate=validate_mean_mix)
    composer.register("L", "legacy mix", LegacyMix)


def unregister_all() -> None:
    unregister("R")
    unregister("L")


def cfg_dict() -> dict:
    cfg = ModelConfig.from_dict({"pattern": "R*R-L", "d_model": 32, "vocab_size": 61,
                                 "attention": {"n_heads": 4}, "mlp": {"d_ff": 64},
                                 "meanmix": {"d_inner": 48}})
    return cfg.canonical().to_dict()


def case_with_kind(*args):
    register()  # in each spawned rank: user code runs its registration at import
    try:
        return case(*args)
    finally:
        unregister_all()


@pytest.fixture
def registered():
    register()
    yield
    unregister_all()


def test_the_kind_is_known_everywhere(registered, capsys):
    cfg = ModelConfig.from_dict(cfg_dict())
    assert cfg.meanmix == MeanMixConfig(d_inner=48) and "meanmix" in cfg.to_dict()
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    composer.apply_overrides(cfg, ["meanmix.d_inner=-4"])
    with pytest.raises(ConfigError, match="meanmix.d_inner must be positive, got -4"):
        cfg.validate()
    with pytest.raises(ConfigError, match="unknown config key 'meanmx'"):
        ModelConfig.from_dict({**cfg_dict(), "meanmx": {}})
    cfg = ModelConfig.from_dict(cfg_dict())
    from composer.build.registry import REGISTRY

    kind = REGISTRY["R"]  # everything about the kind, one hop away
    assert kind.section_type is MeanMixConfig and kind.mixer is MeanMix
    assert kind.parallel_plan(cfg).rowwise == ("out",)
    assert kind.flops_per_token(cfg, 16) == 2 * 3 * 32 * 48
    assert [r.what for r in kind.layout_rules(cfg)] == ["meanmix.d_inner"]
    kind.validate(cfg)
    model = composer.build_model(cfg, seed=0)
    stats = composer.model_stats(model, seq_len=16)
    mixer_params = 32 * 48 + 48 + 32 * 48 + 48 + 48 * 32 + 32
    assert stats.params_by_kind["R causal mean mix"] == 2 * (mixer_params + 32)
    assert stats.params_by_kind["L legacy mix"] == 2 * 32 * 64 + 64 + 32 + 32
    assert stats.forward_flops_per_token > 2 * 2 * 3 * 32 * 48
    ids = torch.randint(0, 61, (2, 8))
    assert model(ids).shape == (2, 8, 61)
    from composer.build.builder import check_model
    from composer.parallel.mesh import LayoutError, ParallelConfig, resolve_layout

    with pytest.raises(LayoutError, match=r"meanmix.d_inner \(48\) is not divisible by tp \(5\)"):
        check_model(resolve_layout(ParallelConfig(tp=5), 5), cfg)
    from composer.cli import main

    assert main(["build", "--pattern", "R-", "--set", "meanmix.d_inner=8",
                              "--json"]) == 0
    assert '"R": 1' in capsys.readouterr().out
    unregister_all()
    with pytest.raises(ValueError, match="invalid symbol"):
        composer.parse_pattern("R*")
    register()


@pytest.mark.slow
def test_tp2_equals_one_process():
    register()
    try:
        config = cfg_dict()
        reference = case({}, config, tokens(), 3)
    finally:
        unregister_all()
    for layout in ({"tp": 2}, {"dp": 2}):
        for got in run_distributed(case_with_kind, 2, layout, config, tokens(), 3):
            check_same(got, reference)
    assert math.isfinite(reference["eval"])
