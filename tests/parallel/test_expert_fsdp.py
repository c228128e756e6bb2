"""Expert FSDP (gloo): at ep=2 x dp_outer=2 the routed experts are FSDP units over dp_outer, so a
rank holds half the expert weights and optimizer state it holds at ep=2 alone (counted on the
shards); the layout computes what one process computes (fp64: eval loss, gradients, three AdamW
steps), also with tp=2 inside (8 ranks); and its checkpoint, optimizer included, resumes at
ep=2, dp=2 and on one process."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import composer
from composer.config import ModelConfig
from composer.parallel.launch import run_distributed
from composer.parallel.mesh import ParallelConfig

ROOT = str(Path(__file__).resolve().parents[2])
if ROOT not in sys.path:  # spawned ranks unpickle this module's functions by name
    sys.path.insert(0, ROOT)

pytestmark = pytest.mark.slow  # every test here spawns ranks or processes


def cfg_dict() -> dict:
    return {"pattern": "*E-E", "d_model": 32, "vocab_size": 61, "init_std": 0.1,
            "attention": {"n_heads": 4, "n_kv_heads": 2}, "mamba": None, "mlp": {"d_ff": 48},
            "moe": {"n_experts": 8, "top_k": 2, "d_ff": 16, "n_shared_experts": 1,
                    "aux_loss_coeff": 0.01}}


def tokens() -> np.ndarray:
    return np.random.default_rng(0).integers(0, 61, (8, 16))


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def expert_numels(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, int]:
    """This rank's elements of routed-expert weights and of their AdamW state."""
    from composer.parallel.tensor import expert_params

    params = [p for layer in model.all_layers() for p in expert_params(layer.mixer)]
    local = [p.to_local() if hasattr(p, "to_local") else p for p in params]
    state = [v for p in params for k, v in opt.state[p].items() if k != "step"]
    state = [v.to_local() if hasattr(v, "to_local") else v for v in state]
    return {"params": sum(t.numel() for t in local), "optimizer": sum(t.numel() for t in state),
            "n_params": len(params), "n_state": len(state),
            "placements": str(params[0].placements) if hasattr(params[0], "placements") else ""}


def save_case(layout: dict, folder: str, data: np.ndarray) -> dict:
    """Two AdamW steps, save, one more step: the continuation a resume must reproduce."""
    from composer.parallel.checkpoint import save_checkpoint
    from composer.run import prepare
    from tests.helpers import adamw_steps

    model, dims, opt, _ = prepare(folder + "/portable", ParallelConfig(**layout),
                                  optimizer_lr=1e-2)
    adamw_steps(model, dims, opt, list(data), 2, batch_size=4, seed=1)
    save_checkpoint(folder + "/run", 2, model, opt)
    adamw_steps(model, dims, opt, list(data), 1, batch_size=4, seed=1, start_step=2)
    return {"params": {k: _whole(p.detach()).clone() for k, p in model.named_parameters()},
            "numels": expert_numels(model, opt)}


def resume_case(layout: dict, folder: str, data: np.ndarray) -> dict:
    from composer.run import prepare
    from tests.helpers import adamw_steps

    model, dims, opt, step = prepare(folder + "/run", ParallelConfig(**layout),
                                     optimizer_lr=1e-2)
    adamw_steps(model, dims, opt, list(data), 1, batch_size=4, seed=1, start_step=step)
    return {"params": {k: _whole(p.detach()).clone() for k, p in model.named_parameters()},
            "numels": expert_numels(model, opt), "step": step}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    folder = str(tmp_path_factory.mktemp("efsdp"))
    composer.save(composer.build_model(ModelConfig.from_dict(cfg_dict()), seed=2),
                  folder + "/portable")
    saved = run_distributed(save_case, 4, {"ep": 2}, folder, tokens(), timeout=600)
    out = {"saved": saved, "one": resume_case({}, folder, tokens())}
    for name, layout in (("ep2", {"ep": 2}), ("dp2", {"dp": 2})):
        out[name] = run_distributed(resume_case, 2, layout, folder, tokens(), timeout=600)
    return out


def test_expert_memory_halves_with_dp_outer(runs: dict) -> None:
    sharded = [r["numels"] for r in runs["saved"]]  # ep=2 x dp_outer=2
    alone = [r["numels"] for r in runs["ep2"]]  # ep=2
    assert all(n["n_params"] == 6 and n["n_state"] == 12 for n in sharded + alone)
    for mine in sharded:
        assert 2 * mine["params"] == alone[0]["params"] == 2 * 3 * 16 * 32 * 8 // 2
        assert 2 * mine["optimizer"] == alone[0]["optimizer"] == 2 * alone[0]["params"]
    # sharded over ep, then over dp_outer (the FSDP shard of the ep shard)
    assert sharded[0]["placements"].count("Shard") == 2, sharded[0]["placements"]


@pytest.mark.parametrize("name", ["one", "ep2", "dp2"])
def test_checkpoint_resumes_at_other_layouts(runs: dict, name: str) -> None:
    expected = runs["saved"][0]["params"]
    got = runs[name] if name == "one" else runs[name][0]
    assert got["step"] == 2
    for k, v in expected.items():
        torch.testing.assert_close(got["params"][k], v, rtol=2e-5, atol=2e-6, msg=k)


@pytest.mark.parametrize("world, layout", [(4, {"ep": 2}), (8, {"tp": 2, "ep": 2}),
                                           (4, {"ep": 2, "ep_overlap": True})],
                         ids=["ep2-dp_outer2", "tp2-ep2-dp_outer2", "ep2-dp_outer2-overlap"])
def test_equals_one_process_in_fp64(world: int, layout: dict) -> None:
    """Eval loss, every gradient (gathered) and three AdamW steps at lr 1e-2; with tp the
    experts are split over (dp_outer, ep, tp) (expert-tensor parallel inside)."""
    from tests.helpers import layout_case

    args = (cfg_dict(), tokens(), True, 1e-2)
    ref = layout_case({}, *args)
    got = run_distributed(layout_case, world, layout, *args, timeout=600)[0]
    assert abs(got["eval"] - ref["eval"]) < 1e-12 * abs(ref["eval"])
    np.testing.assert_allclose(got["losses"], ref["losses"], rtol=1e-12)
    for key in ("grads", "params"):
        assert got[key].keys() == ref[key].keys()
        for k, v in ref[key].items():
            torch.testing.assert_close(got[key][k], v, rtol=1e-10, atol=1e-13, msg=k)
