"""The short-convolution kind (``C``, LFM2's gated short convolution): the mixer equals its
plain-math twin in fp64 (forward and every gradient, with and without biases); packed documents
equal each document alone; cached decoding (a left-padded prefill, then token by token) equals
the full forward; the record (section, counts, FLOPs, cp strategy, layout rule); LoRA on its
projections; two steps of the training engine; tp=2 and cp=2 (documents across the chunks too)
equal one process in fp64."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import composer
from composer.blocks.shortconv import ShortConvConfig, ShortConvMixer, shortconv_ref
from composer.config import ConfigError, ModelConfig
from tests.helpers import randomize

F64 = torch.float64
SIZES = {"d_model": 32, "vocab_size": 61, "attention": {"n_heads": 4, "n_kv_heads": 2},
         "mlp": {"d_ff": 64}}


def cfg_dict(pattern: str = "C-*-C-", bias: bool = True) -> dict:
    return {"pattern": pattern, **SIZES, "shortconv": {"d_conv": 3, "bias": bias}}


def mixer(bias: bool) -> tuple[ShortConvMixer, ModelConfig]:
    cfg = ModelConfig.from_dict(cfg_dict(bias=bias))
    m = ShortConvMixer(cfg).to(F64)
    m.reset_parameters(torch.Generator().manual_seed(0))
    randomize(m, seed=1)  # biases too (they start at zero)
    return m, cfg


DOCS = torch.tensor([[0, 0, 0, 0, 1, 1, 2, 2, 2, 2, 2], [5, 6, 6, 6, 6, 6, 6, 6, 6, 7, 7]])


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("docs", [None, DOCS], ids=["whole", "packed"])
def test_mixer_equals_its_twin_fp64(bias: bool, docs: torch.Tensor | None) -> None:
    m, cfg = mixer(bias)
    x = torch.randn(2, 11, 32, dtype=F64, generator=torch.Generator().manual_seed(2),
                    requires_grad=True)
    weights = {k: v.detach().clone().requires_grad_() for k, v in m.state_dict().items()}
    assert sorted(weights) == sorted(["in_proj.weight", "conv1d.weight", "out_proj.weight"]
                                     + (["in_proj.bias", "conv1d.bias", "out_proj.bias"]
                                        if bias else []))
    got = m(x, doc_ids=docs)
    want = shortconv_ref(x, weights, cfg, docs)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    grad_out = torch.randn_like(got)
    ours = torch.autograd.grad(got, [x, *m.parameters()], grad_out)
    ref = torch.autograd.grad(want, [x, *weights.values()], grad_out)
    torch.testing.assert_close(ours[0], ref[0], rtol=1e-12, atol=1e-12)
    fused = dict(zip([n for n, _ in m.named_parameters()], ours[1:], strict=True))
    for name, g in zip(weights, ref[1:], strict=True):  # our parts, fused as the state dict is
        module, kind = name.rsplit(".", 1)
        parts = [fused[n] for n in fused if n.startswith(f"{module}.{kind}")]
        torch.testing.assert_close(torch.cat(parts), g, rtol=1e-12, atol=1e-12, msg=name)


def test_the_twin_is_lfm2s_math() -> None:
    """One hand-computed value: ``out(c * conv(b * u))`` with taps 1, 2, 3 (oldest first), no
    activation, and nothing read from before the sequence."""
    cfg = ModelConfig.from_dict(cfg_dict(bias=False) | {"d_model": 1})
    w = {"in_proj.weight": torch.tensor([[2.0], [3.0], [5.0]], dtype=F64),
         "conv1d.weight": torch.tensor([[[1.0, 2.0, 3.0]]], dtype=F64),
         "out_proj.weight": torch.tensor([[7.0]], dtype=F64)}
    x = torch.tensor([[[1.0], [-1.0], [0.5]]], dtype=F64)
    v = 10 * x[0, :, 0] ** 2  # b * u = 2x * 5x
    want = 7 * 3 * x[0, :, 0] * torch.stack([3 * v[0], 3 * v[1] + 2 * v[0],
                                             3 * v[2] + 2 * v[1] + v[0]])
    torch.testing.assert_close(shortconv_ref(x, w, cfg)[0, :, 0], want)


def _model(pattern: str = "C-*-C-", dtype: torch.dtype = F64) -> composer.HybridModel:
    model = composer.build_model(ModelConfig.from_dict(cfg_dict(pattern)), seed=0)
    randomize(model, seed=3)
    return model.to(dtype).eval()


def test_packed_documents_equal_documents_alone() -> None:
    """Logits of two packed rows (a one-token document among them) equal each document run on
    its own (fp64, 1e-10), through C, attention and MLP layers."""
    model = _model()
    ids = torch.randint(0, 61, (2, 11), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        packed = model(ids, doc_ids=DOCS)
        for r in range(2):
            for d in DOCS[r].unique():
                cols = (DOCS[r] == d).nonzero()[:, 0]
                alone = model(ids[r:r + 1, cols])
                torch.testing.assert_close(packed[r:r + 1, cols], alone, rtol=1e-10, atol=1e-10)


def test_decoding_with_a_cache_equals_the_full_forward() -> None:
    """A left-padded prefill then one token per call: the full forward's logits (fp64, 1e-10);
    the padded row equals its tokens alone; the state stays ``[B, D, d_conv - 1]``."""
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
    assert cache.layers[0].conv_BXW.shape == (2, 32, 2)  # the window of layer 0 (a C)


def test_greedy_generation_runs_on_the_kind() -> None:
    model = _model("C-C-", torch.float32)
    ids = torch.randint(0, 61, (2, 5), generator=torch.Generator().manual_seed(6))
    out = composer.generate(model, ids, 6)
    with torch.no_grad():  # each new token is the argmax of the full forward before it
        want = model(out[:, :-1])[:, 4:].argmax(-1)
    assert torch.equal(out[:, 5:], want)


def test_the_record() -> None:
    from composer.build.builder import check_model
    from composer.build.registry import REGISTRY
    from composer.parallel.context import check_cp_length
    from composer.parallel.mesh import LayoutError, ParallelConfig, resolve_layout

    cfg = ModelConfig.from_dict(cfg_dict())
    kind = REGISTRY["C"]
    assert (kind.name, kind.section, kind.halo_width(cfg)) == ("short convolution", "shortconv", 2)
    assert kind.context_strategy(cfg) == ("halo_conv",)
    assert kind.decoding_state is ShortConvMixer.init_cache
    assert ModelConfig(pattern="C-").shortconv == ShortConvConfig()
    assert ModelConfig(pattern="M-").shortconv is None  # present only where the pattern uses C
    with pytest.raises(ConfigError, match="shortconv.d_conv must be positive, got 0"):
        composer.apply_overrides(ModelConfig.from_dict(cfg_dict()), ["shortconv.d_conv=0"]
                                 ).validate()
    with pytest.raises(LayoutError, match=r"d_model \(the short convolution's channels\) "
                                          r"\(32\) is not divisible by tp \(3\)"):
        check_model(resolve_layout(ParallelConfig(tp=3), 3), ModelConfig.from_dict(
            cfg_dict("C-") | {"mlp": {"d_ff": 96}}))
    with pytest.raises(LayoutError, match="shorter than the shortconv convolution's halo of 2"):
        check_cp_length(cfg, 8, 16)
    stats = composer.model_stats(composer.build_model(cfg, device="meta"), seq_len=16)
    mixer_params = 4 * 32 * 32 + 4 * 32 + 32 * 3 + 32  # in/out proj with biases, the conv
    assert stats.params_by_kind["C short convolution"] == 2 * (mixer_params + 32)
    assert ShortConvMixer.flops_per_token(cfg, 16) == 2 * 33 * 128 + 2 * 32 * 3 + 2 * 32


def test_lora_on_both_projections_merges_exactly() -> None:
    """LoRA on in_proj (its B split into the b / c / u parts) and out_proj: the merged model
    equals the adapted one (fp64, 1e-10), and the adapters change the output."""
    from composer.lora import LoRAConfig, adapter_names, add_lora, merge_lora

    model = _model("C-C-")
    ids = torch.randint(0, 61, (2, 9), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        base = model(ids)
    add_lora(model, LoRAConfig(rank=3, alpha=6, targets=("in_proj", "out_proj")))
    names = adapter_names(model)
    assert {"layers.0.mixer.in_proj.lora.B.weight_b", "layers.0.mixer.in_proj.lora.B.weight_u",
            "layers.2.mixer.out_proj.lora.B.weight"} <= names
    g = torch.Generator().manual_seed(8)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in names:
                p.copy_(torch.randn(p.shape, generator=g, dtype=F64) * 0.1)
        adapted = model(ids)
        merge_lora(model)
        merged = model(ids)
    assert (merged - adapted).abs().max() < 1e-10 and (adapted - base).abs().max() > 1e-3


@pytest.mark.slow
def test_trains_two_steps_with_the_engine(tmp_path) -> None:
    from tests.helpers import train_case

    sections = {**cfg_dict("C*-C-"), "vocab_size": 257}  # the built-in corpus's byte tokenizer
    del sections["pattern"]
    out = train_case({"model": {"pattern": "C*-C-", "set": sections}, "steps": 2, "seq_len": 16,
                      "global_batch_size": 4, "lr": 1e-2, "save": str(tmp_path / "run")})
    assert len(out["losses"]) == 2 and all(np.isfinite(out["losses"]))
    assert out["losses"][1] < out["losses"][0]


# ---------------------------------------------------------------- tp=2 and cp=2, gloo ranks

PARALLEL_CFG = cfg_dict("C*-C-")
DATA = np.random.default_rng(0).integers(0, 61, (8, 16))
PACKED = np.array([[0] * 3 + [1] * 11 + [2] * 2,  # a document across chunks 0, 1, 2, 3
                   [4] * 16])


def _in_ranks() -> dict:
    from tests.helpers import layout_case
    from tests.parallel.test_context import docs_case

    return {"tp2": layout_case({"tp": 2}, PARALLEL_CFG, DATA, fp64=True),
            "cp2": layout_case({"cp": 2}, PARALLEL_CFG, DATA, fp64=True),
            "cp2-docs": docs_case({"cp": 2}, PARALLEL_CFG, PACKED)}


def _close(got: torch.Tensor | float, want: torch.Tensor | float, what: str) -> None:
    err = float(np.max(np.abs(np.asarray(got) - np.asarray(want))))
    assert err < 1e-10, (what, err)


@pytest.mark.slow
def test_tp2_and_cp2_equal_one_process_fp64() -> None:
    """The eval loss, every gradient and three AdamW steps at tp=2 and cp=2 (one spawn of two
    gloo ranks), and the loss and gradients of packed documents that cross the cp chunks."""
    from composer.parallel.launch import run_distributed
    from tests.helpers import layout_case
    from tests.parallel.test_context import docs_case

    got = run_distributed(_in_ranks, 2)[0]
    ref = layout_case({}, PARALLEL_CFG, DATA, fp64=True)
    for name in ("tp2", "cp2"):
        _close(got[name]["eval"], ref["eval"], name)
        assert np.allclose(got[name]["losses"], ref["losses"], rtol=1e-10, atol=0), name
        for part in ("grads", "params"):
            for k, want in ref[part].items():
                _close(got[name][part][k], want, f"{name} {part} {k}")
    docs_ref = docs_case({}, PARALLEL_CFG, PACKED)
    _close(got["cp2-docs"]["loss"], docs_ref["loss"], "cp2-docs")
    for k, want in docs_ref["grads"].items():
        _close(got["cp2-docs"]["grads"][k], want, f"cp2-docs {k}")
