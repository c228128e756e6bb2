"""Multi-token prediction under tensor (sequence) and data parallelism equals one process: eval
loss, the gradient of every parameter (the MTP depths' projections and norms, the shared head
and embedding) and three AdamW steps; packed documents under tp=2; MTP layers' layout rules.
gloo on CPU."""

import numpy as np
import pytest
import torch

from composer.config import AttentionConfig, MambaConfig, MLPConfig, ModelConfig, MoEConfig
from composer.parallel.launch import run_distributed
from composer.parallel.mesh import LayoutError, ParallelConfig, resolve_layout
from tests.helpers import layout_case, rel_err


def mtp_cfg() -> ModelConfig:
    return ModelConfig(
        pattern="M*-/*E/*E", d_model=32, vocab_size=61,  # a vocabulary tp=2 does not divide
        attention=AttentionConfig(n_heads=4, n_kv_heads=2, qk_norm=True),
        mamba=MambaConfig(n_heads=4, d_head=8, n_groups=2, d_state=8, chunk_size=8),
        mlp=MLPConfig(d_ff=64),
        moe=MoEConfig(n_experts=4, top_k=2, d_ff=32, n_shared_experts=1, aux_loss_coeff=0.01))


def tokens() -> np.ndarray:
    return np.random.default_rng(0).integers(0, 61, (8, 16))


case = layout_case  # run in every rank by run_distributed


def worst(got: dict, ref: dict) -> tuple[str, float]:
    name = max(ref, key=lambda k: rel_err(got[k], ref[k]))
    return name, rel_err(got[name], ref[name])


@pytest.mark.slow
@pytest.mark.parametrize("layout", [{"tp": 2}, {"tp": 2, "sequence_parallel": False},
                                    {"dp": 2}], ids=["tp2-sp", "tp2", "dp2"])
def test_mtp_equals_one_process(layout):
    args = (mtp_cfg().to_dict(), tokens(), False, 1e-4)
    ref = case({}, *args)
    assert {"mtp.1.proj.weight", "mtp.0.layers.1.mixer.router.weight"} <= ref["grads"].keys()
    for got in run_distributed(case, 2, layout, *args):
        assert abs(got["eval"] - ref["eval"]) <= 1e-5 * abs(ref["eval"])
        assert got["grads"].keys() == ref["grads"].keys()
        name, err = worst(got["grads"], ref["grads"])
        assert err < 1e-5, name
        assert np.allclose(got["losses"], ref["losses"], rtol=1e-4, atol=0)
        # Adam turns fp32 rounding of near-zero gradients into whole steps (1.4e-5 measured
        # here); the fp64 test below shows the layouts agree to 1e-10
        name, err = worst(got["params"], ref["params"])
        assert err < 5e-5, name


@pytest.mark.slow
def test_mtp_tp2_exact_in_fp64():
    args = (mtp_cfg().to_dict(), tokens(), True, 1e-2)
    ref = case({}, *args)
    got = run_distributed(case, 2, {"tp": 2}, *args)[0]
    assert abs(got["eval"] - ref["eval"]) <= 1e-12 * abs(ref["eval"])
    assert worst(got["grads"], ref["grads"])[1] < 1e-10
    assert worst(got["params"], ref["params"])[1] < 1e-10


def doc_case(layout: dict, cfg_dict: dict, data: np.ndarray, docs: np.ndarray) -> dict:
    """Loss, MTP loss and gradients of one batch of packed documents (fp64)."""
    from composer.parallel.data import finish_grads
    from composer.parallel.mesh import build_parallel_dims
    from composer.run import build_sharded

    dims = build_parallel_dims(ParallelConfig(**layout))
    model = build_sharded(ModelConfig.from_dict(cfg_dict), dims, seed=7, dtype=torch.float64)
    ids = torch.from_numpy(data).long()
    out = model(ids, ids, doc_ids=torch.from_numpy(docs))
    out.loss.backward()
    finish_grads(model, dims)
    grads = {k: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
             for k, p in model.named_parameters()}
    return {"loss": out.loss.item(), "mtp": out.mtp_loss.item(), "grads": grads}


@pytest.mark.slow
def test_mtp_with_packed_documents_tp2_sp():
    # documents end inside each rank's half of the sequence: the keep mask is cut with it
    docs = np.repeat(np.array([[0] * 5 + [1] * 6 + [2] * 5]), 4, axis=0)
    docs[1] = [0] * 9 + [3] * 7
    args = (mtp_cfg().to_dict(), tokens()[:4], docs)
    ref = doc_case({}, *args)
    got = run_distributed(doc_case, 2, {"tp": 2}, *args)[0]
    assert abs(got["mtp"] - ref["mtp"]) <= 1e-12 * ref["mtp"]
    assert abs(got["loss"] - ref["loss"]) <= 1e-12 * ref["loss"]
    assert worst(got["grads"], ref["grads"])[1] < 1e-10


def test_mtp_layers_are_held_to_the_layout_rules():
    from composer.build.builder import check_model

    cfg = mtp_cfg()
    cfg.pattern = "M-/*-"  # attention only in the MTP part
    cfg.attention.n_heads, cfg.attention.n_kv_heads = 6, 3
    with pytest.raises(LayoutError, match=r"attention.n_kv_heads \(3\) and tp \(2\)"):
        check_model(resolve_layout(ParallelConfig(tp=2), 2), cfg)


def load_case(layout: dict, folder: str) -> dict:
    """Every parameter (gathered whole) of a portable checkpoint loaded shard by shard."""
    from composer.build.builder import open_portable
    from composer.parallel.mesh import build_parallel_dims
    from composer.run import build_sharded

    dims = build_parallel_dims(ParallelConfig(**layout))
    cfg, source = open_portable(folder)
    model = build_sharded(cfg, dims, tensors=source)
    source.close()
    return {k: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for k, p in model.named_parameters()}


@pytest.mark.slow
def test_mtp_weights_load_slice_by_slice_under_tp2(tmp_path):
    import composer
    from tests.helpers import randomize

    model = composer.build_model(mtp_cfg(), seed=1)
    randomize(model, seed=2)
    composer.save(model, tmp_path / "ckpt")
    got = run_distributed(load_case, 2, {"tp": 2}, str(tmp_path / "ckpt"))[1]
    want = dict(model.named_parameters())
    assert got.keys() == want.keys() and any(k.startswith("mtp.1.") for k in got)
    for k, t in got.items():
        assert torch.equal(t, want[k]), k
