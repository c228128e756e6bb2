"""Zamba2's hybrid layer (``Z``): the layer equals transformers' ``Zamba2HybridLayer`` (fp32) and
its plain-math twin in fp64 (forward and every gradient, packed documents too); packed documents
equal each document alone; cached decoding (a left-padded prefill, then token by token) equals
the full forward; a shared block is stored once and its gradient is the sum over its uses; the
record (section, FLOPs, the layout refusals); tp=2 and pp=2 (the shared block used on both
stages) equal one process (fp64, gloo), and the pp=2 checkpoint holds the shared block once."""

from __future__ import annotations

import pytest
import torch

import composer
from composer.blocks.zamba import ZambaMixer, zamba_ref
from composer.build.registry import build_layer
from composer.config import ConfigError, ModelConfig
from tests.helpers import randomize

F64 = torch.float64
D, F, R = 16, 24, 4
SIZES = {"d_model": D, "vocab_size": 61,
         "attention": {"n_heads": 2, "n_kv_heads": 2, "d_head": 2 * D // 2,
                       "softmax_scale": (D / 2) ** -0.5},
         "mamba": {"n_heads": 4, "d_head": 8, "n_groups": 2, "d_state": 8, "chunk_size": 8,
                   "dt_limit": [0.001, float("inf")]},
         "mlp": {"d_ff": F, "activation": "geglu"}, "zamba": {"adapter_rank": R}}
DOCS = torch.tensor([[0, 0, 0, 0, 1, 1, 2, 2, 2, 2, 2], [5, 6, 6, 6, 6, 6, 6, 6, 6, 7, 7]])


def config(pattern: str = "Z", **zamba) -> ModelConfig:
    return ModelConfig.from_dict({"pattern": pattern, **SIZES,
                                  "zamba": {"adapter_rank": R, **zamba}}).validate()


def hf_weights(sd: dict[str, torch.Tensor], site: int = 0) -> dict[str, torch.Tensor]:
    """Our layer's state dict from a ``Zamba2HybridLayer``'s (adapters of hybrid site
    ``site``)."""
    st = "shared_transformer."
    out = {"mixer.block.input_norm.weight": sd[st + "input_layernorm.weight"],
           "mixer.block.ff_norm.weight": sd[st + "pre_ff_layernorm.weight"],
           "mixer.block.mlp.down_proj.weight": sd[st + "feed_forward.down_proj.weight"],
           "mixer.linear.weight": sd["linear.weight"],
           "norm.weight": sd["mamba_decoder.input_layernorm.weight"]}
    gate_up = sd[st + "feed_forward.gate_up_proj.weight"]
    out["mixer.block.mlp.gate_proj.weight"], out["mixer.block.mlp.up_proj.weight"] = \
        gate_up.chunk(2)
    for p in "qkvo":
        out[f"mixer.block.attn.{p}_proj.weight"] = sd[st + f"self_attn.{p}_proj.weight"]
    lists = {p: f"self_attn.linear_{p}_adapter_list" for p in "qkv"}
    lists["mlp"] = "feed_forward.gate_up_proj_adapter_list"
    for name, hf in lists.items():
        for i, part in enumerate(("down", "up")):
            out[f"mixer.adapters.{name}.{part}.weight"] = sd[f"{st}{hf}.{site}.{i}.weight"]
    for k, v in sd.items():
        if k.startswith("mamba_decoder.mamba."):
            out["mixer.mamba." + k[len("mamba_decoder.mamba."):]] = v
    return out


@pytest.mark.slow
def test_the_layer_is_transformers_hybrid_layer() -> None:
    from transformers import Zamba2Config, Zamba2ForCausalLM

    hc = Zamba2Config(vocab_size=61, hidden_size=D, num_hidden_layers=1,
                      layers_block_type=["hybrid"], mamba_d_state=8, mamba_ngroups=2,
                      n_mamba_heads=4, chunk_size=8, intermediate_size=F, num_attention_heads=2,
                      num_key_value_heads=2, use_shared_attention_adapter=True, adapter_rank=R,
                      use_mem_rope=True, hidden_act="gelu")
    hf = Zamba2ForCausalLM(hc).eval()
    randomize(hf, seed=1, std=0.3)
    cfg = config()
    ours = build_layer(cfg, 0, "Z")
    ours.load_state_dict(hf_weights(hf.model.layers[0].state_dict()))
    g = torch.Generator().manual_seed(2)
    x, e = torch.randn(2, 13, D, generator=g), torch.randn(2, 13, D, generator=g)
    pos = torch.arange(13)[None]
    with torch.no_grad():
        want = hf.model.layers[0](x, e, 0, None, None, position_ids=pos,
                                  position_embeddings=hf.model.rotary_emb(x, pos))
        got = ours(x, embeddings=e)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("adapters", [True, False])
@pytest.mark.parametrize("docs", [None, DOCS], ids=["whole", "packed"])
def test_layer_equals_its_twin_fp64(adapters: bool, docs: torch.Tensor | None) -> None:
    cfg = config(attention_adapters=adapters)
    layer = build_layer(cfg, 0, "Z").to(F64)
    layer.mixer.reset_parameters(torch.Generator().manual_seed(0))
    randomize(layer, seed=3)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 11, D, dtype=F64, generator=g, requires_grad=True)
    e = torch.randn(2, 11, D, dtype=F64, generator=g, requires_grad=True)
    weights = {k: v.detach().clone().requires_grad_() for k, v in layer.state_dict().items()}
    assert ("mixer.adapters.q.down.weight" in weights) == adapters
    got = layer(x, embeddings=e, doc_ids=docs)
    want = zamba_ref(x, e, weights, cfg, doc_ids=docs)
    torch.testing.assert_close(got, want, rtol=1e-11, atol=1e-11)
    grad_out = torch.randn_like(got)
    ours = torch.autograd.grad(got, [x, e, *layer.parameters()], grad_out)
    ref = torch.autograd.grad(want, [x, e, *weights.values()], grad_out)
    torch.testing.assert_close(ours[0], ref[0], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ours[1], ref[1], rtol=1e-10, atol=1e-10)
    fused = dict(zip([n for n, _ in layer.named_parameters()], ours[2:], strict=True))
    for name, want_g in zip(weights, ref[2:], strict=True):  # split parts fused back
        module, kind = name.rsplit(".", 1)
        parts = [fused[n] for n in fused if n == name or n.startswith(f"{module}.{kind}_")]
        torch.testing.assert_close(torch.cat(parts), want_g, rtol=1e-10, atol=1e-10, msg=name)


def _model(pattern: str = "M{a:Z}-{a}Z", dtype: torch.dtype = F64) -> composer.HybridModel:
    model = composer.build_model(config(pattern), seed=0)
    randomize(model, seed=5)
    return model.to(dtype).eval()


def test_packed_documents_equal_documents_alone() -> None:
    model = _model()
    ids = torch.randint(0, 61, (2, 11), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        packed = model(ids, doc_ids=DOCS)
        for r in range(2):
            for d in DOCS[r].unique():
                cols = (DOCS[r] == d).nonzero()[:, 0]
                alone = model(ids[r:r + 1, cols])
                torch.testing.assert_close(packed[r:r + 1, cols], alone, rtol=1e-10, atol=1e-10)


def test_decoding_with_a_cache_equals_the_full_forward() -> None:
    """A left-padded prefill then one token per call: the full forward's logits (fp64, 1e-10);
    the padded row equals its tokens alone."""
    model = _model()
    ids = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(7))
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


def test_the_record() -> None:
    from composer.build.builder import check_model
    from composer.build.registry import REGISTRY
    from composer.parallel.context.model import check_cp
    from composer.parallel.mesh import LayoutError, ParallelConfig, resolve_layout

    cfg = config("MZ")
    kind = REGISTRY["Z"]
    assert (kind.name, kind.section, kind.halo_width(cfg)) == ("Zamba2 hybrid", "zamba", 3)
    assert kind.context_strategy(cfg) is None and kind.decoding_state is ZambaMixer.init_cache
    check_model(resolve_layout(ParallelConfig(tp=2), 2), cfg)  # tp and pp: no refusal
    check_model(resolve_layout(ParallelConfig(pp=2), 2), cfg)
    odd = ModelConfig.from_dict({"pattern": "Z", **SIZES, "mamba": {**SIZES["mamba"],
                                                                    "n_groups": 1}})
    with pytest.raises(LayoutError, match=r"^'Z' \(Zamba2 hybrid layer\): attention.n_heads "
                                          r"\(2\) is not divisible by tp \(4\)$"):
        check_model(resolve_layout(ParallelConfig(tp=4), 4), odd)
    with pytest.raises(LayoutError, match=r"--cp: layers.1 \('Z', ZambaMixer\) has no "
                                          "context-parallel form yet"):
        check_cp(composer.build_model(cfg, device="meta"), 2)
    with pytest.raises(ConfigError, match="the shared block's MLP is gated"):
        composer.apply_overrides(config("MZ"), ["mlp.activation=gelu"]).validate()
    # FLOPs: the block, adapters, linear and the Mamba-2 mixer from their parameter counts
    layer = build_layer(cfg, 1, "Z")
    weights = sum(p.numel() for n, p in layer.mixer.named_parameters()
                  if "norm" not in n and not n.startswith("mamba."))
    mamba = composer.blocks.mamba2.Mamba2Mixer.flops_per_token(cfg, 16)
    scores = 4 * 2 * 16 * 16  # 4 * heads * d_head * seq_len
    assert ZambaMixer.flops_per_token(cfg, 16) == 2 * weights + scores + mamba


def test_shared_block_is_stored_once_and_its_gradient_sums_the_uses() -> None:
    """``M{a:Z}-{a}Z``: the block of layers 1 and 3 is ``shared.a.*`` only; the same model with
    two equal copies (``MZ-ZZ``) gives the same logits, and the shared gradient is the sum of
    the copies' (fp64, 1e-10)."""
    shared = _model()
    keys = shared.state_dict()
    assert not any(k.startswith(("layers.1.mixer.block", "layers.3.mixer.block")) for k in keys)
    assert "layers.4.mixer.block.attn.q_proj.weight" in keys  # the unlabelled Z keeps its own
    copies = composer.build_model(config("MZ-ZZ"), seed=0).to(F64)
    state = {}
    for k, v in keys.items():
        if k.startswith("shared.a."):
            for i in (1, 3):
                state[f"layers.{i}.mixer.block." + k[len("shared.a."):]] = v
        else:
            state[k] = v
    copies.load_state_dict(state)
    ids = torch.randint(0, 61, (2, 11), generator=torch.Generator().manual_seed(8))
    a, b = shared(ids, labels=ids).loss, copies(ids, labels=ids).loss
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    a.backward()
    b.backward()
    got = dict(shared.named_parameters())
    ref = dict(copies.named_parameters())
    for name, p in got.items():
        if name.startswith("shared.a."):
            rest = name[len("shared.a."):]
            want = sum(ref[f"layers.{i}.mixer.block.{rest}"].grad for i in (1, 3))
            torch.testing.assert_close(p.grad, want, rtol=1e-10, atol=1e-10, msg=name)


@pytest.mark.slow
def test_trains_two_steps_with_the_engine(tmp_path) -> None:
    import numpy as np

    from tests.helpers import train_case

    sections = {**SIZES, "vocab_size": 257}  # the built-in corpus's byte tokenizer
    out = train_case({"model": {"pattern": "M{a:Z}-{a}", "set": sections}, "steps": 2,
                      "seq_len": 16, "global_batch_size": 4, "lr": 1e-2,
                      "save": str(tmp_path / "run")})
    assert len(out["losses"]) == 2 and all(np.isfinite(out["losses"]))
    assert out["losses"][1] < out["losses"][0]


# ---------------------------------------------------------------- tp=2, pp=2: gloo ranks

PARALLEL_CFG = {"pattern": "M{a:Z}|M{a}", **SIZES}  # pp=2: both stages use the shared block
GQA_CFG = {**PARALLEL_CFG, "attention": {**SIZES["attention"], "n_kv_heads": 1}}
LAYOUTS = {"tp2": ({"tp": 2}, PARALLEL_CFG),  # kv heads split, sequence parallel
           "tp2_gqa": ({"tp": 2, "sequence_parallel": False}, GQA_CFG),  # kv heads replicated
           "pp2": ({"pp": 2}, PARALLEL_CFG)}


def _data() -> tuple:
    import numpy as np

    data = np.random.default_rng(0).integers(0, 61, (8, 16))
    docs = np.sort(np.random.default_rng(1).integers(0, 3, (8, 16)), axis=1)
    return data, docs


def _in_ranks(folder: str) -> dict:
    from composer.parallel.checkpoint import save_checkpoint
    from composer.parallel.mesh import ParallelConfig, build_parallel_dims
    from composer.run import build_sharded
    from tests.helpers import layout_case

    data, docs = _data()
    out = {name: layout_case(layout, cfg, data, fp64=True, doc_ids=docs)
           for name, (layout, cfg) in LAYOUTS.items()}
    dims = build_parallel_dims(ParallelConfig(pp=2))
    model = build_sharded(ModelConfig.from_dict(PARALLEL_CFG), dims, seed=7, dtype=F64)
    save_checkpoint(folder, 0, model)
    return out


@pytest.mark.slow
def test_tp2_pp2_equal_one_process_fp64(tmp_path) -> None:
    """The eval loss (packed documents too), every gradient and three AdamW steps, each pipeline
    rank's copies of the shared block and the embedding included (one spawn of two gloo
    ranks); the pp=2 checkpoint exports the single-process model's tensors, the shared block
    once (``shared.a.*``)."""
    from composer.cli import main
    from composer.parallel.launch import run_distributed
    from composer.parallel.mesh import ParallelConfig, build_parallel_dims
    from composer.run import build_sharded
    from tests.helpers import layout_case, read_all

    data, docs = _data()
    ranks = run_distributed(_in_ranks, 2, str(tmp_path / "run"))
    refs = {id(cfg): layout_case({}, cfg, data, fp64=True, doc_ids=docs)
            for cfg in (PARALLEL_CFG, GQA_CFG)}
    for name, (_, cfg) in LAYOUTS.items():
        ref = refs[id(cfg)]
        for rank in ranks:
            got = rank[name]
            for key in ("eval", "eval_packed"):
                assert abs(got[key] - ref[key]) < 1e-10, (name, key)
            assert max(abs(a - b) for a, b in zip(got["losses"], ref["losses"],
                                                  strict=True)) < 1e-10, name
            for part in ("grads", "params"):  # every copy a rank holds equals the one model's
                assert set(got[part]) <= set(ref[part]), (name, part)
                for k, v in got[part].items():
                    err = float((v - ref[part][k]).abs().max())
                    assert err < 1e-10, (name, part, k, err)
        held = {k for rank in ranks for k in rank[name]["params"]}
        assert held == set(ref["params"]), name
    # both pipeline ranks hold a copy of the shared block and of the embedding, nothing else
    pp = [set(rank["pp2"]["params"]) for rank in ranks]
    shared = {k for k in refs[id(PARALLEL_CFG)]["params"] if k.startswith("shared.a.")}
    assert pp[0] & pp[1] == shared | {"embed.weight"}
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "out")]) == 0
    exported = read_all(tmp_path / "out")
    one = build_sharded(ModelConfig.from_dict(PARALLEL_CFG), build_parallel_dims(ParallelConfig()),
                        seed=7, dtype=F64).state_dict()
    assert set(exported) == set(one)
    assert not any(".mixer.block." in k for k in exported)
    for k, v in one.items():
        assert (exported[k].to(F64) - v).abs().max() < 1e-12, k
