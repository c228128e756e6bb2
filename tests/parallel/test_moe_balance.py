"""MoE balancing and capacity under parallelism (gloo): the aux-loss-free bias after three steps
equals one process's at ep=2, dp=2 and tp=2 x ep=2 (bit for bit: the loads are integers summed
over the global batch), also with the global-batch and sequence-wise balance losses on (ep=2,
dp=2, tp=2) and with capacity at tp=2, and resumes exactly through the training engine at ep=2;
token dropping under ep=2 drops exactly the assignments of the rule applied to each rank's own
tokens; the overlapped (two-chunk) dispatch computes what the plain one does."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from composer.config import ModelConfig
from composer.parallel.launch import run_distributed
from tests.helpers import train_case

ROOT = str(Path(__file__).resolve().parents[2])
if ROOT not in sys.path:  # spawned ranks unpickle this module's functions by name
    sys.path.insert(0, ROOT)

pytestmark = pytest.mark.slow  # every test here spawns ranks or processes

MOE = {"n_experts": 4, "top_k": 2, "d_ff": 16, "score_func": "sigmoid",
       "score_correction_bias": True, "bias_update_rate": 0.01, "n_shared_experts": 1}


def cfg_dict(**moe: Any) -> dict:
    return {"pattern": "*EE", "d_model": 32, "vocab_size": 61, "init_std": 0.1,
            "attention": {"n_heads": 4, "n_kv_heads": 2}, "mamba": None, "mlp": None,
            "moe": {**MOE, **moe}}


VARIANTS: dict[str, dict[str, Any]] = {
    # the three balance losses together: global-batch loads, per-sequence statistics
    "losses": {"aux_loss_coeff": 0.01, "aux_loss_scope": "global_batch",
               "seq_aux_loss_coeff": 0.01},
    # capacity is decided per forward: one process equals layouts without data parallel
    "capacity": {"capacity_factor": 1.0},
}
"""Model variants checked at the layouts ``LAYOUTS_2`` name (beside the plain one)."""
LAYOUTS_2 = {"ep2": ("plain", {"ep": 2}), "dp2": ("plain", {"dp": 2}),
             "ep2-overlap": ("plain", {"ep": 2, "ep_overlap": True}),
             "ep2-losses": ("losses", {"ep": 2}), "dp2-losses": ("losses", {"dp": 2}),
             "tp2-losses": ("losses", {"tp": 2}), "tp2-capacity": ("capacity", {"tp": 2})}


def tokens() -> np.ndarray:
    return np.random.default_rng(0).integers(0, 61, (8, 16))


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def bias_case(layout: dict, cfg: dict, data: np.ndarray, steps: int = 3) -> dict:
    """fp64 AdamW steps with the bias update after each; the biases after every step."""
    from composer.parallel.expert import finish_moe_step
    from composer.parallel.mesh import ParallelConfig, build_parallel_dims
    from composer.run import build_sharded
    from tests.helpers import adamw_steps

    dims = build_parallel_dims(ParallelConfig(**layout))
    model = build_sharded(ModelConfig.from_dict(cfg), dims, seed=7, dtype=torch.float64)
    history: list[dict[str, torch.Tensor]] = []

    def on_step(step: int, loss: float) -> None:
        finish_moe_step(model, dims)
        history.append({k: v.clone() for k, v in model.named_buffers() if "score_bias" in k})

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    result = adamw_steps(model, dims, opt, list(data), steps, batch_size=4, seed=3,
                         on_step=on_step)
    params = {k: _whole(p.detach()).clone() for k, p in model.named_parameters()}
    return {"history": history, "losses": result.losses, "params": params}


def check_bias_case(got: dict, ref: dict) -> None:
    assert len(got["history"]) == len(ref["history"]) == 3
    for mine, theirs in zip(got["history"], ref["history"], strict=True):
        assert mine.keys() == theirs.keys() and len(mine) == 2
        for k in mine:
            assert torch.equal(mine[k], theirs[k]), k  # fp64 here: kept names stay >= fp32
    assert np.allclose(got["losses"], ref["losses"], rtol=1e-10, atol=0)
    for k, v in ref["params"].items():
        torch.testing.assert_close(got["params"][k], v, rtol=1e-9, atol=1e-12)


@pytest.fixture(scope="module")
def references() -> dict[str, dict]:
    out = {name: bias_case({}, cfg_dict(**kw), tokens())
           for name, kw in {"plain": {}, **VARIANTS}.items()}
    # the rule moved every bias each step (a balanced expert would stay put)
    last = out["plain"]["history"][-1]
    assert all((v != 0).all() for v in last.values()), last
    return out


# ---------------------------------------------------------------- capacity under ep

D = 16


def capacity_moe(capacity_factor: float | None, seed: int = 0):
    from composer.blocks.moe import MoE
    from composer.config import MoEConfig

    moe_cfg = MoEConfig(n_experts=4, top_k=2, d_ff=12, capacity_factor=capacity_factor,
                        score_func="sigmoid", score_correction_bias=True, n_shared_experts=1)
    cfg = ModelConfig(pattern="E", d_model=D, init_std=0.3, attention=None, mamba=None,
                      moe=moe_cfg).validate()
    moe = MoE(cfg)
    gen = torch.Generator().manual_seed(seed)
    moe.reset_parameters(gen)
    moe.router.score_bias.copy_(torch.tensor([0.3, 0.2, 0.0, -0.1]))  # experts 0, 1 crowded
    return moe.double(), cfg


def rank_tokens(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + rank)
    n = 9 + 3 * rank
    return (torch.randn(1, n, D, generator=gen, dtype=torch.float64),
            torch.randn(1, n, D, generator=gen, dtype=torch.float64))


def capacity_under_ep() -> dict[str, Any]:
    """EP forward/backward with capacity against, per rank, the single-process MoE on that
    rank's own tokens (capacity is a per-rank decision); expert gradients summed over ranks."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from composer.blocks.moe import capacity, drop_ref, moe_ref, router_ref
    from composer.parallel.expert import apply_ep

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))
    me = dist.get_rank()
    out: dict[str, Any] = {}
    for name, factor in (("small", 0.5), ("large", 2.0)):
        ref, cfg = capacity_moe(factor)
        ref_grads = None
        for r in range(2):  # every rank's share, each on its own
            x_r, w_r = rank_tokens(r)
            ref.zero_grad()
            y_r = ref(x_r)
            (y_r * w_r).sum().backward()
            grads = {k: p.grad.clone() for k, p in ref.named_parameters()}
            ref_grads = grads if ref_grads is None else {k: ref_grads[k] + g
                                                         for k, g in grads.items()}
            if r == me:
                y_ref = y_r
        x, w = rank_tokens(me)
        n = x.shape[1]
        w_NE = router_ref(x[0], ref.router.weight, cfg.moe, ref.router.score_bias)
        kept_NE = drop_ref(w_NE, capacity(cfg.moe, n))
        dropless, _ = capacity_moe(None)
        moe, _ = capacity_moe(factor)
        apply_ep(moe, mesh)
        y = moe(x)
        (y * w).sum().backward()
        errs = {"y": (y - y_ref).abs().max().item(),
                "y_rule": (y - moe_ref(x, {k: v.detach() for k, v in ref.state_dict().items()},
                                       cfg)).abs().max().item(),
                "y_dropless": (y - dropless(x)).abs().max().item()}
        for k, p in moe.named_parameters():
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad.clone()
            if not hasattr(p.grad, "full_tensor"):
                dist.all_reduce(g)
            errs[k] = (g - ref_grads[k]).abs().max().item()
        out[name] = {"errs": errs, "dropped": int(((w_NE > 0) & (kept_NE == 0)).sum())}
    return out


def overlap_under_ep() -> dict[str, float]:
    """The overlapped dispatch (two chunks) against the plain one on the same tokens, dropless
    and with capacity: largest differences of the output and of every gradient."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from composer.parallel import expert

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))
    x, w = rank_tokens(dist.get_rank())
    a2a = expert.funcol.all_to_all_single_autograd
    calls: list[int] = []

    def counted(t: torch.Tensor, *args: Any) -> torch.Tensor:
        calls.append(t.shape[0])
        return a2a(t, *args)

    out: dict[str, Any] = {}
    expert.funcol.all_to_all_single_autograd = counted
    try:
        for name, factor in (("dropless", None), ("capacity", 0.5)):
            runs = []
            for chunks in (1, 2):
                moe, _ = capacity_moe(factor)
                expert.apply_ep(moe, mesh, chunks=chunks)
                xr = x.clone().requires_grad_()
                calls.clear()
                y = moe(xr)
                out[f"{name}/sent {chunks}"] = calls[:chunks]  # the dispatches come first
                (y * w).sum().backward()
                runs.append([y, xr.grad] + [_whole(p.grad) for p in moe.parameters()])
            out[name] = max((a - b).abs().max().item() / b.abs().max().clamp_min(1e-30).item()
                            for a, b in zip(*runs, strict=True))
    finally:
        expert.funcol.all_to_all_single_autograd = a2a
    return out


def two_ranks(tmp: str) -> dict[str, Any]:
    out: dict[str, Any] = {
        name: bias_case(layout, cfg_dict(**VARIANTS.get(variant, {})), tokens())
        for name, (variant, layout) in LAYOUTS_2.items()}
    out["capacity"] = capacity_under_ep()
    out["overlap"] = overlap_under_ep()
    recipe = {**RECIPE, "ep": 2}
    straight = engine_run({**recipe, "save": f"{tmp}/a"})
    engine_run({**recipe, "exit_at_step": 2, "save": f"{tmp}/b"})
    rest = engine_run({}, source=f"{tmp}/b")
    out["resume"] = {"straight": straight, "rest": rest}
    out["engine-pp2"] = engine_run({**RECIPE, "pp": 2})  # each rank: its stage's layers
    out["engine-ep2"] = straight
    return out


RECIPE = {"model": {"pattern": "*EE", "set": {"d_model": 32, "vocab_size": 61,
                                              "attention.n_heads": 4, "attention.n_kv_heads": 2,
                                              **{f"moe.{k}": v for k, v in MOE.items()}}},
          "tokens": "synthetic", "seq_len": 16, "steps": 4, "global_batch_size": 8,
          "micro_batch_size": 2, "lr": 3e-3, "device": "cpu", "precision": "fp32"}
"""The training engine's run (four micro-batches of two rows per step)."""


def engine_run(values: dict, source: str | None = None) -> dict:
    """``composer train`` in this process; its losses, final parameters and score biases."""
    out = train_case(values, source)
    return {"losses": out["losses"], "step": out["step"], "params": out["params"],
            "biases": {k: v for k, v in out["buffers"].items() if "score_bias" in k}}


@pytest.fixture(scope="module")
def ranks2(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_distributed(two_ranks, 2, str(tmp_path_factory.mktemp("moe")), timeout=600)


@pytest.mark.parametrize("name", list(LAYOUTS_2))
def test_bias_update_equals_one_process(references: dict, ranks2: list, name: str) -> None:
    for rank_result in ranks2:
        check_bias_case(rank_result[name], references[LAYOUTS_2[name][0]])


def test_bias_update_equals_one_process_tp2_ep2(references: dict) -> None:
    got = run_distributed(bias_case, 4, {"tp": 2, "ep": 2}, cfg_dict(), tokens(), timeout=600)
    for rank_result in got:
        check_bias_case(rank_result, references["plain"])


def test_bias_resumes_exactly_at_ep2(ranks2: list) -> None:
    straight, rest = ranks2[0]["resume"]["straight"], ranks2[0]["resume"]["rest"]
    assert rest["step"] == 4 and rest["losses"] == straight["losses"][2:]
    assert len(straight["biases"]) == 2
    for k, v in straight["biases"].items():
        assert torch.equal(rest["biases"][k], v) and (v != 0).any(), k
    for k, v in straight["params"].items():
        assert torch.equal(rest["params"][k], v), k


@pytest.mark.parametrize("name", ["small", "large"])
def test_capacity_under_ep_drops_exactly_the_rule(ranks2: list, name: str) -> None:
    for rank, rank_result in enumerate(ranks2):
        got = rank_result["capacity"][name]
        errs = got["errs"]
        assert {"y", "y_rule", "router.weight", "experts.up_proj"} <= set(errs)
        worst = max(v for k, v in errs.items() if k != "y_dropless")
        assert worst < 1e-12, (rank, json.dumps(errs))
        if name == "small":
            assert got["dropped"] >= 3 and errs["y_dropless"] > 1e-3, (rank, got)
        else:  # nothing dropped: the dropless layer's output
            assert got["dropped"] == 0 and errs["y_dropless"] < 1e-12, (rank, got)


def test_overlapped_dispatch_equals_the_plain_one(ranks2: list) -> None:
    for rank_result in ranks2:
        got = rank_result["overlap"]
        assert got["dropless"] < 1e-13 and got["capacity"] < 1e-13, got
        for name in ("dropless", "capacity"):  # two dispatches of about half the rows each
            (whole,), halves = got[f"{name}/sent 1"], got[f"{name}/sent 2"]
            assert len(halves) == 2 and sum(halves) == whole and min(halves) >= whole // 3, got


@pytest.mark.parametrize("name", ["engine-ep2", "engine-pp2"])
def test_engine_bias_equals_one_process(ranks2: list, name: str) -> None:
    """Through ``composer train`` (accumulation over four micro-batches, fp32): pipeline ranks
    update the layers they hold, expert-parallel ranks sum the loads over the batch."""
    one = engine_run(dict(RECIPE))
    biases = {k: v for r in ranks2 for k, v in r[name]["biases"].items()}
    assert sorted(biases) == sorted(one["biases"]) and len(biases) == 2
    for k, v in one["biases"].items():
        assert torch.equal(biases[k], v) and (v != 0).any(), (k, biases[k], v)
    np.testing.assert_allclose(ranks2[-1][name]["losses"], one["losses"], rtol=1e-5)
