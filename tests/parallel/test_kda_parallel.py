"""Kimi delta attention under tensor parallelism (heads) and context parallelism (halo conv and
chunk state passing, the gated delta net's variants) equals one process: the eval loss, every
gradient (the replicated gate down-projections and norm weight included) and three AdamW
steps, in fp64 (1e-10), alone and in Kimi Linear's layout (KDA, NoPE MLA, MoE); packed
documents that cross the cp ranks' chunks; gloo on CPU."""

import numpy as np
import pytest

from composer.build.builder import check_model
from composer.config import ModelConfig
from composer.parallel.launch import run_distributed
from composer.parallel.mesh import LayoutError, ParallelConfig, resolve_layout
from tests.helpers import layout_case
from tests.parallel.test_context import DOCS, _same, docs_case


def kda_cfg(n_heads: int = 4) -> dict:
    return ModelConfig.from_dict({
        "pattern": "K-K*", "d_model": 32, "vocab_size": 61,
        "kda": {"n_heads": n_heads, "d_head": 8, "d_gate": 6, "chunk_size": 4},
        "attention": {"n_heads": 4, "n_kv_heads": 2}, "mlp": {"d_ff": 64}}).validate().to_dict()


def kimi_cfg() -> dict:
    """Kimi Linear's layout: KDA, then NoPE MLA (``mla.rope`` false), with MoE layers."""
    return ModelConfig.from_dict({
        "pattern": "K-+E", "d_model": 32, "vocab_size": 61,
        "kda": {"n_heads": 2, "d_head": 8, "chunk_size": 4},
        "mla": {"n_heads": 4, "kv_lora_rank": 16, "d_head_nope": 8, "d_head_rope": 4,
                "d_head_v": 8, "rope": False},
        "mlp": {"d_ff": 64}, "moe": {"n_experts": 4, "top_k": 2, "d_ff": 16,
                                    "n_shared_experts": 1, "score_func": "sigmoid",
                                    "score_correction_bias": True}}).validate().to_dict()


DATA = np.random.default_rng(0).integers(0, 61, (8, 16))
LAYOUTS = {"tp2": {"tp": 2}, "cp2": {"cp": 2}, "kimi-tp2": {"tp": 2}, "kimi-cp2": {"cp": 2}}


def _cfg(name: str) -> dict:
    return kimi_cfg() if name.startswith("kimi") else kda_cfg()


DOC_LAYOUTS = {"cp2-docs": {"cp": 2}, "cp2-adaptive-docs": {"cp": 2, "cp_adaptive": True}}


def cases_in_ranks(names: list[str]) -> dict:
    out = {name: layout_case(LAYOUTS[name], _cfg(name), DATA, fp64=True) for name in names}
    return out | {name: docs_case(lay, kda_cfg(), DOCS) for name, lay in DOC_LAYOUTS.items()}


@pytest.fixture(scope="module")
def layouts() -> dict:
    return run_distributed(cases_in_ranks, 2, list(LAYOUTS))[0]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_kda_layout_equals_one_process_fp64(layouts: dict, name: str) -> None:
    ref = layout_case({}, _cfg(name), DATA, fp64=True)
    got = layouts[name]
    assert abs(got["eval"] - ref["eval"]) < 1e-10
    assert set(got["grads"]) == set(ref["grads"])
    assert "layers.0.mixer.f_a_proj.weight" in got["grads"]
    for k, g in ref["grads"].items():
        assert (got["grads"][k] - g).abs().max() < 1e-10, k
    assert np.allclose(got["losses"], ref["losses"], rtol=0, atol=1e-10)
    for k, p in ref["params"].items():
        assert (got["params"][k] - p).abs().max() < 1e-10, k


@pytest.mark.slow
@pytest.mark.parametrize("name", list(DOC_LAYOUTS))
def test_kda_packed_documents_across_ranks_fp64(layouts: dict, name: str) -> None:
    """Documents crossing the ranks' chunks (2N-chunk and adaptive layouts): one process's
    loss and gradients."""
    _same(layouts[name], docs_case({}, kda_cfg(), DOCS))


def test_kda_heads_must_divide_tp() -> None:
    cfg = ModelConfig.from_dict(kda_cfg(n_heads=3))
    with pytest.raises(LayoutError, match=r"kda.n_heads \(3\) is not divisible by tp \(2\)"):
        check_model(resolve_layout(ParallelConfig(tp=2), world_size=2), cfg)
