"""Multi-latent attention under tensor parallelism equals one process: eval loss, the gradient
of every parameter (the replicated down-projections and latent norms included) and three AdamW
steps; gloo on CPU."""

import numpy as np
import pytest

from composer.config import MLAConfig, MLPConfig, ModelConfig, MoEConfig, YarnScaling
from composer.parallel.launch import run_distributed
from composer.parallel.mesh import LayoutError, ParallelConfig, resolve_layout
from tests.helpers import layout_case, rel_err


def mla_cfg(q_lora_rank: int | None) -> ModelConfig:
    return ModelConfig(
        pattern="+-+E", d_model=32, vocab_size=61, attention=None, mamba=None,
        mla=MLAConfig(n_heads=4, q_lora_rank=q_lora_rank, kv_lora_rank=16, d_head_nope=8,
                      d_head_rope=4, d_head_v=6,
                      rope_scaling=YarnScaling(factor=4.0, original_max_position=8,
                                               mscale=1.0, mscale_all_dim=1.0)),
        mlp=MLPConfig(d_ff=64), moe=MoEConfig(n_experts=4, top_k=2, d_ff=32))


def tokens() -> np.ndarray:
    return np.random.default_rng(0).integers(0, 61, (8, 16))


case = layout_case  # run in every rank by run_distributed


rel = rel_err


def worst(got: dict, ref: dict) -> tuple[str, float]:
    name = max(ref, key=lambda k: rel(got[k], ref[k]))
    return name, rel(got[name], ref[name])


@pytest.mark.slow
@pytest.mark.parametrize("q_lora_rank", [12, None], ids=["lora-q", "full-q"])
@pytest.mark.parametrize("layout", [{"tp": 2}, {"tp": 2, "sequence_parallel": False}],
                         ids=["tp2-sp", "tp2"])
def test_mla_tp2_equals_one_process(layout, q_lora_rank):
    args = (mla_cfg(q_lora_rank).to_dict(), tokens(), False, 1e-4)
    ref = case({}, *args)
    for got in run_distributed(case, 2, layout, *args):
        assert abs(got["eval"] - ref["eval"]) <= 1e-5 * abs(ref["eval"])
        assert got["grads"].keys() == ref["grads"].keys()
        name, err = worst(got["grads"], ref["grads"])
        assert err < 1e-5, name
        assert "layers.0.mixer.kv_a_norm.weight" in got["grads"]
        assert np.allclose(got["losses"], ref["losses"], rtol=1e-4, atol=0)
        name, err = worst(got["params"], ref["params"])
        assert err < 1e-5, name


@pytest.mark.slow
def test_mla_tp2_exact_in_fp64():
    args = (mla_cfg(12).to_dict(), tokens(), True, 1e-2)
    ref = case({}, *args)
    got = run_distributed(case, 2, {"tp": 2}, *args)[0]
    assert abs(got["eval"] - ref["eval"]) <= 1e-12 * abs(ref["eval"])
    assert worst(got["grads"], ref["grads"])[1] < 1e-10
    assert worst(got["params"], ref["params"])[1] < 1e-10


def test_mla_heads_must_divide_tp():
    from composer.build.builder import check_model

    cfg = mla_cfg(12)
    cfg.mla.n_heads = 3
    with pytest.raises(LayoutError, match=r"mla.n_heads \(3\) is not divisible by tp \(2\)"):
        check_model(resolve_layout(ParallelConfig(tp=2), world_size=2), cfg)
