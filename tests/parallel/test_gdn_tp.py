"""The gated delta net under tensor parallelism equals one process: eval loss, the gradient of
every parameter (the replicated norm weight included) and three AdamW steps; gloo on CPU."""

import numpy as np
import pytest

from composer.config import AttentionConfig, GDNConfig, MLPConfig, ModelConfig
from composer.parallel.launch import run_distributed
from composer.parallel.mesh import LayoutError, ParallelConfig, resolve_layout
from tests.helpers import layout_case, rel_err


def gdn_cfg(n_kv_heads: int = 2, conv_bias: bool = False) -> ModelConfig:
    return ModelConfig(
        pattern="G-G*", d_model=32, vocab_size=61, mamba=None, moe=None,
        gdn=GDNConfig(n_heads=4, n_kv_heads=n_kv_heads, d_head_k=8, d_head_v=6, chunk_size=8,
                      conv_bias=conv_bias),
        attention=AttentionConfig(n_heads=4, n_kv_heads=2), mlp=MLPConfig(d_ff=64))


def tokens() -> np.ndarray:
    return np.random.default_rng(0).integers(0, 61, (8, 16))


case = layout_case  # run in every rank by run_distributed


rel = rel_err


def worst(got: dict, ref: dict) -> tuple[str, float]:
    name = max(ref, key=lambda k: rel(got[k], ref[k]))
    return name, rel(got[name], ref[name])


@pytest.mark.slow
@pytest.mark.parametrize("layout", [{"tp": 2}, {"tp": 2, "sequence_parallel": False}],
                         ids=["tp2-sp", "tp2"])
def test_gdn_tp2_equals_one_process(layout):
    # No conv bias (as the families): its q/k gradient is a near-cancelling sum over tokens, which
    # fp32 rounding moves by ~1e-5 of itself; the fp64 test below covers it exactly.
    args = (gdn_cfg().to_dict(), tokens(), False, 1e-4)
    ref = case({}, *args)
    for got in run_distributed(case, 2, layout, *args):
        assert abs(got["eval"] - ref["eval"]) <= 1e-5 * abs(ref["eval"])
        assert got["grads"].keys() == ref["grads"].keys()
        assert "layers.0.mixer.norm.weight" in got["grads"]
        name, err = worst(got["grads"], ref["grads"])
        assert err < 1e-5, name
        assert np.allclose(got["losses"], ref["losses"], rtol=1e-4, atol=0)
        name, err = worst(got["params"], ref["params"])
        assert err < 1e-5, name


@pytest.mark.slow
@pytest.mark.parametrize("n_kv_heads", [2, 4], ids=["gqa", "mha"])
def test_gdn_tp2_exact_in_fp64(n_kv_heads):
    args = (gdn_cfg(n_kv_heads, conv_bias=True).to_dict(), tokens(), True, 1e-2)
    ref = case({}, *args)
    got = run_distributed(case, 2, {"tp": 2}, *args)[0]
    assert abs(got["eval"] - ref["eval"]) <= 1e-12 * abs(ref["eval"])
    assert worst(got["grads"], ref["grads"])[1] < 1e-10
    assert worst(got["params"], ref["params"])[1] < 1e-10


def test_gdn_heads_must_divide_tp():
    from composer.build.builder import check_model

    cfg = gdn_cfg(n_kv_heads=1)
    with pytest.raises(LayoutError, match=r"gdn.n_kv_heads \(1\) is not divisible by tp \(2\)"):
        check_model(resolve_layout(ParallelConfig(tp=2), world_size=2), cfg)
