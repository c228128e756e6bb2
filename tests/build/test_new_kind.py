"""A new sequence-mixer kind from one file, with no composer file edited.

This module is all of it: a config section (``ema``), a time-mixing op with a recurrent state
(an exponential moving average ``h_t = a_t h_{t-1} + (1 - a_t) u_t`` per channel, with its
decoding step and its context-parallel contract: a :class:`LinearRecurrence`, so it reuses the
``state_passing`` variant; its short convolution is the built-in ``CausalConv`` op, reusing
``halo_conv``), a mixer around them, and one :class:`LayerKind` record. Registered, the kind
builds, validates, counts, trains two steps with the training engine, decodes with a cache
exactly as the full forward computes, and runs at cp=2 and tp=2 exactly as one process does
(fp64: eval loss, every gradient, two AdamW steps).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import composer
from composer.blocks.cache import Step, recurrent_state
from composer.blocks.kind import LayerKind
from composer.blocks.ops import CausalConv, LinearRecurrence, keep_mask, step_docs
from composer.blocks.plan import ZEROS, Constant, Divisible, Normal, ParallelPlan
from composer.blocks.split import SplitCausalConv1d
from composer.build.registry import unregister
from composer.config import ConfigError, ModelConfig, positive
from composer.parallel.launch import run_distributed
from tests.parallel.test_parallel import case, check_same

# ---------------------------------------------------------------- the kind, in one file


@dataclass
class EMAConfig:
    d_inner: int = 32
    d_conv: int = 3
    decay_init: float = 2.0
    """Initial decay bias: ``a = sigmoid(a_proj(x) + bias)`` starts near ``sigmoid(2)``."""


def validate_ema(section: EMAConfig, cfg: ModelConfig) -> None:
    positive(section, "ema.", ("d_inner", "d_conv"))


class EMAScan(LinearRecurrence):
    """``h_t = a_t h_{t-1} + (1 - a_t) u_t`` per channel; the state restarts at a document.
    Over a span ``h_end = (prod a) h_start + h_local``: ``carry(M, S) = M * S``."""

    def forward(self, u_BTE: torch.Tensor, a_BTE: torch.Tensor, *,
                doc_ids: torch.Tensor | None = None, initial_state: torch.Tensor | None = None,
                step: Step | None = None) -> torch.Tensor:
        math = torch.promote_types(u_BTE.dtype, torch.float32)
        h_BE = initial_state
        if step is not None and not step.fresh:
            h_BE = step.state.state
        if h_BE is None:
            h_BE = u_BTE.new_zeros(u_BTE.shape[0], u_BTE.shape[2], dtype=math)
        carry_BTE = self._carry(a_BTE, step_docs(doc_ids, step))
        ys = []
        for t in range(u_BTE.shape[1]):
            h_BE = carry_BTE[:, t] * h_BE + (1 - a_BTE[:, t]) * u_BTE[:, t]
            ys.append(h_BE)
        if step is not None:
            step.state.state.copy_(h_BE)
        return torch.stack(ys, 1).to(u_BTE.dtype)

    @staticmethod
    def _carry(a_BTE: torch.Tensor, doc_ids: torch.Tensor | None) -> torch.Tensor:
        """What each step keeps of the state before it: ``a``, or 0 at a document's start."""
        if doc_ids is None:
            return a_BTE
        starts = F.pad(doc_ids[:, 1:] != doc_ids[:, :-1], (1, 0), value=False)
        return a_BTE.masked_fill(starts[..., None], 0.0)

    def end_state(self, u_BTE: torch.Tensor, a_BTE: torch.Tensor, *,
                  doc_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        local = self(u_BTE, a_BTE, doc_ids=doc_ids)[:, -1]
        return local, self._carry(a_BTE, doc_ids).prod(dim=1)

    @staticmethod
    def carry(M: torch.Tensor, S: torch.Tensor) -> torch.Tensor:
        return M * S

    def mask_steps(self, tokens: Sequence[torch.Tensor],
                   keep_BT: torch.Tensor) -> tuple[torch.Tensor, ...]:
        u_BTE, a_BTE = tokens
        keep = keep_mask(keep_BT, u_BTE)
        return u_BTE * keep, torch.where(keep.bool(), a_BTE, torch.ones_like(a_BTE))


class EMAMixer(nn.Module):
    """``out(ema(silu(conv(u(x))), sigmoid(a(x) + bias)) * silu(z(x)))``."""

    uses_doc_ids = True
    ops = ("conv", "scan")

    def __init__(self, cfg: ModelConfig, layer_idx: int = 0) -> None:
        super().__init__()
        s = cfg.ema
        self.init_std, self.decay_init, self.d_conv = cfg.init_std, s.decay_init, s.d_conv
        self.u_proj = nn.Linear(cfg.d_model, s.d_inner, bias=False)
        self.a_proj = nn.Linear(cfg.d_model, s.d_inner, bias=False)
        self.z_proj = nn.Linear(cfg.d_model, s.d_inner, bias=False)
        self.conv1d = SplitCausalConv1d({"u": s.d_inner}, s.d_conv, bias=True)
        self.decay_bias = nn.Parameter(torch.empty(s.d_inner))
        self.out_proj = nn.Linear(s.d_inner, cfg.d_model, bias=True)
        self.conv, self.scan = CausalConv(), EMAScan()

    def init_rules(self):
        return {"*_proj.weight": Normal(self.init_std), "out_proj.bias": ZEROS,
                "decay_bias": Constant(self.decay_init)}

    def forward(self, x_BTD: torch.Tensor, *, doc_ids: torch.Tensor | None = None,
                step: Step | None = None) -> torch.Tensor:
        u_BTE = self.conv(self.u_proj(x_BTD), self.conv1d, doc_ids=doc_ids, step=step)
        a_BTE = torch.sigmoid(self.a_proj(x_BTD) + self.decay_bias)
        h_BTE = self.scan(u_BTE, a_BTE, doc_ids=doc_ids, step=step)
        return self.out_proj(h_BTE * F.silu(self.z_proj(x_BTD)))

    def init_cache(self, batch: int, max_len: int, device: torch.device, dtype: torch.dtype):
        e = self.u_proj.weight.shape[0]  # this rank's channels
        return recurrent_state(batch, e, self.d_conv, (e,), device, dtype)

    def parallel_plan(self) -> ParallelPlan:
        return ParallelPlan(colwise=("u_proj", "a_proj", "z_proj"), rowwise=("out_proj",),
                            shard={"conv1d.*": 0, "decay_bias": 0})

    @staticmethod
    def layout_rules(cfg: ModelConfig):
        return [Divisible("ema.d_inner", cfg.ema.d_inner)]

    @staticmethod
    def flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
        e = cfg.ema.d_inner
        return 2 * 4 * cfg.d_model * e + 2 * e * cfg.ema.d_conv + 4 * e


KIND = LayerKind("Q", "moving average", EMAMixer, "ema", EMAConfig, validate_ema,
                 halo=lambda cfg: cfg.ema.d_conv - 1)

# ---------------------------------------------------------------- the checks

PATTERN = "Q*Q-"


def cfg_dict(pattern: str = PATTERN) -> dict:
    return {"pattern": pattern, "d_model": 32, "vocab_size": 61, "attention": {"n_heads": 4},
            "mlp": {"d_ff": 64}, "ema": {"d_inner": 48}}


@pytest.fixture
def registered():
    composer.register(KIND)
    yield
    unregister("Q")


def test_builds_validates_and_counts(registered, capsys):
    from composer.build.builder import check_model
    from composer.build.registry import REGISTRY
    from composer.parallel.context import check_cp_length
    from composer.parallel.mesh import LayoutError, ParallelConfig, resolve_layout

    cfg = ModelConfig.from_dict(cfg_dict())
    assert cfg.ema == EMAConfig(d_inner=48) and ModelConfig.from_dict(cfg.to_dict()) == cfg
    assert ModelConfig(pattern="Q-").ema == EMAConfig()  # the section comes with the symbol
    with pytest.raises(ConfigError, match="ema.d_conv must be positive, got 0"):
        composer.apply_overrides(ModelConfig.from_dict(cfg_dict()), ["ema.d_conv=0"]).validate()
    kind = REGISTRY["Q"]
    assert kind.context_strategy(cfg) == ("halo_conv", "state_passing")
    assert kind.decoding_state is EMAMixer.init_cache and kind.halo_width(cfg) == 2
    with pytest.raises(LayoutError, match=r"ema.d_inner \(48\) is not divisible by tp \(5\)"):
        check_model(resolve_layout(ParallelConfig(tp=5), 5), cfg)
    with pytest.raises(LayoutError, match="shorter than the ema convolution's halo of 2"):
        check_cp_length(cfg, 8, 16)
    stats = composer.model_stats(composer.build_model(cfg, device="meta"), seq_len=16)
    mixer = 4 * 32 * 48 + 48 * 3 + 48 + 48 + 32
    assert stats.params_by_kind["Q moving average"] == 2 * (mixer + 32)
    assert stats.layer_counts == {"Q": 2, "*": 1, "-": 1}
    from composer.cli import main

    assert main(["build", "--pattern", "Q-", "--set", "ema.d_inner=8", "--json"]) == 0
    assert '"Q": 1' in capsys.readouterr().out


@pytest.mark.slow
def test_trains_two_steps(registered, tmp_path):
    from tests.helpers import train_case

    sections = {**cfg_dict(), "vocab_size": 257}  # the built-in corpus's byte tokenizer
    del sections["pattern"]
    out = train_case({"model": {"pattern": PATTERN, "set": sections},
                      "steps": 2, "seq_len": 16, "global_batch_size": 4, "lr": 1e-2,
                      "save": str(tmp_path / "run")})
    assert len(out["losses"]) == 2 and all(np.isfinite(out["losses"]))
    assert any(k.startswith("layers.0.mixer.conv1d") for k in out["params"])


def test_decoding_with_a_cache_equals_the_full_forward(registered):
    cfg = ModelConfig.from_dict(cfg_dict())
    model = composer.build_model(cfg, seed=0, dtype=torch.float64).eval()
    ids = torch.randint(0, 61, (2, 11))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, :3] = 0  # left padding in the second row
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache(2, 11)
        got = [model.forward_cached(ids[:, :8], cache, attention_mask=mask, last_only=False)]
        got += [model.forward_cached(ids[:, t:t + 1], cache, last_only=False)
                for t in range(8, 11)]
        alone = model(ids[1:, 3:])  # the padded row's prompt and tokens, on their own
    got = torch.cat(got, 1)
    torch.testing.assert_close(got[0], full[0], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(got[1, 3:], alone[0], rtol=1e-10, atol=1e-10)


def case_with_kind(*args):
    composer.register(KIND)  # in each spawned rank: user code registers at import
    try:
        return case(*args)
    finally:
        unregister("Q")


@pytest.mark.slow
def test_tp2_and_cp2_equal_one_process(registered):
    data = np.random.default_rng(0).integers(0, 61, (8, 16))
    reference = case({}, cfg_dict(), data, 2, True)
    for layout in ({"tp": 2}, {"cp": 2}):
        for got in run_distributed(case_with_kind, 2, layout, cfg_dict(), data, 2, True):
            check_same(got, reference, tol=1e-10, loss_tol=1e-10)
